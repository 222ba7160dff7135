"""Draft trees against chains at equal draft steps (issue 35 §4): accept length per round and
tokens/s of greedy decoding on the bundled pair (or `--model`), per prompt regime.

    python -m scripts.bench.tree [--device cpu|cuda] [--model DIR | --shape llama3-8b] [--steps 3 5]
        [--trees 2x6 4x8] [--batch 1] [--prompts 6] [--new-tokens 64] [--repeats 3]
        [--out FILE]

For every regime (code, high-entropy, repetitive; `scripts.bench.common.make_prompts`) and every
`--steps S` it runs the chain of depth S and each tree `KxN` (top-k K, N verify tokens, the root
included) at S steps, `--repeats` times interleaved (chain, trees, chain, trees, ...), each
engine built once and warmed up; on CUDA chains and trees each eager and through CUDA graphs.
A row: accepted drafts per round (the bonus excluded; mean over the requests' rounds), the
accept histogram, tokens/s over the wall time of `generate` (prefill included; no stop token,
every request makes `--new-tokens`), and whether the tokens equal the chain's (greedy: they
must, up to float near-ties on a GPU). The JSON goes to `--out` FILE and its plot to FILE
with `.png` (default: the table on stdout only).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from scripts.bench.common import (build, encode_prompts, load_pair, make_prompts, static_spec,
                                  sync, tokenizer)
from adaptive_dist.shape import TreeShape
from workers.loading import DEFAULT_MODEL
from workers.sampling import SamplingParams


def run(engine: Any, prompts: list[list[int]], new_tokens: int, device: str,
        batch: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens)
    hist0 = dict(engine.stats.accept_histogram)
    round0 = engine.planner.round
    sync(device)
    start = time.perf_counter()
    reqs = []
    for i in range(0, len(prompts), batch):
        reqs += engine.generate(prompts[i:i + batch], params)
    sync(device)
    elapsed = time.perf_counter() - start
    rounds = sum(r.spec_rounds for r in reqs)
    hist = {k: v - hist0.get(k, 0) for k, v in engine.stats.accept_histogram.items()
            if v - hist0.get(k, 0)}
    cluster_rounds = engine.planner.round - round0
    return {"tokens": sum(len(r.output_ids) for r in reqs), "elapsed_s": elapsed,
            # wall ms per engine round (prefill rounds included): at 8B shapes what a chain or
            # a tree round costs, beside adaptive_dist.policy.tree's derived price
            "ms_per_round": 1e3 * elapsed / max(cluster_rounds, 1),
            "rounds": rounds, "accept_per_round": sum(r.accepted for r in reqs) / max(rounds, 1),
            "hist": {str(k): v for k, v in sorted(hist.items())},
            "outputs": [r.output_ids for r in reqs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--shape", default=None, metavar="NAME",
                   help="instead of --model: a target of this shape (e.g. llama3-8b) with an "
                        "EAGLE-3 head, random bfloat16 weights made on the device "
                        "(scripts.gen.make_checkpoint's shapes): the price of chain and tree "
                        "rounds at a real shape (ms/round); its acceptance means nothing")
    p.add_argument("--steps", type=int, nargs="+", default=[3, 5])
    p.add_argument("--trees", nargs="+", default=["2x6", "4x8"],
                   help="KxN: top-k K, N verify tokens (root included)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompts", type=int, default=6, help="prompts per regime")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ways", choices=("eager", "graphs", "both"), default=None,
                   help="which engines run: eager, through CUDA graphs, or both (default: both "
                        "on CUDA with --model, graphs only with --shape — an 8B eager round is "
                        "launch-bound and prices nothing; eager on the CPU)")
    p.add_argument("--regimes", nargs="+", default=None, metavar="NAME",
                   help="only these prompt regimes (default: every regime; with --shape the "
                        "first only, since random weights accept nothing in any regime)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ways = args.ways or ("eager" if args.device != "cuda" else
                         "graphs" if args.shape is not None else "both")
    if ways != "eager" and args.device != "cuda":
        p.error(f"--ways {ways}: CUDA graphs need --device cuda")
    modes = {"eager": (False,), "graphs": (True,), "both": (False, True)}[ways]

    if args.shape is not None:
        from scripts.bench.common import random_pair

        target, head = random_pair(args.shape, "eagle3", args.device)
    else:
        target, head = load_pair(args.model, args.device)
    tok = tokenizer(args.model, None, target.config.vocab_size)
    regimes = encode_prompts(make_prompts(args.prompts, seed=0), tok.encode)
    if args.regimes is not None:
        unknown = sorted(set(args.regimes) - set(regimes))
        if unknown:
            p.error(f"--regimes: unknown {unknown}; the regimes are {sorted(regimes)}")
        regimes = {r: regimes[r] for r in args.regimes}
    elif args.shape is not None:
        regimes = dict(list(regimes.items())[:1])
    context = max(len(x) for v in regimes.values() for x in v) + args.new_tokens + 64
    engines: dict[str, Any] = {}
    names = []                        # (name, steps, tree or None, graphs) in build order
    for steps in args.steps:
        for graphs in modes:
            names.append((f"chain{steps}" + ("/graphs" if graphs else ""), steps, None, graphs))
        for tree in args.trees:
            k, n = (int(x) for x in tree.split("x"))
            try:
                TreeShape(steps, k, n)
            except ValueError as err:   # e.g. 2x12 at 3 steps: 10 nodes
                print(f"tree {tree} at {steps} steps skipped: {err}", flush=True)
                continue
            for graphs in modes:
                names.append((f"tree{steps}/{tree}" + ("/graphs" if graphs else ""), steps,
                              (k, n), graphs))
    t0 = time.perf_counter()
    for i, (name, steps, tree, graphs) in enumerate(names):
        extra = {} if tree is None else dict(speculative_eagle_topk=tree[0],
                                             speculative_num_draft_tokens=tree[1])
        engines[name] = build(static_spec(steps), target, head, batch=args.batch,
                              context=context, device=args.device, graphs=graphs, **extra)
        engines[name].warmup()
        print(f"[tree] built and warmed {name} ({i + 1}/{len(names)}, "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
    rows: list[dict] = []
    total = len(regimes) * args.repeats
    for regime, prompts in regimes.items():
        for repeat in range(args.repeats):
            for name, engine in engines.items():
                res = run(engine, prompts, args.new_tokens, args.device, args.batch)
                rows.append({"regime": regime, "engine": name, "repeat": repeat, **res})
            print(f"[tree] {regime} repeat {repeat + 1}/{args.repeats} done "
                  f"({len(rows) // len(engines)}/{total}, {time.perf_counter() - t0:.0f} s)",
                  flush=True)
    summary: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = f"{row['regime']} {row['engine']}"
        steps = row["engine"].split("/")[0].lstrip("chaintre")
        suffix = "/graphs" if row["engine"].endswith("/graphs") else ""
        chain = next(r for r in rows if r["regime"] == row["regime"] and r["repeat"] == row[
            "repeat"] and r["engine"] == f"chain{steps}{suffix}")
        s = summary.setdefault(key, {"accept_per_round": row["accept_per_round"],
                                     "tokens_per_s": [], "ms_per_round": [],
                                     "equal_to_chain": True})
        s["tokens_per_s"].append(round(row["tokens"] / row["elapsed_s"], 1))
        s["ms_per_round"].append(round(row["ms_per_round"], 3))
        s["equal_to_chain"] &= row["outputs"] == chain["outputs"]
    for row in rows:
        del row["outputs"]
    print(f"{'regime engine':34} {'accept/round':>12} {'tokens/s (repeats)':>28} "
          f"{'ms/round (median)':>17} equal")
    for key, s in summary.items():
        ms = sorted(s["ms_per_round"])[len(s["ms_per_round"]) // 2]
        print(f"{key:34} {s['accept_per_round']:12.3f} {str(s['tokens_per_s']):>28} "
              f"{ms:17.3f} {s['equal_to_chain']}")
    cal = calibrate(summary)
    print(f"{'tree':12} {'fitted f':>8}  regime: chain p, observed / predicted accepted per round")
    for tree, c in cal.items():
        print(f"{tree:12} {c['coverage']:8.3f}  " + "; ".join(
            f"{r}: p {v['p']:.3f}, {v['observed']:.3f} / {v['predicted']:.3f}"
            for r, v in c["regimes"].items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "calibration": cal,
                       "rows": rows}, f, indent=1)
        plot(summary, str(Path(args.out).with_suffix(".png")))


def solve_rate(accepted: float, steps: int) -> float:
    """The per-position rate p with E(p, S) = p + ... + p^S = `accepted` (bisection; 0 and 1
    at the ends)."""
    from adaptive_dist.policy.goodput import expected_accepted

    if accepted <= 0:
        return 0.0
    if accepted >= steps:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accepted(mid, steps) < accepted else (lo, mid)
    return (lo + hi) / 2


def calibrate(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tree estimator of `adaptive_dist.policy.tree` against what was accepted: per tree
    (eager engines), per regime the chain's rate p at the same steps (`solve_rate` of the
    chain's accepted per round), the coverage f that fits the tree's accepted per round in every
    regime whose chain misses (p < 0.97; least squares over a grid of f in steps of 0.005), and
    per regime observed against predicted `E(p + (1 - p) f, S)`."""
    from adaptive_dist.policy.tree import expected_tree

    out: dict[str, Any] = {}
    regimes = list(dict.fromkeys(k.split(" ", 1)[0] for k in summary))
    engines = list(dict.fromkeys(k.split(" ", 1)[1] for k in summary))
    eager = [e for e in engines if e.startswith("tree") and "/graphs" not in e]
    # the eager engines when they ran (acceptance does not depend on the path), else the graphs'
    trees = eager or [e for e in engines if e.startswith("tree")]
    for tree in trees:
        steps = int(tree[len("tree"):].split("/")[0])
        suffix = "/graphs" if tree.endswith("/graphs") else ""
        cells = {}
        for regime in regimes:
            chain = summary.get(f"{regime} chain{steps}{suffix}")
            mine = summary.get(f"{regime} {tree}")
            if chain and mine:
                cells[regime] = (solve_rate(chain["accept_per_round"], steps),
                                 mine["accept_per_round"])
        fit = [(p, obs) for p, obs in cells.values() if p < 0.97] or list(cells.values())
        best = min((sum((expected_tree(p, steps, f) - obs) ** 2 for p, obs in fit), f)
                   for f in (i / 200 for i in range(200)))[1]
        out[tree] = {"coverage": best, "regimes": {
            r: {"p": p, "observed": obs, "predicted": expected_tree(p, steps, best)}
            for r, (p, obs) in cells.items()}}
    return out


