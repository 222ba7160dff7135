"""The depth policies: one ``DepthPolicy`` class per ``policy`` (``static``, ``ema``, ``goodput``),
each owning its configuration section, its state and its rules (docs/policy.md), as pure
functions of agreed inputs: every rank calls ``decide`` with the same gathered values and gets
the same answer. ``depth_policy(config)`` is the one place a policy name becomes behaviour.

The rules themselves live in the submodules (``rules``, ``reducers``, ``ladder``, ``goodput``,
``budgets``); this package exports the policies and what the coordinator and the engine use.
"""
from __future__ import annotations

from adaptive_dist.config import POLICIES, REDUCERS, AdaptiveConfig
from adaptive_dist.policy.base import (
    CountingPolicy,
    Decision,
    DepthPolicy,
    Observed,
    PolicyState,
    RankEstimate,
    Shadow,
)
from adaptive_dist.policy.goodput import (
    GoodputEstimate,
    GoodputPolicy,
    GoodputState,
    cost_row,
    shifted_costs,
    update_offsets,
)
from adaptive_dist.policy.ladder import EmaLadderPolicy, StaticPolicy
from adaptive_dist.policy.reducers import REDUCERS_BY_NAME
from adaptive_dist.policy.rules import INITIAL_EMA_FAIL, pick_bucket

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


__all__ = [
    "POLICY_CLASSES", "policy_class", "depth_policy", "DepthPolicy", "CountingPolicy",
    "StaticPolicy", "EmaLadderPolicy", "GoodputPolicy", "PolicyState", "GoodputState",
    "RankEstimate", "GoodputEstimate", "Observed", "Shadow", "Decision", "INITIAL_EMA_FAIL",
    "pick_bucket", "cost_row", "shifted_costs", "update_offsets",
]
