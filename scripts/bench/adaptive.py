"""Adaptive against static depth on phased workloads: the benchmark the goodput policy is judged by.

    python -m scripts.bench.adaptive [--device cuda] [--model DIR [--draft-model DIR]]
        [--batches 1 16 64] [--repeats 3]
        [--workloads transition code high_entropy repetitive] [--new-tokens 64] [--out DIR]
    torchrun --nproc-per-node 2 -m scripts.bench.adaptive --dp 2 --device cuda \
        --workloads heterogeneous [...]

Workloads are sequences of phases; a phase gives every DP replica `batch` prompts of one regime
(code, high_entropy, repetitive) run to completion (greedy, `--new-tokens` each) — a closed batch,
whose time follows its slowest request. `--waves N` (N > 1) gives each phase N x `batch` prompts
arriving continuously instead: at most `batch` run at once and a finished request is replaced by
the next prompt, so the batch stays full until the phase's last prompts (what a server sees, and
what goodput's tokens per round measure). `--length-spread F` draws each request's budget uniformly
from `new_tokens x [1-F, 1+F]` (the same budgets for every policy; default 0.5 with `--waves`,
else 0: a continuous workload whose requests all end together refills in bulk, which real
traffic does not). `--phase-rounds N` makes every phase a window of N rounds instead, each
replica kept full throughout (its prompts cycled; requests in flight at a phase's end run on into
the next): tokens/s under steady load rather than the time to finish a fixed set of prompts,
which in a DP cluster the slowest replica sets — a depth that helps only the other replica cannot
shorten it, while under steady load that replica's extra tokens count. Workloads:
`code`, `high_entropy`, `repetitive` (one phase each), `transition` (code -> high_entropy ->
repetitive -> high_entropy), `heterogeneous` (DP: replica 0 high-entropy while replica 1
repetitive, then swapped). Policies: static 0 (no speculation), 1, 3, 7; ema (weighted_mean);
ema_min (the min vote); goodput (candidates 0, 1, 3, 7; its cost table measured at start-up;
the pooled rate), goodput_min (the same with the `min` reducer: the smallest rank's rate) and
goodput_mix (the `mixture` reducer: the mean of the ranks' expected tokens, each from its own rate);
and the oracle, computed from the static runs: per phase the best static depth's median
tokens/s. `NAME@N` runs a policy's engine with the draft cache caught up every N depth-0 rounds
(`--catchup-rounds`, default the engine's), beside the same policy at other intervals;
`NAME/nodefer` (also `NAME@N/nodefer`) the engine with the head run in every prefill
(`--defer-prefill-width 0`: the head's part of a prefill at depth 0 not left to the catch-up);
`NAME+KEY=VALUE` (after the rest, repeatable) an adaptive setting for that policy alone, e.g.
`goodput+reset_nats=0` beside `goodput`. Workloads shaped like a server's: `transition_long`
(the transition, every phase `--long-phase-rounds` rounds, default 300), `code_warm`,
`high_entropy_warm`, `repetitive_warm` (the steady regime measured after a warm-up phase of the
same regime: the policy's state and the requests in flight carried over, the warm-up phase left
out of every figure), and `mixed` (one stream of 4 segments of `--mixed-rounds` rounds, the batch
kept full: each request's regime drawn from shares of code / high-entropy / repetitive that drift
linearly over the run (`MIXED_DRIFT`), its output budget from a log-normal, `--mixed-median` 200,
`--mixed-sigma` 0.8, held to `--mixed-cap` 1200, so the batch's acceptance moves as requests come
and go; `--mixed-seed N` another stream of the same law). `goals.md` and the results' `goals` hold issue 26's goal rows (`GOALS`) per adaptive
policy. `--model-costs FILE` reads a cost table file (`docs/data/cost_tables/*.json`, its
`agreed_round_cost_ms`; the file's name recorded as `meta.model_costs_file`);
`--model-costs TABLE` prices every run's rounds by a
cost table (e.g. a GPU's start-up table, `meta.round_cost` of a GPU run) instead of timing them:
the goodput engines decide on the same table (cut to each one's candidates): the decisions of a
CPU run, compared in the device's units (prefills priced as the decode round they share, host
work left out). `staticN` runs any static depth N and `goodput+candidate_steps=[...]` any ladder;
`--interpolate-depths D ...` prices the depths the table lacks (linear in verified tokens between
the measured depths around D, past the deepest the last measured segment extended): estimates,
named in `meta.model_costs_interpolated` and above the goals table, never measurements.
The prompts are drawn once per run for its largest batch (`make_prompts(largest × waves)`) and a
phase at batch b takes the first b × waves of its regime; the high-entropy and repetitive draws
depend on that count, so compare figures within a run, or between runs with the same `--batches`.
One engine per policy, built once (graphs captured once); every run starts its policy
afresh; runs are interleaved over the repeats. Per run: tokens/s overall and per phase, switches,
switches per phase change (and per hour at the run's rate), rounds at each depth, the depth
timeline. Writes `OUT/results.json`, `OUT/<workload>_b<batch>.png` (tokens/s per policy with
spread, depth timelines over the phases) and prints the goals table.
"""
from __future__ import annotations

import argparse
import re
import collections
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import collectives as C
from adaptive_dist import cost_tables
from adaptive_dist.config import AdaptiveConfig, ConfigError, RoundCost, load_config
from adaptive_dist.coordinator import RoundCoordinator
from adaptive_dist.policy import cost_row
from scripts.bench.common import (GcPauses, add_overlap_argument, build, encode_prompts,
                                  gpu_name, held_at_zero, in_flight, load_pair, make_prompts,
                                  overlap_of, pyplot, run_continuous, save, settle_heap,
                                  spread, static_spec, sync, tokenizer, write_json)
from workers.config import EngineConfig
from workers.engine import Engine
from workers.loading import DEFAULT_MODEL
from workers.model import ModelParallel
from workers.sampling import SamplingParams

STATIC = ("static0", "static1", "static3", "static7")
POLICIES = STATIC + ("ema", "ema_min", "goodput", "goodput_min", "goodput_mix", "goodput_pr",
                     "oracle_pr", "goodput_tree", "goodput_prtree")
TREES = ("goodput_tree", "goodput_prtree")
"""Policies with draft trees among their candidates (issue 35): goodput over chains 0, 1, 3, 7
and `--tree-candidates` (default `TREE_CANDIDATES`), each tree priced from the cost table's chain
rows and verify table (`adaptive_dist.policy.tree`). Needs --model-costs with a verify table or
the start-up measurement of both."""
TREE_CANDIDATES = ("3x2x6", "5x4x8", "7x2x12", "7x4x16")
PER_REQUEST_TREES = ("goodput_prtree",)
"""Per-request trees (`--per-request --tree-candidates`): the round's shape a chain or a tree,
each request its own draft depth or verify nodes (`adaptive_dist.policy.tree.TreeBudgetRule`);
a tree round priced by its packed verify tokens (`policy.tree.tree_tokens_cost`)."""
TREE_GOALS = {"transition": {1: (1.20, None), 16: (1.05, None), 64: (1.00, None)},
              "transition_long": {1: (1.20, None), 16: (1.05, None), 64: (1.00, None)},
              "mixed": {1: (1.20, None), 16: (1.05, None), 64: (1.00, None)}}
