"""The model pair of one rank: the target (Llama / Qwen2 / Qwen3), an EAGLE or EAGLE-3 draft
head, the loader.

See ``workers.model.llama`` for the forward/attention API and the features a head consumes,
``workers.model.eagle`` for the head's input pairing, ``workers.model.eagle3`` for EAGLE-3.

Names load on first use (PEP 562, as in `collectives`), so what the command line reads here (the
choices `workers.model.parallel.SCATTERS` and `workers.model.config.MOE_PARALLEL`) comes without
torch; the classes and the loader import it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.model.config import (
        EAGLE3_ARCHITECTURE,
        EAGLE_ARCHITECTURE,
        LLAMA_ARCHITECTURE,
        QWEN2_ARCHITECTURE,
        QWEN3_ARCHITECTURE,
        Eagle3Config,
        EagleConfig,
        LlamaConfig,
    )
    from workers.model.dense_attention import DenseCausalAttention
    from workers.model.eagle import EagleHead
    from workers.model.eagle3 import Eagle3Head
    from workers.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
    from workers.model.llama import FeatureTap, LlamaForCausalLM
    from workers.model.loader import load_eagle, load_llama, read_config, save_pretrained
    from workers.model.parallel import ModelParallel
    from workers.model.weights import CheckpointError

_LAZY = {
    **dict.fromkeys(("EAGLE3_ARCHITECTURE", "EAGLE_ARCHITECTURE", "LLAMA_ARCHITECTURE",
                     "QWEN2_ARCHITECTURE", "QWEN3_ARCHITECTURE", "Eagle3Config", "EagleConfig",
                     "LlamaConfig"), "workers.model.config"),
    "DenseCausalAttention": "workers.model.dense_attention",
    "EagleHead": "workers.model.eagle", "Eagle3Head": "workers.model.eagle3",
    **dict.fromkeys(("ColumnParallelLinear", "RMSNorm", "RowParallelLinear"),
                    "workers.model.layers"),
    "FeatureTap": "workers.model.llama", "LlamaForCausalLM": "workers.model.llama",
    **dict.fromkeys(("load_eagle", "load_llama", "read_config", "save_pretrained"),
                    "workers.model.loader"),
    "ModelParallel": "workers.model.parallel",
    "CheckpointError": "workers.model.weights",
}

__all__ = [
    "EAGLE3_ARCHITECTURE", "EAGLE_ARCHITECTURE", "LLAMA_ARCHITECTURE", "QWEN2_ARCHITECTURE",
    "QWEN3_ARCHITECTURE", "Eagle3Config", "EagleConfig", "LlamaConfig", "DenseCausalAttention",
    "EagleHead", "Eagle3Head", "FeatureTap", "ModelParallel", "ColumnParallelLinear", "RMSNorm",
    "RowParallelLinear", "LlamaForCausalLM", "CheckpointError", "load_eagle", "load_llama",
    "read_config", "save_pretrained",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'workers.model' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
