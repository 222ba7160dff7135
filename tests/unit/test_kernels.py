"""The fused Triton kernels against the torch code they replace: on a CPU in triton's interpreter
(conftest sets TRITON_INTERPRET before triton is imported), on a GPU compiled."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")

from workers import kernels  # noqa: E402
from workers.attention.base import PaddedBatch  # noqa: E402
from workers.attention.static_backend import StaticAttention  # noqa: E402
from workers.kv_cache import DUMMY_PAGE, KVPool  # noqa: E402
from workers.model.layers import RMSNorm, apply_rope  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on a CPU


def tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(48, 1e-5).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(7, 48, device=DEV).to(dtype)
    delta = torch.randn(7, 48, device=DEV).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(x, norm.weight, norm.eps), norm(x), **tol(dtype))
    total, out = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
    # the residual stream rounded to the input dtype (exactly so in float32; triton's interpreter
    # may round bfloat16 differently from the GPU by one unit)
    torch.testing.assert_close(total, x + delta, **tol(dtype))
    torch.testing.assert_close(out, norm(x + delta), **tol(dtype))
    # strided rows (a view of a wider tensor) and an empty batch
    wide = torch.randn(5, 96, device=DEV).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(wide[:, :48], norm.weight, norm.eps),
                               norm(wide[:, :48]), **tol(dtype))
    assert kernels.rms_norm(x[:0], norm.weight, norm.eps).shape == (0, 48)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 300])
def test_qk_norm_rope_equals_the_norms_then_the_rotation(dtype: torch.dtype, tokens: int) -> None:
    """One launch for Qwen3's per-head query and key norms and RoPE against the torch code it
    replaces (`RMSNorm` per head, its own weight for the query and the key heads, then
    `apply_rope`): a QKV GEMM's output with the V columns after (strided rows), 5 query and 2
    key heads (not a power of two), 1 token and 300 (several programs)."""
    torch.manual_seed(2)
    hd, nq, nk = 16, 5, 2
    q_norm, k_norm = RMSNorm(hd, 1e-6).to(DEV, dtype), RMSNorm(hd, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        q_norm.weight.normal_()
        k_norm.weight.normal_()
    qkv = (3 * torch.randn(tokens, (nq + 2 * nk) * hd, device=DEV)).to(dtype)
    angles = torch.randn(tokens, hd // 2, device=DEV)
    cos, sin = angles.cos(), angles.sin()
    q, k = kernels.qk_norm_rope(qkv, nq, nk, hd, q_norm.weight, k_norm.weight, 1e-6, cos, sin)
    assert q.shape == (tokens, nq, hd) and k.shape == (tokens, nk, hd)
    assert kernels._tile_tokens(8 * 8) < 300
    enabled = kernels.enabled
    kernels.enabled = lambda x: False      # the torch code, on the same device
    try:
        want_q = apply_rope(q_norm(qkv[:, :nq * hd].reshape(tokens, nq, hd)), cos, sin)
        want_k = apply_rope(k_norm(qkv[:, nq * hd:(nq + nk) * hd].reshape(tokens, nk, hd)),
                            cos, sin)
    finally:
        kernels.enabled = enabled
    torch.testing.assert_close(q, want_q, **tol(dtype))
    torch.testing.assert_close(k, want_k, **tol(dtype))
    empty = kernels.qk_norm_rope(qkv[:0], nq, nk, hd, q_norm.weight, k_norm.weight, 1e-6,
                                 cos[:0], sin[:0])
    assert empty[0].shape == (0, nq, hd) and empty[1].shape == (0, nk, hd)
    with pytest.raises(ValueError, match="qk of shape .* allowed: .T, >= heads . head_dim"):
        kernels.qk_norm_rope(qkv[:, :hd], nq, nk, hd, q_norm.weight, k_norm.weight, 1e-6,
                             cos, sin)
    with pytest.raises(ValueError, match="norm weights .* one dtype"):
        kernels.qk_norm_rope(qkv, nq, nk, hd, q_norm.weight, k_norm.weight[:8], 1e-6, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_silu_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(6, 3, 16, device=DEV).to(dtype)
    angles = torch.randn(6, 8, device=DEV)
    cos, sin = angles.cos(), angles.sin()
    torch.testing.assert_close(kernels.rope(x, cos, sin), apply_rope(x, cos, sin), **tol(dtype))
    # tokens over several programs (BLOCK_T tokens each), heads not a power of two, a strided view
    qk = torch.randn(300, 2, 5, 16, device=DEV).to(dtype)[:, 0]
    angles = torch.randn(300, 8, device=DEV)
    cos, sin = angles.cos(), angles.sin()
    assert kernels._tile_tokens(8 * 8) < 300
    torch.testing.assert_close(kernels.rope(qk, cos, sin), apply_rope(qk, cos, sin), **tol(dtype))
    g, u = torch.randn(5, 40, device=DEV).to(dtype), torch.randn(5, 40, device=DEV).to(dtype)
    torch.testing.assert_close(kernels.silu_mul(g, u), torch.nn.functional.silu(g) * u,
                               **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_padded_attention_matches_static_backend(dtype: torch.dtype, heads: tuple) -> None:
    """Rows of different cache lengths, a dummy row, grouped-query heads, a stored head dim wider
    than the model's: the kernel's outputs equal the static backend's (which also wrote K/V)."""
    torch.manual_seed(2)
    hq, hkv = heads
    page_size, dim, width = 4, 8, 3
    pool = KVPool(1, 16, page_size, hkv, dim + 8, dtype=dtype, device=DEV)  # stored channels beyond D
    for t in (pool.k[0], pool.v[0]):
        t.normal_()
    reach = 5
    page_tab = torch.full((3, reach), DUMMY_PAGE, dtype=torch.int64)
    page_tab[0, :4] = torch.tensor([3, 7, 1, 9])
    page_tab[1, :2] = torch.tensor([2, 5])
    page_tab = page_tab.to(DEV)
    cached = torch.tensor([11, 2, 0], device=DEV)
    qo_len = torch.tensor([3, 2, 0], device=DEV)  # row 2 is a dummy row
    meta = PaddedBatch(page_tab, cached, qo_len, width)
    q = torch.randn(3 * width, hq, dim, device=DEV).to(dtype)
    k = torch.randn(3 * width, hkv, dim, device=DEV).to(dtype)
    v = torch.randn(3 * width, hkv, dim, device=DEV).to(dtype)
    static = StaticAttention(meta, pool)
    ref = static.forward(0, q, k, v)            # writes K/V, then attends
    out = kernels.padded_attention(q, pool.k[0], pool.v[0], page_tab, cached, width, dim ** -0.5)
    real = (torch.arange(width, device=DEV)[None, :] < qo_len[:, None]).reshape(-1)
    torch.testing.assert_close(out[real], ref[real], **tol(dtype))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype,heads", [(d, h) for d in (torch.float32, torch.float16)
                                         for h in ((4, 4), (8, 2), (6, 2))]
                         + [(torch.float64, (4, 4))])   # per-slot kernel: slow interpreted
