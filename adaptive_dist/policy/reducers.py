"""How the ranks' statistics combine at a counted round: one reducer per ``reducer`` name, each
giving both the global EMA (the ladder's input, shown by every policy) and the cluster's
acceptance rate (goodput's input), over the ranks with weight > 0 in rank order (float64).
"""
from __future__ import annotations

from typing import ClassVar, Optional, Sequence

from adaptive_dist.policy.rules import acceptance_rate

Live = Sequence[tuple[float, float, float]]
"""``(ema, ema_fail, weight)`` of the ranks with weight > 0, in rank order."""


class Reducer:
    """``weighted_mean``: ``Σ w·ema / Σ w``; the rate pools, ``Σw·ema / (Σw·ema + Σw·ema_fail)``
    (1.0 when both sums are 0)."""

    name: ClassVar[str] = "weighted_mean"

    def ema(self, live: Live) -> float:
        num = 0.0
        den = 0.0
        for e, _, w in live:
            num += w * e
            den += w
        return num / den

    def rate(self, live: Live) -> float:
        acc = 0.0
        fail = 0.0
        for e, f, w in live:
            acc += w * e
            fail += w * f
        return acceptance_rate(acc, fail)

    def mix(self, live: Live) -> Optional[list[tuple[float, float]]]:
        """The per-rank rates and weights goodput's scores read instead of the rate (``mixture``
        only; None: the scores read the rate)."""
        return None


class Smallest(Reducer):
    """``min``: the smallest EMA; the smallest per-rank rate."""

    name = "min"

    def ema(self, live: Live) -> float:
        return min(e for e, _, _ in live)

    def rate(self, live: Live) -> float:
        return min(acceptance_rate(e, f) for e, f, _ in live)


class Largest(Reducer):
    """``max``: the largest EMA; the largest per-rank rate."""

    name = "max"

    def ema(self, live: Live) -> float:
        return max(e for e, _, _ in live)

    def rate(self, live: Live) -> float:
        return max(acceptance_rate(e, f) for e, f, _ in live)


class Mixture(Reducer):
    """``mixture`` (goodput only): the EMA as ``weighted_mean`` (shown only); the rate is the
    weighted mean of the per-rank rates ``Σw·p / Σw``, and the scores read every rank's own rate
    (``mix``)."""

    name = "mixture"

    def rate(self, live: Live) -> float:
        num = 0.0
        den = 0.0
        for p, w in self.mix(live):
            num += w * p
            den += w
        return num / den

    def mix(self, live: Live) -> list[tuple[float, float]]:
        return [(acceptance_rate(e, f), w) for e, f, w in live]


REDUCERS_BY_NAME = {cls.name: cls() for cls in (Reducer, Smallest, Largest, Mixture)}


def reducer_named(name: str) -> Reducer:
    """The reducer called ``name``; ``ValueError`` naming the allowed ones otherwise."""
    try:
        return REDUCERS_BY_NAME[name]
    except KeyError:
        raise ValueError(f"reducer={name!r}; allowed: weighted_mean, min, max, mixture") from None


def live(emas: Sequence[float], ema_fails: Optional[Sequence[float]],
         weights: Sequence[float]) -> list[tuple[float, float, float]]:
    """``(ema, ema_fail, weight)`` of the ranks with weight > 0, in rank order (``ema_fail``
    0.0 when ``ema_fails`` is None)."""
    fails = ema_fails if ema_fails is not None else [0.0] * len(emas)
    return [(e, f, w) for e, f, w in zip(emas, fails, weights) if w > 0]


def reduce_emas(emas: Sequence[float], weights: Sequence[float], reducer: str) -> Optional[float]:
    """Combine ranks' EMAs, in rank order, over ranks with weight > 0; None if Σw = 0."""
    ranks = live(emas, None, weights)
    return reducer_named(reducer).ema(ranks) if ranks else None


def cluster_rate(emas: Sequence[float], ema_fails: Sequence[float], weights: Sequence[float],
                 reducer: str) -> Optional[float]:
    """The cluster's acceptance rate over ranks with weight > 0, in rank order; None if Σw = 0
    (``Reducer.rate``)."""
    ranks = live(emas, ema_fails, weights)
    return reducer_named(reducer).rate(ranks) if ranks else None


def live_rates(emas: Sequence[float], ema_fails: Sequence[float],
               weights: Sequence[float]) -> list[tuple[float, float]]:
    """``(p_i, w_i)`` of the ranks with weight > 0, in rank order."""
    return REDUCERS_BY_NAME[Mixture.name].mix(live(emas, ema_fails, weights))
