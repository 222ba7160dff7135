"""The frontend's side of the sockets: sequenced sends to every rank, the output pump, liveness.

``ClusterClient.submit`` chooses the DP group and PUSHes a ``Generate`` (with the next ``seq``)
to every rank; ``abort`` does the same with an ``Abort``. ``pump`` reads the ranks' outputs and
feeds each request's events (``Tokens`` / ``Failure``) into the sink its HTTP handler reads.
``watchdog`` fails the cluster when a rank stops sending heartbeats or rank 0 (the launch, the
frontend's parent) is gone. After a failure every waiting handler gets a 503, new requests get
503, the ranks are sent ``Shutdown``, and ``stopping`` is set ``linger_s`` later.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq
import zmq.asyncio

from workers.server import protocol
from workers.server.metrics import FrontendMetrics
from workers.server.protocol import (Abort, FrontendConfig, Generate, Heartbeat, ModelInfo,
                                     QueueStats, RankExit, Ready, RequestError, Shutdown,
                                     StepOutput)
from workers.server.router import Router

log = logging.getLogger("adaptive_dist.serve")

STARTUP_GRACE_S = 30.0   # extra silence allowed before a rank's first message


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: Optional[list] = None          # TokenDelta.logprobs
    prompt_logprobs: Optional[list] = None   # TokenDelta.prompt_logprobs


@dataclass(frozen=True)
class Failure:
    """A request's end in error: the cluster stopped (503), or a rank refused it (400 with the
    field, or 500)."""

    status: int
    message: str
    param: Optional[str] = None
    code: Optional[str] = "server_shutting_down"


class Unavailable(Exception):
    """The cluster cannot take requests (starting, failed, or its queue is full)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message, self.code = message, code


@dataclass
class Tracker:
    """One sub-request (one prompt) in flight; events go to `sink` as (index, event)."""

    rid: str
    index: int
    dp_rank: int
    prompt_tokens: int
    max_tokens: int
    sink: asyncio.Queue
    generated: int = 0
    created: float = field(default_factory=time.perf_counter)

    @property
    def outstanding(self) -> int:
        """Tokens this request may still cost its DP group (routing load)."""
        return (self.prompt_tokens if self.generated == 0 else 0) + self.max_tokens - self.generated


