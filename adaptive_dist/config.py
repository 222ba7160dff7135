"""The adaptive layer's configuration: one frozen dataclass, strict validation, a stable hash.

``AdaptiveConfig``'s fields are the keys every policy reads; each policy's own keys are its
section (``PolicySection``, declared beside the policy: ``adaptive_dist.policy.ladder.EmaSection``,
``adaptive_dist.policy.goodput.GoodputSection``), one per registered policy
(``adaptive_dist.registry``). A JSON file may set any subset, a policy's keys inside its
section (``{"goodput": {"switch_margin": 0.1}}``) or at the top level (the older spelling, still
accepted). Validation errors name the key, the value and what is allowed.
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

from adaptive_dist.registry import (PolicySection, float_fields, json_value, policy_class,
                                           policy_names, policy_sections)

REDUCERS = ("weighted_mean", "min", "max", "mixture")


class _PolicyNames:
    """The names of the registered policies (``adaptive_dist.registry``), read when used,
    so a policy registered later is a ``--policy`` choice too: ``in``, iteration (registration
    order), ``len``, ``==`` with a tuple. ``adaptive``: only the policies that may change the
    depth (True), only those that may not (False), every one (None)."""

    def __init__(self, adaptive: Optional[bool] = None) -> None:
        self.adaptive = adaptive

    def _names(self) -> tuple[str, ...]:
        return policy_names(self.adaptive)

    def __iter__(self) -> Any:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __len__(self) -> int:
        return len(self._names())

    def __eq__(self, other: object) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, (tuple, list, _PolicyNames)) \
            else NotImplemented

    def __repr__(self) -> str:
        return repr(self._names())


POLICIES: Any = _PolicyNames()
"""Every registered policy's name (static, ema, goodput, then any registered later)."""
ADAPTIVE_POLICIES: Any = _PolicyNames(adaptive=True)
"""The registered policies that may change the depth (``--adaptive --policy``'s choices)."""
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


def _sections() -> dict[str, type]:
    """Every registered policy's section class, by policy name (policies without keys left out);
    ``ConfigError`` when a section declares a key every policy reads."""
    sections = policy_sections()
    for name, cls in sections.items():
        clash = [k for k in cls.keys() if k in AdaptiveConfig.core_keys()]
        if clash:
            raise ConfigError(f"policy {name!r}: its section's key(s) {clash} are keys every "
                              f"policy reads")
    return sections


