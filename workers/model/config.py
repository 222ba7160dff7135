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
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
QWEN2_ARCHITECTURE = "Qwen2ForCausalLM"
QWEN3_ARCHITECTURE = "Qwen3ForCausalLM"
QWEN3_MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
QWEN2_MOE_ARCHITECTURE = "Qwen2MoeForCausalLM"
MIXTRAL_ARCHITECTURE = "MixtralForCausalLM"
EAGLE_ARCHITECTURE = "EagleLlamaHead"
EAGLE_PROJECT_ARCHITECTURES = (LLAMA_ARCHITECTURE, "LlamaForCausalLMEagle")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class TargetArchitecture:
    """What a target architecture changes in the Llama decoder."""

    model_type: str
    qkv_bias: bool          # q/k/v projections have biases (Qwen2)
    qk_norm: bool           # RMSNorm over each query and key head before RoPE (Qwen3)
    moe: bool = False       # sparse mixture-of-experts MLPs (``MoeSpec``)


TARGET_ARCHITECTURES = {
    LLAMA_ARCHITECTURE: TargetArchitecture("llama", qkv_bias=False, qk_norm=False),
    QWEN2_ARCHITECTURE: TargetArchitecture("qwen2", qkv_bias=True, qk_norm=False),
    QWEN3_ARCHITECTURE: TargetArchitecture("qwen3", qkv_bias=False, qk_norm=True),
    QWEN3_MOE_ARCHITECTURE: TargetArchitecture("qwen3_moe", qkv_bias=False, qk_norm=True, moe=True),
    MIXTRAL_ARCHITECTURE: TargetArchitecture("mixtral", qkv_bias=False, qk_norm=False, moe=True),
    QWEN2_MOE_ARCHITECTURE: TargetArchitecture("qwen2_moe", qkv_bias=True, qk_norm=False, moe=True),
}


