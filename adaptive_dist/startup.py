"""Start-up agreement of the adaptive layer: the configuration, and what a policy needs from an
engine before the first round (``prepare``: the values it derives in an engine, the inputs it
measures; goodput's probe floor and cost tables).

A bad configuration, trace or output path on any rank stops start-up on every rank with the same
message; ranks whose settings differ refuse to run, naming the settings and the ranks. Everything
that changes the sequence of collectives or the outputs belongs in ``agree_settings``.

The exchanges are ``collectives.agreement``'s (one ``all_gather_object`` over a group's gloo
control group each; a peer that dies meanwhile ends them in ``CollectiveTimeoutError`` naming the
step); here a refusal is a ``ConfigError``, as every input error of the adaptive layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Optional, Protocol, TypeVar

from adaptive_dist.config import AdaptiveConfig, ConfigError
from adaptive_dist.policy import policy_class
import collectives.agreement as agreement
from collectives.agreement import exchange

if TYPE_CHECKING:
    from collectives.group import Group

T = TypeVar("T")

__all__ = ["ConfigMismatchError", "agree_settings", "agree_config", "exchange",
           "all_ranks_or_none", "EngineFacts", "prepare", "agree_measured", "MEASURES", "missing_inputs_error",
           "probe_after_catchup", "derived_settings", "agree_round_cost", "agree_verify_cost",
           "measured_as_json"]


class ConfigMismatchError(ConfigError):
    """Ranks started with different effective configurations or settings."""


def agree_settings(settings: dict[str, Any], group: "Group", what: str) -> None:
    """``collectives.agreement.agree_settings``, refusing with ``ConfigMismatchError``: the
    message, the same on every rank, names the settings that differ and the ranks."""
    agreement.agree_settings(settings, group, what, error=ConfigMismatchError)


def all_ranks_or_none(fn: Callable[[], T], group: "Group", what: str,
                      consequence: str = "start-up refused on every rank") -> T:
    """``collectives.agreement.all_ranks_or_none``, refusing with ``ConfigError``: ``fn`` runs on
    every member; if it raises ``ValueError`` or ``OSError`` on any, every member raises ``{what}
    failed, {consequence}: rank(s) [..]: message``. Returns ``fn()``'s value."""
    return agreement.all_ranks_or_none(fn, group, what, consequence, error=ConfigError)


def agree_config(build: Callable[[], AdaptiveConfig], group: "Group",
                 extra: Optional[dict] = None) -> AdaptiveConfig:
    """Build the config on this rank (``build`` may raise ``ConfigError``), exchange the outcome
    over ``group``'s control group, and return it only if every rank built the same one.

    ``extra`` holds further settings that must agree (see ``agree_settings``).
    """
    cfg = all_ranks_or_none(build, group, "configuration check")
    views = exchange({**cfg.to_dict(), **(extra or {})}, group, "configuration check")
    from collectives.distributed import describe_differences

    diff = describe_differences(views, group.ranks)
    if diff:
        raise ConfigMismatchError(
            "ranks were started with different configurations, refusing to run: " + diff)
    return cfg


# ---- what a policy needs from an engine -----------------------------------------------------------

class EngineFacts(Protocol):
    """What an engine offers a policy at start-up (``prepare``): one object, the same interface
    for every policy. An engine provides all of it; a policy takes what it declares."""

    catchup_rounds: int
    """Depth-0 rounds between the draft cache's catch-ups (what ``DepthPolicy.in_engine`` derives
    from: goodput's probe floor)."""

    def measure_round_costs(self) -> "MeasuredCost":
        """Seconds of one round at every tier and padded batch bucket, on this rank (a collective:
        every rank measures the same tiers and buckets in the same order)."""

    def measure_verify_costs(self) -> Mapping[int, float]:
        """Seconds of the packed verify forward at each verify-token count, on this rank."""


class Measure(NamedTuple):
    """A measurement an engine provides (``EngineFacts``) and how the ranks agree it: which method
    measures it on a rank, its JSON form, how the ranks' tables combine (a round waits for the
    slowest rank: the element-wise maximum) and, for messages, what it is."""

    method: str                                 # the EngineFacts method that measures it
    what: str                                   # "round cost table"
    keys: str                                   # what its top-level keys are: "batch buckets"
    as_json: Callable[[Any], dict]              # the measured table in the config's JSON form
    combine: Callable[[list[dict]], dict]       # every rank's table -> the agreed one
    example: str                                # how a config file gives it (KEY: the key)