class ClusterClient:
    def __init__(self, config: FrontendConfig, metrics: FrontendMetrics) -> None:
        self.config, self.metrics = config, metrics
        self._sync = zmq.Context()
        self._async = zmq.asyncio.Context()
        self._push: dict[int, zmq.Socket] = {}
        for r in config.ranks:
            sock = self._sync.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(r.address)
            self._push[r.rank] = sock
        self._pull = self._async.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(config.pull_address)
        self.router = Router(config.dp, config.routing)
        self.seq = 0
        self.ready: dict[int, Ready] = {}
        self.model: Optional[ModelInfo] = None
        self.stats: dict[int, QueueStats] = {}
        self.trackers: dict[str, Tracker] = {}
        self.failure: Optional[str] = None
        self.orderly = False
        self.stopping = asyncio.Event()
        start = time.monotonic() + STARTUP_GRACE_S
        self._last_seen = {r.rank: start for r in config.ranks}
        self._leader_of = {r.dp_rank: r.rank for r in config.ranks if r.is_leader}

    # ---- state ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.config.ranks)

    @property
    def capacity(self) -> int:
        """Requests the DP groups run at once."""
        return self.config.dp * self.config.max_batch_size

    @property
    def healthy(self) -> bool:
        return self.failure is None and len(self.ready) == self.world_size

    def check_available(self, new_requests: int) -> None:
        """`Unavailable` unless every rank is ready and the queue bound leaves room."""
        if self.failure is not None:
            raise Unavailable(f"the server is shutting down: {self.failure}", "shutting_down")
        if len(self.ready) < self.world_size:
            raise Unavailable(f"the server is starting: {len(self.ready)} of {self.world_size} "
                              f"ranks ready", "starting")
        capacity = self.capacity
        queued = len(self.trackers) + new_requests - capacity
        if queued > self.config.max_queue:
            raise Unavailable(f"the server is overloaded: {len(self.trackers)} requests in "
                              f"flight, batch capacity {capacity}, queue bound "
                              f"{self.config.max_queue} (--max-queue)", "overloaded")

    def loads(self) -> list[int]:
        """Outstanding tokens per DP group."""
        loads = [0] * self.config.dp
        for t in self.trackers.values():
            loads[t.dp_rank] += t.outstanding
        return loads

    # ---- control messages ------------------------------------------------------------------------
    def _broadcast(self, msg: Any) -> None:
        data = protocol.encode(msg)
        for sock in self._push.values():
            sock.send(data, zmq.NOBLOCK)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def submit(self, rid: str, index: int, prompt_ids: list[int], max_tokens: int,
               temperature: float, top_p: float, seed: int, dp_rank: Optional[int],
               sink: asyncio.Queue, stop_token_ids: tuple[int, ...] = (),
               ignore_eos: bool = False, **sampling: Any) -> Tracker:
        """Route and send one sub-request; its events arrive in `sink`. `sampling`: the
        ``Generate`` sampling fields (top_k, min_tokens, penalties, logprobs, ...)."""
        group = self.router.choose(self.loads(), dp_rank)
        tracker = Tracker(rid, index, group, len(prompt_ids), max_tokens, sink)
        self.trackers[rid] = tracker
        self._broadcast(Generate(self._next_seq(), rid, group, list(prompt_ids), max_tokens,
                                 temperature, top_p, seed, time.time(), list(stop_token_ids),
                                 ignore_eos, **sampling))
        return tracker

    def abort(self, rid: str) -> None:
        """Finish `rid` early on its rank (no-op once it finished or the cluster failed)."""
        if self.trackers.pop(rid, None) is not None and self.failure is None:
            self._broadcast(Abort(self._next_seq(), rid))

    def fail(self, message: str, orderly: bool = False, status: int = 503) -> None:
        """Stop serving: answer everything in flight, refuse the rest, stop the ranks.
        `orderly` marks a requested stop (a signal) rather than a failure."""
        if self.failure is not None:
            return
        self.failure, self.orderly = message, orderly
        (log.info if orderly else log.error)("%s; failing %d request(s) in flight", message,
                                             len(self.trackers))
        for t in self.trackers.values():
            t.sink.put_nowait((t.index, Failure(status, f"the server is shutting down: "
                                                        f"{message}")))
        self.trackers.clear()
        try:
            self._broadcast(Shutdown(self._next_seq(), message, error=not orderly))
        except zmq.ZMQError as err:
            log.warning("could not send Shutdown to the ranks: %s", err)
        asyncio.get_running_loop().call_later(self.config.linger_s, self.stopping.set)

    # ---- outputs -----------------------------------------------------------------------------------
    async def pump(self) -> None:
        """Read the ranks' messages until cancelled."""
        while True:
            msg = protocol.decode(await self._pull.recv())
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        now = time.monotonic()
        if isinstance(msg, (Heartbeat, Ready, RankExit)):
            self._last_seen[msg.rank] = now
        if isinstance(msg, StepOutput):
            self._last_seen[self._leader_of.get(msg.dp_rank, -1)] = now
            if msg.stats is not None:
                self.stats[msg.dp_rank] = msg.stats
            for delta in msg.deltas:
                self._deliver(delta)
        elif isinstance(msg, Ready):
            self._on_ready(msg)
        elif isinstance(msg, RequestError):
            t = self.trackers.pop(msg.rid, None)
            if t is not None:
                code = "invalid_value" if msg.status < 500 else "internal_error"
                t.sink.put_nowait((t.index, Failure(msg.status, msg.message, msg.param, code)))
        elif isinstance(msg, RankExit):
            what = "failed" if msg.error else "stopped"
            self.fail(f"rank {msg.rank} {what}: {msg.reason}", orderly=not msg.error)

    def _on_ready(self, msg: Ready) -> None:
        self.ready[msg.rank] = msg
        self.model = self.model or msg.model
        if len(self.ready) == self.world_size:
            log.info("ready: %d rank(s), %d DP group(s), %s, context %d", self.world_size,
                     self.config.dp, msg.model.mode, msg.model.max_context_len)

    def _deliver(self, delta: Any) -> None:
        t = self.trackers.get(delta.rid)
        if t is None:
            return    # aborted by the frontend, or failed: nobody waits for it
        if delta.first_token_s is not None:
            self.metrics.wake.observe(delta.wake_s or 0.0)
            self.metrics.rank_first_token.observe(delta.first_token_s)
        if delta.queue_s is not None:
            self.metrics.queue_time.observe(delta.queue_s)
        t.generated += len(delta.token_ids)
        if delta.finish_reason is not None:
            del self.trackers[delta.rid]
        t.sink.put_nowait((t.index, Tokens(list(delta.token_ids), delta.finish_reason,
                                           delta.logprobs, delta.prompt_logprobs)))

    # ---- liveness ---------------------------------------------------------------------------------
    async def watchdog(self, every_s: float = 0.25) -> None:
        """Fail when rank 0 (the parent) is gone or a rank is silent for `dead_after_s`."""
        while self.failure is None:
            await asyncio.sleep(every_s)
            if os.getppid() != self.config.parent_pid:
                self.fail("rank 0 (the launch) exited")
                return
            now = time.monotonic()
            for rank, seen in sorted(self._last_seen.items()):
                if rank >= 0 and now - seen > self.config.dead_after_s:
                    self.fail(f"rank {rank} stopped responding (no heartbeat for "
                              f"{now - seen:.1f} s)")
                    return

    def close(self) -> None:
        for sock in self._push.values():
            sock.close()
        self._pull.close()
        self._sync.term()
        self._async.term()
