"""The engine of one rank: continuous batching, round by round, in lockstep with the cluster.

One engine step (every rank of the cluster, idle ones too):
1. admit waiting requests that fit (a batch slot, their worst-case KV pages);
2. `plan = planner.begin_round(RoundReport(...))`: the round's one collective; it agrees the depth
   (a switch decided at the previous round is applied here by swapping the pre-built runtime
   state), the graph path and every padded shape;
3. if any rank admitted requests: one prefill forward of the agreed size on every rank;
4. if any rank runs requests: one speculative round (or plain decode at depth 0) of the agreed
   batch on every rank — a rank without requests runs it on dummy rows;
5. read the round's results (one host synchronisation), commit them to the requests,
   `planner.end_round(accepts, plan)` (local; `planner.ran(...)` told it at launch what this rank
   ran); retire finished requests (KV back).

With `overlap` (`EngineConfig.overlap`, on by default on CUDA from the command line) step 5 of
round r runs after round r+1 is launched: while the device computes round r+1, the host reads
and commits round r, retires what finished and agrees round r+2. What it costs, the same on
every rank: a request that finished in round r runs round r+1 too (its results are dropped;
admission reserves KV for that extra round), and the planner decides with statistics one round
older. Every rank overlaps or none does (the setting is agreed at start-up).

`build_engine` builds the stack from an `EngineConfig` and a loaded target and head: the worker
and its tiers, the effective speculative settings (what the policy derives and measures at
start-up, `adaptive_dist.startup.prepare` over this engine's `EngineFacts`), the planner (a
`RoundCoordinator`), then the engine.
"""
from __future__ import annotations

import atexit
import gc
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from adaptive_dist.failures import say
from adaptive_dist.coordinator import Executed, RoundCoordinator, RoundPlan, RoundReport, RoundStats
from adaptive_dist.policy import Shadow
from adaptive_dist.shape import RoundShape
from adaptive_dist.startup import prepare
from collectives import Group, LockstepGuard
from workers import startup_log
from workers.attention import make_backend
from workers.config import EngineConfig
from workers.kv_cache import PageAllocator
from workers.round_log import RoundLog
from workers.runtime_state import RuntimeStatePool
from workers.sampling import SamplingParams
from workers.scheduler import Request, Scheduler
from workers.worker import EagleWorker


class RoundPlanner(Protocol):
    """Everything the engine asks before and tells after every round (`RoundCoordinator` is one).
    """

    round: int           # rounds begun so far (the guard names a hung round by it)
    steps: int           # the depth in force
    stats: RoundStats    # the run's record of the depth: switches, steps timeline

    def begin_round(self, report: RoundReport) -> RoundPlan:
        """Agree this round's plan with the other ranks (every rank, every round, idle too)."""

    def ran(self, executed: Executed) -> None:
        """What this rank launched for the round begun last: its shape, graph, bucket."""

    def end_round(self, accepts: Sequence[int], plan: RoundPlan | None = None,
                  shadow: tuple[int, int, int] | None = None,
                  requests: Sequence[int] | None = None,
                  shadow_rows: Sequence[tuple[int, int]] | None = None) -> None:
        """Report this rank's accept lengths of round `plan` (of `requests`, by id) and (depth 0
        with a head, after a catch-up) its shadow checks (hits, checks, rows; per request
        `shadow_rows`) (local only)."""


