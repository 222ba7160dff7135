"""Reference attention over a ragged batch, in plain torch (CPU and GPU).

Per forward, `plan` builds (once, shared by every layer) each request's KV slots padded to the
longest request, a causal mask, and the index of the new tokens in a padded `[B, max_new]` query
block — all from host lists, so no device sync. Per layer, `forward` writes the new K/V into their
slots, gathers the requests' K/V (`base.gather_kv`) and runs `scaled_dot_product_attention`;
`forward_last` attends each request's last new token only, over its whole sequence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention.base import AttnMetadata, gather_kv, padded_forward, padded_last, upload
from workers.kv_cache import KVPool


class TorchBackend:
    """Stateless factory of `TorchAttention` objects."""

    name = "torch"

    def plan(self, meta: AttnMetadata, pool: KVPool) -> "TorchAttention":
        """Prepare one forward over `pool` described by `meta`."""
        return TorchAttention(meta, pool)


def _tables(meta: AttnMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, L] flat KV slot of every token of every request, padded with slot 0 (masked out);
    [T] position of each new token in the flattened padded `[B * Q]` query block), in one copy."""
    ps, length, q_len = meta.page_size, max(meta.max_seq_len, 1), max(meta.max_qo_len, 1)
    slots = []
    for pages, seq_len in zip(meta.host_pages, meta.host_seq_lens):
        flat = [p * ps + i for p in pages for i in range(ps)][:seq_len]
        slots.extend(flat + [0] * (length - seq_len))
    index = [b * q_len + i for b, n in enumerate(meta.host_qo_lens) for i in range(n)]
    flat_slots, q_index = upload(device, slots, index)
    return flat_slots.view(meta.batch_size, length), q_index


def _causal_mask(meta: AttnMetadata, device: torch.device) -> torch.Tensor:
    """[B, 1, Q, L] bool: new token i of request b sees KV indices <= cached_lens[b] + i."""
    q_len, kv_len = max(meta.max_qo_len, 1), max(meta.max_seq_len, 1)
    cached, qo_lens = meta.cached_lens.long(), meta.qo_indptr.diff().long()
    q_pos = torch.arange(q_len, device=device)[None, :] + cached[:, None]
    kv_idx = torch.arange(kv_len, device=device)
    mask = kv_idx[None, None, :] <= q_pos[:, :, None]
    # NOTE: padded query rows (i >= qo_len) see KV index 0 only, so they stay finite; they are
    # dropped when the output is gathered back.
    pad_rows = torch.arange(q_len, device=device)[None, :] >= qo_lens[:, None]
    mask = torch.where(pad_rows[:, :, None], (kv_idx == 0)[None, None, :], mask)
    return mask[:, None]


class TorchAttention:
    """The per-forward attention callable handed to the model (`attn.forward(layer_id, q, k, v)`)."""

    def __init__(self, meta: AttnMetadata, pool: KVPool) -> None:
        device = pool.device
        self.meta, self.pool = meta, pool
        if meta.num_tokens:
            self.slots, self.q_index = _tables(meta, device)
            self.mask = _causal_mask(meta, device)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Store this layer's new K/V, then attention of `q` [T, Hq, D] -> [T, Hq, D]."""
        return padded_forward(self.meta.num_tokens, q, k, v,
                              lambda q, k, v: self._attend(layer_id, q, k, v))

    def _attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer_id, self.meta.out_slots, k, v)
        batch, q_len = self.mask.shape[0], self.mask.shape[2]
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        keys, values = self._kv(layer_id, q)
        padded = q.new_zeros(batch * q_len, num_q_heads, head_dim).index_copy_(0, self.q_index, q)
        padded = padded.view(batch, q_len, num_q_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(padded, keys, values, attn_mask=self.mask,
                                             scale=head_dim ** -0.5)
        out = out.transpose(1, 2).reshape(batch * q_len, num_q_heads, head_dim)
        return out.index_select(0, self.q_index)

    def forward_last(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        """Store this layer's new K/V, then attention of each request's last new token (`q`
        [R, Hq, D], request order) over its whole sequence -> [R, Hq, D]."""
        pool = self.pool
        return padded_last(self.meta, q, k, v,
                           lambda k, v: pool.write(layer_id, self.meta.out_slots, k, v),
                           lambda q: self._attend_last(layer_id, q))

    def _attend_last(self, layer_id: int, q: torch.Tensor) -> torch.Tensor:
        keys, values = self._kv(layer_id, q)
        kv_idx = torch.arange(self.slots.shape[1], device=q.device)
        mask = (kv_idx[None, :] < self.meta.seq_lens.long()[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask,
                                             scale=q.shape[2] ** -0.5)
        return out[:, :, 0]

    def _kv(self, layer_id: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's K and V of this layer, [B, Hq, L, D] each, in `q`'s dtype."""
        pool, num_q_heads, head_dim = self.pool, q.shape[1], q.shape[2]
        return (gather_kv(pool.k[layer_id], self.slots, num_q_heads, head_dim, q.dtype),
                gather_kv(pool.v[layer_id], self.slots, num_q_heads, head_dim, q.dtype))
