"""Backend-neutral metadata of one forward over a flattened ragged batch of requests.

A forward carries `T` new tokens from `B` requests, request-major: request `b` brings
`qo_lens[b]` new tokens that follow `cached_lens[b]` tokens already in its KV pages. New token `i`
of request `b` sits at KV index `cached_lens[b] + i` and attends causally to KV indices
`0 .. cached_lens[b] + i` of its own request (the cached prefix and the earlier new tokens).

The metadata holds both forms a backend may want:
- per request: `cached_lens`, `seq_lens` (= cached + new), and `out_slots` (flat KV slot of every
  new token, where the backend writes its K/V);
- flashinfer's paged-KV CSR layout: `qo_indptr` [B+1], `kv_indptr` [B+1] into `kv_page_indices`
  [nnz pages], `kv_last_page_len` [B] (tokens used in each request's last page, 1..page_size).

Device tensors are int32 except `out_slots` (int64, for `index_copy_`). Host copies of the
per-request lengths sit in `host_*` lists, so planning needs no device-to-host sync.
With `MetadataBuffers`, every device tensor is a view into a pre-allocated buffer (same address
every forward: what a CUDA-graph runner needs); without, they are freshly allocated.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class ForwardMode(enum.Enum):
    """What a forward does; the reference backend treats all modes alike (causal over new tokens)."""

    EXTEND = "extend"            # prefill / extend: any number of new tokens per request
    DECODE = "decode"            # exactly one new token per request (draft steps, plain decode)
    VERIFY = "verify"            # steps+1 new tokens per request, causal among them
    DRAFT_EXTEND = "draft_extend"  # draft head over the accepted tokens (1..steps+1 per request)


@dataclass
class AttnMetadata:
    """Everything an attention backend needs for one forward (the same for every layer)."""

    mode: ForwardMode
    page_size: int
    batch_size: int
    num_tokens: int
    qo_indptr: torch.Tensor        # [B+1] int32: new tokens of request b are qo_indptr[b]:[b+1]
    kv_indptr: torch.Tensor        # [B+1] int32: pages of request b are kv_page_indices[kv_indptr[b]:[b+1]]
    kv_page_indices: torch.Tensor  # [nnz] int32
    kv_last_page_len: torch.Tensor  # [B] int32, in 1..page_size
    cached_lens: torch.Tensor      # [B] int32: KV tokens before this forward
    seq_lens: torch.Tensor         # [B] int32: KV tokens after this forward
    out_slots: torch.Tensor        # [T] int64: flat slot of every new token
    host_qo_lens: list[int]
    host_cached_lens: list[int]
    host_seq_lens: list[int]

    @property
    def max_qo_len(self) -> int:
        """Most new tokens any request brings."""
        return max(self.host_qo_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        """Longest KV length after the forward."""
        return max(self.host_seq_lens, default=0)


@dataclass
class MetadataBuffers:
    """Pre-allocated device buffers that `build_metadata` fills (fixed addresses across forwards)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_page_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    cached_lens: torch.Tensor
    seq_lens: torch.Tensor
    out_slots: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, max_tokens: int, max_pages: int,
                 device: torch.device | str) -> "MetadataBuffers":
        """Buffers for up to `max_batch` requests, `max_tokens` new tokens, `max_pages` pages."""
        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)
        return cls(qo_indptr=i32(max_batch + 1), kv_indptr=i32(max_batch + 1),
                   kv_page_indices=i32(max_pages), kv_last_page_len=i32(max_batch),
                   cached_lens=i32(max_batch), seq_lens=i32(max_batch),
                   out_slots=torch.zeros(max_tokens, dtype=torch.int64, device=device))

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(t.numel() * t.element_size() for t in vars(self).values())


def _prefix_sum(values: Sequence[int]) -> list[int]:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return out


def _put(buf: torch.Tensor | None, values: list[int], dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    """`values` as a device tensor: a view into `buf` if given, else a new tensor."""
    host = torch.tensor(values, dtype=dtype)
    if buf is None:
        return host.to(device)
    if len(values) > buf.numel():
        raise RuntimeError(f"metadata buffer too small: need {len(values)}, have {buf.numel()}")
    view = buf[:len(values)]
    view.copy_(host, non_blocking=True)
    return view


def build_metadata(mode: ForwardMode, page_tables: Sequence[Sequence[int]],
                   cached_lens: Sequence[int], qo_lens: Sequence[int], page_size: int,
                   device: torch.device | str = "cpu",
                   out: MetadataBuffers | None = None) -> AttnMetadata:
    """Metadata for requests with `page_tables` (already grown to hold the new tokens).

    `cached_lens[b]` tokens of request b are in the cache; `qo_lens[b]` new tokens follow them.
    """
    device = torch.device(device)
    seq_lens = [c + n for c, n in zip(cached_lens, qo_lens)]
    used = [list(table[:-(-s // page_size)]) for table, s in zip(page_tables, seq_lens)]
    for b, (table, s) in enumerate(zip(used, seq_lens)):
        if len(table) * page_size < s:
            raise RuntimeError(f"request {b}: {len(table)} pages cannot hold {s} tokens")
    slots = [table[i // page_size] * page_size + i % page_size
             for table, c, n in zip(used, cached_lens, qo_lens) for i in range(c, c + n)]
    i32, i64 = torch.int32, torch.int64

    def buf(name: str) -> torch.Tensor | None:
        return None if out is None else getattr(out, name)

    return AttnMetadata(
        mode=mode, page_size=page_size, batch_size=len(seq_lens), num_tokens=len(slots),
        qo_indptr=_put(buf("qo_indptr"), _prefix_sum(qo_lens), i32, device),
        kv_indptr=_put(buf("kv_indptr"), _prefix_sum(len(t) for t in used), i32, device),
        kv_page_indices=_put(buf("kv_page_indices"), [p for t in used for p in t], i32, device),
        kv_last_page_len=_put(buf("kv_last_page_len"),
                              [(s - 1) % page_size + 1 if s else 0 for s in seq_lens], i32, device),
        cached_lens=_put(buf("cached_lens"), list(cached_lens), i32, device),
        seq_lens=_put(buf("seq_lens"), seq_lens, i32, device),
        out_slots=_put(buf("out_slots"), slots, i64, device),
        host_qo_lens=list(qo_lens), host_cached_lens=list(cached_lens), host_seq_lens=seq_lens)


class LayerAttention(Protocol):
    """What a model's attention layer calls: the per-forward object bound to one metadata."""

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Write `k`, `v` [T, Hkv, D] of layer `layer_id` into the cache; attention for `q` [T, Hq, D]."""
        ...


class AttentionBackend(Protocol):
    """An attention implementation over a `KVCache`."""

    name: str

    def plan(self, meta: AttnMetadata, cache: "object") -> LayerAttention:
        """Prepare one forward (everything shared by its layers) and return the per-layer callable."""
        ...
