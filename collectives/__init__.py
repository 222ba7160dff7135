"""Process groups, the parallel layout, typed collectives, recording and the lockstep guard."""
from collectives import ops
from collectives.distributed import DistContext, free_port, init_distributed, pick_backend
from collectives.group import Group
from collectives.guard import (
    EXIT_DIVERGENCE,
    EXIT_TIMEOUT,
    CollectiveTimeoutError,
    DivergenceError,
    LockstepGuard,
    first_difference,
)
from collectives.layout import GROUP_NAMES, ParallelLayout, check_degrees
from collectives.recorder import CollectiveEntry, CollectiveRecorder

__all__ = [
    "ops", "DistContext", "free_port", "init_distributed", "pick_backend", "Group",
    "EXIT_DIVERGENCE", "EXIT_TIMEOUT", "CollectiveTimeoutError", "DivergenceError",
    "LockstepGuard", "first_difference", "GROUP_NAMES", "ParallelLayout", "check_degrees",
    "CollectiveEntry", "CollectiveRecorder",
]
