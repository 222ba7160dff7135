"""The parallel layout of a DP-attention cluster: one validated object that owns the named groups.

Semantics (the DP-attention layout): the MLP (and the vocabulary) is tensor-parallel over all
``mlp_tp`` ranks; attention is data-parallel over ``dp`` replicas, each replica tensor-parallel
over ``attn_tp = mlp_tp / dp`` ranks. ``mlp_tp`` equals the world size (the degree is
``ParallelLayout.tp``, as ``check_degrees`` names it). Rank ``r`` belongs to attention replica
``r // attn_tp`` at attention-TP index ``r % attn_tp``.

Groups, fetched by name:
- ``world``: every rank.
- ``mlp_tp``: every rank (the MLP's and the vocabulary's group); same members as ``world``
  (``tp``, its former name, still finds it).
- ``attn_tp``: the ``attn_tp`` ranks of this rank's attention replica (contiguous).
- ``dp``: the ``dp`` ranks that hold the same attention shard of different replicas
  (stride ``attn_tp``); the consensus runs here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from collectives.group import Group
from collectives.recorder import CollectiveRecorder

GROUP_NAMES = ("world", "mlp_tp", "dp", "attn_tp")
"""The named groups, in the order every rank creates them."""
ALIASES = {"tp": "mlp_tp"}
"""Former names of groups (the lookups accept them)."""


def check_degrees(world_size: int, dp: int, tp: int) -> None:
    """Raise ValueError naming the numbers if (dp, tp) does not fit ``world_size``."""
    for key, value in (("dp", dp), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"parallel layout: {key}={value!r} must be a positive integer")
    if tp != world_size:
        raise ValueError(
            f"parallel layout: tp={tp} must equal the world size {world_size} "
            f"(the MLP is tensor-parallel over every rank)"
        )
    if tp % dp != 0:
        raise ValueError(
            f"parallel layout: dp={dp} must divide tp={tp} (attn_tp = tp / dp = {tp / dp:g} "
            f"is not an integer)"
        )


def member_ranks(name: str, rank: int, world_size: int, dp: int, tp: int) -> tuple[int, ...]:
    """The global ranks of the group ``name`` that contains global ``rank``, in group order."""
    attn_tp = tp // dp
    name = ALIASES.get(name, name)
    if name in ("world", "mlp_tp"):
        return tuple(range(world_size))
    if name == "attn_tp":
        start = (rank // attn_tp) * attn_tp
        return tuple(range(start, start + attn_tp))
    if name == "dp":
        return tuple(range(rank % attn_tp, world_size, attn_tp))
    raise KeyError(f"unknown group {name!r}; known groups: {', '.join(GROUP_NAMES)}")


def all_member_sets(name: str, world_size: int, dp: int, tp: int) -> list[tuple[int, ...]]:
    """Every distinct member set of group ``name``, in a fixed order (all ranks create all)."""
    seen: list[tuple[int, ...]] = []
    for r in range(world_size):
        members = member_ranks(name, r, world_size, dp, tp)
        if members not in seen:
            seen.append(members)
    return seen


@dataclass(eq=False)
class ParallelLayout:
    """Validated (dp, tp) degrees and this rank's named groups."""

    world_size: int
    rank: int
    dp: int
    tp: int
    device: torch.device
    groups: dict[str, Group] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        check_degrees(self.world_size, self.dp, self.tp)

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    @property
    def mlp_tp(self) -> int:
        """Ranks the MLP and the vocabulary split over: the world (the degree ``tp``)."""
        return self.tp

    def group(self, name: str) -> Group:
        """The named group this rank belongs to (``world``, ``mlp_tp``, ``dp`` or ``attn_tp``)."""
        name = ALIASES.get(name, name)
        if name not in self.groups:
            raise KeyError(f"unknown group {name!r}; known groups: {', '.join(GROUP_NAMES)}")
        return self.groups[name]

    @classmethod
    def build(
        cls,
        *,
        world_size: int,
        rank: int,
        dp: int,
        tp: int,
        device: torch.device,
        device_backend: str | None,
        recorder: CollectiveRecorder | None = None,
        timeout: timedelta | None = None,
        control_timeout: timedelta | None = None,
    ) -> "ParallelLayout":
        """Create every group on every rank in the same order (a collective over the world).

        ``device_backend`` None means no torch.distributed at all (a single process).
        """
        layout = cls(world_size=world_size, rank=rank, dp=dp, tp=tp, device=device)
        made: dict[tuple[int, ...], tuple] = {}  # groups with the same members share their pgs
        for name in GROUP_NAMES:
            layout.groups[name] = _make_group(
                name, layout, device_backend, recorder, timeout, control_timeout or timeout, made
            )
        return layout


def _make_group(name: str, layout: "ParallelLayout", device_backend: str | None,
                recorder: CollectiveRecorder | None, timeout: timedelta | None,
                control_timeout: timedelta | None,
                made: dict[tuple[int, ...], tuple]) -> Group:
    mine = member_ranks(name, layout.rank, layout.world_size, layout.dp, layout.tp)
    device_pg = control_pg = None
    # NOTE: new_group is collective over the whole world and must run in the same order on every
    # rank, so every member set is created everywhere, even those this rank is not part of.
    for members in all_member_sets(name, layout.world_size, layout.dp, layout.tp):
        if device_backend is None or len(members) == 1:
            continue
        if members not in made:
            made[members] = (
                dist.new_group(list(members), backend=device_backend, timeout=timeout),
                dist.new_group(list(members), backend="gloo", timeout=control_timeout),
            )
        if members == mine:
            device_pg, control_pg = made[members]
    return Group(
        name=name,
        ranks=mine,
        rank=mine.index(layout.rank),
        device=layout.device,
        device_pg=device_pg,
        control_pg=control_pg,
        recorder=recorder,
    )
