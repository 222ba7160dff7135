"""The fused MoE layer (``workers.moe_kernels``) against the floor its weights set: one
Qwen3-30B-A3B-shaped sparse MLP (d 2048, 128 experts of width 768, top 8, bfloat16, random
weights), routed rows N = 1 ... 512 (a decode round of batch B at depth S routes B·(S+1) rows).

    python -m scripts.bench.moe_layer --out OUT

Per N: the median time of the fused path (routing included) over interleaved repeats, the
experts the rows hit, and the floor = the bytes of those experts' weights (3 · F · d · 2 each)
over the GPU's memory bandwidth (`--bandwidth`, default the H200's 4.8 TB/s): the time reading
the weights alone would take. Writes OUT/moe_layer.json and OUT/moe_layer.png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from scripts.bench.common import gpu_name, pyplot, save, write_json


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s of the GPU's memory")
    p.add_argument("--out", default="runs/moe_layer")
    return p.parse_args()


def block(device: str):
    from workers.model.config import LlamaConfig, MoeSpec
    from workers.model.moe import MoeBlock
    from workers.model.parallel import ModelParallel

    cfg = LlamaConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4,
                      explicit_head_dim=128, architecture="Qwen3MoeForCausalLM",
                      moe=MoeSpec(num_experts=128, top_k=8, expert_size=768, norm_topk_prob=True))
    with torch.device("meta"):
        moe = MoeBlock(cfg, ModelParallel.single(device))
    moe.to_empty(device=device)
    moe.to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device).mul_(0.02))
    return moe


def time_rows(moe, x: torch.Tensor, iters: int) -> float:
    """Milliseconds per call of the block's fused path (routing, kernels, the sum)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        ids, weights = moe.route(x)
        moe.fused(x, ids, weights)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            ids, weights = moe.route(x)
            moe.fused(x, ids, weights)
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_layer: needs a CUDA GPU")
    moe = block("cuda")
    d, f = 2048, 768
    xs = {n: torch.randn(n, d, device="cuda", dtype=torch.bfloat16) for n in args.rows}
    samples: dict[int, list[float]] = {n: [] for n in args.rows}
    for r in range(args.repeats):          # interleaved: every N once per repeat
        for n in args.rows:
            samples[n].append(time_rows(moe, xs[n], args.iters))
        print(f"[moe_layer] repeat {r + 1}/{args.repeats} done", flush=True)
    rows = []
    for n in args.rows:
        with torch.no_grad():
            hit = int(moe.route(xs[n])[0].unique().numel())
        floor_ms = 1000 * hit * 3 * f * d * 2 / args.bandwidth
        ts = sorted(samples[n])
        med = ts[len(ts) // 2]
        rows.append({"rows": n, "experts_hit": hit, "median_ms": med, "min_ms": ts[0],
                     "max_ms": ts[-1], "floor_ms": floor_ms, "over_floor": med / floor_ms})
        print(f"rows {n:>4}: {med * 1000:8.1f} us (spread {ts[0] * 1000:.1f}-{ts[-1] * 1000:.1f}), "
              f"{hit:>3} experts hit, weight floor {floor_ms * 1000:6.1f} us, x{med / floor_ms:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": gpu_name("cuda"), "torch": torch.__version__, "shape": "Qwen3-30B-A3B sparse MLP",
              "bandwidth_bytes_per_s": args.bandwidth, "iters": args.iters,
              "repeats": args.repeats, "rows": rows, "command": " ".join(sys.argv)}
    write_json(out / "moe_layer.json", result)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [r["rows"] for r in rows]
    ax.plot(ns, [1000 * r["median_ms"] for r in rows], "o-", label="fused MoE (median)")
    ax.plot(ns, [1000 * r["floor_ms"] for r in rows], "s--", label="weights / bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("routed rows")
    ax.set_ylabel("us per layer")
    ax.set_title("Qwen3-30B-A3B MoE layer, bf16")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, out / "moe_layer.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