def prepare(config: AdaptiveConfig, engine: EngineFacts, group: "Group"
            ) -> tuple[AdaptiveConfig, str]:
    """The effective configuration of ``config`` in ``engine``, and what it derived (``''``: none;
    ``derived_settings``): first the values the policy derives from the engine
    (``DepthPolicy.in_engine``, ``probe_after_catchup``), then every measured input the policy
    still needs (``DepthPolicy.start_up_needs``: its key -> the measurement, one of
    ``MEASURES``), each measured by ``engine`` and agreed over ``group`` (``agree_measured``), in
    the order the policy names them. Call on every rank, after the configuration is agreed and
    before the ``RoundCoordinator`` (whose hash includes all of it). A policy that asks for a
    measurement no engine makes is refused by name."""
    effective = probe_after_catchup(config, engine.catchup_rounds)
    derived = derived_settings(config, effective)
    for key, kind in effective.start_up_needs.items():
        if kind not in MEASURES:
            raise ConfigError(f"the {effective.policy} policy needs {key!r} measured as "
                              f"{kind!r} at start-up, which an engine does not measure (it "
                              f"measures {', '.join(MEASURES)}); set {key!r} in the config")
        measured = getattr(engine, MEASURES[kind].method)()
        effective = agree_measured(effective, key, kind, measured, group)
    return effective, derived


def agree_measured(config: AdaptiveConfig, key: str, kind: str, measured: Any,
                   group: "Group") -> AdaptiveConfig:
    """``config`` with its key ``key`` set to the cluster's agreed measurement ``kind`` (one of
    ``MEASURES``): every member's ``measured`` in the JSON form, validated as the policy's
    section validates ``key`` (a bad table is refused on every rank with the same
    ``ConfigError``), refused with ``ConfigMismatchError`` naming the ranks unless every member
    measured the same top-level keys, then combined (the element-wise maximum). Call on every
    member of ``group`` with its own ``measured``; two exchanges on the control group, none for
    a size-1 group."""
    measure = MEASURES[kind]
    what = f"agreeing the {measure.what}"

    def local() -> dict:
        table = measure.as_json(measured)
        config.replace(**{key: table})   # validated by the policy's section, with key names
        return table

    views = _exchange_tables(local, group, what, measure.keys)
    return config.replace(**{key: measure.combine(views)})


def missing_inputs_error(config: AdaptiveConfig) -> Optional[ConfigError]:
    """Where nothing measures (consensus-only mode): the error for a configuration whose policy
    still needs measured inputs, naming them and how the file gives them; None when none."""
    needs = config.start_up_needs
    if not needs:
        return None
    how = "; ".join(MEASURES[kind].example.replace("KEY", key) if kind in MEASURES else key
                    for key, kind in needs.items())
    return ConfigError(f"--policy {config.policy} in consensus-only mode needs "
                       f"{' and '.join(needs)} in the --config file (no model runs here to "
                       f"measure them): {how}")


# ---- the values a policy derives in an engine ----------------------------------------------------

def probe_after_catchup(config: AdaptiveConfig, catchup_rounds: int) -> AdaptiveConfig:
    """The effective configuration of ``config`` in an engine whose draft cache catches up every
    ``catchup_rounds`` depth-0 rounds (``DepthPolicy.in_engine``): under goodput with a 0
    candidate, ``probe_every`` raised where needed so that a probe never comes before the
    engine's first shadow report (``adaptive_dist.policy.probe_floor``: the report comes one
    round after the catch-up, a round later again when rounds overlap, so the wait must span
    ``ceil((catchup_rounds + 2) / update_interval)`` decision points); ``config`` itself
    otherwise. Call it on every rank with the agreed ``catchup_rounds``, before
    ``agree_round_cost`` (the effective config, hashed, includes it)."""
    if catchup_rounds < 1:
        raise ConfigError(f"probe_after_catchup: catchup_rounds={catchup_rounds!r}: must be >= 1")
    return policy_class(config.policy).in_engine(config, catchup_rounds)


def derived_settings(given: AdaptiveConfig, effective: AdaptiveConfig) -> str:
    """``key given -> effective`` for every key whose effective value differs from the one
    given ('' when none): what a run derived (``probe_after_catchup``) says before it starts,
    beside the effective configuration's digest, so no given value changes unseen."""
    before, after = given.to_dict(), effective.to_dict()
    return ", ".join(f"{key} {before[key]!r} -> {after[key]!r}" for key in sorted(after)
                     if before[key] != after[key])


# ---- measured inputs: the cost tables ------------------------------------------------------------

MeasuredCost = Mapping[int, Mapping[int, float]]
"""A rank's measured round cost: padded batch bucket -> depth (steps) -> seconds per round."""


