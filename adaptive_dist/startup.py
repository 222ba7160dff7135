"""Start-up agreement: every rank validates its configuration, then the ranks compare.

A bad configuration on any rank stops start-up on every rank with the same message; ranks whose
effective configurations differ refuse to run, naming the ranks and the keys that differ.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist

from collectives import Group
from adaptive_dist.config import AdaptiveConfig, ConfigError


class ConfigMismatchError(ConfigError):
    """Ranks started with different effective configurations."""


def agree_config(build: Callable[[], AdaptiveConfig], group: Group,
                 extra: Optional[dict] = None) -> AdaptiveConfig:
    """Build the config on this rank (``build`` may raise ``ConfigError``), exchange the outcome
    over ``group``'s control group, and return it only if every rank built the same one.

    ``extra`` holds further settings that must agree (for example the policy name).
    """
    def build_and_describe():
        cfg = build()
        return cfg, {**cfg.to_dict(), **(extra or {})}

    cfg, mine = all_ranks_or_none(build_and_describe, group, "configuration check")
    views = _exchange(mine, group)
    diff = _differences(views, group.ranks)
    if diff:
        raise ConfigMismatchError(
            "ranks were started with different configurations, refusing to run: " + diff)
    return cfg


def _exchange(mine: dict, group: Group) -> list[dict]:
    if group.size == 1:
        return [mine]
    views: list = [None] * group.size
    dist.all_gather_object(views, mine, group=group.control_pg)
    return views


def _differences(configs: list[dict], ranks: tuple[int, ...]) -> str:
    keys = sorted(set().union(*configs))
    parts = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, c in zip(ranks, configs):
            by_value.setdefault(repr(c.get(key)), []).append(rank)
        if len(by_value) > 1:
            shown = ", ".join(f"ranks {rs} have {v}" for v, rs in by_value.items())
            parts.append(f"{key} ({shown})")
    return "; ".join(parts)


def all_ranks_or_none(fn: Callable[[], object], group: Group, what: str):
    """Run ``fn`` on every rank; if it raises ``ValueError`` on any rank, raise on every rank
    the same ``ConfigError`` naming the ranks and their messages. Returns ``fn()``'s value."""
    try:
        value, mine = fn(), {"ok": True}
    except ValueError as exc:
        value, mine = None, {"ok": False, "error": str(exc)}
    views = _exchange(mine, group)
    failed: dict[str, list[int]] = {}
    for rank, view in zip(group.ranks, views):
        if not view["ok"]:
            failed.setdefault(view["error"], []).append(rank)
    if failed:
        msg = "; ".join(f"rank(s) {ranks}: {err}" for err, ranks in failed.items())
        raise ConfigError(f"{what} failed, start-up refused on every rank: {msg}")
    return value