"""Issue 35's goals for the tree policies (production-priced): tokens/s over the best static
chain."""
PER_REQUEST = ("goodput_pr",)
"""Policies with per-request budgets (`--per-request`): goodput deciding each round's shape and
each request's draft tokens (`adaptive_dist.policy.budgets`)."""
ORACLE = "oracle_pr"
"""The per-request oracle: the depth-7 chain run, each round priced as if every request had
drafted exactly what it accepts (greedy output does not depend on the drafts, so the tokens
are those of the chain): draft forwards the smallest candidate >= the round's largest accept
(0 when nothing is accepted), verify tokens the rung holding sum(accept + 1). What each request
drafting the best d_i knowing its acceptance would cost; the gap to it is what the policy's
estimates leave. Needs --model-costs with a verify table."""
STATIC_NAME = re.compile(r"static(0|[1-9][0-9]*)")
"""`staticN` for any depth N (the default list runs 0, 1, 3, 7; e.g. `static5` for a wider
ladder, priced by `--interpolate-depths` where the cost table lacks it)."""


def is_static(policy: str) -> bool:
    """A static depth `staticN` (N any non-negative integer)."""
    return STATIC_NAME.fullmatch(policy) is not None
DIAGNOSTIC = ("depth0_head",)
"""Not run by default: `depth0_head` is the goodput engine held at depth 0 (its head kept
current — prefilled, caught up every `--catchup-rounds` rounds, shadow-checked — but never
drafting), which prices what a speculating engine pays at depth 0 against static 0 (no head)."""
WORKLOADS = {
    "code": [("code", "code")], "high_entropy": [("high_entropy", "high_entropy")],
    "repetitive": [("repetitive", "repetitive")],
    "transition": [("code", "code"), ("high_entropy", "high_entropy"),
                   ("repetitive", "repetitive"), ("high_entropy", "high_entropy")],
    "heterogeneous": [("high_entropy", "repetitive"), ("repetitive", "high_entropy")],
    # what a server sees (issue 26): the transition with long phases, each steady regime after a
    # warm-up phase of its own, and a stream mixing the regimes in drifting proportions
    "transition_long": [("code", "code"), ("high_entropy", "high_entropy"),
                        ("repetitive", "repetitive"), ("high_entropy", "high_entropy")],
    "code_warm": [("code", "code")] * 2, "high_entropy_warm": [("high_entropy",) * 2] * 2,
    "repetitive_warm": [("repetitive", "repetitive")] * 2,
    "mixed": [("mixed", "mixed")] * 4,
}
"""Phases: (regime of even replicas, regime of odd replicas)."""
WARM = {"code_warm": 1, "high_entropy_warm": 1, "repetitive_warm": 1}
"""Leading phases run (the policy's state and the requests in flight carried over) but not
measured: a steady regime judged after a warm-up phase of the same regime."""
LONG = ("transition_long",)
"""Workloads whose phases are `--long-phase-rounds` windows."""
MIXED_DRIFT = ((0.5, 0.3, 0.2), (0.3, 0.5, 0.2), (0.2, 0.3, 0.5), (0.45, 0.1, 0.45),
               (0.5, 0.3, 0.2))
"""The mixed stream's shares of (code, high_entropy, repetitive) at the start of each of its
segments (and at the end of the last): a request's regime is drawn from the shares interpolated
linearly at its place in the segment."""
MIXED_SEED_STRIDE = 1000
"""`--mixed-seed M` adds `M * MIXED_SEED_STRIDE` to the seed of every draw of the mixed stream
(a replica's regimes, the segments' budgets); larger than any replica or segment index, so no
two (seed, replica, segment) share a draw."""
PER_REQUEST_GOALS = {"transition": (1.10, 0.97), "transition_long": (1.10, 0.97),
                     "mixed": {1: (1.10, None), 16: (1.08, None), 64: (1.15, None)},
                     "heterogeneous": (1.05, None)}
"""Issue 32's goals for the per-request policies (production-priced): (least tokens/s over the
best static depth, least tokens/s of every phase over that phase's best static depth, or None),
per batch where they differ."""
GOALS = {"transition": (1.10, 0.97), "transition_long": (1.10, 0.97), "mixed": (1.05, None),
         "code_warm": (0.98, None), "high_entropy_warm": (0.98, None),
         "repetitive_warm": (0.98, None)}
"""Issue 26's goals (production-priced): (least tokens/s over the best static depth, least
tokens/s of every phase over the per-phase oracle, or None)."""


def lognormal_budgets(n: int, median: float, sigma: float, cap: int,
                      seed: int = 0) -> list[int]:
    """`n` output budgets from a log-normal of this median and sigma (ln units), held to
    [1, cap]; seeded, the same for every policy."""
    import random

    rng = random.Random(seed)
    return [min(cap, max(1, round(rng.lognormvariate(math.log(median), sigma))))
            for _ in range(n)]


def mixed_stream(enc: dict[str, list[list[int]]], n: int, segment: int, segments: int,
                 seed: int = 0) -> tuple[list[list[int]], list[str]]:
    """Segment `segment` (of `segments`) of the mixed stream: `n` prompts whose regimes are
    drawn from `MIXED_DRIFT`'s shares interpolated over the segment, each regime's prompts taken
    in turn (cycled); -> (prompts, their regimes). Seeded by (seed, segment)."""
    import random

    rng = random.Random(seed * 1000 + segment)
    kinds = ("code", "high_entropy", "repetitive")
    start = MIXED_DRIFT[segment % (len(MIXED_DRIFT) - 1)]
    end = MIXED_DRIFT[segment % (len(MIXED_DRIFT) - 1) + 1]
    taken = {k: (segment * n) % len(enc[k]) for k in kinds}
    prompts, regimes = [], []
    for j in range(n):
        f = j / max(n - 1, 1)
        kind = rng.choices(kinds, [a * (1 - f) + b * f for a, b in zip(start, end)])[0]
        prompts.append(enc[kind][taken[kind] % len(enc[kind])])
        taken[kind] += 1
        regimes.append(kind)
    return prompts, regimes


def load_model_costs(value: str) -> tuple[RoundCost, str | None]:
    """`--model-costs`'s round cost (`adaptive_dist.cost_tables.load_model_costs`) -> (table in
    seconds, the file's name or None)."""
    table, _, name = cost_tables.load_model_costs(value)
    return table, name