def agree_round_cost(config: AdaptiveConfig, measured: MeasuredCost,
                     group: "Group") -> AdaptiveConfig:
    """``config`` with ``round_cost`` set to the cluster's agreed cost table: for every bucket
    and depth, the maximum of the members' measurements (a round waits for the slowest rank).

    Call on every member of ``group`` with its own ``measured`` table, after the configuration
    is agreed and before the first round — and before building the ``RoundCoordinator``, whose
    config hash includes the table. Each table needs the same buckets on every rank and a
    positive finite number of seconds for every candidate depth (0 included when it is a
    candidate); a bad or mismatched table is refused on every rank with the same
    ``ConfigError``. Two exchanges on ``group``'s control group; none for a size-1 group.
    """
    if "round_cost" not in _own_keys(config):
        raise ConfigError(f"agree_round_cost: policy={config.policy!r}; round_cost applies "
                          f"to the goodput policy only")
    return agree_measured(config, "round_cost", "round_costs", measured, group)


def _exchange_tables(local: Callable[[], dict], group: "Group", what: str,
                     keys: str) -> list[dict]:
    """Every member's table (``local()`` on every member, refused on every member if it fails
    on any), refused with ``ConfigMismatchError`` naming the ranks unless every table has the
    same top-level keys (``keys``: what they are, for the message)."""
    views = exchange(all_ranks_or_none(local, group, what), group, what)
    seen: dict[str, list[int]] = {}
    for rank, view in zip(group.ranks, views):
        seen.setdefault(repr(sorted(int(k) for k in view)), []).append(rank)
    if len(seen) > 1:
        shown = "; ".join(f"ranks {rs} have {s}" for s, rs in seen.items())
        raise ConfigMismatchError(f"{what}: ranks measured different {keys}, refusing "
                                  f"to run: {shown}")
    return views


def agree_verify_cost(config: AdaptiveConfig, measured: Mapping[int, float],
                      group: "Group") -> AdaptiveConfig:
    """``config`` with ``verify_cost`` set to the cluster's agreed table (per-request budgets):
    for every verify-token count the maximum of the members' measurements, as
    ``agree_round_cost``; every rank must have measured the same counts."""
    if not config.per_request:
        raise ConfigError("agree_verify_cost: verify_cost applies with per_request only")
    return agree_measured(config, "verify_cost", "verify_costs", measured, group)


def measured_as_json(measured: MeasuredCost) -> dict[str, dict[str, float]]:
    """A measured table (int keys, seconds) in ``round_cost``'s JSON form (string keys, floats);
    ``ConfigError`` naming the entry when a key is not an integer or a value not a number."""
    if not isinstance(measured, Mapping) or not measured:
        raise ConfigError(f"measured round cost={measured!r}: must be a non-empty mapping "
                          f"bucket -> steps -> seconds")
    out: dict[str, dict[str, float]] = {}
    for bucket, row in measured.items():
        _measured_key(bucket, "bucket", f"measured round cost[{bucket!r}]")
        if not isinstance(row, Mapping) or not row:
            raise ConfigError(f"measured round cost[{bucket!r}]={row!r}: must be a non-empty "
                              f"mapping steps -> seconds")
        cells: dict[str, float] = {}
        for steps, seconds in row.items():
            where = f"measured round cost[{bucket!r}][{steps!r}]"
            _measured_key(steps, "steps", where)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
                raise ConfigError(f"{where}={seconds!r}: must be a number of seconds")
            cells[str(steps)] = float(seconds)
        out[str(bucket)] = cells
    return out


def _measured_key(key: Any, name: str, where: str) -> None:
    if isinstance(key, bool) or not isinstance(key, int):
        raise ConfigError(f"{where}: the {name} {key!r} must be an integer")


def _own_keys(config: AdaptiveConfig) -> tuple[str, ...]:
    """The keys of the section of ``config``'s policy."""
    section = config.section(config.policy)
    return section.keys() if section is not None else ()


def _max_rows(views: list[dict]) -> dict:
    """Per bucket and depth, the largest of the ranks' seconds."""
    return {b: {k: max(view[b][k] for view in views) for k in row} for b, row in views[0].items()}


def _max_cells(views: list[dict]) -> dict:
    """Per key, the largest of the ranks' seconds."""
    return {k: max(view[k] for view in views) for k in views[0]}


MEASURES: dict[str, Measure] = {
    "round_costs": Measure(
        "measure_round_costs", "round cost table", "batch buckets", measured_as_json, _max_rows,
        'e.g. {"KEY": {"1": 1.2, "3": 1.5, "7": 2.2}} with one relative cost per candidate '
        'depth, or one such table per padded batch bucket {"KEY": {"8": {...}, "64": {...}}}'),
    "verify_costs": Measure(
        "measure_verify_costs", "verify cost table", "token counts",
        lambda measured: {str(t): float(c) for t, c in measured.items()}, _max_cells,
        'e.g. {"KEY": {"8": 0.004, "16": 0.005}}, seconds of the verify forward per token '
        'count'),
}
"""The measurements an engine provides (``EngineFacts``), by name: what a policy's
``start_up_needs`` may ask for."""
