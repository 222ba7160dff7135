"""The start-up timeline: one line per step on rank 0's stderr as it happens, flushed, and the
same steps as data (`Timeline.events`; with ``ADAPTIVE_DIST_STARTUP_LOG=FILE`` also one JSON line
per event in FILE, for `scripts.bench.startup`).

    [start-up    0.0 s] begin: cuda:0, 139.10 GiB free of 139.80 GiB, 1 rank(s); ...
    [start-up   11.2 s] loading: 16.06 GB of weight files in 11.2 s (1.43 GB/s); ...
    [start-up   24.0 s] cost table: 12/168 (chains of rounds; bucket 8, depth 3), 6.1 s

The engine's start-up code opens a timeline (`active`) around what it builds; the code it calls
(the worker's captures, the round-cost measurement) reports through `current()`, which is a
silent timeline when none is open (tests and scripts that build engines themselves). Only the
group's first rank prints (`Timeline(printing=...)`); every rank records.

Memory per step: on a CUDA device the caching allocator's allocated and reserved bytes and the
device's used bytes (every process's); on the CPU the process's resident set.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

ENV_FILE = "ADAPTIVE_DIST_STARTUP_LOG"
"""Environment variable: a file the printing rank appends one JSON line per event to."""

PROGRESS_EVERY_S = 3.0
"""A long step prints a progress line at most this often."""

GB = 1e9
GiB = float(1 << 30)


def memory_now(device: Any = None) -> dict[str, int]:
    """Memory in bytes now: on CUDA `allocated`, `reserved` (the caching allocator) and
    `device_used` (total - free: every process on the device); on the CPU `rss`."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(dev)
        return {"allocated": int(torch.cuda.memory_allocated(dev)),
                "reserved": int(torch.cuda.memory_reserved(dev)),
                "device_used": int(total - free)}
    return {"rss": rss_bytes()}


def rss_bytes() -> int:
    """This process's resident set in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux; None elsewhere): the start-up's own clock
    begins later, after Python and torch are imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def fmt_bytes(n: float) -> str:
    """`n` bytes in GiB, MiB, KiB or bytes, whichever is the largest below it."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass
class Timeline:
    """The start-up's steps on this rank (`printing`: this rank prints them)."""

    printing: bool = True
    device: Any = None
    file: Optional[str] = None
    clock: Callable[[], float] = time.perf_counter
    started: float = -1.0
    events: list[dict[str, Any]] = field(default_factory=list)
    _last_progress: float = 0.0

    def __post_init__(self) -> None:
        if self.file is None and self.printing:
            self.file = os.environ.get(ENV_FILE) or None
        self.age_at_start = process_age_s()
        if self.started < 0:
            self.started = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.started

    def step(self, name: str, text: str, seconds: Optional[float] = None,
             memory: bool = True, **data: Any) -> dict[str, Any]:
        """Record (and on the printing rank print) one finished step: `text` is the line after
        the step's name; `seconds` what the step took; `data` its numbers (JSON values)."""
        event: dict[str, Any] = {"step": name, "t": round(self.elapsed(), 3)}
        if seconds is not None:
            event["seconds"] = round(seconds, 3)
        if memory:
            event["memory"] = memory_now(self.device)
        event.update(data)
        self.events.append(event)
        self._emit(f"{name}: {text}", event)
        return event

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[dict[str, Any]]:
        """Time a step; the block fills the yielded dict: `text` (the line) and any numbers.
        The step is recorded when the block ends without an exception."""
        start = self.clock()
        out: dict[str, Any] = {}
        yield out
        seconds = self.clock() - start
        text = out.pop("text", "")
        self.step(name, f"{text} in {seconds:.1f} s" if text else f"{seconds:.1f} s",
                  seconds=seconds, **out)

    def progress(self, name: str, done: int, total: int, detail: str = "",
                 since: Optional[float] = None) -> None:
        """A long step's progress (`done` of `total` parts; `since`: when the step began, a
        `clock()` value): printed at most every `PROGRESS_EVERY_S` seconds."""
        now = self.clock()
        if now - self._last_progress < PROGRESS_EVERY_S or done >= total:
            return
        self._last_progress = now
        took = f", {now - since:.1f} s" if since is not None else ""
        more = f" ({detail})" if detail else ""
        self._emit(f"{name}: {done}/{total}{more}{took}", None)

    def say(self, text: str) -> None:
        """A line of the timeline that is not a step (a note, a warning)."""
        self._emit(text, {"note": text, "t": round(self.elapsed(), 3)})

    def _emit(self, line: str, event: Optional[dict[str, Any]]) -> None:
        if not self.printing:
            return
        # NOTE: not `[rank R] ...`: that prefix is a failure's one line per rank (the tests and
        # users read it so); only the group's first rank prints these
        sys.stderr.write(f"[start-up {self.elapsed():6.1f} s] {line}\n")
        sys.stderr.flush()
        if self.file and event is not None:
            try:
                with open(self.file, "a", encoding="utf-8") as f:
                    f.write(json.dumps(event) + "\n")
            except OSError:
                pass   # a diagnostic file must not stop a start-up


def reserved(device: Any) -> int:
    """Bytes torch's caching allocator holds on `device` (0 off CUDA): what a step's memory
    grew by, cheaply (the graph pool's exact size needs a memory snapshot, once, at the end)."""
    import torch

    dev = torch.device(device)
    return int(torch.cuda.memory_reserved(dev)) if dev.type == "cuda" else 0


def captured(what: str, graphs: int, seconds: float, grew: int, **data: Any) -> None:
    """Report a batch of CUDA-graph captures to the open timeline (one line): `grew`, what the
    caching allocator's reserved memory grew by (the graph pool and the warm-ups' blocks)."""
    text = (f"{graphs} CUDA graph{'s' if graphs != 1 else ''} in {seconds:.1f} s, memory "
            f"+{fmt_bytes(grew)}")
    current().step(what, text, seconds=seconds, graphs=graphs, reserved_growth=grew, **data)


class _Silent(Timeline):
    """The timeline when none is open: records nothing, prints nothing."""

    def __init__(self) -> None:
        super().__init__(printing=False)

    def step(self, name: str, text: str, seconds: Optional[float] = None,
             memory: bool = True, **data: Any) -> dict[str, Any]:
        return {}

    def say(self, text: str) -> None:
        return None


_SILENT = _Silent()
_current: Optional[Timeline] = None


def current() -> Timeline:
    """The open timeline, or a silent one."""
    return _current if _current is not None else _SILENT


@contextlib.contextmanager
def active(timeline: Timeline) -> Iterator[Timeline]:
    """Make `timeline` the one `current()` returns for the block."""
    global _current
    previous, _current = _current, timeline
    try:
        yield timeline
    finally:
        _current = previous
