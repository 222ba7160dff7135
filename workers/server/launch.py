"""The `serve` command on one rank: sockets, address exchange, the frontend, the engine, the loop.

    torchrun --nproc-per-node N -m adaptive_dist serve --dp D [...]   (or one process: N = D = 1)

Rank r belongs to DP replica ``r // attn_tp`` and leads it when ``r % attn_tp == 0``. Rank 0
first binds the HTTP port (a busy port ends the start at once, exit 2, before anything loads).
Every rank binds its inbox (``channel.Endpoints``: a private ipc endpoint when the job is on one
host, TCP across hosts); ``gather_addresses`` gives rank 0 every address and every rank the job's
secret (one ``all_gather_object`` on a gloo group); rank 0 spawns the frontend with them in its
environment and hands it the listening socket. Every rank then loads its shards of the model,
the ranks agree every setting, build the DP-attention engine (`workers.launch.start_engine`, as
`generate` does), send ``Ready`` and run ``RankLoop`` in lockstep. SIGINT / SIGTERM stop the loop
(every rank leaves after the same round); the rank tells the frontend (``RankExit``), and rank 0
waits for the frontend to answer its clients and exit.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:
    from collectives import DistContext, ParallelLayout
    from workers.server.protocol import FrontendConfig
    from workers.settings import ClusterShape, ServeSettings

log = logging.getLogger("adaptive_dist.serve")

HEARTBEAT_S = 0.5


@dataclass(frozen=True)
class RankRole:
    """This rank's place in the serving cluster."""

    rank: int
    world_size: int
    dp: int
    attn_tp: int

    @property
    def dp_rank(self) -> int:
        return self.rank // self.attn_tp

    @property
    def is_leader(self) -> bool:
        return self.rank % self.attn_tp == 0


def rank_role(shape: "ClusterShape") -> RankRole:
    """This rank's role from the torchrun environment and `--dp` / `--attn-tp` / `--tp`;
    `ValueError` naming the numbers when they do not fit the job."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dp, attn_tp = shape.resolve(world)
    return RankRole(rank, world, dp, attn_tp)


def zmq_host() -> str:
    """The address other processes reach this rank's sockets on: loopback when the whole job
    runs on one node; across nodes, the IPv4 address of `GLOO_SOCKET_IFNAME` (its first
    interface) when set, else of the interface this host reaches MASTER_ADDR through (the
    address rank 0's host reaches it back on; the hostname may resolve to loopback)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if local == int(os.environ.get("WORLD_SIZE", "1")):
        return "127.0.0.1"
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        return _interface_address(ifname)
    master = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))   # UDP: picks the route, sends nothing
            return s.getsockname()[0]
    except OSError:                  # no IPv4 route or name: what the hostname resolves to
        return socket.gethostbyname(socket.gethostname())


