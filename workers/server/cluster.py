"""The frontend's side of the sockets: sequenced sends to every rank, the output pump, liveness.

``ClusterClient.submit`` chooses the DP group and PUSHes a ``Generate`` (with the next ``seq``)
to every rank; ``abort`` does the same with an ``Abort``. ``pump`` reads the ranks' outputs and
feeds each request's events (``Tokens`` / ``Failure``) into the sink its HTTP handler reads.
``watchdog`` fails the cluster when a rank stops sending heartbeats, a rank's process on this host
is gone, or rank 0 (the launch, the frontend's parent) is gone. After a failure every waiting
handler gets a 503, new requests get 503, the ranks are sent ``Shutdown``, and ``stopping`` is set
``linger_s`` later.

Every message is sealed with the job's key (``channel``): what the frontend's inbox receives
without it, twice, or undecodable is dropped and counted, never acted on.

The failure reported is the first cause: a rank whose process ended without a word (seen on this
host in /proc) outranks what came after it (a peer's collective error, torchrun's SIGTERM to the
frontend), so a SIGTERM waits ``SIGTERM_GRACE_S`` for the ranks' own account first. A rank
declared dead (silent for ``dead_after_s``) whose process runs on this host is killed (SIGKILL:
a frozen process takes no other signal), so the job comes down within seconds instead of at the
collective timeout.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq
import zmq.asyncio

from workers.server import protocol
from workers.server.channel import OUTPUT_MAX_MESSAGE, JobKey, Signer, Verifier
from workers.server.metrics import FrontendMetrics
from workers.server.protocol import (Abort, FrontendConfig, Generate, Heartbeat, ModelInfo,
                                     QueueStats, RankExit, Ready, RequestError, Shutdown,
                                     StepOutput)
from workers.server.router import Router

log = logging.getLogger("adaptive_dist.serve")

STARTUP_GRACE_S = 30.0   # extra silence allowed before a rank's first message
SIGTERM_GRACE_S = 0.5    # after a SIGTERM, how long the ranks' own account may take to arrive
CONFIRM_S = 0.3          # a failure's verdict waits this long for what the ranks sent before it


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
    def __init__(self, config: FrontendConfig, metrics: FrontendMetrics, key: JobKey) -> None:
        self.config, self.metrics = config, metrics
        self._sync = zmq.Context()
        self._async = zmq.asyncio.Context()
        self._push: dict[int, zmq.Socket] = {}
        self._signer = Signer(key.control)        # one seal per broadcast, the same bytes to all
        for r in config.ranks:
            sock = self._sync.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(r.address)
            self._push[r.rank] = sock
        self._pull = self._async.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, OUTPUT_MAX_MESSAGE)
        self._pull.bind(config.pull_address)
        if config.pull_address.startswith("ipc://"):
            os.chmod(config.pull_address[len("ipc://"):], 0o600)
        self.verifier = Verifier(key.output, "the frontend's inbox")
        self.rank_dropped: dict[int, dict[str, int]] = {}   # each rank's inbox, from heartbeats
        self.host_id = host_id()
        self._local: dict[int, tuple[int, Optional[int]]] = {}   # rank -> (pid, start time)
        self._exited: set[int] = set()                         # ranks that sent RankExit
        self._causes: list[tuple[int, int, str, bool]] = []   # (rank, order, message, orderly)
        self.on_ready: list[Any] = []     # called once every rank is ready
        self.on_failure: list[Any] = []   # called once the cluster failed (not orderly)
        self._verdict_due: Optional[asyncio.TimerHandle] = None
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
    def send(self, kind: type, **fields: Any) -> None:
        """PUSH one control message (``Generate``, ``Abort``, ``Shutdown``: `fields` without
        ``seq``) to every rank with the next ``seq``, sealed once: every rank applies the
        messages in ``seq`` order."""
        self.seq += 1
        data = self._signer.seal(protocol.encode(kind(seq=self.seq, **fields)))
        for sock in self._push.values():
            sock.send(data, zmq.NOBLOCK)

    def track(self, rid: str, index: int, dp_rank: int, prompt_tokens: int, max_tokens: int,
              sink: asyncio.Queue) -> Tracker:
        """Follow request `rid` on DP group `dp_rank`: its events (``Tokens``, or a
        ``Failure`` when a rank refuses it or the cluster stops) arrive in `sink`."""
        tracker = Tracker(rid, index, dp_rank, prompt_tokens, max_tokens, sink)
        self.trackers[rid] = tracker
        return tracker

    def submit(self, rid: str, index: int, prompt_ids: list[int], max_tokens: int,
               temperature: float, top_p: float, seed: int, dp_rank: Optional[int],
               sink: asyncio.Queue, stop_token_ids: tuple[int, ...] = (),
               ignore_eos: bool = False, **sampling: Any) -> Tracker:
        """Route and send one sub-request; its events arrive in `sink`. `sampling`: the
        ``Generate`` sampling fields (top_k, min_tokens, penalties, logprobs, ...)."""
        group = self.router.choose(self.loads(), dp_rank)
        tracker = self.track(rid, index, group, len(prompt_ids), max_tokens, sink)
        self.send(Generate, rid=rid, dp_rank=group, prompt_ids=list(prompt_ids),
                  max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                  sent_at=time.time(), stop_token_ids=list(stop_token_ids),
                  ignore_eos=ignore_eos, **sampling)
        return tracker

    def abort(self, rid: str) -> None:
        """Finish `rid` early on its rank (no-op once it finished or the cluster failed)."""
        if self.trackers.pop(rid, None) is not None and self.failure is None:
            self.send(Abort, rid=rid)

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
            self.send(Shutdown, reason=message, error=not orderly)
        except zmq.ZMQError as err:
            log.warning("could not send Shutdown to the ranks: %s", err)
        if not orderly:
            for callback in self.on_failure:
                callback()
        asyncio.get_running_loop().call_later(self.config.linger_s, self.stopping.set)

    # ---- outputs -----------------------------------------------------------------------------------
    async def pump(self) -> None:
        """Read the ranks' messages until cancelled; drop (and count) what is not this job's."""
        while True:
            payload = self.verifier.open(await self._pull.recv())
            if payload is None:
                continue
            try:
                msg = protocol.decode(payload)
            except protocol.ProtocolError as err:
                self.verifier.drop("malformed", str(err)[:200])
                continue
            if isinstance(msg, (Heartbeat, Ready, RankExit)) and \
                    msg.rank not in self._last_seen:
                self.verifier.drop("malformed", f"rank {msg.rank!r} is no rank of this job")
                continue
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        now = time.monotonic()
        if isinstance(msg, (Heartbeat, Ready, RankExit)):
            self._last_seen[msg.rank] = now
        if isinstance(msg, Heartbeat) and msg.dropped:
            self.rank_dropped[msg.rank] = dict(msg.dropped)
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
            self._exited.add(msg.rank)
            what = "failed" if msg.error else "stopped"
            self.fail_first(f"rank {msg.rank} {what}: {msg.reason}", orderly=not msg.error,
                            rank=1 if msg.error else 2)

    def _on_ready(self, msg: Ready) -> None:
        self.ready[msg.rank] = msg
        self.model = self.model or msg.model
        if msg.host_id is not None and msg.host_id == self.host_id:
            self._local[msg.rank] = (msg.pid, start_time(msg.pid))
        if len(self.ready) == self.world_size:
            pids = ", ".join(str(self.ready[r].pid) for r in sorted(self.ready))
            log.info("ready: %d rank(s) (pid %s), %d DP group(s), %s, context %d",
                     self.world_size, pids, self.config.dp, msg.model.mode,
                     msg.model.max_context_len)
            for callback in self.on_ready:
                callback()

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
    def gone_rank(self) -> Optional[str]:
        """The first rank (by rank) of this host whose process ended without a `RankExit`, and
        how it ended; None when every one still runs (or none is on this host)."""
        for rank, (pid, started) in sorted(self._local.items()):
            if rank in self._exited:
                continue
            end = process_end(pid, started)
            if end is not None and pid == self.config.parent_pid:
                return f"rank {rank} (the launch) exited: its process (pid {pid}) {end}"
            if end is not None:
                return f"rank {rank} failed: its process (pid {pid}) {end}"
        return None

    def fail_first(self, message: Optional[str], orderly: bool = False, rank: int = 2,
                   delay_s: float = CONFIRM_S) -> None:
        """Fail with the first cause, `delay_s` from now (unless a verdict is already due): a
        rank of this host gone without a word comes first; then the causes noted here, by
        `rank` (1: a rank's failure or rank 0 gone, 2: a rank's orderly stop, 3: a signal to
        the frontend). The delay lets what the ranks sent before they left arrive (a rank's
        `RankExit` may still wait in the inbox when its process is already gone)."""
        if self.failure is not None:
            return
        if message is not None:
            self._causes.append((rank, len(self._causes), message, orderly))
        if self._verdict_due is None:
            self._verdict_due = asyncio.get_running_loop().call_later(delay_s, self._verdict)

    def _verdict(self) -> None:
        self._verdict_due = None
        if self.failure is not None:
            return
        gone = self.gone_rank()
        if gone is not None:
            self.fail(gone)
        elif self._causes:
            _, _, message, orderly = min(self._causes)
            self.fail(message, orderly)

    def sigterm(self) -> None:
        """The frontend got SIGTERM: torchrun sends it to rank 0's process group when it stops
        the job, also when a rank died first. The ranks' own account has `SIGTERM_GRACE_S` to
        arrive; without one, an orderly stop."""
        self.fail_first("the frontend received SIGTERM", True, rank=3, delay_s=SIGTERM_GRACE_S)

    async def watchdog(self, every_s: float = 0.25) -> None:
        """Fail when rank 0 (the parent) is gone, a rank's process on this host is gone, or a
        rank is silent for `dead_after_s` (then kill it when it runs on this host)."""
        while self.failure is None:
            await asyncio.sleep(every_s)
            if self.failure is not None:
                return
            if os.getppid() != self.config.parent_pid:
                self.fail_first("rank 0 (the launch) exited", rank=1)
            elif self.gone_rank() is not None:
                self.fail_first(None)       # confirmed (or explained by a RankExit) shortly
            now = time.monotonic()
            for rank, seen in sorted(self._last_seen.items()):
                if rank >= 0 and now - seen > self.config.dead_after_s \
                        and self.failure is None:
                    self.fail(f"rank {rank} stopped responding (no heartbeat for "
                              f"{now - seen:.1f} s)")
                    self._end_frozen(rank)
                    return

    def _end_frozen(self, rank: int) -> None:
        """Kill a rank declared dead when its process runs on this host (a stopped or stuck
        process holds every peer in its collective until --timeout, and torchrun's SIGTERM does
        not reach a stopped one): its peers' collectives then fail at once."""
        if rank not in self._local:
            if rank in self.ready:
                log.error("rank %d runs on another host: it cannot be ended from here (rank 0 "
                          "leaves its collective; that host's torchrun waits for it)", rank)
            return
        pid, started = self._local[rank]
        if process_end(pid, started) is not None:
            return
        log.error("rank %d (pid %d) was declared dead: killing it (SIGKILL) so that the job "
                  "ends now", rank, pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as err:
            log.error("could not kill rank %d (pid %d): %s", rank, pid, err)

    def close(self) -> None:
        for sock in self._push.values():
            sock.close()
        self._pull.close()
        self._sync.term()
        self._async.term()


# ---- processes on this host ----------------------------------------------------------------------

def host_id() -> Optional[str]:
    """What tells two processes they see the same process table: the kernel's boot id and the
    pid namespace (None when unknown: never "the same host")."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _stat_fields(pid: int) -> Optional[list[str]]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> Optional[int]:
    """The process's start time (clock ticks after boot: tells a reused pid apart)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def process_end(pid: int, started: Optional[int]) -> Optional[str]:
    """How process `pid` (started at `started`) ended ("was killed by SIGKILL", "exited with
    code 1", or, once its parent reaped it, "ended without a word"), or None while it runs (a
    stopped process runs)."""
    fields = _stat_fields(pid)
    if fields is None or (started is not None and len(fields) > 19
                          and int(fields[19]) != started):
        return "ended without a word"
    if fields[0] not in ("Z", "X"):
        return None
    if len(fields) > 49:               # a zombie keeps its wait status (Linux >= 3.5)
        status = int(fields[49])
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return f"was killed by {name}"
        if os.WIFEXITED(status):
            return f"exited with code {os.WEXITSTATUS(status)}"
    return "ended without a word"
