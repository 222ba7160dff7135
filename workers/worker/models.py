"""What one rank's worker runs: the target and its draft head, their KV pools, the attention.

Ragged forwards (a large prefill) plan their attention through the configured
`attention_backend`; padded forwards (the round's phases, the padded prefill, the catch-up) through
the static backend, capturable, over the pages the slot state hands them.
"""
from __future__ import annotations

from typing import Any

import torch

from workers.attention import PaddedBatch, StaticBackend
from workers.attention.base import AttentionBackend
from workers.config import EngineConfig
from workers.kv_cache import KVPool


class RankModels:
    """The target and the head (None: no speculation) of one rank, with a KV pool each (the
    head's only when the config speculates) holding this rank's KV heads."""

    def __init__(self, target: torch.nn.Module, head: torch.nn.Module | None,
                 config: EngineConfig, backend: AttentionBackend, device: torch.device) -> None:
        self.target, self.head, self.backend = target, head, backend
        self.config, self.device = config, device
        self.static = StaticBackend()
        attn_tp = target.par.attn.size
        self.target_kv = self._pool(target, attn_tp)
        self.draft_kv = self._pool(head, attn_tp) if config.speculative else None

    def _pool(self, model: torch.nn.Module, attn_tp: int) -> KVPool:
        """A pool for `model`'s layers holding this rank's KV heads (in the backend's format)."""
        cfg, dtype = model.config, next(model.parameters()).dtype
        head_dim = cfg.head_dim
        kv_format = getattr(self.backend, "kv_format", None)
        if kv_format is not None:  # flashinfer: padded head dim, float16/bfloat16
            head_dim, dtype = kv_format(head_dim, dtype)
        return KVPool(model.num_layers, self.config.pool_pages, self.config.page_size,
                      cfg.num_key_value_heads // attn_tp, head_dim, dtype=dtype, device=self.device)

    @property
    def speculative(self) -> bool:
        """Whether the head runs (a head, and a config that speculates)."""
        return self.head is not None and self.config.speculative

    def padded_attn(self, pool: KVPool, pages: torch.Tensor, cached: torch.Tensor,
                    qo_len: torch.Tensor, width: int) -> Any:
        """The static backend's attention over `pool` for rows of `width` query slots: each
        row's pages, tokens already cached and real queries."""
        return self.static.plan(PaddedBatch(pages, cached, qo_len, width), pool)
