"""The adaptive layer's configuration: one frozen dataclass, strict validation, a stable hash.

Every key, its default and what is allowed is listed in ``FIELDS`` docs below; a JSON file may set
any subset. Validation errors name the key, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REDUCERS = ("weighted_mean", "min", "max", "mixture")
FLOAT_KEYS = ("ema_alpha", "up_hysteresis", "down_hysteresis", "switch_margin", "cost_alpha",
              "reset_nats")
POLICIES = ("static", "ema", "goodput")   # one class each in adaptive_dist.policy
REMOVED_KEYS = {
    "probe_backoff": "goodput's probes all wait probe_every decision points now",
    "zero_via_smallest": "goodput's switch to depth 0 goes straight to 0 now",
}
"""Keys a config may no longer set, each with what replaced it: refused by name (a file that
still sets one asks for a behaviour the code no longer has). Removed by issue 26: neither moved
any production-priced goal row by 1% at batch 1, 16 or 64 (docs/policy.md, "Knobs and their
measurements")."""
INT_KEY = re.compile(r"0|[1-9][0-9]*")  # an integer written as a JSON key: "0", "7", "64"


class ConfigError(ValueError):
    """A configuration value or file is not acceptable; the message names key, value, allowed."""


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass(frozen=True)
class RoundCost:
    """The ``round_cost`` table of the goodput policy, validated and immutable.

    ``buckets`` is ``None`` for one table that serves every batch size (JSON
    ``{"<steps>": cost, ...}``), else the ascending padded-batch keys of the rows (JSON
    ``{"<bucket>": {"<steps>": cost, ...}, ...}``). ``rows[i]`` holds ``(steps, cost)`` pairs,
    ascending by steps; a flat table has exactly one row. Which row a round uses is a rule of
    the policy (``adaptive_dist.policy.cost_row``)."""

    buckets: Optional[tuple[int, ...]]
    rows: tuple[tuple[tuple[int, float], ...], ...]

    @staticmethod
    def parse(value: Any) -> "RoundCost":
        """From the JSON form (string keys) or a ``RoundCost``; ``ConfigError`` naming the key."""
        if isinstance(value, RoundCost):
            return value
        if not isinstance(value, dict) or not value:
            raise ConfigError(f"round_cost={value!r}: must be a non-empty JSON object, either "
                              f'{{"<steps>": cost, ...}} or {{"<bucket>": {{"<steps>": cost, ...}}, ...}}')
        nested = [isinstance(v, dict) for v in value.values()]
        if any(nested) and not all(nested):
            raise ConfigError(f"round_cost={value!r}: mixes costs and per-bucket rows; give either "
                              f'{{"<steps>": cost, ...}} or {{"<bucket>": {{"<steps>": cost, ...}}, ...}}')
        if not all(nested):
            return RoundCost(None, (_cost_row("round_cost", value),))
        keys = sorted(value, key=lambda k: _int_key("round_cost", k, 1))
        rows = tuple(_cost_row(f"round_cost[{k!r}]", value[k]) for k in keys)
        return RoundCost(tuple(int(k) for k in keys), rows)

    @property
    def steps(self) -> tuple[int, ...]:
        """The depths of the first row (every row has the same, checked against the candidates)."""
        return tuple(s for s, _ in self.rows[0])

    def to_json(self) -> dict:
        """The JSON form (string keys, ascending numeric order)."""
        as_obj = [{str(s): c for s, c in row} for row in self.rows]
        if self.buckets is None:
            return as_obj[0]
        return {str(b): row for b, row in zip(self.buckets, as_obj)}


def _int_key(where: str, key: Any, minimum: int) -> int:
    if not isinstance(key, str) or not INT_KEY.fullmatch(key) or int(key) < minimum:
        raise ConfigError(f"{where}: key {key!r} must be an integer >= {minimum} written as a "
                          f'string (e.g. "{max(minimum, 1)}")')
    return int(key)


def _cost_row(where: str, row: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(row, dict) or not row:
        raise ConfigError(f'{where}={row!r}: must be a non-empty object {{"<steps>": cost, ...}}')
    pairs = []
    for key, cost in row.items():
        steps = _int_key(where, key, 0)
        if not is_number(cost) or cost <= 0:
            raise ConfigError(f"{where}[{key!r}]={cost!r}: must be a positive finite number "
                              f"(the relative cost of a round at {steps} steps)")
        pairs.append((steps, float(cost)))
    return tuple(sorted(pairs))


@dataclass(frozen=True)
class VerifyCost:
    """The ``verify_cost`` table of per-request budgets: seconds of the packed verify forward
    alone at each token count it was measured at (JSON ``{"<tokens>": seconds, ...}``), ascending.
    What a round shape costs beyond its chain's (``adaptive_dist.policy.budgets.shape_cost``)."""

    tokens: tuple[int, ...]
    costs: tuple[float, ...]

    @staticmethod
    def parse(value: Any) -> "VerifyCost":
        """From the JSON form (string keys) or a ``VerifyCost``; ``ConfigError`` naming the key."""
        if isinstance(value, VerifyCost):
            return value
        if not isinstance(value, dict) or not value:
            raise ConfigError(f'verify_cost={value!r}: must be a non-empty JSON object '
                              f'{{"<tokens>": seconds, ...}}')
        pairs = sorted(_cost_row("verify_cost", value))
        if pairs[0][0] < 1:
            raise ConfigError(f"verify_cost: key '0' must be an integer >= 1 (verify tokens)")
        return VerifyCost(tuple(t for t, _ in pairs), tuple(c for _, c in pairs))

    def cost(self, tokens: int) -> float:
        """Seconds at ``tokens`` (a measured count)."""
        try:
            return self.costs[self.tokens.index(tokens)]
        except ValueError:
            raise ConfigError(f"verify_cost has no entry for {tokens} tokens (measured: "
                              f"{list(self.tokens)})") from None

    def missing(self, ladder: Any) -> list[int]:
        """The rungs of ``ladder`` the table lacks."""
        return [t for t in ladder if t not in self.tokens]

    def to_json(self) -> dict:
        return {str(t): c for t, c in zip(self.tokens, self.costs)}


@dataclass(frozen=True)
class AdaptiveConfig:
    """Policy and consensus settings (rules in docs/policy.md; the ladder is SGLang-compatible)."""

    policy: str = "ema"
    """``ema`` (adaptive: the EMA ladder), ``goodput`` (adaptive: the best expected tokens per
    unit of round cost) or ``static`` (stay at ``initial_steps``)."""
    candidate_steps: tuple[int, ...] = (1, 3, 7)
    """Draft depths the policy may choose; sorted ascending, at least two distinct, each >= 1
    (0, no speculation, is allowed for ``goodput`` and ``static``)."""
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
    """How ranks' EMAs combine: ``weighted_mean``, ``min`` or ``max``; goodput also
    ``mixture`` (the weighted mean of every rank's expected tokens, from its own rate)."""
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Padded batch sizes that have CUDA graphs; a larger cluster-wide batch runs eager."""
    lockstep_check_every: int = 16
    """Rounds between lockstep hash checks across ranks (>= 1)."""
    round_cost: Optional[RoundCost] = None
    """goodput: the relative cost of a round at each candidate depth, one table
    (``{"<steps>": cost}``) or one row per padded batch (``{"<bucket>": {"<steps>": cost}}``).
    ``None`` until the engine has measured and agreed it (``agree_round_cost``); consensus-only
    mode needs it in the config file. Refused for the other policies."""
    switch_margin: float = 0.05
    """goodput: switch only when the best score beats the current one by this share (>= 0)."""
    probe_every: int = 8
    """goodput: at depth 0, probe the smallest positive depth after this many decision points
    (>= 1)."""
    reset_nats: float = 8.0
    """goodput: a round that measures acceptance and whose accept lengths are more than this many
    nats likelier under their own acceptance rate than under the rank's EMAs (the geometric
    model's log-likelihood ratio, ``policy.surprise``) restarts the rank's EMAs from that round
    alone: a new regime is taken at once instead of over ``~1/ema_alpha`` rounds. At batch 1 it
    takes a round far off the EMAs (a request that accepts all 7 drafts against a rate of 0.3:
    8.4 nats; one that rejects the first against 0.85: 1.9); 16 requests that each reject at
    once at depth 7 against 0.85 give 30. With it on, a rank's first measurement replaces the
    start values too. (>= 0; 0: off — the EMAs follow ``ema_alpha`` alone.)"""
    per_request: bool = False
    """goodput: per-request budgets (``--per-request``): every request drafts what its own
    acceptance pays for, inside a round shape (draft forwards, verify tokens) the cluster agrees
    every round (``adaptive_dist.policy.budgets``); false: one depth for the whole batch."""
    verify_cost: Optional[VerifyCost] = None
    """goodput with ``per_request``: seconds of the packed verify forward at each token count
    (``{"<tokens>": seconds}``), measured and agreed at start-up like ``round_cost`` (or given:
    ``--model-costs``)."""
    cost_alpha: float = 0.0
    """goodput: EMA weight of a timed round in its cost-table row's offset (in [0, 1]; 0: the
    table stays as agreed at start-up). The engine's rounds are timed (seconds from one round's
    begin to the next's, the slowest rank's), so a table in other units must keep 0."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidate_steps",
                           _as_int_tuple("candidate_steps", self.candidate_steps, minimum=0))
        if self.round_cost is not None:
            object.__setattr__(self, "round_cost", RoundCost.parse(self.round_cost))
        if self.verify_cost is not None:
            object.__setattr__(self, "verify_cost", VerifyCost.parse(self.verify_cost))
        object.__setattr__(self, "graph_buckets", _as_int_tuple("graph_buckets", self.graph_buckets))
        for key in FLOAT_KEYS:  # 0 and 0.0 are the same setting and must hash the same
            v = getattr(self, key)
            if is_number(v):
                object.__setattr__(self, key, float(v))
        _validate(self)

    # ---- derived -----------------------------------------------------------------------------
    @property
    def initial_index(self) -> int:
        return self.candidate_steps.index(self.initial_steps)

    @property
    def adaptive(self) -> bool:
        """Whether the policy may change the depth."""
        return policy_section(self.policy).adaptive

    @property
    def needs_round_cost(self) -> bool:
        """The policy needs a ``round_cost`` table and none is set yet (the engine measures it
        and calls ``adaptive_dist.startup.agree_round_cost`` before the first round)."""
        return policy_section(self.policy).uses_round_cost and (
            self.round_cost is None or (self.per_request and self.verify_cost is None))

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
        removed = sorted(set(data) & set(REMOVED_KEYS))
        if removed:
            raise ConfigError(
                f"{source}: key(s) {', '.join(repr(k) for k in removed)} no longer exist ("
                + "; ".join(f"{k}: {REMOVED_KEYS[k]}" for k in removed)
                + "); drop them from the config")
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
        d["round_cost"] = self.round_cost.to_json() if self.round_cost is not None else None
        d["verify_cost"] = self.verify_cost.to_json() if self.verify_cost is not None else None
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
        if not is_int(v) or v < minimum:
            raise ConfigError(f"{key}={list(value)!r}: every entry must be an integer >= "
                              f"{minimum}, got {v!r}")
    return tuple(sorted(set(value)))


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {allowed}")