def interpolate_costs(table: RoundCost, depths: list[int]) -> RoundCost:
    """`table` with a cost for every depth of `depths` it lacks, in every row: linear in the
    verified tokens (steps + 1 per request) between the two measured depths around it, past the
    deepest measured depth extrapolated from the last measured segment (the two deepest). An
    estimate, never a measurement: a run priced by it records the depths in
    `meta.model_costs_interpolated` and every figure it gives is marked interpolated."""
    rows = []
    for row in table.rows:
        known = dict(row)
        measured = sorted(known)
        if len(measured) < 2:
            raise ValueError("--interpolate-depths: a row of the table has fewer than 2 depths")
        for d in depths:
            if d in known:
                continue
            if d < measured[0]:
                raise ValueError(f"--interpolate-depths {d}: below the shallowest measured "
                                 f"depth {measured[0]}")
            lo = max((m for m in measured if m < d), default=None)
            hi = min((m for m in measured if m > d), default=None)
            if hi is None:   # past the deepest: the last segment's slope
                lo, hi = measured[-2], measured[-1]
            # linear in verified tokens (steps + 1): the same as linear in steps
            f = (d - lo) / (hi - lo)
            cost = known[lo] + f * (known[hi] - known[lo])
            if not cost > 0:
                raise ValueError(f"--interpolate-depths {d}: extrapolated cost {cost} <= 0")
            known[d] = cost
        rows.append(tuple(sorted(known.items())))
    return RoundCost(table.buckets, tuple(rows))


restrict_costs = cost_tables.restrict_costs


def spec_of(policy: str, knobs: dict[str, Any] | None = None,
            cost_alpha: float = 0.0) -> AdaptiveConfig:
    """The policy's config; `knobs` (the `--set` values) apply to every adaptive policy alike;
    `cost_alpha` (timed rounds move the cost table) to goodput."""
    if is_static(policy):
        return static_spec(int(policy[len("static"):]))
    if policy == "depth0_head":   # depth 7 priced out of reach; no probe ever due
        return held_at_zero(7)
    if policy == ORACLE:   # the depth-7 chain, priced as the oracle (`ORACLE`)
        return static_spec(7)
    if policy.startswith("goodput"):
        # the shipped defaults (load_config: candidates 0, 1, 3, 7, initial 3)
        spec = load_config(None, "goodput").replace(
            cost_alpha=cost_alpha, per_request=policy in PER_REQUEST + PER_REQUEST_TREES,
            tree_candidates=[tree_entry(t) for t in TREE_CANDIDATES_IN_USE]
            if policy in TREES else (),
            reducer={"goodput_min": "min", "goodput_mix": "mixture"}.get(policy, "weighted_mean"))
    else:
        spec = AdaptiveConfig(reducer="min" if policy == "ema_min" else "weighted_mean")
    return spec.replace(**knobs) if knobs else spec


TREE_CANDIDATES_IN_USE: list[str] = list(TREE_CANDIDATES)
"""`--tree-candidates` of this run (set by `parse_args`)."""


def tree_entry(text: str) -> list:
    """`SxKxN` or `SxKxN:f` -> [S, K, N] or [S, K, N, f] (a goodput `tree_candidates` entry)."""
    shape, _, cover = text.partition(":")
    entry: list = [int(x) for x in shape.split("x")]
    if cover:
        entry.append(float(cover))
    return entry


NODEFER = "/nodefer"


def split_policy(name: str) -> tuple[str, int | None, int | None, dict[str, Any]]:
    """`NAME`, `NAME@N` (a speculating policy's engine at catch-up interval N), either with
    `/nodefer` (the head in every prefill), then any `+KEY=VALUE` (an adaptive setting of this
    policy alone, over `--set`) -> (NAME, N or None, 0 with `/nodefer` else None: the engine's
    default deferral, {KEY: VALUE}); raises ValueError naming what is wrong."""
    name, *sets = name.split("+")
    overrides: dict[str, Any] = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"+{item}: expected +KEY=VALUE (an adaptive setting)")
        overrides[key] = parse_knobs([item])[key]
    defer = None
    if name.endswith(NODEFER):
        name, defer = name[:-len(NODEFER)], 0
    base, sep, rounds = name.partition("@")
    if base not in POLICIES + DIAGNOSTIC and not is_static(base):
        raise ValueError(f"unknown policy {base!r}; allowed: {', '.join(POLICIES + DIAGNOSTIC)}")
    if is_static(base) and overrides:
        raise ValueError(f"{base} has no adaptive settings to override")
    if base == "static0" and (sep or defer is not None):
        raise ValueError("static0 has no draft head, so no catch-up interval or deferral")
    if overrides:   # a bad key or value is refused here, by name, before any engine is built
        spec = spec_of(base)
        AdaptiveConfig.from_dict({**spec.to_dict(), **overrides}, source=f"+ in {name!r}")
    if not sep:
        return base, None, defer, overrides
    if not rounds.isdigit() or int(rounds) < 1:
        raise ValueError(f"@{rounds}: the catch-up interval must be an integer >= 1")
    return base, int(rounds), defer, overrides


