"""Building blocks of the Llama decoder: RMSNorm, RoPE, and the parallel linears and vocabulary
layers of a DP-attention cluster (see ``workers.model.parallel`` for the groups).

Tensor parallelism follows Megatron: a ``ColumnParallelLinear`` holds rows
``[i * out/n, (i+1) * out/n)`` of the full ``[out, in]`` weight (``i`` its index in its group of
``n``) and produces that slice of the output features; a ``RowParallelLinear`` holds the matching
columns, takes that slice of the input and returns partial sums, which its caller reduces (the
attention output over the ``attn`` group, the MLP output through ``ModelParallel.scatter_sum``).
The vocabulary (embedding rows, LM-head rows) is split over the ``mlp`` group (every rank),
padded up to a multiple of its size. At group size 1 every collective is a no-op.

Every split parameter is described by a ``Shard`` (``shard_specs``), which the loader uses to read
exactly this rank's slice of a checkpoint tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from collectives import Group
from workers import kernels
from workers.model.config import (
    LinearRopeScaling,
    RopeScaling,
    RopeScalingType,
    YarnRopeScaling,
    _DecoderDims,
)
from workers.model.parallel import ModelParallel


@dataclass(frozen=True)
class Shard:
    """A parameter split along ``dim`` over ``group`` (this rank holds part ``group.rank``);
    ``full`` is the checkpoint's size along ``dim`` (the parts may pad beyond it)."""

    dim: int
    group: Group
    full: int

    @property
    def part(self) -> int:
        """Size of one part along ``dim`` (the full size, padded, divided by the group size)."""
        return -(-self.full // self.group.size)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.enabled(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm of its result: ``(x + delta, norm(x + delta))``."""
        if kernels.enabled(x):
            return kernels.add_rms_norm(x, delta, self.weight, self.eps)
        total = x + delta
        return total, self.forward(total)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the SwiGLU activation)."""
    if kernels.enabled(gate):
        return kernels.silu_mul(gate, up)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScalingType | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, scaled as ``scaling`` says (``None``: plain)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv = _SCALERS[type(scaling)](inv, scaling, head_dim, theta)
    return inv.float()


def _llama3_scale(inv: torch.Tensor, s: RopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    mid = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    return torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), mid, out)


def _linear_scale(inv: torch.Tensor, s: LinearRopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    return inv / s.factor


def _yarn_scale(inv: torch.Tensor, s: YarnRopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    """Dimension ``i`` keeps its frequency where it turns more than ``beta_fast`` times over the
    original context, is interpolated (``/ factor``) where fewer than ``beta_slow``, and is
    blended linearly in between."""
    def dim_of(turns: float) -> float:  # the dimension that turns `turns` times
        return head_dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(theta))
    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv / s.factor * ramp + inv * (1 - ramp)


_SCALERS = {RopeScaling: _llama3_scale, LinearRopeScaling: _linear_scale,
            YarnRopeScaling: _yarn_scale}


class RotaryEmbedding(nn.Module):
    """RoPE in the Hugging Face layout (rotate-half): ``cos, sin = rope(positions)`` once per
    forward, then ``apply_rope(x, cos, sin)`` in every layer. Positions are given per token."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScalingType | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.attention_factor = 1.0 if scaling is None else scaling.attention_factor
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` in float32 (after ``to_empty`` or a dtype change)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` of shape [T, head_dim/2] (float32) for int ``positions`` [T]."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.float()[None, :]
        if self.attention_factor != 1.0:  # YaRN scales the rotated q and k
            return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by per-token angles (``cos``/``sin`` [T, D/2]); rotate-half layout."""
    if kernels.enabled(x):
        return kernels.rope(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _split(total: int, group: Group, what: str) -> int:
    if total % group.size:
        raise ValueError(f"{what} of {total} does not split over a group of {group.size} ranks "
                         f"({group.name!r})")
    return total // group.size


class ColumnParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with W's output rows split over ``group``: returns this rank's slice."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False) -> None:
        super().__init__()
        self.group, self.out_features = group, out_features
        self.out_local = _split(out_features, group, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features))
        self.bias = nn.Parameter(torch.zeros(self.out_local)) if bias else None
        nn.init.normal_(self.weight, std=in_features ** -0.5)

    def shard_specs(self) -> dict[str, Shard]:
        shard = Shard(0, self.group, self.out_features)
        return {"weight": shard, "bias": shard}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FusedColumns:
    """Sibling ``ColumnParallelLinear`` s of one input read as one: ``y = x [W_1; W_2; ...]^T``,
    one GEMM instead of one per linear (q/k/v, gate/up). Each linear keeps its own parameters
    (checkpoint names, shard specs, loading and saving are unchanged), but their storage is one
    buffer per kind: each parameter is a view of rows of it, so on every rank the fused weight is
    ``[W_1 local rows; W_2 local rows; ...]`` and the outputs come back as the concatenation of
    the linears' outputs, split by ``split``. Nothing is held twice.

    The owner calls ``fuse()`` after construction and after anything that gives the parameters
    new storage (``Module._apply``: ``to``, ``to_empty``, ``cuda``, dtype casts; see
    ``FusedOwner``). In-place writes into the parameters (loading, initialisation, optimisers)
    go to the shared buffer. Should the parameters no longer be views of it (e.g. replaced by
    ``load_state_dict(assign=True)``), or gradients be needed, ``weights()`` concatenates them
    per call instead: the same math, one more kernel."""

    def __init__(self, *linears: "ColumnParallelLinear") -> None:
        self.linears = linears
        self.split = [m.out_local for m in linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._ptrs: tuple[int, ...] = ()
        self.has_bias = all(m.bias is not None for m in linears)
        if any(m.bias is not None for m in linears) and not self.has_bias:
            raise ValueError("fused linears must all have a bias or none")

    def _params(self) -> list[nn.Parameter]:
        out = [m.weight for m in self.linears]
        return out + [m.bias for m in self.linears] if self.has_bias else out

    def release(self) -> None:
        """Drop the fused buffers (before the parameters get new storage)."""
        self.weight = self.bias = None
        self._ptrs = ()

    @torch.no_grad()
    def fuse(self) -> None:
        """Make every parameter a view of rows of one buffer (one copy of the weights)."""
        self.release()
        self.weight = _fuse_rows([m.weight for m in self.linears])
        if self.has_bias:
            self.bias = _fuse_rows([m.bias for m in self.linears])
        self._ptrs = tuple(p.data_ptr() for p in self._params())

    def weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused (weight, bias) for a forward."""
        params = self._params()
        fresh = self.weight is not None and self._ptrs == tuple(p.data_ptr() for p in params)
        if fresh and not (torch.is_grad_enabled() and params[0].requires_grad):
            return self.weight, self.bias
        weight = torch.cat([m.weight for m in self.linears])
        bias = torch.cat([m.bias for m in self.linears]) if self.has_bias else None
        return weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., in] -> [..., sum of the linears' local outputs] (theirs, concatenated)."""
        weight, bias = self.weights()
        return F.linear(x, weight, bias)


def _fuse_rows(params: list[nn.Parameter]) -> torch.Tensor:
    """Concatenate ``params`` along dim 0 into one buffer and make each a view of its rows."""
    base = torch.cat([p.data for p in params])
    lo = 0
    for p in params:
        p.data = base[lo:lo + p.shape[0]]
        lo += p.shape[0]
    return base


class FusedOwner(nn.Module):
    """A module holding ``FusedColumns`` (in ``self._fused``): re-fuses them whenever its
    parameters get new storage (every ``to``/``to_empty``/``cuda``/dtype cast goes through
    ``_apply``), so the fused buffers always follow the parameters' device and dtype."""

    _fused: tuple[FusedColumns, ...] = ()

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN201 (nn.Module's signature)
        for group in self._fused:
            group.release()  # the old buffers go with the old storage
        out = super()._apply(fn, recurse)
        for group in self._fused:
            group.fuse()
        return out


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with W's input columns split over ``group``; ``x`` is this rank's input
    slice and the result this rank's partial sum (the caller reduces it over the right group)."""

    def __init__(self, in_features: int, out_features: int, group: Group) -> None:
        super().__init__()
        self.group, self.in_features = group, in_features
        self.in_local = _split(in_features, group, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local))
        nn.init.normal_(self.weight, std=in_features ** -0.5)

    def shard_specs(self) -> dict[str, Shard]:
        return {"weight": Shard(1, self.group, self.in_features)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LlamaMLP(FusedOwner):
    """SwiGLU ``down(silu(gate(x)) * up(x))`` over every replica's tokens and this rank's slice of
    the intermediate size (``width``, default the config's ``intermediate_size``); returns this
    replica's rows summed over the world. Gate and up are one GEMM (``FusedColumns``, as Q/K/V in
    ``LlamaAttention``). ``partial`` is the same over tokens already gathered, before the sum (a
    MoE block's shared expert: ``workers.model.moe``)."""

    def __init__(self, cfg: _DecoderDims, par: ModelParallel, width: int | None = None) -> None:
        super().__init__()
        d, f = cfg.hidden_size, width or cfg.intermediate_size
        self.par = par
        self.gate_proj = ColumnParallelLinear(d, f, par.mlp)
        self.up_proj = ColumnParallelLinear(d, f, par.mlp)
        self.down_proj = RowParallelLinear(f, d, par.mlp)
        self.gate_up = FusedColumns(self.gate_proj, self.up_proj)
        self._fused = (self.gate_up,)
        self.gate_up.fuse()

    def partial(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums [N, d] for gathered ``tokens`` [N, d] (its width slice)."""
        f = self.gate_up.split[0]
        gate_up = self.gate_up(tokens)                        # [N, 2 * F_local]
        return self.down_proj(silu_mul(gate_up[..., :f], gate_up[..., f:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.par.scatter_sum(self.partial(self.par.gather(x)))


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over ``par.mlp`` (every rank).

    ``forward(ids [T])`` (this replica's tokens, T agreed across replicas) gathers every replica's
    ids, looks up the rows this rank holds (zeros for the others) and sums over the world:
    [T, d], identical on every rank of the replica.
    """

    def __init__(self, vocab_size: int, dim: int, par: ModelParallel) -> None:
        super().__init__()
        self.par, self.vocab_size = par, vocab_size
        self.shard = Shard(0, par.mlp, vocab_size)
        self.lo = par.mlp.rank * self.shard.part
        self.weight = nn.Parameter(torch.empty(self.shard.part, dim))
        nn.init.normal_(self.weight)

    def shard_specs(self) -> dict[str, Shard]:
        return {"weight": self.shard}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.par.mlp.size == 1:
            return F.embedding(ids, self.weight)
        local = self.par.gather(ids) - self.lo
        inside = (local >= 0) & (local < self.shard.part)
        rows = F.embedding(local.clamp(0, self.shard.part - 1), self.weight)
        return self.par.scatter_sum(rows * inside[:, None].to(rows.dtype))


class VocabParallelLMHead(nn.Module):
    """The LM head with the vocabulary split over ``par.mlp``: ``forward(h [T, d])`` gathers
    every replica's rows, computes this rank's vocabulary columns, gathers the columns of every
    rank and returns this replica's full-vocabulary logits [T, vocab_size]."""

    def __init__(self, dim: int, vocab_size: int, par: ModelParallel) -> None:
        super().__init__()
        self.par, self.vocab_size = par, vocab_size
        self.shard = Shard(0, par.mlp, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.shard.part, dim))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # as nn.Linear

    def shard_specs(self) -> dict[str, Shard]:
        return {"weight": self.shard}

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.par.mlp.size == 1:
            return F.linear(h, self.weight)
        local = F.linear(self.par.gather(h), self.weight)
        return self.par.own_rows(self.par.gather_columns(local))[:, :self.vocab_size]


def shard_specs(model: nn.Module) -> dict[str, Shard | None]:
    """For every parameter name of ``model``: how it is split (``Shard``), or ``None`` when it is
    replicated. The loader slices checkpoint tensors with it."""
    specs: dict[str, Shard | None] = {}
    for mod_name, module in model.named_modules():
        own = module.shard_specs() if hasattr(module, "shard_specs") else {}
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            specs[full] = own.get(p_name)
    return specs
