"""A policy that is not part of the product, to show what a new policy touches: this file (its
section, its class) and one `register_policy` call, nothing else (tests/unit/test_policy_plugin.py).

`roundrobin`: at every decision point the dwell allows, move `stride` candidates up, wrapping
around to the smallest. Run as a script it registers itself and runs `python -m adaptive_dist`
with the arguments given (what torchrun starts on every rank).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from adaptive_dist.config import PolicySection, check, is_int
from adaptive_dist.policy import CountingPolicy, Decision, PolicyState, register_policy


@dataclass(frozen=True)
class RoundRobinSection(PolicySection):
    """The round-robin policy's own key."""

    stride: int = 1
    """Candidates to move up at a decision point (>= 1), wrapping around."""


class RoundRobinPolicy(CountingPolicy):
    name = "roundrobin"
    Section = RoundRobinSection

    @classmethod
    def check_section(cls, config) -> None:
        check(is_int(config.stride) and config.stride >= 1, "stride", config.stride,
              "must be an integer >= 1")

    def choose(self, state: PolicyState, point: bool, dwell_ok: bool,
               global_ema: Optional[float], pooled, batch: int, table
               ) -> tuple[PolicyState, Decision]:
        new_index = state.index
        if point and dwell_ok:
            new_index = (state.index + self.config.stride) % len(self.config.candidate_steps)
        decision = Decision(True, point, global_ema, state.index, new_index)
        return (self.switch(state, new_index) if new_index != state.index else state), decision

    def outcome_fields(self, decision: Decision, local_ema_fail: float) -> dict:
        return {"stride": self.config.stride}


def register() -> None:
    register_policy(RoundRobinPolicy)


if __name__ == "__main__":
    register()
    from adaptive_dist.cli import main

    sys.exit(main(sys.argv[1:]))