def parse_knobs(items: list[str]) -> dict[str, Any]:
    """`key=value` pairs (values parsed as JSON numbers where they are) for AdaptiveConfig."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected key=value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add_overlap_argument(p)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="target directory, or a directory with target/ and eagle/ (as generate)")
    p.add_argument("--draft-model", default=None, help="draft head directory (as generate)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--workloads", nargs="+", default=["transition", "code", "high_entropy",
                                                      "repetitive"], choices=list(WORKLOADS))
    p.add_argument("--policies", nargs="+", default=list(POLICIES), metavar="POLICY[@N][/nodefer][+KEY=VALUE]",
                   help=f"of {', '.join(POLICIES + DIAGNOSTIC)}; default: every policy but the "
                        "diagnostic depth0_head (the goodput engine held at depth 0). NAME@N: "
                        "that policy's engine with --catchup-rounds N (a speculating one; the "
                        "same policy may be listed at several N); NAME/nodefer: with the head "
                        "in every prefill (--defer-prefill-width 0); NAME+KEY=VALUE: an "
                        "adaptive setting of that policy alone (e.g. goodput+reset_nats=0)")
    p.add_argument("--catchup-rounds", type=int, default=EngineConfig.catchup_rounds,
                   metavar="N", help="the engines' catch-up interval of the draft cache at "
                   "depth 0 (as generate's flag; NAME@N overrides it for one policy)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--waves", type=int, default=1,
                   help="prompts per phase as a multiple of the batch; above 1 they arrive "
                        "continuously (a finished request is replaced), 1: one closed batch")
    p.add_argument("--phase-rounds", type=int, default=None, metavar="N",
                   help="every phase is N rounds of the cluster with every replica kept full "
                        "(its regime's prompts cycled), instead of a count of prompts run to "
                        "completion: tokens/s under steady load, where a replica that finishes "
                        "requests sooner takes more, rather than the time to finish a fixed "
                        "set (which the slowest replica sets). Requests in flight at a phase's "
                        "end run on into the next; the last phase's are aborted, uncounted")
    p.add_argument("--length-spread", type=float, default=None,
                   help="request budgets uniform in new_tokens x [1-F, 1+F] (default: 0.5 with "
                        "--waves > 1, else 0)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-runs", type=int, default=1,
                   help="passes over every run before the measured ones, not recorded (the first "
                        "use of a prompt shape compiles kernels)")
    p.add_argument("--cost-alpha", type=float, default=0.0,
                   help="goodput: weight of a timed round in the offset of its cost-table row (0, "
                        "the config's default: the start-up table only)")
    p.add_argument("--set", dest="knobs", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key for every adaptive policy alike (e.g. update_interval=2)")
    p.add_argument("--long-phase-rounds", type=int, default=300, metavar="N",
                   help="transition_long: every phase is N rounds (as --phase-rounds)")
    p.add_argument("--mixed-rounds", type=int, default=None, metavar="N",
                   help="mixed: each of its 4 segments (the regimes' shares drift over each) is "
                        "N rounds with the batch kept full (default: --phase-rounds, else 100)")
    p.add_argument("--mixed-median", type=float, default=200.0,
                   help="mixed: the median of the log-normal output budgets (tokens)")
    p.add_argument("--mixed-sigma", type=float, default=0.8,
                   help="mixed: the log-normal's sigma (ln units; 0.8: ~2%% of budgets above "
                        "5x the median)")
    p.add_argument("--mixed-cap", type=int, default=1200,
                   help="mixed: the largest budget (tokens)")
    p.add_argument("--mixed-seed", type=int, default=0, metavar="N",
                   help="mixed: which stream (N >= 0; 0 the stream of every record before the "
                        "option): changes only the random draws of the workload, each "
                        "request's regime and output budget, the same for every policy of the "
                        "run; recorded as meta.mixed.seed")
    p.add_argument("--model-costs", default=None, metavar="FILE|JSON",
                   help="a cost table file (docs/data/cost_tables/*.json: its "
                        "agreed_round_cost_ms, read as seconds) or a JSON table. "
                        "Price every run's rounds by this round_cost table (as --set "
                        "round_cost=..., e.g. a GPU's start-up table) instead of timing them: "
                        "a phase's seconds become the sum over its rounds of the cost of the "
                        "round's depth in its padded batch's row (wall time kept as "
                        "wall_seconds); the goodput engines decide on it too (no start-up "
                        "measurement). Prefills are priced as the round they run in. For "
                        "comparing decisions off the device the table was measured on")
    p.add_argument("--interpolate-depths", nargs="+", type=int, default=[], metavar="D",
                   help="with --model-costs: give the table a cost for each depth D it lacks, "
                        "linear in verified tokens between the measured depths around it "
                        "(past the deepest: the last measured segment extended); an estimate, "
                        "recorded as meta.model_costs_interpolated and marked in goals.md")
    p.add_argument("--merge", nargs="+", default=[], metavar="RESULTS",
                   help="earlier results.json files whose runs join this run's in the tables and "
                        "plots (the runs are deterministic with --model-costs: a static depth or "
                        "the oracle need not run again beside a changed policy); a (workload, "
                        "batch, policy, repeat) this run also ran is taken from this run. The "
                        "files are named in meta.merged")
    p.add_argument("--round-log", metavar="DIR", default=None,
                   help="write every run's round log (workers.round_log: per round the shape "
                        "and each request's draft and accepted tokens) to "
                        "DIR/<workload>_b<batch>_<policy>[.rank<R>].jsonl")
    p.add_argument("--tree-candidates", nargs="+", default=list(TREE_CANDIDATES),
                   metavar="SxKxN[:f]",
                   help="goodput_tree's trees: steps x top-k x verify tokens per request (the "
                        "root included), optionally ':f' the share of the chain's misses its "
                        "siblings cover (default: adaptive_dist.policy.tree.DEFAULT_COVERAGE)")
    p.add_argument("--out", default="runs/bench_adaptive")
    args = p.parse_args()
    try:
        from adaptive_dist.policy.tree import parse_tree_candidates

        parse_tree_candidates([tree_entry(t) for t in args.tree_candidates])
    except (ValueError, ConfigError) as err:
        p.error(f"--tree-candidates: {err}")
    TREE_CANDIDATES_IN_USE[:] = args.tree_candidates
    args.model_costs_file = None
    args.model_costs_interpolated = []
    args.verify_costs = None
    if args.model_costs is not None:
        try:
            args.model_costs, args.verify_costs, args.model_costs_file = \
                cost_tables.load_model_costs(args.model_costs)
        except (json.JSONDecodeError, ConfigError, OSError) as err:
            p.error(f"--model-costs: {err}")
        measured = set(args.model_costs.steps)
        try:
            args.model_costs = interpolate_costs(args.model_costs, args.interpolate_depths)
        except ValueError as err:
            p.error(str(err))
        args.model_costs_interpolated = sorted(set(args.interpolate_depths) - measured)
    elif args.interpolate_depths:
        p.error("--interpolate-depths: only with --model-costs")
    for flag in ("long_phase_rounds", "mixed_rounds", "mixed_cap"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} {value}: must be >= 1")
    if args.mixed_seed < 0:
        p.error(f"--mixed-seed {args.mixed_seed}: must be >= 0")
    if not (args.mixed_median >= 1 and args.mixed_sigma >= 0):
        p.error("--mixed-median must be >= 1 and --mixed-sigma >= 0")
    if not 0 <= args.cost_alpha <= 1:
        p.error(f"--cost-alpha {args.cost_alpha}: must be in [0, 1]")
    if args.warmup_runs < 0:
        p.error(f"--warmup-runs {args.warmup_runs}: must be >= 0")
    if args.waves < 1:
        p.error(f"--waves {args.waves}: must be >= 1")
    if args.catchup_rounds < 1:
        p.error(f"--catchup-rounds {args.catchup_rounds}: must be >= 1")
    for name in args.policies:
        try:
            base = split_policy(name)[0]
        except ValueError as err:
            p.error(f"--policies {name}: {err}")
        if base in PER_REQUEST + (ORACLE,) + TREES and args.model_costs is not None \
                and args.verify_costs is None:
            p.error(f"--policies {name}: per-request budgets are priced with the verify "
                    f"forward's cost; the --model-costs table has none (agreed_verify_cost_ms)")
        if base == ORACLE and args.model_costs is None:
            p.error(f"--policies {name}: the oracle is priced, so it needs --model-costs")
    if len(set(args.policies)) != len(args.policies):
        p.error(f"--policies {' '.join(args.policies)}: a policy is listed twice")
    if args.phase_rounds is not None and args.phase_rounds < 1:
        p.error(f"--phase-rounds {args.phase_rounds}: must be >= 1")
    if args.length_spread is None:
        args.length_spread = 0.5 if args.waves > 1 or args.phase_rounds else 0.0
    if not 0 <= args.length_spread < 1:
        p.error(f"--length-spread {args.length_spread}: must be in [0, 1)")
    return args


def budgets(n: int, new_tokens: int, spread: float, seed: int = 0) -> list[int]:
    """`n` token budgets drawn uniformly from `new_tokens x [1-spread, 1+spread]` (rounded, at
    least 1), the same for every policy and repeat (seeded)."""
    import random

    rng = random.Random(seed)
    return [max(1, round(new_tokens * (1 + spread * (2 * rng.random() - 1)))) for _ in range(n)]


def run_window(engine: Engine, prompts: list[list[int]], batch: int, rounds: int,
               budget: list[int], active: list[Any]) -> int:
    """`rounds` rounds of the cluster with this replica kept full: before every round the free
    places (at most `batch` in flight) are taken by `prompts`, cycled, the i-th admitted with
    budget `budget[i % len(budget)]`. `active` (updated in place) holds the requests in flight,
    those of an earlier window included: they run on into this one. Returns the tokens the
    window's requests committed during it."""
    sched = engine.scheduler
    touched = list(active)
    before = {id(r): len(r.output_ids) for r in touched}
    for _ in range(rounds):
        while in_flight(sched) < batch:
            i = len(touched) - len(active)
            req = engine.add(prompts[i % len(prompts)],
                             SamplingParams(max_new_tokens=budget[i % len(budget)]), seed=i)
            before[id(req)] = 0
            touched.append(req)
        engine.step(pending=True)
    active[:] = [r for r in touched if not r.finished]
    return sum(len(r.output_ids) - before[id(r)] for r in touched)