@dataclass
class EngineStats:
    """Acceptance and throughput of one run on this rank. The depth's record (switches, the steps
    timeline) is the planner's (`run`, its `RoundStats`), read here, not kept twice."""

    run: RoundStats = field(default_factory=RoundStats)   # the planner's
    accept_histogram: Counter = field(default_factory=Counter)  # accept length -> request-rounds
    rounds: int = 0             # rounds in which this rank ran requests
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    graph_rounds: int = 0       # rounds that ran through CUDA graphs
    round_seconds: float = 0.0  # wall time of every round (idle ones too)
    plan_seconds: float = 0.0   # of which: agreeing the plan (the round's one collective)

    @property
    def switches(self) -> int:
        """Depth switches so far (the planner's count)."""
        return self.run.switches

    @property
    def steps_timeline(self) -> list[tuple[int, int]]:
        """(round, steps) at the start and at every switch (the planner's)."""
        return self.run.steps_timeline

    @property
    def mean_accept_length(self) -> float:
        """Accepted draft tokens per request per round (bonus excluded); 0 without rounds."""
        total = sum(self.accept_histogram.values())
        return sum(k * v for k, v in self.accept_histogram.items()) / total if total else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens (all requests) per second of engine time."""
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {"mean_accept_length": self.mean_accept_length,
                "accept_histogram": {str(k): v for k, v in sorted(self.accept_histogram.items())},
                "tokens_per_second": self.tokens_per_second, "switches": self.switches,
                "rounds": self.rounds, "graph_rounds": self.graph_rounds,
                "generated_tokens": self.generated_tokens, "elapsed_s": self.elapsed_s,
                "round_seconds": self.round_seconds, "plan_seconds": self.plan_seconds,
                "steps_timeline": [list(x) for x in self.steps_timeline]}


@dataclass
class _Launched:
    """A round the engine launched: its plan, the worker's handle (None: no forward ran) and
    what this rank ran (reported to the planner at launch)."""

    plan: RoundPlan
    handle: Any
    executed: Executed


class Engine:
    """Continuous batching over one `EagleWorker`, each round planned with the cluster."""

    def __init__(self, config: EngineConfig, worker: EagleWorker, scheduler: Scheduler,
                 planner: RoundPlanner, guard: LockstepGuard | None = None,
                 pool: RuntimeStatePool | None = None) -> None:
        self.config, self.worker, self.scheduler = config, worker, scheduler
        self.guard = guard
        self.round_log: RoundLog | None = None   # --round-log: this rank's lines
        self.stats = EngineStats(planner.stats)
        self.planner = planner
        self.live: dict[int, Request] = {}   # queued or running; finished ones leave at retire
        self.last_plan: RoundPlan | None = None
        self._next_rid = 0
        self._all_done = False
        self._launched: _Launched | None = None   # overlap: the round in flight
        # the engine applies the depth the planner decides: one pre-built state per tier
        self.pool = pool if pool is not None else build_tiers(worker, config)

    @property
    def planner(self) -> RoundPlanner:
        """What plans every round with the cluster; the engine's statistics read its record."""
        return self._planner

    @planner.setter
    def planner(self, planner: RoundPlanner) -> None:
        self._planner = planner
        self.stats.run = planner.stats

    def add(self, prompt_ids: list[int], params: SamplingParams, seed: int = 0,
            rid: int | None = None) -> Request:
        """Queue a request (validated now; an impossible request raises `ValueError`). `rid`
        defaults to the next free number; a caller-chosen one must not be in use."""
        rid = self._next_rid if rid is None else rid
        if rid in self.live:
            raise ValueError(f"request id {rid} is already in use")
        req = Request(rid, list(prompt_ids), params, seed=seed)
        if params.processed and getattr(self.worker, "tree", None) is not None:
            raise ValueError(f"request {rid}: top-k, min_tokens, penalties and logprobs are not "
                             f"implemented with draft trees (--speculative-eagle-topk "
                             f"{self.config.speculative_eagle_topk})")
        if params.processed and getattr(self.worker, "trees", None):
            raise ValueError(f"request {rid}: top-k, min_tokens, penalties and logprobs are not "
                             f"implemented with draft trees (tree_candidates)")
        self.scheduler.add(req)
        self.live[rid] = req
        self._next_rid = max(self._next_rid, rid + 1)
        return req

    def abort(self, rid: int) -> bool:
        """Finish request `rid` now with reason "abort" (a client went away). A waiting request
        leaves the queue; a running one is retired at the next round boundary, which gives its KV
        back. Returns whether the request was still unfinished."""
        req = self.live.get(rid)
        if req is None or req.finished:
            return False
        self.scheduler.abort(req)
        return True

    def step(self, seq: int = 0, leave: bool = False, pending: bool = False) -> list[Request]:
        """One round (admit, agree, prefill, speculate, retire); returns the requests that
        finished. Every rank of the cluster calls it every round, with or without requests.
        Serving passes `seq` (request messages received), `leave` (stop wanted) and `pending`
        (messages received but not applied yet: not done); the agreed values are in
        `last_plan`."""
        if self.guard is None:
            return self._step(seq, leave, pending)
        with self.guard.round(self.planner.round):  # a hung round becomes an error
            return self._step(seq, leave, pending)

    def _step(self, seq: int, leave: bool, pending: bool) -> list[Request]:
        start = time.perf_counter()
        try:
            return self._round(seq, leave, pending)
        finally:
            self.stats.round_seconds += time.perf_counter() - start

    def _round(self, seq: int, leave: bool, pending: bool) -> list[Request]:
        done = self._retire()
        if self._launched is not None and not self._may_outlive(self._launched):
            # every request of the round in flight may finish in it: read it before planning the
            # next round rather than run a round that may be all dropped rows
            self.drain()
            done += self._retire()
        admitted = self.scheduler.admit()
        batch = list(self.scheduler.running)
        if not batch and self.scheduler.waiting:
            self._refuse_stuck()
        start = time.perf_counter()
        plan = self.planner.begin_round(RoundReport(
            num_requests=len(batch), num_tokens=sum(len(r.prompt_ids) for r in admitted),
            can_graph=self.worker.can_use_graph(batch),
            done=not (self.scheduler.has_work or pending),
            num_extend=len(admitted), seq=seq, leave=leave,
            extend_len=max((len(r.prompt_ids) for r in admitted), default=0),
            requests=tuple(r.rid for r in batch)))
        self.stats.plan_seconds += time.perf_counter() - start
        self.last_plan = plan
        self._all_done = plan.all_done
        if plan.switched:
            self.pool.apply(plan.steps)
        if plan.steps != self.worker.steps:
            raise RuntimeError(f"plan says steps={plan.steps} but the worker runs "
                               f"steps={self.worker.steps}: the runtime state was not applied")
        if plan.extend_tokens:
            self.worker.prefill(admitted, plan.extend_tokens, plan.extend_requests,
                                plan.extend_width, plan.use_graph)
            if self.round_log is not None:
                self.round_log.prefill(plan, [r.rid for r in admitted],
                                       sum(len(r.prompt_ids) for r in admitted))
        launched = self._launch(plan, [r for r in batch if not r.finished])
        # what this rank launched, compared across ranks at the next round
        self.planner.ran(launched.executed)
        if not self.config.overlap:
            self._collect(launched)
            return done + self._retire()
        # overlap: the device runs this round while the host reads and commits the previous one
        previous, self._launched = self._launched, launched
        if previous is not None:
            self._collect(previous)
        if plan.all_done or plan.leave:  # no next round to hide it behind
            self.drain()
        return done + self._retire()

    def _may_outlive(self, launched: "_Launched") -> bool:
        """Whether some request of a launched round is sure to outlive it (its token budget
        exceeds what the round can commit). Rank-local: a rank that reads its round early sends
        fresher statistics, and the decisions, made from the gathered vectors, stay the same on
        every rank."""
        handle = launched.handle
        if handle is None:  # nothing ran: reading it costs nothing
            return False
        live = [r.slot for r in handle.reqs if not r.finished]
        if not live:
            return False
        out = self.scheduler.outputs
        return bool((out.limit[live] - out.count[live] > handle.steps + 1).any())

    def drain(self) -> None:
        """Read and commit the round still in flight (overlap), if any."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._collect(launched)

    def _launch(self, plan: RoundPlan, live: list[Request]) -> "_Launched":
        """Queue the round's forwards (none when no rank of the cluster runs requests)."""
        bucket = plan.batch_bucket if plan.use_graph else None
        handle = None
        if plan.cluster_requests:
            budgets = None
            if plan.budgets:
                of = plan.budget_of()
                budgets = [of[r.rid] for r in live]
            handle = self.worker.launch(live, plan.batch_pad, bucket, plan.shape, budgets)
        # what this rank ran (an idle rank ran dummy rows of the agreed shape): its worker's
        # applied depth is rank-local state, checked against every other rank before the next round
        shape = handle.shape if handle is not None else RoundShape(
            self.worker.steps, plan.shape.verify_tokens if plan.shape is not None else 0)
        return _Launched(plan, handle, Executed(shape, plan.use_graph, plan.batch_bucket))

    def _collect(self, launched: "_Launched") -> None:
        """Read a launched round, commit it to its requests that are still running (with overlap
        a request may have finished in the round before: its extra round is dropped) and report
        it to the planner."""
        accepts: list[int] = []
        shadow: tuple[int, int, int] | None = None
        shadow_rows = None
        rids: list[int] = []
        handle, plan = launched.handle, launched.plan
        if handle is not None:
            result = self.worker.collect(handle)
            reqs = handle.reqs
            budgets = handle.budgets
            if self.config.overlap:
                keep = np.fromiter((not r.finished for r in reqs), dtype=bool, count=len(reqs))
                if not keep.all():
                    reqs = [r for r, k in zip(reqs, keep) if k]
                    budgets = tuple(b for b, k in zip(budgets, keep) if k)
                    result = result.select(keep)
            rids = [r.rid for r in reqs]
            self.scheduler.commit_round(reqs, result.first, result.accept, result.tokens,
                                        result.logprobs)
            if reqs:
                self.stats.graph_rounds += plan.use_graph
                if self.config.speculative:
                    counts = np.bincount(result.accept)
                    self.stats.accept_histogram.update(
                        {int(k): int(v) for k, v in enumerate(counts) if v})
                self.stats.rounds += 1
            accepts = result.accept.tolist()
            if result.shadow is not None and len(reqs):
                checks = result.shadow[:, 1]
                shadow = Shadow(int(result.shadow[:, 0].sum()), int(checks.sum()),
                                int((checks > 0).sum()))
                shadow_rows = [tuple(x) for x in result.shadow.tolist()]
            if self.round_log is not None:
                self.round_log.decode(plan, launched.executed, rids, budgets, accepts,
                                      handle.catchup, handle.pending,
                                      max((r.num_tokens for r in reqs), default=0))
        self.planner.end_round(accepts, plan=plan, shadow=shadow,
                               requests=rids if plan.requests else None, shadow_rows=shadow_rows)

    def _retire(self) -> list[Request]:
        """Retire finished requests (KV and slot back) and forget them."""
        done = self.scheduler.retire()
        for req in done:
            self.live.pop(req.rid, None)
            self.stats.generated_tokens += len(req.output_ids)
        return done

    def measure_round_costs(self, repeats: int = 5, context: int = 0) -> dict[int, dict[int, float]]:
        """`measure_round_costs` over this engine's worker and tiers."""
        return measure_round_costs(self.config, self.worker, self.pool, repeats, context)

    def warmup(self) -> None:
        """One dummy prefill and one dummy round on every rank (all rows padding): connects
        every process group and runs every kernel once, so the first request does not pay for
        it. Collective: every rank of the cluster calls it at start-up."""
        self.worker.prefill([], 1, 1)
        if self.planner.steps == self.worker.steps:
            self.worker.spec_round([], 1, None)

    def _refuse_stuck(self) -> None:
        """Nothing runs and the next waiting request cannot be admitted: it never will be."""
        req = self.scheduler.waiting[0]
        raise RuntimeError(f"request {req.rid} cannot be admitted into an empty KV pool "
                           f"(needs {self.scheduler.kv_tokens(req)} tokens)")

    def close(self) -> None:
        """Release the worker's CUDA graphs. # NOTE: before the process group is destroyed."""
        self.worker.close()

    def run(self) -> None:
        """Step until every rank reported it has no work left."""
        start = time.perf_counter()
        self._all_done = False
        while not self._all_done:
            self.step()
        self.drain()
        self.stats.elapsed_s += time.perf_counter() - start

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
                 seed: int = 0, seeds: Sequence[int] | None = None) -> list[Request]:
        """Run `prompts` to completion; the finished requests, in prompt order.

        Request `i` samples with the generator seeded `seeds[i]` (default `seed + i`), so its
        samples do not depend on the rest of the batch. Every request is validated before any runs.
        """
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        seeds = list(seeds) if seeds is not None else [seed + i for i in range(len(prompts))]
        if not len(per) == len(seeds) == len(prompts):
            raise ValueError(f"{len(per)} sampling params and {len(seeds)} seeds for "
                             f"{len(prompts)} prompts")
        for i, (ids, p) in enumerate(zip(prompts, per)):
            self.scheduler.validate(Request(i, list(ids), p), what=f"prompt {i}")
        reqs = [self.add(ids, p, seed=s) for ids, p, s in zip(prompts, per, seeds)]
        self.run()
        return reqs