@dataclass(frozen=True)
class MoeSpec:
    """The sparse MLP of a mixture-of-experts target: a router ``gate`` [E, d], softmax over the
    ``num_experts`` logits, the ``top_k`` most probable experts per token (their probabilities
    renormalised to sum to 1 when ``norm_topk_prob``), each expert a SwiGLU of width
    ``expert_size``. Layer ``i`` is sparse when ``(i + 1) % sparse_step == 0`` and ``i`` is not in
    ``dense_layers`` (those keep the dense MLP of ``intermediate_size``).

    ``shared_expert_size`` (Qwen2-MoE's ``shared_expert_intermediate_size``; ``None``: none): every
    sparse layer also runs a SwiGLU shared expert of that width over every token, scaled per token
    by ``sigmoid(shared_expert_gate(x))`` (a ``[1, d]`` linear) and added to the routed output.

    ``names`` is the checkpoint's layout: ``"qwen3_moe"`` (``mlp.gate``,
    ``mlp.experts.{e}.{gate,up,down}_proj``, and for a shared expert ``mlp.shared_expert.*`` and
    ``mlp.shared_expert_gate``; Qwen3-MoE and Qwen2-MoE) or ``"mixtral"``
    (``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1/w3/w2``)."""

    num_experts: int
    top_k: int
    expert_size: int
    norm_topk_prob: bool
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    names: str = "qwen3_moe"
    shared_expert_size: int | None = None

    def __post_init__(self) -> None:
        _check_int("num_experts", self.num_experts)
        _check_int("num_experts_per_tok", self.top_k)
        if self.top_k > self.num_experts:
            raise ValueError(f"config key 'num_experts_per_tok' is {self.top_k}; allowed: at most "
                             f"the number of experts ({self.num_experts})")
        _check_int("moe_intermediate_size", self.expert_size)
        _check_bool("norm_topk_prob", self.norm_topk_prob)
        _check_int("decoder_sparse_step", self.sparse_step)
        for layer in self.dense_layers:
            _check_int("mlp_only_layers", layer, 0)
        if self.names not in ("qwen3_moe", "mixtral"):
            raise ValueError(f"MoE names {self.names!r}; allowed: 'qwen3_moe', 'mixtral'")
        if self.shared_expert_size is not None:
            _check_int("shared_expert_intermediate_size", self.shared_expert_size)
            if self.names != "qwen3_moe":
                raise ValueError("a shared expert is read in the 'qwen3_moe' names only (Qwen2-MoE)")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the sparse MLP."""
        return (layer + 1) % self.sparse_step == 0 and layer not in self.dense_layers

    def check_split(self, mode: str, ranks: int) -> None:
        """Raise ``ValueError`` unless the experts split over ``ranks`` in ``mode``: ``"tp"``
        (every expert's width split) or ``"ep"`` (whole experts per rank). A shared expert's
        width splits over the ranks in both modes, as the dense MLP's does."""
        if mode == "ep" and self.num_experts % ranks:
            raise ValueError(f"expert parallelism over {ranks} ranks needs a number of experts "
                             f"divisible by {ranks}; the checkpoint has {self.num_experts}")
        if mode == "tp" and self.expert_size % ranks:
            raise ValueError(f"config key 'moe_intermediate_size' is {self.expert_size}; expert "
                             f"tensor parallelism over {ranks} ranks needs a multiple of {ranks} "
                             f"(or use --moe-parallel ep)")
        if self.shared_expert_size is not None and self.shared_expert_size % ranks:
            raise ValueError(f"config key 'shared_expert_intermediate_size' is "
                             f"{self.shared_expert_size}; the shared expert's tensor parallelism "
                             f"over {ranks} ranks needs a multiple of {ranks}")
        if mode not in MOE_PARALLEL:
            raise ValueError(f"MoE parallel mode {mode!r}; allowed: {', '.join(MOE_PARALLEL)}")

    @staticmethod
    def from_hf(raw: Mapping[str, Any], arch: str) -> MoeSpec:
        """The MoE fields of a Qwen3-MoE, Qwen2-MoE or Mixtral ``config.json`` (the defaults of
        absent keys are transformers' for that architecture)."""
        if arch == MIXTRAL_ARCHITECTURE:
            if raw.get("sliding_window") is not None:
                raise ValueError(f"config key 'sliding_window' is {raw['sliding_window']!r}; "
                                 f"supported: null (sliding windows are not implemented)")
            return MoeSpec(raw.get("num_local_experts", 8), raw.get("num_experts_per_tok", 2),
                           raw["intermediate_size"], True, names="mixtral")
        both = [k for k in ("num_experts", "num_local_experts") if k in raw]
        if len(both) == 2 and raw["num_experts"] != raw["num_local_experts"]:
            raise ValueError(f"config keys 'num_experts' ({raw['num_experts']}) and "
                             f"'num_local_experts' ({raw['num_local_experts']}) differ")
        if not both or "moe_intermediate_size" not in raw:
            raise ValueError("config.json lacks the MoE keys 'num_experts' (or "
                             "'num_local_experts') and 'moe_intermediate_size'")
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list):
            raise ValueError(f"config key 'mlp_only_layers' is {dense!r}; allowed: a list of layer ids")
        shared, top_k = None, raw.get("num_experts_per_tok", 8)
        if arch == QWEN2_MOE_ARCHITECTURE:
            if "shared_expert_intermediate_size" not in raw:
                raise ValueError("config.json lacks the Qwen2-MoE key "
                                 "'shared_expert_intermediate_size' (the shared expert's width)")
            shared, top_k = raw["shared_expert_intermediate_size"], raw.get("num_experts_per_tok", 4)
        return MoeSpec(raw[both[0]], top_k, raw["moe_intermediate_size"],
                       raw.get("norm_topk_prob", False), raw.get("decoder_sparse_step", 1),
                       tuple(dense), shared_expert_size=shared)

    def to_hf(self) -> dict[str, Any]:
        """The MoE keys of ``config.json``."""
        if self.names == "mixtral":
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.top_k}
        out = {"num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
               "moe_intermediate_size": self.expert_size, "norm_topk_prob": self.norm_topk_prob,
               "decoder_sparse_step": self.sparse_step, "mlp_only_layers": list(self.dense_layers)}
        if self.shared_expert_size is not None:
            out["shared_expert_intermediate_size"] = self.shared_expert_size
        return out


MOE_PARALLEL = ("tp", "ep")    # how a MoE target's experts split (ModelParallel.moe)
# keys of MoE configs read by MoeSpec, or (router training losses, jitter) irrelevant to inference
_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
             "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
             "router_aux_loss_coef", "router_jitter_noise")