def modelled_seconds(rounds: dict[tuple, int], table: RoundCost,
                     verify: Any = None, tree_overhead: float = 0.0,
                     packed: bool = False) -> float:
    """The time `rounds` ((steps, padded batch, verify tokens) -> count) take by `table` (a
    round_cost table, its row picked as the policy picks it: `policy.cost_row`); with `verify`
    (a `VerifyCost`) a round's verify forward is priced by its own tokens
    (`policy.budgets.shape_cost`), else by its row's full chain; `packed`: a tree round's verify
    by its own tokens too (per-request trees: `policy.tree.tree_tokens_cost`), else every row's
    N (`tree_round_cost`)."""
    from adaptive_dist.policy.budgets import shape_cost
    from adaptive_dist.policy.tree import tree_round_cost, tree_tokens_cost

    total = 0.0
    for key, n in sorted(rounds.items()):
        steps, batch = key[0], key[1]
        if len(key) == 5:   # a tree round: (steps, batch, tokens, top-k, tokens per request)
            if verify is None:
                raise ValueError("a tree round is priced with the verify table; --model-costs "
                                 "has none (agreed_verify_cost_ms)")
            total += n * (tree_tokens_cost(table, verify, steps, key[3], key[2], batch,
                                           tree_overhead) if packed else
                          tree_round_cost(table, verify, steps, key[3], key[4], batch,
                                          tree_overhead))
        elif verify is not None and len(key) > 2:
            total += n * shape_cost(table, verify, steps, key[2], batch)
        else:
            total += n * dict(table.rows[cost_row(table, batch)])[steps]
    return total


def oracle_pricing(engine: Engine, verify: Any, group: Any = None) -> collections.Counter:
    """The per-request oracle's shapes (`ORACLE`): every round the engine ran, as the counter
    (steps, padded batch, verify tokens) -> rounds it returns, filled as rounds are reported:
    draft forwards the smallest candidate >= the largest accept (0 when no request accepted a
    draft), verify tokens the rung holding sum(accept + 1); over a cluster (`group`, every rank
    reporting every round) the largest of the ranks', as the ranks would have agreed."""
    from adaptive_dist.shape import token_bucket

    shapes: collections.Counter = collections.Counter()
    planner = engine.planner
    end_round = planner.end_round
    depths = sorted(set(engine.config.spec.candidate_steps) | {0, 1, 3, 7})
    rungs = verify.tokens

    def priced_end_round(accepts: Any, plan: Any = None, **kw: Any) -> None:
        end_round(accepts, plan=plan, **kw)
        top = max(accepts, default=0)
        steps = next(d for d in depths if d >= top) if top else 0
        tokens = token_bucket(sum(a + 1 for a in accepts), rungs) if len(accepts) else 0
        if group is not None and group.size > 1:   # every rank reports every round
            import torch.distributed as dist

            both = torch.tensor([steps, tokens], dtype=torch.int64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group.control_pg)
            steps, tokens = (int(x) for x in both)
        if plan is None or not plan.cluster_requests or not tokens:
            return
        shapes[(steps, plan.batch_pad, tokens)] += 1

    planner.end_round = priced_end_round
    return shapes


def rounds_at_candidate(shapes: dict) -> dict[str, int]:
    """Rounds with requests per candidate: "chainS" or "tree SxKxN" (`RoundStats.rounds_at_shape`
    collapsed over batch and verify tokens; a tree's key carries its top-k and N)."""
    out: collections.Counter = collections.Counter()
    for key, n in shapes.items():
        out[f"tree {key[0]}x{key[3]}x{key[4]}" if len(key) == 5 else f"chain{key[0]}"] += n
    return dict(sorted(out.items()))


def run_phases(engine: Engine, phases: list[list[list[int]]], new_tokens: int,
               device: str, batch: int | None = None, spread: float = 0.0,
               model: RoundCost | None = None, window: int | None = None,
               lengths_of: list[list[int]] | None = None, verify: Any = None,
               oracle: bool = False, group: Any = None) -> dict[str, Any]:
    """Every phase on this replica; per phase: seconds and tokens; and the policy's trace.
    `batch`: run each phase's prompts arriving continuously, at most `batch` at once (None: the
    phase is one closed batch); `spread`: the requests' budgets vary (`budgets`); `model`: a
    phase's seconds are its rounds priced by this table (`modelled_seconds`), its wall time kept
    as `wall_seconds`; `window` (with `batch`): every phase is that many rounds with the replica
    kept full (`run_window`), requests in flight at its end running on into the next, the last
    phase's aborted; `lengths_of`: every phase's budgets (one per prompt) instead of
    `budgets`; `verify`: the verify forward's cost (a round's verify tokens priced as its own);
    `oracle`: price every round as the per-request oracle (`ORACLE`, `oracle_pricing`)."""
    out: dict[str, Any] = {"phases": [], "phase_rounds": []}
    round0 = engine.planner.round
    priced = oracle_pricing(engine, verify, group) if oracle else None
    pauses = GcPauses()
    active: list[Any] = []
    for prompts in phases:
        counter = priced if priced is not None else engine.planner.stats.rounds_at_shape
        shapes = collections.Counter(counter)
        sync(device)
        start = time.perf_counter()
        with pauses:
            lengths = (lengths_of[len(out["phases"])] if lengths_of is not None else
                       budgets(len(prompts), new_tokens, spread, seed=len(out["phases"])))
            if window is not None:
                tokens = run_window(engine, prompts, batch, window, lengths, active)
            else:
                params = [SamplingParams(max_new_tokens=n) for n in lengths]
                reqs = (engine.generate(prompts, params) if batch is None
                        else run_continuous(engine, prompts, batch, params))
                tokens = sum(len(r.output_ids) for r in reqs)
            sync(device)
        phase = {"seconds": time.perf_counter() - start, "tokens": tokens}
        if model is not None:
            ran = counter - shapes
            phase.update(wall_seconds=phase["seconds"], seconds=modelled_seconds(
                ran, model, verify, getattr(engine.config.spec, "tree_overhead", 0.0),
                getattr(engine.config.spec, "per_request", False)))
        out["phases"].append(phase)
        out["phase_rounds"].append(engine.planner.round - round0)
    if window is not None:   # the last window's requests in flight: uncounted, cut short
        for req in active:
            engine.abort(req.rid)
        engine.run()   # every rank, with or without requests left (the rounds are collective)
    stats = engine.planner.stats
    out.update(gc_full_collections=pauses.count, gc_seconds=pauses.seconds)
    out.update(switches=stats.switches, probes=stats.probes, resets=stats.resets,
               timeline=[list(x) for x in stats.steps_timeline],
               rounds_at_steps={str(k): v for k, v in sorted(stats.rounds_at_steps.items())},
               rounds_at_candidate=rounds_at_candidate(stats.rounds_at_shape),
               calibration=[list(c) for c in stats.calibration])
    if engine.planner.round_cost is not None:  # goodput: the table its last decision read
        out.update(timed_rounds=stats.timed_rounds,
                   live_round_cost=engine.planner.round_cost.to_json(),
                   timed_samples=[list(x) for x in stats.timed_samples])
    return out


