"""Model configurations in Hugging Face ``config.json`` layout.

* ``LlamaConfig``: the target — Llama (``LlamaForCausalLM``, Llama-3 RoPE scaling, tied or untied
  embeddings) and the small deltas of Qwen2 (``Qwen2ForCausalLM``: q/k/v biases) and Qwen3
  (``Qwen3ForCausalLM``: RMSNorm of every query and key head; ``head_dim`` explicit), and the
  mixture-of-experts targets (``MoeSpec``): Qwen3-MoE, Mixtral and Qwen2-MoE
  (``Qwen2MoeForCausalLM``: Qwen2's attention, a gated shared expert beside the routed ones).
* ``EagleConfig``: an EAGLE (1/2) head: ``fc([embed; feature]) -> decoder layer(s) -> [norm]``,
  in our own layout (``EagleLlamaHead``) or the EAGLE project's (``LlamaForCausalLM`` or
  ``LlamaForCausalLMEagle`` in a draft directory; ``fc``'s bias, the first layer's input norm and
  the final norm present or not, as the checkpoint's tensors say).
* ``Eagle3Config``: an EAGLE-3 head (``LlamaForCausalLMEagle3``): see ``workers.model.eagle3``.

All are frozen dataclasses validated in ``__post_init__``; every error names the key, the value
and what is allowed. The readers are total: every key of a ``config.json`` (and of its nested
RoPE and ``eagle_config`` dicts) is parsed, or listed in ``IRRELEVANT_KEYS`` as not changing the
forward, or refused by name — a setting this implementation does not compute (another
activation, an MLP bias, sliding windows, a RoPE type, a quantization) never loads a silently
different model. RoPE is read in both layouts (``rope_parameters``, written by transformers 5,
and the older top-level ``rope_theta`` + ``rope_scaling``). See docs/models.md.

One reader per family, each in its own module (this one names them all, so
``from workers.model.config import X`` works for every name):

* ``config_checks``: what every reader shares (value and key checks, ``IRRELEVANT_KEYS``);
* ``config_rope``: RoPE, both layouts and every ``rope_type``;
* ``config_dense``: the decoder every model shares and the targets (``LlamaConfig``);
* ``config_moe``: the MoE targets' sparse MLP (``MoeSpec``);
* ``config_eagle``: EAGLE and EAGLE-3 heads (``EagleConfig``, ``Eagle3Config``);
* ``config_speculators``: EAGLE-3 heads in the speculators library's layout (as vLLM reads it).

A new format lands in a module of its own and is named here.
"""
from __future__ import annotations

from workers.model.config_checks import (
    IRRELEVANT_KEYS,
    _architecture,
    _check_bool,
    _check_fits,
    _check_int,
    _check_keys,
    _check_positive_float,
    _check_token_id,
    _check_unsupported,
)
from workers.model.config_dense import (
    _DIMS_KEYS,
    LLAMA_ARCHITECTURE,
    QWEN2_ARCHITECTURE,
    QWEN3_ARCHITECTURE,
    TARGET_ARCHITECTURES,
    LlamaConfig,
    TargetArchitecture,
    _DecoderDims,
    _dims_kwargs,
    _dims_of,
    _dims_to_hf,
)
from workers.model.config_eagle import (
    EAGLE3_ARCHITECTURE,
    EAGLE3_LAYOUTS,
    EAGLE_ARCHITECTURE,
    EAGLE_PROJECT_ARCHITECTURES,
    DraftConfig,
    Eagle3Config,
    EagleConfig,
    _aux_layer_ids,
)
from workers.model.config_moe import (
    _ARCH_KEYS,
    _MOE_KEYS,
    MIXTRAL_ARCHITECTURE,
    MOE_PARALLEL,
    QWEN2_MOE_ARCHITECTURE,
    QWEN3_MOE_ARCHITECTURE,
    MoeSpec,
)
from workers.model.config_rope import (
    _REFUSED_ROPE_TYPES,
    _ROPE_KEYS,
    LinearRopeScaling,
    RopeScaling,
    RopeScalingType,
    YarnRopeScaling,
    _rope_from_hf,
    _rope_number,
    _rope_scaling_from,
    _yarn_mscale,
)
from workers.model.config_speculators import (
    LLAMA_DEFAULTS,
    SPECULATORS_EAGLE3_ARCHITECTURE,
    eagle3_from_speculators,
    is_speculators_layout,
    to_speculators,
)

__all__ = [
    "IRRELEVANT_KEYS", "LLAMA_ARCHITECTURE", "QWEN2_ARCHITECTURE", "QWEN3_ARCHITECTURE",
    "QWEN3_MOE_ARCHITECTURE", "QWEN2_MOE_ARCHITECTURE", "MIXTRAL_ARCHITECTURE",
    "EAGLE_ARCHITECTURE", "EAGLE_PROJECT_ARCHITECTURES", "EAGLE3_ARCHITECTURE", "EAGLE3_LAYOUTS",
    "SPECULATORS_EAGLE3_ARCHITECTURE", "LLAMA_DEFAULTS", "eagle3_from_speculators",
    "is_speculators_layout", "to_speculators",
    "TARGET_ARCHITECTURES", "TargetArchitecture", "MOE_PARALLEL", "MoeSpec", "RopeScaling",
    "LinearRopeScaling", "YarnRopeScaling", "RopeScalingType", "LlamaConfig", "EagleConfig",
    "Eagle3Config", "DraftConfig",
    # the readers' parts, for the family modules and the tests
    "_DecoderDims", "_DIMS_KEYS", "_MOE_KEYS", "_ARCH_KEYS", "_REFUSED_ROPE_TYPES", "_ROPE_KEYS",
    "_architecture", "_aux_layer_ids", "_check_bool", "_check_fits", "_check_int",
    "_check_keys", "_check_positive_float", "_check_token_id", "_check_unsupported",
    "_dims_kwargs", "_dims_of", "_dims_to_hf", "_rope_from_hf", "_rope_number",
    "_rope_scaling_from", "_yarn_mscale",
]
