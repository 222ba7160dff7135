"""Per-request speculation budgets (goodput with ``per_request``): each request drafts what its own
acceptance pays for, inside a round shape the cluster agrees (docs/policy.md, "Per-request
budgets").

The estimate. For every request the rank keeps, per draft position k, decayed counts of the rounds
in which its draft reached position k (all of 1..k-1 accepted and k drafted) and in which it was
accepted there: ``c_i(k) = (hits_k + PRIOR_WEIGHT * q_i) / (reached_k + PRIOR_WEIGHT)`` is its
conditional acceptance at k, ``q_i`` being the request's rate over every position it reached,
shrunk toward the rate pooled over every request the rank has seen (decayed alike) by
``PRIOR_WEIGHT`` pseudo-observations (a request never seen: the fresh-request rates, the last
few requests' first drafting rounds shrunk toward the pooled per-position rates), and
``s_i(k) = c_i(1) * ... * c_i(k)`` the probability that position k survives: what drafting it
is worth in expected tokens. Counts decay by ``DECAY`` per round in which the request drafts, so
its own last drafts dominate within a few rounds (a regime change is taken in one or two rounds,
where a batch EMA needs tens); a round in which the rank drafts nothing at all (0 draft
forwards) multiplies every request's counts by ``IDLE_DECAY`` (rates kept, weight lost: the
estimate relaxes toward the request's own rate and then the pooled one), or a stretch at 0 draft
forwards would hold every estimate at its low until the catch-up's shadow checks
(``observe_shadow``). The raw ``s_i(k)`` is then calibrated: per tenth of the raw prediction the
rank keeps decayed sums of the drafted positions' predictions and of whether they survived, and
a prediction is scaled by its tenth's observed-over-predicted ratio (docs/policy.md). Every input is something
every rank of a DP replica has alike (the replica's requests and their accepted lengths), so the
replica's ranks compute the same budgets.

The value curve. For a shape (S draft forwards, T verify tokens) a rank with ``n`` requests fills
its ``T - n`` verify places beyond the requests' own tokens with the positions worth most: first
position 1 of every request due a check (when S >= 1; ``SurvivalTracker.due``: a request that has
never drafted, or drafted nothing in its last ``probe_every`` rounds — one that drafts nothing
never learns again), then every other position ``k <= S``, position 1 of the other requests
included, in order of ``s_i(k)`` (a request's positions come in order, since ``s_i`` falls with
k). ``V(S, T) = n + sum of the chosen s_i(k)``: the tokens the rank expects to commit. Every
rank sends ``V`` for every candidate S and token rung T in its round vector (fixed point,
``VALUE_SCALE``, summed exactly as integers), and every rank picks, from the same sums, the shape
with the most expected tokens per second of the agreed cost table (``shape_cost``) for the next
round: decided at round r, checked in round r+1's pre-flight, run in round r+1. The budgets
of a round are the fill of its agreed shape, from the estimates as they stand.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from typing import TYPE_CHECKING, Optional, Sequence

from dataclasses import replace

from adaptive_dist.policy.base import Decision, PolicyState
from adaptive_dist.shape import RoundShape, token_bucket

if TYPE_CHECKING:
    from adaptive_dist.config import AdaptiveConfig, RoundCost, VerifyCost

DECAY = 0.7
"""Weight of a request's older observations per round of its own (counts are multiplied by it
before each round's are added)."""
PRIOR_WEIGHT = 1.0
"""Pseudo-observations of the pooled rate in a request's estimate at each position."""
POOL_DECAY = 0.98
"""Weight of the rank's pooled counts per observed round."""
PRIOR_START = 0.5
"""The pooled conditional acceptance before any observation (one pseudo-observation of it)."""
VALUE_SCALE = 1 << 24
"""Value curves travel as ``round(V * VALUE_SCALE)`` integers: exact sums on every rank."""
FORGET_ROUNDS = 64
"""A request not seen for this many rounds is forgotten (it finished)."""
IDLE_DECAY = 0.956
"""Weight of every request's counts per round in which the rank drafted nothing: about
``DECAY ** (1 / 8)``, so that 8 such rounds (the default ``probe_every``) weigh like one drafting
round's decay."""
CAL_BINS = 10
"""Calibration: predicted survivals are scored in this many equal bins of ``[0, 1]``."""
CAL_DECAY = 0.95
"""Weight of the rank's calibration counts per round that drafted."""
CAL_WEIGHT = 8.0
"""Pseudo-observations of a perfectly calibrated prediction in every calibration bin."""
FRESH_DECAY = 0.7
"""Weight of the rank's fresh-request counts per request that drafts for the first time (the
counts of the last few requests' first drafting rounds: what a request never drafted reads)."""
FRESH_WEIGHT = 1.0
"""Pseudo-observations of the pooled rate in a fresh request's estimate at each position."""


