"""Overlap takes the agreement off the critical path (issue 27): CPU ranks whose "device round" is a
timed wait of D ms (a fixture, here only) run the engine's order of a round — with overlap
(``workers/engine.py``, ``Engine._round``): agree round r, launch it (queued behind round r-1 on
the device), then read round r-1; without: agree, launch, read the same round. With overlap the
agreement of a round runs while the device computes the one before, so a round costs
max(D, host work) instead of D + host work; decisions stay in lockstep (same digests).

    python tests/multirank/test_overlap_agreement.py      # the crossover table, D = 2, 5, 10 ms
"""
from __future__ import annotations

import statistics
import sys
import time

import pytest

from multirank import run_ranks


def overlap_job(rank: int, d_ms: float, rounds: int, overlap: bool, scheme: str = "reduce") -> dict:
    import collectives as C
    from adaptive_dist.config import AdaptiveConfig
    from adaptive_dist.coordinator import Executed, RoundCoordinator, RoundReport

    ctx = C.init_distributed(timeout_s=60.0, backend="gloo", record=False)
    world = ctx.layout().group("world")
    ctrl = RoundCoordinator(AdaptiveConfig(warmup_batches=2, update_interval=2), world,
                            scheme=scheme, clock=None)
    d = d_ms / 1e3
    device_free = time.perf_counter()     # when the device finishes what is queued
    host, in_flight = [], None

    def launch(plan):
        nonlocal device_free
        device_free = max(time.perf_counter(), device_free) + d   # queued behind the last
        return plan, device_free

    def collect(launched):
        plan, done_at = launched
        time.sleep(max(0.0, done_at - time.perf_counter()))        # the round's one read
        ctrl.end_round([min(2, plan.steps)] * 4 + [0], plan=plan)

    C.ops.all_reduce_sum_max(__import__("torch").zeros(2, dtype=__import__("torch").int64),
                             world, 1)   # line up the ranks
    t0 = time.perf_counter()
    for r in range(rounds):
        h0 = time.perf_counter()
        plan = ctrl.begin_round(RoundReport(5, 0, True))
        host.append(time.perf_counter() - h0)
        launched = launch(plan)
        ctrl.ran(Executed(plan.shape, plan.use_graph, plan.batch_bucket))
        if not overlap:
            collect(launched)
            continue
        previous, in_flight = in_flight, launched
        if previous is not None:
            collect(previous)
    if in_flight is not None:
        collect(in_flight)
    wall = time.perf_counter() - t0
    digest = ctrl.decision_digest()
    ctx.shutdown()
    return {"period_ms": 1e3 * wall / rounds, "host_ms": 1e3 * statistics.median(host),
            "host_p90_ms": 1e3 * sorted(host)[9 * len(host) // 10], "digest": digest,
            "steps": ctrl.steps}


def measure(world: int, d_ms: float, overlap: bool, rounds: int = 150) -> dict:
    results = run_ranks(overlap_job, world, d_ms, rounds, overlap, timeout=240)
    assert len({r.value["digest"] for r in results}) == 1    # lockstep
    # the round is paced by the slowest rank's host work
    return {"period_ms": results[0].value["period_ms"],
            "host_ms": max(r.value["host_ms"] for r in results),
            "digest": results[0].value["digest"]}


@pytest.mark.parametrize("d_ms", [10.0, 20.0])
def test_overlap_hides_the_agreement_behind_the_device_round(d_ms):
    over = measure(2, d_ms, True, rounds=80)
    serial = measure(2, d_ms, False, rounds=80)
    # the 5% of the goal is measured by the table below (__main__, docs/results.md); a test
    # sharing 2 cores with the rest of the suite (its host work swings 1-5 ms) keeps a margin
    # for the scheduler and judges against the host work it measured
    assert over["period_ms"] <= 1.25 * max(d_ms, over["host_ms"]), over
    assert serial["period_ms"] >= d_ms + 0.5 * serial["host_ms"], serial
    assert over["period_ms"] < serial["period_ms"], (over, serial)
    # the decisions are the same whatever the timing: overlap lags the statistics one round,
    # on every rank alike (the digests above), and the serial run has its own digest
    assert over["digest"] != 0 and serial["digest"] != 0


if __name__ == "__main__":
    worlds = [int(x) for x in sys.argv[1:]] or [2, 4, 8]
    print("D_ms world overlap_period_ms serial_period_ms host_ms max(D,host) within5%")
    for d in (2.0, 5.0, 10.0):
        for n in worlds:
            o, s = measure(n, d, True), measure(n, d, False)
            bound = max(d, o["host_ms"])
            print(f"{d:4g} {n:5d} {o['period_ms']:8.2f} {s['period_ms']:8.2f} "
                  f"{o['host_ms']:6.2f} {bound:6.2f} {o['period_ms'] <= 1.05 * bound}", flush=True)
