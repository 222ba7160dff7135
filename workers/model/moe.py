"""The sparse mixture-of-experts MLP of a MoE target (Qwen3-MoE, Mixtral, Qwen2-MoE), split over the
cluster.

    block = MoeBlock(cfg, par)          # par.moe: "tp" or "ep"
    y = block(x)                        # x [T, d] this replica's rows -> [T, d]

Like the dense MLP it gathers every replica's tokens over ``dp`` and hands each replica its rows
summed over the world (``par.scatter_sum``). Every rank routes every gathered token alike
(float32 softmax, top ``top_k``, renormalised when ``norm_topk_prob``) and adds the outputs of the
experts it holds: ``tp`` a ``1/world`` slice of every expert, ``ep`` ``E / world`` whole experts.
A shared expert (Qwen2-MoE) is a dense MLP (``LlamaMLP``) split by width over the world in both
modes; its gate ``sigmoid(shared_expert_gate(x))`` (replicated, one value per token) scales each
rank's partial sums before the world's sum, which is linear, so the sum is the gated output.
The collectives never depend on the routing (no capacity, no dropped token); why:
``docs/ARCHITECTURE.md``, "MoE". Local experts run ``sparse`` (``index_add``, eager; the CPU path
and the reference), ``fused`` (``workers.moe_kernels``: grouped Triton GEMMs, static shapes) or
``dense`` (every expert over every row, zero-weighted; CUDA otherwise), equal up to rounding. The
experts' weights are views of two stacked buffers per block (``[E, 2F, d]``, ``[E, d, F]``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from collectives import Group
from workers import kernels, moe_kernels
from workers.model.config import LlamaConfig
from workers.model.layers import (
    ColumnParallelLinear,
    FusedOwner,
    LlamaMLP,
    RowParallelLinear,
    _fuse_rows,
    silu_mul,
)
from workers.model.parallel import ModelParallel

# checkpoint names per layout: the block's prefix, then the expert's gate, up and down linears
MOE_NAMES = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
             "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


class Expert(nn.Module):
    """One SwiGLU expert, ``down(silu(gate(x)) * up(x))``, its width split over ``group``
    (a size-1 group holds it whole); linears named as the checkpoint names them."""

    def __init__(self, d: int, width: int, group: Group, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        setattr(self, names[0], ColumnParallelLinear(d, width, group))
        setattr(self, names[1], ColumnParallelLinear(d, width, group))
        setattr(self, names[2], RowParallelLinear(width, d, group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(silu_mul(gate(x), up(x)))


class StackedWeights:
    """The weights of sibling linears as views of one buffer, stacked along a new first dim
    (``FusedColumns``' contract: ``fuse()`` after construction and after new storage)."""

    def __init__(self, linears: list[nn.Module]) -> None:
        self.linears, self.stacked = linears, None

    def release(self) -> None:
        self.stacked = None

    @torch.no_grad()
    def fuse(self) -> None:
        params = [m.weight for m in self.linears]
        base = _fuse_rows(params)
        self.stacked = base.view(len(params), *params[0].shape)


class MoeBlock(FusedOwner):
    """The router, this rank's experts and, when the spec has one, the shared expert and its gate
    (see the module docstring)."""

    def __init__(self, cfg: LlamaConfig, par: ModelParallel) -> None:
        super().__init__()
        spec = cfg.moe
        assert spec is not None, "MoeBlock needs a MoE config"
        spec.check_split(par.moe, par.mlp.size)
        self.spec, self.par = spec, par
        linear_names = MOE_NAMES[spec.names][1]
        self.gate = nn.Linear(cfg.hidden_size, spec.num_experts, bias=False)
        if par.moe == "ep":
            per_rank = spec.num_experts // par.mlp.size
            first = par.mlp.rank * per_rank
            local, group = range(first, first + per_rank), Group.single(par.mlp.device)
        else:
            local, group = range(spec.num_experts), par.mlp
        self.local = tuple(local)
        self.experts = nn.ModuleDict({str(e): Expert(cfg.hidden_size, spec.expert_size, group,
                                                     linear_names) for e in local})
        gate, up, down = ([getattr(x, n) for x in self.experts.values()] for n in linear_names)
        self.gate_up = StackedWeights([lin for pair in zip(gate, up) for lin in pair])
        self.down = StackedWeights(down)
        self._fused = (self.gate_up, self.down)
        for stack in self._fused:
            stack.fuse()
        self.seen: list[torch.Tensor] | None = None   # `routed_experts` records here
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_expert_size is not None:
            self.shared_expert = LlamaMLP(cfg, par, width=spec.shared_expert_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the top-k expert ids [N, k], their routing weights [N, k] in ``tokens``' dtype): the
        float32 softmax of the router's logits at its top k, renormalised over them when
        ``norm_topk_prob``. The softmax is monotone, so the top k of the logits are the top k of
        the probabilities, and renormalised they are the softmax of those k logits alone: four
        kernels (the logits, top k, a softmax that casts to float32, the cast back) where the
        softmax over all experts, top k, sum and divide took seven (issue 36: a decode round
        runs 48 such layers); where the fused kernels serve (CUDA, the fused path's dtypes) two:
        the logits and `moe_kernels.route` (the same up to the exponentials' last bits, and of
        two equal logits the lower expert first)."""
        logits = F.linear(tokens, self.gate.weight)
        if kernels.enabled(tokens) and tokens.dtype in moe_kernels.DTYPES:   # one more kernel
            return moe_kernels.route(logits, self.spec.top_k, self.spec.norm_topk_prob,
                                     tokens.dtype)
        if self.spec.norm_topk_prob:
            top, ids = torch.topk(logits, self.spec.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        return ids, weights.to(tokens.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.par.gather(x)
        ids, weights = self.route(tokens)
        if self.seen is not None:
            self.seen.append(ids.detach().reshape(-1))
        if kernels.enabled(tokens) and tokens.dtype in moe_kernels.DTYPES:
            local = self.fused(tokens, ids, weights)
        else:
            local = (self.dense if tokens.is_cuda else self.sparse)(tokens, ids, weights)
        if self.shared_expert is not None:
            local = local + self.shared(tokens)
        return self.par.scatter_sum(local)

    def shared(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums of the gated shared expert over gathered ``tokens``: its width
        slice's output times the token's gate ``sigmoid(shared_expert_gate(x))`` [N, 1]."""
        gate = torch.sigmoid(F.linear(tokens, self.shared_expert_gate.weight))
        return self.shared_expert.partial(tokens) * gate

    def fused(self, tokens: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts through the grouped GEMMs (``workers.moe_kernels``)."""
        e, width = len(self.local), self.down.stacked.shape[-1]
        w13 = self.gate_up.stacked.view(e, 2 * width, -1)    # [gate_e; up_e] rows per expert
        first = self.local[0]
        if first == 0:   # every expert (tp, one rank) or ep's first rank: ids past e are others'
            local_ids = ids
        else:   # ep: this rank's experts first .. first + e - 1 at 0 .. e - 1; the others' ids
            # land at e or more (below first: + E - first >= e), which the kernels skip
            local_ids = torch.remainder(ids - first, self.spec.num_experts)
        return moe_kernels.fused_moe(tokens, local_ids, weights, w13, self.down.stacked)

    def sparse(self, tokens: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts, each over the rows routed to it."""
        out = torch.zeros_like(tokens)
        for e in self.local:
            rows, slot = torch.where(ids == e)
            if rows.numel():
                y = self.experts[str(e)](tokens.index_select(0, rows))
                out.index_add_(0, rows, y * weights[rows, slot, None])
        return out

    def dense(self, tokens: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts, each over every row, weighted by zero where not routed."""
        out = torch.zeros_like(tokens)
        for e in self.local:
            w = (weights * (ids == e).to(weights.dtype)).sum(dim=-1, keepdim=True)
            out = out + self.experts[str(e)](tokens) * w
        return out


class RoutedExperts:
    """What `routed_experts` recorded: per MoE block of the model, in module order, the expert
    ids its forwards routed (kept after the context closes)."""

    def __init__(self, blocks: list[MoeBlock]) -> None:
        self.ids: list[list[torch.Tensor]] = [[] for _ in blocks]

    def counts(self) -> list[int]:
        """Distinct experts routed per MoE block (over every forward recorded; 0 for a block
        that ran none). Reads the device once per block."""
        return [int(torch.cat(ids).unique().numel()) if ids else 0 for ids in self.ids]


@contextmanager
def routed_experts(model: nn.Module) -> Iterator[RoutedExperts]:
    """Record the experts every MoE block of `model` routes while the context is open (eager
    forwards only: a CUDA graph's replay runs no Python), e.g. the distinct experts per layer of
    one round; nothing for a dense model (no blocks)."""
    blocks = [m for m in model.modules() if isinstance(m, MoeBlock)]
    record = RoutedExperts(blocks)
    for block, ids in zip(blocks, record.ids):
        block.seen = ids
    try:
        yield record
    finally:
        for block in blocks:
            block.seen = None
