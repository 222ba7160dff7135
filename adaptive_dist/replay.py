"""Consensus-only mode: the adaptive layer without a model, replaying acceptance traces.

Every rank replays its own trace (capping each request's accept length at the steps in force),
runs the real per-round consensus collective over the DP group, and records its decisions. At the
end rank 0 writes one JSON line per rank per counted round and prints a summary whose last line
starts ``lockstep OK`` — or every rank raises ``DivergenceError``.
"""
from __future__ import annotations

import json
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from collectives import CollectiveTimeoutError, DistContext, DivergenceError, Group, LockstepGuard
from adaptive_dist import __version__, consensus
from adaptive_dist.config import AdaptiveConfig, ConfigError
from adaptive_dist.coordinator import RoundCoordinator, RoundOutcome, RoundReport
from adaptive_dist.policy import DepthPolicy, Shadow, depth_policy
from adaptive_dist.outputs import OutputError, check_output_dir, check_output_file, write_lines
from adaptive_dist.startup import (agree_settings, all_ranks_or_none, exchange,
                                   missing_inputs_error)
from adaptive_dist.shape import token_ladder
from adaptive_dist.trace import RANK_FILE, TraceRound


@dataclass
class ReplayResult:
    records: list[dict]                       # this rank's output lines
    rounds: int
    decision_digest: int
    consensus_us: list[float] = field(default_factory=list)
    coordinator: Optional[RoundCoordinator] = None


def outcome_record(outcome: RoundOutcome, rank: int, policy: DepthPolicy) -> dict:
    """One output line: the round, the rank, the steps that ran, the EMAs, whether it switched
    and went through the graphs, and what ``policy`` adds (``DepthPolicy.outcome_fields``;
    goodput: the rank's ``local_ema_fail``, the cluster's ``accept_rate``, the ``cost_row`` and
    whether the switch is a ``probe``)."""
    d = outcome.decision
    rec = {"round": outcome.round, "rank": rank, "steps": outcome.steps,
           "local_ema": outcome.local_ema, "global_ema": d.global_ema,
           "switched": d.switched, "graph": outcome.use_graph}
    rec.update(policy.outcome_fields(d, outcome.local_ema_fail))
    return rec


def require_round_cost(config: AdaptiveConfig) -> AdaptiveConfig:
    """Consensus-only mode runs no model, so nothing can measure what a policy needs at start-up
    (``DepthPolicy.start_up_needs``; goodput: ``round_cost``): the config file must give it
    (``adaptive_dist.startup.missing_inputs_error``). Returns ``config``."""
    error = missing_inputs_error(config)
    if error is not None:
        raise error
    trees = getattr(config, "tree_candidates", ()) if config.policy == "goodput" else ()
    if trees:   # a trace's accept lengths are a chain's: what a tree accepts is not in it
        raise ConfigError(f"tree_candidates={[list(t[:3]) for t in trees]}: consensus-only mode "
                          f"replays chains' accept lengths (a trace holds what each request "
                          f"would accept with unlimited steps of a chain); draft trees need the "
                          f"engine (generate, serve)")
    return config


def shadow_checks(full: list[int], steps: int) -> Optional[tuple[int, int, int]]:
    """A depth-0 round's shadow checks from its trace: one check per request, a hit when its
    unlimited accept length is >= 1 (its first draft would have been accepted); None at depth > 0
    or for an idle round. Only a policy that measures nothing at depth 0 (goodput) reads them."""
    if steps != 0 or not full:
        return None
    return Shadow(sum(1 for a in full if a >= 1), len(full), len(full))


def replay(trace: list[TraceRound], config: AdaptiveConfig, group: Group,
           guard: Optional[LockstepGuard] = None, progress=None,
           verify_ladder: Optional[list[int]] = None) -> ReplayResult:
    """Replay ``trace`` on this rank in lockstep with the other members of ``group``
    (``verify_ladder``: the token rungs per-request budgets choose from, the same on every
    rank). With per-request budgets each request's accept length is capped at its own budget,
    and requests are known by their ``ids`` (else their place in the round)."""
    ctrl = RoundCoordinator(config, group, guard=guard, clock=None,  # replays are untimed
                            verify_ladder=verify_ladder)
    records: list[dict] = []
    times: list[float] = []
    r = 0
    while True:
        item = trace[r] if r < len(trace) else None
        full = list(item.accept) if item is not None else []
        tokens = item.num_tokens if item is not None and item.num_tokens is not None else len(full)
        can_graph = item.can_graph if item is not None else True
        t0 = time.perf_counter()
        ids = (tuple(item.ids) if item is not None and item.ids is not None
               else tuple(range(len(full))))
        with guard.round(r) if guard is not None else nullcontext():
            plan = ctrl.begin_round(RoundReport(len(full), tokens, can_graph, done=item is None,
                                                requests=ids))
        times.append((time.perf_counter() - t0) * 1e6)
        out = ctrl.last_outcome
        if out is not None and out.decision.counted:
            records.append(outcome_record(out, group.global_rank, ctrl.policy))
        if plan.all_done:
            break
        budget = plan.budget_of()
        ctrl.end_round([min(a, budget[i]) for a, i in zip(full, ids)],
                       shadow=shadow_checks(full, plan.steps))
        r += 1
        if progress is not None:
            progress.update(1)
    if guard is not None:
        guard.check(ctrl.round, ctrl.decision_digest())
    return ReplayResult(records, r, ctrl.decision_digest(), times, ctrl)


