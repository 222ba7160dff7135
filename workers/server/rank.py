"""The serving loop of one rank; every rank of the cluster runs it in lockstep.

One iteration is one engine round on every rank (its one collective agrees everything):
1. when the last round found the whole cluster idle (no work, nothing unapplied on any rank),
   block in the inbox's poll until a message or a signal arrives (every rank receives every
   message, so they all wake; the timeout only bounds how often `alive()` is checked); else just
   take in what has arrived;
2. one engine round: this rank brings the highest ``seq`` it has received, whether it wants to
   stop, and whether messages wait; the round agrees the smallest ``seq`` (what every rank has)
   and whether any rank asked to stop (then every rank leaves after the same round);
3. apply the messages up to the agreed ``seq`` in order — ``Generate`` for this DP replica ->
   ``engine.add`` (admitted at the next round, on every rank of the replica alike; a request the
   replica cannot run is refused by every rank of it alike, and its leader reports a
   ``RequestError``: ``EngineAdapter.add``), ``Abort`` -> ``engine.abort``, ``Shutdown`` -> leave;
4. the replica's leader sends the token deltas (and, at most every ``stats_every_s`` or when the
   replica turns idle, its queue statistics) to the frontend.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from workers.server.engine_glue import EngineAdapter, Refused
from workers.server.inbox import Inbox, Outbox
from workers.server.protocol import Abort, Generate, RequestError, Shutdown, StepOutput

log = logging.getLogger("adaptive_dist.serve")


@dataclass
class StopFlag:
    """Set by a signal handler (or a failure check); the loop leaves at its next iteration."""

    reason: Optional[str] = None
    error: bool = False

    def set(self, reason: str, error: bool = False) -> None:
        if self.reason is None:
            self.reason, self.error = reason, error


@dataclass(frozen=True)
class LoopExit:
    """Why the loop ended; `error` for a failure (non-zero exit)."""

    reason: str
    error: bool
    by_peer: bool = False   # another rank asked to stop; this one was not told to


class RankLoop:
    """Applies control messages in order and steps the engine; see the module docstring."""

    def __init__(self, adapter: EngineAdapter, inbox: Inbox, outbox: Optional[Outbox],
                 dp_rank: int, stop: StopFlag,
                 alive: Callable[[], Optional[str]] = lambda: None,
                 check_every_s: float = 0.5, stats_every_s: float = 0.1) -> None:
        self.adapter, self.inbox, self.outbox = adapter, inbox, outbox
        self.dp_rank, self.stop, self.alive = dp_rank, stop, alive
        self.check_every_s, self.stats_every_s = check_every_s, stats_every_s
        self._last_stats = 0.0

    def announce(self) -> None:
        """Send the first queue statistics (the frontend's /metrics start from them)."""
        if self.outbox is not None:
            self.outbox.send(StepOutput(self.dp_rank, [], self.adapter.queue_stats()))
            self._last_stats = time.monotonic()

    def run(self) -> LoopExit:
        """Serve until a `Shutdown`, a stop signal or a failed `alive()` check (on any rank:
        every rank leaves after the same round)."""
        idle = True
        while True:
            if idle:
                self.inbox.wait(self.check_every_s)
            else:
                self.inbox.receive()
            problem = self.alive()
            if problem is not None:
                self.stop.set(problem, error=True)
            was_busy = self.adapter.has_work
            plan = self.adapter.step(self.inbox.received_seq, self.stop.reason is not None,
                                     self.inbox.has_unapplied)
            if plan.leave:
                if self.stop.reason is None:
                    return LoopExit("another rank asked to stop", False, by_peer=True)
                return LoopExit(self.stop.reason, self.stop.error)
            messages = self.inbox.take_upto(plan.seq)
            for msg in messages:
                if isinstance(msg, Shutdown):
                    return LoopExit(f"the frontend asked to stop ({msg.reason})", msg.error)
                self._apply(msg)
            if messages or was_busy:
                self._report(idle_now=not self.adapter.has_work)
            idle = plan.all_done and not messages

    def _apply(self, msg: Generate | Abort) -> None:
        if isinstance(msg, Abort):
            self.adapter.abort(msg.rid)
        elif msg.dp_rank == self.dp_rank:
            try:
                self.adapter.add(msg)
            except Refused as err:    # every rank of the replica alike (EngineAdapter.add)
                log.info("request %.80r refused in round %d: %s", msg.rid, self.adapter.rounds,
                         err)
                if self.outbox is not None:
                    self.outbox.send(RequestError(_text(msg.rid), self.dp_rank, err.message,
                                                  err.status, err.param))

    def _report(self, idle_now: bool) -> None:
        deltas = self.adapter.collect()
        if self.outbox is None:
            return
        now = time.monotonic()
        stats = None
        if idle_now or now - self._last_stats >= self.stats_every_s:
            stats = self.adapter.queue_stats()
            self._last_stats = now
        if deltas or stats is not None:
            self.outbox.send(StepOutput(self.dp_rank, deltas, stats))


def _text(value: object) -> str:
    return value if isinstance(value, str) else repr(value)
