"""Engine throughput: tokens/s without speculation and at static steps 1, 3, 7, at batch 1 and 16,
on code, high-entropy and repetitive prompts; on CUDA also eager versus CUDA graphs and the torch
versus the flashinfer attention backend.

    python -m scripts.bench.engine [--device cpu|cuda] [--model DIR [--draft-model DIR]] [--out DIR]
        [--new-tokens N] [--variants torch/eager torch/graphs flashinfer/eager flashinfer/graphs]
        [--max-seconds S]

Writes `OUT/results.json` (one record per configuration, plus the run's settings) and
`OUT/engine_tps.png`. Tokens/s counts every generated token of the batch over the wall time of
`engine.generate` (prefill included; greedy, no stop token, so every request makes exactly
`--new-tokens` tokens). Each engine is built once per (variant, mode) and warmed up before timing;
the runtime-state pool's bytes per tier (buffers, and CUDA graphs with their memory pool) are
recorded with it. On CUDA the model runs in float16 (flashinfer's dtype), on CPU in float32.
"""
from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from scripts.bench.common import (KINDS, add_overlap_argument, build, encode_prompts,
                                  load_pair, make_prompts, overlap_of, pyplot, save,
                                  settle_heap, static_spec, sync, tokenizer, write_json)
from workers.engine import Engine
from workers.loading import DEFAULT_MODEL
from workers.sampling import SamplingParams

MODES = ("nospec", 1, 3, 7)
BATCHES = (1, 16)


# ---- engines -------------------------------------------------------------------------------------

def measure(engine: Engine, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens)
    rounds0, graph0 = engine.stats.rounds, engine.stats.graph_rounds
    sync(device)
    start = time.perf_counter()
    reqs = engine.generate(prompts, params)
    sync(device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in reqs)
    rounds = sum(r.spec_rounds for r in reqs)
    return {"tokens": tokens, "elapsed_s": elapsed, "tokens_per_second": tokens / elapsed,
            "rounds": engine.stats.rounds - rounds0,
            "graph_rounds": engine.stats.graph_rounds - graph0,
            "mean_accept_length": sum(r.accepted for r in reqs) / rounds if rounds else None}


def state_bytes(engine: Engine) -> dict[str, int]:
    """Bytes per tier of the runtime-state pool (buffers, graph inputs, graph-pool growth)."""
    return {str(s): st.nbytes for s, st in engine.pool.states.items()}


def graph_pool_bytes(engine: Engine) -> int:
    runner = engine.worker.graphs
    return runner.pool_bytes() if runner is not None else 0


