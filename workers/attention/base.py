"""The attention contract: one backend protocol, two kinds of per-forward metadata.

A forward carries new tokens of `B` requests; request `b` brings `qo_len[b]` new tokens that follow
`cached[b]` tokens already in its KV pages. New token `i` of request `b` sits at KV index
`cached[b] + i` and attends causally to KV indices `0 .. cached[b] + i` of its own request.

Two layouts of the same contract:
- **ragged** (`AttnMetadata`, built on the host by `build_metadata`): tokens flattened
  request-major, any number per request (prefill). It carries flashinfer's paged CSR layout
  (`qo_indptr`, `kv_indptr` into `kv_page_indices`, `kv_last_page_len`) plus per-request lengths
  and the flat slot of every new token; host copies of the lengths let a backend plan without a
  device sync. Backends: `torch` (reference) and `flashinfer` (GPU).
- **padded** (`PaddedBatch`, device tensors only): `B` rows by a fixed `width` of token slots, each
  row's page table padded to a fixed reach, so every shape is fixed and the forward can be captured
  in a CUDA graph (draft steps, verify, draft-extend). Rows beyond a request's `qo_len`, and whole
  dummy rows, write into the dummy page and their outputs are dropped. Backend: `static`.

A forward may carry more token rows than its metadata describes (the round pads every forward to
the size agreed across DP replicas); the extra rows come last, are never written to the cache and
return zeros (`padded_forward`). `forward_last` (attention for each request's last new token only)
follows the same rule for its query rows (`padded_last`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch


class ForwardMode(enum.Enum):
    """What a forward does; the backends treat every mode as causal over its new tokens."""

    EXTEND = "extend"            # prefill / extend: any number of new tokens per request
    DECODE = "decode"            # exactly one new token per request (draft steps, plain decode)
    VERIFY = "verify"            # steps+1 new tokens per request, causal among them
    DRAFT_EXTEND = "draft_extend"  # draft head over the accepted tokens (1..steps+1 per request)


class LayerAttention(Protocol):
    """What a model's attention layer calls: the per-forward object bound to one metadata."""

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Write `k`, `v` [T, Hkv, D] of layer `layer_id` into the cache; attention for `q`
        [T, Hq, D] -> [T, Hq, D]."""
        ...

    def forward_last(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        """Write `k`, `v` [T, Hkv, D] as `forward` does; attention for the last new token of
        each request only: `q` [R, Hq, D] holds those tokens' queries in request order (rows
        beyond the metadata's requests: agreed padding, zeros out) -> [R, Hq, D]. For a layer
        whose other rows' outputs nobody reads (a draft head's last layer at prefill and
        draft-extend: only each request's last output becomes its next feature)."""
        ...


class AttentionBackend(Protocol):
    """An attention implementation over a `KVPool`."""

    name: str

    def plan(self, meta: Any, pool: Any) -> LayerAttention:
        """Prepare one forward (everything its layers share) and return the per-layer callable."""
        ...


