"""Process-group set-up from the launcher's environment, and a clean (or a bounded) shutdown.

``init_distributed`` reads the torchrun-style environment (the same variables a multi-node launch
by hand sets), hosts or reaches the rendezvous store, and lets the ranks *join*: every rank posts
what it is about to start (backend, world size) or why it cannot start, and every rank waits, at
most ``timeout_s``, for all of them. A rank that cannot start, ranks that disagree, or a rank that
never arrives stop every rank with one line naming the ranks, before any process group exists.
Then the process group is created on that store: NCCL when every local rank has its own GPU and
gloo otherwise, the CUDA device set from ``LOCAL_RANK`` first, an explicit timeout. Without the
launcher's variables it returns a single-process context.
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from collectives.errors import CollectiveTimeoutError, StartupError
from collectives.group import Group
from collectives.guard import LockstepGuard, grace_seconds, short_cause
from collectives.layout import ParallelLayout
from collectives.recorder import CollectiveRecorder

DEFAULT_TIMEOUT_S = 60.0
JOIN_PREFIX = "join/"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for tests and local launches)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise StartupError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str]
    master_port: int

    @property
    def distributed(self) -> bool:
        return not (self.world_size == 1 and self.master_addr is None)


def launch_env() -> LaunchEnv:
    """Read RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; raise
    ``StartupError`` naming the variable when one is malformed or missing."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if world_size < 1:
        raise StartupError(f"WORLD_SIZE={world_size}: must be >= 1")
    if not 0 <= rank < world_size:
        raise StartupError(f"RANK={rank} is outside WORLD_SIZE={world_size} (allowed: 0..{world_size - 1})")
    addr = os.environ.get("MASTER_ADDR") or None
    port = _env_int("MASTER_PORT", 0)
    env = LaunchEnv(rank, world_size, _env_int("LOCAL_RANK", 0),
                    _env_int("LOCAL_WORLD_SIZE", world_size), addr, port)
    if env.distributed and (addr is None or not 0 < port < 65536):
        raise StartupError(f"WORLD_SIZE={world_size} needs MASTER_ADDR and MASTER_PORT (1..65535) "
                           f"on every rank; got MASTER_ADDR={addr!r}, MASTER_PORT={port}")
    return env


