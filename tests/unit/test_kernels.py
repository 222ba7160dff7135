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
def test_rope_and_silu_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(6, 3, 16, device=DEV).to(dtype)
    angles = torch.randn(6, 8, device=DEV)
    cos, sin = angles.cos(), angles.sin()
    torch.testing.assert_close(kernels.rope(x, cos, sin), apply_rope(x, cos, sin), **tol(dtype))
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
