"""The page allocator, the KV pool, and the attention backends over them.

Both backends are checked against an independent dense computation (explicit softmax over each
request's whole un-paged K/V history): the ragged torch backend (prefill) and the padded static
backend (the speculative round's forwards, eager and in CUDA graphs), through prefill, decode,
multi-token verify with rejection (the next forward overwrites rejected slots), dummy rows and
padding, and requests whose pages are fragmented across the pool.
"""
from __future__ import annotations

import random

import pytest
import torch

from workers.attention import ForwardMode, PaddedBatch, StaticBackend, build_metadata, make_backend
from workers.attention.torch_backend import TorchBackend
from workers.kv_cache import DUMMY_PAGE, KVPool, PageAllocator, RequestTooLargeError, pages_for


def _pool(num_pages: int = 32, page_size: int = 4, layers: int = 2, hkv: int = 2,
          dim: int = 8, dtype: torch.dtype = torch.float64) -> KVPool:
    return KVPool(layers, num_pages, page_size, hkv, dim, dtype=dtype)


# ---- bookkeeping ---------------------------------------------------------------------------

def test_allocation_holds_the_worst_case_and_never_the_dummy_page() -> None:
    alloc = PageAllocator(num_pages=8, page_size=4)
    assert alloc.usable_pages == 7 and alloc.num_free_pages == 7
    pages = alloc.allocate(7, max_tokens=20)   # 5 pages
    assert len(pages) == 5 and DUMMY_PAGE not in pages and alloc.num_free_pages == 2
    assert not alloc.can_allocate(9) and alloc.can_allocate(8)
    with pytest.raises(RuntimeError, match="can_allocate"):
        alloc.allocate(8, 9)
    with pytest.raises(KeyError, match="already holds"):
        alloc.allocate(7, 1)
    with pytest.raises(RequestTooLargeError, match=r"29 tokens.*only 28 tokens"):
        alloc.check_fits(29)
    alloc.free(7)
    alloc.check_empty()
    with pytest.raises(ValueError, match="dummy page"):
        PageAllocator(num_pages=1, page_size=4)


def test_every_page_back_after_random_requests() -> None:
    rng = random.Random(1234)
    alloc = PageAllocator(num_pages=40, page_size=4)
    live: dict[int, list[int]] = {}
    for rid in range(3000):
        if rng.random() < 0.5 and alloc.can_allocate(n := rng.randint(1, 60)):
            live[rid] = alloc.allocate(rid, n)
        elif live:
            victim = rng.choice(sorted(live))
            alloc.free(victim)
            del live[victim]
        held = [p for pages in live.values() for p in pages]
        assert len(held) == len(set(held)), "a page is owned twice"
        assert len(held) + alloc.num_free_pages == alloc.usable_pages
    for rid in list(live):
        alloc.free(rid)
    alloc.check_empty()


def test_pool_write_pads_channels_to_the_stored_head_dim() -> None:
    pool = KVPool(1, 4, 2, 1, 8, dtype=torch.float32)
    k = torch.ones(2, 1, 5)
    pool.write(0, torch.tensor([2, 3]), k, 2 * k)
    flat = pool.k[0].view(-1, 1, 8)
    assert flat[2, 0, :5].tolist() == [1.0] * 5 and flat[2, 0, 5:].tolist() == [0.0] * 3
    assert pool.v[0].view(-1, 1, 8)[3, 0, 0] == 2.0


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
    """Requests with a dense K/V history each, run through the paged pool and a backend.

    `static` runs every forward through the padded static backend (rows of `width` token slots,
    plus `dummy_rows` dummy rows); otherwise the ragged torch backend. Padding rows carry random
    q/k/v too: they must change nothing the real rows see.
    """

    def __init__(self, pool: KVPool, alloc: PageAllocator, hq: int, seed: int,
                 static: bool = False, dummy_rows: int = 0) -> None:
        self.pool, self.alloc, self.hq, self.static = pool, alloc, hq, static
        self.dummy_rows = dummy_rows
        self.gen = torch.Generator().manual_seed(seed)
        self.hist: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pages: dict[int, list[int]] = {}

    def new(self, rid: int, max_tokens: int) -> None:
        self.pages[rid] = self.alloc.allocate(rid, max_tokens)
        empty = torch.empty(0, self.pool.num_kv_heads, self.pool.head_dim, dtype=torch.float64)
        self.hist[rid] = [(empty, empty) for _ in range(self.pool.num_layers)]

    def free(self, rid: int) -> None:
        self.alloc.free(rid)
        self.hist.pop(rid)

    def length(self, rid: int) -> int:
        return self.hist[rid][0][0].shape[0]

    def _attn(self, mode: ForwardMode, rids: list[int], cached: list[int], qo_lens: list[int]):
        if not self.static:
            meta = build_metadata(mode, [self.pages[r] for r in rids], cached, qo_lens,
                                  self.pool.page_size)
            return TorchBackend().plan(meta, self.pool), None
        width = max(qo_lens)
        reach = max(len(self.pages[r]) for r in rids)
        table = [self.pages[r] + [DUMMY_PAGE] * (reach - len(self.pages[r])) for r in rids]
        table += [[DUMMY_PAGE] * reach] * self.dummy_rows
        pad = [0] * self.dummy_rows
        meta = PaddedBatch(torch.tensor(table), torch.tensor(cached + pad),
                           torch.tensor(qo_lens + pad), width)
        rows = [b * width + i for b, n in enumerate(qo_lens) for i in range(n)]
        return StaticBackend().plan(meta, self.pool), (len(table) * width, rows)

    def forward(self, mode: ForwardMode, rids: list[int], qo_lens: list[int]) -> None:
        dim, hkv = self.pool.head_dim, self.pool.num_kv_heads
        cached = [self.length(r) for r in rids]
        attn, padded = self._attn(mode, rids, cached, qo_lens)
        total = sum(qo_lens)
        for layer in range(self.pool.num_layers):
            q, k, v = (torch.randn(total, h, dim, generator=self.gen, dtype=torch.float64)
                       for h in (self.hq, hkv, hkv))
            if padded is None:
                out = attn.forward(layer, q, k, v)
            else:  # scatter the real tokens into the padded layout, random padding elsewhere
                size, rows = padded
                full = [torch.randn(size, h, dim, generator=self.gen, dtype=torch.float64)
                        for h in (self.hq, hkv, hkv)]
                for t, x in zip(full, (q, k, v)):
                    t[rows] = x
                out = attn.forward(layer, *full)[rows]
            start = 0
            for rid, c, n in zip(rids, cached, qo_lens):
                hk, hv = self.hist[rid][layer]
                hk, hv = torch.cat([hk, k[start:start + n]]), torch.cat([hv, v[start:start + n]])
                self.hist[rid][layer] = (hk, hv)
                want = _dense(q[start:start + n], hk, hv, c)
                torch.testing.assert_close(out[start:start + n], want, rtol=1e-10, atol=1e-10)
                start += n

    def reject(self, rid: int, new_len: int) -> None:
        """Keep the first `new_len` tokens (the rest are overwritten by the next forward)."""
        self.hist[rid] = [(k[:new_len], v[:new_len]) for k, v in self.hist[rid]]


