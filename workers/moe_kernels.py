"""The fused MoE path of ``workers.model.moe.MoeBlock`` on the GPU: tokens sorted by expert, two
grouped GEMMs in Triton, static shapes (so a CUDA graph captures it at every depth and bucket).

    out = fused_moe(x [N, d], ids [N, k], weights [N, k], w13 [E, 2F, d], w2 [E, d, F])
    ids, weights = route(logits [N, E], k, norm, dtype)      # the router's choice, one kernel
    s, h = combine(pairs [N, k, d], shared, gate, x, norm_weight, eps)   # sum, add, norm

``ids`` are expert ids, this rank's ``first .. first + E - 1`` (``fused_moe``'s ``first``, 0 but
on an expert-parallel rank; any other id is another rank's expert, contributing nothing here);
``w13[e]`` is expert ``first + e``'s gate rows then its up rows; the result is
``sum_j weights[:, j] * expert_{ids[:, j]}(x)`` [N, d] over this rank's experts.

1. ``align``: the ``P = N·k`` (token, choice) pairs sorted by expert (a stable sort), each
   expert's run padded to a multiple of ``BLOCK_M`` rows, so every block of ``BLOCK_M`` sorted
   rows belongs to one expert. The padded length is bounded by ``P + E·(BLOCK_M - 1)`` whatever the
   routing: every tensor has a shape fixed by ``N``, ``k`` and ``E``, and blocks past the last
   expert's run are skipped by the kernels (no host sync, nothing data-dependent in a shape).
   Up to `ALIGN_KERNEL_PAIRS` pairs one Triton program computes it (`align_kernel`: counts,
   padded offsets, each pair's place by its rank among the earlier pairs of its expert — the
   stable sort's order — and every block's expert), not the ~25 torch ops of `align_torch`;
   past it the same in three launches of many programs (`align_multi`: counts per chunk of
   pairs, one scan, the scatter), where the one program's sequential steps grow with the pairs.
2. ``gate_up``: per block, ``silu(x W_gate^T) * (x W_up^T)`` of its rows, float32 accumulation.
3. ``down``: per block, ``h W_down^T`` times each pair's routing weight, written to its pair.
4. The ``k`` pairs of each token summed: here, or (``summed=False``) by `combine` in one launch
   with what the decoder adds after the block (a shared expert's gated rows, the next residual
   add and RMSNorm: ``workers.model.moe.MoeOutput``).

A decode round routes few pairs (batch 1 at top 8: 8), and there the alignment and the grouped
grid (one 16-row block per expert and column slice, nearly all of them empty padding) cost more
than the weights (one H200, graph-replayed, Qwen3-30B-A3B's shape: the torch alignment 47 us, the
one-program alignment 11 us, against 23 us to read the 8 experts' weights at 3.25 TB/s;
`docs/data/runs/moe_layer_h200_2026-12-03/`). So at most `PAIR_PATH_PAIRS` pairs (2 rows at top
8: where the layer measured faster so) take the pair path instead: no alignment;
per (pair, column slice) one program multiplies the pair's token row by its expert's weights
(a GEMV: the slice's rows read once, contiguous along the reduction), the same float32
accumulation and the same roundings as the grouped kernels; a pair whose expert is another
rank's writes zeros. Pairs routed to the same expert read its weights once each (the L2 may
serve the repeats): a few pairs, a few experts. The choice depends on the shape alone.

Like ``workers.kernels`` it runs under triton's interpreter on a CPU (``TRITON_INTERPRET=1``),
which is how the CPU tests compare it with the sparse torch path.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

BLOCK_M = 16     # sorted rows per block (tl.dot's smallest tile; decode rounds route few rows)
BLOCK_N = 64     # output columns per program
BLOCK_K = 64     # reduction slice
DTYPES = (torch.float16, torch.bfloat16, torch.float32)   # tl.dot's (float64: MoeBlock.dense)
# At most this many (token, choice) pairs: the pair path. One H200, Qwen3-30B-A3B's layer (top 8)
# graph-replayed (docs/data/runs/moe_layer_h200_2026-12-03/moe_layer.json): the pair path against
# the grouped GEMMs 58.8 / 65.3 us at 1 row (8 pairs), 70.4 / 72.4 at 2 (16), but 117.0 / 105.5
# at 4 (32) and 180.0 / 156.0 at 8 (64): the grouped GEMMs from 32 pairs on.
PAIR_PATH_PAIRS = 16
PAIR_BLOCK_N = 16      # the pair path's output columns per program
PAIR_BLOCK_K = 256     # its reduction slice
# At most this many pairs: `align` in one Triton program (its steps run one after another). The
# same run: faster than the torch ops at every row count up to 1024 pairs (10-57 us against
# 47-79 us), slower past it (256 rows: 106 against 82 us), where the torch ops serve.
ALIGN_KERNEL_PAIRS = 1024
ALIGN_CHUNK = 64            # pairs per step of that program
# Past it: `align_multi`, three launches of many programs (count per chunk, one scan, scatter),
# in place of the torch ops' ~25 launches and stable sort. Not yet timed on a GPU against either
# (scripts/bench/moe_layer.py --ways align_kernel align_multi align_torch); the one program
# stays up to ALIGN_KERNEL_PAIRS, where it was measured faster than the torch ops.
ALIGN_MULTI_CHUNK = 64      # pairs per program of `align_multi`'s count and scatter passes
ALIGN_SCAN_ROWS = 64        # chunks (and blocks) per step of its one scan program


@functools.lru_cache(maxsize=1)
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def gate_up_kernel(x_ptr, rows_ptr, block_expert_ptr, w_ptr, out_ptr, pairs, top_k,
                       num_experts, d, f, stride_x, stride_we, stride_wn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       IEEE: tl.constexpr):
        b = tl.program_id(0)
        e = tl.load(block_expert_ptr + b)
        if e < num_experts:
            m = b * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(rows_ptr + m)
            live = pair < pairs
            tok = (pair // top_k).to(tl.int64)
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < f
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            w_e = w_ptr + e.to(tl.int64) * stride_we
            for k0 in range(0, d, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                kmask = kk < d
                a = tl.load(x_ptr + tok[:, None] * stride_x + kk[None, :],
                            mask=live[:, None] & kmask[None, :], other=0.0)
                wmask = kmask[:, None] & nmask[None, :]
                wg = tl.load(w_e + n[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)
                wu = tl.load(w_e + (n[None, :] + f) * stride_wn + kk[:, None], mask=wmask,
                             other=0.0)
                if IEEE:   # float32: full precision, as torch's matmul (not TF32)
                    acc_g += tl.dot(a, wg, input_precision="ieee")
                    acc_u += tl.dot(a, wu, input_precision="ieee")
                else:
                    acc_g += tl.dot(a, wg)
                    acc_u += tl.dot(a, wu)
            g = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
            up = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_ptr + m.to(tl.int64)[:, None] * f + n[None, :],
                     (act * up).to(out_ptr.dtype.element_ty), mask=live[:, None] & nmask[None, :])

    @triton.jit
    def down_kernel(h_ptr, rows_ptr, block_expert_ptr, w_ptr, weight_ptr, out_ptr, pairs,
                    num_experts, d, f, stride_we, stride_wn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr):
        b = tl.program_id(0)
        e = tl.load(block_expert_ptr + b)
        if e < num_experts:
            m = b * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(rows_ptr + m)
            live = pair < pairs
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < d
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            w_e = w_ptr + e.to(tl.int64) * stride_we
            for k0 in range(0, f, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                kmask = kk < f
                a = tl.load(h_ptr + m.to(tl.int64)[:, None] * f + kk[None, :],
                            mask=live[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_e + n[None, :] * stride_wn + kk[:, None],
                            mask=kmask[:, None] & nmask[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(a, w, input_precision="ieee")
                else:
                    acc += tl.dot(a, w)
            y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            scale = tl.load(weight_ptr + pair, mask=live, other=0.0).to(tl.float32)
            tl.store(out_ptr + pair.to(tl.int64)[:, None] * d + n[None, :],
                     (y * scale[:, None]).to(out_ptr.dtype.element_ty),
                     mask=live[:, None] & nmask[None, :])

    @triton.jit
    def pair_gate_up_kernel(x_ptr, ids_ptr, w_ptr, out_ptr, top_k, num_experts, first, d, f,
                            stride_x, stride_we, stride_wn, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)
        e = tl.load(ids_ptr + pair) - first      # this rank's experts first .. first + E - 1
        if (e >= 0) & (e < num_experts):
            tok = (pair // top_k).to(tl.int64)
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < f
            acc_g = tl.zeros([BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_N], tl.float32)
            w_e = w_ptr + e.to(tl.int64) * stride_we
            for k0 in range(0, d, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                kmask = kk < d
                a = tl.load(x_ptr + tok * stride_x + kk, mask=kmask, other=0.0).to(tl.float32)
                wmask = nmask[:, None] & kmask[None, :]
                wg = tl.load(w_e + n[:, None] * stride_wn + kk[None, :], mask=wmask, other=0.0)
                wu = tl.load(w_e + (n[:, None] + f) * stride_wn + kk[None, :], mask=wmask,
                             other=0.0)
                acc_g += tl.sum(wg.to(tl.float32) * a[None, :], axis=1)
                acc_u += tl.sum(wu.to(tl.float32) * a[None, :], axis=1)
            g = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
            up = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_ptr + pair.to(tl.int64) * f + n, (act * up).to(out_ptr.dtype.element_ty),
                     mask=nmask)

    @triton.jit
    def pair_down_kernel(h_ptr, ids_ptr, w_ptr, weight_ptr, out_ptr, num_experts, first, d, f,
                         stride_we, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)
        e = tl.load(ids_ptr + pair) - first
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < d
        acc = tl.zeros([BLOCK_N], tl.float32)
        local = (e >= 0) & (e < num_experts)
        if local:
            w_e = w_ptr + e.to(tl.int64) * stride_we
            for k0 in range(0, f, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                kmask = kk < f
                a = tl.load(h_ptr + pair.to(tl.int64) * f + kk, mask=kmask,
                            other=0.0).to(tl.float32)
                w = tl.load(w_e + n[:, None] * stride_wn + kk[None, :],
                            mask=nmask[:, None] & kmask[None, :], other=0.0)
                acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.load(weight_ptr + pair).to(tl.float32) * local.to(tl.float32)
        tl.store(out_ptr + pair.to(tl.int64) * d + n, (y * scale).to(out_ptr.dtype.element_ty),
                 mask=nmask)

    @triton.jit
    def align_kernel(ids_ptr, rows_ptr, block_expert_ptr, pairs, num_experts, first, length,
                     BLOCK: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
        # one program: `align`'s result (the same rows, in the same stable order); ids less
        # `first`, another rank's (below 0 or past the experts) the sentinel `num_experts`
        ex = tl.arange(0, EXPERTS)
        counts = tl.zeros([EXPERTS], tl.int32)
        for c0 in range(0, pairs, CHUNK):
            p = c0 + tl.arange(0, CHUNK)
            e = tl.load(ids_ptr + p, mask=p < pairs, other=first + num_experts) - first
            e = tl.where((e < 0) | (e > num_experts), num_experts, e)
            counts += tl.sum((e[:, None] == ex[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK - 1) // BLOCK * BLOCK
        ends = tl.cumsum(padded, axis=0)
        seen = ends - padded                  # where each expert's next pair goes
        for r0 in range(0, length, CHUNK):
            r = r0 + tl.arange(0, CHUNK)
            tl.store(rows_ptr + r, tl.zeros([CHUNK], tl.int64) + pairs, mask=r < length)
        tl.debug_barrier()                    # the padding first, then the pairs over it
        for c0 in range(0, pairs, CHUNK):
            p = c0 + tl.arange(0, CHUNK)
            live = p < pairs
            e = tl.load(ids_ptr + p, mask=live, other=first + num_experts) - first
            e = tl.where((e < 0) | (e > num_experts), num_experts, e)
            hot = (e[:, None] == ex[None, :]).to(tl.int32)          # [CHUNK, EXPERTS]
            before = tl.cumsum(hot, axis=0) - hot                   # same expert, earlier
            dest = tl.sum((before + seen[None, :]) * hot, axis=1)
            tl.store(rows_ptr + dest, p.to(tl.int64), mask=live & (e < num_experts))
            seen += tl.sum(hot, axis=0)
        for b0 in range(0, length // BLOCK, CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            start = b * BLOCK
            below = (ends[None, :] <= start[:, None]) & (ex[None, :] < num_experts)
            tl.store(block_expert_ptr + b, tl.sum(below.to(tl.int64), axis=1),
                     mask=b < length // BLOCK)

    @triton.jit
    def align_count_kernel(ids_ptr, rows_ptr, counts_ptr, pairs, num_experts, first, length,
                           span, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
        # `align_multi`'s pass 1, one program per chunk of CHUNK pairs: the chunk's pairs per
        # local expert (a row of the [chunks, EXPERTS] table; nothing past the experts), and the
        # sentinel into its `span` of the rows (every slot; pass 3 writes the pairs over it)
        c = tl.program_id(0)
        ex = tl.arange(0, EXPERTS)
        p = c * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + p, mask=p < pairs, other=first + num_experts) - first
        e = tl.where((e < 0) | (e > num_experts), num_experts, e)
        hot = (e[:, None] == ex[None, :]) & (ex[None, :] < num_experts)
        tl.store(counts_ptr + c * EXPERTS + ex, tl.sum(hot.to(tl.int32), axis=0))
        for r0 in range(0, span, CHUNK):
            i = r0 + tl.arange(0, CHUNK)
            r = c * span + i
            tl.store(rows_ptr + r, tl.zeros([CHUNK], tl.int64) + pairs,
                     mask=(i < span) & (r < length))

    @triton.jit
    def align_scan_kernel(counts_ptr, starts_ptr, block_expert_ptr, chunks, num_experts, length,
                          BLOCK: tl.constexpr, EXPERTS: tl.constexpr, ROWS: tl.constexpr):
        # pass 2, one program: each expert's total, its run padded to BLOCK rows, the runs one
        # after another (the padded cumulative sum); per (chunk, expert) where the chunk's first
        # pair of that expert goes (the run's start + the earlier chunks' pairs of the expert);
        # every block's expert (the runs ending at or before its first row; E past the last)
        ex = tl.arange(0, EXPERTS)
        totals = tl.zeros([EXPERTS], tl.int32)
        for c0 in range(0, chunks, ROWS):
            c = c0 + tl.arange(0, ROWS)
            at = c[:, None] * EXPERTS + ex[None, :]
            totals += tl.sum(tl.load(counts_ptr + at, mask=at < chunks * EXPERTS, other=0),
                             axis=0)
        padded = (totals + BLOCK - 1) // BLOCK * BLOCK
        ends = tl.cumsum(padded, axis=0)
        seen = ends - padded
        for c0 in range(0, chunks, ROWS):
            c = c0 + tl.arange(0, ROWS)
            at = c[:, None] * EXPERTS + ex[None, :]
            n = tl.load(counts_ptr + at, mask=at < chunks * EXPERTS, other=0)
            tl.store(starts_ptr + at, tl.cumsum(n, axis=0) - n + seen[None, :],
                     mask=at < chunks * EXPERTS)
            seen += tl.sum(n, axis=0)
        for b0 in range(0, length // BLOCK, ROWS):
            b = b0 + tl.arange(0, ROWS)
            below = (ends[None, :] <= (b * BLOCK)[:, None]) & (ex[None, :] < num_experts)
            tl.store(block_expert_ptr + b, tl.sum(below.to(tl.int64), axis=1),
                     mask=b < length // BLOCK)

    @triton.jit
    def align_scatter_kernel(ids_ptr, starts_ptr, rows_ptr, pairs, num_experts, first,
                             EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
        # pass 3, one program per chunk: each local pair to its expert's place for this chunk
        # plus its rank among the chunk's earlier pairs of that expert (the stable order)
        c = tl.program_id(0)
        ex = tl.arange(0, EXPERTS)
        p = c * CHUNK + tl.arange(0, CHUNK)
        live = p < pairs
        e = tl.load(ids_ptr + p, mask=live, other=first + num_experts) - first
        e = tl.where((e < 0) | (e > num_experts), num_experts, e)
        hot = (e[:, None] == ex[None, :]).to(tl.int32)          # [CHUNK, EXPERTS]
        before = tl.cumsum(hot, axis=0) - hot
        base = tl.load(starts_ptr + c * EXPERTS + ex)
        dest = tl.sum((before + base[None, :]) * hot, axis=1)
        tl.store(rows_ptr + dest, p.to(tl.int64), mask=live & (e < num_experts))

    @triton.jit
    def route_kernel(logits_ptr, ids_ptr, weights_ptr, num_experts, top_k, stride_l,
                     EXPERTS: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr):
        # one program per row: its top k logits (the largest first, the lower expert on a tie)
        # and the float32 softmax at them, over those k (NORM) or over every expert
        r = tl.program_id(0).to(tl.int64)
        ex = tl.arange(0, EXPERTS)
        logits = tl.load(logits_ptr + r * stride_l + ex, mask=ex < num_experts,
                         other=float("-inf")).to(tl.float32)
        top = tl.max(logits, axis=0)
        exps = tl.exp(logits - top)                     # 0 past the experts
        slot = tl.arange(0, K)
        picked = tl.zeros([K], tl.int32)
        left = logits
        for j in tl.static_range(K):
            best = tl.max(left, axis=0)
            first = tl.min(tl.where(left == best, ex, EXPERTS), axis=0)
            picked = tl.where(slot == j, first, picked)
            left = tl.where(ex == first, float("-inf"), left)
        live = slot < top_k
        chosen = tl.sum(tl.where(ex[None, :] == picked[:, None], exps[None, :], 0.0), axis=1)
        if NORM:
            total = tl.sum(tl.where(live, chosen, 0.0), axis=0)
        else:
            total = tl.sum(exps, axis=0)
        tl.store(ids_ptr + r * top_k + slot, picked.to(tl.int64), mask=live)
        tl.store(weights_ptr + r * top_k + slot,
                 (chosen / total).to(weights_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def combine_kernel(pairs_ptr, shared_ptr, gate_ptr, x_ptr, w_ptr, out_ptr, sum_ptr, top_k,
                       n, stride_g, stride_x, eps, HAS_SHARED: tl.constexpr, NORM: tl.constexpr,
                       BLOCK: tl.constexpr):
        # one program per token: its k pairs' rows summed (float32, rounded once, as torch's sum),
        # plus the gated shared expert's row (sigmoid of the gate's logit, each product rounded
        # as torch's ops round); with NORM the residual add and `rms_norm` of the result as
        # `kernels.add_rms_norm` computes them (sum_ptr: x + delta; out_ptr: its norm)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        acc = tl.zeros([BLOCK], tl.float32)
        for j in range(top_k):
            acc += tl.load(pairs_ptr + (row * top_k + j) * n + cols, mask=mask,
                           other=0.0).to(tl.float32)
        dt = pairs_ptr.dtype.element_ty
        delta = acc.to(dt)
        if HAS_SHARED:
            g = tl.load(gate_ptr + row * stride_g).to(tl.float32)
            g = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            sh = tl.load(shared_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            delta = (delta.to(tl.float32) + (sh * g).to(dt).to(tl.float32)).to(dt)
        if NORM:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * n + cols, x, mask=mask)
            xf = x.to(tl.float32)
            r = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
            y = (xf * r).to(x.dtype).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            tl.store(out_ptr + row * n + cols, (w.to(tl.float32) * y).to(w.dtype), mask=mask)
        else:
            tl.store(sum_ptr + row * n + cols, delta, mask=mask)

    return SimpleNamespace(gate_up=gate_up_kernel, down=down_kernel,
                           pair_gate_up=pair_gate_up_kernel, pair_down=pair_down_kernel,
                           align=align_kernel, align_count=align_count_kernel,
                           align_scan=align_scan_kernel, align_scatter=align_scatter_kernel,
                           route=route_kernel, combine=combine_kernel)


def route(logits: torch.Tensor, top_k: int, norm: bool, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's choice from its logits [N, E] in one Triton program per row: (the top
    ``top_k`` experts [N, k] int64, the largest logit first; their weights [N, k] in ``dtype``:
    the float32 softmax over all ``E`` at them, renormalised over the ``k`` when ``norm``). What
    ``MoeBlock.route``'s torch ops compute (top k, softmax, cast: some 4 kernels) up to the
    last bits of the exponentials and which of two equal logits comes first (here the lower
    expert)."""
    n, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"route: top_k={top_k}; allowed: 1 .. the number of experts ({experts})")
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(n, top_k, dtype=dtype, device=logits.device)
    if n:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        _kernels().route[(n,)](logits, ids, weights, experts, top_k, logits.stride(0),
                               EXPERTS=max(16, 1 << (experts - 1).bit_length()),
                               K=1 << (top_k - 1).bit_length(), NORM=norm)
    return ids, weights


