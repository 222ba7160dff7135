"""What every depth policy is: the ``DepthPolicy`` protocol, the shared state, the decision record,
and ``CountingPolicy``, the counting and decision-point skeleton the policies build on.

A policy is pure: every rank calls ``decide`` with the same gathered values and the same state and
gets the same answer; ``observe`` turns one rank's round into its next local estimate. The round
coordinator (``adaptive_dist.coordinator``) holds the state and the estimate, runs the collective
and applies nothing itself.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Optional, Protocol, Sequence

from adaptive_dist.policy.reducers import Pooled, reducer_named
from adaptive_dist.policy.rules import (
    INITIAL_EMA_FAIL,
    ema_fail_update,
    ema_update,
    is_decision_point,
)

if TYPE_CHECKING:
    from adaptive_dist.config import AdaptiveConfig, PolicySection, RoundCost


_PLAIN: dict[type, frozenset] = {}   # class -> its field names (empty: not plain)


def evolve(obj: Any, **changes: Any) -> Any:
    """``dataclasses.replace(obj, **changes)`` for the round's frozen records (the state, the
    estimate), without the frozen ``__init__``'s one ``object.__setattr__`` per field: the same
    instance (equal, the same repr and hash). A class whose ``__init__`` does more
    (``__post_init__``, ``init=False`` fields, slots) and a name that is not a field take
    ``dataclasses.replace`` (which refuses the unknown name)."""
    cls = type(obj)
    names = _PLAIN.get(cls)
    if names is None:
        params = getattr(cls, "__dataclass_params__", None)
        plain = (params is not None and params.frozen and params.init
                 and not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__")
                 and all(f.init for f in dataclasses.fields(cls)))
        names = _PLAIN[cls] = (frozenset(f.name for f in dataclasses.fields(cls)) if plain
                               else frozenset())
    if not names or not names.issuperset(changes) or obj.__dict__.keys() != names:
        return replace(obj, **changes)
    new = object.__new__(cls)
    d = new.__dict__
    d.update(obj.__dict__)
    d.update(changes)
    return new


@dataclass(frozen=True)
class PolicyState:
    """What every rank must hold identically under every policy: the tier, the counted rounds and
    the last switch (a policy with more state extends it)."""

    index: int
    counted: int = 0
    last_switch: int = -1  # counted round of the last switch; -1: none yet
    tokens: int = 0        # per-request budgets: the verify tokens decided for the next round
                           # (0: none yet, a chain)


@dataclass(frozen=True)
class RankEstimate:
    """One rank's own statistics since the start: the EMA of its accept lengths, of the share of
    its requests that rejected a draft token, and its weight (the requests it reported since the
    last decision point). Rank-local; they travel in the round's vector."""

    ema: float
    ema_fail: float = INITIAL_EMA_FAIL
    weight: int = 0


class Shadow(NamedTuple):
    """A depth-0 round's shadow checks on one rank (the draft head's greedy guesses checked
    against committed tokens by the catch-up): guesses right, guesses, rows that had any."""

    hits: int
    checks: int
    rows: int


class Observed(NamedTuple):
    """What a round's report did to the estimate (for the statistics)."""

    reset: bool = False    # the EMAs restarted from this round alone
    shadow: bool = False   # shadow checks updated the EMAs (a depth-0 round)


_OBSERVED = (Observed(False), Observed(True))   # Observed(reset), built once (a tuple: immutable)


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
    tokens: int = 0                      # per-request: the verify tokens decided (next round)
    rate: Optional[float] = None         # per-request: expected tokens per second of the shape

    @property
    def switched(self) -> bool:
        return self.new_index != self.old_index


