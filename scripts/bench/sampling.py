"""Sampled requests: the counter-based uniforms in torch operations against the fused kernel.

    python -m scripts.bench.sampling [--device cuda] [--steps 3] [--batches 1 16 64]
        [--requests 4 64] [--repeats 5] [--out DIR]

A sampled round draws uniforms (`workers.spec_decode.uniforms`) in every draft step and three
times in verify; in torch operations each draw is about 60 small kernels, on a GPU one Triton
kernel does the same integer arithmetic (`workers.kernels.uniforms`, bit-identical). Two engines
at a static depth (`--steps`) on the same weights: `torch_uniforms` captures its graphs with the
torch hash, `fused_uniforms` with the kernel (what the engine runs on a GPU). Per engine,
interleaved over the repeats:
- the draft and verify phases' sampling CUDA graphs at each bucket (`--batches`), replayed
  `--iters` times back to back over dummy rows reading `--context` cached positions (device time
  from CUDA events; on a CPU there are no graphs and these are skipped);
- `--requests` sampled requests generated to completion (temperature 0.8, top-p 0.9,
  `--new-tokens` each, the same seeds for both engines): tokens per second, and whether both
  engines sampled the same tokens (they must: the uniforms are bit-identical).
Writes `OUT/results.json` (medians, min and max per measure, and every sample) and
`OUT/sampling.png`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import workers.spec_decode as spec_decode
from scripts.bench.common import (build, gpu_name, load_pair, pyplot, random_pair, save, spread,
                                  static_spec, timer, write_json)
from workers.engine import Engine
from workers.loading import DEFAULT_MODEL
from workers.sampling import SamplingParams

FUSED = spec_decode.uniforms


def torch_uniforms(seed: torch.Tensor, counter: torch.Tensor, salt: int, n: int) -> torch.Tensor:
    """The uniforms in torch operations only (what every device ran before the kernel)."""
    return spec_decode._draw(spec_decode._row_key(seed, counter), salt, n)


VARIANTS: dict[str, Callable[..., torch.Tensor]] = {"torch_uniforms": torch_uniforms,
                                                     "fused_uniforms": FUSED}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--shape", choices=("bundled", "tiny"), default="bundled",
                   help="the bundled pair, or a small random pair (a smoke test)")
    p.add_argument("--steps", type=int, default=3, help="the engines' static depth (>= 1)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64],
                   help="graph buckets whose sampling phases are timed")
    p.add_argument("--requests", nargs="+", type=int, default=[4, 64],
                   help="sampled requests per generation run")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--context", type=int, default=256,
                   help="cached positions each dummy row's attention reads")
    p.add_argument("--iters", type=int, default=50, help="graph replays per sample")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="runs/bench_sampling")
    args = p.parse_args()
    for name in ("steps", "new_tokens", "context", "iters", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if min(args.batches) < 1 or min(args.requests) < 1:
        p.error("--batches and --requests take integers >= 1")
    return args


def build_pair(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    if args.shape == "tiny":
        return random_pair("tiny", "eagle", args.device)
    return load_pair(args.model, args.device, half=args.device == "cuda")


def prompts(n: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % vocab for j in range(16 + i % 17)] for i in range(n)]


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else 4)
    target, head = build_pair(args)
    vocab = min(target.config.vocab_size, 250)
    spec = static_spec(args.steps).replace(graph_buckets=tuple(sorted(set(args.batches))))
    longest = max(len(p) for p in prompts(max(args.requests), vocab))
    context = max(args.context, longest + args.new_tokens) + 64
    engines: dict[str, Engine] = {}
    for name, fn in VARIANTS.items():
        spec_decode.uniforms = fn     # the graphs capture whichever is in force
        try:
            engine = build(spec, target, head, batch=max(max(args.batches), max(args.requests)),
                           context=context, device=args.device, graphs=args.device == "cuda",
                           overlap=args.device == "cuda")
            engine.warmup()
        finally:
            spec_decode.uniforms = FUSED
        engines[name] = engine
    clock = timer(args.device)
    samples: dict[str, list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    from tqdm import tqdm

    bar = tqdm(total=args.repeats * len(engines), desc="bench_sampling", unit="run")
    with torch.inference_mode():
        for rep in range(args.repeats):
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]   # interleaved
            for name in order:
                engine = engines[name]
                spec_decode.uniforms = VARIANTS[name]   # eager paths (CPU) draw with it too
                try:
                    time_phases(engine, args, clock, name, samples)
                    for n in args.requests:
                        params = [SamplingParams(temperature=0.8, top_p=0.9,
                                                 max_new_tokens=args.new_tokens)] * n
                        start = time.perf_counter()
                        reqs = engine.generate(prompts(n, vocab), params, seed=rep)
                        if args.device == "cuda":
                            torch.cuda.synchronize()
                        elapsed = time.perf_counter() - start
                        out = [r.output_ids for r in reqs]
                        samples.setdefault(f"{name}/generate x{n}", []).append(
                            sum(map(len, out)) / elapsed)
                        tokens.setdefault(f"x{n} seed {rep}", []).append(
                            [t for ids in out for t in ids])
                finally:
                    spec_decode.uniforms = FUSED
                bar.update()
    bar.close()
    for engine in engines.values():
        engine.close()
    same = all(all(v == runs[0] for v in runs) for runs in tokens.values())
    write(args, samples, same)
    return 0 if same else 1


def time_phases(engine: Engine, args: argparse.Namespace, clock: Callable, name: str,
                samples: dict[str, list[float]]) -> None:
    """The sampling draft and acceptance graphs at each bucket, over dummy rows
    (microseconds)."""
    from workers.worker.graph_table import GraphKey, GraphPhase

    worker = engine.worker
    bufs = worker.state.payload
    if worker.table is None:
        return
    for bucket in args.batches:
        graphs = [(phase, worker.table.get(GraphKey(
            phase, batch=bucket, steps=bufs.steps, greedy=False)))
            for phase in (GraphPhase.DRAFT, GraphPhase.ACCEPT)]
        if any(g is None for _, g in graphs):
            continue
        bufs.rows[:bucket].fill_(worker.slots.dummy)
        worker.slots.set_dummy_length(args.context)
        for phase, graph in graphs:
            samples.setdefault(f"{name}/{phase} b{bucket}", []).append(
                clock(graph.replay, args.iters) * 1e6)
        worker.slots.set_dummy_length(0)


def write(args: argparse.Namespace, samples: dict[str, list[float]], same: bool) -> None:
    out = Path(args.out)
    results: dict[str, Any] = {k: spread(v) for k, v in samples.items()}
    meta = {"device": args.device, "torch": torch.__version__, "shape": args.shape,
            "gpu": gpu_name(args.device),
            "steps": args.steps, "context": args.context, "iters": args.iters,
            "repeats": args.repeats, "new_tokens": args.new_tokens,
            "units": {"draft/accept": "microseconds per graph replay",
                      "generate": "tokens per second"},
            "same_tokens": same, "command": " ".join(sys.argv)}
    write_json(out / "results.json", {"meta": meta, "results": results, "samples": samples})
    measures = sorted({k.split("/", 1)[1] for k in results})
    for measure in measures:
        base = results.get(f"torch_uniforms/{measure}")
        new = results.get(f"fused_uniforms/{measure}")
        if base and new:
            print(f"   {measure:<16} torch {base['median']:10.1f}   fused {new['median']:10.1f}"
                  f"   x{new['median'] / base['median']:.3f}")
    print(f"same sampled tokens with either: {same}")
    plot(results, measures, out / "sampling.png")
    print(f"wrote {out / 'results.json'}")


def plot(results: dict[str, Any], measures: list[str], path: Path) -> None:
    plt = pyplot()
    groups = [("phase graph replay (us)", [m for m in measures if not m.startswith("generate")]),
              ("sampled generation (tokens/s)", [m for m in measures if m.startswith("generate")])]
    groups = [g for g in groups if g[1]]
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, (title, keys) in zip(axes[0], groups):
        for i, name in enumerate(VARIANTS):
            rows = [results[f"{name}/{k}"] for k in keys]
            xs = [j + (i - 0.5) * 0.4 for j in range(len(keys))]
            ax.bar(xs, [r["median"] for r in rows], width=0.4, label=name,
                   yerr=[[r["median"] - r["min"] for r in rows],
                         [r["max"] - r["median"] for r in rows]], capsize=2)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(keys, rotation=30, fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
