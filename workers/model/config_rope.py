"""RoPE in ``config.json``: both layouts (transformers 5's ``rope_parameters`` with the theta
inside, the older top-level ``rope_theta`` + ``rope_scaling``), every key of the dict checked
against its ``rope_type``, the types this implementation does not compute refused by name. Part of
``workers.model.config``."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from workers.model.config_checks import _check_bool, _check_int, _check_positive_float


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