def _interface_address(ifname: str) -> str:
    """The IPv4 address of network interface `ifname` (Linux); `ValueError` naming it."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915,   # SIOCGIFADDR
                                 struct.pack("256s", ifname.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError as err:
        raise ValueError(f"GLOO_SOCKET_IFNAME={ifname!r}: no IPv4 address on that interface "
                         f"({err.strerror})") from None


def gather_addresses(mine: Any, extra: Any, pg: Any) -> tuple[list[Any], list[Any]]:
    """(every rank's `mine`, every rank's `extra`) in rank order: one `all_gather_object` over
    the gloo group `pg` (None: a single process)."""
    if pg is None:
        return [mine], [extra]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, (mine, extra), group=pg)
    return [m for m, _ in out], [e for _, e in out]


def single_host() -> bool:
    """Whether every rank of the job runs on this host (torchrun's LOCAL_WORLD_SIZE)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) == world


def host_id() -> Optional[str]:
    """This process's host identity for the frontend (`cluster.host_id`)."""
    from workers.server.cluster import host_id as ident

    return ident()


def spawn_frontend(config: Any, secret: str) -> subprocess.Popen:
    """Start the frontend process (stdout/stderr shared with this rank). Its configuration and
    the job's secret go in its environment (readable by this user only), never on its command
    line; the listening socket `config.http_fd` is inherited."""
    from workers.server.channel import SECRET_ENV
    from workers.server.protocol import CONFIG_ENV

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(key, None)   # the frontend is no rank
    env[CONFIG_ENV] = config.to_json()
    env[SECRET_ENV] = secret
    fds = tuple(fd for fd in (config.http_fd, config.failure_fd) if fd is not None)
    return subprocess.Popen([sys.executable, "-m", "workers.server.frontend"], env=env,
                            pass_fds=fds)


class FrontendProcess(Protocol):
    """What rank 0 holds of the frontend it started (`spawn_frontend`: a `subprocess.Popen`)."""

    pid: int
    returncode: Optional[int]

    def poll(self) -> Optional[int]: ...

    def wait(self, timeout: Optional[float] = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


FrontendStarter = Callable[["FrontendConfig", str], FrontendProcess]
"""Starts the frontend from its configuration and the job's secret (`spawn_frontend`)."""


def stop_frontend(proc: FrontendProcess, wait_s: float) -> Optional[int]:
    """Wait up to `wait_s` for the frontend to exit by itself, then terminate (then kill) it."""
    for action in (None, proc.terminate, proc.kill):
        if action is not None:
            log.warning("the frontend did not exit in time; sending %s",
                        "SIGTERM" if action == proc.terminate else "SIGKILL")
            action()
        try:
            return proc.wait(timeout=wait_s if action is None else 5.0)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def set_thread_count() -> Optional[int]:
    """Unless the user set OMP_NUM_THREADS: torch's intra-op threads of this rank = the cores
    this process may run on, less one (the frontend's, and the machine's own), shared by the
    ranks of this host; at least 1. (torch's default, every core, spins its threads against the
    frontend and the other ranks: several times slower on a small machine.) The count set, or
    None when left to OMP_NUM_THREADS."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    threads = max(1, ((cores or 1) - 1) // local)
    torch.set_num_threads(threads)
    log.info("%d torch thread(s) per rank (%d core(s), %d rank(s) here; OMP_NUM_THREADS "
             "overrides)", threads, cores or 1, local)
    return threads


def setup_logging(name: str) -> None:
    """One line per record, prefixed by the process's role (ranks share stderr)."""
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(message)s", stream=sys.stderr,
                        force=True)


class _Signals:
    """SIGINT / SIGTERM set the stop flag and wake the inbox's poll; restored on exit."""

    def __init__(self, stop: Any) -> None:
        self.stop, self._old = stop, {}

    def install(self, wakeup_fd: int) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        self._old_fd = signal.set_wakeup_fd(wakeup_fd)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.stop.set(f"received {signal.Signals(signum).name}")

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        if self._old:
            signal.set_wakeup_fd(self._old_fd)


def cmd_serve(settings: "ServeSettings") -> int:
    """Handler of `serve` (every rank). The process ends here, without the interpreter's
    teardown (seconds with torch loaded): everything it holds was closed above."""
    from adaptive_dist.failures import EXIT_INTERNAL, describe_failure, say

    try:
        code = serve_rank(settings)
    except BaseException as exc:  # one line and the documented exit code, as every command
        described = describe_failure(exc) if isinstance(exc, Exception) else None
        if described is None:
            import traceback

            traceback.print_exc()
            code = EXIT_INTERNAL
        else:
            label, code, message = described
            say(f"{label}: {message}")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve_rank(settings: "ServeSettings",
               start_frontend: FrontendStarter = spawn_frontend) -> int:
    """`serve` on this rank, start to end: the HTTP port (rank 0), the process group, the job's
    secret, the inbox and the address exchange, the frontend (rank 0: `start_frontend`), the
    engine, the loop, and everything closed again. Returns the exit code."""
    import zmq

    from collectives import init_distributed
    from workers.server.channel import Endpoints
    from workers.server.inbox import HeartbeatThread, Inbox, Outbox
    from workers.server.perimeter import bind_http, connection_cap
    from workers.server.protocol import FrontendConfig, RankAddress, RankExit
    from workers.server.rank import StopFlag

    launch = settings.launch
    role = rank_role(launch.shape)
    setup_logging(f"rank {role.rank}")
    set_thread_count()
    settings.check()
    http = None
    max_connections = 0
    if role.rank == 0:     # before anything loads: a busy port or a bad cap ends the start now
        max_connections = connection_cap(settings.max_connections, role.world_size)
        http = bind_http(settings.host, settings.port)
    backend = "gloo" if (launch.device or "cpu") == "cpu" else None
    ctx = init_distributed(timeout_s=launch.timeout, backend=backend, record=True)
    zctx = zmq.Context()
    endpoints = Endpoints(None if single_host() else zmq_host())
    secret, key = job_secret(ctx, role)
    inbox = Inbox(zctx, endpoints, key, name=f"rank {role.rank}")
    stop = StopFlag()
    signals = _Signals(stop)
    signals.install(inbox.wakeup_fd)
    frontend: Optional[FrontendProcess] = None
    alarm_r: Optional[int] = None
    outbox = heartbeat = None
    failed = True
    closers = contextlib.ExitStack()
    try:
        first = ctx.layout(dp=1)
        pg = first.group("world").control_pg if ctx.distributed else None
        pull = endpoints.address_for("frontend") if role.rank == 0 else None
        mine = RankAddress(role.rank, role.dp_rank, role.is_leader, inbox.address)
        ranks, pulls = gather_addresses(mine, pull, pg)
        pull = pulls[0]
        outbox = Outbox(zctx, pull, key)
        heartbeat = HeartbeatThread(zctx, pull, role.rank, HEARTBEAT_S, key, inbox)
        heartbeat.start()
        if role.rank == 0:
            alarm_r, alarm_w = os.pipe()
            port = http.getsockname()[1]      # --port 0: the one the system gave
            frontend = start_frontend(FrontendConfig(
                host=settings.host, port=port, pull_address=pull, ranks=ranks,
                dp=role.dp,
                model_name=settings.served_model_name or Path(launch.model).resolve().name,
                max_batch_size=launch.engine.max_batch_size, max_queue=settings.max_queue,
                routing=settings.routing, parent_pid=os.getpid(),
                dead_after_s=min(launch.timeout, 10.0),
                chat_template=settings.chat_template, http_fd=http.fileno(),
                max_body_size=settings.max_body_size, header_timeout=settings.header_timeout,
                body_timeout=settings.body_timeout,
                timeout_keep_alive=settings.timeout_keep_alive,
                max_connections=max_connections,
                chat_template_timeout=settings.chat_template_timeout,
                failure_fd=alarm_w), secret)
            http.close()          # the frontend holds them now
            http = None
            os.close(alarm_w)
            log.info("frontend at http://%s:%d (pid %d); loading the model", settings.host,
                     port, frontend.pid)
        watch = _StuckWatch(frontend, alarm_r, endpoints.close) if frontend is not None \
            else None
        try:
            loop = _build_loop(ctx, first, settings, role, inbox, outbox, stop, frontend,
                               closers)
            if watch is not None:
                watch.start()
            result = loop.run()
        except Exception as err:   # the frontend answers every client with this message
            outbox.send(RankExit(role.rank, f"{type(err).__name__}: {err}", True))
            raise
        finally:
            if watch is not None:
                watch.left.set()
        outbox.send(RankExit(role.rank, result.reason, result.error))
        (log.error if result.error else log.info)("stopping: %s", result.reason)
        failed = result.error
        # NOTE: across hosts, a stop another rank asked for (its signal, its failure) exits
        # non-zero: on a clean exit torchrun's agent of this node waits (300 s) in its exit
        # barrier for every node's agent, and the agent of a node stopped by a signal never
        # arrives. On one host there is one agent and no such wait: a clean stop is 0 on every
        # rank, so torchrun ends without a traceback (docs/serving.md, "Stopping").
        return 1 if result.error or (result.by_peer and not single_host()) else 0
    finally:
        closers.close()  # NOTE: the engine's CUDA graphs go before the process group
        if heartbeat is not None:
            heartbeat.stop()
        if frontend is not None:
            code = stop_frontend(frontend, wait_s=15.0)
            log.info("the frontend exited (code %s)", code)
        if http is not None:
            http.close()
        if outbox is not None:
            outbox.close()
        inbox.close()
        zctx.term()
        endpoints.close()
        if alarm_r is not None:
            os.close(alarm_r)
        signals.restore()
        if ctx.distributed and not failed:
            ctx.shutdown()   # after a failure a peer may be gone: just exit


class _StuckWatch(threading.Thread):
    """Rank 0's guard against waiting out a failed job. The frontend writes a byte to `alarm`
    (a pipe) when it declares the job failed, and the pipe closes when it exits. The loop then
    leaves within a round (the frontend's Shutdown, or its exit, reaches it). If it has not
    after `grace_s`, this rank is stuck in a round's collective with a rank that is gone or
    frozen (the frontend declared it dead and, on this host, killed it): leave now, exit 4,
    rather than after the collective's failure diagnosis or its timeout."""

    def __init__(self, frontend: FrontendProcess, alarm: int, cleanup: Any,
                 grace_s: float = 1.5) -> None:
        super().__init__(name="stuck-watch", daemon=True)
        self.frontend, self.alarm, self.grace_s = frontend, alarm, grace_s
        self.cleanup = cleanup
        self.left = threading.Event()

    def run(self) -> None:
        import select
        import time

        from adaptive_dist.failures import say
        from collectives.errors import EXIT_TIMEOUT

        failed_at: Optional[float] = None
        while not self.left.is_set():
            if failed_at is None:
                if select.select([self.alarm], [], [], 0.2)[0]:
                    raised = os.read(self.alarm, 64)
                    if raised or self._exit_code() not in (None, 0):
                        failed_at = time.monotonic()
                    elif not raised:          # closed by an orderly exit: nothing to watch
                        return
                continue
            if self.left.wait(0.1):
                return
            if time.monotonic() - failed_at >= self.grace_s:
                say("CollectiveTimeoutError: the frontend declared the job failed (its line "
                    "above says why) while this rank waited in a round's collective; leaving "
                    "now")
                self.cleanup()
                logging.shutdown()
                os._exit(EXIT_TIMEOUT)

    def _exit_code(self) -> Optional[int]:
        try:
            return self.frontend.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None


def job_secret(ctx: Any, role: RankRole) -> tuple[str, Any]:
    """The job's secret and keys (``channel``): ADAPTIVE_DIST_SERVE_SECRET when set (every rank
    must have the same; they compare digests, never the secret), else one rank 0 draws and
    hands to the others over the gloo group. `ValueError` naming the variable and the ranks
    when the ranks disagree."""
    from workers.server.channel import (SECRET_ENV, JobKey, new_secret, secret_digest,
                                        user_secret)

    given = user_secret()
    drawn = new_secret() if role.rank == 0 and given is None else None
    digest = secret_digest(given) if given is not None else None
    pg = ctx.layout(dp=1).group("world").control_pg if ctx.distributed else None
    _, shared = gather_addresses(None, (drawn, digest), pg)
    digests = [d for _, d in shared]
    if len(set(digests)) > 1:
        unset = [r for r, d in enumerate(digests) if d is None]
        what = (f"set on some ranks only (unset on rank(s) {unset})" if unset else
                "different values on the ranks")
        raise ValueError(f"{SECRET_ENV}: {what}; give every rank the same secret, or none")
    secret = given if given is not None else shared[0][0]
    return secret, JobKey(secret)


def _build_loop(ctx: "DistContext", first: "ParallelLayout", settings: "ServeSettings",
                role: RankRole, inbox: Any, outbox: Any, stop: Any,
                frontend: Optional[FrontendProcess], closers: contextlib.ExitStack) -> Any:
    """Load the model, build the engine (every rank agrees every setting), announce readiness;
    the loop to run."""
    from workers.launch import start_engine
    from workers.server.engine_glue import EngineAdapter, serving_sizes
    from workers.server.protocol import ModelInfo, Ready
    from workers.server.rank import RankLoop

    launch = settings.launch
    cluster = start_engine(
        ctx, launch, closers, extra={"--max-model-len": settings.max_model_len,
                                     "--max-batch-size": launch.engine.max_batch_size},
        size_for=lambda cfg, dp: serving_sizes(cfg, launch.engine.max_batch_size,
                                               settings.max_model_len),
        first_layout=first)
    mcfg, engine, tok = cluster.target.config, cluster.engine, cluster.tokenizer
    eos = tuple(tok.eos_token_ids)
    adapter = EngineAdapter(engine, eos, role.dp_rank, mcfg.vocab_size)
    mode = cluster.config.mode
    info = ModelInfo(max_context_len=cluster.config.max_context_len,
                     bos_token_id=tok.bos_token_id, eos_token_ids=list(eos),
                     vocab_size=mcfg.vocab_size, mode=mode,
                     tokenizer_dir=str(Path(cluster.target_dir).resolve()))
    loop = RankLoop(adapter, inbox, outbox if role.is_leader else None, role.dp_rank, stop,
                    alive=_frontend_check(frontend))
    outbox.send(Ready(role.rank, role.dp_rank, role.is_leader, os.getpid(), info,
                      adapter.queue_stats().kv_usable_pages, host_id()))
    if role.is_leader:
        loop.announce()
    log.info("serving: %s, DP replica %d of %d (attention over %d ranks), batch %d, context %d",
             mode, role.dp_rank, role.dp, role.attn_tp, launch.engine.max_batch_size,
             cluster.config.max_context_len)
    return loop


def _frontend_check(frontend: Optional[FrontendProcess]) -> Any:
    """Rank 0's liveness check of its frontend (None: nothing to check on other ranks)."""
    def check() -> Optional[str]:
        if frontend is not None and frontend.poll() is not None:
            return f"the frontend exited unexpectedly (code {frontend.returncode})"
        return None
    return check
