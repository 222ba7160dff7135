"""Tree attention: a padded batch's new tokens are nodes of a draft tree, not a causal run.

Row `b` of a tree forward brings `Q` nodes (a draft step's frontier, or the N tokens a request
verifies). Each node attends to its request's context — KV indices `0 .. cached[b] - 1` in the
paged pool — and to the tree nodes its boolean mask row allows (its ancestors and itself). The
nodes' own K/V are not written to the pages: they go to `TreeKV`, a per-forward (or per-round)
store of `M` node slots per row, so siblings never overwrite each other's positions; `commit`
then copies the accepted path's K/V to contiguous positions `cached[b] ..` of the pages and the
rest is dropped. Positions (RoPE) are the caller's: context length + the node's depth.

On CUDA one fused kernel per layer (`workers.kernels.tree_attention`: a program per tile of a
row's nodes x the query heads of one KV head, `tl.dot`, the context's pages — split over the key
range at small grids, merged after — then the allowed tree slots, one online softmax); elsewhere
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

    def rows(self, count: int) -> "TreeKV":
        """A view of the store's first `count` rows (the same memory)."""
        out = TreeKV.__new__(TreeKV)
        out.k, out.v = self.k[:, :count], self.v[:, :count]
        return out


class TreeAttention:
    """The per-forward attention of `Q` tree nodes per row (`LayerAttention`).

    `pages` [B, P] and `cached` [B]: each row's page table and context length; `memory`: the
    nodes' K/V store, this forward's nodes going to slots `start .. start + Q - 1`; `mask`
    [B, Q, M] bool: node `i` of row `b` sees tree slot `j` (its ancestors and itself); `live`
    [B, Q] bool (optional): the nodes a forward verifies — one not live reads no context (its
    output is not used; it still sees itself, so it stays finite)."""

    def __init__(self, pool: KVPool, pages: torch.Tensor, cached: torch.Tensor, memory: TreeKV,
                 start: int, mask: torch.Tensor, live: torch.Tensor | None = None) -> None:
        batch, queries, slots = mask.shape
        if slots != memory.slots or start + queries > slots or pages.shape[0] != batch:
            raise ValueError(f"tree attention: mask {list(mask.shape)}, {memory.slots} node slots "
                             f"from {start}, {pages.shape[0]} page tables")
        ps = pool.page_size
        self.pool, self.memory, self.start, self.queries = pool, memory, start, queries
        # on CUDA one fused kernel per layer reads the pages and the store directly
        self.fused = kernels.enabled(pages)
        if self.fused:
            # int8 once per forward (the kernel reads bytes), not once per layer
            self.pages, self.cached = pages.contiguous(), cached
            self.tree_mask = mask.to(torch.int8).contiguous()
            self.batch = batch
            self.live = live.to(torch.int8).contiguous() if live is not None else None
            return
        kv_idx = torch.arange(pages.shape[1] * ps, device=pages.device)
        self.slots = pages[:, kv_idx // ps] * ps + kv_idx % ps                  # [B, L]
        context = (kv_idx[None, :] < cached[:, None])[:, None, :].expand(-1, queries, -1)
        if live is not None:
            context = context & live[:, :, None]
        self.mask = torch.cat([context, mask], dim=2)[:, None]                  # [B, 1, Q, L+M]

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Keep this layer's node K/V in the tree store; attention of `q` [B*Q, Hq, D]."""
        queries = self.queries
        batch = self.batch if self.fused else self.mask.shape[0]
        end = self.start + queries
        self.memory.k[layer_id, :, self.start:end] = k.view(batch, queries, *k.shape[1:])
        self.memory.v[layer_id, :, self.start:end] = v.view(batch, queries, *v.shape[1:])
        return self.attend(layer_id, q)

    def attend(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of `q` [B*Q, Hq, D] over the context and the store as it holds now."""
        queries, heads, dim = self.queries, q.shape[1], q.shape[2]
        batch = self.batch if self.fused else self.mask.shape[0]
        if self.fused:
            return kernels.tree_attention(q, self.pool.k[layer_id], self.pool.v[layer_id],
                                          self.pages, self.cached, self.memory.k[layer_id],
                                          self.memory.v[layer_id], self.tree_mask, dim ** -0.5,
                                          live=self.live)
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


class PackedTreeAttention:
    """The attention of a ragged tree verify (per-request trees): `T` packed tokens, token `j`
    node `grid[j]` of the `[B, N]` grid of the rows' trees (`B * N`: a padding token). The
    forward's linear layers run the `T` tokens; here each layer's K/V go to the node's slot of
    the store (`memory`: `B + 1` rows, the last the padding tokens'), the queries are scattered
    to the grid, the grid's tree attention runs (`TreeAttention`, the nodes not `live` reading no
    context) and the packed tokens' outputs are gathered back."""

    def __init__(self, pool: KVPool, pages: torch.Tensor, cached: torch.Tensor, memory: TreeKV,
                 mask: torch.Tensor, grid: torch.Tensor, live: torch.Tensor) -> None:
        batch, queries, _ = mask.shape
        if memory.k.shape[1] != batch + 1 or memory.slots != queries:
            raise ValueError(f"packed tree attention: a store of {memory.k.shape[1]} rows x "
                             f"{memory.slots} slots for {batch} rows of {queries} nodes (+1 row)")
        self.memory, self.grid, self.cells = memory, grid, batch * queries
        self.inner = TreeAttention(pool, pages, cached, memory.rows(batch), 0, mask, live)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        cells, grid = self.cells, self.grid
        self.memory.k[layer_id].view(-1, *k.shape[1:])[grid] = k.to(self.memory.k.dtype)
        self.memory.v[layer_id].view(-1, *v.shape[1:])[grid] = v.to(self.memory.v.dtype)
        qg = q.new_zeros((cells + 1, *q.shape[1:]))
        qg[grid] = q
        out = torch.cat([self.inner.attend(layer_id, qg[:cells]), qg[cells:]], 0)
        return out[grid]

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
