"""adaptive_dist: adaptive speculative-decoding depth that is safe on DP/TP attention clusters."""
from adaptive_dist.config import AdaptiveConfig, ConfigError, load_config
from adaptive_dist.controller import AdaptiveController, RoundOutcome, RoundPlan
from adaptive_dist.startup import ConfigMismatchError, agree_config

__all__ = [
    "AdaptiveConfig", "ConfigError", "load_config", "AdaptiveController", "RoundOutcome",
    "RoundPlan", "ConfigMismatchError", "agree_config",
]
__version__ = "0.1.0"
