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
experts' weights are views of two stacked buffers per block (``[E, 2F, d]``, ``[E, d, F]``);
with a shared expert the router's and its gate's weights are rows of one (``RouterRows``: one
GEMM for both logits). On the fused path of one rank (no collective after the block) the
decoder takes ``pending``'s ``MoeOutput`` (the pairs' rows, not summed over the top k; the
shared expert's rows and gate logits) and sums it in the launch of its next residual add and
norm (``moe_kernels.combine``): per layer at batch 1 the experts' part is the router GEMM, the
route kernel and the two pair kernels (Qwen2-MoE: the shared expert's GEMMs and activation
beside them), nothing more (``python -m scripts.diag.layer_kernels`` counts them).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
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


class RouterRows:
    """The router's weight [E, d] and the shared expert gate's [1, d] as the rows of one buffer
    (each parameter a view of its rows; ``FusedColumns``' contract: ``fuse()`` after
    construction and after new storage), so one GEMM gives both logits [N, E + 1]. ``weight``
    is None when the parameters are no longer views of it (e.g. assigned by
    ``load_state_dict(assign=True)``): then they run as two GEMMs."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears, self.base, self._ptrs = linears, None, ()

    def release(self) -> None:
        self.base, self._ptrs = None, ()

    @torch.no_grad()
    def fuse(self) -> None:
        self.base = _fuse_rows([m.weight for m in self.linears])
        self._ptrs = tuple(m.weight.data_ptr() for m in self.linears)

    @property
    def weight(self) -> torch.Tensor | None:
        fresh = self.base is not None and self._ptrs == tuple(m.weight.data_ptr()
                                                              for m in self.linears)
        return self.base if fresh and not torch.is_grad_enabled() else None


@dataclass(frozen=True, eq=False)
class MoeOutput:
    """A MoE block's output on the fused path of one rank, not summed yet: the (token, choice)
    pairs' rows [N, k, d] (``moe_kernels.fused_moe(summed=False)``) and, with a shared expert,
    its rows [N, d] and its gate's logits [N, 1]. Whoever takes it sums it in one launch with
    what comes next (``moe_kernels.combine``): ``add_norm`` the next residual add and RMSNorm,
    ``total`` the sum alone."""

    pairs: torch.Tensor
    shared: torch.Tensor | None = None
    gate: torch.Tensor | None = None

    def total(self) -> torch.Tensor:
        """The block's output [N, d]."""
        return moe_kernels.combine(self.pairs, self.shared, self.gate)

    def add_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, rms_norm(s))`` for ``s = x + total()``, as ``kernels.add_rms_norm``."""
        return moe_kernels.combine(self.pairs, self.shared, self.gate, x, weight, eps)


def settle(delta: "torch.Tensor | MoeOutput") -> torch.Tensor:
    """`delta` as a tensor (a `MoeOutput` summed)."""
    return delta.total() if isinstance(delta, MoeOutput) else delta


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
        self.router: RouterRows | None = None
        if spec.shared_expert_size is not None:
            self.shared_expert = LlamaMLP(cfg, par, width=spec.shared_expert_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
            # the router's and the gate's logits in one GEMM (both replicated, one input)
            self.router = RouterRows([self.gate, self.shared_expert_gate])
            self.router.fuse()
            self._fused = (*self._fused, self.router)

    def logits(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the router's logits [N, E]; with a shared expert its gate's logits [N, 1], else
        None): with a shared expert one GEMM over `RouterRows` (the two, views of its output)."""
        weight = self.router.weight if self.router is not None else None
        if weight is not None:
            both = F.linear(tokens, weight)
            return both[:, :self.spec.num_experts], both[:, self.spec.num_experts:]
        gate = (None if self.shared_expert_gate is None else
                F.linear(tokens, self.shared_expert_gate.weight))
        return F.linear(tokens, self.gate.weight), gate

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`pick` over the router's logits of `tokens`."""
        return self.pick(self.logits(tokens)[0], tokens.dtype)

    def pick(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(the top-k expert ids [N, k], their routing weights [N, k] in `dtype`): the
        float32 softmax of the router's logits at its top k, renormalised over them when
        ``norm_topk_prob``. The softmax is monotone, so the top k of the logits are the top k of
        the probabilities, and renormalised they are the softmax of those k logits alone: three
        kernels after the logits' GEMM (top k, a softmax that casts to float32, the cast back)
        where the softmax over all experts, top k, sum and divide took six (issue 36: a decode
        round runs 48 such layers); where the fused kernels serve (CUDA, the fused path's
        dtypes) one: `moe_kernels.route` (the same up to the exponentials' last bits, and of
        two equal logits the lower expert first)."""
        if kernels.enabled(logits) and dtype in moe_kernels.DTYPES:   # one more kernel
            return moe_kernels.route(logits, self.spec.top_k, self.spec.norm_topk_prob, dtype)
        if self.spec.norm_topk_prob:
            top, ids = torch.topk(logits, self.spec.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        return ids, weights.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return settle(self.pending(x))

    def pending(self, x: torch.Tensor) -> "torch.Tensor | MoeOutput":
        """`forward`'s output, but on the fused path of one rank (no collective after it) a
        `MoeOutput` for the decoder's next residual add and norm to sum in their launch."""
        tokens = self.par.gather(x)
        logits, gate = self.logits(tokens)
        ids, weights = self.pick(logits, tokens.dtype)
        if self.seen is not None:
            self.seen.append(ids.detach().reshape(-1))
        if kernels.enabled(tokens) and tokens.dtype in moe_kernels.DTYPES:
            shared = None if self.shared_expert is None else self.shared_expert.partial(tokens)
            out = MoeOutput(self.fused(tokens, ids, weights, summed=False), shared,
                            None if shared is None else gate)
            if self.par.mlp.size == 1 and self.par.dp.size == 1:   # scatter_sum: a no-op
                return out
            return self.par.scatter_sum(out.total())
        local = (self.dense if tokens.is_cuda else self.sparse)(tokens, ids, weights)
        if self.shared_expert is not None:
            local = local + self.shared(tokens)
        return self.par.scatter_sum(local)

    def shared(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums of the gated shared expert over gathered ``tokens``: its width
        slice's output times the token's gate ``sigmoid(shared_expert_gate(x))`` [N, 1]."""
        gate = torch.sigmoid(F.linear(tokens, self.shared_expert_gate.weight))
        return self.shared_expert.partial(tokens) * gate

    def fused(self, tokens: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              summed: bool = True) -> torch.Tensor:
        """This rank's experts through the grouped GEMMs (``workers.moe_kernels``); `summed`
        False: the pairs' rows [N, k, d] (``fused_moe``)."""
        e, width = len(self.local), self.down.stacked.shape[-1]
        w13 = self.gate_up.stacked.view(e, 2 * width, -1)    # [gate_e; up_e] rows per expert
        # ep: this rank's experts first .. first + e - 1, read by the kernels at 0 .. e - 1; the
        # others' ids they skip (no shifted copy of the ids: two launches fewer per layer)
        return moe_kernels.fused_moe(tokens, ids, weights, w13, self.down.stacked, summed,
                                     all_local=e == self.spec.num_experts, first=self.local[0])

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