@dataclass
class Counts:
    """Decayed per-position counts: drafts that reached position k, and that were accepted."""

    reached: list[float]
    hits: list[float]
    seen: int = 0   # the round it was last observed in

    @staticmethod
    def empty(depth: int) -> "Counts":
        return Counts([0.0] * depth, [0.0] * depth)

    def age(self, decay: float) -> None:
        """Every count multiplied by ``decay``: the estimate keeps its rates and loses weight."""
        for k in range(len(self.reached)):
            self.reached[k] *= decay
            self.hits[k] *= decay

    def add(self, budget: int, accept: int, decay: float) -> None:
        """One round that drafted ``budget`` tokens and had ``accept`` of them accepted:
        positions ``1 .. min(accept + 1, budget)`` were reached, ``1 .. accept`` accepted."""
        self.age(decay)
        for k in range(min(accept + 1, budget, len(self.reached))):
            self.reached[k] += 1.0
            if k < accept:
                self.hits[k] += 1.0


@dataclass
class SurvivalTracker:
    """Every request's counts and the rank's pooled ones (replica-shared inputs only)."""

    depth: int
    requests: dict[int, Counts] = field(default_factory=dict)
    pooled: Counts = field(init=False)
    rounds: int = 0
    idle: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per request: (its rounds in a row that drafted nothing, the round it was last seen in);
    a request absent has never drafted (nor been shadow-checked)."""

    cal_predicted: list[float] = field(init=False)
    cal_survived: list[float] = field(init=False)
    """Calibration, per bin of the raw prediction: decayed sums of the raw predicted survivals
    of drafted positions and of whether they survived (``observe``)."""

    fresh: Counts = field(init=False)
    """Decayed per-position counts of every request's first drafting round (``FRESH_DECAY``
    per such round): the estimate of a request that has never drafted."""
    first_drafted: set[int] = field(default_factory=set)
    """The requests whose first drafting round is in ``fresh`` (forgotten with ``idle``)."""

    def __post_init__(self) -> None:
        self.pooled = Counts.empty(self.depth)
        self.fresh = Counts.empty(self.depth)
        self.cal_predicted = [0.0] * CAL_BINS
        self.cal_survived = [0.0] * CAL_BINS

    def observe(self, rids: Sequence[int], budgets: Sequence[int],
                accepts: Sequence[int]) -> None:
        """One round's results: request ``rids[j]`` drafted ``budgets[j]`` and had
        ``accepts[j]`` accepted (in round order). Requests not seen for ``FORGET_ROUNDS`` rounds
        are dropped."""
        self.rounds += 1
        drafted = bool(budgets) and max(budgets) > 0
        if drafted:   # the pool decays per round that drafted
            self._score(rids, budgets, accepts)
            for k in range(self.depth):
                self.pooled.reached[k] *= POOL_DECAY
                self.pooled.hits[k] *= POOL_DECAY
        for rid, d, a in zip(rids, budgets, accepts):
            if d <= 0:
                if rid in self.idle:
                    self.idle[rid] = (self.idle[rid][0] + 1, self.rounds)
                if not drafted and rid in self.requests:
                    # a round in which nothing drafted renews no estimate: the evidence ages
                    # (toward the request's own rate and the pooled one), or a stretch at 0
                    # draft forwards would hold every estimate at its low for good
                    self.requests[rid].age(IDLE_DECAY)
                continue
            self.idle[rid] = (0, self.rounds)
            if rid not in self.first_drafted:   # its first drafting round: what a new one sees
                self.first_drafted.add(rid)
                self.fresh.add(d, a, FRESH_DECAY)
            counts = self.requests.get(rid)
            if counts is None:
                counts = self.requests[rid] = Counts.empty(self.depth)
            counts.add(d, a, DECAY)
            counts.seen = self.rounds
            for k in range(min(a + 1, d, self.depth)):
                self.pooled.reached[k] += 1.0
                if k < a:
                    self.pooled.hits[k] += 1.0
        if self.rounds % FORGET_ROUNDS == 0:
            stale = [r for r, c in self.requests.items() if self.rounds - c.seen > FORGET_ROUNDS]
            for rid in stale:
                del self.requests[rid]
            for rid in [r for r, (_, seen) in self.idle.items()
                        if self.rounds - seen > FORGET_ROUNDS]:
                del self.idle[rid]
                self.first_drafted.discard(rid)

    def _score(self, rids: Sequence[int], budgets: Sequence[int],
               accepts: Sequence[int]) -> None:
        """Calibration: every drafted position's raw survival as the tracker predicts it before
        this round's results are added (the prediction the round's budgets were filled from,
        when the round was planned after the one before was observed) against whether it
        survived (position ``k`` of a request that drafted ``d`` and had ``a`` accepted:
        ``k <= a``), into the bin of the prediction; the counts decay by ``CAL_DECAY`` first."""
        for b in range(CAL_BINS):
            self.cal_predicted[b] *= CAL_DECAY
            self.cal_survived[b] *= CAL_DECAY
        prior = self.prior()
        for rid, d, a in zip(rids, budgets, accepts):
            if d <= 0:
                continue
            surv = self.raw_survival(rid, prior)
            for k in range(min(d, self.depth)):
                b = min(int(surv[k] * CAL_BINS), CAL_BINS - 1)
                self.cal_predicted[b] += surv[k]
                self.cal_survived[b] += 1.0 if k < a else 0.0

    def observe_shadow(self, rids: Sequence[int], checks: Sequence[tuple[int, int]]) -> None:
        """Depth-0 shadow checks (``(hits, checks)`` per request: the head's greedy guesses
        against committed tokens): position-1 observations, one per check."""
        for rid, (hits, n) in zip(rids, checks):
            if n <= 0:
                continue
            counts = self.requests.setdefault(rid, Counts.empty(self.depth))
            counts.seen = self.rounds
            self.idle[rid] = (0, self.rounds)
            for j in range(n):
                counts.add(1, 1 if j < hits else 0, DECAY)

    def due(self, rid: int, every: int) -> bool:
        """Whether request ``rid`` must check its position 1 in its next drafting round: it has
        never drafted (nor been shadow-checked), or drafted nothing in its last ``every``
        rounds. Without the check a request whose estimate says no would never be measured
        again, and a new one would run on the pooled prior alone."""
        state = self.idle.get(rid)
        return state is None or state[0] >= every

    def prior(self) -> list[float]:
        """The pooled conditional acceptance per position."""
        p = self.pooled
        return [(p.hits[k] + PRIOR_START) / (p.reached[k] + 1.0) for k in range(self.depth)]

    def survival(self, rid: int, prior: Optional[list[float]] = None) -> list[float]:
        """``s(1..depth)`` of request ``rid``: its raw survival (``raw_survival``) calibrated by
        what the rank's drafts have shown: a raw ``r`` in bin ``b`` becomes
        ``r * (survived_b + CAL_WEIGHT * r) / (predicted_b + CAL_WEIGHT * r)`` (the bin's
        observed over predicted survival, ``CAL_WEIGHT`` pseudo-observations of ``r`` itself),
        held to at most 1 and to at most the position before (a request's positions stay in
        order)."""
        out, last = [], 1.0
        for r in self.raw_survival(rid, prior):
            b = min(int(r * CAL_BINS), CAL_BINS - 1)
            c = r * (self.cal_survived[b] + CAL_WEIGHT * r) / (self.cal_predicted[b] + CAL_WEIGHT * r) \
                if r > 0 else 0.0
            last = min(last, c)
            out.append(last)
        return out

    def fresh_rates(self, prior: list[float]) -> list[float]:
        """The conditional acceptance per position of a request never seen: the last few
        requests' first drafting rounds (``fresh``), shrunk toward the pooled ``prior`` by
        ``FRESH_WEIGHT`` pseudo-observations. The pool remembers every drafting round of every
        request (``POOL_DECAY``); after a change of regime — the requests that arrive accept
        less, or more, than those that made the pool — a new request reads what the last ones
        did in their first round, not the old regime's rate."""
        f = self.fresh
        return [(f.hits[k] + FRESH_WEIGHT * prior[k]) / (f.reached[k] + FRESH_WEIGHT)
                for k in range(self.depth)]

    def raw_survival(self, rid: int, prior: Optional[list[float]] = None) -> list[float]:
        """The raw ``s(1..depth)`` of request ``rid`` (for a request never seen: the fresh
        requests' rates, ``fresh_rates``).

        Two levels: the request's own rate over every position it reached, shrunk toward the
        pooled rate (``PRIOR_WEIGHT`` pseudo-observations of it), is the prior of each of its
        positions, whose own counts then move it: a request that accepts everything it drafts
        is expected to accept past its drafts too (where its counts are still empty), one that
        rejects at once is expected to reject further down as well."""
        prior = prior if prior is not None else self.prior()
        counts = self.requests.get(rid)
        if counts is None:
            own = self.fresh_rates(prior)
        else:
            reached, hits = sum(counts.reached), sum(counts.hits)
            pool = self.pooled
            pooled_rate = (sum(pool.hits) + PRIOR_START) / (sum(pool.reached) + 1.0)
            rate = (hits + PRIOR_WEIGHT * pooled_rate) / (reached + PRIOR_WEIGHT)
            own = [(counts.hits[k] + PRIOR_WEIGHT * rate) / (counts.reached[k] + PRIOR_WEIGHT)
                   for k in range(self.depth)]
        out, s = [], 1.0
        for c in own:
            s *= c
            out.append(s)
        return out


