"""Start-up agreement: every rank checks its inputs and settings, then the ranks compare.

A bad configuration, trace or output path on any rank stops start-up on every rank with the same
message; ranks whose settings differ refuse to run, naming the settings and the ranks. Everything
that changes the sequence of collectives or the outputs belongs in ``agree_settings``.

Every exchange here is one ``all_gather_object`` over a group's gloo control group; if a peer
dies meanwhile, the survivors raise ``CollectiveTimeoutError`` naming the step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from adaptive_dist.config import AdaptiveConfig, ConfigError
from collectives.errors import CollectiveTimeoutError

if TYPE_CHECKING:
    from collectives.group import Group

T = TypeVar("T")


class ConfigMismatchError(ConfigError):
    """Ranks started with different effective configurations or settings."""


def agree_settings(settings: dict[str, Any], group: "Group", what: str) -> None:
    """Raise ``ConfigMismatchError`` on every member of ``group`` unless every member passed
    equal ``settings`` (JSON-able values, keyed by the flag or setting name users know).

    The message is the same on every rank: ``{what}: ranks were started with different
    settings, refusing to run: --timeout (ranks [0] have 3.0, ranks [1] have 5.0); ...``.
    """
    from collectives.distributed import describe_differences

    views = exchange(settings, group, what)
    diff = describe_differences(views, group.ranks)
    if diff:
        raise ConfigMismatchError(f"{what}: ranks were started with different settings, "
                                  f"refusing to run: {diff}")


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


def exchange(mine: Any, group: "Group", what: str) -> list:
    """Every member's ``mine``, in group order (one all-gather on the control group)."""
    if group.size == 1:
        return [mine]
    import torch.distributed as dist

    views: list = [None] * group.size
    try:
        dist.all_gather_object(views, mine, group=group.control_pg)
    except Exception as exc:
        from collectives.guard import short_cause

        cause = short_cause(exc)
        why = ("a peer is still busy with this step (larger traces take longer: raise --timeout) "
               "or is frozen" if "timed out" in cause.lower() else "a peer stopped or is unreachable")
        raise CollectiveTimeoutError(f"rank {group.global_rank}: start-up step '{what}' did not "
                                     f"complete ({cause}): {why}") from None
    return views


def all_ranks_or_none(fn: Callable[[], T], group: "Group", what: str,
                      consequence: str = "start-up refused on every rank") -> T:
    """Run ``fn`` on every member of ``group``; if it raises ``ValueError`` or ``OSError`` on
    any, raise on every member the same ``ConfigError``: ``{what} failed, {consequence}: rank(s)
    [..]: message``. Returns ``fn()``'s value."""
    try:
        value, mine = fn(), {"ok": True}
    except (ValueError, OSError) as exc:
        value, mine = None, {"ok": False, "error": str(exc)}
    views = exchange(mine, group, what)
    failed: dict[str, list[int]] = {}
    for rank, view in zip(group.ranks, views):
        if not view["ok"]:
            failed.setdefault(view["error"], []).append(rank)
    if failed:
        msg = "; ".join(f"rank(s) {ranks}: {err}" for err, ranks in failed.items())
        raise ConfigError(f"{what} failed, {consequence}: {msg}")
    return value  # type: ignore[return-value]