@dataclass(frozen=True, init=False)
class AdaptiveConfig:
    """Policy and consensus settings (rules in docs/policy.md; the ladder is SGLang-compatible).

    The fields below are the keys every policy reads; each policy's own keys are its section
    (``DepthPolicy.Section``, a ``PolicySection``), held in ``sections`` for every registered
    policy and read as attributes (``config.switch_margin``) or as keyword arguments
    (``AdaptiveConfig(policy="goodput", switch_margin=0.1)``, ``config.replace(...)``)."""

    policy: str = "ema"
    """The registered policy (``adaptive_dist.registry``): ``ema`` (adaptive: the EMA
    ladder), ``goodput`` (adaptive: the best expected tokens per unit of round cost) or
    ``static`` (stay at ``initial_steps``)."""
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
    sections: tuple[tuple[str, PolicySection], ...] = ()
    """(policy name, its section) for every registered policy that has keys, in registration
    order (the ema ladder's hysteresis, goodput's cost table and knobs: see their classes)."""

    def __init__(self, policy: str = "ema", candidate_steps: Any = (1, 3, 7),
                 initial_steps: int = 3, ema_alpha: float = 0.2, warmup_batches: int = 10,
                 update_interval: int = 5, min_dwell_rounds: int = 0,
                 reducer: str = "weighted_mean", graph_buckets: Any = (1, 2, 4, 8, 16, 32, 64),
                 lockstep_check_every: int = 16,
                 sections: Any = (), **keys: Any) -> None:
        """The core keys by name; ``keys``: any registered policy's section keys, flat (over the
        values of ``sections``, a tuple of pairs or a mapping policy -> section or dict)."""
        core = dict(policy=policy, candidate_steps=candidate_steps, initial_steps=initial_steps,
                    ema_alpha=ema_alpha, warmup_batches=warmup_batches,
                    update_interval=update_interval, min_dwell_rounds=min_dwell_rounds,
                    reducer=reducer, graph_buckets=graph_buckets,
                    lockstep_check_every=lockstep_check_every)
        for name, value in core.items():
            object.__setattr__(self, name, value)
        given = dict(sections.items() if isinstance(sections, dict) else sections)
        built: list[tuple[str, PolicySection]] = []
        where: dict[str, PolicySection] = {}
        for name, cls in _sections().items():
            have = given.pop(name, None)
            values = ({f.name: getattr(have, f.name) for f in dataclasses.fields(have)}
                      if isinstance(have, PolicySection) else dict(have or {}))
            values.update({k: keys.pop(k) for k in cls.keys() if k in keys})
            section = cls(**values)
            built.append((name, section))
            where.update((k, section) for k in cls.keys())
        if keys or given:
            extra = ", ".join(repr(k) for k in [*keys, *given])
            raise TypeError(f"AdaptiveConfig got unexpected keyword argument(s) {extra}")
        object.__setattr__(self, "sections", tuple(built))
        object.__setattr__(self, "_where", where)
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        """A section key read as an attribute (``config.probe_every``)."""
        section = self.__dict__.get("_where", {}).get(name)
        if section is None:
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        return getattr(section, name)

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidate_steps",
                           _as_int_tuple("candidate_steps", self.candidate_steps, minimum=0))
        object.__setattr__(self, "graph_buckets", _as_int_tuple("graph_buckets", self.graph_buckets))
        float_fields(self)  # 0 and 0.0 are the same setting and must hash the same
        _validate(self)

    def section(self, policy: str) -> Optional[PolicySection]:
        """The section of ``policy`` (None: that policy has no keys of its own)."""
        return dict(self.sections).get(policy)

    # ---- derived -----------------------------------------------------------------------------
    @property
    def initial_index(self) -> int:
        return self.candidate_steps.index(self.initial_steps)

    @property
    def adaptive(self) -> bool:
        """Whether the policy may change the depth."""
        return policy_section(self.policy).adaptive

    @property
    def start_up_needs(self) -> dict[str, str]:
        """The measured inputs the policy still needs before the first round, key -> the
        engine's measurement (``DepthPolicy.start_up_needs``; goodput: ``round_cost``, and
        ``verify_cost`` with per_request, while unset): an engine measures and agrees them
        (``adaptive_dist.startup.prepare``)."""
        return dict(policy_section(self.policy).start_up_needs(self))

    @property
    def needs_round_cost(self) -> bool:
        """The policy still needs measured inputs (``start_up_needs``; the older name)."""
        return bool(self.start_up_needs)

    @property
    def tiers(self) -> tuple[int, ...]:
        """The depths a run may use: every candidate when adaptive (a tree candidate's steps
        too, ``tree_candidates``), else ``initial_steps``."""
        if not self.adaptive:
            return (self.initial_steps,)
        trees = self.__dict__.get("_where", {}).get("tree_candidates")
        extra = {t[0] for t in getattr(trees, "tree_candidates", ())} if trees else set()
        return tuple(sorted(set(self.candidate_steps) | extra))

    @property
    def max_steps(self) -> int:
        """The deepest tier a run may use (what buffers and KV reservations are sized for)."""
        return max(self.tiers)

    # ---- I/O ---------------------------------------------------------------------------------
    @classmethod
    def core_keys(cls) -> tuple[str, ...]:
        """The keys every policy reads (the fields but ``sections``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "sections")

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "AdaptiveConfig":
        """Build from a dict (a parsed JSON file): the core keys, each policy's keys either in
        its section (``{"goodput": {...}}``) or flat; unknown keys are refused by name."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        sections = _sections()
        flat = dict(data)
        nested: dict[str, dict] = {}
        for name in sections:
            if name in flat:
                given = flat.pop(name)
                if not isinstance(given, dict):
                    raise ConfigError(f"{source}: section {name!r}={given!r}: must be a JSON "
                                      f"object of the {name} policy's keys "
                                      f"({', '.join(sections[name].keys())})")
                nested[name] = given
        removed = {k: why for c in sections.values() for k, why in c.removed.items()}
        named = sorted(set(flat) | {k for s in nested.values() for k in s})
        gone = [k for k in named if k in removed]
        if gone:
            raise ConfigError(
                f"{source}: key(s) {', '.join(repr(k) for k in gone)} no longer exist ("
                + "; ".join(f"{k}: {removed[k]}" for k in gone)
                + "); drop them from the config")
        known = set(cls.core_keys()) | {k for c in sections.values() for k in c.keys()}
        unknown = sorted(set(flat) - known)
        unknown += [f"{name}.{k}" for name, s in nested.items() for k in s
                    if k not in sections[name].keys()]
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(repr(k) for k in unknown)}; "
                f"allowed keys: {', '.join(sorted(known))}"
                + "".join(f"; in section {n!r}: {', '.join(c.keys())}"
                          for n, c in sections.items()))
        twice = sorted(k for name, s in nested.items() for k in s if k in flat)
        if twice:
            raise ConfigError(f"{source}: key(s) {', '.join(repr(k) for k in twice)} given both "
                              f"at the top level and in their policy's section; give each once")
        try:
            return cls(**flat, sections=nested)
        except ConfigError as exc:
            if source == "config":
                raise
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "AdaptiveConfig":
        """Build from a JSON file (errors name the file)."""
        return cls.from_dict(read_config_file(path), source=f"config file {str(path)!r}")

    def to_dict(self) -> dict:
        """The effective configuration, flat: the core keys, then every section's keys."""
        d = {k: json_value(getattr(self, k)) for k in self.core_keys()}
        for _, section in self.sections:
            d.update(section.to_json())
        return d

    def digest(self) -> str:
        """A stable hash of the effective configuration (hex, 16 chars)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> "AdaptiveConfig":
        """A copy with ``changes`` (core or section keys, by name), validated again."""
        core = {k: getattr(self, k) for k in self.core_keys()}
        return AdaptiveConfig(**{**core, "sections": self.sections, **changes})


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
          f"0 (no speculation) is a candidate of the "
          f"{' and '.join(n for n in POLICIES if policy_section(n).allows_depth_zero)} policies "
          f"only: the {c.policy} policy has no acceptance signal at depth 0")
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
    """The class of the policy called ``name`` (``adaptive_dist.registry``): what it
    allows, its section and ``check_section`` for the keys only it reads."""
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

