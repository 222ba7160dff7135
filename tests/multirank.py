"""One spawn harness for multi-rank tests: real processes, real gloo (or NCCL) process groups.

Each rank runs ``fn(rank, *args)`` in a fresh spawned process with the torchrun environment set
(free port on 127.0.0.1). The parent waits with a hard timeout, so a hang fails the test instead
of stalling the suite, and every rank's traceback is shown.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

from collectives import free_port


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error_type: Optional[str] = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    exitcode: Optional[int] = None


def _child(fn, rank, world_size, port, args, env, results) -> None:
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
    })
    os.environ.update(env or {})
    try:
        value = fn(rank, *args)
        results.put((rank, True, value, None, None, None))
    except BaseException as exc:  # report everything, including SystemExit
        results.put((rank, False, None, type(exc).__name__, str(exc), traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    env: Optional[dict[str, str]] = None,
    check: bool = True,
) -> list[RankResult]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned ranks; return one result per rank.

    With ``check`` (default) any failed, killed or hung rank fails with every rank's report.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, env, results),
                         name=f"rank{r}", daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout
    while len(got) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, value, etype, err, tb = results.get(timeout=0.2)
            got[rank] = RankResult(rank, ok, value, etype, err, tb)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    hung = [p for p in procs if p.is_alive() and int(p.name[4:]) not in got]
    for p in procs:
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if not hung else 0.1)
        if p.is_alive():
            p.kill()
            p.join()
    out = []
    for r, p in enumerate(procs):
        res = got.get(r) or RankResult(r, False, error_type="NoResult",
                                        error="hung past the timeout" if p in hung
                                        else f"died with exit code {p.exitcode}")
        res.exitcode = p.exitcode
        out.append(res)
    if check and not all(r.ok for r in out):
        raise AssertionError("multi-rank run failed:\n" + format_results(out))
    return out


def format_results(results: list[RankResult]) -> str:
    lines = []
    for r in results:
        status = "ok" if r.ok else f"{r.error_type}: {r.error}"
        lines.append(f"--- rank {r.rank} (exit {r.exitcode}): {status}")
        if r.traceback:
            lines.append(r.traceback)
    return "\n".join(lines)
