"""The depth policies: one ``DepthPolicy`` class per ``policy`` (``static``, ``ema``, ``goodput``),
each owning its configuration section, its start-up needs, its state and its rules
(docs/policy.md), as pure functions of agreed inputs: every rank calls ``decide`` with the same
gathered values and gets the same answer. The registry (``adaptive_dist.registry``) is the one
place a policy name becomes its class; the built-in policies register below, and a new one is its
own module and one ``register_policy`` call.

The rules themselves live in the submodules (``rules``, ``reducers``, ``ladder``, ``goodput``,
``budgets``); this package exports the policies and what the coordinator and the engine use.
"""
from __future__ import annotations

from adaptive_dist.config import REDUCERS, AdaptiveConfig
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
from adaptive_dist.registry import policy_class, register_policy
from adaptive_dist.policy.rules import INITIAL_EMA_FAIL, pick_bucket

for _builtin in (StaticPolicy, EmaLadderPolicy, GoodputPolicy):   # the built-in policies
    register_policy(_builtin)
assert tuple(REDUCERS_BY_NAME) == REDUCERS, "adaptive_dist.config.REDUCERS lists every reducer"


def depth_policy(cfg: AdaptiveConfig) -> DepthPolicy:
    """The depth policy ``cfg`` asks for, configured by it."""
    return policy_class(cfg.policy)(cfg)


__all__ = [
    "register_policy", "policy_class", "depth_policy", "DepthPolicy", "CountingPolicy",
    "StaticPolicy", "EmaLadderPolicy", "GoodputPolicy", "PolicyState", "GoodputState",
    "RankEstimate", "GoodputEstimate", "Observed", "Shadow", "Decision", "INITIAL_EMA_FAIL",
    "pick_bucket", "cost_row", "shifted_costs", "update_offsets",
]
