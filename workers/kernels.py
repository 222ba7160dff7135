"""Fused Triton kernels for the round's hot path; each replaces a chain of torch ops with one
launch and computes in float32 like the torch code it replaces (why: ``docs/ARCHITECTURE.md``,
"Fused kernels").

``rms_norm``, ``add_rms_norm`` (the residual add fused in), ``rope``, ``qk_norm_rope`` (Qwen3's
query and key norms with the rotation), ``silu_mul``, ``store_kv``
(a layer's K and V into the paged cache), ``greedy_accept`` and ``one_hot`` (greedy acceptance,
``spec_decode.verify``), ``lag_append`` (the depth-0 lag ring, ``workers.worker.draft_lag``),
``uniforms`` (the counter-based uniforms of sampled rows, bit-identical to the torch code) and
``padded_attention`` (causal attention of a padded batch over its paged KV, online softmax,
grouped-query heads; per (slot, head) at the round's widths, tiled with ``tl.dot`` at prefill
widths >= ``TILED_WIDTH``; float64 keeps the per-slot kernel; on a GPU at small grids and long
reaches the key range split over programs and merged after, ``attention_splits``).

``enabled(x)`` says whether the model code uses them for tensor ``x``: on CUDA tensors when triton
imports, unless ``ADAPTIVE_DIST_FUSED=0``. The kernels run wherever triton runs, on a CPU under
``TRITON_INTERPRET=1`` (how the CPU tests check them). They are defined on first use, so the
interpreter setting in force then decides how they run.
"""
from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Any

import torch


