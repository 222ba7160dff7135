"""The paged KV cache, in two parts with two owners.

- `PageAllocator` (host bookkeeping, owned by the scheduler: admission is a scheduling decision).
  A request is given, at admission, every page it can ever need (its prompt, its `max_new_tokens`
  and the deepest tier's speculative overshoot); they stay its own until it is retired. So a
  running request never runs out of pages mid-round, the page table of a request never changes
  while it runs (the device can keep it), and rejected draft tokens need no bookkeeping: the next
  round overwrites their slots. Page 0 is never handed out: it is the dummy page that padded rows
  (dummy requests of an agreed batch shape) write into.
- `KVPool` (device tensors, owned by the worker): per layer `k[layer]`, `v[layer]` of shape
  `[num_pages, page_size, num_kv_heads, head_dim]`. Token `i` of a request lives in flat slot
  `pages[i // page_size] * page_size + i % page_size` of the `[num_pages * page_size, ...]` view.
  The target and the draft head have a pool each, indexed by the same page tables.

Under attention tensor parallelism every rank of a replica holds a pool of its own KV heads with
the same page tables (its replica's requests); nothing here communicates.
"""
from __future__ import annotations

import torch

from workers import kernels

DUMMY_PAGE = 0


class RequestTooLargeError(ValueError):
    """A request needs more KV pages than the whole pool holds: it could never be admitted."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class PageAllocator:
    """Hands out whole page tables at admission and takes them back at retirement (host only)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        for key, value in (("num_pages", num_pages), ("page_size", page_size)):
            if value < 1:
                raise ValueError(f"PageAllocator {key}={value}: must be >= 1")
        if num_pages < 2:
            raise ValueError(f"PageAllocator num_pages={num_pages}: needs >= 2 (page "
                             f"{DUMMY_PAGE} is the dummy page)")
        self.num_pages, self.page_size = num_pages, page_size
        # NOTE: pop() from the end hands out low page ids first, which keeps tests readable.
        self._free: list[int] = [p for p in range(num_pages - 1, -1, -1) if p != DUMMY_PAGE]
        self._tables: dict[int, list[int]] = {}

    @property
    def usable_pages(self) -> int:
        """Pages requests can ever hold (all but the dummy page)."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages no request holds."""
        return len(self._free)

    def check_fits(self, max_tokens: int) -> None:
        """Raise `RequestTooLargeError` if `max_tokens` could never fit, even in an empty pool."""
        need = pages_for(max_tokens, self.page_size)
        if need > self.usable_pages:
            raise RequestTooLargeError(
                f"request needs up to {max_tokens} tokens of KV cache ({need} pages of "
                f"{self.page_size}), but the pool holds only {self.usable_pages * self.page_size} "
                f"tokens ({self.usable_pages} usable pages); shorten the prompt or max_new_tokens, "
                f"or enlarge the pool")

    def can_allocate(self, max_tokens: int) -> bool:
        """Whether a request that may grow to `max_tokens` tokens can be admitted now."""
        return pages_for(max_tokens, self.page_size) <= len(self._free)

    def allocate(self, rid: int, max_tokens: int) -> list[int]:
        """The page table of request `rid` (every page it may need); a copy is returned."""
        if rid in self._tables:
            raise KeyError(f"request {rid} already holds pages")
        self.check_fits(max_tokens)
        need = pages_for(max_tokens, self.page_size)
        if need > len(self._free):
            raise RuntimeError(f"request {rid}: {need} pages asked, {len(self._free)} free; "
                               "check can_allocate() first")
        self._tables[rid] = [self._free.pop() for _ in range(need)]
        return list(self._tables[rid])

    def holds(self, rid: int) -> bool:
        """Whether request `rid` holds pages."""
        return rid in self._tables

    def free(self, rid: int) -> None:
        """Give back every page request `rid` holds."""
        self._free.extend(reversed(self._tables.pop(rid)))

    def check_empty(self) -> None:
        """Raise if any request still holds pages (a leak)."""
        if self._tables or len(self._free) != self.usable_pages:
            raise AssertionError(f"KV pages not all back: {len(self._tables)} requests hold "
                                 f"{self.usable_pages - len(self._free)} pages")


class KVPool:
    """K/V tensors of `num_layers` attention layers (the target's, or the draft head's)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        for key, value in (("num_layers", num_layers), ("num_pages", num_pages),
                           ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                           ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"KVPool {key}={value}: must be >= 1")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k`, `v` (`[T, Hkv, D]`, D <= head_dim: a pool in a kernel's format may store
        zero channels beyond the model's) of layer `layer` into flat slots `slots` (`[T]`)."""
        flat_k = self.k[layer].view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v[layer].view(-1, self.num_kv_heads, self.head_dim)
        if kernels.enabled(k):  # both in one launch
            kernels.store_kv(flat_k, flat_v, slots, k, v)
            return
        flat_k.index_copy_(0, slots, _pad_channels(k, self.head_dim).to(flat_k.dtype))
        flat_v.index_copy_(0, slots, _pad_channels(v, self.head_dim).to(flat_v.dtype))


def _pad_channels(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))
