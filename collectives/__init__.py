"""Process groups, the parallel layout, typed collectives, recording and the lockstep guard.

Names are loaded on first use (PEP 562), so ``import collectives`` and the error classes in
``collectives.errors`` do not import torch; ``collectives.init_distributed`` and friends do.
"""
from __future__ import annotations

import importlib
from typing import Any

from collectives.errors import (
    EXIT_DIVERGENCE,
    EXIT_TIMEOUT,
    CollectiveTimeoutError,
    DivergenceError,
    SettingsMismatchError,
    StartupError,
)

_LAZY = {
    "ops": "collectives.ops",
    "agree_settings": "collectives.agreement", "all_ranks_or_none": "collectives.agreement",
    "exchange": "collectives.agreement",
    "DistContext": "collectives.distributed", "free_port": "collectives.distributed",
    "init_distributed": "collectives.distributed", "pick_backend": "collectives.distributed",
    "Group": "collectives.group",
    "LockstepGuard": "collectives.guard", "first_difference": "collectives.guard",
    "GROUP_NAMES": "collectives.layout", "ParallelLayout": "collectives.layout",
    "check_degrees": "collectives.layout",
    "CollectiveEntry": "collectives.recorder", "CollectiveRecorder": "collectives.recorder",
}

__all__ = [
    "ops", "DistContext", "free_port", "init_distributed", "pick_backend", "Group",
    "EXIT_DIVERGENCE", "EXIT_TIMEOUT", "CollectiveTimeoutError", "DivergenceError",
    "LockstepGuard", "first_difference", "GROUP_NAMES", "ParallelLayout", "check_degrees",
    "CollectiveEntry", "CollectiveRecorder", "StartupError", "SettingsMismatchError",
    "agree_settings", "all_ranks_or_none", "exchange",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    mod = importlib.import_module(module)
    return mod if name == "ops" else getattr(mod, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
