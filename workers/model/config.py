"""Model configurations in Hugging Face ``config.json`` layout.

``LlamaConfig`` describes the target (``architectures: ["LlamaForCausalLM"]``),
``EagleConfig`` the EAGLE draft head (``architectures: ["EagleLlamaHead"]``). Both are
frozen dataclasses validated in ``__post_init__``; every error names the key, the value
and what is allowed. Unknown keys in a ``config.json`` are ignored, as Hugging Face does;
keys whose values would change the math and that this implementation does not support
(biases, another activation, an unknown RoPE scaling) are refused.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
EAGLE_ARCHITECTURE = "EagleLlamaHead"


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (``rope_scaling.rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @staticmethod
    def from_hf(raw: Mapping[str, Any] | None) -> RopeScaling | None:
        """Parse ``rope_scaling``; ``None`` means plain RoPE."""
        if raw is None:
            return None
        kind = raw.get("rope_type", raw.get("type"))
        if kind == "default":
            return None
        if kind != "llama3":
            raise ValueError(
                f"config key 'rope_scaling.rope_type' is {kind!r}; supported: None, 'default', 'llama3'")
        try:
            return RopeScaling(float(raw["factor"]), float(raw["low_freq_factor"]),
                               float(raw["high_freq_factor"]),
                               int(raw["original_max_position_embeddings"]))
        except KeyError as err:
            raise ValueError(f"config key 'rope_scaling' lacks {err.args[0]!r} (needed for llama3)") from None

    def to_hf(self) -> dict[str, Any]:
        """``rope_scaling`` dict as written to ``config.json``."""
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"config key {name!r} is {value!r}; allowed: an integer >= {minimum}")


def _check_positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"config key {name!r} is {value!r}; allowed: a finite number > 0")


def _check_token_id(name: str, value: Any, vocab_size: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"config key {name!r} is {value!r}; allowed: None or an integer in [0, {vocab_size})")


@dataclass(frozen=True, kw_only=True)
class _DecoderDims:
    """Dimensions shared by the target and the draft head (validated together)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            _check_int(name, getattr(self, name))
        _check_positive_float("rms_norm_eps", self.rms_norm_eps)
        _check_positive_float("rope_theta", self.rope_theta)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"config key 'hidden_size' is {self.hidden_size}; allowed: a multiple of "
                f"num_attention_heads ({self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config key 'num_key_value_heads' is {self.num_key_value_heads}; allowed: a divisor "
                f"of num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim (hidden_size / num_attention_heads) is {self.head_dim}; allowed: even")

    @property
    def head_dim(self) -> int:
        """Per-head dimension: ``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    def check_tp(self, attn_tp: int, mlp_tp: int | None = None) -> None:
        """Raise ``ValueError`` unless the heads and KV heads split evenly over ``attn_tp`` ranks
        and the MLP over ``mlp_tp`` ranks (default: ``attn_tp``, plain tensor parallelism)."""
        mlp_tp = attn_tp if mlp_tp is None else mlp_tp
        for name, size, what in (("num_attention_heads", attn_tp, "attention"),
                                 ("num_key_value_heads", attn_tp, "attention"),
                                 ("intermediate_size", mlp_tp, "MLP")):
            value = getattr(self, name)
            if value % size:
                raise ValueError(
                    f"config key {name!r} is {value}; {what} tensor parallelism of {size} needs a "
                    f"multiple of {size}")


_UNSUPPORTED = {  # key -> the only value this implementation computes correctly
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


def _check_architecture(raw: Mapping[str, Any], expected: str) -> None:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or expected not in archs:
        raise ValueError(
            f"unsupported architecture {archs!r} in config.json; supported: [{expected!r}]")


def _check_unsupported(raw: Mapping[str, Any]) -> None:
    for key, allowed in _UNSUPPORTED.items():
        if key in raw and raw[key] != allowed:
            raise ValueError(f"config key {key!r} is {raw[key]!r}; supported: {allowed!r}")
    if "head_dim" in raw and raw["head_dim"] is not None:
        derived = raw.get("hidden_size", 0) // max(1, raw.get("num_attention_heads", 1))
        if raw["head_dim"] != derived:
            raise ValueError(
                f"config key 'head_dim' is {raw['head_dim']!r}; supported: hidden_size / "
                f"num_attention_heads ({derived})")


def _dims_kwargs(raw: Mapping[str, Any], required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks required keys {missing}")
    kwargs = {k: raw[k] for k in required}
    kwargs.update({k: raw[k] for k in optional if k in raw})
    if "num_key_value_heads" not in raw or raw["num_key_value_heads"] is None:
        kwargs["num_key_value_heads"] = raw["num_attention_heads"]
    kwargs["rope_scaling"] = RopeScaling.from_hf(raw.get("rope_scaling"))
    return kwargs


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL = ("num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(_DecoderDims):
    """The target model: a Llama decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"config key 'tie_word_embeddings' is {self.tie_word_embeddings!r}; allowed: true or false")
        _check_token_id("bos_token_id", self.bos_token_id, self.vocab_size)
        for eos in self.eos_token_ids:
            _check_token_id("eos_token_id", eos, self.vocab_size)

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
        _check_architecture(raw, LLAMA_ARCHITECTURE)
        kwargs = _dims_kwargs(raw, _REQUIRED, _OPTIONAL)
        _check_unsupported(raw)
        for key in ("tie_word_embeddings", "bos_token_id"):
            if key in raw:
                kwargs[key] = raw[key]
        eos = raw.get("eos_token_id")
        kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos
        return LlamaConfig(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict (weights are written in bfloat16)."""
        out = _dims_to_hf(self)
        out.update(architectures=[LLAMA_ARCHITECTURE], model_type="llama",
                   tie_word_embeddings=self.tie_word_embeddings, bos_token_id=self.bos_token_id,
                   eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                   else self.eos_token_id)
        return out


def _dims_to_hf(cfg: _DecoderDims) -> dict[str, Any]:
    out: dict[str, Any] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(_DecoderDims)}
    out["rope_scaling"] = cfg.rope_scaling.to_hf() if cfg.rope_scaling else None
    out.update(hidden_act="silu", attention_bias=False, mlp_bias=False, head_dim=cfg.head_dim,
               torch_dtype="bfloat16")
    return out


@dataclass(frozen=True, kw_only=True)
class EagleConfig(_DecoderDims):
    """The EAGLE draft head: ``fc([embed; feature]) -> num_hidden_layers decoder layers -> norm``.

    Its dimensions are the decoder layer's; ``hidden_size`` and ``vocab_size`` must equal the
    target's (the head shares the target's embedding and LM head). ``fc_bias`` says whether
    ``fc`` has a bias (the EAGLE paper's head does).
    """

    num_hidden_layers: int = 1
    fc_bias: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.fc_bias, bool):
            raise ValueError(f"config key 'fc_bias' is {self.fc_bias!r}; allowed: true or false")

    @staticmethod
    def for_target(target: LlamaConfig, **overrides: Any) -> EagleConfig:
        """A one-layer head with the target's dimensions (``overrides`` replace fields)."""
        base = {f.name: getattr(target, f.name) for f in dataclasses.fields(_DecoderDims)}
        base.update(num_hidden_layers=1)
        base.update(overrides)
        return EagleConfig(**base)

    def check_target(self, target: LlamaConfig) -> None:
        """Raise ``ValueError`` unless this head fits ``target`` (hidden size and vocabulary)."""
        for key in ("hidden_size", "vocab_size"):
            mine, theirs = getattr(self, key), getattr(target, key)
            if mine != theirs:
                raise ValueError(
                    f"EAGLE config key {key!r} is {mine}; allowed: the target's {key} ({theirs})")

    @staticmethod
    def from_hf(raw: Mapping[str, Any]) -> EagleConfig:
        """Build from a parsed ``config.json`` of an EAGLE head; ``ValueError`` on anything unsupported."""
        _check_architecture(raw, EAGLE_ARCHITECTURE)
        kwargs = _dims_kwargs(raw, _REQUIRED, _OPTIONAL)
        _check_unsupported(raw)
        kwargs["fc_bias"] = raw.get("fc_bias", True)
        return EagleConfig(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict of the head."""
        out = _dims_to_hf(self)
        out.update(architectures=[EAGLE_ARCHITECTURE], model_type="eagle_llama_head",
                   fc_bias=self.fc_bias)
        return out