class DepthPolicy(Protocol):
    """A rule for the draft depth: its own configuration section, its state, its decisions."""

    name: ClassVar[str]
    adaptive: ClassVar[bool]          # may change the depth
    allows_depth_zero: ClassVar[bool]  # 0 (no speculation) may be a candidate
    # the candidates a run gets when its configuration names none (None: AdaptiveConfig's)
    default_candidates: ClassVar[Optional[tuple[int, ...]]]
    # the configuration keys only this policy reads, with their defaults: a frozen dataclass
    # deriving from ``adaptive_dist.config.PolicySection`` (None: no keys of its own)
    Section: ClassVar[Optional[type["PolicySection"]]]
    config: "AdaptiveConfig"

    @classmethod
    def check_section(cls, config: "AdaptiveConfig") -> None:
        """Validate the keys of this policy's section (every effective configuration holds them,
        whatever its policy); ``ConfigError`` naming the key, the value and what is allowed."""

    @classmethod
    def start_up_needs(cls, config: "AdaptiveConfig") -> dict[str, str]:
        """The measured inputs this policy still needs before the first round: its section's
        key -> the engine's measurement that fills it (``adaptive_dist.startup.MEASURES``;
        goodput: ``{"round_cost": "round_costs"}`` while unset). An engine measures each and the
        ranks agree it (``adaptive_dist.startup.prepare``); consensus-only mode, which measures
        nothing, refuses a config that still needs any."""

    def initial_state(self) -> PolicyState:
        """The shared state before any round."""

    def initial_ema(self) -> float:
        """A rank's EMA before any round."""

    def initial_estimate(self) -> RankEstimate:
        """A rank's estimate before any round."""

    def measures_acceptance(self, steps: int) -> bool:
        """Whether a round run at ``steps`` updates the EMAs and weight from its accept lengths."""

    @property
    def resets(self) -> bool:
        """Whether a surprise (or a first measurement) restarts a rank's EMAs."""

    def round_update(self, ema: float, ema_fail: float, accepts: Sequence[int], steps: int,
                     first: bool = False) -> tuple[float, float, bool]:
        """(ema, ema_fail, reset) after a round that measures acceptance."""

    def observe(self, estimate: RankEstimate, accepts: Sequence[int], steps: int,
                shadow: Optional[tuple[int, int, int]] = None) -> tuple[RankEstimate, Observed]:
        """The rank's estimate after one of its rounds (``accepts`` checked against ``steps``)."""

    def decide(self, state: PolicyState, cluster_requests: int, emas: Sequence[float],
               weights: Sequence[float], ema_fails: Optional[Sequence[float]] = None,
               batch: int = 0, table: Optional["RoundCost"] = None
               ) -> tuple[PolicyState, Decision]:
        """One round's decision from cluster-wide values (identical on every rank)."""

    def decide_pooled(self, state: PolicyState, cluster_requests: int,
                      pooled: Optional["Pooled"], batch: int = 0,
                      table: Optional["RoundCost"] = None) -> tuple[PolicyState, Decision]:
        """``decide`` from the cluster's pooled statistics (``reducers.Pooled``; None: no rank
        has weight), as a round's reduction gives them."""

    @classmethod
    def in_engine(cls, config: "AdaptiveConfig", catchup_rounds: int) -> "AdaptiveConfig":
        """The effective configuration in an engine whose draft cache catches up every
        ``catchup_rounds`` depth-0 rounds (``config`` itself when the policy does not care)."""

    @property
    def times_rounds(self) -> bool:
        """Whether the agreed time of a steady decode round moves what this policy decides on
        (``round_timed``; goodput with ``cost_alpha`` > 0)."""

    def live_costs(self) -> Any:
        """What round times move, at the start (None: nothing; goodput: its cost table and a
        zero offset per row). The coordinator holds it, identical on every rank, and passes
        its ``table`` to ``decide``."""

    def round_timed(self, costs: Any, batch: int, steps: int, seconds: float) -> Any:
        """``costs`` after a steady decode round of padded batch ``batch`` at ``steps`` took
        ``seconds`` (the slowest rank's, agreed)."""

    def outcome_fields(self, decision: Decision, local_ema_fail: float) -> dict[str, Any]:
        """What this policy adds to a consensus-only output line (none: ``{}``)."""

    def summary_lines(self, records: Sequence[dict]) -> list[str]:
        """What this policy adds to a consensus-only summary, from every rank's output lines."""


