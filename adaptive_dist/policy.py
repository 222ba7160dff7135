"""The adaptive policies as pure functions of agreed inputs (no collectives, no rank-local state).

Every rank calls ``decide`` with the same gathered values and gets the same answer. The rules are
those of docs/policy.md: ``ema`` (the ladder), ``goodput`` (expected tokens per unit of round
cost, with probes out of depth 0) and ``static``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from adaptive_dist.config import AdaptiveConfig, RoundCost


def initial_ema(cfg: AdaptiveConfig) -> float:
    """A rank's EMA before any round: ``initial_steps - 1`` (goodput: at least 0, so the
    acceptance rate of a run that starts at depth 0 is defined)."""
    start = float(cfg.initial_steps - 1)
    return max(start, 0.0) if cfg.policy == "goodput" else start


INITIAL_EMA_FAIL = 1.0
"""A rank's ``ema_fail`` before any round."""


def measures_acceptance(cfg: AdaptiveConfig, steps: int) -> bool:
    """Whether a round run at ``steps`` updates the rank's EMAs and weight: always, except a
    goodput round at depth 0 (no draft, so no acceptance signal)."""
    return steps > 0 or cfg.policy != "goodput"


def ema_update(ema: float, accepts: Sequence[int], alpha: float) -> float:
    """``(1-α)·ema + α·mean(accepts)``; unchanged for an empty round."""
    if len(accepts) == 0:
        return ema
    return (1.0 - alpha) * ema + alpha * (sum(accepts) / len(accepts))


def shadow_update(ema: float, ema_fail: float, hits: int, checks: int,
                  alpha: float, rounds: int = 1) -> tuple[float, float]:
    """(ema, ema_fail) after shadow checks (goodput, depth 0): ``checks`` greedy guesses of the
    head, ``hits`` of them right, taken as depth-1 observations covering ``rounds`` rounds (the
    depth-0 rounds with requests they were gathered over): ``rounds`` updates, one after the
    other, each ``(1-α)·ema + α·h`` and ``(1-α)·ema_fail + α·(1-h)`` with ``h = hits/checks``
    (so after k of them the old value keeps a weight of ``(1-α)^k``); unchanged without checks."""
    if checks <= 0:
        return ema, ema_fail
    if rounds < 1:
        raise ValueError(f"shadow_update: rounds={rounds} must be >= 1")
    share = hits / checks
    for _ in range(rounds):
        ema = (1.0 - alpha) * ema + alpha * share
        ema_fail = (1.0 - alpha) * ema_fail + alpha * (1.0 - share)
    return ema, ema_fail


def fail_flags(accepts: Sequence[int], steps: int) -> list[float]:
    """Per request, 1.0 if it rejected a draft token (``accept < steps``), else 0.0."""
    return [1.0 if a < steps else 0.0 for a in accepts]


def ema_fail_update(ema_fail: float, accepts: Sequence[int], steps: int, alpha: float) -> float:
    """``(1-α)·ema_fail + α·(share of requests with accept < steps)``; unchanged for an empty
    round (the same rule as ``ema_update``)."""
    return ema_update(ema_fail, fail_flags(accepts, steps), alpha)


SURPRISE_RATE_CLIP = 0.01
"""The rank's rate is held to ``[0.01, 0.99]`` in ``surprise``: the EMAs' start values (rate 0
before the first round of a run that starts at depth 1) must not make one request's round an
infinite surprise."""


def surprise(accepts: Sequence[int], steps: int, ema: float, ema_fail: float) -> float:
    """How much better a round's own acceptance rate explains its accept lengths than the rank's
    EMAs do, in nats: with ``A = Σ accepts``, ``F = #{a < steps}`` (the requests that rejected a
    draft token), the round's rate ``r = A / (A + F)`` and the rank's ``p = ema / (ema +
    ema_fail)`` held to ``[0.01, 0.99]``, the log-likelihood ratio ``A·ln(r/p) + F·ln((1-r)/(1-p))``
    of the geometric model (terms with A or F = 0 left out). 0 for an empty round or depth 0."""
    if steps <= 0 or len(accepts) == 0:
        return 0.0
    accepted = sum(accepts)
    failed = sum(1 for a in accepts if a < steps)
    if accepted + failed == 0:
        return 0.0
    p = min(max(acceptance_rate(ema, ema_fail), SURPRISE_RATE_CLIP), 1.0 - SURPRISE_RATE_CLIP)
    r = accepted / (accepted + failed)
    nats = 0.0
    if accepted:
        nats += accepted * math.log(r / p)
    if failed:
        nats += failed * math.log((1.0 - r) / (1.0 - p))
    return nats


def resets(cfg: AdaptiveConfig) -> bool:
    """Whether the policy restarts a rank's EMAs on a surprise and on its first measurement
    (goodput with ``reset_nats > 0``)."""
    return cfg.policy == "goodput" and cfg.reset_nats > 0


