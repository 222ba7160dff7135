"""Paged KV cache bookkeeping and the torch reference attention backend over it.

The backend is checked against an independent dense computation (explicit softmax over each
request's whole un-paged K/V history) through prefill, decode, multi-token verify with rejection
(truncate), and interleaved requests whose pages are fragmented across the pool.
"""
from __future__ import annotations

import random

import pytest
import torch

from workers.attention import ForwardMode, MetadataBuffers, build_metadata, make_backend
from workers.attention.torch_backend import TorchBackend
from workers.kv_cache import KVCache, KVCacheFullError, RequestTooLargeError, pages_for


def _cache(num_pages: int = 32, page_size: int = 4, layers: int = 2, hkv: int = 2,
           dim: int = 8, dtype: torch.dtype = torch.float64) -> KVCache:
    return KVCache(layers, num_pages, page_size, hkv, dim, dtype=dtype)


# ---- bookkeeping ---------------------------------------------------------------------------

def test_extend_truncate_free_page_accounting() -> None:
    cache = _cache(num_pages=8, page_size=4)
    cache.admit(7, max_tokens=20)  # 5 pages reserved
    assert cache.num_available_pages == 3 and cache.num_free_pages == 8
    cache.extend(7, 9)             # 3 pages
    assert cache.seq_len(7) == 9 and len(cache.page_table(7)) == 3
    assert cache.num_free_pages == 5 and cache.num_available_pages == 3
    cache.truncate(7, 4)           # back to 1 page; the other 2 stay reserved for request 7
    assert len(cache.page_table(7)) == 1 and cache.num_free_pages == 7
    assert cache.num_available_pages == 3
    assert cache.slots(7, 0, 4) == [cache.page_table(7)[0] * 4 + i for i in range(4)]
    with pytest.raises(KVCacheFullError, match="beyond its reservation"):
        cache.extend(7, 17)
    cache.free(7)
    cache.check_empty()


def test_admission_waits_when_full_and_refuses_what_never_fits() -> None:
    cache = _cache(num_pages=4, page_size=4)
    cache.admit(0, 12)
    assert not cache.can_admit(5)   # 2 pages needed, 1 available
    assert cache.can_admit(4)
    with pytest.raises(KVCacheFullError, match="can_admit"):
        cache.admit(1, 5)
    with pytest.raises(RequestTooLargeError, match=r"17 tokens.*only 16 tokens"):
        cache.check_fits(17)
    cache.free(0)
    assert cache.can_admit(16)


def test_truncate_out_of_range_is_refused() -> None:
    cache = _cache()
    cache.admit(1, 8)
    cache.extend(1, 3)
    with pytest.raises(RuntimeError, match="outside"):
        cache.truncate(1, 4)


def test_every_page_back_after_random_requests() -> None:
    rng = random.Random(1234)
    cache = _cache(num_pages=40, page_size=4, layers=1)
    live: dict[int, int] = {}  # rid -> max tokens
    next_rid = 0
    for _ in range(3000):
        action = rng.random()
        if action < 0.25:
            max_tokens = rng.randint(1, 60)
            if cache.can_admit(max_tokens):
                cache.admit(next_rid, max_tokens)
                live[next_rid] = max_tokens
                next_rid += 1
        elif live and action < 0.7:
            rid = rng.choice(sorted(live))
            room = live[rid] - cache.seq_len(rid)
            if room:
                cache.extend(rid, rng.randint(1, room))
        elif live and action < 0.9:
            rid = rng.choice(sorted(live))
            cache.truncate(rid, rng.randint(0, cache.seq_len(rid)))
        elif live:
            rid = rng.choice(sorted(live))
            cache.free(rid)
            del live[rid]
        held = [p for rid in live for p in cache.page_table(rid)]
        assert len(held) == len(set(held)), "a page is owned twice"
        assert len(held) + cache.num_free_pages == cache.num_pages
    assert next_rid > 100
    for rid in list(live):
        cache.free(rid)
    cache.check_empty()


# ---- metadata ------------------------------------------------------------------------------

def test_metadata_csr_layout() -> None:
    meta = build_metadata(ForwardMode.VERIFY, [[5, 2], [7, 1, 3]], cached_lens=[3, 6],
                          qo_lens=[2, 3], page_size=4)
    assert meta.qo_indptr.tolist() == [0, 2, 5]
    assert meta.kv_indptr.tolist() == [0, 2, 5]
    assert meta.kv_page_indices.tolist() == [5, 2, 7, 1, 3]
    assert meta.kv_last_page_len.tolist() == [1, 1]
    assert meta.seq_lens.tolist() == [5, 9]
    assert meta.out_slots.tolist() == [5 * 4 + 3, 2 * 4 + 0, 1 * 4 + 2, 1 * 4 + 3, 3 * 4 + 0]
    assert meta.num_tokens == 5 and meta.batch_size == 2