# ---- the fill, the value curve --------------------------------------------------------------------
class Estimates(list):
    """The round's requests' ``s(1..depth)`` (a list, round order) and, per request, whether its
    position 1 is due a check (``SurvivalTracker.due``): what the fill and the value curve
    read. A plain list of survivals is every request due (every position 1 first)."""

    def __init__(self, survivals: Sequence[Sequence[float]] = (),
                 due: Optional[Sequence[bool]] = None) -> None:
        super().__init__(survivals)
        self.due = tuple(due) if due is not None else (True,) * len(self)
        if len(self.due) != len(self):
            raise ValueError(f"Estimates: {len(self.due)} due flags for {len(self)} requests")


def _due(survivals: Sequence[Sequence[float]]) -> np.ndarray:
    due = getattr(survivals, "due", None)
    return np.ones(len(survivals), dtype=bool) if due is None else np.asarray(due, dtype=bool)


def _order(survivals: Sequence[Sequence[float]], steps: int) -> tuple[list, list, list]:
    """The places a round at ``steps`` draft forwards can fill, in the order they are filled:
    position 1 of every request due a check first (when ``steps >= 1``; ``Estimates.due``, a
    plain list: every request), then every other place by value, larger first (ties: earlier
    request, then earlier position; a request's positions come in order, since ``s`` falls
    with the position) -> (values, requests, positions)."""
    n = len(survivals)
    if steps < 1 or n == 0:
        return [], [], []
    surv = np.asarray(survivals, dtype=np.float64)[:, :steps]
    req = np.repeat(np.arange(n), steps).reshape(n, steps)
    pos = np.tile(np.arange(1, steps + 1), n).reshape(n, steps)
    forced = np.zeros((n, steps), dtype=bool)
    forced[:, 0] = _due(survivals)
    fv, fr, fp = surv[forced], req[forced], pos[forced]
    first = np.lexsort((fr, -fv))
    rest_v, rest_r, rest_p = surv[~forced], req[~forced], pos[~forced]
    rest = np.lexsort((rest_p, rest_r, -rest_v))
    values = np.concatenate([fv[first], rest_v[rest]])
    return (values, np.concatenate([fr[first], rest_r[rest]]),
            np.concatenate([fp[first], rest_p[rest]]))