# ---- run -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="target directory, or a directory with target/ and eagle/ (as generate)")
    p.add_argument("--draft-model", default=None, help="draft head directory (as generate)")
    p.add_argument("--out", default="runs/bench_engine", help="output directory")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens per request (default: 32 on cpu, 48 on cuda)")
    p.add_argument("--variants", nargs="+", default=None,
                   help="backend/path pairs (default: torch/eager on cpu; torch and flashinfer, "
                        "eager and graphs on cuda)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop starting new configurations after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    add_overlap_argument(p)
    return p.parse_args(argv)


def default_variants(device: str) -> list[str]:
    if device == "cpu":
        return ["torch/eager"]
    return ["torch/eager", "torch/graphs", "flashinfer/eager", "flashinfer/graphs"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny model: more threads only spin-wait (see tests/engine_fixtures.py)
    new_tokens = args.new_tokens or (32 if args.device == "cpu" else 48)
    variants = args.variants or default_variants(args.device)
    notes = []
    if any(v.startswith("flashinfer") for v in variants) and \
            importlib.util.find_spec("flashinfer") is None:
        variants = [v for v in variants if not v.startswith("flashinfer")]
        notes.append("flashinfer not importable: its variants were skipped")
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    target, head = load_pair(args.model, args.device, draft=args.draft_model, dtype=dtype)
    tok = tokenizer(args.model, args.draft_model, target.config.vocab_size)
    texts = make_prompts(max(BATCHES), args.seed)
    prompts = encode_prompts(texts, tok.encode)
    longest = max(len(p) for ps in prompts.values() for p in ps)
    max_context = -(-(longest + new_tokens + 1) // 64) * 64
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    jobs = []
    for variant in variants:
        backend, path = variant.split("/")
        for mode in MODES:
            jobs.append((variant, backend, path == "graphs", mode))
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    bar = tqdm(total=len(jobs) * len(KINDS) * len(BATCHES), desc="bench", unit="cfg")
    for variant, backend, graphs, mode in jobs:
        if args.max_seconds and time.perf_counter() - start > args.max_seconds:
            notes.append(f"stopped at {variant} mode {mode}: --max-seconds {args.max_seconds}")
            break
        t_build = time.perf_counter()
        engine = build(static_spec(mode), target, head, batch=max(BATCHES), context=max_context,
                       device=args.device, graphs=graphs, attention_backend=backend,
                       **overlap_of(args, args.device))
        build_s = time.perf_counter() - t_build
        for batch in BATCHES:  # warm-up: lazy kernel loading, allocator, every batch shape
            measure(engine, prompts["code"][:batch], 8, args.device)
        settle_heap()
        memory = {"runtime_state_bytes": state_bytes(engine),
                  "graph_pool_bytes": graph_pool_bytes(engine)}
        for kind in KINDS:
            for batch in BATCHES:
                rec = measure(engine, prompts[kind][:batch], new_tokens, args.device)
                rec.update(variant=variant, backend=backend, graphs=graphs, mode=str(mode),
                           batch=batch, prompts=kind, engine_build_s=build_s,
                           **memory)
                results.append(rec)
                bar.set_postfix_str(f"{variant} {mode} {kind} b{batch}: "
                                    f"{rec['tokens_per_second']:.0f} tok/s")
                bar.update()
        engine.close()
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    meta = {"device": args.device, "device_name": torch.cuda.get_device_name()
            if args.device == "cuda" else platform.processor() or platform.machine(),
            "torch": torch.__version__, "model": str(args.model),
            "draft_model": args.draft_model, "dtype": str(dtype),
            "new_tokens": new_tokens, "overlap": bool(overlap_of(args, args.device)),
            "batches": list(BATCHES), "modes": [str(m) for m in MODES],
            "threads": torch.get_num_threads(), "command": " ".join(sys.argv),
            "wall_s": time.perf_counter() - start, "notes": notes}
    write_json(out_dir / "results.json", {"meta": meta, "results": results})
    plot(results, meta, out_dir / "engine_tps.png")
    print(summary_table(results))
    print(f"wrote {out_dir / 'results.json'} and {out_dir / 'engine_tps.png'}")
    return 0


def summary_table(results: list[dict]) -> str:
    lines = [f"{'variant':<18}{'mode':<8}{'prompts':<14}{'batch':>6}{'tok/s':>10}{'accept':>8}"
             f"{'graph rounds':>14}"]
    for r in results:
        acc = "-" if r["mean_accept_length"] is None else f"{r['mean_accept_length']:.2f}"
        lines.append(f"{r['variant']:<18}{r['mode']:<8}{r['prompts']:<14}{r['batch']:>6}"
                     f"{r['tokens_per_second']:>10.1f}{acc:>8}{r['graph_rounds']:>8}/{r['rounds']}")
    return "\n".join(lines)


def plot(results: list[dict], meta: dict, path: Path) -> None:
    plt = pyplot()
    variants = sorted({r["variant"] for r in results}, key=lambda v: (v.split("/")[0], v))
    modes = [m for m in meta["modes"] if any(r["mode"] == m for r in results)]
    fig, axes = plt.subplots(len(BATCHES), len(KINDS), figsize=(5 * len(KINDS), 3.6 * len(BATCHES)),
                             squeeze=False)
    width = 0.8 / max(len(variants), 1)
    for i, batch in enumerate(BATCHES):
        for j, kind in enumerate(KINDS):
            ax = axes[i][j]
            for k, variant in enumerate(variants):
                xs, ys = [], []
                for x, mode in enumerate(modes):
                    hit = [r for r in results if (r["variant"], r["mode"], r["batch"],
                                                  r["prompts"]) == (variant, mode, batch, kind)]
                    if hit:
                        xs.append(x + (k - (len(variants) - 1) / 2) * width)
                        ys.append(hit[0]["tokens_per_second"])
                ax.bar(xs, ys, width, label=variant)
            ax.set_xticks(range(len(modes)), ["no spec" if m == "nospec" else f"steps {m}"
                                              for m in modes])
            ax.set_title(f"{kind}, batch {batch}")
            ax.set_ylabel("tokens/s")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"engine throughput ({meta['device_name']}, {meta['dtype']}, "
                 f"{meta['new_tokens']} new tokens per request)")
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
