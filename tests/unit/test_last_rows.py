"""A draft head's last layer at prefill and draft-extend goes on with each request's last new
token only (`LayerAttention.forward_last`, the `last` argument of the heads): every row's K/V is
still stored, and the rows it keeps must equal those of the full forward. Checked for the
attention backends on their own (padded with dummy rows and padding slots; ragged with agreed
padding rows) and for every head kind over both."""
from __future__ import annotations

import pytest
import torch

from model_fixtures import HEADS, random_head, random_target, target_config
from workers.attention import ForwardMode, PaddedBatch, StaticBackend, build_metadata
from workers.attention.torch_backend import TorchBackend
from workers.kv_cache import DUMMY_PAGE, KVPool, PageAllocator

PAGE = 4
QO = [5, 1, 3]        # new tokens per request
CACHED = [0, 6, 2]    # tokens already in the cache


def _pool(layers: int, hkv: int, dim: int, dtype: torch.dtype = torch.float64) -> KVPool:
    torch.manual_seed(7)
    pool = KVPool(layers, 24, PAGE, hkv, dim, dtype=dtype)
    for t in pool.k + pool.v:
        t.normal_()
    return pool


def _pages() -> list[list[int]]:
    alloc = PageAllocator(24, PAGE)
    return [alloc.allocate(r, c + n + 4) for r, (c, n) in enumerate(zip(CACHED, QO))]


def _plans(pages: list[list[int]], static: bool, extra: int):
    """(a planner of the forward over a fresh pool, the flat index of each request's last new
    token, token rows): padded (width max(QO), `extra` dummy rows) or ragged (`extra` agreed
    padding rows and tokens)."""
    if static:
        width, reach = max(QO), max(len(p) for p in pages)
        table = [p + [DUMMY_PAGE] * (reach - len(p)) for p in pages] + [[DUMMY_PAGE] * reach] * extra
        meta = PaddedBatch(torch.tensor(table), torch.tensor(CACHED + [0] * extra),
                           torch.tensor(QO + [0] * extra), width)
        last = [b * width + max(n - 1, 0) for b, n in enumerate(QO + [0] * extra)]
        return (lambda pool: StaticBackend().plan(meta, pool)), torch.tensor(last), len(table) * width
    meta = build_metadata(ForwardMode.EXTEND, pages, CACHED, QO, PAGE)
    ends = [sum(QO[:b + 1]) - 1 for b in range(len(QO))]
    return (lambda pool: TorchBackend().plan(meta, pool)), torch.tensor(ends + [0] * extra), \
        sum(QO) + extra


@pytest.mark.parametrize("static", [False, True], ids=["ragged", "padded"])
def test_forward_last_equals_forward_at_the_last_rows(static: bool) -> None:
    hq, hkv, dim, extra = 4, 2, 8, 2
    pages = _pages()
    plan, last, rows = _plans(pages, static, extra)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(rows, h, dim, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    full_pool, last_pool = _pool(1, hkv, dim), _pool(1, hkv, dim)
    want = plan(full_pool).forward(0, q, k, v)[last]
    got = plan(last_pool).forward_last(0, q[last], k, v)
    assert got.shape == (len(QO) + extra, hq, dim)
    torch.testing.assert_close(got[:len(QO)], want[:len(QO)], rtol=1e-12, atol=1e-12)
    if not static:   # agreed padding rows: zeros, as `forward` gives them
        assert got[len(QO):].abs().sum() == 0
    torch.testing.assert_close(last_pool.k[0], full_pool.k[0], rtol=0, atol=0)
    torch.testing.assert_close(last_pool.v[0], full_pool.v[0], rtol=0, atol=0)


@pytest.mark.parametrize("static", [False, True], ids=["ragged", "padded"])
@pytest.mark.parametrize("kind", HEADS)
def test_head_with_last_rows_equals_its_full_forward(kind: str, static: bool) -> None:
    target = random_target(target_config("llama", layers=4), seed=2).double()
    head = random_head(kind, target, seed=5)
    cfg = head.config
    pages = _pages()
    plan, last, rows = _plans(pages, static, 1)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (rows,), generator=gen)
    feats = torch.randn(rows, head.feature_size, generator=gen, dtype=torch.float64)
    pos = torch.randint(1, 40, (rows,), generator=gen)
    pools = [_pool(head.num_layers, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2)]
    with torch.inference_mode():
        want = head(ids, feats, pos, plan(pools[0]))[last]
        got = head(ids, feats, pos, plan(pools[1]), last=last)
    assert got.shape == (len(last), head.feature_size)
    torch.testing.assert_close(got[:len(QO)], want[:len(QO)], rtol=1e-10, atol=1e-10)
    for a, b in zip(pools[1].k + pools[1].v, pools[0].k + pools[0].v):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
