"""The engine of one rank: continuous batching driven round by round by the adaptive controller.

One engine step:
1. admit waiting requests that fit (batch size, KV reservation) and prefill them;
2. `plan = planner.begin_round(...)` (the controller's one collective; it applies a tier switch
   decided at the previous round by swapping the worker's runtime state);
3. one speculative round over the running batch (or one plain decode step with `--no-spec`);
4. `planner.end_round(accepts)`; retire finished requests (their KV goes back to the pool).

`make_engine` builds the whole stack from a loaded target and head.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence

import torch

from adaptive_dist.config import AdaptiveConfig
from adaptive_dist.controller import AdaptiveController, RoundPlan
from collectives import Group, LockstepGuard
from workers.attention import make_backend
from workers.eagle_worker import EagleWorker, WorkerConfig
from workers.runtime_state import RuntimeStatePool
from workers.sampling import SamplingParams
from workers.scheduler import Request, Scheduler


class RoundPlanner(Protocol):
    """What the engine asks before and tells after every round (`AdaptiveController` is one)."""

    def begin_round(self, num_requests: int, num_tokens: int = 0, can_graph: bool = True,
                    done: bool = False) -> RoundPlan:
        """Agree this round's plan with the other ranks (every rank, every round, idle too)."""

    def end_round(self, accepts: Sequence[int], executed: tuple | None = None) -> None:
        """Report this rank's accept lengths of the round and what it ran (local only)."""


@dataclass
class EngineStats:
    """Acceptance and throughput of one run on this rank."""

    accept_histogram: Counter = field(default_factory=Counter)  # accept length -> request-rounds
    rounds: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    switches: int = 0
    graph_rounds: int = 0       # rounds that ran through CUDA graphs
    steps_timeline: list[tuple[int, int]] = field(default_factory=list)  # (round, steps) on change

    @property
    def mean_accept_length(self) -> float:
        """Accepted draft tokens per request per round (bonus excluded); 0 without rounds."""
        total = sum(self.accept_histogram.values())
        return sum(k * v for k, v in self.accept_histogram.items()) / total if total else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens (all requests) per second of engine time."""
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def record_plan(self, steps: int, switched: bool) -> None:
        """Note the steps a round runs at (and whether a switch preceded it)."""
        if switched:
            self.switches += 1
        if not self.steps_timeline or self.steps_timeline[-1][1] != steps:
            self.steps_timeline.append((self.rounds, steps))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {"mean_accept_length": self.mean_accept_length,
                "accept_histogram": {str(k): v for k, v in sorted(self.accept_histogram.items())},
                "tokens_per_second": self.tokens_per_second, "switches": self.switches,
                "rounds": self.rounds, "graph_rounds": self.graph_rounds,
                "generated_tokens": self.generated_tokens,
                "elapsed_s": self.elapsed_s,
                "steps_timeline": [list(x) for x in self.steps_timeline]}


class Engine:
    """Continuous batching over one `EagleWorker`; speculative when a `planner` is given."""

    def __init__(self, worker: EagleWorker, scheduler: Scheduler,
                 planner: RoundPlanner | None, guard: LockstepGuard | None = None,
                 tiers: Sequence[int] = (), initial_steps: int | None = None) -> None:
        if planner is not None and not worker.speculative:
            raise ValueError("a speculative engine needs a worker with a draft head")
        self.worker, self.scheduler, self.planner = worker, scheduler, planner
        # the engine applies the tier the controller decides: one pre-built state per depth
        self.pool = RuntimeStatePool(worker, tiers) if planner is not None else None
        if self.pool is not None:
            self.pool.apply(initial_steps)
        self.guard = guard
        self.stats = EngineStats()
        self.requests: list[Request] = []

    def add(self, prompt_ids: list[int], params: SamplingParams, seed: int = 0) -> Request:
        """Queue a request (validated now; an impossible request raises `ValueError`)."""
        req = Request(len(self.requests), list(prompt_ids), params, seed=seed)
        self.scheduler.add(req)
        self.requests.append(req)
        return req

    def abort(self, rid: int) -> bool:
        """Finish request `rid` now with reason "abort" (a client went away). A waiting request
        leaves the queue; a running one is retired at the next round boundary, which gives its KV
        back. Returns whether the request was still unfinished."""
        req = next((r for r in self.requests if r.rid == rid), None)
        if req is None or req.finished:
            return False
        req.finish_reason = "abort"
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
            self.scheduler.finished.append(req)
        return True

    def step(self) -> list[Request]:
        """Admit + prefill, one round, retire; returns the requests that finished.

        With a planner every rank joins the round's consensus even with nothing to run (an idle
        rank reports zero requests), so ranks with different workloads stay in lockstep.
        """
        self.worker.prefill(self.scheduler.admit())
        done = self.scheduler.retire()
        batch = self.scheduler.running
        if not batch and self.scheduler.waiting:
            self._refuse_stuck()
        if self.planner is None:
            if batch:
                self.worker.decode_round(batch)
                self.stats.rounds += 1
        elif self.guard is None:
            self._spec_round(batch)
        else:
            with self.guard.round(self.stats.rounds):  # a hung round becomes an error
                self._spec_round(batch)
        return done + self.scheduler.retire()

    def _refuse_stuck(self) -> None:
        """Nothing runs and the next waiting request cannot be admitted: it never will be."""
        req = self.scheduler.waiting[0]
        raise RuntimeError(f"request {req.rid} cannot be admitted into an empty KV pool "
                           f"(needs {self.worker.max_kv_tokens(req)} tokens)")

    def _spec_round(self, batch: list[Request]) -> None:
        plan = self.planner.begin_round(
            num_requests=len(batch), num_tokens=len(batch),
            can_graph=self.worker.can_use_graph(batch) if batch else True,
            done=not self.scheduler.has_work)
        self._all_done = plan.all_done
        if plan.switched:
            self.pool.apply(plan.steps)
        if plan.steps != self.worker.steps:
            raise RuntimeError(f"plan says steps={plan.steps} but the worker runs "
                               f"steps={self.worker.steps}: the runtime state was not applied")
        accepts: list[int] = []
        if batch:
            self.stats.record_plan(plan.steps, plan.switched)
            bucket = plan.batch_bucket if plan.use_graph else None
            accepts = self.worker.spec_round(batch, graph_bucket=bucket)
            self.stats.graph_rounds += bucket is not None
            self.stats.accept_histogram.update(accepts)
            self.stats.rounds += 1
        # what this rank ran (an idle rank stands by on the agreed shape): its worker's applied
        # depth is rank-local state, checked against every other rank before the next round
        executed = (self.worker.steps, plan.use_graph, plan.batch_bucket, "spec")
        self.planner.end_round(accepts, executed)

    def close(self) -> None:
        """Release the worker's CUDA graphs. # NOTE: before the process group is destroyed."""
        self.worker.close()

    def run(self) -> None:
        """Step until every request has finished."""
        start = time.perf_counter()
        self._all_done = False
        while True:
            if self.planner is None and not self.scheduler.has_work:
                break
            self.step()
            if self.planner is not None and self._all_done:
                break  # every rank reported it had no work left
        self.stats.elapsed_s += time.perf_counter() - start
        self.stats.generated_tokens = sum(len(r.output_ids) for r in self.requests)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
                 seed: int = 0) -> list[Request]:
        """Run `prompts` to completion; the finished requests, in prompt order.

        Request `i` samples with the generator seeded `seed + i` (its samples do not depend on
        the rest of the batch). Every request is validated before any runs.
        """
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} sampling params for {len(prompts)} prompts")
        for ids, p in zip(prompts, per):
            self.scheduler.validate(Request(-1, list(ids), p))
        reqs = [self.add(ids, p, seed=seed + i) for i, (ids, p) in enumerate(zip(prompts, per))]
        self.run()
        return reqs