def check_timeout(timeout_s: float, flag: str = "--timeout") -> float:
    """``timeout_s`` if it is a finite number of seconds > 0, else ``ValueError`` naming ``flag``."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"{flag} {timeout_s!r}: must be a finite number of seconds > 0")
    return float(timeout_s)


def pick_backend(local_world_size: int, requested: Optional[str] = None) -> str:
    """NCCL when CUDA has a GPU for every local rank, else gloo; ``requested`` overrides."""
    if requested is not None:
        if requested not in ("nccl", "gloo"):
            raise StartupError(f"backend={requested!r}; allowed: 'nccl', 'gloo'")
        if requested == "nccl" and not torch.cuda.is_available():
            raise StartupError("--backend nccl was asked for but CUDA has no GPU here")
        return requested
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


# ---- the rendezvous store and the join --------------------------------------------------------

def connect_store(env: LaunchEnv, timeout_s: float) -> dist.Store:
    """Host (rank 0) or reach the job's TCP store at MASTER_ADDR:MASTER_PORT. Under torchrun
    its agent hosts it (TORCHELASTIC_USE_AGENT_STORE); keys live under a per-attempt prefix."""
    where = f"{env.master_addr}:{env.master_port}"
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = env.rank == 0 and not agent
    try:
        tcp = dist.TCPStore(env.master_addr, env.master_port, None, host,
                            timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as exc:
        if host:
            raise StartupError(f"rank 0 cannot host the rendezvous store on {where} "
                               f"(MASTER_ADDR/MASTER_PORT): {short_cause(exc)}") from None
        raise CollectiveTimeoutError(
            f"rank {env.rank}: could not reach the rendezvous store at {where} within "
            f"{timeout_s:g} s ({short_cause(exc)}); is rank 0 running, with the same MASTER_ADDR "
            f"and MASTER_PORT?") from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"adaptive_dist/attempt_{attempt}/", tcp)


def join(store: dist.Store, env: LaunchEnv, mine: dict, timeout_s: float) -> list[dict]:
    """Post this rank's start-up record (``{"error": ...}`` if it cannot start) and wait, at most
    ``timeout_s``, for every rank's. Every rank reaches the same verdict: ``StartupError`` if a
    rank cannot start or the records disagree, ``CollectiveTimeoutError`` naming the ranks that
    never arrived. Lives on the store, before any process group exists."""
    store.set(f"{JOIN_PREFIX}{env.rank}", json.dumps(mine, sort_keys=True))
    deadline = time.monotonic() + timeout_s
    records: dict[int, dict] = {}
    while True:
        for r in range(env.world_size):
            if r not in records and store.check([f"{JOIN_PREFIX}{r}"]):
                records[r] = json.loads(store.get(f"{JOIN_PREFIX}{r}"))
        expired = time.monotonic() > deadline
        if len(records) == env.world_size or expired:
            break
        time.sleep(0.02)
    error = _join_error(records, env.world_size, timeout_s)
    if error is None:
        return [records[r] for r in range(env.world_size)]
    _leave_join(store, env, records, timeout_s)
    raise error


def _join_error(records: dict[int, dict], world_size: int, timeout_s: float) -> Optional[Exception]:
    """The start-up error every rank derives from the same records (None: all is well)."""
    missing = [r for r in range(world_size) if r not in records]
    late = (f"rank(s) {missing} of {world_size} did not join within {timeout_s:g} s (not "
            f"started, exited early: see their output, or a different MASTER_ADDR/MASTER_PORT/"
            f"WORLD_SIZE)") if missing else ""
    failed: dict[str, list[int]] = {}
    for r in sorted(records):
        if "error" in records[r]:
            failed.setdefault(records[r]["error"], []).append(r)
    if failed:
        detail = "; ".join(f"rank(s) {ranks}: {msg}" for msg, ranks in failed.items())
        return StartupError(f"start-up refused on every rank: {detail}" + (f"; {late}" if late else ""))
    if missing:
        return CollectiveTimeoutError(f"start-up: {late}")
    diff = describe_differences([records[r] for r in range(world_size)], tuple(range(world_size)))
    if diff:
        return StartupError(f"start-up refused on every rank: ranks differ in {diff}")
    return None


def _leave_join(store: dist.Store, env: LaunchEnv, records: dict[int, dict],
                timeout_s: float) -> None:
    """Before a failed join ends this rank: mark the records read. Rank 0 hosts the store, so it
    waits (bounded) until every rank that joined has read them."""
    try:
        store.set(f"{JOIN_PREFIX}read/{env.rank}", "1")
        if env.rank == 0:
            wait_for_keys(store, [f"{JOIN_PREFIX}read/{r}" for r in sorted(records)],
                          grace_seconds(timeout_s))
    except Exception:
        pass  # the store is gone: nobody is left to wait for


def wait_for_keys(store: dist.Store, keys: list[str], wait_s: float) -> list[str]:
    """Poll until every key exists or ``wait_s`` passed; return the keys still missing."""
    deadline = time.monotonic() + wait_s
    missing = list(keys)
    while missing:
        missing = [k for k in missing if not store.check([k])]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return missing


def describe_differences(views: list[dict], ranks: tuple[int, ...]) -> str:
    """``key (ranks [0] have X, ranks [1] have Y); ...`` over every key whose value differs
    across ``views`` (one dict per rank, in the order of ``ranks``); '' when all agree."""
    keys = sorted(set().union(*views))
    parts = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, view in zip(ranks, views):
            by_value.setdefault(_show(view.get(key, "<unset>")), []).append(rank)
        if len(by_value) > 1:
            shown = ", ".join(f"ranks {rs} have {v}" for v, rs in by_value.items())
            parts.append(f"{key} ({shown})")
    return "; ".join(parts)


def _show(value: object) -> str:
    return value if isinstance(value, str) and value == "<unset>" else json.dumps(value, sort_keys=True)


# ---- the context --------------------------------------------------------------------------------

@dataclass(eq=False)
class DistContext:
    """What one process knows about the job: its rank, device, backend, store and recorder."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: Optional[str]          # None: a single process without torch.distributed
    timeout_s: float
    recorder: Optional[CollectiveRecorder] = None
    store: Optional[dist.Store] = field(default=None, repr=False)
    _guards: list = field(default_factory=list, repr=False)

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def grace_s(self) -> float:
        """How long a live peer is given to answer during a diagnosis or at the exit."""
        return grace_seconds(self.timeout_s)

    def layout(self, dp: int = 1, tp: Optional[int] = None) -> ParallelLayout:
        """Build (collectively, on every rank) and validate the parallel layout."""
        tp = self.world_size if tp is None else tp
        try:
            return ParallelLayout.build(
                world_size=self.world_size, rank=self.rank, dp=dp, tp=tp, device=self.device,
                device_backend=self.backend, recorder=self.recorder,
                timeout=timedelta(seconds=self.pg_timeout_s) if self.distributed else None,
                control_timeout=timedelta(seconds=self.timeout_s) if self.distributed else None,
            )
        except ValueError:
            raise
        except Exception as exc:  # a peer died or the store went away while groups were made
            raise CollectiveTimeoutError(
                f"rank {self.rank}: creating the process groups failed ({short_cause(exc)}); "
                f"a peer stopped or is unreachable") from None

    @property
    def pg_timeout_s(self) -> float:
        # NOTE: with NCCL the host never sees a device collective fail; the guard's watchdog
        # (armed at timeout_s) reports first, so torch's own NCCL watchdog is given more time.
        return self.timeout_s if self.backend != "nccl" else self.timeout_s + 60.0

    def guard(self, group: Group, check_every: int = 8) -> LockstepGuard:
        """A lockstep guard over ``group`` (normally ``world``); needs recording on."""
        if self.recorder is None:
            raise ValueError("the lockstep guard needs init_distributed(record=True)")
        # gloo raises on its own after timeout_s; the watchdog is the backstop for a rank stuck
        # outside any collective. NCCL never raises on the host: the watchdog is the detector.
        slack = 0.0 if self.backend == "nccl" else self.grace_s + 1.0
        watch_store = self.store.clone() if self.store is not None else None
        guard = LockstepGuard(group, self.recorder, check_every=check_every,
                              timeout_s=self.timeout_s, watchdog_s=self.timeout_s + slack,
                              store=self.store, watch_store=watch_store)
        self._guards.append(guard)
        return guard

    def claim_exit(self) -> bool:
        """Whether this thread may report the failure and end the process (False: a guard's
        watchdog is already doing it; wait for it)."""
        return all(g.try_claim() for g in self._guards)

    def abandon(self, label: str, code: int, message: str) -> None:
        """After this rank failed and printed ``label: message``: tell the peers (so ranks still
        running stop at once with the same line) and wait, bounded, until the live ones have
        printed theirs. Never blocks on a stuck process group."""
        if not self.distributed:
            return
        if self._guards:
            for guard in self._guards:
                guard.close()
                guard.abandon(label, code, message)
        else:
            self._leave_together(self.grace_s)

    def shutdown(self, aborted: bool = False) -> None:
        """Destroy the process groups. After a failure (``aborted``) skip the teardown, which is
        collective for some backends, so a stuck peer cannot hang this process."""
        if not self.distributed or not dist.is_initialized():
            return
        for guard in self._guards:
            guard.close()
            if aborted:
                guard.finish()
        if aborted:
            if not self._guards:
                self._leave_together(self.grace_s)
        else:
            dist.destroy_process_group()

    def _leave_together(self, wait_s: float) -> None:
        """Bounded wait until every rank reached its exit path, so that every rank's error
        message is printed before a launcher tears the job down on the first exit."""
        if self.store is None:
            return
        try:
            self.store.set(f"leaving/{self.rank}", "1")
            wait_for_keys(self.store, [f"leaving/{r}" for r in range(self.world_size)],
                          wait_s)
        except Exception:
            pass  # the store is gone: nobody is left to wait for