def main() -> int:
    args = parse_args()
    knobs = parse_knobs(args.knobs)
    torch.set_num_threads(1 if args.device == "cpu" else 4)
    ctx = C.init_distributed(timeout_s=300, backend="gloo" if args.device == "cpu" else None)
    layout = ctx.layout(dp=args.dp)
    world, par = layout.group("world"), ModelParallel.from_layout(layout)
    device = str(ctx.device) if args.device == "cuda" and ctx.device.type == "cuda" else args.device
    target, head = load_pair(args.model, device, draft=args.draft_model, par=par,
                             half=args.device == "cuda")
    top = max(args.batches)
    texts = make_prompts(top * args.waves, seed=2)
    tok = tokenizer(args.model, args.draft_model, target.config.vocab_size)
    enc = encode_prompts(texts, tok.encode)
    longest = round(args.new_tokens * (1 + args.length_spread))
    if "mixed" in args.workloads:
        longest = max(longest, args.mixed_cap)
    context = max(len(p) for ps in enc.values() for p in ps) + longest + 1
    guard = ctx.guard(world, check_every=16) if ctx.distributed else None
    engines = {}
    for policy in args.policies:
        base, catchup, defer, own = split_policy(policy)
        extra = {} if defer is None else {"defer_prefill_width": defer}
        if args.model_costs is not None and base.startswith("goodput"):
            # decided on the prices paid: the table's rows at this policy's candidates
            cands = spec_of(base, {**knobs, **own}).candidate_steps
            own = {"round_cost": restrict_costs(args.model_costs, cands), **own}
            if base in PER_REQUEST + TREES:
                own = {"verify_cost": args.verify_costs, **own}
        engines[policy] = build(spec_of(base, {**knobs, **own}, args.cost_alpha), target, head,
                                batch=top, context=context, device=device,
                                graphs=args.device == "cuda", group=world, guard=guard,
                                catchup_rounds=catchup or args.catchup_rounds, **extra,
                                dp=args.dp, attn_tp=layout.attn_tp,
                                **overlap_of(args, args.device))
        engines[policy].warmup()
    if args.model_costs is not None:
        for policy, engine in engines.items():
            # a tree's steps are priced from the chain rows (adaptive_dist.policy.tree)
            missing = sorted(set(engine.config.spec.candidate_steps)
                             - set(args.model_costs.steps))
            if missing:
                raise SystemExit(f"--model-costs: no cost for depth {missing} of {policy}; the "
                                 f"table has {list(args.model_costs.steps)}")
    settle_heap()
    # the cost tables the goodput engines measured and agreed at start-up (relative costs)
    round_costs = {p: e.config.spec.round_cost.to_json() for p, e in engines.items()
                   if e.config.spec.round_cost is not None}
    jobs = [(w, b, p) for w in args.workloads for b in args.batches for p in args.policies]
    bar = None
    if ctx.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=(args.warmup_runs + args.repeats) * len(jobs), desc="bench_adaptive",
                   unit="run")
    records = []
    for rep in range(-args.warmup_runs, args.repeats):  # negative: warm-up, not recorded
        shift = rep % len(jobs)
        for workload, batch, policy in jobs[shift:] + jobs[:shift]:
            engine = engines[policy]
            spec = engine.config.spec  # goodput: with its agreed round_cost
            engine.planner = RoundCoordinator(spec, world, guard=guard,
                                              verify_ladder=engine.config.verify_ladder)
            engine.pool.apply(spec.initial_steps)
            phases, lengths_of, window = workload_phases(args, workload, batch, enc,
                                                         par.replica)
            if args.round_log is not None and rep >= 0:
                from workers.round_log import RoundLog, round_log_path

                Path(args.round_log).mkdir(parents=True, exist_ok=True)
                name = re.sub(r"[^A-Za-z0-9_.=@+-]", "_", f"{workload}_b{batch}_{policy}")
                engine.round_log = RoundLog(round_log_path(
                    Path(args.round_log) / f"{name}.jsonl", ctx.rank, world.size), ctx.rank)
            res = run_phases(engine, phases, args.new_tokens, args.device,
                             batch if args.waves > 1 or window else None,
                             args.length_spread, args.model_costs, window, lengths_of,
                             verify=args.verify_costs,
                             oracle=split_policy(policy)[0] == ORACLE, group=world)
            if engine.round_log is not None:
                engine.round_log.close()
                engine.round_log = None
            parts: list[Any] = [res]
            if world.size > 1:
                import torch.distributed as dist

                parts = [None] * world.size
                dist.all_gather_object(parts, res, group=world.control_pg)
            if ctx.rank == 0 and rep >= 0:
                records.append(summarise(workload, batch, policy, rep, parts, layout.attn_tp,
                                         warm=WARM.get(workload, 0)))
                # the results so far, every run (a cut-short run keeps what it measured)
                write(args, records, ctx, quiet=True, round_costs=round_costs)
            if bar is not None:
                bar.set_postfix_str(f"{workload} b{batch} {policy}: " + (
                    f"{records[-1]['tokens_per_second']:.0f} tok/s" if rep >= 0 else "warm-up"))
                bar.update()
        if ctx.rank == 0 and rep >= 0:   # the plots and the table of the repeats so far
            write(args, records, ctx, round_costs=round_costs)
    if bar is not None:
        bar.close()
    if ctx.rank == 0 and args.repeats == 0 and args.merge:   # the merged files' table alone
        write(args, records, ctx, round_costs=round_costs)
    for engine in engines.values():
        engine.close()
    if guard is not None:
        guard.close()
    ctx.shutdown()
    return 0