# keys only some MoE targets have: Qwen2-MoE's shared expert, and its q/k/v bias switch (checked:
# true, the biases its architecture has)
_ARCH_KEYS = {QWEN2_MOE_ARCHITECTURE: ("shared_expert_intermediate_size", "qkv_bias")}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    rope_type = "llama3"
    attention_factor = 1.0

    def to_hf(self) -> dict[str, Any]:
        """The scaling's ``rope_scaling`` dict as written to ``config.json``."""
        return {"rope_type": self.rope_type, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (``rope_type: "linear"``): every frequency divided by ``factor``."""

    factor: float

    rope_type = "linear"
    attention_factor = 1.0

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": self.rope_type, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (``rope_type: "yarn"``): frequencies blended between interpolated (``/ factor``) and
    original along a linear ramp over the dimensions that rotate between ``beta_slow`` and
    ``beta_fast`` times within ``original_max_position_embeddings``; ``cos``/``sin`` are
    multiplied by ``attention_factor`` (resolved from ``mscale`` / ``mscale_all_dim`` when the
    config does not give it)."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    rope_type = "yarn"

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": self.rope_type, **dataclasses.asdict(self)}


RopeScalingType = RopeScaling | LinearRopeScaling | YarnRopeScaling

# rope types transformers defines that this implementation refuses, and why
_REFUSED_ROPE_TYPES = {
    "dynamic": "it rescales every frequency by the sequence's current length at each forward, so "
               "keys cached at one length would be rotated for another",
    "longrope": "not implemented",
    "proportional": "not implemented",
    "axial": "not implemented",
    "mrope": "multimodal RoPE is not implemented",
    "su": "not implemented",
}
_ROPE_KEYS = {  # keys of a rope dict beside rope_type / type / rope_theta, per supported type
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_number(where: str, raw: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = raw.get(key, default)
    if value is None:
        if default is None:
            raise ValueError(f"config key '{where}.{key}' is missing; needed for rope_type "
                             f"{raw.get('rope_type', raw.get('type'))!r}")
        return default
    _check_positive_float(f"{where}.{key}", value)
    return value


def _rope_scaling_from(where: str, raw: Mapping[str, Any],
                       max_position_embeddings: Any) -> RopeScalingType | None:
    """The scaling a ``rope_scaling`` / ``rope_parameters`` dict names (``None``: plain RoPE);
    ``where`` is the key it came from, for the errors."""
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind in _REFUSED_ROPE_TYPES:
        raise ValueError(f"config key '{where}.rope_type' is {kind!r}: {_REFUSED_ROPE_TYPES[kind]}; "
                         f"supported: {sorted(_ROPE_KEYS)!r}")
    if kind not in _ROPE_KEYS:
        raise ValueError(f"config key '{where}.rope_type' is {kind!r}; supported: "
                         f"{sorted(_ROPE_KEYS)!r}")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *_ROPE_KEYS[kind]}
    for key in raw:
        if key not in known:
            raise ValueError(f"config key '{where}.{key}' is not understood for rope_type {kind!r} "
                             f"(it would change the rotary embedding); understood: {sorted(known)!r}")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config key '{where}.partial_rotary_factor' is "
                         f"{raw['partial_rotary_factor']!r}; supported: 1.0 (every dimension rotated)")
    if kind == "default":
        return None
    if kind == "linear":
        return LinearRopeScaling(float(_rope_number(where, raw, "factor")))
    if kind == "llama3":
        factor, low, high = (float(_rope_number(where, raw, k)) for k in
                             ("factor", "low_freq_factor", "high_freq_factor"))
        original = _rope_number(where, raw, "original_max_position_embeddings", max_position_embeddings)
        _check_int(f"{where}.original_max_position_embeddings", original)
        if not high > low:
            raise ValueError(f"config key '{where}.high_freq_factor' is {high}; allowed: greater "
                             f"than low_freq_factor ({low})")
        return RopeScaling(factor, low, high, int(original))
    original = _rope_number(where, raw, "original_max_position_embeddings", max_position_embeddings)
    _check_int(f"{where}.original_max_position_embeddings", original)
    factor = raw.get("factor")
    factor = float(max_position_embeddings / original if factor is None
                   else _rope_number(where, raw, "factor"))
    attention = raw.get("attention_factor")
    if attention is None:
        mscale, mscale_all = raw.get("mscale"), raw.get("mscale_all_dim")
        for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all)):
            if value is not None:
                _check_positive_float(f"{where}.{key}", value)
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    else:
        _check_positive_float(f"{where}.attention_factor", attention)
    truncate = raw.get("truncate", True)
    _check_bool(f"{where}.truncate", truncate)
    return YarnRopeScaling(factor, int(original), float(attention),
                           float(raw.get("beta_fast") or 32.0), float(raw.get("beta_slow") or 1.0),
                           truncate)


def _rope_from_hf(raw: Mapping[str, Any]) -> tuple[float, RopeScalingType | None]:
    """``(rope_theta, scaling)`` from either layout: transformers 5's ``rope_parameters`` (theta
    inside) or the older top-level ``rope_theta`` + ``rope_scaling``. A value both give must agree."""
    found = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"config key {key!r} is {value!r}; allowed: an object or null")
        if value and all(isinstance(v, dict) for v in value.values()):
            raise ValueError(f"config key {key!r} gives RoPE per layer type {sorted(value)!r}; "
                             f"supported: one RoPE for every layer")
        found[key] = value
    thetas = {k: v["rope_theta"] for k, v in found.items() if "rope_theta" in v}
    if "rope_theta" in raw:
        thetas["rope_theta"] = raw["rope_theta"]
    if len(set(map(repr, thetas.values()))) > 1:
        raise ValueError(f"config gives RoPE theta twice, differently: {thetas}; they must agree")
    theta = next(iter(thetas.values()), 10000.0)
    _check_positive_float("rope_theta", theta)
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config key 'partial_rotary_factor' is {raw['partial_rotary_factor']!r}; "
                         f"supported: 1.0 (every dimension rotated)")
    max_pos = raw.get("max_position_embeddings", 2048)
    scalings = {k: _rope_scaling_from(k, v, max_pos) for k, v in found.items()}
    if len(set(scalings.values())) > 1:
        raise ValueError(f"config keys 'rope_parameters' and 'rope_scaling' describe different "
                         f"RoPE ({found['rope_parameters']} vs {found['rope_scaling']}); they must agree")
    return float(theta), next(iter(scalings.values()), None)


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"config key {name!r} is {value!r}; allowed: an integer >= {minimum}")


def _check_positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"config key {name!r} is {value!r}; allowed: a finite number > 0")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"config key {name!r} is {value!r}; allowed: true or false")


def _check_token_id(name: str, value: Any, vocab_size: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"config key {name!r} is {value!r}; allowed: None or an integer in [0, {vocab_size})")


@dataclass(frozen=True, kw_only=True)
class _DecoderDims:
    """Dimensions shared by the target and the draft heads (validated together).

    ``explicit_head_dim`` is ``config.json``'s ``head_dim`` (Qwen3 sets it apart from
    ``hidden_size / num_attention_heads``); ``head_dim`` is the value in force."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    rope_scaling: RopeScalingType | None = None
    explicit_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            _check_int(name, getattr(self, name))
        _check_positive_float("rms_norm_eps", self.rms_norm_eps)
        _check_positive_float("rope_theta", self.rope_theta)
        if self.explicit_head_dim is not None:
            _check_int("head_dim", self.explicit_head_dim)
        elif self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"config key 'hidden_size' is {self.hidden_size}; allowed: a multiple of "
                f"num_attention_heads ({self.num_attention_heads}), or give head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config key 'num_key_value_heads' is {self.num_key_value_heads}; allowed: a divisor "
                f"of num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim is {self.head_dim}; allowed: even (RoPE rotates pairs)")

    @property
    def head_dim(self) -> int:
        """Per-head dimension: ``head_dim`` when the config gives it, else
        ``hidden_size // num_attention_heads``."""
        if self.explicit_head_dim is not None:
            return self.explicit_head_dim
        return self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether the q/k/v projections have biases."""
        return False

    @property
    def qk_norm(self) -> bool:
        """Whether every query and key head is RMS-normalised before RoPE."""
        return False

    def check_tp(self, attn_tp: int, mlp_tp: int | None = None, dense_mlp: bool = True) -> None:
        """Raise ``ValueError`` unless the heads and KV heads split evenly over ``attn_tp`` ranks
        and (``dense_mlp``: some layer has the dense MLP) the MLP over ``mlp_tp`` ranks (default:
        ``attn_tp``, plain tensor parallelism)."""
        mlp_tp = attn_tp if mlp_tp is None else mlp_tp
        for name, size, what in (("num_attention_heads", attn_tp, "attention"),
                                 ("num_key_value_heads", attn_tp, "attention"),
                                 ("intermediate_size", mlp_tp if dense_mlp else 1, "MLP")):
            value = getattr(self, name)
            if value % size:
                raise ValueError(
                    f"config key {name!r} is {value}; {what} tensor parallelism of {size} needs a "
                    f"multiple of {size}")


def _architecture(raw: Mapping[str, Any], supported: Collection[str]) -> str:
    """The first entry of ``architectures`` this implementation supports."""
    archs = raw.get("architectures")
    if isinstance(archs, list):
        for arch in archs:
            if arch in supported:
                return arch
    raise ValueError(f"unsupported architecture {archs!r} in config.json; supported: "
                     f"{sorted(supported)!r}")


# config.json keys that do not change the forward: bookkeeping, training-time settings and the
# generation defaults older transformers wrote into every config
IRRELEVANT_KEYS = frozenset({
    "_name_or_path", "transformers_version", "model_type", "torch_dtype", "dtype",
    "initializer_range", "use_cache", "pad_token_id", "attention_dropout", "pretraining_tp",
    "auto_map", "_attn_implementation_autoset", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "finetuning_task", "id2label",
    "label2id", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "problem_type", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens",
})
# keys of every decoder this module reads (their values are parsed or checked)
_DIMS_KEYS = ("architectures", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
              "max_position_embeddings", "head_dim", "rope_theta", "rope_scaling",
              "rope_parameters", "partial_rotary_factor", "hidden_act", "mlp_bias",
              "attention_bias", "use_sliding_window", "sliding_window", "max_window_layers",
              "layer_types", "bos_token_id", "eos_token_id")


def _check_keys(raw: Mapping[str, Any], understood: Collection[str], what: str) -> None:
    """Refuse every key of ``raw`` that is neither understood nor listed as irrelevant."""
    unknown = sorted(k for k in raw if k not in understood and k not in IRRELEVANT_KEYS)
    if unknown:
        raise ValueError(f"config key {unknown[0]!r} is not understood by this implementation of "
                         f"{what}: it may change the model's math, so it is refused (unknown keys: "
                         f"{unknown}; the keys known not to change the forward are "
                         f"workers.model.config.IRRELEVANT_KEYS)")


def _check_unsupported(raw: Mapping[str, Any], attention_bias_ok: bool = False) -> None:
    refused = {"hidden_act": "silu", "mlp_bias": False, "use_sliding_window": False}
    if not attention_bias_ok:
        refused["attention_bias"] = False
    for key, allowed in refused.items():
        if key in raw and raw[key] != allowed:
            raise ValueError(f"config key {key!r} is {raw[key]!r}; supported: {allowed!r}")
    layers = raw.get("layer_types")
    if layers is not None and (not isinstance(layers, list)
                               or any(t != "full_attention" for t in layers)):
        raise ValueError(f"config key 'layer_types' is {layers!r}; supported: every layer "
                         f"'full_attention' (sliding windows are not implemented)")


def _dims_kwargs(raw: Mapping[str, Any]) -> dict:
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks required keys {missing}")
    kwargs = {k: raw[k] for k in required}
    kwargs.update({k: raw[k] for k in ("rms_norm_eps", "max_position_embeddings") if k in raw})
    heads = raw.get("num_key_value_heads")
    kwargs["num_key_value_heads"] = heads if heads is not None else raw["num_attention_heads"]
    kwargs["rope_theta"], kwargs["rope_scaling"] = _rope_from_hf(raw)
    head_dim, heads = raw.get("head_dim"), raw["num_attention_heads"]
    derived = raw["hidden_size"] // heads if isinstance(heads, int) and heads > 0 else None
    if head_dim is not None and (head_dim != derived or raw["hidden_size"] % heads):
        kwargs["explicit_head_dim"] = head_dim  # a head_dim equal to the derived one is no news
    return kwargs


def _dims_to_hf(cfg: _DecoderDims) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(_DecoderDims) if f.name != "explicit_head_dim"]
    out: dict[str, Any] = {name: getattr(cfg, name) for name in names}
    out["rope_scaling"] = cfg.rope_scaling.to_hf() if cfg.rope_scaling else None
    out.update(hidden_act="silu", mlp_bias=False, head_dim=cfg.head_dim, torch_dtype="bfloat16")
    return out


def _dims_of(cfg: _DecoderDims) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(_DecoderDims)}


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(_DecoderDims):
    """The target model: a Llama decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), or
    the Qwen2 / Qwen3 variant named by ``architecture``."""

    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    architecture: str = LLAMA_ARCHITECTURE
    moe: MoeSpec | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bool("tie_word_embeddings", self.tie_word_embeddings)
        if self.architecture not in TARGET_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r}; supported: "
                             f"{sorted(TARGET_ARCHITECTURES)!r}")
        if TARGET_ARCHITECTURES[self.architecture].moe != (self.moe is not None):
            raise ValueError(f"architecture {self.architecture!r} "
                             f"{'needs' if self.moe is None else 'has no'} a MoE spec")
        _check_token_id("bos_token_id", self.bos_token_id, self.vocab_size)
        for eos in self.eos_token_ids:
            _check_token_id("eos_token_id", eos, self.vocab_size)

    @property
    def qkv_bias(self) -> bool:
        return TARGET_ARCHITECTURES[self.architecture].qkv_bias

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the MoE MLP."""
        return self.moe is not None and self.moe.is_sparse(layer)

    def check_tp(self, attn_tp: int, mlp_tp: int | None = None, dense_mlp: bool = True,
                 moe_parallel: str = "tp") -> None:
        """As ``_DecoderDims.check_tp``; a MoE target's experts split as ``moe_parallel`` says
        (``MoeSpec.check_split``) and its dense MLP checked only if some layer has one."""
        mlp_tp = attn_tp if mlp_tp is None else mlp_tp
        if self.moe is not None:
            self.moe.check_split(moe_parallel, mlp_tp)
            dense_mlp = any(not self.is_sparse(i) for i in range(self.num_hidden_layers))
        super().check_tp(attn_tp, mlp_tp, dense_mlp)

    @property
    def qk_norm(self) -> bool:
        return TARGET_ARCHITECTURES[self.architecture].qk_norm

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids as a tuple (``config.json`` may give one id or a list)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int) and not isinstance(self.eos_token_id, bool):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @staticmethod
    def from_hf(raw: Mapping[str, Any]) -> LlamaConfig:
        """Build from a parsed Hugging Face ``config.json``; ``ValueError`` on anything unsupported."""
        arch = _architecture(raw, TARGET_ARCHITECTURES)
        moe = TARGET_ARCHITECTURES[arch].moe
        _check_keys(raw, (*_DIMS_KEYS, "tie_word_embeddings", *(_MOE_KEYS if moe else ()),
                          *_ARCH_KEYS.get(arch, ())), f"the target {arch}")
        kwargs = _dims_kwargs(raw)
        if moe:
            kwargs["moe"] = MoeSpec.from_hf(raw, arch)
        if raw.get("qkv_bias", True) is not True:
            raise ValueError(f"config key 'qkv_bias' is {raw['qkv_bias']!r}; supported: true "
                             f"(the q/k/v biases of {arch})")
        _check_unsupported(raw, attention_bias_ok=TARGET_ARCHITECTURES[arch].qkv_bias)
        for key in ("tie_word_embeddings", "bos_token_id"):
            if key in raw:
                kwargs[key] = raw[key]
        eos = raw.get("eos_token_id")
        kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos
        return LlamaConfig(**kwargs, architecture=arch)

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict (weights are written in bfloat16)."""
        out = _dims_to_hf(self)
        out.update(architectures=[self.architecture],
                   model_type=TARGET_ARCHITECTURES[self.architecture].model_type,
                   tie_word_embeddings=self.tie_word_embeddings, bos_token_id=self.bos_token_id,
                   eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                   else self.eos_token_id)
        if not self.qkv_bias:
            out["attention_bias"] = False
        if self.moe is not None:
            out.update(self.moe.to_hf())
        return out


def _check_fits(key: str, mine: int, theirs: int, their_key: Optional[str] = None) -> None:
    if mine != theirs:
        raise ValueError(f"draft config key {key!r} is {mine}; allowed: the target's "
                         f"{their_key or key} ({theirs})")


@dataclass(frozen=True, kw_only=True)
class EagleConfig(_DecoderDims):
    """An EAGLE (1/2) draft head: ``fc([embed; feature]) -> num_hidden_layers decoder layers
    -> norm``.

    Its dimensions are the decoder layer's; ``hidden_size`` and ``vocab_size`` must equal the
    target's (the head shares the target's embedding and LM head). ``layout`` is ``"own"``
    (``EagleLlamaHead``: ``fc_bias`` from the config, every norm present) or ``"eagle"`` (the
    EAGLE project's: ``fc_bias``, ``first_input_norm``, ``final_norm`` and ``attention_qkv_bias``
    say which of ``fc.bias``, ``layers.0.input_layernorm.weight``, ``norm.weight`` and
    ``layers.0.self_attn.{q,k,v}_proj.bias`` (its heads for Qwen2 targets) the checkpoint holds;
    a head without the final norm hands its output to the target's LM head as it is).
    """

    num_hidden_layers: int = 1
    fc_bias: bool = True
    layout: str = "own"
    first_input_norm: bool = True
    final_norm: bool = True
    attention_qkv_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("fc_bias", "first_input_norm", "final_norm", "attention_qkv_bias"):
            _check_bool(key, getattr(self, key))
        if self.layout not in ("own", "eagle"):
            raise ValueError(f"EAGLE layout {self.layout!r}; allowed: 'own', 'eagle'")
        if self.layout == "own" and (not (self.first_input_norm and self.final_norm)
                                     or self.attention_qkv_bias):
            raise ValueError("an EagleLlamaHead has every norm and no attention bias; other heads "
                             "are in the EAGLE project's layout (layout='eagle')")

    @property
    def qkv_bias(self) -> bool:
        """Whether the head's q/k/v projections have biases (``attention_qkv_bias``)."""
        return self.attention_qkv_bias

    @staticmethod
    def for_target(target: LlamaConfig, **overrides: Any) -> EagleConfig:
        """A one-layer head with the target's dimensions (``overrides`` replace fields)."""
        base = _dims_of(target)
        base.update(num_hidden_layers=1)
        base.update(overrides)
        return EagleConfig(**base)

    def check_target(self, target: LlamaConfig) -> None:
        """Raise ``ValueError`` unless this head fits ``target`` (hidden size and vocabulary)."""
        for key in ("hidden_size", "vocab_size"):
            _check_fits(key, getattr(self, key), getattr(target, key))

    @staticmethod
    def from_hf(raw: Mapping[str, Any], tensor_names: Collection[str] = ()) -> EagleConfig:
        """Build from a parsed ``config.json`` of an EAGLE head (``tensor_names``: the checkpoint's
        tensors, which decide the optional parts of the EAGLE project's layout)."""
        arch = _architecture(raw, (EAGLE_ARCHITECTURE, *EAGLE_PROJECT_ARCHITECTURES))
        # the EAGLE project's `bias` says whether fc has one: the tensors decide, as for the norms
        _check_keys(raw, (*_DIMS_KEYS, "fc_bias" if arch == EAGLE_ARCHITECTURE else "bias",
                          "tie_word_embeddings"), f"an EAGLE head ({arch})")
        kwargs = _dims_kwargs(raw)
        _check_unsupported(raw, attention_bias_ok=arch != EAGLE_ARCHITECTURE)  # tensors decide
        if arch == EAGLE_ARCHITECTURE:
            return EagleConfig(**kwargs, fc_bias=raw.get("fc_bias", True))
        names = set(tensor_names)
        return EagleConfig(**kwargs, layout="eagle", fc_bias="fc.bias" in names,
                           first_input_norm="layers.0.input_layernorm.weight" in names,
                           final_norm="norm.weight" in names,
                           attention_qkv_bias=any(f"layers.0.self_attn.{p}_proj.bias" in names
                                                  for p in "qkv"))

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict of the head."""
        out = _dims_to_hf(self)
        out["attention_bias"] = self.attention_qkv_bias
        if self.layout == "own":
            out.update(architectures=[EAGLE_ARCHITECTURE], model_type="eagle_llama_head",
                       fc_bias=self.fc_bias)
        else:  # the EAGLE project writes a Llama config (its optional parts live in the tensors)
            out.update(architectures=[LLAMA_ARCHITECTURE], model_type="llama", bias=self.fc_bias)
        return out


@dataclass(frozen=True, kw_only=True)
class Eagle3Config(_DecoderDims):
    """An EAGLE-3 draft head (see ``workers.model.eagle3``).

    ``draft_vocab_size``: rows of its own LM head (mapped to target ids by ``d2t``);
    ``aux_layer_ids``: ``eagle_config.eagle_aux_hidden_state_layer_ids`` as the config gives them
    (id ``k`` names the output of target layer ``k``, i.e. the residual entering layer ``k + 1``;
    ``None``: the residual entering layers ``2``, ``L // 2`` and ``L - 3``);
    ``target_hidden_size``: the width of each target hidden state ``fc`` takes (default
    ``hidden_size``); ``fc_bias`` / ``own_embedding``: whether the checkpoint holds ``fc.bias`` /
    ``embed_tokens.weight`` (without it the head uses the target's embedding);
    ``norm_before_residual``: the midlayer's residual is the normed hidden state
    (``hidden_norm(hidden)``) instead of the hidden state itself.

    The captured states are concatenated in layer order, whatever order the config lists them in
    (as SGLang and vLLM capture them during the target's forward).
    """

    num_hidden_layers: int = 1
    draft_vocab_size: int
    aux_layer_ids: Optional[tuple[int, ...]] = None
    target_hidden_size: Optional[int] = None
    fc_bias: bool = False
    own_embedding: bool = False
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_hidden_layers != 1:
            raise ValueError(f"config key 'num_hidden_layers' is {self.num_hidden_layers!r}; "
                             f"allowed: 1 (an EAGLE-3 head has one midlayer)")
        _check_int("draft_vocab_size", self.draft_vocab_size)
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"config key 'draft_vocab_size' is {self.draft_vocab_size}; allowed: "
                             f"at most vocab_size ({self.vocab_size})")
        if self.target_hidden_size is not None:
            _check_int("target_hidden_size", self.target_hidden_size)
        for key in ("fc_bias", "own_embedding", "norm_before_residual"):
            _check_bool(key, getattr(self, key))
        if self.aux_layer_ids is not None and (
                len(self.aux_layer_ids) != 3 or len(set(self.aux_layer_ids)) != 3 or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in self.aux_layer_ids)):
            raise ValueError(f"config key 'eagle_config.eagle_aux_hidden_state_layer_ids' is "
                             f"{list(self.aux_layer_ids)!r}; allowed: three distinct layer ids")

    @property
    def fused_width(self) -> int:
        """Width of ``fc``'s input: three target hidden states."""
        return 3 * (self.target_hidden_size or self.hidden_size)

    def capture_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose entering residual stream ``fc`` fuses, in layer order (index
        ``L``: after the last layer, before the final norm)."""
        n = num_target_layers
        # listed ids in layer order (as SGLang and vLLM capture them); the default is in layer
        # order already from 7 layers on (smaller test targets keep it as written)
        layers = ((2, n // 2, n - 3) if self.aux_layer_ids is None
                  else tuple(sorted(k + 1 for k in self.aux_layer_ids)))
        if not all(0 <= i <= n for i in layers):
            given = ("the default (2, L//2, L-3)" if self.aux_layer_ids is None
                     else f"eagle_config.eagle_aux_hidden_state_layer_ids "
                          f"{list(self.aux_layer_ids)}")
            raise ValueError(f"EAGLE-3 layers to capture {list(layers)} (from {given}) are outside "
                             f"the target's {n} layers; allowed: layer ids in [-1, {n - 1}]")
        return layers

    def check_target(self, target: LlamaConfig) -> None:
        """Raise ``ValueError`` unless this head fits ``target``."""
        _check_fits("hidden_size", self.hidden_size, target.hidden_size)
        _check_fits("vocab_size", self.vocab_size, target.vocab_size)
        if self.target_hidden_size is not None:
            _check_fits("target_hidden_size", self.target_hidden_size, target.hidden_size,
                        "hidden_size")
        self.capture_layers(target.num_hidden_layers)

    @staticmethod
    def for_target(target: LlamaConfig, draft_vocab_size: int, **overrides: Any) -> Eagle3Config:
        """A head with the target's dimensions (``overrides`` replace fields)."""
        base = _dims_of(target)
        base.update(num_hidden_layers=1, draft_vocab_size=draft_vocab_size, explicit_head_dim=None)
        base.update(overrides)
        return Eagle3Config(**base)

    @staticmethod
    def from_hf(raw: Mapping[str, Any], tensor_names: Collection[str] = ()) -> Eagle3Config:
        """Build from a parsed ``config.json`` (``tensor_names``: the checkpoint's tensors).

        The aux layer ids are read from the top level first, then from ``eagle_config`` (as vLLM
        reads them); both present and different is refused."""
        _architecture(raw, (EAGLE3_ARCHITECTURE,))
        _check_keys(raw, (*_DIMS_KEYS, "draft_vocab_size", "eagle_config", "target_hidden_size",
                          "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
                          "tie_word_embeddings"), f"an EAGLE-3 head ({EAGLE3_ARCHITECTURE})")
        kwargs = _dims_kwargs(raw)
        _check_unsupported(raw)
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError(f"config key 'eagle_config' is {eagle!r}; allowed: an object")
        for key in eagle:
            if key not in ("eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"):
                raise ValueError(f"config key 'eagle_config.{key}' is not understood by this "
                                 f"implementation of an EAGLE-3 head (it may change the math); "
                                 f"understood: ['eagle_aux_hidden_state_layer_ids', "
                                 f"'use_aux_hidden_state']")
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ValueError(f"config key 'eagle_config.use_aux_hidden_state' is "
                             f"{eagle['use_aux_hidden_state']!r}; supported: true (the head fuses "
                             f"three target layers)")
        ids = _aux_layer_ids(raw.get("eagle_aux_hidden_state_layer_ids"),
                             eagle.get("eagle_aux_hidden_state_layer_ids"))
        names = set(tensor_names)
        return Eagle3Config(**kwargs, draft_vocab_size=raw.get("draft_vocab_size", raw["vocab_size"]),
                            aux_layer_ids=ids, target_hidden_size=raw.get("target_hidden_size"),
                            norm_before_residual=raw.get("norm_before_residual", False),
                            fc_bias="fc.bias" in names, own_embedding="embed_tokens.weight" in names)

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict of the head, in the EAGLE-3 layout."""
        out = _dims_to_hf(self)
        out.update(architectures=[EAGLE3_ARCHITECTURE], model_type="llama", attention_bias=False,
                   draft_vocab_size=self.draft_vocab_size)
        if self.aux_layer_ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        if self.target_hidden_size is not None:
            out["target_hidden_size"] = self.target_hidden_size
        if self.norm_before_residual:
            out["norm_before_residual"] = True
        return out


def _aux_layer_ids(top: Any, nested: Any) -> tuple[int, ...] | None:
    """The EAGLE-3 aux layer ids from the top-level key or ``eagle_config``'s."""
    for key, ids in (("eagle_aux_hidden_state_layer_ids", top),
                     ("eagle_config.eagle_aux_hidden_state_layer_ids", nested)):
        if ids is not None and not isinstance(ids, list):
            raise ValueError(f"config key {key!r} is {ids!r}; allowed: a list of three layer ids")
    if top is not None and nested is not None and top != nested:
        raise ValueError(f"config keys 'eagle_aux_hidden_state_layer_ids' ({top}) and "
                         f"'eagle_config.eagle_aux_hidden_state_layer_ids' ({nested}) differ; "
                         f"give one, or the same ids in both")
    ids = top if top is not None else nested
    return tuple(ids) if ids is not None else None


DraftConfig = EagleConfig | Eagle3Config
