"""Where the padded prefill's device time goes, against a decode round: a diagnostic.

    python -m scripts.diag.profile_prefill [--device cuda] [--batches 1 64] [--out DIR]

For an engine without a head and one keeping a head at depth 0 (`scripts.bench.depth0`'s engines, the
bundled pair in half precision on a GPU), per bucket: the graph replay time of the padded prefill
(`bucket` rows of `--width` slots, full-length dummy prompts; greedy and sampling graphs) and of
a depth-0 round (CUDA events over `--iters` replays), and `torch.profiler`'s kernels of the same
bodies run eagerly (kernels per call, kernel time per call, the costliest kernels). On a CPU the
profile lists operators' CPU time and there are no graphs. Writes `OUT/results.json` and
`OUT/prefill.png`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from scripts.bench.common import (bodies, depth0_engines, gpu_name, load_pair, pyplot, save, timer,
                                  write_json)
from workers.loading import DEFAULT_MODEL


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--width", type=int, default=64, help="token slots per prefill row")
    p.add_argument("--context", type=int, default=256,
                   help="cached positions each dummy row of the round reads")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--top", type=int, default=12, help="kernels listed per profile")
    p.add_argument("--out", default="runs/profile_prefill")
    args = p.parse_args()
    if min(args.batches) < 1 or min(args.width, args.iters, args.top, args.context) < 1:
        p.error("--batches, --width, --context, --iters and --top take integers >= 1")
    return args


def kernels_of(fn: Callable[[], None], device: str, calls: int, top: int) -> dict[str, Any]:
    """torch.profiler over `calls` eager calls of `fn`: per call, the kernels (CPU: operators)."""
    cuda = device == "cuda"
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = [(e.key, e.count / calls,
               (e.device_time_total if cuda else e.self_cpu_time_total) / calls)
              for e in prof.key_averages()]
    events = [e for e in events if e[2] > 0]
    events.sort(key=lambda e: -e[2])
    return {"kernels_per_call": sum(e[1] for e in events),
            "time_per_call_us": sum(e[2] for e in events),
            "top": [{"name": k[:120], "per_call": c, "us": t} for k, c, t in events[:top]]}


def main() -> int:
    args = parse_args()
    target, head = load_pair(args.model, args.device, half=args.device == "cuda")
    graphs = args.device == "cuda"
    engines = depth0_engines(target, head, {"head": None}, batch=max(args.batches),
                             context=args.context + 64, device=args.device, graphs=graphs,
                             overlap=graphs)
    for engine in engines.values():
        engine.warmup()
    clock = timer(args.device)
    results: dict[str, Any] = {}
    with torch.inference_mode():
        for name, engine in engines.items():
            worker = engine.worker
            for bucket in args.batches:
                parts = bodies(engine, bucket, args.context, args.width)
                prefill = worker.prefill_runner
                shape = prefill.shape(bucket, args.width)
                if shape is None:
                    continue
                rows, slots = shape
                parts["setup"]()
                entry: dict[str, Any] = {"prefill_shape": [rows, slots]}
                if graphs:
                    for greedy in (True, False):
                        graph = worker.table.get(prefill.key(rows, slots, greedy))
                        key = "greedy" if greedy else "sampling"
                        entry[f"prefill_graph_{key}_us"] = clock(graph.replay, args.iters) * 1e6
                    entry["round_graph_us"] = clock(parts["round"], args.iters) * 1e6
                entry["prefill_eager_sampling"] = kernels_of(
                    lambda: prefill.padded(rows, slots, False), args.device, 10, args.top)
                entry["prefill_eager_greedy"] = kernels_of(
                    lambda: prefill.padded(rows, slots, True), args.device, 10, args.top)
                entry["round_eager"] = kernels_of(
                    worker.round_body(bucket, graphs=False), args.device, 10, args.top)
                worker.slots.set_dummy_length(0)
                results[f"{name} b{bucket}"] = entry
                print(f"== {name} b{bucket} (prefill {rows} x {slots})"
                      + "".join(f"  {k} {v:.1f}" for k, v in entry.items() if k.endswith("_us")))
                for part in ("prefill_eager_greedy", "prefill_eager_sampling", "round_eager"):
                    prof = entry[part]
                    print(f"   {part}: {prof['kernels_per_call']:.0f} kernels, "
                          f"{prof['time_per_call_us']:.1f} us per call; costliest: "
                          + ", ".join(f"{t['name'][:28]} {t['us']:.1f}" for t in prof["top"][:4]))
    for engine in engines.values():
        engine.close()
    out = Path(args.out)
    meta = {"device": args.device, "torch": torch.__version__,
            "gpu": gpu_name(args.device), "width": args.width,
            "context": args.context, "iters": args.iters, "command": " ".join(sys.argv)}
    write_json(out / "results.json", {"meta": meta, "results": results})
    plot(results, out / "prefill.png")
    print(f"wrote {out / 'results.json'}")
    return 0


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    keys = list(results)
    parts = ("prefill_eager_greedy", "prefill_eager_sampling", "round_eager")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, part in enumerate(parts):
        xs = [k + (i - 1) * 0.27 for k in range(len(keys))]
        axes[0].bar(xs, [results[k][part]["time_per_call_us"] for k in keys], width=0.27,
                    label=part)
        axes[1].bar(xs, [results[k][part]["kernels_per_call"] for k in keys], width=0.27,
                    label=part)
    for ax, title in zip(axes, ("kernel time per call (us)", "kernels per call")):
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(keys, fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