def plot(summary: dict[str, dict[str, Any]], path: str) -> None:
    """Accepted drafts per round and tokens/s (median of the repeats, the spread as a bar) per
    regime and engine: OUT.png beside OUT (the JSON)."""
    from scripts.bench.common import pyplot, save

    regimes = list(dict.fromkeys(k.split(" ", 1)[0] for k in summary))
    engines = list(dict.fromkeys(k.split(" ", 1)[1] for k in summary))
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(engines))
    for i, engine in enumerate(engines):
        xs = [r + (i - (len(engines) - 1) / 2) * width for r in range(len(regimes))]
        cells = [summary.get(f"{r} {engine}") for r in regimes]
        a1.bar(xs, [c["accept_per_round"] if c else 0 for c in cells], width, label=engine)
        tps = [sorted(c["tokens_per_s"]) if c else [0.0] for c in cells]
        med = [t[len(t) // 2] for t in tps]
        a2.bar(xs, med, width, yerr=[[m - t[0] for m, t in zip(med, tps)],
                                     [t[-1] - m for m, t in zip(med, tps)]], label=engine)
    for ax, title in ((a1, "accepted draft tokens per round"), (a2, "tokens/s (median, min-max)")):
        ax.set_xticks(range(len(regimes)), regimes)
        ax.set_title(title)
    a1.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    main()