def init_distributed(
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: Optional[str] = None,
    record: bool = True,
    strict: bool = False,
    keep_log: bool = False,
) -> DistContext:
    """Initialise torch.distributed from the launcher's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: torchrun sets them; a launch by hand
    sets them per process). Without them, a single-process context.

    ``timeout_s`` bounds every collective and the join. ``record`` turns on the per-rank
    collective log; ``strict`` (a debug mode, one extra host exchange per collective) compares
    every collective across its group before issuing it. ``keep_log`` keeps every entry (to dump
    it); otherwise only the rolling hash and the entries since the last lockstep check are kept.
    Errors: ``StartupError`` (a ``ValueError``) for a rank that cannot start or ranks that
    disagree, ``CollectiveTimeoutError`` for a rank that never arrives; the same on every rank.
    """
    check_timeout(timeout_s, "timeout_s")
    env = launch_env()
    recorder = (CollectiveRecorder(env.rank, keep_log=keep_log, strict=strict)
                if (record or strict or keep_log) else None)
    if not env.distributed:
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        return DistContext(env.rank, 1, 0, device, None, timeout_s, recorder)
    try:
        chosen: Optional[str] = pick_backend(env.local_world_size, backend)
        mine = {"world size": env.world_size, "backend": chosen}
    except ValueError as exc:
        chosen, mine = None, {"error": str(exc)}
    store = connect_store(env, timeout_s)
    join(store, env, mine, timeout_s)
    if chosen == "nccl":
        # NOTE: the device must be set before the process group exists (NCCL binds to it).
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    ctx = DistContext(env.rank, env.world_size, env.local_rank, device, chosen, timeout_s,
                      recorder, store)
    kwargs = {"device_id": device} if chosen == "nccl" else {}
    try:
        dist.init_process_group(backend=chosen, store=store, rank=env.rank,
                                world_size=env.world_size,
                                timeout=timedelta(seconds=ctx.pg_timeout_s), **kwargs)
    except Exception as exc:
        raise CollectiveTimeoutError(
            f"rank {env.rank}: creating the {chosen} process group failed "
            f"({short_cause(exc)}); a peer stopped or is unreachable") from None
    return ctx


def announce_startup_failure(message: str, wait_s: float = DEFAULT_TIMEOUT_S) -> Optional[Exception]:
    """For a rank that cannot even parse its command line under a distributed launch: join with
    ``message`` as its error, so every rank stops with the same line instead of waiting for it.
    Returns the error every rank reports (None outside a distributed launch, or when the peers
    could not be reached); never raises (the caller exits anyway)."""
    try:
        env = launch_env()
        if not env.distributed:
            return None
        store = connect_store(env, wait_s)
        join(store, env, {"error": message}, wait_s)
    except (StartupError, CollectiveTimeoutError) as exc:
        return exc if "start-up refused" in str(exc) else None
    except Exception:
        return None
    return None