def round_update(cfg: AdaptiveConfig, ema: float, ema_fail: float, accepts: Sequence[int],
                 steps: int, first: bool = False) -> tuple[float, float, bool]:
    """(ema, ema_fail, reset) after a round that measures acceptance (``measures_acceptance``):
    the EMA updates with ``ema_alpha``; under goodput with ``reset_nats > 0`` a round restarts
    both from itself alone (α = 1: its mean accept length and its share of rejecting requests)
    when it is the rank's ``first`` measurement (the start values are placeholders, not
    measurements) or its ``surprise`` exceeds ``reset_nats``."""
    alpha = cfg.ema_alpha
    reset = resets(cfg) and len(accepts) > 0 and (
        first or surprise(accepts, steps, ema, ema_fail) > cfg.reset_nats)
    if reset:
        alpha = 1.0
    return (ema_update(ema, accepts, alpha), ema_fail_update(ema_fail, accepts, steps, alpha),
            reset)


def reduce_emas(emas: Sequence[float], weights: Sequence[float], reducer: str) -> Optional[float]:
    """Combine ranks' EMAs, in rank order, over ranks with weight > 0; None if Σw = 0."""
    live = [(e, w) for e, w in zip(emas, weights) if w > 0]
    if not live:
        return None
    if reducer in ("weighted_mean", "mixture"):   # (mixture: goodput, where it is shown only)
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
    raise ValueError(f"reducer={reducer!r}; allowed: weighted_mean, min, max, mixture")


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


# ------------------------------------------------------------------------------------ goodput
def acceptance_rate(ema: float, ema_fail: float) -> float:
    """A rank's per-token acceptance rate ``ema / (ema + ema_fail)``; 1.0 when both are 0."""
    den = ema + ema_fail
    return 1.0 if den == 0 else ema / den


def cluster_rate(emas: Sequence[float], ema_fails: Sequence[float], weights: Sequence[float],
                 reducer: str) -> Optional[float]:
    """The cluster's acceptance rate over ranks with weight > 0, in rank order; None if Σw = 0.

    ``weighted_mean`` pools: ``Σw·ema / (Σw·ema + Σw·ema_fail)`` (1.0 when both sums are 0);
    ``min`` / ``max`` take the smallest / largest per-rank rate; ``mixture`` the weighted mean
    of the per-rank rates ``Σw·p / Σw`` (its decisions read every rank's rate:
    ``mixture_expected``)."""
    live = [(e, f, w) for e, f, w in zip(emas, ema_fails, weights) if w > 0]
    if not live:
        return None
    if reducer == "weighted_mean":
        acc = 0.0
        fail = 0.0
        for e, f, w in live:
            acc += w * e
            fail += w * f
        return acceptance_rate(acc, fail)
    rates = [acceptance_rate(e, f) for e, f, _ in live]
    if reducer == "mixture":
        num = 0.0
        den = 0.0
        for p, (_, _, w) in zip(rates, live):
            num += w * p
            den += w
        return num / den
    if reducer == "min":
        return min(rates)
    if reducer == "max":
        return max(rates)
    raise ValueError(f"reducer={reducer!r}; allowed: weighted_mean, min, max, mixture")


def live_rates(emas: Sequence[float], ema_fails: Sequence[float],
               weights: Sequence[float]) -> list[tuple[float, float]]:
    """``(p_i, w_i)`` of the ranks with weight > 0, in rank order."""
    return [(acceptance_rate(e, f), w) for e, f, w in zip(emas, ema_fails, weights) if w > 0]


def mixture_expected(rates: Sequence[tuple[float, float]], steps: int) -> float:
    """The ``mixture`` reducer's expected accepted tokens at depth ``steps``: the weighted mean
    over the ranks of each rank's own ``E(S)``, ``Σ w_i·E(p_i, S) / Σ w_i`` (rank order,
    float64). In lockstep every rank runs the same depth and the cluster's tokens are the sum of
    the ranks', so this is the cluster's expectation, where one pooled rate (``weighted_mean``)
    would fit a single geometric law to ranks that follow different ones."""
    num = 0.0
    den = 0.0
    for p, w in rates:
        num += w * expected_accepted(p, steps)
        den += w
    return num / den


def expected_accepted(p: float, steps: int) -> float:
    """``E(S) = p + p² + … + p^S``: the terms ``t₁ = p``, ``t_k = t_{k-1}·p``, added in that
    order (float64); ``E(0) = 0``."""
    total = 0.0
    term = 1.0
    for _ in range(steps):
        term *= p
        total += term
    return total


def goodput_score(p: float, steps: int, cost: float) -> float:
    """``(1 + E(S)) / cost``: expected tokens a request gains per unit of round cost."""
    return (1.0 + expected_accepted(p, steps)) / cost


