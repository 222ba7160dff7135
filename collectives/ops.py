"""Typed collective ops on a ``Group``: explicit at the call site, no-ops at size 1, recorded.

Every op records itself (when the group has a recorder) before it is issued, so a divergence can
be named by sequence number, and turns a failing or timed-out collective into a clear error.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from collectives.group import Group

# torch >= 2.13 renamed all_gather_into_tensor to all_gather_single; accept both.
gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


def _run(op: str, group: Group, tensor: torch.Tensor, fn) -> None:
    rec = group.recorder
    entry = rec.record(op, group.name, tensor) if rec is not None else None
    if entry is not None and rec.strict and rec.before_issue is not None:
        rec.before_issue(entry, group)
    try:
        fn()
    except Exception as exc:  # gloo raises on timeouts and mismatches; name them
        if rec is not None and rec.on_failure is not None and entry is not None:
            raise rec.on_failure(entry, exc) from exc
        raise


def _check_group(group: Group, op: str) -> None:
    if group.device_pg is None:
        raise RuntimeError(
            f"{op} on group {group.name!r} of size {group.size} has no process group; "
            f"was init_distributed() called on every rank?"
        )


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` and return it. No-op at size 1."""
    if group.size == 1:
        return tensor
    _check_group(group, "all_reduce")
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce: op={op!r}; allowed: {sorted(_REDUCE_OPS)}")
    _run(f"all_reduce.{op}", group, tensor,
         lambda: dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group.device_pg))
    return tensor


def all_gather(tensor: torch.Tensor, group: Group, dim: int = 0,
               control: bool = False) -> torch.Tensor:
    """Concatenate every member's ``tensor`` along ``dim`` in group order (a new tensor).

    ``control`` sends a host tensor over the group's gloo control group instead of its device
    group (small host-side agreements: a separate channel from the model's collectives)."""
    if group.size == 1:
        return tensor
    _check_group(group, "all_gather")
    src = tensor.contiguous() if tensor.dim() > 0 else tensor.reshape(1)
    out = torch.empty((group.size * src.shape[0],) + tuple(src.shape[1:]),
                      dtype=src.dtype, device=src.device)
    pg = group.control_pg if control else group.device_pg
    _run("all_gather.control" if control else "all_gather", group, src,
         lambda: gather_into(out, src, group=pg))
    if dim == 0:
        return out
    parts = out.chunk(group.size, dim=0)
    return torch.cat(parts, dim=dim)


def reduce_scatter(tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum over ``group``, then return this member's slice of ``tensor`` along ``dim``."""
    if group.size == 1:
        return tensor
    _check_group(group, "reduce_scatter")
    if tensor.shape[dim] % group.size != 0:
        raise ValueError(
            f"reduce_scatter: dim {dim} has size {tensor.shape[dim]}, not divisible by the "
            f"group size {group.size} (group {group.name!r})"
        )
    src = tensor.movedim(dim, 0).contiguous() if dim != 0 else tensor.contiguous()
    if src.device.type == "cpu" and src.data_ptr() == tensor.data_ptr():
        src = src.clone()  # the CPU path all-reduces in place: keep the caller's tensor intact
    out = torch.empty((src.shape[0] // group.size,) + tuple(src.shape[1:]),
                      dtype=src.dtype, device=src.device)
    if src.device.type == "cpu":
        # gloo has no reduce_scatter_tensor: an all-reduce then a slice gives the same values.
        def fn() -> None:
            dist.all_reduce(src, group=group.device_pg)
            out.copy_(src.chunk(group.size, dim=0)[group.rank])
    else:
        def fn() -> None:
            dist.reduce_scatter_tensor(out, src, group=group.device_pg)
    _run("reduce_scatter", group, src, fn)
    return out.movedim(0, dim) if dim != 0 else out


def broadcast(tensor: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """Copy member ``src``'s ``tensor`` (``src`` is the index inside the group) to every member."""
    if group.size == 1:
        return tensor
    _check_group(group, "broadcast")
    if not 0 <= src < group.size:
        raise ValueError(f"broadcast: src={src} outside group {group.name!r} of size {group.size}")
    _run("broadcast", group, tensor,
         lambda: dist.broadcast(tensor, src=group.ranks[src], group=group.device_pg))
    return tensor


def all_reduce_sum_max(tensor: torch.Tensor, group: Group, n_sum: int,
                       algorithm: str = "doubling") -> torch.Tensor:
    """One reduction of a host int64 vector over ``group``'s gloo control group, in place:
    elements ``[:n_sum]`` summed, ``[n_sum:]`` their maximum (a minimum travels as the maximum
    of its negation). Integer arithmetic, so every member ends with the same values whatever
    order the partial results meet in. No-op at size 1.

    ``algorithm="doubling"``: recursive doubling over point-to-point sends on the control group,
    each message the whole vector — ``log2 N`` exchange steps for ``N`` a power of two (else the
    ``N - 2^k`` extra members first hand their vector to a partner and get the result back: two
    more steps), against gloo's ring all-reduce, ``2(N - 1)`` sequential hops even for a tiny
    vector. ``"gloo"``: gloo's own all-reduce, twice (SUM, then MAX; for comparison)."""
    if group.size == 1:
        return tensor
    _check_group(group, "all_reduce_sum_max")
    if tensor.dtype != torch.int64 or tensor.device.type != "cpu" or tensor.dim() != 1:
        raise ValueError("all_reduce_sum_max: a 1-D int64 host tensor")
    if algorithm not in ("doubling", "gloo"):
        raise ValueError(f"all_reduce_sum_max: algorithm={algorithm!r}; allowed: doubling, gloo")
    pg = group.control_pg
    head, tail = tensor[:n_sum], tensor[n_sum:]

    def gloo() -> None:
        dist.all_reduce(head, op=dist.ReduceOp.SUM, group=pg)
        dist.all_reduce(tail, op=dist.ReduceOp.MAX, group=pg)

    def doubling() -> None:
        size, me, ranks = group.size, group.rank, group.ranks
        pow2 = 1 << (size.bit_length() - 1)
        extra = size - pow2
        other = torch.empty_like(tensor)
        mine, theirs = tensor.numpy(), other.numpy()   # the same memory: combined in numpy
        m_head, m_tail, t_head, t_tail = mine[:n_sum], mine[n_sum:], theirs[:n_sum], theirs[n_sum:]

        def combine() -> None:
            np.add(m_head, t_head, out=m_head)
            np.maximum(m_tail, t_tail, out=m_tail)

        def swap(peer: int) -> None:   # send mine, receive theirs, combine
            sent = dist.isend(tensor, ranks[peer], group=pg)
            got = dist.irecv(other, ranks[peer], group=pg)
            sent.wait()
            got.wait()
            combine()

        if me < 2 * extra and me % 2 == 0:   # an extra member: its partner reduces for it
            dist.send(tensor, ranks[me + 1], group=pg)
            dist.recv(tensor, ranks[me + 1], group=pg)
            return
        if me < 2 * extra:
            dist.recv(other, ranks[me - 1], group=pg)
            combine()
        v = me // 2 if me < 2 * extra else me - extra   # index among the 2^k active members
        mask = 1
        while mask < pow2:
            peer = v ^ mask
            swap(2 * peer + 1 if peer < extra else peer + extra)
            mask <<= 1
        if me < 2 * extra:
            dist.send(tensor, ranks[me - 1], group=pg)

    _run(f"all_reduce.sum_max.{algorithm}.control", group, tensor,
         gloo if algorithm == "gloo" else doubling)
    return tensor
