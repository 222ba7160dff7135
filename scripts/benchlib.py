"""Small helpers the benchmark scripts share."""
from __future__ import annotations

import argparse
import statistics

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