def align(ids: torch.Tensor, num_experts: int, block: int = BLOCK_M, first: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pairs in expert order, each expert's run padded to ``block`` rows with the sentinel
    ``P`` [padded length]; the expert of every block, ``>= num_experts`` past the last run).
    Shapes depend on ``ids.numel()``, ``num_experts`` and ``block`` only. Up to
    `ALIGN_KERNEL_PAIRS` pairs one Triton program computes it (`align_kernel`), past it three
    launches of many programs (`align_multi`); no pairs: the torch ops (`align_torch`). The
    same tensors every way."""
    if ids.numel() == 0:
        return align_torch(ids, num_experts, block, first)
    if ids.numel() <= ALIGN_KERNEL_PAIRS:
        return align_kernel(ids, num_experts, block, first)
    return align_multi(ids, num_experts, block, first)


def align_kernel(ids: torch.Tensor, num_experts: int, block: int = BLOCK_M, first: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`align` in one Triton program (its chunks of `ALIGN_CHUNK` pairs one after another)."""
    pairs = ids.numel()
    length = (pairs + num_experts * (block - 1) + block - 1) // block * block
    rows = torch.empty(length, dtype=torch.int64, device=ids.device)
    block_expert = torch.empty(length // block, dtype=torch.int64, device=ids.device)
    _kernels().align[(1,)](ids.reshape(-1).contiguous(), rows, block_expert, pairs, num_experts,
                           first, length, BLOCK=block,
                           EXPERTS=max(16, 1 << (num_experts - 1).bit_length()),
                           CHUNK=ALIGN_CHUNK)
    return rows, block_expert


def align_multi(ids: torch.Tensor, num_experts: int, block: int = BLOCK_M, first: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`align` in three launches, deterministic (no atomics): (1) per chunk of
    `ALIGN_MULTI_CHUNK` pairs one program counts the chunk's pairs per expert ([chunks, E]) and
    fills its share of the rows with the sentinel; (2) one program scans the table (per expert
    the earlier chunks' pairs, plus the expert's run start: the padded cumulative sum over the
    experts) and writes every block's expert; (3) per chunk one program places each pair at its
    expert's start for the chunk plus its rank among the chunk's earlier pairs of the expert.
    The same tensors as `align_torch` (the stable order within each run)."""
    pairs = ids.numel()
    if pairs == 0:
        raise ValueError("align_multi: no pairs (align serves 0 pairs with the torch ops)")
    dev = ids.device
    length = (pairs + num_experts * (block - 1) + block - 1) // block * block
    chunks = -(-pairs // ALIGN_MULTI_CHUNK)
    span = -(-length // chunks)                 # rows per count program to fill with the sentinel
    experts = max(16, 1 << (num_experts - 1).bit_length())
    flat = ids.reshape(-1).contiguous()
    rows = torch.empty(length, dtype=torch.int64, device=dev)
    block_expert = torch.empty(length // block, dtype=torch.int64, device=dev)
    counts = torch.empty(chunks, experts, dtype=torch.int32, device=dev)
    starts = torch.empty(chunks, experts, dtype=torch.int32, device=dev)
    k = _kernels()
    k.align_count[(chunks,)](flat, rows, counts, pairs, num_experts, first, length, span,
                             EXPERTS=experts, CHUNK=ALIGN_MULTI_CHUNK)
    k.align_scan[(1,)](counts, starts, block_expert, chunks, num_experts, length, BLOCK=block,
                       EXPERTS=experts, ROWS=ALIGN_SCAN_ROWS)
    k.align_scatter[(chunks,)](flat, starts, rows, pairs, num_experts, first, EXPERTS=experts,
                               CHUNK=ALIGN_MULTI_CHUNK)
    return rows, block_expert


def align_torch(ids: torch.Tensor, num_experts: int, block: int = BLOCK_M, first: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`align` in torch ops (a stable sort; some 25 small kernels)."""
    flat = ids.reshape(-1)
    if first:   # this rank's experts from `first` at 0 ..; the lower ones another rank's
        flat = torch.where(flat < first, first + num_experts, flat) - first
    flat = flat.clamp(max=num_experts)                     # other ranks' experts: one sentinel
    pairs = flat.numel()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_experts] + block - 1) // block * block
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    first_sorted = torch.cumsum(counts, 0) - counts          # where each expert's pairs start
    rank = torch.arange(pairs, device=ids.device) - first_sorted[expert]
    length = (pairs + num_experts * (block - 1) + block - 1) // block * block
    starts = ends - padded
    dest = torch.where(expert < num_experts, starts[expert.clamp(max=num_experts - 1)] + rank,
                       length)                               # others' pairs: a dump slot
    rows = torch.full((length + 1,), pairs, dtype=torch.int64, device=ids.device)
    rows.scatter_(0, dest, order)
    block_start = torch.arange(0, length, block, device=ids.device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    return rows[:length], block_expert


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, summed: bool = True, all_local: bool = False,
              first: int = 0) -> torch.Tensor:
    """See the module docstring. ``w13`` [E, 2F, d], ``w2`` [E, d, F], both contiguous.
    ``summed`` False: the pairs' rows [N, k, d] (each the routing weight times its expert's
    output) for `combine` to sum, one launch fewer than summing here. ``all_local``: every id
    is below E (tp, or a single rank): every pair's row is written, so the grouped path's output
    is not zeroed first. ``first``: the expert id of ``w13[0]`` (expert parallelism: this rank's
    experts are ``first .. first + E - 1``; ids outside are other ranks'), read by the kernels
    (no shifted copy of the ids)."""
    n_tok, d = x.shape
    top_k, experts, f = ids.shape[1], w13.shape[0], w2.shape[2]
    pairs = n_tok * top_k
    x = x.contiguous()
    if pairs <= PAIR_PATH_PAIRS:
        out = _pair_path(x, ids, weights, w13, w2, first)
        return out.sum(dim=1) if summed else out
    rows, block_expert = align(ids, experts, first=first)
    blocks = rows.numel() // BLOCK_M
    ieee = x.dtype == torch.float32
    k = _kernels()
    hidden = torch.empty(rows.numel(), f, dtype=x.dtype, device=x.device)
    k.gate_up[(blocks, -(-f // BLOCK_N))](
        x, rows, block_expert, w13, hidden, pairs, top_k, experts, d, f, x.stride(0),
        w13.stride(0), w13.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        IEEE=ieee)
    # another rank's pair is in no block: its row stays as allocated, so zeros unless all local
    out = (torch.empty if all_local else torch.zeros)(pairs, d, dtype=x.dtype, device=x.device)
    k.down[(blocks, -(-d // BLOCK_N))](
        hidden, rows, block_expert, w2, weights.reshape(-1).contiguous(), out, pairs, experts, d,
        f, w2.stride(0), w2.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        IEEE=ieee)
    out = out.view(n_tok, top_k, d)
    return out.sum(dim=1) if summed else out


def _pair_path(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor, first: int = 0) -> torch.Tensor:
    """`fused_moe` for few pairs: one GEMV program per (pair, column slice), no alignment; the
    pairs' rows [N, k, d], not summed."""
    n_tok, d = x.shape
    top_k, experts, f = ids.shape[1], w13.shape[0], w2.shape[2]
    pairs = n_tok * top_k
    flat = ids.reshape(-1).contiguous()
    k = _kernels()
    hidden = torch.empty(pairs, f, dtype=x.dtype, device=x.device)
    k.pair_gate_up[(pairs, -(-f // PAIR_BLOCK_N))](
        x, flat, w13, hidden, top_k, experts, first, d, f, x.stride(0), w13.stride(0),
        w13.stride(1), BLOCK_N=PAIR_BLOCK_N, BLOCK_K=PAIR_BLOCK_K)
    out = torch.empty(pairs, d, dtype=x.dtype, device=x.device)
    k.pair_down[(pairs, -(-d // PAIR_BLOCK_N))](
        hidden, flat, w2, weights.reshape(-1).contiguous(), out, experts, first, d, f,
        w2.stride(0), w2.stride(1), BLOCK_N=PAIR_BLOCK_N, BLOCK_K=PAIR_BLOCK_K)
    return out.view(n_tok, top_k, d)


def combine(pairs: torch.Tensor, shared: torch.Tensor | None = None,
            gate: torch.Tensor | None = None, x: torch.Tensor | None = None,
            weight: torch.Tensor | None = None, eps: float = 0.0
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A MoE block's output from `fused_moe`'s unsummed pairs [N, k, d] in one launch: their sum
    over k (float32, rounded once, as ``pairs.sum(1)``), plus, with `shared` [N, d] (a shared
    expert's rows) and `gate` [N, 1] (its gate's logits), ``shared * sigmoid(gate)`` (each op
    rounded to the dtype as torch's ops round); with `x` [N, d] and `weight` [d] also the
    residual add and RMSNorm of `kernels.add_rms_norm`: returns ``(x + delta, norm(x + delta))``.
    One launch where two ran (the sum, the add and norm), with a shared expert five."""
    n, top_k, d = pairs.shape
    if (shared is None) != (gate is None):
        raise ValueError("combine: a shared expert's rows and its gate's logits go together")
    if (x is None) != (weight is None):
        raise ValueError("combine: the residual x and the norm's weight go together")
    if shared is not None and (tuple(shared.shape) != (n, d) or tuple(gate.shape) != (n, 1)):
        raise ValueError(f"combine: shared {tuple(shared.shape)}, gate {tuple(gate.shape)}; "
                         f"allowed: [{n}, {d}] and [{n}, 1]")
    if x is not None and (tuple(x.shape) != (n, d) or tuple(weight.shape) != (d,)):
        raise ValueError(f"combine: x {tuple(x.shape)}, weight {tuple(weight.shape)}; "
                         f"allowed: [{n}, {d}] and [{d}]")
    pairs = pairs.contiguous()
    if shared is not None:
        shared = shared.contiguous()
    xs = pairs if x is None else (x if x.stride(-1) == 1 else x.contiguous())
    total = torch.empty(n, d, dtype=xs.dtype, device=pairs.device)
    normed = total if weight is None else torch.empty(n, d, dtype=weight.dtype,
                                                      device=pairs.device)
    if n:
        _kernels().combine[(n,)](
            pairs, pairs if shared is None else shared, pairs if gate is None else gate, xs,
            pairs if weight is None else weight, normed, total, top_k, d,
            0 if gate is None else gate.stride(0), xs.stride(0), eps,
            HAS_SHARED=shared is not None, NORM=x is not None,
            BLOCK=1 << (d - 1).bit_length())
    return total if x is None else (total, normed)
