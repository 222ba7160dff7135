"""Small helpers the benchmark scripts share."""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA), so a timer reads finished work."""
    if device == "cuda":
        torch.cuda.synchronize()


def spread(xs: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def add_overlap_argument(p: argparse.ArgumentParser) -> None:
    """`--overlap auto|on|off`, as the engine's command line (auto: on with CUDA)."""
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="launch round r+1 before reading round r (auto: on with CUDA)")


def overlap_of(args: argparse.Namespace, device: str) -> dict:
    """EngineConfig keywords for `--overlap` (none when off, so an older engine tree that has no
    such setting still builds)."""
    on = args.overlap == "on" or (args.overlap == "auto" and device == "cuda")
    return {"overlap": True} if on else {}


def settle_heap() -> None:
    """After building and warming the engines: their objects out of the garbage collector's
    walks (`workers.engine.freeze_heap`, which `generate` and `serve` run after start-up; an
    older engine tree without it gets the same two calls), so no timed run pays a full
    collection over them."""
    try:
        from workers.engine import freeze_heap
    except ImportError:
        import atexit

        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)
    else:
        freeze_heap()


class GcPauses:
    """Count and time the garbage collector's full (generation-2) collections while active."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = 0, 0.0, None

    def _hook(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._hook)
