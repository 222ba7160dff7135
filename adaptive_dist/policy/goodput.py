"""The goodput policy: the depth with the most expected tokens per unit of round cost, with probes
out of depth 0, the shadow checks of depth 0 and the reset on a surprise (docs/policy.md,
"Goodput"). Its configuration section, its state and its rules, as pure functions of agreed inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Optional, Sequence

from adaptive_dist.config import (
    AdaptiveConfig,
    ConfigError,
    PolicySection,
    RoundCost,
    VerifyCost,
    check,
    is_int,
    is_number,
)
from adaptive_dist.policy.base import CountingPolicy, Decision, Observed, PolicyState, RankEstimate
from adaptive_dist.policy.reducers import Mixture, Pooled, exact_sum
from adaptive_dist.policy.tree import (
    candidate_tree,
    chain_rate,
    shape_scores,
    tree_rate,
    trees_of,
)
from adaptive_dist.policy.rules import (
    acceptance_rate,
    decision_points_upto,
    ema_fail_update,
    ema_update,
)

MARGIN_LIMIT = 1000.0
RESET_LIMIT = 1e6

SURPRISE_RATE_CLIP = 0.01
"""The rank's rate is held to ``[0.01, 0.99]`` in ``surprise``: the EMAs' start values (rate 0
before the first round of a run that starts at depth 1) must not make one request's round an
infinite surprise."""


# ---- the configuration section -----------------------------------------------------------------
@dataclass(frozen=True)
class GoodputSection(PolicySection):
    """The goodput policy's own keys (checked by ``GoodputPolicy.check_section``)."""

    removed: ClassVar[dict[str, str]] = {
        "probe_backoff": "goodput's probes all wait probe_every decision points now",
        "zero_via_smallest": "goodput's switch to depth 0 goes straight to 0 now",
    }
    """Keys a config may no longer set, each with what replaced it: refused by name (a file that
    still sets one asks for a behaviour the code no longer has). Removed by issue 26: neither
    moved any production-priced goal row by 1% at batch 1, 16 or 64 (docs/policy.md, "Knobs and
    their measurements")."""

    round_cost: Optional[RoundCost] = None
    """The relative cost of a round at each candidate depth, one table (``{"<steps>": cost}``)
    or one row per padded batch (``{"<bucket>": {"<steps>": cost}}``). ``None`` until the engine
    has measured and agreed it (``start_up_needs``); consensus-only mode needs it in the config
    file. Refused for the other policies."""
    switch_margin: float = 0.05
    """Switch only when the best score beats the current one by this share (>= 0)."""
    probe_every: int = 8
    """At depth 0, probe the smallest positive depth after this many decision points (>= 1).
    With ``per_request``: a request that drafted nothing in its last this-many rounds checks its
    position 1 first again (``budgets.SurvivalTracker.due``)."""
    reset_nats: float = 8.0
    """A round that measures acceptance and whose accept lengths are more than this many nats
    likelier under their own acceptance rate than under the rank's EMAs (the geometric model's
    log-likelihood ratio, ``surprise``) restarts the rank's EMAs from that round alone: a new
    regime is taken at once instead of over ``~1/ema_alpha`` rounds. At batch 1 it takes a round
    far off the EMAs (a request that accepts all 7 drafts against a rate of 0.3: 8.4 nats; one
    that rejects the first against 0.85: 1.9); 16 requests that each reject at once at depth 7
    against 0.85 give 30. With it on, a rank's first measurement replaces the start values too.
    (>= 0; 0: off — the EMAs follow ``ema_alpha`` alone.)"""
    per_request: bool = False
    """Per-request budgets (``--per-request``): every request drafts what its own acceptance
    pays for, inside a round shape (draft forwards, verify tokens) the cluster agrees every
    round (``adaptive_dist.policy.budgets``); false: one depth for the whole batch."""
    verify_cost: Optional[VerifyCost] = None
    """With ``per_request``: seconds of the packed verify forward at each token count
    (``{"<tokens>": seconds}``), measured and agreed at start-up like ``round_cost`` (or given:
    ``--model-costs``)."""
    tree_candidates: tuple = ()
    """Draft trees among the candidates (issue 35): ``[[S, K, N], ...]`` (steps, top-k >= 2,
    verify tokens per request with the root; optionally a fourth number, the share f of the
    chain's misses the tree's siblings cover, default ``policy.tree.DEFAULT_COVERAGE``).
    Candidate index ``len(candidate_steps) + j`` is tree ``j``; each is priced from
    ``round_cost`` and ``verify_cost`` (``adaptive_dist.policy.tree``). Empty: chains only."""
    tree_overhead: float = 0.0
    """Seconds added to every tree round's price (``policy.tree.tree_round_cost``): what a tree
    round runs beyond a chain's that the tables do not measure (ranking the nodes, the tree
    mask, the path's KV commit); >= 0, in the cost table's units. 0: none priced."""
    cost_alpha: float = 0.0
    """EMA weight of a timed round in its cost-table row's offset (in [0, 1]; 0: the table stays
    as agreed at start-up). The engine's rounds are timed (seconds from one round's begin to the
    next's, the slowest rank's), so a table in other units must keep 0."""

    def __post_init__(self) -> None:
        if self.round_cost is not None:
            object.__setattr__(self, "round_cost", RoundCost.parse(self.round_cost))
        if self.verify_cost is not None:
            object.__setattr__(self, "verify_cost", VerifyCost.parse(self.verify_cost))
        from adaptive_dist.policy.tree import parse_tree_candidates

        object.__setattr__(self, "tree_candidates", parse_tree_candidates(self.tree_candidates))
        super().__post_init__()


