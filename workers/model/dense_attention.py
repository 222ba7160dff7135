"""Cache-free causal attention for training and tests.

``DenseCausalAttention(seq_lens)`` treats the T flattened tokens of a forward as whole sequences
laid out back to back (``sum(seq_lens) == T``), each attending causally to itself only. Equal
lengths run as one batched SDPA call (the training path); ragged lengths run one call per
sequence. It keeps no state between forwards, so one object serves every layer and both models.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def _expand_kv(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """[.., Hkv, L, D] -> [.., Hkv*groups, L, D]: query head h reads KV head h // groups."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


class DenseCausalAttention:
    """Causal self-attention over whole sequences, no KV cache (see the module docstring)."""

    def __init__(self, seq_lens: Sequence[int]) -> None:
        if not seq_lens or any(int(n) <= 0 for n in seq_lens):
            raise ValueError(f"seq_lens is {list(seq_lens)!r}; allowed: a non-empty list of lengths > 0")
        self.seq_lens = [int(n) for n in seq_lens]
        self.num_tokens = sum(self.seq_lens)

    @staticmethod
    def uniform(batch: int, length: int) -> DenseCausalAttention:
        """``batch`` sequences of ``length`` tokens each."""
        return DenseCausalAttention([length] * batch)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; ``layer_id`` is unused (no cache)."""
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"attention got {q.shape[0]} tokens; planned for {self.num_tokens} ({self.seq_lens})")
        if len(set(self.seq_lens)) == 1:
            return self._batched(q, k, v, len(self.seq_lens))
        parts = zip(q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens))
        return torch.cat([self._batched(qs, ks, vs, 1) for qs, ks, vs in parts])

    @staticmethod
    def _batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int) -> torch.Tensor:
        t, hq, d = q.shape
        groups = hq // k.shape[1]
        qb, kb, vb = (x.reshape(batch, t // batch, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qb, _expand_kv(kb, groups), _expand_kv(vb, groups),
                                             is_causal=True, scale=d ** -0.5)
        return out.transpose(1, 2).reshape(t, hq, d)
