"""Which DP group a new request goes to.

- ``shortest``: the group with the fewest outstanding tokens (from the frontend's own bookkeeping:
  for every unfinished request, its prompt until the first token arrives plus the tokens it may
  still generate); ties go to the lowest group index;
- ``round_robin``: groups in turn;
- a request's own ``dp_rank`` pins it.
"""
from __future__ import annotations

from typing import Optional, Sequence

ROUTINGS = ("shortest", "round_robin")


class Router:
    def __init__(self, dp: int, policy: str) -> None:
        if policy not in ROUTINGS:
            raise ValueError(f"routing={policy!r}; allowed: {', '.join(ROUTINGS)}")
        if dp < 1:
            raise ValueError(f"dp={dp}: must be >= 1")
        self.dp, self.policy = dp, policy
        self._next = 0

    def choose(self, loads: Sequence[int], pinned: Optional[int] = None) -> int:
        """The DP group for a new request, given each group's outstanding tokens."""
        if len(loads) != self.dp:
            raise ValueError(f"{len(loads)} loads for {self.dp} DP groups")
        if pinned is not None:
            if not 0 <= pinned < self.dp:
                raise ValueError(f"dp_rank={pinned}: must be in [0, {self.dp})")
            return pinned
        if self.policy == "round_robin":
            chosen = self._next
            self._next = (self._next + 1) % self.dp
            return chosen
        return min(range(self.dp), key=lambda g: (loads[g], g))
