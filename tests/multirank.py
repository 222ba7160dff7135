"""Harnesses for multi-rank tests: real processes, real gloo (or NCCL) process groups.

``run_ranks``: each rank runs ``fn(rank, *args)`` in a fresh spawned process with the torchrun
environment set (free port on 127.0.0.1). The parent waits with a hard timeout, so a hang fails
the test instead of stalling the suite, and every rank's traceback is shown.

``launch_by_hand`` / ``HandLaunch``: each rank is a plain ``python -m adaptive_dist ...`` process
with its own argv and the launcher's variables, as a multi-node launch without torchrun does;
a test can wait for output, kill a rank, and read every rank's exit code, output and exit time.
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


# ---- ranks launched by hand -------------------------------------------------------------------

@dataclass
class HandResult:
    """What one hand-launched rank left behind."""

    rank: int
    returncode: Optional[int]   # None: still running at the deadline (then killed)
    stdout: str
    stderr: str
    elapsed: float              # seconds from the launch (or from ``since``) to its exit

    def lines(self) -> list[str]:
        """Non-empty stderr lines, without tqdm's carriage-return redraws."""
        return [ln.rsplit("\r", 1)[-1] for ln in self.stderr.splitlines()
                if ln.rsplit("\r", 1)[-1].strip()]


class HandLaunch:
    """Ranks started as plain ``python -m adaptive_dist ...`` processes, each with its own
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as a multi-node
    launch without torchrun's supervision does. stdout/stderr are read continuously, so a test
    can wait for a rank to reach some point (``wait_for``) before, say, killing another."""

    def __init__(self, argv_per_rank: list[list[str]], env: Optional[dict[str, str]] = None,
                 module: str = "adaptive_dist") -> None:
        import subprocess
        import sys
        import threading

        world = len(argv_per_rank)
        port = free_port()
        self.t0 = time.monotonic()
        self.procs: list = []
        self._out: list[list[str]] = []
        self._err: list[list[str]] = []
        self._ended: list[Optional[float]] = [None] * world
        self._threads = []
        for rank, argv in enumerate(argv_per_rank):
            penv = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank),
                    "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1", **(env or {})}
            proc = subprocess.Popen([sys.executable, "-m", module, *argv], env=penv,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self.procs.append(proc)
            self._out.append([])
            self._err.append([])
            for stream, sink in ((proc.stdout, self._out[rank]), (proc.stderr, self._err[rank])):
                t = threading.Thread(target=self._pump, args=(stream, sink), daemon=True)
                t.start()
                self._threads.append(t)

    @staticmethod
    def _pump(stream, sink: list[str]) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            sink.append(chunk.decode(errors="replace"))

    def stderr(self, rank: int) -> str:
        return "".join(self._err[rank])

    def wait_for(self, rank: int, text: str, timeout: float = 60.0) -> bool:
        """Wait until ``text`` appears on ``rank``'s stderr (True) or it exits / time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.stderr(rank):
                return True
            if self.procs[rank].poll() is not None:
                return text in self.stderr(rank)
            time.sleep(0.05)
        return False

    def kill(self, rank: int, sig: int = 9) -> float:
        """Send ``sig`` to ``rank``; return the moment (time.monotonic())."""
        self.procs[rank].send_signal(sig)
        return time.monotonic()

    def wait(self, timeout: float = 90.0, since: Optional[float] = None) -> list[HandResult]:
        """Wait for every rank (killing what is left at the deadline); ``elapsed`` of each is
        measured from ``since`` (default: the launch)."""
        deadline = time.monotonic() + timeout
        start = self.t0 if since is None else since
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            for r, p in enumerate(self.procs):
                if self._ended[r] is None and p.poll() is not None:
                    self._ended[r] = time.monotonic()
            time.sleep(0.02)
        results = []
        for r, p in enumerate(self.procs):
            if self._ended[r] is None and p.poll() is not None:
                self._ended[r] = time.monotonic()
            code = p.poll()
            if code is None:
                p.kill()
                p.wait()
        for t in self._threads:
            t.join(timeout=5)
        for r, p in enumerate(self.procs):
            code = p.returncode if self._ended[r] is not None else None
            ended = self._ended[r] if self._ended[r] is not None else time.monotonic()
            results.append(HandResult(r, code, "".join(self._out[r]), "".join(self._err[r]),
                                      ended - start))
        return results


def launch_by_hand(argv_per_rank: list[list[str]], env: Optional[dict[str, str]] = None,
                   timeout: float = 90.0) -> list[HandResult]:
    """Run ``python -m adaptive_dist <argv>`` once per rank (rank R gets ``argv_per_rank[R]``),
    launched by hand with the launcher's environment; wait at most ``timeout`` s for all."""
    return HandLaunch(argv_per_rank, env).wait(timeout)


def format_hand(results: list[HandResult]) -> str:
    return "\n".join(f"--- rank {r.rank}: exit {r.returncode} after {r.elapsed:.1f} s\n"
                     f"stdout: {r.stdout[-1500:]}\nstderr: {r.stderr[-3000:]}" for r in results)