def collect_on_first(records: list[dict], group: Group) -> Optional[list[dict]]:
    """Gather every rank's records on the group's first member (control group)."""
    if group.size == 1:
        return sorted(records, key=lambda x: (x["round"], x["rank"]))
    parts: Optional[list] = [None] * group.size if group.is_first else None
    try:
        dist.gather_object(records, parts, dst=group.ranks[0], group=group.control_pg)
    except Exception as exc:
        from collectives.guard import short_cause

        raise CollectiveTimeoutError(
            f"rank {group.global_rank}: gathering the decisions on rank {group.ranks[0]} failed "
            f"({short_cause(exc)}); a peer stopped or is unreachable") from None
    if not group.is_first:
        return None
    merged = [rec for part in parts for rec in part]
    return sorted(merged, key=lambda x: (x["round"], x["rank"]))


def verify_lockstep(result: ReplayResult, group: Group) -> None:
    """Every rank must have made the same decisions (compared digests); raise otherwise."""
    if group.size == 1:
        return
    views = exchange((result.rounds, result.decision_digest), group, "comparing the decisions")
    if len(set(views)) > 1:
        detail = ", ".join(f"rank {r}: {v[0]} rounds, digest {v[1]:#x}"
                           for r, v in zip(group.ranks, views))
        raise DivergenceError(f"ranks finished with different decision histories: {detail}")


def summary(records: list[dict], result: ReplayResult, world: int, config: AdaptiveConfig,
            guard: Optional[LockstepGuard], recorded: int) -> str:
    """Human-readable summary (rank 0); the last line starts with 'lockstep OK'."""
    rank0 = [r for r in records if r["rank"] == 0]
    counted = len(rank0)
    switches = sum(1 for r in rank0 if r["switched"])
    ctrl = result.coordinator
    lines = [
        f"consensus-only replay: {world} rank(s), policy {config.policy}, reducer {config.reducer}, "
        f"candidates {list(config.candidate_steps)}, initial steps {config.initial_steps}",
        f"rounds {result.rounds}, counted {counted}, switches {switches}",
    ]
    if ctrl is not None:
        timeline = " -> ".join(f"r{r}:{s}" for r, s in ctrl.stats.steps_timeline[:12])
        more = len(ctrl.stats.steps_timeline) - 12
        lines.append(f"steps timeline: {timeline}" + (f" ... (+{more})" if more > 0 else ""))
        total = sum(ctrl.stats.rounds_at_steps.values()) or 1
        share = ", ".join(f"{s}: {100 * n / total:.0f}%"
                          for s, n in sorted(ctrl.stats.rounds_at_steps.items()))
        lines.append(f"share of rounds at each depth: {share}")
    graph = sum(1 for r in rank0 if r["graph"])
    lines.append(f"counted rounds on the CUDA-graph path: {graph}/{counted}")
    by_rank: dict[int, list[float]] = {}
    for r in records:
        by_rank.setdefault(r["rank"], []).append(r["local_ema"])
    ema = ", ".join(f"rank {k}: {v[-1]:.3f}" for k, v in sorted(by_rank.items()))
    lines.append(f"final local EMA: {ema or 'none (no round had requests on any rank)'}")
    lines.extend(depth_policy(config).summary_lines(records))
    if result.consensus_us:
        lines.append(f"consensus collective (rank 0): median {statistics.median(result.consensus_us):.1f} us "
                     f"per round")
    checks = guard.checks if guard is not None else 0
    lines.append(f"lockstep OK: {world} rank(s) made identical decisions in {result.rounds} rounds "
                 f"(digest {result.decision_digest:#014x}, {checks} hash checks, "
                 f"{recorded} collectives recorded per rank)")
    return "\n".join(lines)


def write_records(path: str, records: list[dict], flag: str = "--out") -> int:
    """Write ``records`` as JSON lines, atomically (see ``adaptive_dist.outputs.write_lines``)."""
    return write_lines(path, (json.dumps(rec) for rec in records), flag)


