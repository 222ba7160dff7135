"""Cost table files: what `--model-costs FILE` reads (`generate`, `serve`, the benchmarks), so a
run decides (and a benchmark prices) on a table measured elsewhere — a GPU's start-up table on a
CPU run — instead of measuring its own at start-up.

A file is either a measured table file (`docs/data/cost_tables/*.json`: milliseconds,
`agreed_round_cost_ms` = `{bucket: {depth: ms}}`, the full chain's round per padded batch bucket
and depth, and for per-request budgets `agreed_verify_cost_ms` = `{tokens: ms}`, the packed
verify forward alone per token count), a results file's `{"agreed_round_cost": ...}` (seconds),
or a bare `round_cost` table (seconds). Errors name the file and the key.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from adaptive_dist.config import AdaptiveConfig, ConfigError, RoundCost, VerifyCost


def load_model_costs(value: str) -> tuple[RoundCost, Optional[VerifyCost], Optional[str]]:
    """A JSON table, or a file holding one -> (round cost in seconds, verify cost in seconds or
    None when the file has none, the file's name or None)."""
    path = Path(value)
    name = None
    try:
        if value.lstrip()[:1] not in ("{", "") and path.is_file():
            data, name = json.loads(path.read_text()), str(path)
        else:
            data = json.loads(value)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--model-costs {value!r}: not a JSON file or table ({err.msg} at "
                          f"line {err.lineno})") from None
    except OSError as err:
        raise ConfigError(f"--model-costs {value!r}: cannot be read ({err.strerror})") from None
    verify = None
    where = name or "--model-costs"
    if isinstance(data, dict) and "agreed_round_cost_ms" in data:
        if "agreed_verify_cost_ms" in data:
            verify = VerifyCost.parse({t: c / 1e3 for t, c in
                                       data["agreed_verify_cost_ms"].items()})
        data = {b: {s: c / 1e3 for s, c in row.items()}
                for b, row in data["agreed_round_cost_ms"].items()}
    elif isinstance(data, dict) and "agreed_round_cost" in data:
        if data.get("agreed_verify_cost") is not None:
            verify = VerifyCost.parse(data["agreed_verify_cost"])
        data = data["agreed_round_cost"]
    try:
        return RoundCost.parse(data), verify, name
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def restrict_costs(table: RoundCost, depths: tuple[int, ...]) -> RoundCost:
    """`table` at `depths` only (a goodput policy's table holds exactly its candidates); a
    depth the table lacks is left out, for the config's check to name."""
    keep = set(depths)
    return RoundCost(table.buckets, tuple(tuple((s, c) for s, c in row if s in keep)
                                          for row in table.rows))


def with_model_costs(spec: AdaptiveConfig, value: str) -> AdaptiveConfig:
    """`spec` deciding on the table `value` names (`--model-costs`): its round cost cut to the
    candidates and, with per-request budgets, its verify cost. `ConfigError` naming the flag when
    the policy reads no table, or the file lacks what the run needs."""
    if spec.policy != "goodput":
        raise ConfigError(f"--model-costs applies to --adaptive --policy goodput only (the "
                          f"{spec.policy} policy reads no cost table)")
    table, verify, name = load_model_costs(value)
    missing = sorted(set(spec.candidate_steps) - set(table.steps))
    where = name or "--model-costs"
    if missing:
        raise ConfigError(f"--model-costs {where}: no cost for depth(s) {missing}; the table has "
                          f"{list(table.steps)}, the run's candidates are "
                          f"{list(spec.candidate_steps)}")
    changes = {"round_cost": restrict_costs(table, spec.candidate_steps)}
    if spec.per_request:
        if verify is None:
            raise ConfigError(f"--model-costs {where}: per-request budgets need the verify "
                              f"forward's cost (agreed_verify_cost_ms), which the file lacks")
        changes["verify_cost"] = verify
    return spec.replace(**changes)