def test_tiled_padded_attention_matches_static_backend(dtype: torch.dtype, heads: tuple) -> None:
    """Prefill widths (>= TILED_WIDTH): the tiled kernel (several programs per row, grouped
    query heads, 3 per KV head too; float64 takes the per-slot kernel) against the static
    backend's eager attention, with rows that start at different cache lengths, a short row and
    a dummy row."""
    torch.manual_seed(9)
    hq, hkv = heads
    page_size, dim, width = 4, 16, 2 * kernels.TILED_WIDTH + 8
    assert kernels.TILE_QUERIES // (1 << (hq // hkv - 1).bit_length()) < width  # > 1 tile a row
    pool = KVPool(1, 64, page_size, hkv, dim, dtype=dtype, device=DEV)
    for t in (pool.k[0], pool.v[0]):
        t.normal_()
    reach = 20
    page_tab = torch.full((3, reach), DUMMY_PAGE, dtype=torch.int64)
    page_tab[0] = torch.arange(1, 21)
    page_tab[1, :11] = torch.arange(30, 41)
    page_tab = page_tab.to(DEV)
    cached = torch.tensor([7, 0, 0], device=DEV)
    qo_len = torch.tensor([width, 13, 0], device=DEV)  # a full row, a short one, a dummy row
    meta = PaddedBatch(page_tab, cached, qo_len, width)
    q = torch.randn(3 * width, hq, dim, device=DEV).to(dtype)
    k = torch.randn(3 * width, hkv, dim, device=DEV).to(dtype)
    v = torch.randn(3 * width, hkv, dim, device=DEV).to(dtype)
    ref = StaticAttention(meta, pool).forward(0, q, k, v)   # eager on a CPU: writes K/V first
    out = kernels.padded_attention(q, pool.k[0], pool.v[0], page_tab, cached, width, dim ** -0.5)
    real = (torch.arange(width, device=DEV)[None, :] < qo_len[:, None]).reshape(-1)
    close = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.float16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out[real].float(), ref[real].float(), **close)
    assert torch.isfinite(out).all()


