"""Attention over a padded batch with every shape fixed (`base.PaddedBatch`): capturable in a
CUDA graph, and the eager path of the speculative round too (one code path for both).

`B` rows by `width` token slots; row `b`'s KV reach is its page table `page_tab[b]` (padded with
the dummy page). From `page_tab`, `cached` and `qo_len` (device tensors, read at run time) the plan
computes on the device, once per forward: the flat slot of every KV index, the causal mask, and
the write slot of every token slot (real tokens: their own slot; padding and dummy rows: a slot of
the dummy page). On CUDA the plan computes nothing: the store kernel works out the write slots
(`workers.kernels.store_kv_padded`) and the attention kernel the rest. Every row sees KV index 0, so no row is fully masked and every output is finite;
outputs of padding rows are dropped by the caller. On CUDA the gather, mask and attention are
one fused kernel per layer (`workers.kernels.padded_attention`, the same rule: token slot `w` of
row `b` sees KV indices `0 .. cached[b] + w` within the row's reach). `forward_last` stores every
slot's K/V the same way and attends only each row's last new token (slot `qo_len - 1`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers import kernels
from workers.attention.base import PaddedBatch, gather_kv
from workers.kv_cache import DUMMY_PAGE, KVPool


class StaticBackend:
    """Stateless factory of `StaticAttention` objects."""

    name = "static"

    def plan(self, meta: PaddedBatch, pool: KVPool) -> "StaticAttention":
        """Prepare one padded forward over `pool`."""
        return StaticAttention(meta, pool)


class StaticAttention:
    """The per-forward attention callable of a padded batch (see the module docstring)."""

    def __init__(self, meta: PaddedBatch, pool: KVPool) -> None:
        self.pool, self.width, self.batch = pool, meta.width, meta.batch
        page_tab, ps = meta.page_tab, pool.page_size
        device = page_tab.device
        # on CUDA one fused kernel per layer reads the pages directly (workers.kernels)
        self.fused = kernels.enabled(page_tab)
        self.page_tab, self.cached = page_tab.contiguous(), meta.cached
        self.qo_len = meta.qo_len
        if self.fused:  # the write slots are worked out inside the store kernel (same rule)
            return
        rows = torch.arange(meta.width, device=device)
        kv_pos = meta.cached[:, None] + rows[None, :]                           # [B, W]
        kv_idx = torch.arange(page_tab.shape[1] * ps, device=device)
        self.slots = page_tab[:, kv_idx // ps] * ps + kv_idx % ps              # [B, L]
        self.mask = (kv_idx[None, None, :] <= kv_pos[:, :, None])[:, None]      # [B, 1, W, L]
        real = rows[None, :] < meta.qo_len[:, None]
        page = page_tab.gather(1, (kv_pos // ps).clamp(max=page_tab.shape[1] - 1))
        self.out_slots = torch.where(real, page * ps + kv_pos % ps, DUMMY_PAGE * ps).reshape(-1)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Store K/V (padding into the dummy page), then attention: [B*W, Hq, D]."""
        self._store(layer_id, k, v)
        pool, scale = self.pool, q.shape[2] ** -0.5
        if self.fused:
            return kernels.padded_attention(q, pool.k[layer_id], pool.v[layer_id], self.page_tab,
                                            self.cached, self.width, scale)
        query = q.reshape(self.batch, self.width, *q.shape[1:]).transpose(1, 2)
        out = self._attend(layer_id, query, self.mask)
        return out.transpose(1, 2).reshape(q.shape)

    def forward_last(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        """Store K/V as `forward`, then attention of each row's last new token only (slot
        `qo_len - 1`; a dummy row's slot 0): `q` [B, Hq, D] -> [B, Hq, D]."""
        self._store(layer_id, k, v)
        pool = self.pool
        end = self.cached + (self.qo_len - 1).clamp(min=0)     # the KV index of that token
        if self.fused:  # the padded kernel at width 1: slot 0 of row b sees KV 0 .. end[b]
            return kernels.padded_attention(q, pool.k[layer_id], pool.v[layer_id], self.page_tab,
                                            end, 1, q.shape[2] ** -0.5)
        kv_idx = torch.arange(self.slots.shape[1], device=q.device)
        mask = (kv_idx[None, :] <= end[:, None])[:, None, None, :]
        return self._attend(layer_id, q[:, :, None, :], mask)[:, :, 0]

    def _store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pool = self.pool
        if self.fused:
            ps, heads, dim = pool.page_size, pool.num_kv_heads, pool.head_dim
            kernels.store_kv_padded(pool.k[layer_id].view(-1, heads, dim),
                                    pool.v[layer_id].view(-1, heads, dim), self.page_tab,
                                    self.cached, self.qo_len, self.width, ps, DUMMY_PAGE * ps, k, v)
        else:
            pool.write(layer_id, self.out_slots, k, v)

    def _attend(self, layer_id: int, query: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Eager attention of `query` [B, Hq, Q, D] over every row's reach under `mask`."""
        pool, num_q_heads, head_dim = self.pool, query.shape[1], query.shape[3]
        keys = gather_kv(pool.k[layer_id], self.slots, num_q_heads, head_dim, query.dtype)
        values = gather_kv(pool.v[layer_id], self.slots, num_q_heads, head_dim, query.dtype)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                              scale=head_dim ** -0.5)


class PackedAttention:
    """Attention of a packed forward's tokens over their rows' pages, through a padded grid (the
    reference path, CPU): token `j` of row `b` at window slot `k` is scattered to grid slot
    `b * width + k` (padding tokens to a spare slot), the grid runs as a padded batch (each row
    gathers its KV once for all of its slots), and the outputs are gathered back. The same rule
    as the width-1 padded batch the fused kernels run over the packed tokens directly: token
    (b, k) writes KV index `cached[b] + k` and sees `0 .. cached[b] + k`."""

    def __init__(self, grid: PaddedBatch, index: torch.Tensor, pool: KVPool) -> None:
        self.inner = StaticAttention(grid, pool)
        self.index, self.slots_ = index, grid.batch * grid.width

    def _grid(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((self.slots_ + 1, *x.shape[1:]))
        out.index_copy_(0, self.index, x)
        return out[:self.slots_]

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        out = self.inner.forward(layer_id, self._grid(q), self._grid(k), self._grid(v))
        return torch.cat([out, out.new_zeros((1, *out.shape[1:]))])[self.index]

    def forward_last(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a packed forward attends every token (forward)")
