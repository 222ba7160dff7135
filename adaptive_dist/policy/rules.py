"""The rules every depth policy shares, as pure functions of agreed inputs (docs/policy.md): the
EMA updates, the acceptance rate, counting and decision points, the ladder walk, the graph bucket.
"""
from __future__ import annotations

import itertools
import operator
from typing import Optional, Sequence

INITIAL_EMA_FAIL = 1.0
"""A rank's ``ema_fail`` before any round."""


def ema_update(ema: float, accepts: Sequence[int], alpha: float) -> float:
    """``(1-α)·ema + α·mean(accepts)``; unchanged for an empty round."""
    if len(accepts) == 0:
        return ema
    return (1.0 - alpha) * ema + alpha * (sum(accepts) / len(accepts))


_lt, _repeat = operator.lt, itertools.repeat


def fail_flags(accepts: Sequence[int], steps: int) -> list[float]:
    """Per request, 1.0 if it rejected a draft token (``accept < steps``), else 0.0."""
    return [1.0 if a < steps else 0.0 for a in accepts]


def ema_fail_update(ema_fail: float, accepts: Sequence[int], steps: int, alpha: float) -> float:
    """``(1-α)·ema_fail + α·(share of requests with accept < steps)``; unchanged for an empty
    round (the same rule as ``ema_update`` of ``fail_flags``: the flags' float sum is the
    count of fails, exactly, and ``count / n`` rounds as ``float(count) / n`` does)."""
    n = len(accepts)
    if n == 0:
        return ema_fail
    return (1.0 - alpha) * ema_fail + alpha * (sum(map(_lt, accepts, _repeat(steps))) / n)


def acceptance_rate(ema: float, ema_fail: float) -> float:
    """A rank's per-token acceptance rate ``ema / (ema + ema_fail)``; 1.0 when both are 0."""
    den = ema + ema_fail
    return 1.0 if den == 0 else ema / den


def ladder_walk(candidates: Sequence[int], index: int, value: float,
                up_hysteresis: float, down_hysteresis: float) -> int:
    """Move down while ``value <= c[i-1] - 0.5 + down``; otherwise up while
    ``value > c[i] - 0.5 + up``. Several tiers may move in one call."""
    i = index
    while i > 0 and value <= candidates[i - 1] - 0.5 + down_hysteresis:
        i -= 1
    if i != index:
        return i
    while i < len(candidates) - 1 and value > candidates[i] - 0.5 + up_hysteresis:
        i += 1
    return i


def is_decision_point(counted: int, warmup: int, interval: int) -> bool:
    """Counted round ``counted`` (1-based) is a decision point."""
    return counted > warmup and (counted - warmup) % interval == 0


def decision_points_upto(counted: int, warmup: int, interval: int) -> int:
    """How many decision points counted rounds ``1..counted`` hold (0 for ``counted <= 0``)."""
    return max(0, (counted - warmup) // interval)


def pick_bucket(batch: int, buckets: Sequence[int]) -> Optional[int]:
    """The smallest graph bucket that holds ``batch`` requests, or None (eager)."""
    for b in buckets:
        if b >= batch:
            return b
    return None
