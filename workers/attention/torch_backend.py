"""Reference attention backend in plain torch (CPU and GPU).

Per forward, `plan` builds (once, shared by every layer) a gather index of each request's KV slots
padded to the longest request, a causal mask, and the scatter index of the new tokens into a
padded `[B, max_new]` query block. Per layer, `forward` writes the new K/V into their slots, gathers
the requests' K/V from the pages, and runs `scaled_dot_product_attention` with that mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention.base import AttnMetadata
from workers.kv_cache import KVCache


class TorchBackend:
    """Stateless factory of `TorchAttention` objects."""

    name = "torch"

    def plan(self, meta: AttnMetadata, cache: KVCache) -> "TorchAttention":
        """Prepare one forward over `cache` described by `meta`."""
        return TorchAttention(meta, cache)


def _gather_index(meta: AttnMetadata, device: torch.device) -> torch.Tensor:
    """[B, L] flat KV slot of every token of every request, padded with slot 0 (masked out)."""
    ps, length = meta.page_size, max(meta.max_seq_len, 1)
    indptr = meta.kv_indptr.tolist()  # NOTE: one host sync per forward; fine for the reference
    within = torch.arange(ps, device=device)
    rows = []
    for b, seq_len in enumerate(meta.host_seq_lens):
        pages = meta.kv_page_indices[indptr[b]:indptr[b + 1]].to(device=device, dtype=torch.int64)
        slots = (pages[:, None] * ps + within).reshape(-1)[:seq_len]
        rows.append(torch.cat([slots, slots.new_zeros(length - seq_len)]))
    return torch.stack(rows)


def _causal_mask(meta: AttnMetadata, device: torch.device) -> torch.Tensor:
    """[B, 1, Q, L] bool: new token i of request b sees KV indices <= cached_lens[b] + i."""
    q_len, kv_len = max(meta.max_qo_len, 1), max(meta.max_seq_len, 1)
    q_pos = torch.arange(q_len, device=device)[None, :] + meta.cached_lens.to(device)[:, None].long()
    kv_idx = torch.arange(kv_len, device=device)
    mask = kv_idx[None, None, :] <= q_pos[:, :, None]
    # NOTE: padded query rows (i >= qo_len) see KV index 0 only, so they stay finite; they are
    # dropped when the output is gathered back.
    qo_lens = torch.tensor(meta.host_qo_lens, device=device)
    pad_rows = torch.arange(q_len, device=device)[None, :] >= qo_lens[:, None]
    mask[pad_rows] = kv_idx == 0
    return mask[:, None]


def _query_index(meta: AttnMetadata, device: torch.device) -> torch.Tensor:
    """[T] position of each new token in the flattened padded `[B * Q]` query block."""
    q_len = max(meta.max_qo_len, 1)
    index = [b * q_len + i for b, n in enumerate(meta.host_qo_lens) for i in range(n)]
    return torch.tensor(index, dtype=torch.int64, device=device)


class TorchAttention:
    """The per-forward attention callable handed to the model (`attn.forward(layer_id, q, k, v)`)."""

    def __init__(self, meta: AttnMetadata, cache: KVCache) -> None:
        device = cache.device
        self.meta = meta
        self.cache = cache
        self.gather = _gather_index(meta, device)
        self.mask = _causal_mask(meta, device)
        self.q_index = _query_index(meta, device)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Store this layer's new K/V, then attention of `q` [T, Hq, D] -> [T, Hq, D]."""
        cache, meta = self.cache, self.meta
        cache.write(layer_id, meta.out_slots, k, v)
        batch, q_len = self.mask.shape[0], self.mask.shape[2]
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        keys = self._gather(cache.k[layer_id], num_q_heads, q.dtype)
        values = self._gather(cache.v[layer_id], num_q_heads, q.dtype)
        padded = q.new_zeros(batch * q_len, num_q_heads, head_dim).index_copy_(0, self.q_index, q)
        padded = padded.view(batch, q_len, num_q_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(padded, keys, values, attn_mask=self.mask)
        out = out.transpose(1, 2).reshape(batch * q_len, num_q_heads, head_dim)
        return out.index_select(0, self.q_index)

    def _gather(self, pages: torch.Tensor, num_q_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, Hq, L, D] K or V of every request (KV heads repeated for grouped-query attention)."""
        flat = pages.view(-1, pages.shape[2], pages.shape[3])
        out = flat[self.gather].to(dtype).transpose(1, 2)  # [B, Hkv, L, D]
        groups = num_q_heads // out.shape[1]
        return out.repeat_interleave(groups, dim=1) if groups > 1 else out