@dataclass(frozen=True)
class LiveCosts:
    """The cost table goodput decides on in a run: the agreed ``base`` plus an offset per row
    that timed rounds move (``cost_alpha`` > 0); identical on every rank."""

    base: RoundCost
    offsets: tuple[float, ...]

    @property
    def table(self) -> RoundCost:
        return shifted_costs(self.base, self.offsets) if any(self.offsets) else self.base


# ---- the rank's estimate ----------------------------------------------------------------------
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


# ---- expected tokens, scores, the cost table ----------------------------------------------------
def expected_accepted(p: float, steps: int) -> float:
    """``E(S) = p + p² + … + p^S``: the terms ``t₁ = p``, ``t_k = t_{k-1}·p``, added in that
    order (float64); ``E(0) = 0``."""
    total = 0.0
    term = 1.0
    for _ in range(steps):
        term *= p
        total += term
    return total


def mixture_expected(rates: Sequence[tuple[float, float]], steps: int) -> float:
    """The ``mixture`` reducer's expected accepted tokens at depth ``steps``: the weighted mean
    over the ranks of each rank's own ``E(S)``, ``Σ w_i·E(p_i, S) / Σ w_i`` (each sum exactly
    rounded, ``exact_sum``). In lockstep every rank runs the same depth and the cluster's tokens
    are the sum of the ranks', so this is the cluster's expectation, where one pooled rate
    (``weighted_mean``) would fit a single geometric law to ranks that follow different ones."""
    return (exact_sum(w * expected_accepted(p, steps) for p, w in rates)
            / exact_sum(w for _, w in rates))


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
                   mix: Optional[Sequence[tuple[float, float]] | dict[int, float]] = None
                   ) -> list[float]:
    """The score of every candidate (ascending depth) at rate ``p`` and padded batch ``batch``,
    with ``table`` (default: ``cfg.round_cost``); with ``mix`` (the ``mixture`` reducer's
    ``{S: E_mix(S)}``, or the per-rank rates and weights it comes from)
    ``(1 + E_mix(S)) / cost`` instead."""
    table = table if table is not None else cfg.round_cost
    assert table is not None, "goodput needs round_cost"
    costs = dict(table.rows[cost_row(table, batch)])
    if isinstance(mix, dict):
        return [(1.0 + mix[s]) / costs[s] for s in cfg.candidate_steps]
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


# ---- the decision -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GoodputState(PolicyState):
    """The shared state with goodput's own: the last decision point at depth 0 that had a
    rate."""

    last_signal: int = -1  # counted round of the last decision point at depth 0 that had a
                           # cluster rate (shadow checks); -1: none


@dataclass(frozen=True)
class GoodputEstimate(RankEstimate):
    """The rank's estimate with what depth 0 needs: the depth-0 rounds with requests since the
    EMAs last moved (a shadow report covers them) and whether no round has measured yet (the
    EMAs hold start values, which a first measurement replaces when resets are on)."""

    unobserved: int = 0
    fresh: bool = True


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


