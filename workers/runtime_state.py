"""Pre-built runtime states, one per depth: what makes a tier switch a reference swap.

A `SpecRuntimeState` holds everything whose shape depends on `steps` (step buffers, the CUDA graphs
of draft, verify and draft-extend per batch bucket). The engine builds one per tier at start-up
through the worker (`build_runtime_state`) and, when the controller's plan says the depth changed,
installs the pre-built one (`apply_runtime_state`): nothing is captured or allocated at a switch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable


@dataclass
class SpecRuntimeState:
    """Everything whose shape depends on ``steps`` (buffers, CUDA graphs per batch bucket)."""

    steps: int
    payload: Any = None
    nbytes: int = 0


@runtime_checkable
class AdaptiveSpecWorker(Protocol):
    """What the pool needs from a worker."""

    def build_runtime_state(self, steps: int) -> SpecRuntimeState: ...

    def apply_runtime_state(self, state: SpecRuntimeState) -> None: ...


class RuntimeStatePool:
    """One pre-built state per tier; ``apply`` is a reference swap in the worker."""

    def __init__(self, worker: AdaptiveSpecWorker, tiers: Sequence[int]) -> None:
        self.worker = worker
        self.states: dict[int, SpecRuntimeState] = {}
        for steps in tiers:
            state = worker.build_runtime_state(steps)
            if state.steps != steps:
                raise ValueError(f"build_runtime_state({steps}) returned a state for "
                                 f"steps={state.steps}")
            self.states[steps] = state

    @property
    def nbytes(self) -> int:
        """Bytes held by every tier's state."""
        return sum(s.nbytes for s in self.states.values())

    def apply(self, steps: int) -> None:
        """Install the pre-built state of ``steps`` (no capture, no allocation)."""
        if steps not in self.states:
            raise RuntimeError(f"no runtime state was built for steps={steps} "
                               f"(built: {sorted(self.states)})")
        self.worker.apply_runtime_state(self.states[steps])
