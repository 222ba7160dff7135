"""The decoder every model shares (``_DecoderDims``: dimensions, RoPE, the checked keys) and the
targets (``LlamaConfig``: Llama, Qwen2, Qwen3, and the MoE targets, whose sparse MLP is
``workers.model.config_moe.MoeSpec``). Part of ``workers.model.config``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from workers.model.config_checks import (
    _architecture,
    _check_bool,
    _check_int,
    _check_keys,
    _check_positive_float,
    _check_token_id,
    _check_unsupported,
)
from workers.model.config_moe import (
    _ARCH_KEYS,
    _MOE_KEYS,
    MIXTRAL_ARCHITECTURE,
    QWEN2_MOE_ARCHITECTURE,
    QWEN3_MOE_ARCHITECTURE,
    MoeSpec,
)
from workers.model.config_rope import RopeScalingType, _rope_from_hf

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
QWEN2_ARCHITECTURE = "Qwen2ForCausalLM"
QWEN3_ARCHITECTURE = "Qwen3ForCausalLM"


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



# keys of every decoder this module reads (their values are parsed or checked)
_DIMS_KEYS = ("architectures", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
              "max_position_embeddings", "head_dim", "rope_theta", "rope_scaling",
              "rope_parameters", "partial_rotary_factor", "hidden_act", "mlp_bias",
              "attention_bias", "use_sliding_window", "sliding_window", "max_window_layers",
              "layer_types", "bos_token_id", "eos_token_id")



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