def fill_budgets(survivals: Sequence[Sequence[float]], shape: RoundShape) -> tuple[int, ...]:
    """Each request's draft tokens in ``shape``: its own token plus the ``T - n`` places of
    ``_order`` that fit (every request at most S)."""
    n = len(survivals)
    budgets = np.zeros(n, dtype=np.int64)
    room = max(shape.verify_tokens - n, 0)
    _, reqs, positions = _order(survivals, shape.draft_forwards)
    if room and len(reqs):
        np.maximum.at(budgets, reqs[:room], positions[:room])
    return tuple(int(b) for b in budgets)


def value_curve(survivals: Sequence[Sequence[float]], candidates: Sequence[int],
                ladder: Sequence[int]) -> list[int]:
    """``V(S, T)`` for every candidate S (outer) and token rung T (inner), in fixed point
    (``VALUE_SCALE``): the rank's expected committed tokens if its requests fill a round of that
    shape. A rung below the rank's own request count is never chosen (the cluster's shape holds
    every rank's requests); it gets the requests alone."""
    n = len(survivals)
    out = []
    rooms = np.clip(np.asarray(ladder, dtype=np.int64) - n, 0, None)
    for s in candidates:
        values = _order(survivals, s)[0]
        prefix = np.concatenate([[0.0], np.cumsum(values)])
        got = prefix[np.minimum(rooms, len(values))]
        out.extend(int(round((n + v) * VALUE_SCALE)) for v in got.tolist())
    return out


