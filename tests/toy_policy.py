"""A policy that is not part of the product, to show what a new policy touches: this file (its
section, its class) and one `register_policy` call, nothing else (tests/unit/test_policy_plugin.py).

`roundrobin`: at every decision point the dwell allows, move `stride` candidates up, wrapping
around to the smallest. It also needs a start-up measurement, to show how a policy asks for one:
`costs`, the round cost table an engine measures (`round_costs`) and the ranks agree, which it
reports as the cheapest depth of each output line. Run as a script it registers itself and runs
`python -m adaptive_dist` with the arguments given (what torchrun starts on every rank).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from adaptive_dist.config import PolicySection, RoundCost, check, is_int
from adaptive_dist.policy import CountingPolicy, Decision, PolicyState, register_policy


@dataclass(frozen=True)
class RoundRobinSection(PolicySection):
    """The round-robin policy's own key."""

    stride: int = 1
    """Candidates to move up at a decision point (>= 1), wrapping around."""
    costs: Optional[RoundCost] = None
    """Seconds of a round per depth (one row per batch bucket); measured by an engine."""

    def __post_init__(self) -> None:
        if self.costs is not None:
            object.__setattr__(self, "costs", RoundCost.parse(self.costs))
        super().__post_init__()


class RoundRobinPolicy(CountingPolicy):
    name = "roundrobin"
    Section = RoundRobinSection

    @classmethod
    def check_section(cls, config) -> None:
        check(is_int(config.stride) and config.stride >= 1, "stride", config.stride,
              "must be an integer >= 1")
        if config.costs is not None:
            check(config.policy == cls.name, "costs", config.costs.to_json(),
                  f"applies to the {cls.name} policy only")
            check(config.costs.steps == config.candidate_steps, "costs", config.costs.to_json(),
                  f"must price every candidate {list(config.candidate_steps)}")

    @classmethod
    def start_up_needs(cls, config) -> dict[str, str]:
        needs_costs = config.policy == cls.name and config.costs is None
        return {"costs": "round_costs"} if needs_costs else {}

    def choose(self, state: PolicyState, point: bool, dwell_ok: bool,
               global_ema: Optional[float], pooled, batch: int, table
               ) -> tuple[PolicyState, Decision]:
        new_index = state.index
        if point and dwell_ok:
            new_index = (state.index + self.config.stride) % len(self.config.candidate_steps)
        decision = Decision(True, point, global_ema, state.index, new_index)
        return (self.switch(state, new_index) if new_index != state.index else state), decision

    def outcome_fields(self, decision: Decision, local_ema_fail: float) -> dict:
        row = self.config.costs.rows[0]
        return {"stride": self.config.stride, "cheapest": min(row, key=lambda sc: sc[1])[0]}


def register() -> None:
    register_policy(RoundRobinPolicy)


if __name__ == "__main__":
    register()
    from adaptive_dist.cli import main

    sys.exit(main(sys.argv[1:]))