def paged_sdpa(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
               page_tab: torch.Tensor, cached: torch.Tensor, width: int,
               scale: float) -> torch.Tensor:
    """An independent reference for `padded_attention`: every row's reach gathered through its
    page table, torch's `scaled_dot_product_attention` in float64 under the explicit mask (slot
    `w` of row `b` sees keys ``0 .. min(cached[b] + w, reach - 1)``)."""
    tokens, hq, dim = q.shape
    rows, ps, hkv = page_tab.shape[0], k_pages.shape[1], k_pages.shape[2]
    idx = torch.arange(page_tab.shape[1] * ps, device=q.device)
    slots = page_tab[:, idx // ps] * ps + idx % ps                                # [B, L]
    k, v = (x.reshape(-1, hkv, x.shape[3])[slots][..., :dim].transpose(1, 2)
            .repeat_interleave(hq // hkv, dim=1).double() for x in (k_pages, v_pages))
    query = q.reshape(rows, width, hq, dim).transpose(1, 2).double()            # [B, Hq, W, D]
    pos = cached[:, None] + torch.arange(width, device=q.device)[None, :]       # [B, W]
    mask = idx[None, None, :] <= pos[:, :, None]
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask[:, None],
                                                           scale=scale)
    return out.transpose(1, 2).reshape(tokens, hq, dim)


# rows, width, KV heads, groups, head dim, dtype, splits asked for; every case: page size 16, a
# reach of 20 pages (320 keys, 5 blocks of the split kernel), cached lengths off page and chunk
# boundaries, very different per row (3: the live keys end inside the first chunk; 330: past
# the reach, capped)
SPLIT_CASES = [
    (1, 1, 4, 8, 128, torch.float16, 4),    # Qwen3-MoE's heads at decode
    (1, 1, 4, 8, 128, torch.bfloat16, 4),
    (2, 2, 2, 4, 64, torch.float32, 5),
    (3, 4, 1, 8, 128, torch.float16, 3),
    (4, 8, 2, 1, 64, torch.float32, 6),     # more splits asked than blocks: one per block
    (4, 1, 2, 4, 64, torch.bfloat16, 2),
    (2, 8, 1, 8, 128, torch.bfloat16, 5),
    (3, 2, 3, 1, 64, torch.float16, 5),     # 3 KV heads (not a power of two)
    (2, 4, 1, 6, 64, torch.float32, 3),     # 6 query heads per KV head (not a power of two)
]


@pytest.mark.parametrize("case", SPLIT_CASES,
                         ids=[f"r{c[0]}w{c[1]}kv{c[2]}g{c[3]}d{c[4]}{str(c[5])[6:]}s{c[6]}"
                              for c in SPLIT_CASES])
def test_split_padded_attention_matches_sdpa_and_unsplit(case: tuple) -> None:
    """The split-KV kernels (key chunks, then the combine) against torch's SDPA under the paged
    causal mask and against the unsplit kernels, rows of very different lengths; chunks past a
    row's live keys leave empty states that the combine ignores."""
    rows, width, hkv, groups, dim, dtype, splits = case
    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("triton's interpreter multiplies bfloat16 tl.dot operands wrong (the tiled "
                    "kernel's too): bfloat16 runs on a GPU, float16 here")
    torch.manual_seed(sum(case[:5]) + splits)
    page_size, reach, pages = 16, 20, 96
    hq = hkv * groups
    k_pages = torch.randn(pages, page_size, hkv, dim, device=DEV).to(dtype)
    v_pages = torch.randn(pages, page_size, hkv, dim, device=DEV).to(dtype)
    page_tab = torch.stack([torch.randperm(pages - 1)[:reach] + 1 for _ in range(rows)])
    cached = torch.tensor([261, 3, 127, 330][:rows] if rows > 1 else [261])
    page_tab[cached == 3, 1:] = DUMMY_PAGE     # the short row: the dummy page past its keys
    page_tab, cached = page_tab.to(DEV), cached.to(DEV)
    q = torch.randn(rows * width, hq, dim, device=DEV).to(dtype)
    scale = dim ** -0.5
    got = kernels.padded_attention(q, k_pages, v_pages, page_tab, cached, width, scale,
                                   splits=splits)
    chunk = -(-(-(-reach * page_size // kernels.SPLIT_BLOCK_N)) // splits) * kernels.SPLIT_BLOCK_N
    assert -(-reach * page_size // chunk) > 1       # the key range really is split
    want = paged_sdpa(q, k_pages, v_pages, page_tab, cached, width, scale)
    unsplit = kernels.padded_attention(q, k_pages, v_pages, page_tab, cached, width, scale,
                                       splits=1)
    close = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else \
        {"atol": 2e-2, "rtol": 2e-2}
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, **close)
    torch.testing.assert_close(got.float(), unsplit.float(), **close)


def test_split_padded_attention_refuses_what_it_cannot_run() -> None:
    q = torch.randn(2, 4, 16, dtype=torch.float64, device=DEV)
    pages = torch.randn(4, 16, 2, 16, dtype=torch.float64, device=DEV)
    tab = torch.tensor([[1, 2], [3, 0]], device=DEV)
    cached = torch.tensor([20, 5], device=DEV)
    with pytest.raises(ValueError, match="splits=4 with torch.float64; the split kernel takes"):
        kernels.padded_attention(q, pages, pages, tab, cached, 1, 0.25, splits=4)
    with pytest.raises(ValueError, match="splits=0; allowed: None or an int >= 1"):
        kernels.padded_attention(q, pages, pages, tab, cached, 1, 0.25, splits=0)
    # float64 and splits=1 (or chosen: on a CPU, 1): the per-slot kernel
    want = kernels.padded_attention(q, pages, pages, tab, cached, 1, 0.25, splits=1)
    torch.testing.assert_close(kernels.padded_attention(q, pages, pages, tab, cached, 1, 0.25),
                               want)


def test_attention_splits_from_static_shapes() -> None:
    """The host's split count: the issue's decode shape (batch 1, Qwen3-MoE's 4 KV heads, 1024
    keys of reach, 132 SMs) splits; wide, short-reach and already full grids do not; the count
    stays within SPLIT_MAX and leaves chunks of at least SPLIT_MIN_CHUNK keys."""
    sms = 132
    n = kernels.attention_splits(1, 1, 32, 4, 1024, sms)
    assert 2 <= n <= kernels.SPLIT_MAX and 1024 // n >= kernels.SPLIT_MIN_CHUNK
    assert kernels.attention_splits(1, kernels.SPLIT_MAX_WIDTH + 1, 32, 4, 1024, sms) == 1
    assert kernels.attention_splits(1, 1, 32, 4, kernels.SPLIT_MIN_REACH - 1, sms) == 1
    assert kernels.attention_splits(512, 1, 32, 8, 4096, sms) == 1     # 4096 programs unsplit
    for rows in (1, 2, 4, 8, 16, 64):
        for width in (1, 2, 4, 8):
            for reach in (512, 1024, 4096, 32768):
                got = kernels.attention_splits(rows, width, 32, 4, reach, sms)
                assert 1 <= got <= kernels.SPLIT_MAX
                assert got == 1 or reach // got >= kernels.SPLIT_MIN_CHUNK
    # more rows never split more
    assert kernels.attention_splits(8, 1, 32, 8, 4096, sms) <= \
        kernels.attention_splits(1, 1, 32, 8, 4096, sms)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture is CUDA's")
@pytest.mark.parametrize("heads", [(32, 4), (32, 8)])
def test_split_padded_attention_in_a_cuda_graph(heads: tuple) -> None:
    """The split path as the engine runs it on a GPU: chosen automatically (batch 2, decode, a
    long reach), captured in a CUDA graph, replayed with other cached lengths (chunks past the
    new live keys write empty states); equal to SDPA and to the unsplit kernels, and the same
    bits on every replay."""
    hq, hkv = heads
    torch.manual_seed(21)
    rows, dim, page_size, reach, pages = 2, 128, 16, 256, 600
    assert kernels.attention_splits(rows, 1, hq, hkv, reach * page_size,
                                    kernels._sm_count(torch.cuda.current_device())) > 1
    k_pages = torch.randn(pages, page_size, hkv, dim, device="cuda").to(torch.bfloat16)
    v_pages = torch.randn(pages, page_size, hkv, dim, device="cuda").to(torch.bfloat16)
    page_tab = torch.stack([torch.randperm(pages - 1)[:reach] + 1 for _ in range(rows)]).cuda()
    cached = torch.tensor([4000, 17], device="cuda")
    q = torch.randn(rows, hq, dim, device="cuda").to(torch.bfloat16)
    scale = dim ** -0.5
    kernels.padded_attention(q, k_pages, v_pages, page_tab, cached, 1, scale)   # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.padded_attention(q, k_pages, v_pages, page_tab, cached, 1, scale)
    for lengths in ([4000, 17], [63, 2900], [0, 4095]):
        cached.copy_(torch.tensor(lengths))
        graph.replay()
        first = out.clone()
        graph.replay()
        assert torch.equal(out, first)
        want = paged_sdpa(q, k_pages, v_pages, page_tab, cached, 1, scale)
        unsplit = kernels.padded_attention(q, k_pages, v_pages, page_tab, cached, 1, scale,
                                           splits=1)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out.float(), unsplit.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the automatic choice is a GPU's")
@pytest.mark.parametrize("width", [2, 4, 8])
def test_small_widths_take_the_split_tile_even_unsplit(width: int) -> None:
    """At widths 2 .. SPLIT_MAX_WIDTH a GPU runs the split kernel's tile even where
    `attention_splits` gives 1 (64 rows, a short reach): equal to SDPA and to the per-slot
    kernel (`splits=1`), for rows of very different cached lengths."""
    torch.manual_seed(23)
    rows, hq, hkv, dim, page_size, reach, pages = 64, 32, 8, 128, 16, 16, 1200
    sms = kernels._sm_count(torch.cuda.current_device())
    assert kernels.attention_splits(rows, width, hq, hkv, reach * page_size, sms) == 1
    k_pages = torch.randn(pages, page_size, hkv, dim, device="cuda").to(torch.bfloat16)
    v_pages = torch.randn(pages, page_size, hkv, dim, device="cuda").to(torch.bfloat16)
    page_tab = torch.stack([torch.randperm(pages - 1)[:reach] + 1 for _ in range(rows)]).cuda()
    cached = torch.randint(0, reach * page_size - width, (rows,), device="cuda")
    q = torch.randn(rows * width, hq, dim, device="cuda").to(torch.bfloat16)
    scale = dim ** -0.5
    out = kernels.padded_attention(q, k_pages, v_pages, page_tab, cached, width, scale)
    want = paged_sdpa(q, k_pages, v_pages, page_tab, cached, width, scale)
    per_slot = kernels.padded_attention(q, k_pages, v_pages, page_tab, cached, width, scale,
                                        splits=1)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), per_slot.float(), atol=2e-2, rtol=2e-2)


def test_enabled_only_on_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not kernels.enabled(torch.zeros(1))
    if torch.cuda.is_available():
        assert kernels.enabled(torch.zeros(1, device="cuda"))
        monkeypatch.setenv("ADAPTIVE_DIST_FUSED", "0")
        assert not kernels.enabled(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("cache", [(torch.float32, 16), (torch.bfloat16, 24)])
def test_store_kv_matches_index_copy(monkeypatch: pytest.MonkeyPatch, cache: tuple) -> None:
    """One launch for K and V: strided inputs (views of a fused QKV output), a cache in another
    dtype with wider heads (zero channels), repeated dummy slots."""
    dtype, stored = cache
    torch.manual_seed(3)
    qkv = torch.randn(6, 5 * 2 * 16, device=DEV)
    k = qkv[:, 64:96].view(6, 2, 16)
    v = qkv[:, 96:128].view(6, 2, 16)
    slots = torch.tensor([5, 9, 0, 0, 17, 2], device=DEV)

    def pool() -> KVPool:
        p = KVPool(2, 4, 8, 2, stored, dtype=dtype, device=DEV)
        for t in p.k + p.v:
            t.normal_()
        return p

    want, got = pool(), pool()
    for w, g in zip(want.k + want.v, got.k + got.v):
        g.copy_(w)
    want.write(1, slots[[0, 1, 2, 4, 5]], k[[0, 1, 2, 4, 5]], v[[0, 1, 2, 4, 5]])
    monkeypatch.setattr(kernels, "enabled", lambda x: True)
    got.write(1, slots[[0, 1, 2, 4, 5]], k[[0, 1, 2, 4, 5]], v[[0, 1, 2, 4, 5]])
    # exact, but triton's interpreter may round bfloat16 differently from the GPU by one unit
    exact = dtype == torch.float32 or DEV == "cuda"
    for w, g in zip(want.k + want.v, got.k + got.v):
        torch.testing.assert_close(g, w, **({"atol": 0, "rtol": 0} if exact else tol(dtype)))


def test_store_kv_over_several_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """More tokens than one program takes (BLOCK_T each), three KV heads (not a power of two):
    every token lands in its own slot."""
    torch.manual_seed(6)
    tokens, heads, dim = 200, 3, 16
    assert kernels._tile_tokens(4 * 16) < tokens
    k, v = torch.randn(2, tokens, heads, dim, device=DEV)
    slots = torch.randperm(32 * 8, device=DEV)[:tokens]
    want, got = (KVPool(1, 32, 8, heads, dim, device=DEV) for _ in range(2))
    want.write(0, slots, k, v)
    monkeypatch.setattr(kernels, "enabled", lambda x: True)
    got.write(0, slots, k, v)
    for w, g in zip(want.k + want.v, got.k + got.v):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("last", [False, True], ids=["every-row", "last-rows"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_static_attention_fused_store_matches_eager(monkeypatch: pytest.MonkeyPatch,
                                                    dtype: torch.dtype, last: bool) -> None:
    """The fused static path (write slots worked out in the store kernel) writes the same cache
    (the dummy page aside: padding rows race into it) and gives the eager path's outputs; so does
    `forward_last` (the kernel at width 1 for each row's last new token)."""
    torch.manual_seed(4)
    page_size, dim, width, hq, hkv = 4, 8, 3, 4, 2
    page_tab = torch.full((3, 5), DUMMY_PAGE, dtype=torch.int64)
    page_tab[0, :4] = torch.tensor([3, 7, 1, 9])
    page_tab[1, :2] = torch.tensor([2, 5])
    page_tab = page_tab.to(DEV)
    meta = PaddedBatch(page_tab, torch.tensor([11, 2, 90], device=DEV),
                       torch.tensor([3, 2, 0], device=DEV), width)
    q = torch.randn(3 * width, hq, dim, device=DEV).to(dtype)
    kv = torch.randn(3 * width, 2 * hkv * dim, device=DEV).to(dtype)   # k, v: strided views
    k, v = kv[:, :hkv * dim].view(-1, hkv, dim), kv[:, hkv * dim:].view(-1, hkv, dim)

    def run(fused: bool) -> tuple[torch.Tensor, KVPool]:
        torch.manual_seed(5)
        pool = KVPool(1, 16, page_size, hkv, dim + 8, dtype=dtype, device=DEV)
        for t in (pool.k[0], pool.v[0]):
            t.normal_()
        monkeypatch.setattr(kernels, "enabled", (lambda x: True) if fused else (lambda x: False))
        attn = StaticAttention(meta, pool)
        if last:
            return attn.forward_last(0, q[ends], k, v), pool
        return attn.forward(0, q, k, v), pool

    ends = torch.arange(3, device=DEV) * width + (meta.qo_len - 1).clamp(min=0)
    (want, ref_pool), (got, pool) = run(False), run(True)
    real = (torch.arange(width, device=DEV)[None, :] < meta.qo_len[:, None]).reshape(-1)
    if last:
        real = meta.qo_len > 0
    torch.testing.assert_close(got[real], want[real], **tol(dtype))
    exact = dtype == torch.float32 or DEV == "cuda"
    for a, b in ((pool.k[0], ref_pool.k[0]), (pool.v[0], ref_pool.v[0])):
        torch.testing.assert_close(a[1:], b[1:], **({"atol": 0, "rtol": 0} if exact else tol(dtype)))


@pytest.mark.parametrize("steps", [0, 1, 3, 7])
def test_greedy_accept_and_one_hot_match_torch(monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """`verify(..., all_greedy=True)` and greedy `draft_step` with the kernels on equal the torch
    code: drafts that match or not, out of range, num_draft below S, above S and negative."""
    from workers.spec_decode import draft_step, verify

    torch.manual_seed(6)
    b, vocab = 9, 50
    logits = torch.randn(b, steps + 1, vocab, device=DEV)
    arg = logits.argmax(-1)
    draft = torch.where(torch.rand(b, steps, device=DEV) < 0.7, arg[:, :steps],
                        torch.randint(0, vocab, (b, steps), device=DEV))
    if steps:
        draft[0, 0] = vocab + 3          # out of range: never accepted
        draft[1] = arg[1, :steps]        # all accepted
    num_draft = torch.tensor([steps, steps, steps - 1, 0, steps + 2, -1, steps, 1, steps],
                             device=DEV)
    q = torch.zeros(b, steps, vocab, device=DEV)
    zeros = torch.zeros(b, device=DEV)
    args = (draft, q, logits, zeros, zeros + 1, zeros.long(), zeros.long(), num_draft)
    want = verify(*args, fill=-7, all_greedy=True)
    want_draft = draft_step(logits[:, 0], zeros, zeros + 1, zeros.long(), zeros.long(), 1,
                            all_greedy=True)
    monkeypatch.setattr(kernels, "enabled", lambda x: True)
    got = verify(*args, fill=-7, all_greedy=True)
    got_draft = draft_step(logits[:, 0], zeros, zeros + 1, zeros.long(), zeros.long(), 1,
                           all_greedy=True)
    for g, w in zip(got + got_draft, want + want_draft):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("dim", [40, 2100])   # one block; several blocks of 1024
def test_lag_append_matches_torch(dim: int) -> None:
    """The depth-0 round's append to the lag rings (`DraftLag.append`) against its torch
    code: rows in any order, rings part full, dummy rows (their slot's lag stays put; its ring
    entry is scratch, written by each of them), a strided feature view."""
    torch.manual_seed(7)
    slots, capacity, dummy = 7, 4, 6
    lag = torch.tensor([0, 3, 1, 2, 0, 1, 0], device=DEV)
    ring_tok = torch.randint(0, 100, (slots, capacity), device=DEV)
    ring_feat = torch.randn(slots, capacity, dim, device=DEV).to(torch.bfloat16)
    rows = torch.tensor([3, 0, dummy, 1, 5, dummy], device=DEV)
    tokens = torch.randint(0, 100, (rows.shape[0],), device=DEV)
    features = torch.randn(rows.shape[0], 2 * dim, device=DEV).to(torch.bfloat16)[:, :dim]
    want_lag, want_tok, want_feat = lag.clone(), ring_tok.clone(), ring_feat.clone()
    at = want_lag[rows]
    want_tok[rows, at] = tokens
    want_feat[rows, at] = features
    want_lag.index_copy_(0, rows, at + (rows != dummy).long())
    kernels.lag_append(rows, tokens, features, lag, ring_tok, ring_feat, dummy)
    assert torch.equal(lag, want_lag) and lag.tolist() == [1, 4, 1, 3, 0, 2, 0]
    assert torch.equal(ring_tok[:dummy], want_tok[:dummy])
    assert torch.equal(ring_feat[:dummy], want_feat[:dummy])
    assert ring_tok[dummy, 0] in tokens[rows == dummy].tolist()


def test_uniforms_kernel_is_bit_identical_to_the_torch_hash() -> None:
    """Seeds over the whole int64 range (negative ones too), counters past 2^32, every salt kind,
    n not a power of two: the same float32 bits as `spec_decode.uniforms`' torch code."""
    from workers.spec_decode import SALT_ACCEPT, SALT_SAMPLE, _draw, _row_key, draft_salt

    gen = torch.Generator().manual_seed(8)
    seed = torch.randint(-2 ** 63, 2 ** 63 - 1, (9,), generator=gen, dtype=torch.int64)
    seed[:3] = torch.tensor([0, 1, 2 ** 32 + 5])
    counter = torch.randint(0, 2 ** 40, (9,), generator=gen, dtype=torch.int64)
    for salt, n in ((SALT_ACCEPT, 7), (SALT_SAMPLE, 1), (draft_salt(3), 3), (draft_salt(65535), 16)):
        want = _draw(_row_key(seed, counter), salt, n)
        got = kernels.uniforms(seed.to(DEV), counter.to(DEV), salt, n).cpu()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (salt, n)
    assert kernels.uniforms(seed[:0].to(DEV), counter[:0].to(DEV), 1, 4).shape == (0, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped width-1 path is CUDA's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (32, 8), (6, 2)])
def test_grouped_width_one_attention_matches_static_backend(dtype: torch.dtype,
                                                            heads: tuple) -> None:
    """Width 1 with grouped query heads on a GPU (a draft step, the packed verify's tokens): one
    program per token and KV head, against the static backend's eager attention, rows of
    different lengths (long ones: several K/V blocks), a dummy row."""
    torch.manual_seed(13)
    hq, hkv = heads
    page_size, dim, rows = 16, 128, 5
    pool = KVPool(1, 64, page_size, hkv, dim, dtype=dtype, device="cuda")
    for t in (pool.k[0], pool.v[0]):
        t.normal_()
    reach = 12
    page_tab = torch.full((rows, reach), DUMMY_PAGE, dtype=torch.int64)
    for r in range(rows - 1):
        page_tab[r] = torch.arange(1 + r * reach, 1 + (r + 1) * reach) % 63 + 1
    page_tab = page_tab.cuda()
    cached = torch.tensor([0, 15, 64, 170, 0], device="cuda")
    qo_len = torch.tensor([1, 1, 1, 1, 0], device="cuda")
    meta = PaddedBatch(page_tab, cached, qo_len, 1)
    q = torch.randn(rows, hq, dim, device="cuda").to(dtype)
    k = torch.randn(rows, hkv, dim, device="cuda").to(dtype)
    v = torch.randn(rows, hkv, dim, device="cuda").to(dtype)
    ref_pool = KVPool(1, 64, page_size, hkv, dim, dtype=dtype, device="cuda")
    ref_pool.k[0].copy_(pool.k[0])
    ref_pool.v[0].copy_(pool.v[0])
    import workers.kernels as K

    enabled = K.enabled
    try:
        K.enabled = lambda x: False      # the eager reference on the same device
        ref = StaticAttention(meta, ref_pool).forward(0, q, k, v)
    finally:
        K.enabled = enabled
    StaticAttention(meta, pool)._store(0, k, v)
    out = kernels.padded_attention(q, pool.k[0], pool.v[0], page_tab, cached, 1, dim ** -0.5)
    torch.testing.assert_close(out[:rows - 1].float(), ref[:rows - 1].float(), atol=2e-2,
                               rtol=2e-2)
