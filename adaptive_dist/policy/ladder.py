"""The static policy and the EMA ladder (SGLang-compatible thresholds; docs/policy.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from adaptive_dist.config import PolicySection, check, is_number
from adaptive_dist.policy.base import CountingPolicy, Decision, PolicyState
from adaptive_dist.policy.rules import ladder_walk

if TYPE_CHECKING:
    from adaptive_dist.config import AdaptiveConfig, RoundCost
    from adaptive_dist.policy.reducers import Pooled

HYSTERESIS_LIMIT = 1000.0


@dataclass(frozen=True)
class EmaSection(PolicySection):
    """The ema ladder's own keys."""

    up_hysteresis: float = 0.0
    """Added to the rise threshold ``c[i] - 0.5``."""
    down_hysteresis: float = -0.25
    """Added to the drop threshold ``c[i-1] - 0.5``."""


class StaticPolicy(CountingPolicy):
    """``static``: never switches. The consensus still runs every round (it agrees the graph path
    and the padded shapes and checks that every rank runs the same depth) and the EMAs still
    update, which nothing reads."""

    name = "static"
    adaptive = False
    allows_depth_zero = True

    def choose(self, state: PolicyState, point: bool, dwell_ok: bool,
               global_ema: Optional[float], pooled: Optional["Pooled"], batch: int,
               table: Optional["RoundCost"]) -> tuple[PolicyState, Decision]:
        return state, Decision(True, point, global_ema, state.index, state.index)


class EmaLadderPolicy(CountingPolicy):
    """``ema``: at a decision point the dwell allows, walk the ladder of candidates on the global
    EMA: down while ``E <= c[i-1] - 0.5 + down_hysteresis``, else up while
    ``E > c[i] - 0.5 + up_hysteresis``. Depth 0 has no acceptance signal here, so it is not a
    candidate."""

    name = "ema"
    Section = EmaSection

    @classmethod
    def check_section(cls, config: "AdaptiveConfig") -> None:
        for key in EmaSection.keys():
            v = getattr(config, key)
            check(is_number(v) and -HYSTERESIS_LIMIT < v < HYSTERESIS_LIMIT, key, v,
                  f"must be a finite number in ({-HYSTERESIS_LIMIT:g}, {HYSTERESIS_LIMIT:g})")

    def choose(self, state: PolicyState, point: bool, dwell_ok: bool,
               global_ema: Optional[float], pooled: Optional["Pooled"], batch: int,
               table: Optional["RoundCost"]) -> tuple[PolicyState, Decision]:
        cfg = self.config
        new_index = state.index
        if point and global_ema is not None and dwell_ok:
            new_index = ladder_walk(cfg.candidate_steps, state.index, global_ema,
                                    cfg.up_hysteresis, cfg.down_hysteresis)
        decision = Decision(True, point, global_ema, state.index, new_index)
        return (self.switch(state, new_index) if new_index != state.index else state), decision
