"""The adaptive policy as pure functions of agreed inputs (no collectives, no rank-local state).

Every rank calls ``decide`` with the same gathered values and gets the same answer; this module
is also the single-process reference the multi-rank tests compare against.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from adaptive_dist.config import AdaptiveConfig


def ema_update(ema: float, accepts: Sequence[int], alpha: float) -> float:
    """``(1-α)·ema + α·mean(accepts)``; unchanged for an empty round."""
    if len(accepts) == 0:
        return ema
    return (1.0 - alpha) * ema + alpha * (sum(accepts) / len(accepts))


def reduce_emas(emas: Sequence[float], weights: Sequence[float], reducer: str) -> Optional[float]:
    """Combine ranks' EMAs, in rank order, over ranks with weight > 0; None if Σw = 0."""
    live = [(e, w) for e, w in zip(emas, weights) if w > 0]
    if not live:
        return None
    if reducer == "weighted_mean":
        num = 0.0
        den = 0.0
        for e, w in live:
            num += w * e
            den += w
        return num / den
    if reducer == "min":
        return min(e for e, _ in live)
    if reducer == "max":
        return max(e for e, _ in live)
    raise ValueError(f"reducer={reducer!r}; allowed: weighted_mean, min, max")


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


@dataclass(frozen=True)
class PolicyState:
    """What every rank must hold identically: the tier, the counted rounds, the last switch."""

    index: int
    counted: int = 0
    last_switch: int = -1  # counted round of the last switch; -1: none yet

    @staticmethod
    def initial(cfg: AdaptiveConfig) -> "PolicyState":
        return PolicyState(index=cfg.initial_index)


@dataclass(frozen=True)
class Decision:
    """The outcome of one round's statistics (made at that round, applied before the next)."""

    counted: bool
    decision_point: bool
    global_ema: Optional[float]
    old_index: int
    new_index: int

    @property
    def switched(self) -> bool:
        return self.new_index != self.old_index


def decide(cfg: AdaptiveConfig, state: PolicyState, cluster_requests: int,
           emas: Sequence[float], weights: Sequence[float]) -> tuple[PolicyState, Decision]:
    """One round's decision under ``cfg.policy`` from cluster-wide values (identical on every
    rank)."""
    if cluster_requests <= 0:
        return state, Decision(False, False, None, state.index, state.index)
    counted = state.counted + 1
    state = replace(state, counted=counted)
    global_ema = reduce_emas(emas, weights, cfg.reducer)
    point = is_decision_point(counted, cfg.warmup_batches, cfg.update_interval)
    new_index = state.index
    dwell_ok = state.last_switch < 0 or counted - state.last_switch >= cfg.min_dwell_rounds
    if cfg.adaptive and point and global_ema is not None and dwell_ok:
        new_index = ladder_walk(cfg.candidate_steps, state.index, global_ema,
                                cfg.up_hysteresis, cfg.down_hysteresis)
    decision = Decision(True, point, global_ema, state.index, new_index)
    if new_index != state.index:
        state = replace(state, index=new_index, last_switch=counted)
    return state, decision


def pick_bucket(batch: int, buckets: Sequence[int]) -> Optional[int]:
    """The smallest graph bucket that holds ``batch`` requests, or None (eager)."""
    for b in buckets:
        if b >= batch:
            return b
    return None
