"""adaptive_dist: adaptive speculative-decoding depth that is safe on DP/TP attention clusters.

Names are loaded on first use (PEP 562), so ``python -m adaptive_dist --help`` and the config
command do not import torch. The policies (pure Python) are imported here: their package
registers the built-in ones (``adaptive_dist.registry``).
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "AdaptiveConfig": "adaptive_dist.config", "ConfigError": "adaptive_dist.config",
    "load_config": "adaptive_dist.config",
    "RoundCoordinator": "adaptive_dist.coordinator", "RoundOutcome": "adaptive_dist.coordinator",
    "RoundPlan": "adaptive_dist.coordinator", "RoundReport": "adaptive_dist.coordinator",
    "RoundStats": "adaptive_dist.coordinator",
    "DepthPolicy": "adaptive_dist.policy", "depth_policy": "adaptive_dist.policy",
    "ConfigMismatchError": "adaptive_dist.startup", "agree_config": "adaptive_dist.startup",
    "agree_settings": "adaptive_dist.startup", "agree_round_cost": "adaptive_dist.startup",
    "RoundCost": "adaptive_dist.config",
}

__all__ = list(_LAZY)
__version__ = "0.1.0"


import adaptive_dist.policy  # noqa: E402,F401  (registers the built-in policies; no torch)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'adaptive_dist' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