def build_tiers(worker: EagleWorker, config: EngineConfig) -> RuntimeStatePool:
    """One pre-built runtime state per tier of `config.spec` (buffers and, with graphs, every
    phase captured), the initial one applied, then the padded prefill's graphs. Collective (the
    captures run the forwards)."""
    pool = RuntimeStatePool(worker, config.spec.tiers)
    pool.apply(config.spec.initial_steps)
    worker.capture_prefill()   # after the tiers (and their CUDA graphs)
    return pool


def measure_round_costs(config: EngineConfig, worker: EagleWorker, pool: RuntimeStatePool,
                        repeats: int = 5, context: int = 0) -> dict[int, dict[int, float]]:
    """Seconds of one round at every tier and batch bucket (dummy rows, the graphs when the
    engine has them, without them the configured buckets up to the largest batch): what the
    goodput policy weighs depths with; chains of rounds run as this engine runs them, see
    `EagleWorker.measure_round_costs`. `context`: the dummy rows' cache length. Collective:
    every rank measures the same tiers and buckets in the same order; the initial tier is
    applied again after."""
    eager = tuple(b for b in config.spec.graph_buckets
                  if b <= config.max_batch_size) or (1,)
    table = worker.measure_round_costs(pool, eager, config.overlap, repeats, context)
    pool.apply(config.spec.initial_steps)
    return table