@pytest.mark.parametrize("static,dummy_rows", [(False, 0), (True, 0), (True, 2)])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_backends_match_dense_through_prefill_decode_verify(hq: int, hkv: int, static: bool,
                                                            dummy_rows: int) -> None:
    rng = random.Random(hq)
    pool = _pool(num_pages=64, page_size=4, layers=2, hkv=hkv)
    h = _Harness(pool, PageAllocator(64, 4), hq, seed=hq, static=static, dummy_rows=dummy_rows)
    rids = [0, 1, 2]
    for rid in rids:
        h.new(rid, 60)
    h.forward(ForwardMode.EXTEND, rids, [7, 1, 12])            # ragged prefill
    for _ in range(3):
        h.forward(ForwardMode.DECODE, rids, [1, 1, 1])
    for _ in range(4):                                        # verify 4, keep a random prefix
        before = [h.length(r) for r in rids]
        h.forward(ForwardMode.VERIFY, rids, [4, 4, 4])
        for rid, b in zip(rids, before):
            h.reject(rid, b + rng.randint(1, 4))
    h.forward(ForwardMode.DRAFT_EXTEND, rids, [2, 3, 1])


@pytest.mark.parametrize("static", [False, True])
def test_backends_with_fragmented_pages(static: bool) -> None:
    """Requests that come and go leave holes; a new request's pages are scattered."""
    pool = _pool(num_pages=24, page_size=2, layers=1, hkv=1)
    alloc = PageAllocator(24, 2)
    h = _Harness(pool, alloc, hq=2, seed=5, static=static)
    for rid in range(4):
        h.new(rid, 10)
        h.forward(ForwardMode.EXTEND, [rid], [3 + rid])
    h.free(1)
    h.free(3)
    h.new(9, 16)
    h.forward(ForwardMode.EXTEND, [9, 0, 2], [11, 2, 1])
    assert h.pages[9] != sorted(h.pages[9]), "pages should be scattered"
    h.forward(ForwardMode.VERIFY, [9, 0, 2], [3, 3, 3])


def test_extra_rows_beyond_the_metadata_return_zeros_and_write_nothing() -> None:
    """A ragged forward padded to the round's agreed size (DP attention)."""
    pool = _pool(num_pages=8, page_size=4, layers=1, hkv=1)
    meta = build_metadata(ForwardMode.EXTEND, [[3, 5]], [0], [5], 4)
    attn = TorchBackend().plan(meta, pool)
    q, k, v = (torch.randn(9, h, 8, dtype=torch.float64) for h in (2, 1, 1))
    before = pool.k[0].clone()
    out = attn.forward(0, q, k, v)
    assert out.shape == q.shape and out[5:].abs().sum() == 0
    written = (pool.k[0] != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert written == [3, 5]  # only the real tokens' pages


def test_unknown_backend_and_flashinfer_without_gpu_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'paged'.*torch, flashinfer"):
        make_backend("paged", "cpu")
    with pytest.raises(ValueError, match="flashinfer' needs a CUDA GPU"):
        make_backend("flashinfer", "cpu")


def test_pages_for() -> None:
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