def _validate(c: AdaptiveConfig) -> None:
    """The keys every policy reads, then each policy's own section (``check_section``: every
    effective configuration holds every key, whatever its policy)."""
    check(c.policy in POLICIES, "policy", c.policy, f"allowed: {', '.join(POLICIES)}")
    active = policy_section(c.policy)
    check(len(c.candidate_steps) >= 2, "candidate_steps", list(c.candidate_steps),
          "needs at least two distinct candidates (duplicates removed)")
    check(c.candidate_steps[0] > 0 or active.allows_depth_zero, "candidate_steps",
          list(c.candidate_steps),
          "0 (no speculation) is a candidate of the static and goodput policies only: the ema "
          "ladder has no acceptance signal at depth 0")
    check(is_int(c.initial_steps), "initial_steps", c.initial_steps, "must be an integer")
    check(c.initial_steps in c.candidate_steps, "initial_steps", c.initial_steps,
          f"must be one of candidate_steps {list(c.candidate_steps)}")
    check(is_number(c.ema_alpha) and 0 < c.ema_alpha <= 1, "ema_alpha", c.ema_alpha,
          "must be a number in (0, 1]")
    for key in ("warmup_batches", "min_dwell_rounds"):
        v = getattr(c, key)
        check(is_int(v) and v >= 0, key, v, "must be an integer >= 0")
    for key in ("update_interval", "lockstep_check_every"):
        v = getattr(c, key)
        check(is_int(v) and v >= 1, key, v, "must be an integer >= 1")
    check(c.reducer in REDUCERS, "reducer", c.reducer, f"allowed: {', '.join(REDUCERS)}")
    for name in POLICIES:
        policy_section(name).check_section(c)