def workload_phases(args: argparse.Namespace, workload: str, batch: int,
                    enc: dict[str, list[list[int]]], replica: int
                    ) -> tuple[list[list[list[int]]], list[list[int]] | None, int | None]:
    """The workload's phases on this replica -> (their prompts, their budgets or None for
    `budgets`' draws, the window in rounds or None)."""
    if workload == "mixed":
        window = args.mixed_rounds or args.phase_rounds or 100
        segments = len(WORKLOADS["mixed"])
        # enough prompts that a segment's stream never cycles: a request a round per place
        n = batch * window
        # --mixed-seed M shifts every draw's seed by M * MIXED_SEED_STRIDE (M = 0: as before)
        shift = args.mixed_seed * MIXED_SEED_STRIDE
        phases = [mixed_stream(enc, n, s, segments, seed=replica + shift)[0]
                  for s in range(segments)]
        lengths = [lognormal_budgets(n, args.mixed_median, args.mixed_sigma, args.mixed_cap,
                                     seed=100 + s + shift) for s in range(segments)]
        return phases, lengths, window
    window = args.long_phase_rounds if workload in LONG else args.phase_rounds
    regime = [phase[replica % 2] for phase in WORKLOADS[workload]]
    return [enc[r][:batch * args.waves] for r in regime], None, window


def summarise(workload: str, batch: int, policy: str, rep: int, parts: list[dict],
              attn_tp: int, warm: int = 0) -> dict[str, Any]:
    """One run's record; `warm`: leading phases run but left out of every figure but the
    timeline (`warmup_phases` keeps them)."""
    leaders, lead = parts[::attn_tp], parts[0]
    phases, warmup = [], []
    for i, ph in enumerate(lead["phases"]):
        tokens = sum(p["phases"][i]["tokens"] for p in leaders)
        (warmup if i < warm else phases).append({"tokens": tokens, "seconds": ph["seconds"],
                                                 "tokens_per_second": tokens / ph["seconds"]})
    total_s = sum(p["seconds"] for p in phases)
    changes = max(len(phases) - 1, 1)
    return {"workload": workload, "batch": batch, "policy": policy, "repeat": rep,
            "tokens_per_second": sum(p["tokens"] for p in phases) / total_s, "phases": phases,
            "warmup_phases": warmup,
            "switches": lead["switches"], "switches_per_phase_change": lead["switches"] / changes,
            "probes": lead["probes"],
            "resets": sum(p.get("resets", 0) for p in parts),   # goodput: every rank's
            "timed_rounds": lead.get("timed_rounds"), "live_round_cost": lead.get("live_round_cost"),
            "timed_samples": lead.get("timed_samples"),
            "switches_per_hour": lead["switches"] * 3600 / total_s,
            "gc_full_collections": sum(p.get("gc_full_collections", 0) for p in parts),
            "gc_seconds": max(p.get("gc_seconds", 0.0) for p in parts),
            "rounds_at_steps": lead["rounds_at_steps"], "timeline": lead["timeline"],
            "rounds_at_candidate": lead.get("rounds_at_candidate"),
            "calibration": [[sum(p["calibration"][i][j] for p in leaders) for j in range(3)]
                            for i in range(10)] if "calibration" in lead else None,
            "phase_rounds": lead["phase_rounds"]}


def analyse(records: list[dict]) -> dict[str, Any]:
    """Medians per (workload, batch, policy), the oracle, and the goals."""
    out: dict[str, Any] = {}
    for w, b in sorted({(r["workload"], r["batch"]) for r in records}):
        runs = [r for r in records if (r["workload"], r["batch"]) == (w, b)]
        pols: dict[str, Any] = {}
        for p in dict.fromkeys(r["policy"] for r in runs):
            mine = [r for r in runs if r["policy"] == p]
            pols[p] = {"tokens_per_second": spread([r["tokens_per_second"] for r in mine]),
                       "phase_tokens_per_second": [
                           statistics.median(r["phases"][i]["tokens_per_second"] for r in mine)
                           for i in range(len(mine[0]["phases"]))],
                       "switches_per_phase_change": spread([r["switches_per_phase_change"]
                                                         for r in mine]),
                       "probes_per_phase_change": spread([
                           r["probes"] / max(len(r["phases"]) - 1, 1) for r in mine]),
                       "switches_per_hour": spread([r["switches_per_hour"] for r in mine]),
                       "rounds_at_steps": mine[0]["rounds_at_steps"]}
        static = {p: v for p, v in pols.items() if is_static(p)}
        entry: dict[str, Any] = {"policies": pols}
        if static:
            phases = len(next(iter(static.values()))["phase_tokens_per_second"])
            best_phase = [max(v["phase_tokens_per_second"][i] for v in static.values())
                          for i in range(phases)]
            tokens = [next(r for r in runs)["phases"][i]["tokens"] for i in range(phases)]
            oracle = sum(tokens) / sum(t / s for t, s in zip(tokens, best_phase))
            best_static = max(v["tokens_per_second"]["median"] for v in static.values())
            entry.update(oracle_tokens_per_second=oracle, oracle_phase=best_phase,
                         best_static=best_static)
            entry["vs"] = {p: {"vs_best_static": v["tokens_per_second"]["median"] / best_static,
                               "vs_oracle": v["tokens_per_second"]["median"] / oracle,
                               "worst_phase_vs_oracle": min(
                                   a / o for a, o in zip(v["phase_tokens_per_second"],
                                                         best_phase))}
                           for p, v in pols.items()}
        out[f"{w} | b={b}"] = entry
    return out


def merged_records(files: list[str], records: list[dict]) -> list[dict]:
    """`records` after the runs of the results files `files` (`--merge`) that this run did not
    run itself (same workload, batch, policy and repeat), in the files' order."""
    key = lambda r: (r["workload"], r["batch"], r["policy"], r["repeat"])   # noqa: E731
    mine = {key(r) for r in records}
    old = []
    for f in files:
        for r in json.loads(Path(f).read_text())["runs"]:
            if key(r) not in mine:
                mine.add(key(r))
                old.append(r)
    return old + records


def write(args: argparse.Namespace, records: list[dict], ctx: Any, quiet: bool = False,
          round_costs: dict[str, Any] | None = None) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = merged_records(args.merge, records)
    analysis = analyse(records)
    meta = {"world": ctx.world_size, "dp": args.dp, "device": args.device,
            "overlap": bool(overlap_of(args, args.device)),
            "gpu": gpu_name(args.device),
            "torch": torch.__version__, "new_tokens": args.new_tokens, "waves": args.waves,
            "length_spread": args.length_spread, "catchup_rounds": args.catchup_rounds,
            "phase_rounds": args.phase_rounds,
            "knobs": parse_knobs(args.knobs), "cost_alpha": args.cost_alpha,
            "warmup_runs": args.warmup_runs, "round_cost": round_costs, "repeats": args.repeats,
            # not None: every phase's "seconds" is this table's price of its rounds
            "model_costs": args.model_costs.to_json() if args.model_costs is not None else None,
            "model_costs_file": args.model_costs_file,
            # depths whose price is interpolated, not measured (`interpolate_costs`)
            "model_costs_interpolated": args.model_costs_interpolated,
            "long_phase_rounds": args.long_phase_rounds,
            "mixed": {"rounds": args.mixed_rounds or args.phase_rounds or 100,
                      "median": args.mixed_median, "sigma": args.mixed_sigma,
                      "cap": args.mixed_cap, "drift": MIXED_DRIFT, "seed": args.mixed_seed},
            "warm_phases": {w: WARM[w] for w in args.workloads if w in WARM},
            "repeats_done": len({r["repeat"] for r in records}),
            "workloads": {w: WORKLOADS[w] for w in args.workloads},
            "command": " ".join(sys.argv), "merged": list(args.merge),
            "tree_candidates": list(TREE_CANDIDATES_IN_USE)}
    goals = goal_rows(analysis)
    write_json(out / "results.json", {"meta": meta, "analysis": analysis, "goals": goals,
                                      "runs": records})
    (out / "goals.md").write_text(goals_markdown(goals, meta["command"],
                                                 meta["model_costs_interpolated"]))
    if quiet:
        return
    for key, entry in analysis.items():
        plot(key, entry, records, out / (key.replace(" | b=", "_b") + ".png"),
             modelled=args.model_costs is not None)
        print(f"== {key}: best static {entry.get('best_static', 0):.0f} tok/s, oracle "
              f"{entry.get('oracle_tokens_per_second', 0):.0f}"
              + (" (time: the --model-costs table's price)" if args.model_costs else ""))
        for p, v in entry["policies"].items():
            vs = entry.get("vs", {}).get(p, {})
            print(f"   {p:<15}{v['tokens_per_second']['median']:>9.0f} tok/s  "
                  f"x{vs.get('vs_best_static', float('nan')):.2f} best static  "
                  f"x{vs.get('vs_oracle', float('nan')):.2f} oracle  worst phase "
                  f"x{vs.get('worst_phase_vs_oracle', float('nan')):.2f}  switches/phase change "
                  f"{v['switches_per_phase_change']['median']:.1f}")
    print(f"wrote {out / 'results.json'}")


