"""Start-up agreement over a group: every member runs a step or states its settings, then the
members compare, so a problem on any rank stops every rank with the same message.

Every exchange here is one ``all_gather_object`` over the group's gloo control group (none for a
size-1 group); if a peer dies meanwhile, the survivors raise ``CollectiveTimeoutError`` naming the
step. The error a refusal raises is the caller's to choose (``error=``): a layer above names its
own kind of input error, and the message stays the same.

Importing this module does not import torch (``torch.distributed`` is imported on first use).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

from collectives.errors import CollectiveTimeoutError, SettingsMismatchError, StartupError

if TYPE_CHECKING:
    from collectives.group import Group

T = TypeVar("T")


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


def agree_settings(settings: dict[str, Any], group: "Group", what: str,
                   error: type[Exception] = SettingsMismatchError) -> None:
    """Raise ``error`` on every member of ``group`` unless every member passed equal
    ``settings`` (JSON-able values, keyed by the flag or setting name users know).

    The message is the same on every rank: ``{what}: ranks were started with different
    settings, refusing to run: --timeout (ranks [0] have 3.0, ranks [1] have 5.0); ...``.
    """
    from collectives.distributed import describe_differences

    views = exchange(settings, group, what)
    diff = describe_differences(views, group.ranks)
    if diff:
        raise error(f"{what}: ranks were started with different settings, refusing to run: "
                    f"{diff}")


def all_ranks_or_none(fn: Callable[[], T], group: "Group", what: str,
                      consequence: str = "start-up refused on every rank",
                      error: type[Exception] = StartupError) -> T:
    """Run ``fn`` on every member of ``group``; if it raises ``ValueError`` or ``OSError`` on
    any, raise on every member the same ``error``: ``{what} failed, {consequence}: rank(s)
    [..]: message``. A group of one process has no peers to tell or name: ``{what} failed:
    message``. Returns ``fn()``'s value."""
    try:
        value, mine = fn(), {"ok": True}
    except (ValueError, OSError) as exc:
        value, mine = None, {"ok": False, "error": str(exc)}
    if group.size == 1 and not mine["ok"]:
        raise error(f"{what} failed: {mine['error']}")
    views = exchange(mine, group, what)
    failed: dict[str, list[int]] = {}
    for rank, view in zip(group.ranks, views):
        if not view["ok"]:
            failed.setdefault(view["error"], []).append(rank)
    if failed:
        msg = "; ".join(f"rank(s) {ranks}: {err}" for err, ranks in failed.items())
        raise error(f"{what} failed, {consequence}: {msg}")
    return value  # type: ignore[return-value]
