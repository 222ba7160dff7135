"""The fused MoE layer (``workers.moe_kernels``) and the depth-0 round against the floor their
weights set, on one GPU, CUDA-graph replayed (the eager figure is the host launching ~25 ops).

    python -m scripts.bench.moe_layer --out OUT     # 48 s on one H200 (every way, the round)
    python -m scripts.bench.moe_layer --ways graph graph_grouped --rows 1 2 4 8 16 --out OUT
    python -m scripts.bench.moe_layer --ways align_kernel align_multi align_torch \
        --rows 32 128 256 512 --no-round --out OUT     # the alignment alone, 256 .. 4096 pairs

One H200's run: `docs/data/runs/moe_layer_h200_2026-12-03/`, read in `docs/results.md`, "MoE rounds
against their weight floor".

1. The layer: one Qwen3-30B-A3B-shaped sparse MLP (d 2048, 128 experts of width 768, top 8,
   bfloat16, random weights), routed rows N = 1, 2, 4 ... 512 (a decode round of batch B at
   depth S routes B·(S+1) rows), random inputs (the router spreads them as traffic: at 64 rows
   about 125 of the 128 experts). Per N, medians over interleaved repeats of `--iters` graph
   replays: the whole layer as it runs (routing, then at most `PAIR_PATH_PAIRS` pairs the pair
   path, else the alignment, the two grouped kernels, the sum), the whole layer with the grouped
   GEMMs at every N, the two grouped kernels alone (their alignment computed once), the
   alignment alone every way (one Triton program, `align_multi`'s three launches of many
   programs, the torch ops; each at every N, whatever `align` picks there), and the eager
   layer; the experts the rows hit
   and the floor = the bytes of those experts' weights (3 · F · d · 2 each) over `--bandwidth`
   (default 3.25 TB/s, what a cuBLAS GEMV chain reaches on an H200).
2. The round (`--round-batches`, default 1 8 64; `--no-round` skips it): the Qwen3-30B-A3B-shaped
   target alone (no head), depth 0, its captured round (the verify forward and the acceptance)
   replayed over the start-up measurement's rows (`TrafficRows`: varied tokens, caches of
   `--context` positions); its floor = every weight it reads (attention, norms, routers, the LM
   head, the embedding rows of the batch, the experts each layer's rows hit, counted in one eager
   round over the same rows) over the bandwidth. The KV it reads is left out of the floor (about
   0.1 GB per 1024 positions and row: batch 64 at 1024 reads 6.4 GB more).

`--profile` also runs torch.profiler over each round's replays: kernels per round and their device
time by kind (MoE, attention, norms and RoPE, GEMMs, other), the sum against the round's time
(the difference: gaps between kernels). Per decoder layer and part (each kernel labelled by the
code that launched it), and the verify forward at depths 1/3/7: `scripts.diag.layer_kernels
--device cuda`. `--ways` times some of the layer's ways only (each alone in its own process, under
`CUDA_LAUNCH_BLOCKING=1`, pinpoints a fault). Writes OUT/moe_layer.json and OUT/moe_layer.png
(after the layer part, and again with the round), and in the JSON's `choices` the rows whose
figures argue against `PAIR_PATH_PAIRS` / `ALIGN_KERNEL_PAIRS`. `--tiny`: a smoke test of this script on the
CPU (the tiny-moe shape, triton's interpreter, no graphs, wall-clock timing; the numbers mean
nothing).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from scripts.bench.common import gpu_name, pyplot, save, write_json

D, F, E, TOP_K = 2048, 768, 128, 8      # Qwen3-30B-A3B's (--tiny: the tiny-moe shape's)
SHAPE, DEVICE = "qwen3-30b-a3b", "cuda"
WAYS = ("graph", "graph_grouped", "kernels", "align_kernel", "align_multi", "align_torch",
        "eager")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[2 ** i for i in range(10)])
    p.add_argument("--iters", type=int, default=50, help="graph replays per sample")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bandwidth", type=float, default=3.25e12, help="bytes/s of the GPU's memory")
    p.add_argument("--round-batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--no-round", action="store_true", help="time the layer only")
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS),
                   help="the layer's ways to capture and time (one alone, in its own process "
                        "with CUDA_LAUNCH_BLOCKING=1, pinpoints a fault)")
    p.add_argument("--profile", action="store_true",
                   help="also profile each round's replays (torch.profiler): its kernels per "
                        "round and their device time, by kind (where the round's time goes)")
    p.add_argument("--tiny", action="store_true", help="a CPU smoke test of this script")
    p.add_argument("--out", default="runs/moe_layer")
    return p.parse_args()


def block(device: str):
    from workers.model.config import LlamaConfig, MoeSpec
    from workers.model.moe import MoeBlock
    from workers.model.parallel import ModelParallel

    cfg = LlamaConfig(vocab_size=151936, hidden_size=D, intermediate_size=3 * D,
                      num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4,
                      explicit_head_dim=128, architecture="Qwen3MoeForCausalLM",
                      moe=MoeSpec(num_experts=E, top_k=TOP_K, expert_size=F, norm_topk_prob=True))
    with torch.device("meta"):
        moe = MoeBlock(cfg, ModelParallel.single(device))
    moe.to_empty(device=device)
    moe.to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device).mul_(0.02))
    return moe


def graphed(fn: Callable[[], Any]) -> Callable[[], None]:
    """`fn` captured in a CUDA graph (after a warm-up on a side stream); returns its replay
    (on the CPU: `fn` itself). The replay holds `fn`: the graph reads and writes, at the addresses
    of the capture, the tensors `fn`'s closure holds (`kernels_only`'s alignment, hidden rows and
    output; the routing a lambda takes as a default), and a bare `graph.replay` let them go — the
    next capture's `empty_cache` returned their memory to the driver, and the first replay of
    `kernels` at 1 row died with an illegal memory access (issue 36)."""
    if DEVICE == "cpu":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay() -> None:
        graph.replay()
    replay.keeps = fn            # type: ignore[attr-defined]  (see the docstring)
    return replay


def clock(fn: Callable[[], Any], iters: int) -> float:
    """Milliseconds per call of `fn` over `iters` back-to-back calls (CUDA events)."""
    if DEVICE == "cpu":
        fn()
        begun = time.perf_counter()
        for _ in range(iters):
            fn()
        return 1000 * (time.perf_counter() - begun) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernels_only(moe, x: torch.Tensor) -> Callable[[], None]:
    """The two grouped GEMMs of `moe_kernels.fused_moe` over `x`'s routing, aligned once."""
    from workers import moe_kernels as mk

    ids, weights = moe.route(x)
    w13 = moe.gate_up.stacked.view(E, 2 * F, -1)
    w2 = moe.down.stacked
    rows, block_expert = mk.align(ids, E)
    blocks, pairs = rows.numel() // mk.BLOCK_M, ids.numel()
    hidden = torch.empty(rows.numel(), F, dtype=x.dtype, device=x.device)
    out = torch.zeros(pairs, D, dtype=x.dtype, device=x.device)
    flat = weights.reshape(-1).contiguous()
    k = mk._kernels()

    def run() -> None:
        k.gate_up[(blocks, -(-F // mk.BLOCK_N))](
            x, rows, block_expert, w13, hidden, pairs, TOP_K, E, D, F, x.stride(0),
            w13.stride(0), w13.stride(1), BLOCK_M=mk.BLOCK_M, BLOCK_N=mk.BLOCK_N,
            BLOCK_K=mk.BLOCK_K, IEEE=False)
        k.down[(blocks, -(-D // mk.BLOCK_N))](
            hidden, rows, block_expert, w2, flat, out, pairs, E, D, F, w2.stride(0),
            w2.stride(1), BLOCK_M=mk.BLOCK_M, BLOCK_N=mk.BLOCK_N, BLOCK_K=mk.BLOCK_K,
            IEEE=False)
    return run


def layer_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from workers import moe_kernels as mk

    moe = block(DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    xs = {n: torch.randn(n, D, device=DEVICE, generator=gen).to(torch.bfloat16)
          for n in args.rows}
    calls: dict[int, dict[str, Callable[[], None]]] = {}
    with torch.inference_mode():
        for n in args.rows:
            x = xs[n]

            def layer(x: torch.Tensor = x) -> torch.Tensor:
                ids, weights = moe.route(x)
                return moe.fused(x, ids, weights)
            def grouped(x: torch.Tensor = x) -> torch.Tensor:
                saved = mk.PAIR_PATH_PAIRS
                mk.PAIR_PATH_PAIRS = 0      # the grouped GEMMs at every N (a graph keeps them)
                try:
                    return layer(x)
                finally:
                    mk.PAIR_PATH_PAIRS = saved
            ids = moe.route(x)[0]
            make = {"graph": lambda: graphed(layer), "graph_grouped": lambda: graphed(grouped),
                    "kernels": lambda: graphed(kernels_only(moe, x)),
                    "align_kernel": lambda: graphed(lambda ids=ids: mk.align_kernel(ids, E)),
                    "align_multi": lambda: graphed(lambda ids=ids: mk.align_multi(ids, E)),
                    "align_torch": lambda: graphed(lambda ids=ids: mk.align_torch(ids, E)),
                    "eager": lambda: layer}
            calls[n] = {way: make[way]() for way in args.ways}
        samples: dict[tuple[int, str], list[float]] = {}
        for r in range(args.repeats):          # interleaved: every N and way once per repeat
            for n in args.rows:
                for way, fn in calls[n].items():
                    samples.setdefault((n, way), []).append(clock(fn, args.iters))
            print(f"[moe_layer] repeat {r + 1}/{args.repeats} done", flush=True)
        out = []
        for n in args.rows:
            hit = int(moe.route(xs[n])[0].unique().numel())
            floor_ms = 1000 * hit * 3 * F * D * 2 / args.bandwidth
            row = {"rows": n, "experts_hit": hit, "floor_ms": floor_ms}
            row["path"] = "pairs" if n * TOP_K <= mk.PAIR_PATH_PAIRS else "grouped"
            for way in args.ways:
                ts = sorted(samples[(n, way)])
                row[f"{way}_ms"] = statistics.median(ts)
                row[f"{way}_spread_ms"] = [ts[0], ts[-1]]
                row[f"{way}_over_floor"] = row[f"{way}_ms"] / floor_ms
            out.append(row)
            times = ", ".join(f"{way} {row[f'{way}_ms'] * 1e3:.1f} us "
                              f"(x{row[f'{way}_over_floor']:.2f})" for way in args.ways)
            print(f"rows {n:>4} ({row['path']}; {hit:>3} experts hit, floor "
                  f"{floor_ms * 1e3:6.1f} us): {times}", flush=True)
    del moe, calls
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


KINDS = (("moe", ("pair_gate_up", "pair_down", "gate_up_kernel", "down_kernel", "align_kernel",
                   "align_count", "align_scan", "align_scatter", "route_kernel",
                   "combine_kernel")),   # combine: the sum, the next add + norm
         ("attention", ("padded_attention", "store_kv", "tree_attention")),
         ("norm_rope", ("rms_norm", "rope", "silu_mul")),
         ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas", "splitk", "aten::mm",
                   "aten::addmm", "aten::linear")))


def kind_of(name: str) -> str:
    """The part of a round a kernel (an operator on the CPU) belongs to, by its name."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profile_round(body: Callable[[], Any], replays: int) -> dict[str, Any]:
    """torch.profiler over `replays` calls of a round's `body` (on a GPU its graph replays: the
    kernels inside them, as CUPTI reports them; on the CPU the operators, CPU time): per round, the
    kernels and their device time, by kind (`KINDS`) and the costliest 20 by name. A GPU round
    with no kernel reported (a profiler that does not see into graphs) says so: 0 kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"
    body()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(replays):
            body()
        if cuda:
            torch.cuda.synchronize()
    rows = [(e.key, e.count / replays,
             (e.device_time_total if cuda else e.self_cpu_time_total) / replays / 1000)
            for e in prof.key_averages()]
    rows = [r for r in rows if r[2] > 0]
    by_kind: dict[str, list[float]] = {}
    for name, count, ms in rows:
        acc = by_kind.setdefault(kind_of(name), [0.0, 0.0])
        acc[0] += count
        acc[1] += ms
    rows.sort(key=lambda r: -r[2])
    return {"kernels_per_round": sum(r[1] for r in rows), "kernel_ms": sum(r[2] for r in rows),
            "by_kind": by_kind, "top": [list(r) for r in rows[:20]], "replays": replays,
            "what": "kernels (GPU, device time)" if cuda else "operators (CPU time)"}


def round_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The depth-0 round of the Qwen3-30B-A3B-shaped target (no head) at each batch, graph
    replayed over the measurement's rows, against its weight floor."""
    from scripts.bench.common import build, random_pair, static_spec
    from workers.model import ModelParallel
    from workers.model.moe import MoeBlock
    from workers.worker.round_cost import TrafficRows, measurement_routing

    target, _ = random_pair(SHAPE, "eagle3", DEVICE, par=ModelParallel.single(DEVICE), seed=1234)
    target.reset_buffers()
    target.eval()
    batches = sorted(args.round_batches)
    engine = build(static_spec(0).replace(graph_buckets=tuple(batches)), target, None,
                   batch=max(batches), context=args.context + args.iters + 8, device=DEVICE,
                   graphs=DEVICE == "cuda")
    worker = engine.worker
    blocks = [m for m in target.modules() if isinstance(m, MoeBlock)]
    expert_bytes = 3 * F * D * 2
    every = sum(p.numel() * p.element_size() for p in target.parameters())
    experts_all = sum(b.gate_up.stacked.numel() * b.gate_up.stacked.element_size()
                      + b.down.stacked.numel() * b.down.stacked.element_size() for b in blocks)
    embed = target.model.embed_tokens.weight
    row_bytes = embed.shape[1] * embed.element_size()
    out = []
    for batch in batches:
        hits = measurement_routing(worker, batch, args.context)
        with torch.inference_mode():
            body = worker.round_body(batch)
        samples = []
        with TrafficRows(worker, batch, args.context, chain=args.iters + 1) as rows:
            for _ in range(args.repeats):
                rows.start()
                worker.buffers.rows[:batch] = torch.arange(batch, device=DEVICE)
                worker.buffers.budget[:batch] = 0
                with torch.inference_mode():
                    samples.append(clock(body, args.iters))
            if args.profile:
                rows.start()
                worker.buffers.rows[:batch] = torch.arange(batch, device=DEVICE)
                worker.buffers.budget[:batch] = 0
                with torch.inference_mode():
                    profiled = profile_round(body, replays=5)
        floor_bytes = (every - experts_all - embed.numel() * embed.element_size()
                       + batch * row_bytes + sum(hits) * expert_bytes)
        floor_ms = 1000 * floor_bytes / args.bandwidth
        med = statistics.median(samples)
        out.append({"batch": batch, "round_ms": med, "spread_ms": [min(samples), max(samples)],
                    "floor_ms": floor_ms, "over_floor": med / floor_ms,
                    "floor_gb": floor_bytes / 1e9, "experts_per_layer_mean": sum(hits) / len(hits),
                    "context": args.context})
        print(f"round batch {batch:>3}: {med:6.2f} ms (graph replay, depth 0, no head), floor "
              f"{floor_ms:5.2f} ms ({floor_bytes / 1e9:.2f} GB: {sum(hits) / len(hits):.1f} "
              f"experts per layer), x{med / floor_ms:.2f}", flush=True)
        if args.profile:
            out[-1]["profile"] = profiled
            kinds = ", ".join(f"{k} {n:.0f} kernels {ms:.3f} ms"
                              for k, (n, ms) in profiled["by_kind"].items())
            print(f"  profiled: {profiled['kernels_per_round']:.0f} kernels per round, "
                  f"{profiled['kernel_ms']:.3f} ms of kernel time (the rest of the round's time: "
                  f"gaps between them); {kinds}", flush=True)
    engine.close()
    return out


def main() -> int:
    global D, F, E, TOP_K, SHAPE, DEVICE
    args = parse_args()
    if args.tiny:   # the tiny-moe shape (scripts.gen.make_checkpoint) on the CPU
        os.environ["TRITON_INTERPRET"] = "1"
        D, F, E, TOP_K, SHAPE, DEVICE = 64, 32, 8, 2, "tiny-moe", "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("moe_layer: needs a CUDA GPU (or --tiny)")
    t0 = time.perf_counter()
    layer = layer_rows(args)
    print(f"[moe_layer] {choices(layer)}", flush=True)
    report(args, layer, [], t0)      # the layer's figures stay if the round part fails
    if not args.no_round:
        report(args, layer, round_rows(args), t0)
    return 0


def choices(layer: list[dict[str, Any]]) -> dict[str, Any]:
    """What the figures say of `moe_kernels`' two shape thresholds: the rows where the pair path
    runs (at most `PAIR_PATH_PAIRS` pairs) and the layer with the grouped GEMMs was faster, and
    the rows where the one-program alignment runs (at most `ALIGN_KERNEL_PAIRS` pairs) and the
    torch ops were faster, and where the multi-program alignment beat the one it would replace
    there (the one program up to `ALIGN_KERNEL_PAIRS` pairs, the torch ops past it) (medians;
    see each row's spread before acting on a close call)."""
    from workers import moe_kernels as mk

    return {"PAIR_PATH_PAIRS": mk.PAIR_PATH_PAIRS, "ALIGN_KERNEL_PAIRS": mk.ALIGN_KERNEL_PAIRS,
            "pair_path_slower_at_rows": [r["rows"] for r in layer if r["path"] == "pairs"
                                         and r.get("graph_ms", 0) > r.get("graph_grouped_ms",
                                                                          float("inf"))],
            "align_kernel_slower_at_rows": [
                r["rows"] for r in layer if r["rows"] * TOP_K <= mk.ALIGN_KERNEL_PAIRS
                and r.get("align_kernel_ms", 0) > r.get("align_torch_ms", float("inf"))],
            "align_multi_faster_than_one_program_at_rows": [
                r["rows"] for r in layer if r["rows"] * TOP_K <= mk.ALIGN_KERNEL_PAIRS
                and r.get("align_multi_ms", float("inf")) < r.get("align_kernel_ms", 0)],
            "align_multi_slower_than_torch_at_rows": [
                r["rows"] for r in layer if r["rows"] * TOP_K > mk.ALIGN_KERNEL_PAIRS
                and r.get("align_multi_ms", 0) > r.get("align_torch_ms", float("inf"))]}


def report(args: argparse.Namespace, layer: list[dict[str, Any]], rounds: list[dict[str, Any]],
           t0: float) -> None:
    """OUT/moe_layer.json and OUT/moe_layer.png (the round's panel when there are rounds)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": gpu_name(DEVICE) if DEVICE == "cuda" else None, "torch": torch.__version__,
              "shape": f"{SHAPE} sparse MLP (d {D}, {E} experts of {F}, top {TOP_K}), bf16",
              "bandwidth_bytes_per_s": args.bandwidth, "iters": args.iters,
              "repeats": args.repeats, "rows": layer, "rounds": rounds,
              "choices": choices(layer), "seconds": time.perf_counter() - t0,
              "command": " ".join(sys.argv)}
    write_json(out / "moe_layer.json", result)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 if rounds else 1, figsize=(11 if rounds else 6, 4))
    ax = axes[0] if rounds else axes
    ns = [r["rows"] for r in layer]
    for key, style, label in (("graph_ms", "o-", "layer, graph replay"),
                              ("graph_grouped_ms", "v-", "layer, grouped GEMMs at every N"),
                              ("kernels_ms", "^-", "the two grouped kernels alone"),
                              ("eager_ms", "x:", "layer, eager"),
                              ("align_kernel_ms", "d:", "alignment, one Triton program"),
                              ("align_multi_ms", "*:", "alignment, three multi-program launches"),
                              ("align_torch_ms", "+:", "alignment, torch ops"),
                              ("floor_ms", "s--", "experts hit / bandwidth")):
        if key in layer[0]:
            ax.plot(ns, [1000 * r[key] for r in layer], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("routed rows")
    ax.set_ylabel("us per layer")
    ax.set_title("Qwen3-30B-A3B MoE layer, bf16")
    ax.grid(alpha=0.3)
    ax.legend()
    if rounds:
        bs = [r["batch"] for r in rounds]
        axes[1].plot(bs, [r["round_ms"] for r in rounds], "o-", label="depth-0 round (graph)")
        axes[1].plot(bs, [r["floor_ms"] for r in rounds], "s--", label="weights read / bandwidth")
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("batch")
        axes[1].set_ylabel("ms per round")
        axes[1].set_title(f"Qwen3-30B-A3B-shaped target, context {args.context}")
        axes[1].grid(alpha=0.3)
        axes[1].legend()
    save(fig, out / "moe_layer.png")


if __name__ == "__main__":
    sys.exit(main())