def goal_of(workload: str, batch: int, policy: str) -> tuple[float, float | None] | None:
    """The goal a policy's row is judged by: issue 32's for the per-request policies
    (`PER_REQUEST_GOALS`), issue 26's (`GOALS`) for the others; None: no goal."""
    base = split_policy(policy)[0]
    table = (PER_REQUEST_GOALS if base in PER_REQUEST else TREE_GOALS if base in TREES
             else GOALS)
    goal = table.get(workload)
    if isinstance(goal, dict):
        goal = goal.get(batch)
    return goal


def goal_rows(analysis: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (workload with a goal, batch, adaptive policy): its ratios and whether its goal holds
    (`goal_of`); beside each, the per-request oracle's tokens/s when it ran (`ORACLE`)."""
    rows = []
    for key, entry in analysis.items():
        workload, batch = key.split(" | b=")
        if "vs" not in entry:
            continue
        pr_oracle = entry["policies"].get(ORACLE, {}).get("tokens_per_second", {}).get("median")
        for policy, vs in entry["vs"].items():
            base = split_policy(policy)[0]
            goal = goal_of(workload, int(batch), policy)
            if is_static(base) or base == ORACLE or goal is None:
                continue
            least, least_phase = goal
            met = vs["vs_best_static"] >= least and (
                least_phase is None or vs["worst_phase_vs_oracle"] >= least_phase)
            best = max((p for p in entry["policies"] if is_static(p)),
                       key=lambda p: entry["policies"][p]["tokens_per_second"]["median"])
            tps = entry["policies"][policy]["tokens_per_second"]["median"]
            rows.append({"workload": workload, "batch": int(batch), "policy": policy,
                         "tokens_per_second": tps,
                         "best_static": entry["best_static"], "best_static_policy": best,
                         "oracle": entry["oracle_tokens_per_second"],
                         "per_request_oracle": pr_oracle,
                         "vs_per_request_oracle": tps / pr_oracle if pr_oracle else None,
                         "vs_best_static": vs["vs_best_static"], "vs_oracle": vs["vs_oracle"],
                         "worst_phase_vs_oracle": vs["worst_phase_vs_oracle"],
                         "phase_vs_oracle": [a / o for a, o in zip(
                             entry["policies"][policy]["phase_tokens_per_second"],
                             entry["oracle_phase"])],
                         "goal": {"vs_best_static": least, "worst_phase_vs_oracle": least_phase},
                         "met": met})
    return rows


def goals_markdown(rows: list[dict[str, Any]], command: str,
                   interpolated: list[int] | None = None) -> str:
    """The goal rows as a markdown table (tokens/s of the run's pricing), with the command;
    `interpolated`: the depths priced by `interpolate_costs` (named above the table)."""
    note = ([f"**Interpolated prices**: depths {', '.join(map(str, interpolated))} are not in the "
             "measured table; their cost is interpolated (linear in verified tokens; past the "
             "deepest measured depth, the last segment extended). Every figure of a policy "
             "that runs them is an estimate, not a measurement.", ""] if interpolated else [])
    lines = [*note, f"Command: `{command}`", "",
             "| workload | batch | policy | tok/s | best static (depth) | x best static | "
             "worst phase x oracle | x per-request oracle | goal | met |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        g = r["goal"]
        goal = f">= {g['vs_best_static']:.2f}x static" + (
            f", >= {g['worst_phase_vs_oracle']:.2f}x oracle per phase"
            if g["worst_phase_vs_oracle"] is not None else "")
        lines.append(f"| {r['workload']} | {r['batch']} | {r['policy']} | "
                     f"{r['tokens_per_second']:.0f} | {r['best_static']:.0f} "
                     f"({r['best_static_policy'][len('static'):]}) | {r['vs_best_static']:.3f} | "
                     f"{r['worst_phase_vs_oracle']:.3f} | "
                     f"{'' if r.get('vs_per_request_oracle') is None else format(r['vs_per_request_oracle'], '.3f')} | {goal} | "
                     f"{'yes' if r['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(key: str, entry: dict, records: list[dict], path: Path, modelled: bool = False) -> None:
    plt = pyplot()
    workload, batch = key.split(" | b=")
    pols = entry["policies"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    names = list(pols)
    medv = [pols[n]["tokens_per_second"]["median"] for n in names]
    err = [[m - pols[n]["tokens_per_second"]["min"] for n, m in zip(names, medv)],
           [pols[n]["tokens_per_second"]["max"] - m for n, m in zip(names, medv)]]
    ax.bar(names, medv, yerr=err, capsize=3)
    if "oracle_tokens_per_second" in entry:
        ax.axhline(entry["oracle_tokens_per_second"], color="k", ls="--", label="oracle")
        ax.legend()
    ax.set_title(f"{workload}, batch {batch}: tokens/s (median, min-max)" if not modelled else
                 f"{workload}, batch {batch}: tokens per second of the cost table")
    ax.tick_params(axis="x", rotation=30)
    ax.grid(axis="y", alpha=0.3)
    for n in names:
        if n.startswith(("ema", "goodput")):
            run = next(r for r in records if (r["workload"], r["batch"], r["policy"])
                       == (workload, int(batch), n))
            pts = run["timeline"] + [[run["phase_rounds"][-1], run["timeline"][-1][1]]]
            ax2.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=n)
            for x in run["phase_rounds"][:-1]:
                ax2.axvline(x, color="gray", lw=0.5)
    ax2.set_xlabel("round (grey: phase changes)")
    ax2.set_ylabel("depth in force")
    ax2.legend()
    ax2.grid(alpha=0.3)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