def policy_section(name: str) -> Any:
    """The class of the policy called ``name`` (``adaptive_dist.policy``): what it allows, and
    ``check_section`` for the keys only it reads."""
    from adaptive_dist.policy import policy_class

    return policy_class(name)


def load_config(
    path: Optional[str], policy: str = "ema", initial_steps: Optional[int] = None
) -> AdaptiveConfig:
    """The effective configuration for a run of ``policy``: the file's keys over the defaults,
    the candidates the policy's own (``default_candidates``: goodput 0, 1, 3, 7) unless named.

    A config file with the static policy is refused: the file would silently do nothing.
    ``initial_steps`` overrides the file; a static run may use any depth (it becomes a candidate
    that is never left).
    """
    if policy not in POLICIES:
        raise ConfigError(f"policy={policy!r}: allowed: {', '.join(POLICIES)}")
    if path is not None and not policy_section(policy).adaptive:
        raise ConfigError(
            f"--config {path!r} was given but adaptive mode is off (static policy); "
            f"a config file only applies to the adaptive policy"
        )
    data = {} if path is None else read_config_file(path)
    if data.get("policy", policy) != policy:
        raise ConfigError(f"config file {path!r} sets policy={data['policy']!r} but the run "
                          f"asks for {policy!r}; drop the key or change the flag")
    defaults = policy_section(policy).default_candidates
    if defaults is not None and "candidate_steps" not in data:
        data = {**data, "candidate_steps": list(defaults)}
    source = "the defaults" if path is None else f"config file {path!r}"
    cfg = AdaptiveConfig.from_dict({**data, "policy": policy}, source=source)
    if initial_steps is not None:
        lowest = 0 if policy_section(policy).allows_depth_zero else 1
        if not is_int(initial_steps) or initial_steps < lowest:
            raise ConfigError(f"initial_steps={initial_steps!r}: must be an integer >= {lowest}")
        if initial_steps not in cfg.candidate_steps:
            if cfg.adaptive:
                raise ConfigError(
                    f"initial_steps={initial_steps}: must be one of candidate_steps "
                    f"{list(cfg.candidate_steps)}"
                )
            cfg = cfg.replace(candidate_steps=tuple(sorted(set(cfg.candidate_steps) | {initial_steps})))
        cfg = cfg.replace(initial_steps=initial_steps)
    return cfg

