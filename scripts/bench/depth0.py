"""What a depth-0 round costs an engine that keeps a draft head, against one that has none.

    python -m scripts.bench.depth0 [--device cuda] [--batches 1 16 64] [--catchup 8 16 32]
        [--context 256] [--iters 100] [--repeats 5] [--shape bundled|llama3-8b]
        [--out runs/bench_depth0]

At depth 0 (the goodput policy's plain rounds) a speculating engine runs the same target forward as
an engine without a head, plus its share of keeping the head current: each round appends the
committed token and target feature to the slot's lag ring (inside the round's forward), and every
`catchup_rounds` rounds one head forward catches the draft cache up (and checks the head's
guesses: the shadow acceptance). This prices both parts, per batch bucket, for each catch-up
interval N (`--catchup-rounds`):

- device: the round's forward alone (the CUDA graph replayed `--iters` times back to back, timed
  with CUDA events; eager bodies timed on the host on a CPU; less the time of setting the dummy
  rows' cache length before each, timed alone) for the engine without a head and
  the speculating engine at depth 0, and the catch-up forward of width N; the depth-0 cost per
  round is `round + catch-up / N`, reported against the headless round;
- prefill: the padded prefill of `bucket` rows of 64 token slots (a graph per shape on a GPU,
  the greedy one: the requests here are greedy),
  which a speculating engine runs with the head over the prompt; and, where the engine defers
  the head's part at depth 0 (`defer_prefill_width`), the prefill without it and the forward
  over `bucket` waiting prompts that a later catch-up runs in its place;
- engine: rounds as the engine runs them (`Engine.measure_round_costs`: chains of N rounds,
  dummy rows, launched and read with overlap as in serving), against the headless engine's.

Every dummy row reads `--context` cached positions. `--shape bundled`: the bundled pair (a 6-layer
target, a 1-layer head; half precision on a GPU); `--shape llama3-8b`: a Llama-3.1-8B-shaped
target and an EAGLE-3-shaped head with random bf16 weights (`scripts.gen.make_checkpoint`; costs
only). Samples are interleaved over the engines and buckets, `--repeats` times; medians and
min-max. Writes OUT/results.json and OUT/depth0.png.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from scripts.bench.common import (HEADLESS, bodies, depth0_engines, gpu_name, load_pair,
                                  pyplot, random_pair, save, settle_heap, spread, timer,
                                  write_json)
from workers.engine import Engine
from workers.loading import DEFAULT_MODEL


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--catchup", nargs="+", type=int, default=[8, 16, 32], metavar="N",
                   help="catch-up intervals to price (one speculating engine each)")
    p.add_argument("--context", type=int, default=256,
                   help="cached positions each dummy row's attention reads")
    p.add_argument("--iters", type=int, default=100, help="replays per device sample")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shape", choices=("bundled", "llama3-8b", "tiny"), default="bundled",
                   help="the bundled pair, or random weights of that shape (tiny: a smoke test)")
    p.add_argument("--prefill-width", type=int, default=64,
                   help="token slots per row of the timed padded prefill")
    p.add_argument("--no-engine", action="store_true",
                   help="skip the engine-round samples (each measures every bucket and tier)")
    p.add_argument("--out", default="runs/bench_depth0")
    args = p.parse_args()
    for name in ("iters", "repeats", "context"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: must be >= 1")
    if min(args.catchup) < 1 or min(args.batches) < 1:
        p.error("--catchup and --batches take integers >= 1")
    return args


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else 4)
    if args.shape == "bundled":
        target, head = load_pair(args.model, args.device, half=args.device == "cuda")
    else:
        target, head = random_pair(args.shape, "eagle3", args.device)
    top = max(args.batches)
    context = args.context + 64
    engines = depth0_engines(target, head, {f"head@{n}": n for n in args.catchup}, batch=top,
                             context=context, device=args.device,
                             graphs=args.device == "cuda", overlap=args.device == "cuda")
    for engine in engines.values():
        engine.warmup()
    settle_heap()
    clock = timer(args.device)
    buckets = list(args.batches)
    samples: dict[tuple[str, int, str], list[float]] = {}
    from tqdm import tqdm

    jobs = [(name, b) for b in buckets for name in engines]
    bar = tqdm(total=len(jobs) * args.repeats, desc="bench_depth0", unit="sample")
    with torch.inference_mode():
        for rep in range(args.repeats):
            shift = rep % len(jobs)
            for name, bucket in jobs[shift:] + jobs[:shift]:  # interleaved, rotating
                engine = engines[name]
                parts = bodies(engine, bucket, args.context, args.prefill_width)
                setup = clock(parts.pop("setup"), args.iters)  # in every timed call: taken off
                for part, fn in parts.items():
                    samples.setdefault((name, bucket, part), []).append(
                        max(clock(fn, args.iters) - setup, 0.0))
                engine.worker.slots.set_dummy_length(0)
                if not args.no_engine:
                    costs = engine.measure_round_costs(repeats=1, context=args.context)
                    samples.setdefault((name, bucket, "engine"), []).append(costs[bucket][0])
                bar.update()
    bar.close()
    results = analyse(samples, engines, buckets)
    for engine in engines.values():
        engine.close()
    write(args, results, samples)
    return 0


def analyse(samples: dict[tuple[str, int, str], list[float]], engines: dict[str, Engine],
            buckets: list[int]) -> dict[str, Any]:
    """Per bucket and engine: medians (microseconds) and the depth-0 cost per round against the
    headless engine (device: round + catch-up / N; engine: as measured)."""
    out: dict[str, Any] = {}
    for bucket in buckets:
        base = statistics.median(samples[(HEADLESS, bucket, "round")])
        engine_base = samples.get((HEADLESS, bucket, "engine"))
        row: dict[str, Any] = {}
        for name, engine in engines.items():
            entry = {part: {k: v * 1e6 for k, v in spread(samples[(name, bucket, part)]).items()}
                     for part in ("round", "catchup", "prefill", "prefill_deferred", "pending",
                                  "engine")
                     if (name, bucket, part) in samples}
            every = engine.worker.lag.catchup_every
            per_round = statistics.median(samples[(name, bucket, "round")]) + (
                statistics.median(samples[(name, bucket, "catchup")]) / every
                if (name, bucket, "catchup") in samples else 0.0)
            if (name, bucket, "prefill") in samples:
                entry["prefill_vs_headless"] = statistics.median(
                    samples[(name, bucket, "prefill")]) / statistics.median(
                    samples[(HEADLESS, bucket, "prefill")])
            if (name, bucket, "prefill_deferred") in samples:
                entry["prefill_deferred_vs_headless"] = statistics.median(
                    samples[(name, bucket, "prefill_deferred")]) / statistics.median(
                    samples[(HEADLESS, bucket, "prefill")])
            entry.update(device_us_per_round=per_round * 1e6,
                         device_vs_headless=per_round / base)
            if engine_base:
                entry["engine_vs_headless"] = (statistics.median(
                    samples[(name, bucket, "engine")]) / statistics.median(engine_base))
            row[name] = entry
        out[f"b={bucket}"] = row
    return out


def write(args: argparse.Namespace, results: dict[str, Any],
          samples: dict[tuple[str, int, str], list[float]]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": args.device, "torch": torch.__version__, "shape": args.shape,
            "prefill_width": args.prefill_width,
            "gpu": gpu_name(args.device),
            "context": args.context, "iters": args.iters, "repeats": args.repeats,
            "catchup": args.catchup, "command": " ".join(sys.argv)}
    raw = [{"engine": k[0], "bucket": k[1], "part": k[2], "seconds": v}
           for k, v in samples.items()]
    write_json(out / "results.json", {"meta": meta, "results": results, "samples": raw})
    for key, row in results.items():
        print(f"== {key}")
        for name, e in row.items():
            catch = e.get("catchup", {}).get("median")
            print(f"   {name:<9} round {e['round']['median']:8.1f} us"
                  + (f"  catch-up {catch:8.1f} us" if catch is not None else " " * 22)
                  + f"  per round x{e['device_vs_headless']:.3f}"
                  + (f"  prefill x{e['prefill_vs_headless']:.3f}" if "prefill_vs_headless" in e
                     else "")
                  + (f" (head deferred x{e['prefill_deferred_vs_headless']:.3f}, waiting "
                     f"prompts {e['pending']['median']:.1f} us per catch-up)"
                     if "prefill_deferred_vs_headless" in e else "")
                  + (f"  engine x{e['engine_vs_headless']:.3f}" if "engine_vs_headless" in e
                     else ""))
    plot(results, out / "depth0.png")
    print(f"wrote {out / 'results.json'}")


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    keys = list(results)
    names = list(next(iter(results.values())))
    fields, titles = [], []
    for field, title in (("device_vs_headless", "device time per depth-0 round"),
                         ("engine_vs_headless", "engine rounds (with host)"),
                         ("prefill_vs_headless", "padded prefill (device)"),
                         ("prefill_deferred_vs_headless", "padded prefill at depth 0 (device)")):
        if all(field in row[n] for row in results.values() for n in row if n != HEADLESS):
            fields.append(field)
            titles.append(title)
    fig, axes = plt.subplots(1, len(fields), figsize=(5.5 * len(fields), 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [k + (i - len(names) / 2 + 0.5) * width for k in range(len(keys))]
        for ax, field in zip(axes, fields):
            ax.bar(xs, [results[k][name].get(field, 1.0) for k in keys], width=width,
                   label=name)
    for ax, title in zip(axes, titles):
        ax.axhline(1.0, color="k", lw=0.7)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(keys)
        ax.set_ylabel("x the headless engine")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