def cost_row(table: RoundCost, batch: int) -> int:
    """The row of ``table`` a round of padded batch ``batch`` uses: the smallest bucket
    ``>= batch``, the largest bucket for larger batches; row 0 of a flat table."""
    if table.buckets is None:
        return 0
    for i, b in enumerate(table.buckets):
        if b >= batch:
            return i
    return len(table.buckets) - 1


def goodput_scores(cfg: AdaptiveConfig, p: float, batch: int,
                   table: Optional[RoundCost] = None,
                   mix: Optional[Sequence[tuple[float, float]]] = None) -> list[float]:
    """The score of every candidate (ascending depth) at rate ``p`` and padded batch ``batch``,
    with ``table`` (default: ``cfg.round_cost``); with ``mix`` (the ``mixture`` reducer's
    per-rank rates and weights) ``(1 + mixture_expected(mix, S)) / cost`` instead."""
    table = table if table is not None else cfg.round_cost
    assert table is not None, "goodput needs round_cost"
    costs = dict(table.rows[cost_row(table, batch)])
    if mix is not None:
        return [(1.0 + mixture_expected(mix, s)) / costs[s] for s in cfg.candidate_steps]
    return [goodput_score(p, s, costs[s]) for s in cfg.candidate_steps]


def update_offsets(base: RoundCost, offsets: tuple[float, ...], batch: int, steps: int,
                   seconds: float, alpha: float) -> tuple[float, ...]:
    """The per-row offsets after a timed round at ``steps`` in the row of padded batch
    ``batch``: that row's offset moves toward ``seconds - base cost``,
    ``(1 - alpha)·offset + alpha·(seconds - base)``, and is kept ``>= -min(row) / 2`` (every
    live cost stays at least half its row's cheapest base cost above zero)."""
    i = cost_row(base, batch)
    row = dict(base.rows[i])
    moved = (1.0 - alpha) * offsets[i] + alpha * (seconds - row[steps])
    moved = max(moved, -0.5 * min(row.values()))
    return offsets[:i] + (moved,) + offsets[i + 1:]


def shifted_costs(base: RoundCost, offsets: tuple[float, ...]) -> RoundCost:
    """``base`` with ``offsets[i]`` added to every cost of row ``i`` (the live table)."""
    rows = tuple(tuple((s, c + off) for s, c in row) for row, off in zip(base.rows, offsets))
    return RoundCost(base.buckets, rows)


def goodput_pick(scores: Sequence[float], index: int, margin: float) -> int:
    """The best candidate (highest score, ties to the smaller depth) if it differs from
    ``index`` and ``score(best) > (1 + margin)·score(current)``; else ``index``."""
    best = 0
    for i in range(1, len(scores)):
        if scores[i] > scores[best]:
            best = i
    if best != index and scores[best] > (1.0 + margin) * scores[index]:
        return best
    return index


def probe_due(cfg: AdaptiveConfig, index: int, counted: int, since: int,
              gap: int = 1) -> bool:
    """At depth 0, whether ``gap × probe_every`` decision points have passed since counted
    round ``since`` (the last switch or signal; -1: the start), counting the one at
    ``counted``."""
    if cfg.candidate_steps[index] != 0:
        return False
    w, n = cfg.warmup_batches, cfg.update_interval
    points = decision_points_upto(counted, w, n) - decision_points_upto(since, w, n)
    return points >= gap * cfg.probe_every


def next_probe_gap(cfg: AdaptiveConfig, state: PolicyState, new_index: int,
                   probe: bool) -> tuple[int, bool]:
    """(probe_gap, probed) after a switch from ``state`` to ``new_index``: a probe keeps the
    gap; a return to depth 0 straight after a probe (it found nothing) doubles it, up to
    ``probe_backoff``; any other switch resets it to 1."""
    if probe:
        return state.probe_gap, True
    if state.probed and cfg.candidate_steps[new_index] == 0:
        return min(2 * state.probe_gap, cfg.probe_backoff), False
    return 1, False


@dataclass(frozen=True)
class PolicyState:
    """What every rank must hold identically: the tier, the counted rounds, the last switch, and
    (goodput) the probe wait's multiplier and whether the last switch was a probe."""

    index: int
    counted: int = 0
    last_switch: int = -1  # counted round of the last switch; -1: none yet
    probe_gap: int = 1     # goodput: the next probe waits probe_gap * probe_every points
    probed: bool = False   # goodput: the last switch was a probe out of depth 0
    last_signal: int = -1  # goodput: counted round of the last decision point at depth 0 that
                           # had a cluster rate (shadow checks); -1: none

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
    accept_rate: Optional[float] = None  # goodput: the cluster's acceptance rate (None: Σw = 0)
    cost_row: Optional[int] = None       # goodput: bucket of the round_cost row used (flat: None)
    probe: bool = False                  # goodput: the switch is a probe out of depth 0

    @property
    def switched(self) -> bool:
        return self.new_index != self.old_index


