"""Deprecated: the old name of the round coordinator and its keyword call forms.

``AdaptiveController`` is ``adaptive_dist.coordinator.RoundCoordinator`` that also takes
``begin_round``'s report as keyword arguments and ``end_round(..., executed=...)``. Kept only
for callers outside this repository's packages and tests (scripts/); new code uses
``RoundCoordinator``, ``RoundReport`` and ``RoundCoordinator.ran``.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from adaptive_dist.coordinator import (
    Executed,
    RoundCoordinator,
    RoundOutcome,
    RoundPlan,
    RoundReport,
)

__all__ = ["AdaptiveController", "RoundOutcome", "RoundPlan", "RoundReport"]


class AdaptiveController(RoundCoordinator):
    """``RoundCoordinator`` with the old call forms (deprecated)."""

    def begin_round(self, report: Any = None, *args: Any, **fields: Any) -> RoundPlan:
        if not isinstance(report, RoundReport):
            if report is not None:
                args = (report, *args)
            report = RoundReport(*args, **fields)
        return super().begin_round(report)

    def end_round(self, accepts: Sequence[int], executed: Optional[Executed] = None,
                  plan: Optional[RoundPlan] = None,
                  shadow: Optional[tuple[int, int, int]] = None) -> None:
        if executed is not None:
            self.ran(executed)
        super().end_round(accepts, plan, shadow)
