"""The start-up round-cost measurement: seconds of one round at every tier and batch bucket, and
of the packed verify forward alone at every token rung.

What the goodput policy weighs depths with (`adaptive_dist.startup.agree_round_cost` agrees the
ranks' tables). The rounds run on dummy rows, through the CUDA graphs when the worker has them.
A round's shape prices as its tier's full chain at its bucket (`measure_tiers`: every row drafting
every step, `bucket x (steps + 1)` verify tokens) with the verify forward's part exchanged for the
one its own token count costs (`measure_targets`): per-request budgets change only the verify
forward's tokens. Each sample of a round is a chain of `COST_CHAIN` rounds run as the engine runs them — back to back, each
read after the next is launched, with overlap; launched and read one by one without — divided by
its length; at depth 0 with a draft head the chain is the catch-up interval (`catchup_every`
rounds), which holds one catch-up of the draft cache, so the tier's share of it is in the cost.
The median of `repeats` chains after a warm-up chain. Collective: every rank measures the same
tiers and buckets in the same order.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Protocol, Sequence

import torch

from workers import startup_log
from workers.runtime_state import RuntimeStatePool
from workers.worker.request import SlotRequest
from workers.worker.slots import SlotState

COST_CHAIN = 8
"""Rounds per sample (but at depth 0 with a head: its catch-up interval)."""


class TimedWorker(Protocol):
    """What the measurement runs rounds through (`EagleWorker`)."""

    device: torch.device
    slots: SlotState

    def launch(self, reqs: list[SlotRequest], batch_pad: int,
               graph_bucket: int | None = None) -> Any: ...

    def collect(self, launched: Any) -> Any: ...

    def target_body(self, tokens: int, context: int = 0) -> Callable[[], None]: ...


def measure_tiers(worker: TimedWorker, tiers: RuntimeStatePool, buckets: Sequence[int],
                  graphs: bool, overlap: bool, catchup_every: int | None,
                  repeats: int = 5, context: int = 0) -> dict[int, dict[int, float]]:
    """Seconds of one round per bucket and tier: {bucket: {steps: seconds}}. Applies each of
    `tiers`' states in turn (the last stays applied); `graphs`: replay each bucket's graphs;
    `overlap`: one round in flight while the next is launched; `catchup_every`: the catch-up
    interval of depth 0 with a head (None: no lag ring); `context`: the dummy rows' cache length
    (their attention reads that many positions of the dummy page)."""
    sync = (torch.cuda.synchronize if worker.device.type == "cuda" else (lambda: None))
    table: dict[int, dict[int, float]] = {}
    begun, total = time.perf_counter(), len(buckets) * len(tiers.states) * (repeats + 1)
    for bucket in buckets:
        graph = bucket if graphs else None
        for steps in tiers.states:
            tiers.apply(steps)
            chain = catchup_every if steps == 0 and catchup_every is not None else COST_CHAIN
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                startup_log.current().progress(
                    "cost table", sum(map(len, table.values())) * (repeats + 1) + len(times),
                    total, f"chains of rounds; bucket {bucket}, depth {steps}", since=begun)
                sync()
                start = time.perf_counter()
                queued = []   # launched, not read yet
                in_flight = 1 if overlap else 0   # as the engine runs rounds
                for _ in range(chain):
                    if context:
                        worker.slots.set_dummy_length(context)
                    queued.append(worker.launch([], bucket, graph))
                    if len(queued) > in_flight:
                        worker.collect(queued.pop(0))
                for handle in queued:
                    worker.collect(handle)
                sync()
                times.append((time.perf_counter() - start) / chain)
            table.setdefault(bucket, {})[steps] = statistics.median(times[1:])
    worker.slots.set_dummy_length(0)
    return table


def measure_targets(worker: TimedWorker, ladder: Sequence[int], repeats: int = 5,
                    context: int = 0) -> dict[int, float]:
    """Seconds of the packed verify forward alone per token rung: {tokens: seconds}, each the
    median of `repeats` chains of `COST_CHAIN` forwards after a warm-up chain, on dummy tokens
    (whose attention reads `context` positions of the dummy page)."""
    sync = (torch.cuda.synchronize if worker.device.type == "cuda" else (lambda: None))
    worker.slots.round_rows.fill_(worker.slots.dummy)
    table: dict[int, float] = {}
    begun = time.perf_counter()
    for tokens in ladder:
        startup_log.current().progress("verify costs", len(table), len(ladder),
                                       f"{tokens} tokens", since=begun)
        body = worker.target_body(tokens, context)
        times = []
        for _ in range(repeats + 1):
            worker.slots.set_dummy_length(context)
            sync()
            start = time.perf_counter()
            for _ in range(COST_CHAIN):
                body()
            sync()
            times.append((time.perf_counter() - start) / COST_CHAIN)
        table[tokens] = statistics.median(times[1:])
    worker.slots.set_dummy_length(0)
    return table