def goodput_step(cfg: AdaptiveConfig, state: PolicyState, rate: Optional[float],
                 batch: int, table: Optional[RoundCost] = None,
                 mix: Optional[Sequence[tuple[float, float]]] = None) -> tuple[int, bool]:
    """The goodput decision at a decision point the dwell allows: (new index, is a probe).
    The best score with the margin, from the cluster's rate; at depth 0 without a rate (no rank
    reported shadow checks since the last decision point) only the probe moves, due
    `probe_gap × probe_every` decision points after the last switch or the last decision point
    at depth 0 that had a rate, whichever is later."""
    if cfg.candidate_steps[state.index] == 0 and rate is None:
        since = max(state.last_switch, state.last_signal)
        if probe_due(cfg, state.index, state.counted, since, state.probe_gap):
            return state.index + 1, True
        return state.index, False
    if rate is None:
        return state.index, False
    scores = goodput_scores(cfg, rate, batch, table, mix)
    new = goodput_pick(scores, state.index, cfg.switch_margin)
    return step_down(cfg, scores, state.index, new), False


def step_down(cfg: AdaptiveConfig, scores: Sequence[float], index: int, new: int) -> int:
    """``zero_via_smallest``: a switch to depth 0 from above the smallest positive candidate
    goes to that candidate instead when it scores above the current depth."""
    cand = cfg.candidate_steps
    if not cfg.zero_via_smallest or cand[new] != 0 or new == index:
        return new
    low = next((i for i, s in enumerate(cand) if s > 0), None)
    if low is not None and cand[index] > cand[low] and scores[low] > scores[index]:
        return low
    return new


def decide(cfg: AdaptiveConfig, state: PolicyState, cluster_requests: int,
           emas: Sequence[float], weights: Sequence[float],
           ema_fails: Optional[Sequence[float]] = None, batch: int = 0,
           table: Optional[RoundCost] = None) -> tuple[PolicyState, Decision]:
    """One round's decision under ``cfg.policy`` from cluster-wide values (identical on every
    rank). ``ema_fails`` (one per rank), ``batch`` (the round's padded batch, which picks the
    ``round_cost`` row) and ``table`` (the live cost table; default ``cfg.round_cost``) are read
    by the goodput policy only."""
    if cluster_requests <= 0:
        return state, Decision(False, False, None, state.index, state.index)
    counted = state.counted + 1
    state = PolicyState(state.index, counted, state.last_switch, state.probe_gap, state.probed,
                        state.last_signal)
    global_ema = reduce_emas(emas, weights, cfg.reducer)
    point = is_decision_point(counted, cfg.warmup_batches, cfg.update_interval)
    new_index = state.index
    dwell_ok = state.last_switch < 0 or counted - state.last_switch >= cfg.min_dwell_rounds
    rate, row, probe = None, None, False
    if cfg.policy == "goodput":
        if ema_fails is None or len(ema_fails) != len(emas):
            raise ValueError("the goodput policy needs one ema_fail per rank")
        table = table if table is not None else cfg.round_cost
        if table is None:
            raise ValueError("the goodput policy needs round_cost (measure it and call "
                             "agree_round_cost, or set it in the config)")
        rate = cluster_rate(emas, ema_fails, weights, cfg.reducer)
        if table.buckets is not None:
            row = table.buckets[cost_row(table, batch)]
        if point and dwell_ok:
            mix = (live_rates(emas, ema_fails, weights) if cfg.reducer == "mixture"
                   else None)
            new_index, probe = goodput_step(cfg, state, rate, batch, table, mix)
        if point and rate is not None and cfg.candidate_steps[state.index] == 0:
            state = PolicyState(state.index, counted, state.last_switch, state.probe_gap,
                                state.probed, counted)   # a signal at depth 0: no probe due
    elif cfg.adaptive and point and global_ema is not None and dwell_ok:
        new_index = ladder_walk(cfg.candidate_steps, state.index, global_ema,
                                cfg.up_hysteresis, cfg.down_hysteresis)
    decision = Decision(True, point, global_ema, state.index, new_index, rate, row, probe)
    if new_index != state.index:
        gap, probed = next_probe_gap(cfg, state, new_index, probe)
        state = PolicyState(new_index, counted, counted, gap, probed, state.last_signal)
    return state, decision


def pick_bucket(batch: int, buckets: Sequence[int]) -> Optional[int]:
    """The smallest graph bucket that holds ``batch`` requests, or None (eager)."""
    for b in buckets:
        if b >= batch:
            return b
    return None
