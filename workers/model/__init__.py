"""The model pair of one rank: the target (Llama / Qwen2 / Qwen3), an EAGLE or EAGLE-3 draft
head, the loader.

See ``workers.model.llama`` for the forward/attention API and the features a head consumes,
``workers.model.eagle`` for the head's input pairing, ``workers.model.eagle3`` for EAGLE-3.
"""
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
from workers.model.parallel import ModelParallel
from workers.model.llama import FeatureTap, LlamaForCausalLM
from workers.model.loader import load_eagle, load_llama, read_config, save_pretrained
from workers.model.weights import CheckpointError

__all__ = [
    "EAGLE3_ARCHITECTURE", "EAGLE_ARCHITECTURE", "LLAMA_ARCHITECTURE", "QWEN2_ARCHITECTURE",
    "QWEN3_ARCHITECTURE", "Eagle3Config", "EagleConfig", "LlamaConfig", "DenseCausalAttention",
    "EagleHead", "Eagle3Head", "FeatureTap", "ModelParallel", "ColumnParallelLinear", "RMSNorm",
    "RowParallelLinear", "LlamaForCausalLM", "CheckpointError", "load_eagle", "load_llama",
    "read_config", "save_pretrained",
]