def test_metadata_into_buffers_keeps_addresses() -> None:
    bufs = MetadataBuffers.allocate(max_batch=4, max_tokens=16, max_pages=16, device="cpu")
    first = build_metadata(ForwardMode.DECODE, [[0], [1, 2]], [2, 5], [1, 1], 4, out=bufs)
    second = build_metadata(ForwardMode.DECODE, [[3, 4]], [6], [1], 4, out=bufs)
    assert first.out_slots.data_ptr() == second.out_slots.data_ptr() == bufs.out_slots.data_ptr()
    assert second.kv_page_indices.tolist() == [3, 4]
    with pytest.raises(RuntimeError, match="buffer too small"):
        build_metadata(ForwardMode.EXTEND, [[0, 1, 2, 3, 4]], [0], [17], 4, out=bufs)


# ---- attention against a dense reference ---------------------------------------------------

def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int) -> torch.Tensor:
    """Causal attention of new queries [n, Hq, D] over the whole history k, v [L, Hkv, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    allowed = torch.arange(k.shape[0])[None, :] <= (cached + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class _Harness:
    """Requests with a dense K/V history each, run through the paged cache and the backend."""

    def __init__(self, cache: KVCache, hq: int, seed: int) -> None:
        self.cache, self.hq = cache, hq
        self.gen = torch.Generator().manual_seed(seed)
        self.hist: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def new(self, rid: int, max_tokens: int) -> None:
        self.cache.admit(rid, max_tokens)
        self.hist[rid] = [(torch.empty(0, self.cache.num_kv_heads, self.cache.head_dim,
                                       dtype=torch.float64),) * 2
                          for _ in range(self.cache.num_layers)]

    def forward(self, mode: ForwardMode, rids: list[int], qo_lens: list[int]) -> None:
        cache, dim, hkv = self.cache, self.cache.head_dim, self.cache.num_kv_heads
        cached = [cache.seq_len(r) for r in rids]
        for rid, n in zip(rids, qo_lens):
            cache.extend(rid, n)
        meta = build_metadata(mode, [cache.page_table(r) for r in rids], cached, qo_lens,
                              cache.page_size)
        attn = TorchBackend().plan(meta, cache)
        total = sum(qo_lens)
        for layer in range(cache.num_layers):
            q, k, v = (torch.randn(total, h, dim, generator=self.gen, dtype=torch.float64)
                       for h in (self.hq, hkv, hkv))
            out = attn.forward(layer, q, k, v)
            start = 0
            for rid, c, n in zip(rids, cached, qo_lens):
                hk, hv = self.hist[rid][layer]
                hk, hv = torch.cat([hk, k[start:start + n]]), torch.cat([hv, v[start:start + n]])
                self.hist[rid][layer] = (hk, hv)
                want = _dense(q[start:start + n], hk, hv, c)
                torch.testing.assert_close(out[start:start + n], want, rtol=1e-10, atol=1e-10)
                start += n

    def truncate(self, rid: int, new_len: int) -> None:
        self.cache.truncate(rid, new_len)
        self.hist[rid] = [(k[:new_len], v[:new_len]) for k, v in self.hist[rid]]


@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_torch_backend_matches_dense_through_prefill_decode_verify(hq: int, hkv: int) -> None:
    rng = random.Random(hq)
    cache = _cache(num_pages=64, page_size=4, layers=2, hkv=hkv)
    h = _Harness(cache, hq, seed=hq)
    rids = [0, 1, 2]
    for rid in rids:
        h.new(rid, 60)
    h.forward(ForwardMode.EXTEND, rids, [7, 1, 12])            # ragged prefill
    for _ in range(3):
        h.forward(ForwardMode.DECODE, rids, [1, 1, 1])
    for _ in range(4):                                        # verify 4, keep a random prefix
        before = [cache.seq_len(r) for r in rids]
        h.forward(ForwardMode.VERIFY, rids, [4, 4, 4])
        for rid, b in zip(rids, before):
            h.truncate(rid, b + rng.randint(1, 4))
    h.forward(ForwardMode.DRAFT_EXTEND, rids, [2, 3, 1])


def test_torch_backend_with_fragmented_pages() -> None:
    """Requests that come and go leave holes; a new request's pages are scattered."""
    cache = _cache(num_pages=24, page_size=2, layers=1, hkv=1)
    h = _Harness(cache, hq=2, seed=5)
    for rid in range(4):
        h.new(rid, 10)
        h.forward(ForwardMode.EXTEND, [rid], [3 + rid])
    cache.free(1)
    cache.free(3)
    h.hist.pop(1)
    h.hist.pop(3)
    h.new(9, 16)
    h.forward(ForwardMode.EXTEND, [9, 0, 2], [11, 2, 1])
    assert cache.page_table(9) != sorted(cache.page_table(9)), "pages should be scattered"
    h.forward(ForwardMode.VERIFY, [9, 0, 2], [3, 3, 3])


def test_unknown_backend_and_flashinfer_without_gpu_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'paged'.*torch, flashinfer"):
        make_backend("paged", "cpu")
    with pytest.raises(ValueError, match="flashinfer' needs a CUDA GPU"):
        make_backend("flashinfer", "cpu")


def test_pages_for() -> None:
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