class CountingPolicy(abc.ABC):
    """The skeleton shared by every policy: a round counts when the cluster ran requests, counted
    round ``c`` is a decision point by ``warmup_batches`` / ``update_interval``, the dwell holds a
    switch back, the global EMA is the reducer over the ranks with weight; the EMAs update with
    ``ema_alpha`` from every round. ``choose`` is the policy's own rule."""

    name: ClassVar[str]
    adaptive: ClassVar[bool] = True
    allows_depth_zero: ClassVar[bool] = False
    default_candidates: ClassVar[Optional[tuple[int, ...]]] = None
    Section: ClassVar[Optional[type["PolicySection"]]] = None

    def __init__(self, config: "AdaptiveConfig") -> None:
        self.config = config
        self.reducer = reducer_named(config.reducer)

    @classmethod
    def check_section(cls, config: "AdaptiveConfig") -> None:
        return None

    @classmethod
    def start_up_needs(cls, config: "AdaptiveConfig") -> dict[str, str]:
        return {}

    # ---- the rank's estimate ---------------------------------------------------------------
    def initial_state(self) -> PolicyState:
        return PolicyState(index=self.config.initial_index)

    def initial_ema(self) -> float:
        """A rank's EMA before any round: ``initial_steps - 1``."""
        return float(self.config.initial_steps - 1)

    def initial_estimate(self) -> RankEstimate:
        return RankEstimate(self.initial_ema())

    def measures_acceptance(self, steps: int) -> bool:
        return True

    @property
    def resets(self) -> bool:
        """Whether a surprise (or a first measurement) restarts a rank's EMAs."""
        return False

    def round_update(self, ema: float, ema_fail: float, accepts: Sequence[int], steps: int,
                     first: bool = False) -> tuple[float, float, bool]:
        """(ema, ema_fail, reset) after a round that measures acceptance: both EMAs update with
        ``ema_alpha``."""
        alpha = self.config.ema_alpha
        return (ema_update(ema, accepts, alpha), ema_fail_update(ema_fail, accepts, steps, alpha),
                False)

    def observe(self, estimate: RankEstimate, accepts: Sequence[int], steps: int,
                shadow: Optional[tuple[int, int, int]] = None) -> tuple[RankEstimate, Observed]:
        """Every round measures: the EMAs update, the weight grows by the requests (``shadow``
        is not read)."""
        ema, ema_fail, reset = self.round_update(estimate.ema, estimate.ema_fail, accepts, steps)
        return (evolve(estimate, ema=ema, ema_fail=ema_fail,
                       weight=estimate.weight + len(accepts)), _OBSERVED[bool(reset)])

    # ---- the decision ----------------------------------------------------------------------
    def pooled(self, emas: Sequence[float], weights: Sequence[float],
               ema_fails: Optional[Sequence[float]] = None) -> Optional[Pooled]:
        """What this policy's reducer reads of per-rank values (None: no rank has weight)."""
        mixes = self.reducer.mixes
        return Pooled.of(emas, ema_fails, weights, self.config.candidate_steps if mixes else (),
                         self.expected if mixes else None)

    @staticmethod
    def expected(p: float, steps: int) -> float:
        """``E(p, S)`` of a mixing reducer (goodput's ``expected_accepted``). Only goodput mixes:
        its ``check_section`` refuses ``reducer='mixture'`` for every other policy."""
        raise TypeError("only the goodput policy defines expected tokens (the 'mixture' reducer)")

    def decide(self, state: PolicyState, cluster_requests: int, emas: Sequence[float],
               weights: Sequence[float], ema_fails: Optional[Sequence[float]] = None,
               batch: int = 0, table: Optional["RoundCost"] = None
               ) -> tuple[PolicyState, Decision]:
        """``decide_pooled`` on the per-rank values (``pooled``)."""
        if cluster_requests <= 0:
            return state, Decision(False, False, None, state.index, state.index)
        return self.decide_pooled(state, cluster_requests, self.pooled(emas, weights, ema_fails),
                                  batch, table)

    def decide_pooled(self, state: PolicyState, cluster_requests: int, pooled: Optional[Pooled],
                      batch: int = 0, table: Optional["RoundCost"] = None
                      ) -> tuple[PolicyState, Decision]:
        """Count the round, find whether it is a decision point and whether the dwell allows a
        switch, then ``choose``. An uncounted round (no requests anywhere) changes nothing.
        ``pooled``: the cluster's statistics (None: no rank has weight)."""
        if cluster_requests <= 0:
            return state, Decision(False, False, None, state.index, state.index)
        cfg = self.config
        counted = state.counted + 1
        state = evolve(state, counted=counted)
        global_ema = self.reducer.ema(pooled) if pooled is not None else None
        point = is_decision_point(counted, cfg.warmup_batches, cfg.update_interval)
        dwell_ok = state.last_switch < 0 or counted - state.last_switch >= cfg.min_dwell_rounds
        return self.choose(state, point, dwell_ok, global_ema, pooled, batch, table)

    @abc.abstractmethod
    def choose(self, state: PolicyState, point: bool, dwell_ok: bool,
               global_ema: Optional[float], pooled: Optional[Pooled], batch: int,
               table: Optional["RoundCost"]) -> tuple[PolicyState, Decision]:
        """The policy's rule at a counted round (``state`` already counts it); every policy
        class defines it."""

    @staticmethod
    def switch(state: PolicyState, new_index: int) -> PolicyState:
        """``state`` after a switch to ``new_index`` at the counted round it holds."""
        return evolve(state, index=new_index, last_switch=state.counted)

    @classmethod
    def in_engine(cls, config: "AdaptiveConfig", catchup_rounds: int) -> "AdaptiveConfig":
        return config

    @property
    def times_rounds(self) -> bool:
        return False

    def live_costs(self) -> Any:
        return None

    def round_timed(self, costs: Any, batch: int, steps: int, seconds: float) -> Any:
        return costs

    def outcome_fields(self, decision: Decision, local_ema_fail: float) -> dict[str, Any]:
        return {}

    def summary_lines(self, records: Sequence[dict]) -> list[str]:
        return []