def make_engine(target: torch.nn.Module, head: torch.nn.Module | None, *,
                adaptive_config: AdaptiveConfig | None,
                backend: str = "torch", device: torch.device | str = "cpu",
                worker_config: WorkerConfig | None = None, dp_group: Group | None = None,
                cuda_graphs: bool = False, guard: LockstepGuard | None = None) -> Engine:
    """The engine stack for a loaded `target` (and `head`).

    `adaptive_config` None means no speculation (plain decoding with the target; `head` unused).
    Otherwise the config's policy is `"static"` (stay at `initial_steps`) or `"ema"` (adaptive),
    and the controller runs its consensus over `dp_group` (size 1 when omitted). The worker's
    `max_steps` becomes the config's deepest candidate. `cuda_graphs` captures the round's
    forwards per tier and batch bucket (`workers.cuda_graphs`; the `generate` command turns it on
    for CUDA); on a CPU it runs the same padded static forwards without capture (a test mode).
    `guard` (multi-rank runs) checks the ranks' collective logs and plans every
    `lockstep_check_every` rounds and arms its watchdog around every round.
    """
    wcfg = worker_config or WorkerConfig(max_context_len=target.config.max_position_embeddings)
    attn = make_backend(backend, device)
    if adaptive_config is None:
        worker = EagleWorker(target, None, attn, replace(wcfg, max_steps=1), device)
        planner = None
    else:
        if head is None:
            raise ValueError("speculative decoding needs a draft head; use --no-spec without one")
        # a static run never goes deeper than its depth: reserve KV and size buffers for it alone
        worker = EagleWorker(target, head, attn, replace(wcfg, max_steps=adaptive_config.max_steps),
                             device,
                             graph_buckets=adaptive_config.graph_buckets if cuda_graphs else None)
        group = dp_group if dp_group is not None else Group.single(device, name="dp")
        planner = AdaptiveController(adaptive_config, group, guard=guard)
    scheduler = Scheduler(worker, wcfg.max_batch_size, wcfg.max_context_len)
    if planner is None:
        return Engine(worker, scheduler, None, guard=guard)
    return Engine(worker, scheduler, planner, guard=guard, tiers=adaptive_config.tiers,
                  initial_steps=adaptive_config.initial_steps)
