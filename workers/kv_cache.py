"""Paged KV cache: a pool of fixed-size pages, per-request page tables, per-layer K/V tensors.

Layout of one layer: `k[layer]` and `v[layer]` are `[num_pages, page_size, num_kv_heads, head_dim]`.
Token `i` of a request lives in slot `page_table[i // page_size] * page_size + i % page_size`
of the flattened `[num_pages * page_size, num_kv_heads, head_dim]` view.

Admission reserves the worst case a request can ever hold (`admit(rid, max_tokens)`), so a running
request never runs out of pages mid-round: the scheduler makes new requests wait while
`can_admit` is false, and `admit` refuses one that could never fit with a clear error. Pages are
allocated lazily inside that reservation (`extend`) and handed back by `truncate` (rejected draft
tokens, every round) and `free` (finished requests).

Under tensor parallelism every rank of the TP group holds a cache of its own KV heads with the same
page tables (the same requests run on every TP rank); nothing here communicates.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class KVCacheFullError(RuntimeError):
    """An allocation went beyond a request's reservation (a bug in the caller, never user input)."""


class RequestTooLargeError(ValueError):
    """A request needs more KV pages than the whole pool holds: it could never be admitted."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


@dataclass
class _Entry:
    """Host bookkeeping of one request: its pages, its length, its reservation (in pages)."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    reserved: int = 0


class KVCache:
    """A paged K/V pool for `num_layers` attention layers (the target's, or the draft head's one).

    All bookkeeping is on the host; only `k`/`v` live on `device`.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        for key, value in (("num_layers", num_layers), ("num_pages", num_pages),
                           ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                           ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"KVCache {key}={value}: must be >= 1")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        # NOTE: pop() from the end hands out low page ids first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._entries: dict[int, _Entry] = {}
        self._unused_reservation = 0  # reserved pages not yet allocated, summed over requests

    # ---- capacity -------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        """Pages on the free list (some may be promised to admitted requests)."""
        return len(self._free)

    @property
    def num_available_pages(self) -> int:
        """Pages neither allocated nor promised: what a new admission can reserve."""
        return len(self._free) - self._unused_reservation

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def can_admit(self, max_tokens: int) -> bool:
        """Whether a request that may grow to `max_tokens` tokens can be admitted now."""
        return pages_for(max_tokens, self.page_size) <= self.num_available_pages

    @property
    def usable_pages(self) -> int:
        """Pages requests can ever hold: all but those of internal entries (rid < 0, such as
        the CUDA-graph runner's dummy page), which are never given back while the pool lives."""
        return self.num_pages - sum(e.reserved for rid, e in self._entries.items() if rid < 0)

    def check_fits(self, max_tokens: int) -> None:
        """Raise `RequestTooLargeError` if `max_tokens` could never fit, even in an empty pool."""
        need = pages_for(max_tokens, self.page_size)
        usable = self.usable_pages
        if need > usable:
            raise RequestTooLargeError(
                f"request needs up to {max_tokens} tokens of KV cache ({need} pages of "
                f"{self.page_size}), but the pool holds only {usable * self.page_size} tokens "
                f"({usable} usable pages); shorten the prompt or max_new_tokens, or enlarge the pool")

    # ---- per request ----------------------------------------------------------------------
    def admit(self, rid: int, max_tokens: int) -> None:
        """Reserve pages for request `rid`, which will never hold more than `max_tokens` tokens."""
        if rid in self._entries:
            raise KeyError(f"request {rid} is already in the KV cache")
        self.check_fits(max_tokens)
        if not self.can_admit(max_tokens):
            raise KVCacheFullError(f"request {rid}: no room for {max_tokens} tokens now; "
                                   "check can_admit() first")
        reserved = pages_for(max_tokens, self.page_size)
        self._entries[rid] = _Entry(reserved=reserved)
        self._unused_reservation += reserved

    def has(self, rid: int) -> bool:
        """Whether request `rid` holds a reservation."""
        return rid in self._entries

    def seq_len(self, rid: int) -> int:
        """Tokens request `rid` holds."""
        return self._entries[rid].length

    def page_table(self, rid: int) -> list[int]:
        """Page ids of request `rid`, in token order (a copy)."""
        return list(self._entries[rid].pages)

    def extend(self, rid: int, num_tokens: int) -> None:
        """Grow request `rid` by `num_tokens` tokens, allocating pages inside its reservation."""
        entry = self._entries[rid]
        need = pages_for(entry.length + num_tokens, self.page_size) - len(entry.pages)
        if len(entry.pages) + need > entry.reserved:
            raise KVCacheFullError(
                f"request {rid}: growing to {entry.length + num_tokens} tokens needs "
                f"{len(entry.pages) + need} pages, beyond its reservation of {entry.reserved}")
        for _ in range(need):
            entry.pages.append(self._free.pop())
        self._unused_reservation -= need
        entry.length += num_tokens

    def truncate(self, rid: int, new_len: int) -> None:
        """Shrink request `rid` to its first `new_len` tokens; pages past them go back to the pool."""
        entry = self._entries[rid]
        if not 0 <= new_len <= entry.length:
            raise RuntimeError(f"request {rid}: truncate to {new_len} outside [0, {entry.length}]")
        keep = pages_for(new_len, self.page_size)
        released = entry.pages[keep:]
        del entry.pages[keep:]
        self._free.extend(reversed(released))
        self._unused_reservation += len(released)  # still reserved for this request
        entry.length = new_len

    def free(self, rid: int) -> None:
        """Release everything request `rid` holds: its pages and its reservation."""
        entry = self._entries.pop(rid)
        self._free.extend(reversed(entry.pages))
        self._unused_reservation -= entry.reserved - len(entry.pages)

    def slots(self, rid: int, start: int, end: int) -> list[int]:
        """Flat slot ids of tokens `start..end-1` of request `rid`."""
        pages, ps = self._entries[rid].pages, self.page_size
        return [pages[i // ps] * ps + i % ps for i in range(start, end)]

    # ---- data -----------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k`, `v` (`[T, Hkv, D]`) of layer `layer` into flat slots `slots` (`[T]`, int64)."""
        flat_k = self.k[layer].view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v[layer].view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, v.to(flat_v.dtype))

    def check_empty(self) -> None:
        """Raise if any request or page is still held (a leak)."""
        if self._entries or len(self._free) != self.num_pages or self._unused_reservation:
            raise AssertionError(
                f"KV cache not empty: {len(self._entries)} requests, "
                f"{self.num_pages - len(self._free)} pages in use, "
                f"{self._unused_reservation} reserved")
