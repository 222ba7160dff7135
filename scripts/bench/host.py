"""Host work per round, without the model: the engine on a model so small (1 layer, width 8,
vocabulary 16) that a round's compute is negligible next to its Python, timed per part —
admission and retirement, the planner's begin/end (the consensus), the worker's glue around the
round's bodies, the bodies themselves (here: eager forwards of the tiny model), and the batch
commit. What this measures is the host cost that CUDA graphs do not remove; on a GPU it is the
gap between a round's GPU time and its wall time.

    python -m scripts.bench.host [--batch 16] [--policy ema] [--tokens 400] [--repeats 3] [--out DIR]
    python -m scripts.bench.host --device cuda [--steps 0 0h 1 3 7] [--batch 16] [--tokens 256]

With `--device cuda` the engine is the bundled pair with CUDA graphs and overlapped rounds, at each
static depth of `--steps` (interleaved over the repeats): the bodies are graph launches, and `wait`
is the time the host blocks on the device (reading a round); host work per round is the round's
wall time less `wait`. A round is host-bound when its host work exceeds the device's time.
`0h` in `--steps` is depth 0 with a draft head: the goodput engine held there (its catch-ups,
deferred prefills and the policy's per-round work), beside `0`, the engine without a head.

Writes `OUT/host.json` (medians and min-max over the repeats, microseconds per round) and
`OUT/host.png`.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from adaptive_dist.config import load_config
from scripts.bench.common import (build, held_at_zero, load_pair, make_prompts, pyplot, save,
                                  settle_heap, spread, static_spec, write_json)
from workers.model import EagleConfig, LlamaConfig, LlamaForCausalLM
from workers.model.eagle import EagleHead
from workers.sampling import SamplingParams

PARTS = (("retire", "scheduler", "retire"), ("admit", "scheduler", "admit"),
         ("plan_begin", "planner", "begin_round"), ("plan_end", "planner", "end_round"),
         ("commit", "scheduler", "commit_round"), ("launch", "worker", "launch"),
         ("launch", "worker", "collect"),
         ("bodies", "phases", "draft_phase"), ("bodies", "phases", "target_phase"),
         ("bodies", "phases", "accept_phase"), ("bodies", "phases", "extend_phase"),
         ("bodies", "lag", "catch_up"))


HELD = "0h"


def depth_arg(text: str) -> int | str:
    """A `--steps` entry: a depth, or `0h` (depth 0 with a head)."""
    if text == HELD:
        return HELD
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a depth (an integer) or {HELD}") from None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--policy", default="ema", choices=("ema", "static"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=depth_arg, nargs="+", default=None,
                   help="static depths to time, and 0h: the goodput engine held at depth 0 with "
                        "its head (default: the --policy run only; cuda: 0 1 3 7)")
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench_host")
    args = p.parse_args()
    if args.steps and any(d != HELD and d < 0 for d in args.steps):
        p.error(f"--steps {args.steps}: depths must be >= 0")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be >= 1")
    return args


def timed(acc: collections.Counter, key: str, fn: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - start
    return run


def configuration(args: argparse.Namespace,
                  steps: int | str | None) -> tuple[Any, list[list[int]]]:
    """The engine of one configuration and its prompts (`steps`: a static depth, or `0h`; None:
    the --policy run)."""
    if steps is None:
        spec = load_config(None, args.policy,
                           **({"initial_steps": 3} if args.policy == "static" else {}))
    elif steps == HELD:
        spec = held_at_zero(1)
    else:
        spec = static_spec(steps)
    if args.device == "cuda":
        from workers import loading

        target, head = load_pair(loading.DEFAULT_MODEL, "cuda")
        prompts = [loading.encode_prompt(t, target.config)
                   for t in make_prompts(args.batch, seed=0)["code"]]
        context = max(len(p) for p in prompts) + args.tokens + 1
        return build(spec, target, head, batch=args.batch, context=context, device="cuda",
                     graphs=True, overlap=True), prompts
    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval()
    head = EagleHead(EagleConfig.for_target(cfg), target).eval()
    engine = build(spec, target, head, batch=args.batch, context=args.tokens + 32, device="cpu",
                   graphs=False)
    return engine, [[3, 4, 5, 6] * 5 for _ in range(args.batch)]


def instrument(engine: Any) -> collections.Counter:
    """Time the engine's parts into the returned counter (seconds, summed)."""
    acc: collections.Counter = collections.Counter()
    owners = {"scheduler": engine.scheduler, "planner": engine.planner, "worker": engine.worker,
              "phases": engine.worker.phases, "lag": engine.worker.lag}
    for key, owner, name in PARTS:
        obj = owners[owner]
        if hasattr(obj, name):
            setattr(obj, name, timed(acc, key, getattr(obj, name)))
    collect = engine.worker.collect

    def waited(launched: Any) -> Any:  # the host blocked on the device: not host work
        if launched.done is not None:
            start = time.perf_counter()
            launched.done.synchronize()
            acc["wait"] += time.perf_counter() - start
        return collect(launched)
    engine.worker.collect = waited
    if engine.worker.graphs is not None:  # graph launches are the bodies of a graphed round
        from workers.worker.graph_table import GraphPhase

        for key, entry in engine.worker.table.entries.items():
            if key.phase is not GraphPhase.PREFILL:
                entry.replay = timed(acc, "bodies", entry.replay)
    return acc


