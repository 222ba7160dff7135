"""Tree attention: a padded batch's new tokens are nodes of a draft tree, not a causal run.

Row `b` of a tree forward brings `Q` nodes (a draft step's frontier, or the N tokens a request
verifies). Each node attends to its request's context — KV indices `0 .. cached[b] - 1` in the
paged pool — and to the tree nodes its boolean mask row allows (its ancestors and itself). The
nodes' own K/V are not written to the pages: they go to `TreeKV`, a per-forward (or per-round)
store of `M` node slots per row, so siblings never overwrite each other's positions; `commit`
then copies the accepted path's K/V to contiguous positions `cached[b] ..` of the pages and the
rest is dropped. Positions (RoPE) are the caller's: context length + the node's depth.

On CUDA one fused kernel per layer (`workers.kernels.tree_attention`: one program per node and
query head, the context's pages then the allowed tree slots, one online softmax); elsewhere
plain torch: the context's K/V gathered through the page table (`base.gather_kv`), the tree's
appended, and `scaled_dot_product_attention` under the concatenated mask. A dummy row (cached 0)
still sees itself, so every output is finite.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers import kernels
from workers.attention.base import gather_kv
from workers.kv_cache import DUMMY_PAGE, KVPool


class TreeKV:
    """K and V of tree nodes, per layer: `[layers, rows, slots, kv_heads, head_dim]`."""

    def __init__(self, layers: int, rows: int, slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (layers, rows, slots, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def slots(self) -> int:
        return self.k.shape[2]


class TreeAttention:
    """The per-forward attention of `Q` tree nodes per row (`LayerAttention`).

    `pages` [B, P] and `cached` [B]: each row's page table and context length; `memory`: the
    nodes' K/V store, this forward's nodes going to slots `start .. start + Q - 1`; `mask`
    [B, Q, M] bool: node `i` of row `b` sees tree slot `j` (its ancestors and itself)."""

    def __init__(self, pool: KVPool, pages: torch.Tensor, cached: torch.Tensor, memory: TreeKV,
                 start: int, mask: torch.Tensor) -> None:
        batch, queries, slots = mask.shape
        if slots != memory.slots or start + queries > slots or pages.shape[0] != batch:
            raise ValueError(f"tree attention: mask {list(mask.shape)}, {memory.slots} node slots "
                             f"from {start}, {pages.shape[0]} page tables")
        ps = pool.page_size
        self.pool, self.memory, self.start, self.queries = pool, memory, start, queries
        # on CUDA one fused kernel per layer reads the pages and the store directly
        self.fused = kernels.enabled(pages)
        if self.fused:
            self.pages, self.cached, self.tree_mask = pages.contiguous(), cached, mask
            self.batch = batch
            return
        kv_idx = torch.arange(pages.shape[1] * ps, device=pages.device)
        self.slots = pages[:, kv_idx // ps] * ps + kv_idx % ps                  # [B, L]
        context = (kv_idx[None, :] < cached[:, None])[:, None, :].expand(-1, queries, -1)
        self.mask = torch.cat([context, mask], dim=2)[:, None]                  # [B, 1, Q, L+M]

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Keep this layer's node K/V in the tree store; attention of `q` [B*Q, Hq, D]."""
        queries, heads, dim = self.queries, q.shape[1], q.shape[2]
        batch = self.batch if self.fused else self.mask.shape[0]
        end = self.start + queries
        self.memory.k[layer_id, :, self.start:end] = k.view(batch, queries, *k.shape[1:])
        self.memory.v[layer_id, :, self.start:end] = v.view(batch, queries, *v.shape[1:])
        if self.fused:
            return kernels.tree_attention(q, self.pool.k[layer_id], self.pool.v[layer_id],
                                          self.pages, self.cached, self.memory.k[layer_id],
                                          self.memory.v[layer_id], self.tree_mask, dim ** -0.5)
        keys = torch.cat([gather_kv(self.pool.k[layer_id], self.slots, heads, dim, q.dtype),
                          _heads(self.memory.k[layer_id], heads, q.dtype)], dim=2)
        values = torch.cat([gather_kv(self.pool.v[layer_id], self.slots, heads, dim, q.dtype),
                            _heads(self.memory.v[layer_id], heads, q.dtype)], dim=2)
        query = q.view(batch, queries, heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=self.mask,
                                             scale=dim ** -0.5)
        return out.transpose(1, 2).reshape(q.shape)

    def forward_last(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a tree forward attends every node (forward)")


def _heads(x: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, M, Hkv, D] -> [B, Hq, M, D] (KV heads repeated for grouped-query attention)."""
    out = x.transpose(1, 2).to(dtype)
    groups = heads // out.shape[1]
    return out.repeat_interleave(groups, dim=1) if groups > 1 else out


def commit(pool: KVPool, memory: TreeKV, pages: torch.Tensor, cached: torch.Tensor,
           path: torch.Tensor, count: torch.Tensor) -> None:
    """Copy the accepted path's K/V into the pages, every layer: tree slot `path[b, j]` of row
    `b` to KV index `cached[b] + j` for `j < count[b]` (the rest to the dummy page)."""
    batch, width = path.shape
    ps = pool.page_size
    pos = cached[:, None] + torch.arange(width, device=path.device)[None, :]       # [B, W]
    page = pages.gather(1, (pos // ps).clamp(max=pages.shape[1] - 1))
    keep = torch.arange(width, device=path.device)[None, :] < count[:, None]
    out = torch.where(keep, page * ps + pos % ps, torch.full_like(pos, DUMMY_PAGE * ps))
    index = path[:, :, None, None].expand(-1, -1, *memory.k.shape[3:])
    for layer in range(memory.k.shape[0]):
        k = memory.k[layer].gather(1, index).reshape(batch * width, *memory.k.shape[3:])
        v = memory.v[layer].gather(1, index).reshape(batch * width, *memory.v.shape[3:])
        pool.write(layer, out.reshape(-1), k, v)