@dataclass
class AttnMetadata:
    """A ragged forward (the same for every layer)."""

    mode: ForwardMode
    page_size: int
    batch_size: int
    num_tokens: int
    qo_indptr: torch.Tensor        # [B+1] int32: new tokens of request b are qo_indptr[b]:[b+1]
    kv_indptr: torch.Tensor        # [B+1] int32: pages of request b: kv_page_indices[kv_indptr[b]:[b+1]]
    kv_page_indices: torch.Tensor  # [nnz] int32
    kv_last_page_len: torch.Tensor  # [B] int32, in 1..page_size
    cached_lens: torch.Tensor      # [B] int32: KV tokens before this forward
    seq_lens: torch.Tensor         # [B] int32: KV tokens after this forward
    out_slots: torch.Tensor        # [T] int64: flat slot of every new token
    host_qo_lens: list[int]
    host_cached_lens: list[int]
    host_seq_lens: list[int]
    host_pages: list[list[int]]    # the pages each request uses in this forward

    @property
    def max_qo_len(self) -> int:
        """Most new tokens any request brings."""
        return max(self.host_qo_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        """Longest KV length after the forward."""
        return max(self.host_seq_lens, default=0)


@dataclass
class PaddedBatch:
    """A padded forward: `page_tab` [B, P] int64 (page ids, dummy page beyond a request's own),
    `cached` [B] and `qo_len` [B] int64 (0 for a dummy row), `width` token slots per row."""

    page_tab: torch.Tensor
    cached: torch.Tensor
    qo_len: torch.Tensor
    width: int

    @property
    def batch(self) -> int:
        return self.page_tab.shape[0]


def _prefix_sum(values: Sequence[int]) -> list[int]:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return out


def build_metadata(mode: ForwardMode, page_tables: Sequence[Sequence[int]],
                   cached_lens: Sequence[int], qo_lens: Sequence[int], page_size: int,
                   device: torch.device | str = "cpu") -> AttnMetadata:
    """Ragged metadata for requests whose `page_tables` hold at least their new tokens.

    `cached_lens[b]` tokens of request b are in the cache; `qo_lens[b]` new tokens follow them.
    """
    seq_lens = [c + n for c, n in zip(cached_lens, qo_lens)]
    used = [list(table[:-(-s // page_size)]) for table, s in zip(page_tables, seq_lens)]
    for b, (table, s) in enumerate(zip(used, seq_lens)):
        if len(table) * page_size < s:
            raise RuntimeError(f"request {b}: {len(table)} pages cannot hold {s} tokens")
    slots = [table[i // page_size] * page_size + i % page_size
             for table, c, n in zip(used, cached_lens, qo_lens) for i in range(c, c + n)]

    fields = [_prefix_sum(qo_lens), _prefix_sum([len(t) for t in used]),
              [p for t in used for p in t],
              [(s - 1) % page_size + 1 if s else 0 for s in seq_lens], list(cached_lens), seq_lens,
              slots]
    qo_indptr, kv_indptr, pages, last_len, cached, seqs, out_slots = upload(device, *fields)
    i32 = torch.int32
    return AttnMetadata(
        mode=mode, page_size=page_size, batch_size=len(seq_lens), num_tokens=len(slots),
        qo_indptr=qo_indptr.to(i32), kv_indptr=kv_indptr.to(i32), kv_page_indices=pages.to(i32),
        kv_last_page_len=last_len.to(i32), cached_lens=cached.to(i32), seq_lens=seqs.to(i32),
        out_slots=out_slots,
        host_qo_lens=list(qo_lens), host_cached_lens=list(cached_lens), host_seq_lens=seq_lens,
        host_pages=used)


def upload(device: torch.device | str, *lists: Sequence, dtype: torch.dtype = torch.int64
           ) -> list[torch.Tensor]:
    """Host lists as 1-D tensors of `dtype` on `device`, in one copy: staged in pinned memory on
    CUDA, so the host does not wait for the device (no synchronisation)."""
    host = torch.tensor([x for values in lists for x in values], dtype=dtype)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    return list(flat.split([len(values) for values in lists]))


def gather_kv(pages: torch.Tensor, slots: torch.Tensor, num_q_heads: int, head_dim: int,
              dtype: torch.dtype) -> torch.Tensor:
    """K or V of every request: `pages` [N, page_size, Hkv, Ds] read at flat `slots` [B, L] ->
    [B, Hq, L, head_dim] in `dtype` (stored channels beyond `head_dim` dropped, KV heads repeated
    for grouped-query attention)."""
    flat = pages.view(-1, pages.shape[2], pages.shape[3])
    out = flat[slots][..., :head_dim].to(dtype).transpose(1, 2)    # [B, Hkv, L, D]
    groups = num_q_heads // out.shape[1]
    return out.repeat_interleave(groups, dim=1) if groups > 1 else out


def padded_forward(num_tokens: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                   ) -> torch.Tensor:
    """`run` on the first `num_tokens` rows; rows beyond them (agreed padding) return zeros."""
    if q.shape[0] == num_tokens:
        return run(q, k, v)
    out = q.new_zeros(q.shape)
    if num_tokens:
        out[:num_tokens] = run(q[:num_tokens], k[:num_tokens], v[:num_tokens])
    return out


def padded_last(meta: AttnMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                store: Callable[[torch.Tensor, torch.Tensor], None],
                attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`forward_last` of a ragged forward: `store` the K/V of the metadata's tokens, `attend` the
    queries of its requests' last tokens (`q`'s first `batch_size` rows); rows beyond them (agreed
    padding) return zeros."""
    tokens, requests = meta.num_tokens, meta.batch_size
    if tokens:
        store(k[:tokens], v[:tokens])
    if q.shape[0] == requests and tokens:
        return attend(q)
    out = q.new_zeros(q.shape)
    if tokens and requests:
        out[:requests] = attend(q[:requests])
    return out
