"""Small helpers the benchmark scripts share."""
from __future__ import annotations

import statistics

import torch


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA), so a timer reads finished work."""
    if device == "cuda":
        torch.cuda.synchronize()


def spread(xs: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
