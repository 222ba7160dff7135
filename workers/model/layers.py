"""Building blocks of the Llama decoder: RMSNorm, RoPE, tensor-parallel linears, the attention
backend protocol.

Tensor parallelism follows Megatron: a ``ColumnParallelLinear`` holds rows
``[rank * out/size, (rank+1) * out/size)`` of the full ``[out, in]`` weight and produces this
rank's slice of the output features; a ``RowParallelLinear`` holds columns
``[rank * in/size, (rank+1) * in/size)``, takes this rank's slice of the input features and
all-reduces the partial sums over its group inside ``forward``. At group size 1 the collectives
are no-ops (``collectives.Group.single``). Every value returned by these layers is replicated
across the TP group, except the output of a column-parallel linear (this rank's slice).
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from collectives import Group, ops
from workers.model.config import RopeScaling


class AttentionBackend(Protocol):
    """What a decoder layer calls for attention; the backend owns the KV cache (if any).

    ``q``: [T, Hq_local, D], ``k``/``v``: [T, Hkv_local, D] for the T tokens of this forward
    (RoPE already applied), flattened over the batch in the order the backend was planned with.
    Returns [T, Hq_local, D]. Scale is ``D ** -0.5``; grouped-query: query head ``h`` reads KV
    head ``h // (Hq_local // Hkv_local)``. ``layer_id`` indexes the backend's cache.
    """

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ...


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, with Llama-3 scaling when given."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv = _llama3_scale(inv, scaling)
    return inv.float()


def _llama3_scale(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    mid = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    return torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), mid, out)


class RotaryEmbedding(nn.Module):
    """RoPE in the Hugging Face layout (rotate-half): ``cos, sin = rope(positions)`` once per
    forward, then ``apply_rope(x, cos, sin)`` in every layer. Positions are given per token."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` in float32 (after ``to_empty`` or a dtype change)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` of shape [T, head_dim/2] (float32) for int ``positions`` [T]."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.float()[None, :]
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by per-token angles (``cos``/``sin`` [T, D/2]); rotate-half layout."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _split(total: int, group: Group, what: str) -> int:
    if total % group.size:
        raise ValueError(f"{what} of {total} does not split over a TP group of size {group.size}")
    return total // group.size


class ColumnParallelLinear(nn.Module):
    """``y = x W^T`` with W's output rows split over ``group``; returns this rank's output slice.

    ``shard_dim = 0``: the loader slices the full checkpoint tensor along dim 0.
    """

    shard_dim = 0

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False) -> None:
        super().__init__()
        self.group = group
        self.out_local = _split(out_features, group, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features))
        self.bias = nn.Parameter(torch.zeros(self.out_local)) if bias else None
        nn.init.normal_(self.weight, std=in_features ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with W's input columns split over ``group``; ``x`` is this rank's input slice.

    Ends with ``ops.all_reduce`` over ``group`` (sum of partial products), so the output is the
    full ``y`` on every rank. ``shard_dim = 1`` for the loader.
    """

    shard_dim = 1

    def __init__(self, in_features: int, out_features: int, group: Group) -> None:
        super().__init__()
        self.group = group
        self.in_local = _split(in_features, group, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local))
        nn.init.normal_(self.weight, std=in_features ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return ops.all_reduce(y, self.group)


def shard_dims(model: nn.Module) -> dict[str, int | None]:
    """For every parameter name of ``model``: the dim it is split along over TP, or ``None``
    when it is replicated. The loader slices checkpoint tensors with it."""
    dims: dict[str, int | None] = {}
    for mod_name, module in model.named_modules():
        dim = getattr(type(module), "shard_dim", None)
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            dims[full] = dim if p_name == "weight" or dim == 0 else None
    return dims