# ---- the cost of a shape, the decision ------------------------------------------------------------
def shape_cost(table: "RoundCost", verify: "VerifyCost", steps: int, tokens: int,
               batch: int) -> float:
    """Seconds of a round of shape (``steps``, ``tokens``) at padded batch ``batch``: the chain's
    cost at that depth in the batch's row (measured with every row drafting every step, so
    ``bucket x (steps + 1)`` verify tokens, on the ladder) with its verify forward's cost
    exchanged for the one ``tokens`` costs."""
    from adaptive_dist.policy.goodput import cost_row

    i = cost_row(table, batch)
    row = dict(table.rows[i])
    bucket = table.buckets[i] if table.buckets is not None else batch
    full = token_bucket(bucket * (steps + 1), verify.tokens)
    # NOTE: a table whose chain rounds cost less than their own verify forward (measured on
    # other hardware, say) would price a shape at or below zero: held to a tenth of the chain's
    return max(row[steps] - verify.cost(full) + verify.cost(tokens), 0.1 * row[steps])


def choose_shape(summed: Sequence[int], candidates: Sequence[int], ladder: Sequence[int],
                 n_req_max: int, batch: int, table: "RoundCost",
                 verify: "VerifyCost") -> tuple[RoundShape, float]:
    """The shape with the most expected tokens per second over the cluster (``summed``: the
    ranks' value curves added; every rung below ``n_req_max`` left out: it cannot hold every
    rank's requests) -> (shape, its expected tokens per second). Ties go to fewer tokens, then
    fewer draft forwards."""
    best: Optional[tuple[float, int, int]] = None
    width = len(ladder)
    for a, s in enumerate(candidates):
        for b, t in enumerate(ladder):
            if t < n_req_max:
                continue
            rate = summed[a * width + b] / VALUE_SCALE / shape_cost(table, verify, s, t, batch)
            key = (rate, -t, -s)
            if best is None or key > best:
                best = key
    if best is None:   # no rung holds the batch: the largest
        return RoundShape(candidates[0], ladder[-1]), 0.0
    return RoundShape(-best[2], -best[1]), best[0]