def record_log_path(record_dir: str, rank: int) -> str:
    return str(Path(record_dir) / f"collectives.rank{rank}.jsonl")


def check_outputs(out: Optional[str], record_dir: Optional[str], trace_dir: str,
                  writes_out: bool) -> None:
    """Start-up checks of the output paths this rank writes (``--out`` on the writer only: on a
    multi-node job it is a path on that rank's node), naming the flag."""
    if record_dir is not None:
        check_output_dir(record_dir, "--record-dir")
    if out is None or not writes_out:
        return
    check_output_file(out, "--out")
    p, d = Path(out), Path(trace_dir)
    if d.is_file() and p.resolve() == d.resolve():
        raise OutputError(f"--out {out!r} would overwrite the round log --trace {trace_dir!r}")
    if d.is_dir() and p.parent.resolve() == d.resolve() and RANK_FILE.fullmatch(p.name):
        raise OutputError(f"--out {out!r} would overwrite a trace file of --trace {trace_dir!r}")


def run_consensus(ctx: DistContext, trace_dir: str, policy: str, config_path: Optional[str],
                  initial_steps: Optional[int], out: Optional[str], show_progress: bool = True,
                  record_dir: Optional[str] = None) -> str:
    """The whole consensus-only job on one rank; returns rank 0's summary ('' elsewhere).

    Start-up, on every rank and in this order, each step refused on every rank with the same
    message if it fails on any: the configuration, the agreement of every setting that changes
    the collectives or the outputs, the output paths, the traces. Then the replay, and the
    outputs, written atomically; a failed write fails every rank.
    """
    from adaptive_dist.config import load_config
    from adaptive_dist.trace import load_trace

    layout = ctx.layout(dp=ctx.world_size, tp=ctx.world_size)
    world, dp = layout.group("world"), layout.group("dp")
    config = all_ranks_or_none(
        lambda: require_round_cost(load_config(config_path, policy, initial_steps)), world,
        "configuration check")
    agree_settings(consensus_settings(ctx, config, show_progress, out, record_dir), world,
                   "consensus")
    all_ranks_or_none(lambda: check_outputs(out, record_dir, trace_dir, world.is_first),
                      world, "checking the output paths")
    trace = all_ranks_or_none(lambda: load_trace(trace_dir, ctx.rank, ctx.world_size), world,
                              "loading traces")
    sizes = exchange((len(trace), max((len(t.accept) for t in trace), default=0)), world,
                     "loading traces")
    longest = max(n for n, _ in sizes)
    # per-request budgets choose verify tokens up to every rank's largest round at the deepest
    # candidate (the same rungs on every rank)
    ladder = list(token_ladder(max(max(b for _, b in sizes), 1) * (config.max_steps + 1)))
    guard = ctx.guard(world, check_every=config.lockstep_check_every) if ctx.recorder else None
    bar = _progress(longest) if show_progress and world.is_first else None
    try:
        result = replay(trace, config, dp, guard, bar, ladder)
    finally:
        if bar is not None:
            bar.close()
        if guard is not None:
            guard.close()
    verify_lockstep(result, world)
    merged = collect_on_first(result.records, world)

    def write_outputs() -> None:
        if record_dir is not None and ctx.recorder is not None:
            write_lines(record_log_path(record_dir, ctx.rank), ctx.recorder.json_lines(),
                        "--record-dir")
        if merged is not None and out:
            write_records(out, merged)

    all_ranks_or_none(write_outputs, world, "writing the outputs",
                      consequence="the job failed on every rank")
    if merged is None:
        return ""
    recorded = ctx.recorder.count if ctx.recorder else 0
    return summary(merged, result, ctx.world_size, config, guard, recorded)


def consensus_settings(ctx: DistContext, config: AdaptiveConfig, show_progress: bool,
                       out: Optional[str], record_dir: Optional[str]) -> dict:
    """Everything of a consensus run that changes the sequence of collectives or the outputs:
    the effective configuration (policy and initial steps included), the flags, the consensus
    vector's format and the software versions. Compared across ranks by ``agree_settings``."""
    return {
        **config.to_dict(),
        "--timeout": ctx.timeout_s,
        "--strict-lockstep": bool(ctx.recorder and ctx.recorder.strict),
        "--no-progress": not show_progress,
        "--out given": out is not None,
        "--record-dir given": record_dir is not None,
        "backend": ctx.backend,
        "consensus vector format": [consensus.MAGIC, len(consensus.FIELDS)],
        "adaptive_dist version": __version__,
        "torch version": torch.__version__,
    }


def _progress(total: int):
    """A progress bar over the longest trace (the first rank only)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="replay", unit="round", mininterval=0.5, leave=False)