class EngineFacts:
    """What this engine offers the policy at start-up (`adaptive_dist.startup.EngineFacts`): its
    catch-up interval and the measurements of its built tiers, each a step of the start-up
    timeline. `adaptive_dist.startup.prepare` takes what the policy declares it needs."""

    def __init__(self, config: EngineConfig, worker: EagleWorker, pool: RuntimeStatePool) -> None:
        self.config, self.worker, self.pool = config, worker, pool
        self.catchup_rounds = config.catchup_rounds

    def measure_round_costs(self) -> dict[int, dict[int, float]]:
        with startup_log.current().timed("cost table") as step:
            measured = measure_round_costs(self.config, self.worker, self.pool)
            step["text"] = (f"{sum(map(len, measured.values()))} round costs (depths "
                            f"{list(self.pool.states)} x buckets {list(measured)})")
        return measured

    def measure_verify_costs(self) -> dict[int, float]:
        with startup_log.current().timed("verify costs") as step:
            verify = self.worker.measure_verify_costs()
            step["text"] = f"{len(verify)} token rungs priced"
        return verify


def build_engine(config: EngineConfig, target: torch.nn.Module, head: torch.nn.Module | None,
                 group: Group | None = None, guard: LockstepGuard | None = None) -> Engine:
    """The engine stack for a loaded `target` (and `head`, unused when `config` does not
    speculate). `group` is the group the round's consensus runs over: every rank of the cluster
    (default: this process alone). `guard` (multi-rank runs) checks the ranks' collective logs and
    plans every `lockstep_check_every` rounds and arms its watchdog around every round.

    The speculative settings the engine runs are the effective ones: what the policy derives in
    this engine and the inputs it measures on the built tiers, agreed over `group`
    (`adaptive_dist.startup.prepare` with this engine's `EngineFacts`; a derived value is said on
    the group's first rank); the planner's config hash holds them."""
    backend = make_backend(config.attention_backend, config.device)
    worker = EagleWorker(target, head if config.speculative else None, config, backend)
    allocator = PageAllocator(config.pool_pages, config.page_size)
    scheduler = Scheduler(allocator, config.max_batch_size, config.max_context_len,
                          lambda r: config.kv_tokens(len(r.prompt_ids), r.params.max_new_tokens),
                          device=config.device, prompt_logprobs=config.dp == 1)
    group = group if group is not None else Group.single(config.device, name="world")
    if group.size > 1:
        # the draft shape sets every round's row counts (a tree's K per draft step, N per
        # verify): a rank started with another one is named before any device collective
        from adaptive_dist.startup import agree_settings

        agree_settings({"--steps": config.max_steps,
                        "--speculative-eagle-topk": config.speculative_eagle_topk,
                        "--speculative-num-draft-tokens": config.speculative_num_draft_tokens},
                       group, "draft shape")
    pool = build_tiers(worker, config)
    spec, derived = prepare(config.spec, EngineFacts(config, worker, pool), group)
    if derived and group.is_first:
        say(f"effective configuration (derived for catchup_rounds {config.catchup_rounds}): "
            f"{derived}; digest {spec.digest()}")
    if spec != config.spec:
        config = config.replace(spec=spec)
    planner = RoundCoordinator(config.spec, group, guard=guard,
                               verify_ladder=config.verify_ladder)
    return Engine(config, worker, scheduler, planner, guard, pool=pool)


def freeze_heap() -> None:
    """Take every object alive now (the models, KV pools and captured graphs: some 300 000 of
    them) out of the garbage collector's reach. A full collection walks every tracked object —
    0.1-0.25 s for these — at a moment no round chooses, and in a cluster every rank then waits
    for the one that paused. For a process that builds its engines once (generate, serve, the
    benchmarks), after start-up; objects created later are collected as usual. At exit they are
    handed back, so the interpreter's shutdown frees them (extension modules report objects
    still alive then as leaks)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