def at_depth_zero(cfg: AdaptiveConfig, index: int) -> bool:
    """Candidate ``index`` is the chain of depth 0 (a tree candidate never is)."""
    return index < len(cfg.candidate_steps) and cfg.candidate_steps[index] == 0


def probe_due(cfg: AdaptiveConfig, index: int, counted: int, since: int) -> bool:
    """At depth 0, whether ``probe_every`` decision points have passed since counted round
    ``since`` (the last switch or signal; -1: the start), counting the one at ``counted``."""
    if not at_depth_zero(cfg, index):
        return False
    w, n = cfg.warmup_batches, cfg.update_interval
    points = decision_points_upto(counted, w, n) - decision_points_upto(since, w, n)
    return points >= cfg.probe_every


def goodput_step(cfg: AdaptiveConfig, state: GoodputState, rate: Optional[float],
                 batch: int, table: Optional[RoundCost] = None,
                 mix: Optional[Sequence[tuple[float, float]] | dict[int, float]] = None,
                 verify: Optional[VerifyCost] = None) -> tuple[int, bool]:
    """The goodput decision at a decision point the dwell allows: (new index, is a probe).
    The best score with the margin, from the cluster's rate; at depth 0 without a rate (no rank
    reported shadow checks since the last decision point) only the probe moves, due
    `probe_every` decision points after the last switch or the last decision point
    at depth 0 that had a rate, whichever is later."""
    if at_depth_zero(cfg, state.index) and rate is None:
        since = max(state.last_switch, state.last_signal)
        if probe_due(cfg, state.index, state.counted, since):
            return state.index + 1, True
        return state.index, False
    if rate is None:
        return state.index, False
    scores = goodput_scores(cfg, rate, batch, table, mix)
    if trees_of(cfg):   # the trees after the chains, scored from the same (chain) rate
        scores = shape_scores(cfg, rate, batch, table if table is not None else cfg.round_cost,
                              verify if verify is not None else cfg.verify_cost, scores)
    return goodput_pick(scores, state.index, cfg.switch_margin), False


