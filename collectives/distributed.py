"""Process-group set-up from the torchrun environment, and a clean shutdown.

``init_distributed`` picks NCCL when every local rank has its own GPU and gloo otherwise, sets the
CUDA device from ``LOCAL_RANK`` before the process group exists, applies an explicit timeout, and
returns a ``DistContext`` from which the parallel layout (with a gloo control group beside every
device group) is built. Without torchrun variables it returns a single-process context.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from collectives.group import Group
from collectives.guard import LockstepGuard
from collectives.layout import ParallelLayout
from collectives.recorder import CollectiveRecorder

DEFAULT_TIMEOUT_S = 60.0


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
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def pick_backend(local_world_size: int, requested: Optional[str] = None) -> str:
    """NCCL when CUDA has a GPU for every local rank, else gloo; ``requested`` overrides."""
    if requested is not None:
        if requested not in ("nccl", "gloo"):
            raise ValueError(f"backend={requested!r}; allowed: 'nccl', 'gloo'")
        if requested == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' was asked for but CUDA has no GPU here")
        return requested
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


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
    _guards: list = field(default_factory=list, repr=False)

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def layout(self, dp: int = 1, tp: Optional[int] = None) -> ParallelLayout:
        """Build (collectively, on every rank) and validate the parallel layout."""
        tp = self.world_size if tp is None else tp
        layout = ParallelLayout.build(
            world_size=self.world_size, rank=self.rank, dp=dp, tp=tp, device=self.device,
            device_backend=self.backend, recorder=self.recorder,
            timeout=timedelta(seconds=self.pg_timeout_s) if self.distributed else None,
            control_timeout=timedelta(seconds=self.timeout_s) if self.distributed else None,
        )
        return layout

    @property
    def pg_timeout_s(self) -> float:
        # NOTE: with NCCL the host never sees a device collective fail; the guard's watchdog
        # (armed at timeout_s) reports first, so torch's own NCCL watchdog is given more time.
        return self.timeout_s if self.backend != "nccl" else self.timeout_s + 60.0

    def store(self) -> Optional[dist.Store]:
        """The rendezvous store (reachable even when a process group is stuck)."""
        if not self.distributed:
            return None
        from torch.distributed import distributed_c10d as c10d

        get = getattr(c10d, "_get_default_store", None)
        return get() if get is not None else None

    def guard(self, group: Group, check_every: int = 8) -> LockstepGuard:
        """A lockstep guard over ``group`` (normally ``world``); needs recording on."""
        if self.recorder is None:
            raise ValueError("the lockstep guard needs init_distributed(record=True)")
        watchdog_s = self.timeout_s if self.backend == "nccl" else self.timeout_s * 1.5 + 5.0
        guard = LockstepGuard(group, self.recorder, check_every=check_every,
                              timeout_s=self.timeout_s, watchdog_s=watchdog_s, store=self.store())
        self._guards.append(guard)
        return guard

    def shutdown(self, aborted: bool = False) -> None:
        """Destroy the process groups. After a failure (``aborted``) skip the teardown, which is
        collective for some backends, so a stuck peer cannot hang this process."""
        if not self.distributed or not dist.is_initialized():
            return
        for guard in self._guards:
            guard.close()
            if aborted and guard.published:
                guard.linger()  # peers stuck in a collective may still need this rank's store
        if aborted:
            self._leave_together()
        else:
            dist.destroy_process_group()

    def _leave_together(self, wait_s: float = 5.0) -> None:
        """Bounded wait until every rank reached its exit path, so that every rank's error
        message is printed before a launcher tears the job down on the first exit."""
        store = self.store()
        if store is None:
            return
        try:
            store.set(f"adaptive_dist/leaving/{self.rank}", "1")
            keys = [f"adaptive_dist/leaving/{r}" for r in range(self.world_size)]
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not store.check(keys):
                time.sleep(0.02)
        except Exception:
            pass  # the store is gone: nobody is left to wait for


def init_distributed(
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: Optional[str] = None,
    record: bool = True,
    strict: bool = False,
    keep_log: bool = False,
) -> DistContext:
    """Initialise torch.distributed from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Without them, a single-process context.

    ``timeout_s`` bounds every collective. ``record`` turns on the per-rank collective log;
    ``strict`` (a debug mode, one extra host exchange per collective) compares every collective
    across its group before issuing it. ``keep_log`` keeps every entry (to dump it); otherwise
    only the rolling hash and the entries since the last lockstep check are kept.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    recorder = (CollectiveRecorder(rank, keep_log=keep_log, strict=strict)
                if (record or strict or keep_log) else None)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        return DistContext(rank, 1, 0, device, None, timeout_s, recorder)
    chosen = pick_backend(local_world, backend)
    if chosen == "nccl":
        # NOTE: the device must be set before the process group exists (NCCL binds to it).
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    ctx = DistContext(rank, world_size, local_rank, device, chosen, timeout_s, recorder)
    kwargs = {"device_id": device} if chosen == "nccl" else {}
    dist.init_process_group(
        backend=chosen, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=ctx.pg_timeout_s), **kwargs,
    )
    return ctx
