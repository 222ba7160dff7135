"""The depth policies: one ``DepthPolicy`` class per ``policy`` (``static``, ``ema``, ``goodput``),
each owning its configuration section, its state and its rules (docs/policy.md), as pure
functions of agreed inputs: every rank calls ``decide`` with the same gathered values and gets
the same answer. ``depth_policy(config)`` is the one place a policy name becomes behaviour.

The module-level ``decide``, ``initial_ema``, ``measures_acceptance``, ``resets`` and
``round_update`` are the policy of ``cfg`` applied once (for tests and one-off callers).
"""
from __future__ import annotations

from typing import Optional, Sequence

from adaptive_dist.config import POLICIES, REDUCERS, AdaptiveConfig, RoundCost
from adaptive_dist.policy.base import (
    CountingPolicy,
    Decision,
    DepthPolicy,
    Observed,
    PolicyState,
    RankEstimate,
)
from adaptive_dist.policy.goodput import (
    SURPRISE_RATE_CLIP,
    GoodputEstimate,
    GoodputPolicy,
    GoodputState,
    cost_row,
    expected_accepted,
    goodput_pick,
    goodput_score,
    goodput_scores,
    goodput_step,
    mixture_expected,
    probe_due,
    probe_floor,
    shadow_update,
    shifted_costs,
    surprise,
    update_offsets,
)
from adaptive_dist.policy.ladder import EmaLadderPolicy, StaticPolicy
from adaptive_dist.policy.reducers import (
    REDUCERS_BY_NAME,
    Reducer,
    cluster_rate,
    live_rates,
    reduce_emas,
    reducer_named,
)
from adaptive_dist.policy.rules import (
    INITIAL_EMA_FAIL,
    acceptance_rate,
    decision_points_upto,
    ema_fail_update,
    ema_update,
    fail_flags,
    is_decision_point,
    ladder_walk,
    pick_bucket,
)

POLICY_CLASSES: dict[str, type[CountingPolicy]] = {
    cls.name: cls for cls in (StaticPolicy, EmaLadderPolicy, GoodputPolicy)}
assert tuple(POLICY_CLASSES) == POLICIES, "adaptive_dist.config.POLICIES lists every policy"
assert tuple(REDUCERS_BY_NAME) == REDUCERS, "adaptive_dist.config.REDUCERS lists every reducer"


def policy_class(name: str) -> type[CountingPolicy]:
    """The class of the policy called ``name`` (``name`` is one of ``POLICIES``)."""
    return POLICY_CLASSES[name]


def depth_policy(cfg: AdaptiveConfig) -> DepthPolicy:
    """The depth policy ``cfg`` asks for, configured by it."""
    return POLICY_CLASSES[cfg.policy](cfg)


def initial_ema(cfg: AdaptiveConfig) -> float:
    """A rank's EMA before any round: ``initial_steps - 1`` (goodput: at least 0, so the
    acceptance rate of a run that starts at depth 0 is defined)."""
    return depth_policy(cfg).initial_ema()


def measures_acceptance(cfg: AdaptiveConfig, steps: int) -> bool:
    """Whether a round run at ``steps`` updates the rank's EMAs and weight: always, except a
    goodput round at depth 0 (no draft, so no acceptance signal)."""
    return depth_policy(cfg).measures_acceptance(steps)


def resets(cfg: AdaptiveConfig) -> bool:
    """Whether the policy restarts a rank's EMAs on a surprise and on its first measurement
    (goodput with ``reset_nats > 0``)."""
    return depth_policy(cfg).resets


def round_update(cfg: AdaptiveConfig, ema: float, ema_fail: float, accepts: Sequence[int],
                 steps: int, first: bool = False) -> tuple[float, float, bool]:
    """(ema, ema_fail, reset) after a round that measures acceptance (``measures_acceptance``),
    by ``cfg``'s policy (``CountingPolicy.round_update``, ``GoodputPolicy.round_update``)."""
    return depth_policy(cfg).round_update(ema, ema_fail, accepts, steps, first)


def decide(cfg: AdaptiveConfig, state: PolicyState, cluster_requests: int,
           emas: Sequence[float], weights: Sequence[float],
           ema_fails: Optional[Sequence[float]] = None, batch: int = 0,
           table: Optional[RoundCost] = None) -> tuple[PolicyState, Decision]:
    """One round's decision under ``cfg.policy`` from cluster-wide values (identical on every
    rank). ``ema_fails`` (one per rank), ``batch`` (the round's padded batch, which picks the
    ``round_cost`` row) and ``table`` (the live cost table; default ``cfg.round_cost``) are read
    by the goodput policy only."""
    return depth_policy(cfg).decide(state, cluster_requests, emas, weights, ema_fails, batch,
                                    table)


__all__ = [
    "POLICY_CLASSES", "policy_class", "depth_policy", "DepthPolicy", "CountingPolicy",
    "StaticPolicy", "EmaLadderPolicy", "GoodputPolicy", "PolicyState", "GoodputState",
    "RankEstimate", "GoodputEstimate", "Observed", "Decision", "Reducer", "REDUCERS_BY_NAME",
    "reducer_named", "reduce_emas", "cluster_rate", "live_rates", "INITIAL_EMA_FAIL",
    "SURPRISE_RATE_CLIP", "acceptance_rate", "cost_row", "decide", "decision_points_upto",
    "ema_fail_update", "ema_update", "expected_accepted", "fail_flags", "goodput_pick",
    "goodput_score", "goodput_scores", "goodput_step", "initial_ema", "is_decision_point",
    "ladder_walk", "measures_acceptance", "mixture_expected", "pick_bucket",
    "probe_due", "probe_floor", "resets", "round_update", "shadow_update", "shifted_costs",
    "surprise", "update_offsets",
]
