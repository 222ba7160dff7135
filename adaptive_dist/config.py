"""The adaptive layer's configuration: one frozen dataclass, strict validation, a stable hash.

Every key, its default and what is allowed is listed in ``FIELDS`` docs below; a JSON file may set
any subset. Validation errors name the key, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REDUCERS = ("weighted_mean", "min", "max")
FLOAT_KEYS = ("ema_alpha", "up_hysteresis", "down_hysteresis")
HYSTERESIS_LIMIT = 1000.0
POLICIES = ("static", "ema")


class ConfigError(ValueError):
    """A configuration value or file is not acceptable; the message names key, value, allowed."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Policy and consensus settings (rules in docs/policy.md; the ladder is SGLang-compatible)."""

    policy: str = "ema"
    """``ema`` (adaptive: the EMA ladder) or ``static`` (stay at ``initial_steps``)."""
    candidate_steps: tuple[int, ...] = (1, 3, 7)
    """Draft depths the policy may choose; sorted ascending, at least two distinct, each >= 1."""
    initial_steps: int = 3
    """Depth in force at start; must be one of ``candidate_steps``."""
    ema_alpha: float = 0.2
    """EMA weight of the newest round, in (0, 1]."""
    warmup_batches: int = 10
    """Counted rounds before the first decision point (>= 0)."""
    update_interval: int = 5
    """Counted rounds between decision points (>= 1)."""
    up_hysteresis: float = 0.0
    """Added to the rise threshold ``c[i] - 0.5``."""
    down_hysteresis: float = -0.25
    """Added to the drop threshold ``c[i-1] - 0.5``."""
    min_dwell_rounds: int = 0
    """No switch within this many counted rounds of the previous switch: a switch at counted
    round c needs c - (counted round of the last switch) >= min_dwell_rounds (>= 0)."""
    reducer: str = "weighted_mean"
    """How ranks' EMAs combine: ``weighted_mean``, ``min`` or ``max``."""
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Padded batch sizes that have CUDA graphs; a larger cluster-wide batch runs eager."""
    lockstep_check_every: int = 16
    """Rounds between lockstep hash checks across ranks (>= 1)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidate_steps",
                           _as_int_tuple("candidate_steps", self.candidate_steps, minimum=0))
        object.__setattr__(self, "graph_buckets", _as_int_tuple("graph_buckets", self.graph_buckets))
        for key in FLOAT_KEYS:  # 0 and 0.0 are the same setting and must hash the same
            v = getattr(self, key)
            if _is_number(v):
                object.__setattr__(self, key, float(v))
        _validate(self)

    # ---- derived -----------------------------------------------------------------------------
    @property
    def initial_index(self) -> int:
        return self.candidate_steps.index(self.initial_steps)

    @property
    def adaptive(self) -> bool:
        """Whether the policy may change the depth."""
        return self.policy != "static"

    @property
    def tiers(self) -> tuple[int, ...]:
        """The depths a run may use: every candidate when adaptive, else ``initial_steps``."""
        return self.candidate_steps if self.adaptive else (self.initial_steps,)

    @property
    def max_steps(self) -> int:
        """The deepest tier a run may use (what buffers and KV reservations are sized for)."""
        return max(self.tiers)

    # ---- I/O ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "AdaptiveConfig":
        """Build from a dict (a parsed JSON file); unknown keys are refused by name."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(repr(k) for k in unknown)}; "
                f"allowed keys: {', '.join(sorted(known))}"
            )
        try:
            return cls(**data)
        except ConfigError as exc:
            if source == "config":
                raise
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "AdaptiveConfig":
        """Build from a JSON file (errors name the file)."""
        return cls.from_dict(read_config_file(path), source=f"config file {str(path)!r}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["candidate_steps"] = list(self.candidate_steps)
        d["graph_buckets"] = list(self.graph_buckets)
        return d

    def digest(self) -> str:
        """A stable hash of the effective configuration (hex, 16 chars)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> "AdaptiveConfig":
        return dataclasses.replace(self, **changes)


