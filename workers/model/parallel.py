"""How a model is split over the ranks of a DP-attention cluster, and the two collectives that
move tokens between attention and the MLP.

World = ``dp × attn_tp`` ranks. Attention (q/k/v/o projections, KV cache, attention kernel) is
tensor-parallel over the ``attn`` group (the ``attn_tp`` ranks of one DP replica, which hold the
same requests) and data-parallel across replicas. The MLP, the embedding and the LM head are
tensor-parallel over the ``mlp`` group: every rank of the world. So before each MLP the replicas'
tokens are gathered over the ``dp`` group (one member per replica, all at the same attention
shard) and after it each replica's rows are summed over the world and handed back:

* ``gather(x)``: ``x`` [T, ...] (T identical on every rank: the round's agreed padded size) ->
  [dp·T, ...], replicas in ``dp``-group order;
* ``scatter_sum(y)``: ``y`` [dp·T, ...] holds this rank's partial sums over its MLP shard ->
  [T, ...], this replica's rows summed over every rank of the world. ``reduce_scatter`` (default:
  a reduce-scatter over ``dp`` then an all-reduce over ``attn``) or ``all_reduce`` (one all-reduce
  over the world, then this replica's slice): the same values, different collectives.

With ``dp = 1`` both reduce to plain tensor parallelism (gather is a no-op, scatter_sum one
all-reduce over the world); with one rank every collective is a no-op. Layers receive a
``ModelParallel``; they never ask ``torch.distributed`` for ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import collectives  # its names load on first use: this module imports no torch until a call
from workers.model.config import MOE_PARALLEL

if TYPE_CHECKING:
    import torch

    from collectives import Group, ParallelLayout

SCATTERS = ("reduce_scatter", "all_reduce")
"""How `scatter_sum` returns MLP outputs to the DP replicas (`ModelParallel.scatter`,
`--mlp-scatter`): the same values through different collectives."""


@dataclass(frozen=True, eq=False)
class ModelParallel:
    """The groups a model's layers split over (see the module docstring)."""

    attn: Group
    mlp: Group
    dp: Group
    scatter: str = "reduce_scatter"
    moe: str = "tp"         # a MoE target's experts: width split over mlp ("tp") or whole ("ep")

    def __post_init__(self) -> None:
        if self.scatter not in SCATTERS:
            raise ValueError(f"scatter={self.scatter!r}; allowed: {', '.join(SCATTERS)}")
        if self.moe not in MOE_PARALLEL:
            raise ValueError(f"moe={self.moe!r}; allowed: {', '.join(MOE_PARALLEL)}")
        if self.attn.size * self.dp.size != self.mlp.size:
            raise ValueError(f"attn ({self.attn.size}) x dp ({self.dp.size}) ranks must make the "
                             f"MLP group ({self.mlp.size})")

    @staticmethod
    def single(device: torch.device | str = "cpu", moe: str = "tp") -> "ModelParallel":
        """One process: every group of size 1, every collective a no-op."""
        g = collectives.Group.single(device)
        return ModelParallel(attn=g, mlp=g, dp=g, moe=moe)

    @staticmethod
    def from_layout(layout: ParallelLayout, scatter: str = "reduce_scatter",
                    moe: str = "tp") -> "ModelParallel":
        """Attention over ``attn_tp``, MLP/vocabulary over ``mlp_tp`` (the world), tokens over
        ``dp``."""
        return ModelParallel(attn=layout.group("attn_tp"), mlp=layout.group("mlp_tp"),
                             dp=layout.group("dp"), scatter=scatter, moe=moe)

    @property
    def replica(self) -> int:
        """This rank's DP replica (its index in the ``dp`` group)."""
        return self.dp.rank

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every replica's rows of ``x``, concatenated in replica order (no-op at dp = 1)."""
        return collectives.ops.all_gather(x, self.dp)

    def scatter_sum(self, y: torch.Tensor) -> torch.Tensor:
        """This replica's rows of ``y`` summed over every rank of the world."""
        if self.dp.size == 1:
            return collectives.ops.all_reduce(y, self.mlp)
        if self.scatter == "all_reduce":
            return collectives.ops.all_reduce(y, self.mlp).chunk(self.dp.size)[self.replica]
        return collectives.ops.all_reduce(collectives.ops.reduce_scatter(y, self.dp), self.attn)

    def gather_columns(self, y: torch.Tensor) -> torch.Tensor:
        """[R, C] column shards of every rank of the world -> [R, world·C] (rank order)."""
        return collectives.ops.all_gather(y, self.mlp, dim=1)

    def own_rows(self, y: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a tensor laid out as ``gather`` returns it."""
        return y if self.dp.size == 1 else y.chunk(self.dp.size)[self.replica]