def one_run(engine: Any, acc: collections.Counter, prompts: list[list[int]],
            tokens: int) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=tokens)
    acc.clear()
    rounds0, seconds0 = engine.stats.rounds, engine.stats.round_seconds
    engine.generate(prompts, params)
    n = engine.stats.rounds - rounds0
    total = (engine.stats.round_seconds - seconds0) / n
    us = {k: 1e6 * v / n for k, v in acc.items()}
    us.setdefault("wait", 0.0)
    us["worker_glue"] = us.pop("launch") - us["bodies"]  # bodies excluded (wait is outside)
    us["engine_other"] = 1e6 * total - sum(us.values())
    us["host_total"] = 1e6 * total - us["bodies"] - us["wait"]
    us["round_total"] = 1e6 * total
    return us


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    from tqdm import tqdm

    steps = args.steps or ([0, 1, 3, 7] if args.device == "cuda" else [None])
    built = {}
    for depth in steps:
        engine, prompts = configuration(args, depth)
        acc = instrument(engine)
        engine.generate(prompts, SamplingParams(max_new_tokens=args.tokens))  # warm
        built[depth] = (engine, acc, prompts)
    settle_heap()
    samples: dict = {d: [] for d in steps}
    bar = tqdm(total=args.repeats * len(steps), desc="bench_host", unit="run")
    for rep in range(args.repeats):  # interleaved: every configuration once per repeat
        for depth in steps[rep % len(steps):] + steps[:rep % len(steps)]:
            engine, acc, prompts = built[depth]
            samples[depth].append(one_run(engine, acc, prompts, args.tokens))
            bar.update()
    bar.close()
    summaries = {}
    for depth, runs in samples.items():
        keys = list(runs[0])
        summaries[depth] = {k: spread([r[k] for r in runs]) for k in keys}
    out = Path(args.out)
    meta = {"batch": args.batch, "policy": args.policy, "tokens": args.tokens,
            "device": args.device, "repeats": args.repeats, "torch": torch.__version__,
            "command": " ".join(sys.argv)}
    label = {d: (args.policy if d is None else "steps 0 + head" if d == HELD else f"steps {d}")
             for d in steps}
    write_json(out / "host.json",
               {"meta": meta, "configs": {label[d]: {"us_per_round": summaries[d],
                                                     "runs": samples[d]} for d in steps}})
    for depth in steps:
        print(f"--- {label[depth]} (batch {args.batch}, {args.device})")
        for k, s in summaries[depth].items():
            print(f"{k:<14}{s['median']:>9.0f} us/round  ({s['min']:.0f}-{s['max']:.0f})")
    plt = pyplot()
    first = summaries[steps[0]]
    parts = [k for k in first if k not in ("host_total", "round_total", "bodies", "wait")]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(steps)
    for i, depth in enumerate(steps):
        summary = summaries[depth]
        med = [summary[k]["median"] for k in parts]
        err = [[m - summary[k]["min"] for k, m in zip(parts, med)],
               [summary[k]["max"] - m for k, m in zip(parts, med)]]
        ax.bar([j + i * width for j in range(len(parts))], med, width, yerr=err, capsize=2,
               label=f"{label[depth]}: {summary['host_total']['median']:.0f} µs host")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(parts))], parts)
    ax.set_ylabel("µs per round (median, min-max)")
    ax.set_title(f"host work per round, batch {args.batch}, {args.device}")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", rotation=20)
    ax.grid(axis="y", alpha=0.3)
    save(fig, out / "host.png")
    print(f"wrote {out / 'host.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
