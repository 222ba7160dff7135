"""The model pair of one rank: Llama target, EAGLE draft head, loader.

See ``workers.model.llama`` for the forward/attention API and which hidden state is the EAGLE
feature, ``workers.model.eagle`` for the head's input pairing.
"""
from workers.model.config import EAGLE_ARCHITECTURE, LLAMA_ARCHITECTURE, EagleConfig, LlamaConfig
from workers.model.dense_attention import DenseCausalAttention
from workers.model.eagle import EagleHead
from workers.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from workers.model.parallel import ModelParallel
from workers.model.llama import LlamaForCausalLM
from workers.model.loader import CheckpointError, load_eagle, load_llama, read_config, save_pretrained

__all__ = [
    "EAGLE_ARCHITECTURE", "LLAMA_ARCHITECTURE", "EagleConfig", "LlamaConfig", "DenseCausalAttention",
    "EagleHead", "ModelParallel", "ColumnParallelLinear", "RMSNorm", "RowParallelLinear",
    "LlamaForCausalLM", "CheckpointError", "load_eagle", "load_llama", "read_config", "save_pretrained",
]