def read_config_file(path: str | Path) -> dict:
    """The JSON object in ``path``; ``ConfigError`` naming the file when it is unreadable."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file {str(p)!r} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a JSON object, got {type(data).__name__}")
    return data


def _as_int_tuple(key: str, value: Any, minimum: int = 1) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{key}={value!r}: must be a non-empty list of integers")
    for v in value:
        if not _is_int(v) or v < minimum:
            raise ConfigError(f"{key}={list(value)!r}: every entry must be an integer >= "
                              f"{minimum}, got {v!r}")
    return tuple(sorted(set(value)))


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {allowed}")


def _validate(c: AdaptiveConfig) -> None:
    _check(c.policy in POLICIES, "policy", c.policy, f"allowed: {', '.join(POLICIES)}")
    _check(len(c.candidate_steps) >= 2, "candidate_steps", list(c.candidate_steps),
           "needs at least two distinct candidates (duplicates removed)")
    _check(c.candidate_steps[0] > 0 or not c.adaptive, "candidate_steps", list(c.candidate_steps),
           "0 (no speculation) is a candidate of the static policy only: an adaptive policy "
           "has no acceptance signal at depth 0")
    _check(_is_int(c.initial_steps), "initial_steps", c.initial_steps, "must be an integer")
    _check(c.initial_steps in c.candidate_steps, "initial_steps", c.initial_steps,
           f"must be one of candidate_steps {list(c.candidate_steps)}")
    _check(_is_number(c.ema_alpha) and 0 < c.ema_alpha <= 1, "ema_alpha", c.ema_alpha,
           "must be a number in (0, 1]")
    for key in ("warmup_batches", "min_dwell_rounds"):
        v = getattr(c, key)
        _check(_is_int(v) and v >= 0, key, v, "must be an integer >= 0")
    for key in ("update_interval", "lockstep_check_every"):
        v = getattr(c, key)
        _check(_is_int(v) and v >= 1, key, v, "must be an integer >= 1")
    for key in ("up_hysteresis", "down_hysteresis"):
        v = getattr(c, key)
        _check(_is_number(v) and -HYSTERESIS_LIMIT < v < HYSTERESIS_LIMIT, key, v,
               f"must be a finite number in ({-HYSTERESIS_LIMIT:g}, {HYSTERESIS_LIMIT:g})")
    _check(c.reducer in REDUCERS, "reducer", c.reducer, f"allowed: {', '.join(REDUCERS)}")


def load_config(
    path: Optional[str], policy: str = "ema", initial_steps: Optional[int] = None
) -> AdaptiveConfig:
    """The effective configuration for a run of ``policy``.

    A config file with the static policy is refused: the file would silently do nothing.
    ``initial_steps`` overrides the file; a static run may use any depth (it becomes a candidate
    that is never left).
    """
    if policy not in POLICIES:
        raise ConfigError(f"policy={policy!r}: allowed: {', '.join(POLICIES)}")
    if path is not None and policy == "static":
        raise ConfigError(
            f"--config {path!r} was given but adaptive mode is off (static policy); "
            f"a config file only applies to the adaptive policy"
        )
    if path is None:
        cfg = AdaptiveConfig(policy=policy)
    else:
        data = read_config_file(path)
        if data.get("policy", policy) != policy:
            raise ConfigError(f"config file {path!r} sets policy={data['policy']!r} but the run "
                              f"asks for {policy!r}; drop the key or change the flag")
        cfg = AdaptiveConfig.from_dict({**data, "policy": policy}, source=f"config file {path!r}")
    if initial_steps is not None:
        if not _is_int(initial_steps) or initial_steps < (1 if policy != "static" else 0):
            raise ConfigError(f"initial_steps={initial_steps!r}: must be an integer >= "
                              f"{1 if policy != 'static' else 0}")
        if initial_steps not in cfg.candidate_steps:
            if cfg.adaptive:
                raise ConfigError(
                    f"initial_steps={initial_steps}: must be one of candidate_steps "
                    f"{list(cfg.candidate_steps)}"
                )
            cfg = cfg.replace(candidate_steps=tuple(sorted(set(cfg.candidate_steps) | {initial_steps})))
        cfg = cfg.replace(initial_steps=initial_steps)
    return cfg

