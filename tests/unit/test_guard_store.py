"""The guard's diagnosis through a real TCP store, in one process: a live peer answers from its
watchdog thread at once, a dead one is named after the grace, every rank adopts one verdict."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from collectives import free_port
from collectives.errors import CollectiveTimeoutError, DivergenceError
from collectives.group import Group
from collectives.guard import LockstepGuard, short_cause
from collectives.recorder import CollectiveRecorder

GRACE = 1.0


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", free_port(), None, True, timedelta(seconds=10),
                      wait_for_workers=False)
    yield s


def _guard(store, rank: int, ops: list[str]) -> LockstepGuard:
    rec = CollectiveRecorder(rank)
    for op in ops:
        rec.record(op, "dp", torch.zeros(14, dtype=torch.float64))
    group = Group(name="world", ranks=(0, 1), rank=rank, device=torch.device("cpu"), recorder=rec)
    return LockstepGuard(group, rec, timeout_s=3.0, store=store.clone(), grace_s=GRACE,
                         exit_on_watchdog=False)


def _fail(guard: LockstepGuard) -> BaseException:
    entry = guard.recorder.window[-1]
    return guard._diagnose(entry, RuntimeError("[pair.cc:537] Read error: Connection reset by peer."))


def test_a_dead_peer_is_named_after_the_grace(store):
    g0 = _guard(store, 0, ["all_gather"] * 3)
    t0 = time.monotonic()
    err = _fail(g0)
    took = time.monotonic() - t0
    g0.close()
    assert isinstance(err, CollectiveTimeoutError)
    assert "rank(s) [1] did not answer within 1 s: dead, or frozen" in str(err)
    assert "RuntimeError: Read error: Connection reset by peer." in str(err)  # no gloo noise
    assert GRACE <= took < GRACE + 1.0


def test_a_live_peer_answers_from_its_watchdog_thread_at_once(store):
    g0, g1 = _guard(store, 0, ["all_gather"] * 3), _guard(store, 1, ["all_gather"] * 2)
    t0 = time.monotonic()
    err = _fail(g0)
    took = time.monotonic() - t0
    assert isinstance(err, CollectiveTimeoutError), err
    assert "stalled, not diverged" in str(err)
    assert took < GRACE, f"the live peer's answer took {took:.2f} s"
    # the peer, failing later in its own thread, adopts the same verdict: one line everywhere
    assert str(_fail(g1)) == str(err)
    g0.close()
    g1.close()


def test_a_different_collective_is_a_divergence_on_every_rank(store):
    g0 = _guard(store, 0, ["all_gather", "all_gather", "all_reduce.sum"])
    g1 = _guard(store, 1, ["all_gather", "all_gather", "broadcast"])
    err0 = _fail(g0)
    err1 = _fail(g1)
    assert isinstance(err0, DivergenceError) and str(err0) == str(err1)
    assert "first differing collective is #2" in str(err0)
    g0.close()
    g1.close()


def test_short_cause_drops_the_source_location_and_advice():
    exc = RuntimeError("[/w/gloo/transport/tcp/pair.cc:553] Connection closed by peer [1.2.3.4]:5. "
                       "This is typically caused by a remote worker crashing.\nmore")
    assert short_cause(exc) == "RuntimeError: Connection closed by peer [1.2.3.4]:5."
