"""The one failure path of every distributed command: a failure a user can cause ends as one line
per rank, ``[rank R] Kind: message``, with the exit codes of ``EXIT_*`` (and
``collectives.errors``'s); the peers are told, so they stop with the same line.

Library code (the engine's start-up, the serving loop) and the command-line front
(``adaptive_dist.cli``) both use it; it imports no torch.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Optional

from adaptive_dist.config import ConfigError
from collectives.errors import (
    EXIT_DIVERGENCE,
    EXIT_TIMEOUT,
    CollectiveTimeoutError,
    DivergenceError,
    JobAborted,
)

EXIT_INTERNAL = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


def rank_label() -> str:
    """``[rank R]`` from the launcher's RANK (0 for a single process)."""
    return f"[rank {os.environ.get('RANK') or '0'}]"


def say(line: str) -> None:
    """One line on stderr in one write (ranks share a terminal; print() writes the newline
    apart, so lines of different ranks could interleave)."""
    sys.stderr.write(f"{rank_label()} {line}\n")
    sys.stderr.flush()


def fail_distributed(ctx: Any, exc: BaseException, record_dir: Optional[str] = None) -> int:
    """End a distributed command after ``exc``: one line on this rank, the peers told (so they
    stop at once with the same line), a bounded wait for them to print, and an exit that skips
    the process-group teardown (a stuck peer could hang it). Returns the exit code when there is
    no process group to leave."""
    if not ctx.claim_exit():
        # this rank's watchdog is already printing the job's verdict and ending the process
        time.sleep(2 * ctx.grace_s + 5.0)
        os._exit(EXIT_TIMEOUT)
    if record_dir and ctx.recorder is not None:
        _dump_log_quietly(ctx, record_dir)
    described = describe_failure(exc)
    if described is None:  # a bug: show it, but still leave in bounded time
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        described = ("internal error", EXIT_INTERNAL, _one_line(exc))
    label, code, message = described
    say(f"{label}: {message}")
    ctx.abandon(label, code, message)
    if ctx.distributed:
        os._exit(code)
    return code


def _dump_log_quietly(ctx: Any, record_dir: str) -> None:
    """After a failure, the collective log helps find the cause: write it if possible."""
    try:
        from adaptive_dist.outputs import write_lines
        from adaptive_dist.replay import record_log_path

        write_lines(record_log_path(record_dir, ctx.rank), ctx.recorder.json_lines(), "--record-dir")
    except Exception:
        pass


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def describe_failure(exc: BaseException) -> Optional[tuple[str, int, str]]:
    """(label, exit code, one-line message) of a failure a user can cause; None for a bug."""
    if isinstance(exc, DivergenceError):
        return "DivergenceError", EXIT_DIVERGENCE, str(exc)
    if isinstance(exc, CollectiveTimeoutError):
        return "CollectiveTimeoutError", EXIT_TIMEOUT, str(exc)
    if isinstance(exc, JobAborted):
        return exc.label, exc.exit_code, str(exc)
    if isinstance(exc, (ConfigError, ValueError)):
        return "error", EXIT_CONFIG, " ".join(str(exc).split("\n"))
    if isinstance(exc, OSError):
        return "error", EXIT_CONFIG, str(exc)
    return None


def report_failure(exc: BaseException) -> int:
    """Print a known failure as one line naming the rank; return its exit code. Anything else
    is a bug and propagates with its traceback."""
    described = describe_failure(exc)
    if described is None:
        raise exc
    label, code, message = described
    say(f"{label}: {message}")
    return code