@functools.lru_cache(maxsize=1)
def _triton() -> Any:
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return triton


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve tensor `x` (CUDA, triton present, not switched off)."""
    return (x.is_cuda and os.environ.get("ADAPTIVE_DIST_FUSED", "1") != "0"
            and _triton() is not None)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


TILE_ELEMENTS = 2048  # elements per program of the token-tiled kernels (rope, store_kv)
TILED_WIDTH = 32      # padded attention at this width and above (prefill) runs tiled
TILE_QUERIES = 64     # query vectors (token slots x heads of one KV head) per tiled program
TILED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float64: the per-slot kernel
GROUPED_DTYPES = (torch.float16, torch.bfloat16)  # width 1 with grouped heads, on a GPU: tiled
GROUPED_QUERIES = 16  # query vectors per program at width 1 (tl.dot's least rows)

# Split-KV ("flash-decoding") padded attention: at small grids (decode, verify at small batch)
# the key range of each (row tile, KV head) is cut into chunks, one program each, whose partial
# softmax states a merge kernel combines in a fixed order (deterministic). The split count is a
# function of static values only (rows, width, head counts, the reach, the SM count), so a CUDA
# graph captures one grid; chunks past a row's live keys write an empty state. Set from
# `python3 -m scripts.bench.attention_split` on one H200 (2026-12-03, 88 configurations,
# docs/data/runs/attention_split_h200_2026-12-03): a split gains >= 5% from a reach of 272 keys,
# up to 0.97 x SMs programs unsplit (Llama-8B's 16 rows x 8 KV heads: 43 -> 28 us at 1024 keys)
# and not at 1.9 x (64 rows x 4 KV heads); the best split grids hold about 2 x SMs programs and
# chunks of 54 keys and more.
SPLIT_MAX_WIDTH = 8      # split only at widths up to this (decode and small verify widths)
SPLIT_MIN_REACH = 256    # ... and a reach (page_tab.shape[1] * page_size) of at least this
SPLIT_BUSY = 1.5         # no split when the unsplit grid has >= this x SMs programs
SPLIT_PROGRAMS = 2.0     # the split grid aims at this x SMs programs
SPLIT_MIN_CHUNK = 64     # keys per chunk at least (a multiple of SPLIT_BLOCK_N)
SPLIT_MAX = 64           # splits at most (the float32 scratch: splits x tokens x heads x D)
SPLIT_BLOCK_N = 64       # keys per block of the split kernel


def _tile_tokens(per_token: int) -> int:
    """Tokens per program of a kernel that handles `per_token` (a power of two) elements of each."""
    return max(1, TILE_ELEMENTS // per_token)


@functools.lru_cache(maxsize=1)
def _kernels() -> SimpleNamespace:  # noqa: C901 (one definition site for every kernel)
    import triton
    import triton.language as tl

    # a module global (not a closure variable), so the kernels find it compiled and in triton's
    # interpreter alike
    global _softmax_step, _paged_keys

    @triton.jit
    def _softmax_step(q, k, v, seen, scale, m_i, l_i, acc, IEEE: tl.constexpr):
        # one block of keys `k`/values `v` into the online softmax of the queries `q` (a tile of
        # query vectors x BLOCK_D), the keys each may see `seen`: the running max `m_i`, sum
        # `l_i` and accumulator `acc` after it (float32). A query that has seen nothing yet
        # keeps max -inf and adds nothing (no NaN).
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32)
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32)
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v, input_precision="ieee").to(tl.float32)
        else:
            pv = tl.dot(p.to(q.dtype), v).to(tl.float32)
        return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv

    @triton.jit
    def _paged_keys(q, m_i, l_i, acc, lo, hi, limit, b, kvh, d, dmask, pages_ptr, k_ptr, v_ptr,
                    stride_pb, stride_ks, stride_kh, stride_vs, stride_vh, scale,
                    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        # keys [lo, hi) of row b's pages (KV head kvh) into the online softmax, in blocks of
        # BLOCK_N; query i sees the keys below limit[i]
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pmask = pos < hi
            page = tl.load(pages_ptr + b * stride_pb + pos // PAGE, mask=pmask, other=0)
            slot = page.to(tl.int64) * PAGE + pos % PAGE
            m2 = pmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                        mask=m2, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=m2, other=0.0).to(q.dtype)
            seen = pmask[None, :] & (pos[None, :] < limit[:, None])
            m_i, l_i, acc = _softmax_step(q, k, v, seen, scale, m_i, l_i, acc, IEEE)
        return m_i, l_i, acc

    @triton.jit
    def rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_d, n, eps,
                        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            delta = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        y = (xf * r).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * n + cols, (w.to(tl.float32) * y).to(w.dtype), mask=mask)

    @triton.jit
    def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, tokens, heads, half,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
        # BLOCK_T tokens x every head per program (one program per (token, head) left a large
        # batch's rotation to tens of thousands of 64-byte programs)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
        h = tl.arange(0, BLOCK_H)[None, :, None]
        cols = tl.arange(0, BLOCK)[None, None, :]
        row = (t < tokens) & (cols < half)
        mask = row & (h < heads)
        base = x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh + cols
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + half, mask=mask, other=0.0)
        c = tl.load(cos_ptr + t * half + cols, mask=row, other=0.0)
        s = tl.load(sin_ptr + t * half + cols, mask=row, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        out = out_ptr + (t.to(tl.int64) * heads + h) * 2 * half + cols
        tl.store(out, (a * c - b * s).to(x1.dtype), mask=mask)
        tl.store(out + half, (b * c + a * s).to(x1.dtype), mask=mask)

    @triton.jit
    def qk_norm_rope_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, tokens,
                            q_heads, heads, half, eps, BLOCK_T: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
        # `rms_norm` of every query and key head (the query heads by one weight, the key heads by
        # the other), then `rope`'s rotation of the result, rounded as those two kernels round
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
        h = tl.arange(0, BLOCK_H)[None, :, None]
        cols = tl.arange(0, BLOCK)[None, None, :]
        row = (t < tokens) & (cols < half)
        mask = row & (h < heads)
        base = x_ptr + t.to(tl.int64) * stride_xt + h * 2 * half + cols
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + half, mask=mask, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        r = tl.rsqrt((tl.sum(a * a, axis=2) + tl.sum(b * b, axis=2)) / (2 * half) + eps)
        r = r[:, :, None]
        is_q = h < q_heads
        wq1 = tl.load(qw_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)
        wq2 = tl.load(qw_ptr + half + cols, mask=cols < half, other=0.0).to(tl.float32)
        wk1 = tl.load(kw_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)
        wk2 = tl.load(kw_ptr + half + cols, mask=cols < half, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        n1 = (tl.where(is_q, wq1, wk1) * (a * r).to(x1.dtype).to(tl.float32)).to(dt)
        n2 = (tl.where(is_q, wq2, wk2) * (b * r).to(x1.dtype).to(tl.float32)).to(dt)
        n1, n2 = n1.to(tl.float32), n2.to(tl.float32)
        c = tl.load(cos_ptr + t * half + cols, mask=row, other=0.0)
        s = tl.load(sin_ptr + t * half + cols, mask=row, other=0.0)
        out = out_ptr + (t.to(tl.int64) * heads + h) * 2 * half + cols
        tl.store(out, (n1 * c - n2 * s).to(dt), mask=mask)
        tl.store(out + half, (n2 * c + n1 * s).to(dt), mask=mask)

    @triton.jit
    def silu_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0)
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + row * n + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
                 mask=mask)

    @triton.jit
    def padded_attention_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, cached_ptr, out_ptr,
                                stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                                stride_pb, width, groups, reach_tokens, head_dim, scale,
                                PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        tok = tl.program_id(0)          # row b, token slot w: tok = b * width + w
        h = tl.program_id(1)            # query head
        heads = tl.num_programs(1)
        b = tok // width
        kvh = h // groups
        n_kv = tl.minimum(tl.load(cached_ptr + b) + tok % width + 1, reach_tokens)
        d = tl.arange(0, BLOCK_D)
        dmask = d < head_dim
        q = tl.load(q_ptr + tok * stride_qt + h * stride_qh + d, mask=dmask, other=0.0)
        q = q.to(tl.float32) * scale
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
        l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start in range(0, n_kv, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pmask = pos < n_kv
            page = tl.load(pages_ptr + b * stride_pb + pos // PAGE, mask=pmask, other=0)
            slot = page.to(tl.int64) * PAGE + pos % PAGE
            m2 = pmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                        mask=m2, other=0.0).to(tl.float32)
            s = tl.where(pmask, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=m2, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        out = out_ptr + (tok * heads + h) * head_dim + d
        tl.store(out, (acc / l_i).to(out_ptr.dtype.element_ty), mask=dmask)

    @triton.jit
    def padded_attention_tiled_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, cached_ptr, out_ptr,
                                      stride_qt, stride_qh, stride_ks, stride_kh, stride_vs,
                                      stride_vh, stride_pb, width, groups, reach_tokens,
                                      head_dim, scale, PAGE: tl.constexpr, BLOCK_W: tl.constexpr,
                                      GROUPS: tl.constexpr, BLOCK_D: tl.constexpr,
                                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        # one program: BLOCK_W token slots of row b x the query heads of KV head kvh, so each
        # block of K/V is loaded once for all of them and multiplied as matrices
        tiles = tl.cdiv(width, BLOCK_W)
        b = tl.program_id(0) // tiles
        w0 = (tl.program_id(0) % tiles) * BLOCK_W
        kvh = tl.program_id(1)
        heads = tl.num_programs(1) * groups
        m = tl.arange(0, BLOCK_W * GROUPS)
        w = w0 + m // GROUPS
        h = kvh * groups + m % GROUPS
        live = (w < width) & (m % GROUPS < groups)
        d = tl.arange(0, BLOCK_D)
        dmask = d < head_dim
        tok = (b * width + w).to(tl.int64)
        qmask = live[:, None] & dmask[None, :]
        q = tl.load(q_ptr + tok[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=qmask, other=0.0)
        limit = tl.minimum(tl.load(cached_ptr + b) + w + 1, reach_tokens)  # keys [0, limit)
        n_kv = tl.max(tl.where(live, limit, 0), axis=0)
        m_i = tl.full([BLOCK_W * GROUPS], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_W * GROUPS], tl.float32)
        acc = tl.zeros([BLOCK_W * GROUPS, BLOCK_D], tl.float32)
        for start in range(0, n_kv, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pmask = pos < n_kv
            page = tl.load(pages_ptr + b * stride_pb + pos // PAGE, mask=pmask, other=0)
            slot = page.to(tl.int64) * PAGE + pos % PAGE
            m2 = pmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                        mask=m2, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=m2, other=0.0).to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32)
            else:
                s = tl.dot(q, tl.trans(k)).to(tl.float32)
            s = tl.where(pos[None, :] < limit[:, None], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))   # finite: key 0 is in every block 0
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            if IEEE:
                pv = tl.dot(p.to(q.dtype), v, input_precision="ieee").to(tl.float32)
            else:
                pv = tl.dot(p.to(q.dtype), v).to(tl.float32)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = out_ptr + (tok[:, None] * heads + h[:, None]) * head_dim + d[None, :]
        tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)

    @triton.jit
    def padded_attention_split_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, cached_ptr, m_ptr, l_ptr,
                                      acc_ptr, stride_qt, stride_qh, stride_ks, stride_kh,
                                      stride_vs, stride_vh, stride_pb, tokens, width, groups,
                                      reach_tokens, head_dim, scale, chunk, PAGE: tl.constexpr,
                                      BLOCK_W: tl.constexpr, GROUPS: tl.constexpr,
                                      BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                                      IEEE: tl.constexpr):
        # the tiled kernel's program (BLOCK_W slots of row b x the query heads of KV head kvh)
        # over keys [split * chunk, (split + 1) * chunk) only; writes its unnormalised softmax
        # state (running max m, sum l, accumulator acc; float32) for `padded_attention_merge`. A
        # query with no live key in the chunk (every one, past the row's keys) leaves m = -inf,
        # l = 0 and no acc.
        tiles = tl.cdiv(width, BLOCK_W)
        b = tl.program_id(0) // tiles
        w0 = (tl.program_id(0) % tiles) * BLOCK_W
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        heads = tl.num_programs(1) * groups
        m = tl.arange(0, BLOCK_W * GROUPS)
        w = w0 + m // GROUPS
        h = kvh * groups + m % GROUPS
        live = (w < width) & (m % GROUPS < groups)
        d = tl.arange(0, BLOCK_D)
        dmask = d < head_dim
        tok = (b * width + w).to(tl.int64)
        qmask = live[:, None] & dmask[None, :]
        q = tl.load(q_ptr + tok[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=qmask, other=0.0)
        limit = tl.minimum(tl.load(cached_ptr + b) + w + 1, reach_tokens)  # keys [0, limit)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, tl.max(tl.where(live, limit, 0), axis=0))
        m_i = tl.full([BLOCK_W * GROUPS], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_W * GROUPS], tl.float32)
        acc = tl.zeros([BLOCK_W * GROUPS, BLOCK_D], tl.float32)
        # keys [lo, hi) of row b's pages; a query whose keys ended before a block adds nothing
        m_i, l_i, acc = _paged_keys(q, m_i, l_i, acc, lo, hi, limit, b, kvh, d, dmask, pages_ptr,
                                    k_ptr, v_ptr, stride_pb, stride_ks, stride_kh, stride_vs,
                                    stride_vh, scale, PAGE, BLOCK_N, IEEE)
        part = (split * tokens + tok) * heads + h                    # [splits, tokens, heads]
        tl.store(m_ptr + part, m_i, mask=live)
        tl.store(l_ptr + part, l_i, mask=live)
        tl.store(acc_ptr + part[:, None] * head_dim + d[None, :], acc,
                 mask=qmask & (m_i > float("-inf"))[:, None])

    @triton.jit
    def padded_attention_merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, head_dim, splits,
                                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program per (token, query head): the split kernel's states merged in split order
        tok = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        row = tok.to(tl.int64) * heads + h
        stride_s = tl.num_programs(0).to(tl.int64) * heads    # tokens x heads
        s = tl.arange(0, BLOCK_S)
        ms = tl.load(m_ptr + s * stride_s + row, mask=s < splits, other=float("-inf"))
        ls = tl.load(l_ptr + s * stride_s + row, mask=s < splits, other=0.0)
        m_max = tl.max(ms, axis=0)      # finite: key 0 is in split 0 for every query
        total = tl.sum(tl.where(ms > float("-inf"), tl.exp(ms - m_max) * ls, 0.0), axis=0)
        d = tl.arange(0, BLOCK_D)
        dmask = d < head_dim
        acc = tl.zeros([BLOCK_D], tl.float32)
        for i in range(0, splits):
            m_s = tl.load(m_ptr + i * stride_s + row)
            full = m_s > float("-inf")
            part = tl.load(acc_ptr + (i * stride_s + row) * head_dim + d,
                           mask=d < tl.where(full, head_dim, 0), other=0.0)
            acc += tl.where(full, tl.exp(m_s - m_max), 0.0) * part
        tl.store(out_ptr + row * head_dim + d, (acc / total).to(out_ptr.dtype.element_ty),
                 mask=dmask)

    @triton.jit
    def tree_attention_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, cached_ptr, tk_ptr, tv_ptr,
                              mask_ptr, live_ptr, out_ptr, stride_qt, stride_qh, stride_ks,
                              stride_kh, stride_vs, stride_vh, stride_pb, stride_tb, stride_tm,
                              stride_th, queries, nodes, groups, reach_tokens, head_dim, scale,
                              PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_M: tl.constexpr, HAS_LIVE: tl.constexpr):
        # one program per (tree node of row b, query head): the row's context through its page
        # table (KV 0 .. cached - 1), then the tree nodes its mask row allows, one online softmax
        tok = tl.program_id(0)          # tok = b * queries + i
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        b = tok // queries
        kvh = h // groups
        n_ctx = tl.minimum(tl.load(cached_ptr + b), reach_tokens)
        if HAS_LIVE:   # a node the forward does not verify reads no context
            n_ctx = tl.where(tl.load(live_ptr + tok) != 0, n_ctx, 0)
        d = tl.arange(0, BLOCK_D)
        dmask = d < head_dim
        q = tl.load(q_ptr + tok * stride_qt + h * stride_qh + d, mask=dmask, other=0.0)
        q = q.to(tl.float32) * scale
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
        l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start in range(0, n_ctx, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pmask = pos < n_ctx
            page = tl.load(pages_ptr + b * stride_pb + pos // PAGE, mask=pmask, other=0)
            slot = page.to(tl.int64) * PAGE + pos % PAGE
            m2 = pmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                        mask=m2, other=0.0).to(tl.float32)
            s = tl.where(pmask, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=m2, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        for start in range(0, nodes, BLOCK_M):
            j = start + tl.arange(0, BLOCK_M)
            seen = tl.load(mask_ptr + tok.to(tl.int64) * nodes + j, mask=j < nodes, other=0) != 0
            m2 = seen[:, None] & dmask[None, :]
            base = b.to(tl.int64) * stride_tb + j[:, None] * stride_tm + kvh * stride_th
            k = tl.load(tk_ptr + base + d[None, :], mask=m2, other=0.0).to(tl.float32)
            s = tl.where(seen, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            # a block of only hidden nodes before anything was seen: nothing to add (no NaN)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe)
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(tv_ptr + base + d[None, :], mask=m2, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        out = out_ptr + (tok * heads + h) * head_dim + d
        tl.store(out, (acc / l_i).to(out_ptr.dtype.element_ty), mask=dmask)

    @triton.jit
    def tree_attention_tiled_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, cached_ptr, tk_ptr, tv_ptr,
                                    mask_ptr, live_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                                    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs,
                                    stride_vh, stride_pb, stride_tb, stride_tm, stride_th, tokens,
                                    queries, nodes, groups, reach_tokens, head_dim, scale, chunk,
                                    PAGE: tl.constexpr, BLOCK_W: tl.constexpr,
                                    GROUPS: tl.constexpr, BLOCK_D: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                                    HAS_LIVE: tl.constexpr, SPLIT: tl.constexpr,
                                    IEEE: tl.constexpr):
        # one program: BLOCK_W nodes of row b x the query heads of KV head kvh, so each block of
        # K/V (context and tree) is loaded once for all of them and multiplied as matrices. The
        # context has no causal offset (every node of a row sees keys 0 .. cached - 1), so the
        # key range splits like the padded split kernel's: program `split` runs keys
        # [split * chunk, (split + 1) * chunk); split 0 also runs the tree slots each node's
        # mask row allows. SPLIT: the unnormalised softmax states (float32) go to m/l/acc for
        # `padded_attention_merge` (split 0 holds the node itself, so the merge's maximum is
        # finite); otherwise (one chunk) the output is written here.
        tiles = tl.cdiv(queries, BLOCK_W)
        b = tl.program_id(0) // tiles
        w0 = (tl.program_id(0) % tiles) * BLOCK_W
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        heads = tl.num_programs(1) * groups
        m = tl.arange(0, BLOCK_W * GROUPS)
        w = w0 + m // GROUPS
        h = kvh * groups + m % GROUPS
        valid = (w < queries) & (m % GROUPS < groups)
        d = tl.arange(0, BLOCK_D)
        dmask = d < head_dim
        tok = (b * queries + w).to(tl.int64)
        qmask = valid[:, None] & dmask[None, :]
        q = tl.load(q_ptr + tok[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=qmask, other=0.0)
        n_ctx = tl.minimum(tl.load(cached_ptr + b), reach_tokens)
        limit = tl.where(valid, n_ctx, 0)                              # keys [0, limit)
        if HAS_LIVE:   # a node the forward does not verify reads no context
            alive = tl.load(live_ptr + tok, mask=valid, other=0) != 0
            limit = tl.where(alive, limit, 0)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, tl.max(limit, axis=0))
        m_i = tl.full([BLOCK_W * GROUPS], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_W * GROUPS], tl.float32)
        acc = tl.zeros([BLOCK_W * GROUPS, BLOCK_D], tl.float32)
        # keys [lo, hi) of row b's pages; a query whose keys ended before a block adds nothing
        m_i, l_i, acc = _paged_keys(q, m_i, l_i, acc, lo, hi, limit, b, kvh, d, dmask, pages_ptr,
                                    k_ptr, v_ptr, stride_pb, stride_ks, stride_kh, stride_vs,
                                    stride_vh, scale, PAGE, BLOCK_N, IEEE)
        n_tree = tl.where(split == 0, nodes, 0)
        for start in range(0, n_tree, BLOCK_M):
            j = start + tl.arange(0, BLOCK_M)
            jmask = j < nodes
            seen = tl.load(mask_ptr + tok[:, None] * nodes + j[None, :],
                           mask=valid[:, None] & jmask[None, :], other=0) != 0
            base = b.to(tl.int64) * stride_tb + j.to(tl.int64) * stride_tm + kvh * stride_th
            m2 = jmask[:, None] & dmask[None, :]
            k = tl.load(tk_ptr + base[:, None] + d[None, :], mask=m2, other=0.0).to(q.dtype)
            v = tl.load(tv_ptr + base[:, None] + d[None, :], mask=m2, other=0.0).to(q.dtype)
            m_i, l_i, acc = _softmax_step(q, k, v, seen, scale, m_i, l_i, acc, IEEE)
        if SPLIT:
            part = (split * tokens + tok) * heads + h                # [splits, tokens, heads]
            tl.store(m_ptr + part, m_i, mask=valid)
            tl.store(l_ptr + part, l_i, mask=valid)
            tl.store(acc_ptr + part[:, None] * head_dim + d[None, :], acc,
                     mask=qmask & (m_i > float("-inf"))[:, None])
        else:
            out = out_ptr + (tok[:, None] * heads + h[:, None]) * head_dim + d[None, :]
            tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)

    @triton.jit
    def store_kv_kernel(k_ptr, v_ptr, slots_ptr, kc_ptr, vc_ptr, stride_kt, stride_kh,
                        stride_vt, stride_vh, stride_cs, stride_ch, stride_vcs, stride_vch,
                        tokens, kv_heads, head_dim, cache_dim, pages_ptr, cached_ptr, qo_ptr,
                        stride_pb, width, num_pages, dummy_slot, PADDED: tl.constexpr,
                        PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_D: tl.constexpr):
        # BLOCK_T tokens x every KV head per program
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
        h = tl.arange(0, BLOCK_H)[None, :, None]
        d = tl.arange(0, BLOCK_D)[None, None, :]
        live = (t < tokens) & (h < kv_heads)
        if PADDED:  # token slot w of row b: KV index cached[b] + w, or the dummy slot
            b = t // width
            w = t % width
            pos = tl.load(cached_ptr + b, mask=t < tokens, other=0).to(tl.int64) + w
            page = tl.load(pages_ptr + b * stride_pb + tl.minimum(pos // PAGE, num_pages - 1),
                           mask=t < tokens, other=0)
            real = w < tl.load(qo_ptr + b, mask=t < tokens, other=0)
            slot = tl.where(real, page.to(tl.int64) * PAGE + pos % PAGE, dummy_slot)
        else:
            slot = tl.load(slots_ptr + t, mask=t < tokens, other=0).to(tl.int64)
        src = live & (d < head_dim)
        dst = live & (d < cache_dim)     # channels head_dim..cache_dim-1 of the cache get zeros
        k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=src, other=0.0)
        v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=src, other=0.0)
        tl.store(kc_ptr + slot * stride_cs + h * stride_ch + d, k.to(kc_ptr.dtype.element_ty),
                 mask=dst)
        tl.store(vc_ptr + slot * stride_vcs + h * stride_vch + d, v.to(vc_ptr.dtype.element_ty),
                 mask=dst)

    @triton.jit
    def greedy_accept_kernel(draft_ptr, arg_ptr, nd_ptr, accept_ptr, tokens_ptr, stride_d,
                             stride_a, steps, vocab, fill, BLOCK_S: tl.constexpr):
        b = tl.program_id(0)
        j = tl.arange(0, BLOCK_S)                     # positions 0..steps (steps + 1 of them)
        x = tl.load(draft_ptr + b * stride_d + j, mask=j < steps, other=-1).to(tl.int64)
        arg = tl.load(arg_ptr + b * stride_a + j, mask=j <= steps, other=0).to(tl.int64)
        n_draft = tl.minimum(tl.maximum(tl.load(nd_ptr + b).to(tl.int64), 0), steps)
        kept = (x == arg) & (x >= 0) & (x < vocab) & (j < n_draft)
        accept = tl.min(tl.where(kept, steps, j), axis=0)   # the first position not kept
        final = tl.sum(tl.where(j == accept, arg, 0), axis=0)
        out = tl.where(j < accept, x, tl.where(j == accept, final, fill))
        tl.store(tokens_ptr + b * (steps + 1) + j, out, mask=j <= steps)
        tl.store(accept_ptr + b, accept)

    @triton.jit
    def one_hot_kernel(tok_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tok = tl.load(tok_ptr + b)
        tl.store(out_ptr + b * vocab + cols, (cols == tok).to(tl.float32), mask=cols < vocab)

    @triton.jit
    def lag_append_kernel(rows_ptr, tok_ptr, feat_ptr, lag_ptr, ring_tok_ptr, ring_feat_ptr,
                          stride_f, stride_rt, stride_rs, stride_re, dim, capacity, dummy_slot,
                          BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        slot = tl.load(rows_ptr + b).to(tl.int64)
        lag = tl.minimum(tl.load(lag_ptr + slot).to(tl.int64), capacity - 1)
        tl.store(ring_tok_ptr + slot * stride_rt + lag, tl.load(tok_ptr + b))
        base = ring_feat_ptr + slot * stride_rs + lag * stride_re
        for start in range(0, dim, BLOCK_D):
            d = start + tl.arange(0, BLOCK_D)
            x = tl.load(feat_ptr + b * stride_f + d, mask=d < dim)
            tl.store(base + d, x.to(ring_feat_ptr.dtype.element_ty), mask=d < dim)
        if slot != dummy_slot:  # dummy rows share one slot: it keeps an empty ring
            tl.store(lag_ptr + slot, lag + 1)

    # the counter-based uniforms of workers.spec_decode, in the same int64 arithmetic (every
    # intermediate below 2^49: exact, so the numbers are bit-identical to the torch code's).
    # y mod 2^32 is y - ((y >> 32) << 32) (the arithmetic shift floors, so negative y too);
    # (x * c) mod 2^32 is that of x * c_lo + ((x & 0xFFFF) * c_hi) << 16; an absorption step is
    # y = (h ^ word) * 0x9E3779B1 mod 2^32, then y ^ (y >> 15) (h ^ word is symmetric, so the
    # torch code's first step, the seed's low word absorbing the initial value, is the same).
    @triton.jit
    def uniforms_kernel(seed_ptr, counter_ptr, out_ptr, n, salt, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        seed = tl.load(seed_ptr + b).to(tl.int64)
        counter = tl.load(counter_ptr + b).to(tl.int64)
        s_top, c_top = seed >> 32, counter >> 32
        j = tl.arange(0, BLOCK)
        # the words in order: seed low / high, counter low / high, salt, then each index j
        words = (seed - (s_top << 32), s_top - ((s_top >> 32) << 32), counter - (c_top << 32),
                 c_top - ((c_top >> 32) << 32), seed * 0 + salt, j.to(tl.int64))
        h = seed * 0 + 0x243F6A88
        for i in tl.static_range(6):
            y = h ^ words[i]
            y = y * 0x79B1 + (((y & 0xFFFF) * 0x9E37) << 16)
            y = y - ((y >> 32) << 32)
            h = y ^ (y >> 15)
        x = h ^ (h >> 16)                 # MurmurHash3's finaliser
        x = x * 0xCA6B + (((x & 0xFFFF) * 0x85EB) << 16)
        x = x - ((x >> 32) << 32)
        x = x ^ (x >> 13)
        x = x * 0xAE35 + (((x & 0xFFFF) * 0xC2B2) << 16)
        x = x - ((x >> 32) << 32)
        x = x ^ (x >> 16)
        u = (x >> 8).to(tl.float32) * (1.0 / 16777216.0)
        tl.store(out_ptr + b * n + j, u, mask=j < n)

    return SimpleNamespace(rms_norm=rms_norm_kernel, rope=rope_kernel, silu_mul=silu_mul_kernel,
                           qk_norm_rope=qk_norm_rope_kernel,
                           padded_attention=padded_attention_kernel,
                           padded_attention_tiled=padded_attention_tiled_kernel,
                           padded_attention_split=padded_attention_split_kernel,
                           padded_attention_merge=padded_attention_merge_kernel,
                           tree_attention=tree_attention_kernel,
                           tree_attention_tiled=tree_attention_tiled_kernel,
                           store_kv=store_kv_kernel,
                           greedy_accept=greedy_accept_kernel, one_hot=one_hot_kernel,
                           lag_append=lag_append_kernel, uniforms=uniforms_kernel)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as [rows, last] with a unit stride along the last dimension."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (float32 statistics, the result in `weight`'s dtype)."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=weight.dtype, device=x.device)
    if x2.shape[0]:
        _kernels().rms_norm[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0,
                                            x2.shape[1], eps, HAS_DELTA=False,
                                            BLOCK=_pow2(x2.shape[1]))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + delta`` and ``rms_norm(s)``, in one launch: returns ``(s, norm)``."""
    x2, d2 = _rows(x), _rows(delta)
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=weight.dtype, device=x.device)
    if x2.shape[0]:
        _kernels().rms_norm[(x2.shape[0],)](x2, d2, weight, out, total, x2.stride(0),
                                            d2.stride(0), x2.shape[1], eps, HAS_DELTA=True,
                                            BLOCK=_pow2(x2.shape[1]))
    return total.view(x.shape), out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `x` [T, H, D] by `cos`/`sin` [T, D/2] (float32)."""
    t, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    if t:
        half = dim // 2
        block_h, block = _pow2(heads), _pow2(half)
        block_t = _tile_tokens(block_h * block)
        _kernels().rope[(-(-t // block_t),)](x, cos, sin, out, x.stride(0), x.stride(1), t,
                                             heads, half, BLOCK_T=block_t, BLOCK_H=block_h,
                                             BLOCK=block)
    return out


def qk_norm_rope(qk: torch.Tensor, q_heads: int, k_heads: int, head_dim: int,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head query and key norms and their rotation in one launch, where four ran
    (`rms_norm` and `rope` for each): `qk` [T, >= (q_heads + k_heads) * head_dim] holds the
    query heads then the key heads side by side from column 0 (a fused QKV GEMM's output);
    every head is RMS-normalised over `head_dim` (float32 statistics, `eps`) by `q_weight` or
    `k_weight` [head_dim], rounded to their dtype, then rotated by `cos`/`sin` [T, head_dim/2]
    (rotate-half). Returns (q [T, q_heads, head_dim], k [T, k_heads, head_dim]), views of one
    buffer in the weights' dtype."""
    t = qk.shape[0]
    heads = q_heads + k_heads
    if qk.dim() != 2 or qk.shape[1] < heads * head_dim or head_dim % 2:
        raise ValueError(f"qk_norm_rope: qk of shape {tuple(qk.shape)} for {q_heads} query and "
                         f"{k_heads} key heads of {head_dim}; allowed: [T, >= heads * head_dim] "
                         "and an even head_dim")
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,) \
            or q_weight.dtype != k_weight.dtype:
        raise ValueError(f"qk_norm_rope: norm weights {tuple(q_weight.shape)} {q_weight.dtype}, "
                         f"{tuple(k_weight.shape)} {k_weight.dtype}; allowed: [head_dim] each, "
                         "one dtype")
    if qk.stride(1) != 1:
        qk = qk.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty((t, heads, head_dim), dtype=q_weight.dtype, device=qk.device)
    if t:
        half = head_dim // 2
        block_h, block = _pow2(heads), _pow2(half)
        block_t = _tile_tokens(block_h * block)
        _kernels().qk_norm_rope[(-(-t // block_t),)](
            qk, q_weight.contiguous(), k_weight.contiguous(), cos, sin, out, qk.stride(0), t,
            q_heads, heads, half, eps, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK=block)
    return out[:, :q_heads], out[:, q_heads:]


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for `g`, `u` of the same shape."""
    g2, u2 = _rows(g), _rows(u)
    rows, n = g2.shape
    out = torch.empty((rows, n), dtype=g.dtype, device=g.device)
    if rows:
        block = min(_pow2(n), 1024)
        _kernels().silu_mul[(rows, -(-n // block))](g2, u2, out, g2.stride(0), u2.stride(0), n,
                                                    BLOCK=block)
    return out.view(g.shape)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """``k_cache[slots[t]] = k[t]`` and ``v_cache[slots[t]] = v[t]`` in one launch: `k`, `v`
    [T, Hkv, D], the caches [S, Hkv, Ds] (Ds >= D: channels beyond D are stored as zeros), values
    cast to the cache's dtype (as ``KVPool.write``'s two ``index_copy_``)."""
    tokens, kv_heads, dim = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if tokens:
        slots = slots.contiguous()
        _store_kv(k_cache, v_cache, k, v, slots, slots, slots, slots, 0, 1, 1, 0, 1, False)


def store_kv_padded(k_cache: torch.Tensor, v_cache: torch.Tensor, page_tab: torch.Tensor,
                    cached: torch.Tensor, qo_len: torch.Tensor, width: int, page_size: int,
                    dummy_slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """``store_kv`` of a padded batch (``workers.attention.static_backend``), the slots worked
    out in the kernel: token slot ``w`` of row ``b`` (token ``b * width + w``) goes to KV index
    ``cached[b] + w`` through ``page_tab[b]`` (page index capped at its last column) when
    ``w < qo_len[b]``, else to ``dummy_slot``."""
    tokens = k.shape[0]
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if tokens:
        if page_tab.stride(-1) != 1:
            page_tab = page_tab.contiguous()
        _store_kv(k_cache, v_cache, k, v, page_tab, page_tab, cached, qo_len, page_tab.stride(0),
                  width, page_tab.shape[1], dummy_slot, page_size, True)


def _store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slots: torch.Tensor, pages: torch.Tensor, cached: torch.Tensor, qo_len: torch.Tensor,
              stride_pb: int, width: int, num_pages: int, dummy_slot: int, page: int,
              padded: bool) -> None:
    cache_dim = k_cache.shape[-1]
    tokens, kv_heads = k.shape[0], k.shape[1]
    block_h, block_d = _pow2(kv_heads), _pow2(cache_dim)
    block_t = _tile_tokens(block_h * block_d)
    _kernels().store_kv[(-(-tokens // block_t),)](
        k, v, slots, k_cache, v_cache, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), tokens,
        kv_heads, k.shape[2], cache_dim, pages, cached, qo_len, stride_pb, width, num_pages,
        dummy_slot, PADDED=padded, PAGE=page, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_D=block_d)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_tile(groups: int, width: int) -> tuple[int, int]:
    """(BLOCK_W, GROUPS) of the split kernel's program: the query heads of one KV head (padded
    to a power of two) by as many of a row's slots as reach tl.dot's least rows, and up to all
    of them within TILE_QUERIES query vectors."""
    group_slots = _pow2(groups)
    return max(1, GROUPED_QUERIES // group_slots,
               min(_pow2(width), TILE_QUERIES // group_slots)), group_slots


def attention_splits(rows: int, width: int, heads: int, kv_heads: int, reach_tokens: int,
                     sm_count: int) -> int:
    """Key chunks per (row tile, KV head) that `padded_attention` runs on a GPU of `sm_count`
    SMs (1: the unsplit kernels), from static values only, so a graph captures one grid: split
    at widths <= SPLIT_MAX_WIDTH, reaches >= SPLIT_MIN_REACH and unsplit grids below
    SPLIT_BUSY x SMs programs, to about SPLIT_PROGRAMS x SMs programs, chunks of at least
    SPLIT_MIN_CHUNK keys, SPLIT_MAX chunks at most."""
    if width > SPLIT_MAX_WIDTH or reach_tokens < SPLIT_MIN_REACH or rows < 1 or kv_heads < 1:
        return 1
    block_w, _ = _split_tile(max(1, heads // kv_heads), width)
    programs = rows * -(-width // block_w) * kv_heads
    if programs >= SPLIT_BUSY * sm_count:
        return 1
    want = -(-int(SPLIT_PROGRAMS * sm_count) // programs)
    return max(1, min(want, reach_tokens // SPLIT_MIN_CHUNK, SPLIT_MAX))


def padded_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                     page_tab: torch.Tensor, cached: torch.Tensor, width: int,
                     scale: float, splits: int | None = None) -> torch.Tensor:
    """Causal attention of a padded batch: `q` [B*width, Hq, D]; token slot `w` of row `b` sees
    KV indices ``0 .. cached[b] + w`` (capped at the row's reach, ``page_tab.shape[1]`` pages)
    through its page table `page_tab` [B, P]; `k_pages`/`v_pages` [N, page_size, Hkv, Ds]
    (Ds >= D; channels beyond D ignored). Returns [B*width, Hq, D] in `q`'s dtype.

    `splits`: the key range cut into at most that many chunks of whole blocks, each its own
    program, their softmax states merged after (`padded_attention_split` then
    `padded_attention_merge`; float16/bfloat16/float32); 1: the unsplit kernels; None: on a GPU
    `attention_splits` of the call's shapes (at widths 2 .. SPLIT_MAX_WIDTH the split kernel
    even when that is 1), elsewhere 1."""
    tokens, heads, dim = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    k_flat = k_pages.view(-1, kv_heads, k_pages.shape[3])
    v_flat = v_pages.view(-1, kv_heads, v_pages.shape[3])
    out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    groups = heads // kv_heads
    reach = page_tab.shape[1] * page_size
    # the split kernel's tile also runs unsplit (one chunk): at widths 2 .. SPLIT_MAX_WIDTH it
    # is the faster form on a GPU even then (the per-slot kernel loads K/V once per query head:
    # measured 10-40x slower at 4 and 8 slots, docs/data/runs/attention_split_h200_2026-12-03)
    tile = False
    if splits is None:
        splits = 1
        if q.is_cuda and q.dtype in TILED_DTYPES and tokens:
            splits = attention_splits(tokens // width, width, heads, kv_heads, reach,
                                      _sm_count(q.device.index if q.device.index is not None
                                                else torch.cuda.current_device()))
            tile = 1 < width <= SPLIT_MAX_WIDTH
    elif not isinstance(splits, int) or splits < 1:
        raise ValueError(f"padded_attention: splits={splits!r}; allowed: None or an int >= 1")
    elif splits > 1 and q.dtype not in TILED_DTYPES:
        raise ValueError(f"padded_attention: splits={splits} with {q.dtype}; the split kernel "
                         f"takes {', '.join(str(t) for t in TILED_DTYPES)} (splits=1 otherwise)")
    if tokens and (splits > 1 or tile) and reach > 0:
        _split_attention(q, k_flat, v_flat, page_tab, cached, out, width, groups, reach,
                         page_size, scale, splits)
    elif tokens and width >= TILED_WIDTH and q.dtype in TILED_DTYPES:  # a tile of slots x heads
        group_slots = _pow2(groups)
        block_w = max(1, TILE_QUERIES // group_slots)
        rows = tokens // width
        _kernels().padded_attention_tiled[(rows * -(-width // block_w), kv_heads)](
            q, k_flat, v_flat, page_tab, cached, out, q.stride(0), q.stride(1),
            k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
            page_tab.stride(0), width, groups, page_tab.shape[1] * page_size, dim, scale,
            PAGE=page_size, BLOCK_W=block_w, GROUPS=group_slots, BLOCK_D=max(16, _pow2(dim)),
            BLOCK_N=64, IEEE=q.dtype == torch.float32, num_warps=4)
    elif tokens and width == 1 and groups > 1 and q.is_cuda and q.dtype in GROUPED_DTYPES:
        # one program per token and KV head: each block of K/V loaded once for the query heads
        # that share it (the per-slot kernel loads it once per query head)
        group_slots = _pow2(groups)
        block_w = max(1, GROUPED_QUERIES // group_slots)
        _kernels().padded_attention_tiled[(tokens, kv_heads)](
            q, k_flat, v_flat, page_tab, cached, out, q.stride(0), q.stride(1),
            k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
            page_tab.stride(0), 1, groups, page_tab.shape[1] * page_size, dim, scale,
            PAGE=page_size, BLOCK_W=block_w, GROUPS=group_slots, BLOCK_D=max(16, _pow2(dim)),
            BLOCK_N=64, IEEE=False, num_warps=4)
    elif tokens:
        _kernels().padded_attention[(tokens, heads)](
            q, k_flat, v_flat, page_tab, cached, out, q.stride(0), q.stride(1),
            k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
            page_tab.stride(0), width, heads // kv_heads, page_tab.shape[1] * page_size, dim,
            scale, PAGE=page_size, BLOCK_D=_pow2(dim), BLOCK_N=64, num_warps=2)
    return out


def _split_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                     page_tab: torch.Tensor, cached: torch.Tensor, out: torch.Tensor, width: int,
                     groups: int, reach: int, page_size: int, scale: float, splits: int) -> None:
    """`padded_attention` with the key range in chunks: the split kernel's softmax states into
    float32 scratch (torch-allocated: a graph's pool holds it), then the merge into `out`."""
    tokens, heads, dim = q.shape
    kv_heads = k_flat.shape[1]
    blocks = -(-reach // SPLIT_BLOCK_N)
    chunk = -(-blocks // splits) * SPLIT_BLOCK_N           # keys per chunk, whole blocks
    n = -(-reach // chunk)                                  # no chunk wholly past the reach
    block_w, group_slots = _split_tile(groups, width)
    m = torch.empty((n, tokens, heads), dtype=torch.float32, device=q.device)
    l = torch.empty((n, tokens, heads), dtype=torch.float32, device=q.device)
    acc = torch.empty((n, tokens, heads, dim), dtype=torch.float32, device=q.device)
    kern = _kernels()
    kern.padded_attention_split[(tokens // width * -(-width // block_w), kv_heads, n)](
        q, k_flat, v_flat, page_tab, cached, m, l, acc, q.stride(0), q.stride(1),
        k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
        page_tab.stride(0), tokens, width, groups, reach, dim, scale, chunk, PAGE=page_size,
        BLOCK_W=block_w, GROUPS=group_slots, BLOCK_D=max(16, _pow2(dim)), BLOCK_N=SPLIT_BLOCK_N,
        IEEE=q.dtype == torch.float32, num_warps=4)
    # BLOCK_S: one value for every count up to SPLIT_MAX (fewer compiled variants)
    kern.padded_attention_merge[(tokens, heads)](m, l, acc, out, dim, n,
                                                 BLOCK_S=_pow2(max(n, SPLIT_MAX)),
                                                 BLOCK_D=_pow2(dim), num_warps=1)


def tree_attention_splits(rows: int, queries: int, heads: int, kv_heads: int,
                          reach_tokens: int, sm_count: int) -> int:
    """Context chunks per (node tile, KV head) that `tree_attention`'s tiled kernel runs on a
    GPU of `sm_count` SMs, from static values only (one grid per graph): `attention_splits`'s
    rule without its width cap (a tree's nodes share one context range, so a tile costs the
    same at any node count)."""
    if reach_tokens < SPLIT_MIN_REACH or rows < 1 or kv_heads < 1 or queries < 1:
        return 1
    block_w, _ = _split_tile(max(1, heads // kv_heads), queries)
    programs = rows * -(-queries // block_w) * kv_heads
    if programs >= SPLIT_BUSY * sm_count:
        return 1
    want = -(-int(SPLIT_PROGRAMS * sm_count) // programs)
    return max(1, min(want, reach_tokens // SPLIT_MIN_CHUNK, SPLIT_MAX))


def tree_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                   page_tab: torch.Tensor, cached: torch.Tensor, tree_k: torch.Tensor,
                   tree_v: torch.Tensor, mask: torch.Tensor, scale: float,
                   live: torch.Tensor | None = None, tiled: bool | None = None,
                   splits: int | None = None) -> torch.Tensor:
    """Attention of draft-tree nodes (`workers.attention.tree`): `q` [B*Q, Hq, D], node `i` of
    row `b` sees KV ``0 .. cached[b] - 1`` through `page_tab` [B, P] (capped at the row's reach)
    and the tree slots `j` of `tree_k`/`tree_v` [B, M, Hkv, D] where `mask` [B, Q, M] (bool or
    int8) is set (its ancestors and itself: at least one per node); `live` [B, Q] (optional):
    a node not live reads no context (its ancestors' slots alone). Returns [B*Q, Hq, D] in
    `q`'s dtype.

    `tiled`: the tiled kernel (a program per tile of a row's nodes x the query heads of one KV
    head, `tl.dot`; each K/V block loaded once per KV head), the context optionally split in
    `splits` chunks merged after (`padded_attention_merge`); False: the per-(node, query head)
    kernel (unsplit). None: tiled for float16/bfloat16/float32, float64 per node. `splits`
    None: `tree_attention_splits` of the static shapes on a GPU, 1 elsewhere."""
    tokens, heads, dim = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, queries, nodes = mask.shape
    if tokens != batch * queries:
        raise ValueError(f"tree_attention: q has {tokens} rows for a mask of {batch} rows x "
                         f"{queries} nodes")
    if tiled is None:
        tiled = q.dtype in TILED_DTYPES
    elif tiled and q.dtype not in TILED_DTYPES:
        raise ValueError(f"tree_attention: tiled=True with {q.dtype}; the tiled kernel takes "
                         f"{', '.join(str(t) for t in TILED_DTYPES)}")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"tree_attention: splits={splits!r}; allowed: None or an int >= 1")
    if splits is not None and splits > 1 and not tiled:
        raise ValueError(f"tree_attention: splits={splits} with the per-node kernel "
                         f"(tiled=False); splits need the tiled kernel")
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    k_flat = k_pages.view(-1, kv_heads, k_pages.shape[3])
    v_flat = v_pages.view(-1, kv_heads, v_pages.shape[3])
    tree_k, tree_v = tree_k.contiguous(), tree_v.contiguous()
    flags = mask.to(torch.int8).contiguous()
    alive = live.to(torch.int8).contiguous() if live is not None else flags
    out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    groups = heads // kv_heads
    reach = page_tab.shape[1] * page_size
    if not tokens:
        return out
    kern = _kernels()
    if not tiled:
        kern.tree_attention[(tokens, heads)](
            q, k_flat, v_flat, page_tab, cached, tree_k, tree_v, flags, alive, out, q.stride(0),
            q.stride(1), k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
            page_tab.stride(0), tree_k.stride(0), tree_k.stride(1), tree_k.stride(2), queries,
            nodes, groups, reach, dim, scale, PAGE=page_size, BLOCK_D=_pow2(dim), BLOCK_N=64,
            BLOCK_M=max(16, min(64, _pow2(nodes))), HAS_LIVE=live is not None, num_warps=2)
        return out
    if splits is None:
        splits = 1
        if q.is_cuda:
            splits = tree_attention_splits(batch, queries, heads, kv_heads, reach,
                                           _sm_count(q.device.index if q.device.index is not None
                                                     else torch.cuda.current_device()))
    blocks = -(-reach // SPLIT_BLOCK_N)
    chunk = max(1, -(-blocks // splits)) * SPLIT_BLOCK_N    # keys per chunk, whole blocks
    n = max(1, -(-reach // chunk))                         # no chunk wholly past the reach
    block_w, group_slots = _split_tile(groups, queries)
    split = n > 1
    if split:   # float32 scratch, torch-allocated: a graph's pool holds it
        m = torch.empty((n, tokens, heads), dtype=torch.float32, device=q.device)
        l = torch.empty((n, tokens, heads), dtype=torch.float32, device=q.device)
        acc = torch.empty((n, tokens, heads, dim), dtype=torch.float32, device=q.device)
    else:
        m = l = acc = out
    kern.tree_attention_tiled[(batch * -(-queries // block_w), kv_heads, n)](
        q, k_flat, v_flat, page_tab, cached, tree_k, tree_v, flags, alive, out, m, l, acc,
        q.stride(0), q.stride(1), k_flat.stride(0), k_flat.stride(1), v_flat.stride(0),
        v_flat.stride(1), page_tab.stride(0), tree_k.stride(0), tree_k.stride(1),
        tree_k.stride(2), tokens, queries, nodes, groups, reach, dim, scale, chunk,
        PAGE=page_size, BLOCK_W=block_w, GROUPS=group_slots, BLOCK_D=max(16, _pow2(dim)),
        BLOCK_N=SPLIT_BLOCK_N, BLOCK_M=max(16, min(64, _pow2(nodes))),
        HAS_LIVE=live is not None, SPLIT=split, IEEE=q.dtype == torch.float32, num_warps=4)
    if split:
        kern.padded_attention_merge[(tokens, heads)](m, l, acc, out, dim, n,
                                                     BLOCK_S=_pow2(max(n, SPLIT_MAX)),
                                                     BLOCK_D=_pow2(dim), num_warps=1)
    return out


def greedy_accept(draft: torch.Tensor, target_arg: torch.Tensor, num_draft: torch.Tensor,
                  vocab: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of ``workers.spec_decode.verify`` (``all_greedy``) in one launch: draft
    ``j`` of row ``b`` (``draft`` [B, S]) is kept when it is in ``[0, vocab)``, equals
    ``target_arg[b, j]`` and ``j < clamp(num_draft[b], 0, S)``; ``accept_len`` counts the leading
    kept ones; ``tokens`` [B, S+1]: the accepted drafts, ``target_arg[b, accept_len]``, then
    ``fill``. Returns ``(accept_len [B], tokens [B, S+1])``, int64."""
    b, steps = draft.shape
    if draft.stride(-1) != 1:
        draft = draft.contiguous()
    if target_arg.stride(-1) != 1:
        target_arg = target_arg.contiguous()
    accept = torch.empty(b, dtype=torch.int64, device=draft.device)
    tokens = torch.empty((b, steps + 1), dtype=torch.int64, device=draft.device)
    if b:
        _kernels().greedy_accept[(b,)](draft, target_arg, num_draft.contiguous(), accept, tokens,
                                       draft.stride(0), target_arg.stride(0), steps, vocab, fill,
                                       BLOCK_S=_pow2(steps + 1))
    return accept, tokens


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32: 1.0 at ``tokens[b]`` (in range), 0.0 elsewhere; one launch."""
    out = torch.empty((tokens.shape[0], vocab), dtype=torch.float32, device=tokens.device)
    if tokens.shape[0]:
        block = min(_pow2(vocab), 1024)
        _kernels().one_hot[(tokens.shape[0], -(-vocab // block))](tokens.contiguous(), out, vocab,
                                                                   BLOCK=block)
    return out


def lag_append(rows: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor,
               slot_lag: torch.Tensor, ring_tokens: torch.Tensor, ring_features: torch.Tensor,
               dummy_slot: int) -> None:
    """For each row ``b`` with slot ``s = rows[b]`` and ``j = slot_lag[s]`` (capped at the
    ring's last entry): ``ring_tokens[s, j] = tokens[b]``, ``ring_features[s, j] = features[b]``
    and, unless ``s`` is `dummy_slot`, ``slot_lag[s] = j + 1``; one launch. Rows name distinct
    slots, but for the dummy one (whose ring entry is scratch)."""
    if not rows.shape[0]:
        return
    if features.stride(-1) != 1:
        features = features.contiguous()
    dim = features.shape[-1]
    _kernels().lag_append[(rows.shape[0],)](
        rows.contiguous(), tokens.contiguous(), features, slot_lag, ring_tokens, ring_features,
        features.stride(0), ring_tokens.stride(0), ring_features.stride(0),
        ring_features.stride(1), dim, ring_tokens.shape[1], dummy_slot,
        BLOCK_D=min(_pow2(dim), 1024))


def uniforms(seed: torch.Tensor, counter: torch.Tensor, salt: int, n: int) -> torch.Tensor:
    """``workers.spec_decode.uniforms`` (seed, counter: [B] integers; salt in [0, 2^32)) in one
    launch instead of about 60: [B, n] float32, bit-identical to the torch code."""
    rows = seed.shape[0]
    out = torch.empty((rows, n), dtype=torch.float32, device=seed.device)
    if rows:
        _kernels().uniforms[(rows,)](seed.contiguous(), counter.contiguous(), out, n, salt,
                                     BLOCK=_pow2(n))
    return out