def effective_tokens(decided: int, n_req_max: int, steps: int, ladder: Sequence[int]) -> int:
    """A round's verify tokens: the decided rung, raised to the rung that holds the cluster's
    largest batch (a request always verifies its own token); ``decided == 0`` (no decision yet:
    a chain) gives the chain's ``n_req_max x (steps + 1)``."""
    if decided == 0:
        return token_bucket(max(n_req_max, 1) * (steps + 1), ladder)
    return max(decided, token_bucket(max(n_req_max, 1), ladder))



# ---- the rule as the coordinator runs it ----------------------------------------------------------
class PerRequestRule:
    """Per-request budgets for one rank: its requests' estimates (``SurvivalTracker``), the value
    curve it sends, the shape every rank picks from the sums, and its budgets in a shape.
    ``ladder``: the engine's verify-token rungs (every rank the same)."""

    def __init__(self, config: "AdaptiveConfig", ladder: Sequence[int]) -> None:
        from adaptive_dist.config import ConfigError

        self.config = config
        self.candidates = config.candidate_steps
        self.ladder = tuple(ladder)
        self.tracker = SurvivalTracker(max(max(self.candidates), 1))
        if config.verify_cost is not None:
            missing = config.verify_cost.missing(self.ladder)
            if missing:
                raise ConfigError(f"verify_cost: no cost for {missing} verify tokens; the engine "
                                  f"verifies {list(self.ladder)} (measure it on this engine, or "
                                  f"give a table measured at every one of those counts)")

    @property
    def n_values(self) -> int:
        """Length of the value curve (candidates x rungs)."""
        return len(self.candidates) * len(self.ladder)

    def survivals(self, rids: Sequence[int]) -> Estimates:
        """Each request's ``s(1..depth)`` (round order) and whether its position 1 is due a
        check (``probe_every`` rounds without drafting, or never drafted)."""
        prior = self.tracker.prior()
        every = self.config.probe_every
        return Estimates([self.tracker.survival(r, prior) for r in rids],
                         [self.tracker.due(r, every) for r in rids])

    def curve(self, survivals: Sequence[Sequence[float]]) -> tuple[int, ...]:
        return tuple(value_curve(survivals, self.candidates, self.ladder))

    def shape(self, state: PolicyState, n_req_max: int) -> RoundShape:
        """This round's shape: the depth in force and the decided tokens (``effective_tokens``)."""
        steps = self.candidates[state.index]
        return RoundShape(steps, effective_tokens(state.tokens, n_req_max, steps, self.ladder))

    def decide(self, state: PolicyState, summed: Sequence[int], n_req_sum: int, n_req_max: int,
               batch: int) -> tuple[PolicyState, Decision]:
        """The next round's shape from this round's summed curves (every rank alike): a counted
        round (the cluster runs requests) decides; an idle one keeps the shape."""
        if n_req_sum <= 0:
            return state, Decision(False, False, None, state.index, state.index,
                                   tokens=state.tokens)
        cfg = self.config
        shape, rate = choose_shape(summed, self.candidates, self.ladder, n_req_max, batch,
                                   cfg.round_cost, cfg.verify_cost)
        index = self.candidates.index(shape.draft_forwards)
        counted = state.counted + 1
        new = replace(state, counted=counted, tokens=shape.verify_tokens)
        if index != state.index:
            new = replace(new, index=index, last_switch=counted)
        return new, Decision(True, False, None, state.index, index, tokens=shape.verify_tokens,
                             rate=rate)

    def budgets(self, survivals: Sequence[Sequence[float]], shape: RoundShape) -> tuple[int, ...]:
        return fill_budgets(survivals, shape)