def probe_floor(cfg: AdaptiveConfig, catchup_rounds: int) -> int:
    """The least ``probe_every`` that lets an engine's first shadow report at depth 0 come before
    a probe: its draft cache catches up every ``catchup_rounds`` depth-0 rounds and reports one
    round after the catch-up (a round later again when rounds overlap), so the wait must span
    ``ceil((catchup_rounds + 2) / update_interval)`` decision points; 1 (no floor) without a 0
    candidate."""
    if 0 not in cfg.candidate_steps:
        return 1
    return -(-(catchup_rounds + 2) // cfg.update_interval)


class GoodputPolicy(CountingPolicy):
    """``goodput``: at a decision point the dwell allows, the candidate with the most expected
    tokens per unit of round cost (``(1 + E(S)) / cost(S, row)``) from the cluster's acceptance
    rate, with ``switch_margin`` and, at depth 0 without a signal, probes. Depth 0 measures nothing but the catch-up's shadow checks; a surprise (or a
    rank's first measurement) restarts its EMAs."""

    name = "goodput"
    allows_depth_zero = True
    # depth 0 among them: at 8B shapes it wins on high-entropy text at every batch (the
    # production-priced runs of docs/results.md and docs/policy.md judge exactly this ladder)
    default_candidates = (0, 1, 3, 7)
    Section = GoodputSection
    OUTCOME_KEYS: ClassVar[tuple[str, ...]] = ("local_ema_fail", "accept_rate", "cost_row",
                                               "probe")
    """Keys this policy adds to each consensus-only output line."""

    @classmethod
    def check_section(cls, c: AdaptiveConfig) -> None:
        check(c.reducer != Mixture.name or c.policy == cls.name, "reducer", c.reducer,
              f"mixture (the mean of the ranks' expected tokens) applies to the goodput policy "
              f"only (policy={c.policy!r})")
        check(is_number(c.switch_margin) and 0 <= c.switch_margin < MARGIN_LIMIT,
              "switch_margin", c.switch_margin, f"must be a finite number in [0, {MARGIN_LIMIT:g})")
        check(is_int(c.probe_every) and c.probe_every >= 1, "probe_every", c.probe_every,
              "must be an integer >= 1")
        check(is_number(c.reset_nats) and 0 <= c.reset_nats < RESET_LIMIT, "reset_nats",
              c.reset_nats, f"must be a finite number in [0, {RESET_LIMIT:g}) (0: off)")
        check(is_number(c.cost_alpha) and 0 <= c.cost_alpha <= 1, "cost_alpha", c.cost_alpha,
              "must be a number in [0, 1]")
        if c.cost_alpha:
            check(c.policy == cls.name, "cost_alpha", c.cost_alpha,
                  f"applies to the goodput policy only (policy={c.policy!r})")
        if c.round_cost is not None:
            check(c.policy == cls.name, "round_cost", c.round_cost.to_json(),
                  f"applies to the goodput policy only (policy={c.policy!r})")
            _check_cost_steps(c.round_cost, c.candidate_steps,
                              tuple(t[0] for t in c.tree_candidates))
        check(isinstance(c.per_request, bool), "per_request", c.per_request,
              "must be true or false")
        if c.per_request:
            check(c.policy == cls.name, "per_request", c.per_request,
                  f"per-request budgets are priced by the round cost: the goodput policy only "
                  f"(policy={c.policy!r})")
        if c.verify_cost is not None:
            check(c.policy == cls.name and (c.per_request or bool(c.tree_candidates)),
                  "verify_cost", c.verify_cost.to_json(),
                  f"applies to the goodput policy with per_request or tree_candidates only "
                  f"(policy={c.policy!r}, per_request={c.per_request!r})")
        check(is_number(c.tree_overhead) and 0 <= c.tree_overhead < MARGIN_LIMIT,
              "tree_overhead", c.tree_overhead, "must be a finite number >= 0 (seconds)")
        if c.tree_overhead:
            check(bool(c.tree_candidates), "tree_overhead", c.tree_overhead,
                  "applies with tree_candidates only")
        if c.tree_candidates:
            trees = [list(t) for t in c.tree_candidates]
            check(c.policy == cls.name, "tree_candidates", trees,
                  f"draft trees are priced by the round cost: the goodput policy only "
                  f"(policy={c.policy!r})")
            check(c.reducer != Mixture.name, "tree_candidates", trees,
                  "the mixture reducer's per-rank expectations are chains' only; use "
                  "weighted_mean or min with draft trees")

    @classmethod
    def start_up_needs(cls, config: AdaptiveConfig) -> dict[str, str]:
        """``round_cost`` (the engine's ``round_costs``) while unset, and with ``per_request``
        ``verify_cost`` (``verify_costs``) while unset."""
        needs: dict[str, str] = {}
        if config.policy == cls.name and config.round_cost is None:
            needs["round_cost"] = "round_costs"
        if (config.policy == cls.name and (config.per_request or config.tree_candidates)
                and config.verify_cost is None):
            needs["verify_cost"] = "verify_costs"
        return needs

    # ---- the rank's estimate ---------------------------------------------------------------
    def initial_state(self) -> GoodputState:
        return GoodputState(index=self.config.initial_index)

    def initial_ema(self) -> float:
        """``initial_steps - 1``, at least 0 (so the rate of a run that starts at depth 0 is
        defined)."""
        return max(super().initial_ema(), 0.0)

    def initial_estimate(self) -> GoodputEstimate:
        return GoodputEstimate(self.initial_ema())

    def measures_acceptance(self, steps: int) -> bool:
        """A round at depth 0 has no draft, so no acceptance signal."""
        return steps > 0

    @property
    def resets(self) -> bool:
        return self.config.reset_nats > 0

    def round_update(self, ema: float, ema_fail: float, accepts: Sequence[int], steps: int,
                     first: bool = False) -> tuple[float, float, bool]:
        """As every policy's, but with ``reset_nats > 0`` a round restarts both EMAs from itself
        alone (α = 1: its mean accept length and its share of rejecting requests) when it is the
        rank's ``first`` measurement (the start values are placeholders, not measurements) or
        its ``surprise`` exceeds ``reset_nats``."""
        cfg = self.config
        alpha = cfg.ema_alpha
        reset = self.resets and len(accepts) > 0 and (
            first or surprise(accepts, steps, ema, ema_fail) > cfg.reset_nats)
        if reset:
            alpha = 1.0
        return (ema_update(ema, accepts, alpha), ema_fail_update(ema_fail, accepts, steps, alpha),
                reset)

    def observe(self, estimate: GoodputEstimate, accepts: Sequence[int], steps: int,
                shadow: Optional[tuple[int, int, int]] = None
                ) -> tuple[GoodputEstimate, Observed]:
        """Above depth 0 as every policy (with the resets). At depth 0 the round's requests
        count it and nothing moves, unless it reports ``shadow`` = (hits, checks, rows): the
        head's greedy guesses checked against committed tokens, taken as depth-1 observations
        over the depth-0 rounds with requests since the EMAs last moved, one update per such
        round (``shadow_update``; a first measurement: one update with α = 1 when resets are
        on); the weight grows by ``rows``."""
        if self.measures_acceptance(steps):
            ema, ema_fail, reset = self.round_update(estimate.ema, estimate.ema_fail, accepts,
                                                     steps, estimate.fresh)
            moved = len(accepts) > 0
            return (replace(estimate, ema=ema, ema_fail=ema_fail,
                            weight=estimate.weight + len(accepts),
                            unobserved=0 if moved else estimate.unobserved,
                            fresh=estimate.fresh and not moved), Observed(reset))
        unobserved = estimate.unobserved + bool(accepts)
        if shadow is not None:
            hits, checks, rows = shadow
            if not (all(type(v) is int for v in shadow) and 0 <= hits <= checks and rows >= 0):
                raise ValueError(f"shadow checks {shadow!r}: want integers 0 <= hits <= "
                                 f"checks and rows >= 0")
            if checks:
                # the checks were gathered over the rounds since the EMAs last moved: as many
                # updates as those rounds (the engine reports once per catch-up)
                first = estimate.fresh and self.resets   # replaces the start values
                alpha, rounds = ((1.0, 1) if first else
                                 (self.config.ema_alpha, max(unobserved, 1)))
                ema, ema_fail = shadow_update(estimate.ema, estimate.ema_fail, hits, checks,
                                              alpha, rounds)
                return (GoodputEstimate(ema, ema_fail, estimate.weight + rows, 0, False),
                        Observed(first, True))
        return replace(estimate, unobserved=unobserved), Observed()

    # ---- the decision ----------------------------------------------------------------------
    expected = staticmethod(expected_accepted)

    def decide(self, state: GoodputState, cluster_requests: int, emas: Sequence[float],
               weights: Sequence[float], ema_fails: Optional[Sequence[float]] = None,
               batch: int = 0, table: Optional[RoundCost] = None
               ) -> tuple[GoodputState, Decision]:
        """``ema_fails`` (one per rank), ``batch`` (the round's padded batch, which picks the
        ``round_cost`` row) and ``table`` (the live cost table; default ``round_cost``)."""
        if cluster_requests > 0 and (ema_fails is None or len(ema_fails) != len(emas)):
            raise ValueError("the goodput policy needs one ema_fail per rank")
        return super().decide(state, cluster_requests, emas, weights, ema_fails, batch, table)

    def choose(self, state: GoodputState, point: bool, dwell_ok: bool,
               global_ema: Optional[float], pooled: Optional[Pooled], batch: int,
               table: Optional[RoundCost]) -> tuple[GoodputState, Decision]:
        cfg = self.config
        table = table if table is not None else cfg.round_cost
        if table is None:
            raise ValueError("the goodput policy needs round_cost (measure it and call "
                             "agree_round_cost, or set it in the config)")
        rate = self.reducer.rate(pooled) if pooled is not None else None
        tree = candidate_tree(cfg, state.index)
        if rate is not None and tree is not None:
            # a tree's rounds measured its per-level rate c: the chain-equivalent p scores all
            rate = chain_rate(rate, tree[3])
        row = table.buckets[cost_row(table, batch)] if table.buckets is not None else None
        new_index, probe = state.index, False
        if point and dwell_ok:
            new_index, probe = goodput_step(cfg, state, rate, batch, table,
                                            self.reducer.mix(pooled) if pooled else None)
        if point and rate is not None and at_depth_zero(cfg, state.index):
            state = replace(state, last_signal=state.counted)   # a signal at depth 0: no probe due
        decision = Decision(True, point, global_ema, state.index, new_index, rate, row, probe)
        if new_index != state.index:
            state = self.switch(state, new_index)
        return state, decision

    def convert_estimate(self, estimate: GoodputEstimate, old: int, new: int
                         ) -> GoodputEstimate:
        """A rank's EMAs after a switch from candidate ``old`` to ``new`` (every rank its own,
        at the same round): they measured the old shape's per-level rate, so the rate is carried
        to the new shape's (``chain_rate`` then ``tree_rate``), ``ema + ema_fail`` kept; a
        switch between chains (or to or from depth 0) leaves them as they are."""
        cfg = self.config
        a, b = candidate_tree(cfg, old), candidate_tree(cfg, new)
        if (a is None and b is None) or at_depth_zero(cfg, old) or at_depth_zero(cfg, new):
            return estimate
        total = estimate.ema + estimate.ema_fail
        if total <= 0:
            return estimate
        p = estimate.ema / total
        if a is not None:
            p = chain_rate(p, a[3])
        if b is not None:
            p = tree_rate(p, b[3])
        return replace(estimate, ema=p * total, ema_fail=(1.0 - p) * total)

    # ---- timed rounds -----------------------------------------------------------------------
    @property
    def times_rounds(self) -> bool:
        """With ``cost_alpha`` > 0 a timed round moves its row of the live cost table."""
        return self.config.cost_alpha > 0

    def live_costs(self) -> Optional[LiveCosts]:
        """The agreed ``round_cost`` with a zero offset per row (None: no table yet)."""
        table = self.config.round_cost
        return LiveCosts(table, (0.0,) * len(table.rows)) if table is not None else None

    def round_timed(self, costs: Optional[LiveCosts], batch: int, steps: int,
                    seconds: float) -> Optional[LiveCosts]:
        """``costs`` with the offset of batch ``batch``'s row moved toward ``seconds`` less the
        agreed cost at ``steps`` (``update_offsets``, weight ``cost_alpha``)."""
        if costs is None or not self.times_rounds:
            return costs
        return replace(costs, offsets=update_offsets(costs.base, costs.offsets, batch, steps,
                                                     seconds, self.config.cost_alpha))

    def outcome_fields(self, decision: Decision, local_ema_fail: float) -> dict[str, Any]:
        """The rank's ``local_ema_fail``, the cluster's ``accept_rate`` (null when no rank has
        weight), the ``round_cost`` row used (``cost_row``, its bucket; null for a flat table)
        and whether the switch is a ``probe`` out of depth 0."""
        return {"local_ema_fail": local_ema_fail, "accept_rate": decision.accept_rate,
                "cost_row": decision.cost_row, "probe": decision.probe}

    def summary_lines(self, records: Sequence[dict]) -> list[str]:
        """Every rank's last acceptance rate ``ema/(ema+ema_fail)`` and rank 0's probes."""
        last: dict[int, dict] = {}
        for r in records:
            last[r["rank"]] = r
        rates = ", ".join(f"rank {k}: {acceptance_rate(v['local_ema'], v['local_ema_fail']):.3f}"
                          for k, v in sorted(last.items()))
        probes = sum(1 for r in records if r["rank"] == 0 and r["probe"])
        return [f"final local acceptance rate ema/(ema+ema_fail): {rates or 'none'}; "
                f"probes out of depth 0: {probes}"]

    # ---- in an engine ----------------------------------------------------------------------
    @classmethod
    def in_engine(cls, config: AdaptiveConfig, catchup_rounds: int) -> AdaptiveConfig:
        """``config`` with ``probe_every`` raised to ``probe_floor`` where it is below."""
        need = probe_floor(config, catchup_rounds)
        return config if config.probe_every >= need else config.replace(probe_every=need)


def _check_cost_steps(table: RoundCost, candidates: tuple[int, ...],
                      tree_steps: tuple[int, ...] = ()) -> None:
    """Every row of ``table`` lists exactly the candidate depths (and may list the steps of a
    tree candidate: an engine measures every tier it built)."""
    for i, row in enumerate(table.rows):
        where = "round_cost" if table.buckets is None else f"round_cost[{str(table.buckets[i])!r}]"
        have = [s for s, _ in row]
        missing = [s for s in candidates if s not in have]
        extra = [s for s in have if s not in candidates and s not in tree_steps]
        if missing or extra:
            what = (f"missing {[str(s) for s in missing]}" if missing
                    else f"has {[str(s) for s in extra]}, which are not candidates")
            raise ConfigError(f"{where}={dict((str(s), v) for s, v in row)!r}: {what}; "
                              f"allowed: one cost for every candidate depth "
                              f"{[str(s) for s in candidates]}")
