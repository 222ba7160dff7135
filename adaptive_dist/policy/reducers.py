"""How the ranks' statistics combine at a counted round: one reducer per ``reducer`` name, each
giving both the global EMA (the ladder's input, shown by every policy) and the cluster's
acceptance rate (goodput's input), over the ranks with weight > 0.

A reducer reads a ``Pooled``: the cluster-wide sums, minima and maxima it needs, never the
per-rank lists. Every sum of floats is **exactly rounded** (``exact_sum``: the exact real sum of
the float64 terms, rounded once to float64, as ``math.fsum``), so it does not depend on the
order the terms are added in: a round's sums can come from a reduction over the ranks (any
order, any tree; ``adaptive_dist.consensus``) or from the gathered per-rank values, and give the
same bits. Minima and maxima are exact in any order; weights are integers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Optional, Sequence

from adaptive_dist.policy.rules import acceptance_rate

Live = Sequence[tuple[float, float, float]]
"""``(ema, ema_fail, weight)`` of the ranks with weight > 0, in rank order."""


def exact_sum(terms: Iterable[float]) -> float:
    """The exact sum of float64 ``terms`` rounded once to float64 (round half to even), +0.0
    for a zero sum: independent of the order of the terms (``math.fsum``)."""
    return math.fsum(terms) + 0.0


@dataclass(frozen=True)
class Pooled:
    """What the reducers read of the ranks with weight > 0 (``live`` of them, at least one):
    the weight ``Σw``; the exactly rounded sums ``Σw·ema``, ``Σw·ema_fail``, ``Σw·p`` (``p``
    each rank's ``acceptance_rate``) and, per depth ``S`` of ``mix``, ``Σw·E(p, S)``; the
    smallest and largest EMA and ``p``. Each term is the float64 product as one rank computes it
    (``w * ema``, ...)."""

    live: int
    weight: float
    ema_sum: float = 0.0
    fail_sum: float = 0.0
    rate_sum: float = 0.0
    ema_min: float = 0.0
    ema_max: float = 0.0
    rate_min: float = 0.0
    rate_max: float = 0.0
    mix: tuple[tuple[int, float], ...] = ()   # (S, Σw·E(p, S)); () unless the reducer mixes

    @staticmethod
    def of(emas: Sequence[float], ema_fails: Optional[Sequence[float]],
           weights: Sequence[float], mix_steps: Sequence[int] = (),
           expected: Optional[Callable[[float, int], float]] = None) -> Optional["Pooled"]:
        """From per-rank values (``ema_fail`` 0.0 when ``ema_fails`` is None); None when no rank
        has weight. ``mix_steps`` / ``expected``: the depths and ``E(p, S)`` of ``mix``."""
        ranks = live(emas, ema_fails, weights)
        if not ranks:
            return None
        rates = [acceptance_rate(e, f) for e, f, _ in ranks]
        mix = tuple((s, exact_sum(w * expected(p, s) for p, (_, _, w) in zip(rates, ranks)))
                    for s in mix_steps) if expected is not None else ()
        return Pooled(
            live=len(ranks), weight=exact_sum(w for _, _, w in ranks),
            ema_sum=exact_sum(w * e for e, _, w in ranks),
            fail_sum=exact_sum(w * f for _, f, w in ranks),
            rate_sum=exact_sum(w * p for p, (_, _, w) in zip(rates, ranks)),
            ema_min=min(e for e, _, _ in ranks), ema_max=max(e for e, _, _ in ranks),
            rate_min=min(rates), rate_max=max(rates), mix=mix)


class Reducer:
    """``weighted_mean``: ``Σ w·ema / Σ w``; the rate pools, ``Σw·ema / (Σw·ema + Σw·ema_fail)``
    (1.0 when both sums are 0)."""

    name: ClassVar[str] = "weighted_mean"
    needs: ClassVar[tuple[str, ...]] = ("ema_sum", "fail_sum")
    """The ``Pooled`` fields this reducer reads (what a round's reduction must carry)."""
    mixes: ClassVar[bool] = False   # reads ``Pooled.mix``

    def ema(self, pooled: Pooled) -> float:
        return pooled.ema_sum / pooled.weight

    def rate(self, pooled: Pooled) -> float:
        return acceptance_rate(pooled.ema_sum, pooled.fail_sum)

    def mix(self, pooled: Pooled) -> Optional[dict[int, float]]:
        """``{S: E_mix(S)}``, the expected accepted tokens goodput's scores read instead of
        ``E(rate, S)`` (``mixture`` only; None: the scores read the rate)."""
        return None


class Smallest(Reducer):
    """``min``: the smallest EMA; the smallest per-rank rate."""

    name = "min"
    needs = ("ema_min", "rate_min")

    def ema(self, pooled: Pooled) -> float:
        return pooled.ema_min

    def rate(self, pooled: Pooled) -> float:
        return pooled.rate_min


class Largest(Reducer):
    """``max``: the largest EMA; the largest per-rank rate."""

    name = "max"
    needs = ("ema_max", "rate_max")

    def ema(self, pooled: Pooled) -> float:
        return pooled.ema_max

    def rate(self, pooled: Pooled) -> float:
        return pooled.rate_max


class Mixture(Reducer):
    """``mixture`` (goodput only): the EMA as ``weighted_mean`` (shown only); the rate is the
    weighted mean of the per-rank rates ``Σw·p / Σw``, and the scores read the weighted mean of
    every rank's own expected tokens ``Σw·E(p, S) / Σw`` (``mix``)."""

    name = "mixture"
    needs = ("ema_sum", "rate_sum")
    mixes = True

    def rate(self, pooled: Pooled) -> float:
        return pooled.rate_sum / pooled.weight

    def mix(self, pooled: Pooled) -> dict[int, float]:
        return {s: total / pooled.weight for s, total in pooled.mix}


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
    """Combine ranks' EMAs over ranks with weight > 0; None if Σw = 0."""
    pooled = Pooled.of(emas, None, weights)
    return reducer_named(reducer).ema(pooled) if pooled else None


def cluster_rate(emas: Sequence[float], ema_fails: Sequence[float], weights: Sequence[float],
                 reducer: str) -> Optional[float]:
    """The cluster's acceptance rate over ranks with weight > 0; None if Σw = 0
    (``Reducer.rate``)."""
    pooled = Pooled.of(emas, ema_fails, weights)
    return reducer_named(reducer).rate(pooled) if pooled else None


def live_rates(emas: Sequence[float], ema_fails: Sequence[float],
               weights: Sequence[float]) -> list[tuple[float, float]]:
    """``(p_i, w_i)`` of the ranks with weight > 0, in rank order."""
    return [(acceptance_rate(e, f), w) for e, f, w in live(emas, ema_fails, weights)]
