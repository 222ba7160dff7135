"""The fused MoE kernels (``workers.moe_kernels``) at the production expert count — 128 experts,
top 8, as Qwen3-30B-A3B — on the CPU through triton's interpreter, every memory access checked:
`bounds_checked` fails a launch that loads or stores, unmasked, an element outside every tensor
argument of that launch (what a GPU reports as an illegal memory access, or silently reads). The
hidden and model widths are shrunk (the alignment and the padding depend on the pairs, the expert
count and the top k, not on them), and picked so that the column and reduction loops run several
slices with a masked tail. Checked: the alignment one Triton program computes, and past 1024
pairs the multi-program one (`align_multi`), equal the torch ops' bit for bit and the layout they
promise (`check_alignment`) for random, skewed, sparse, one-expert and other-rank routings;
the pair path and the grouped path equal the sparse torch path (``MoeBlock.sparse``) at decode
and prefill row counts. On a GPU the same at the real widths, graph-replayed:
``tests/gpu/test_moe_gpu.py``."""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from moe_reference import BLOCK, E, TOP_K, check_alignment, routings
from workers import moe_kernels

D, F = 288, 80    # the pair path: 2 reduction slices of 256 over D; the grouped: 5 of 64, etc.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="triton's interpreter (the CPU tier); "
                                "on a GPU: tests/gpu/test_moe_gpu.py")
torch.set_num_threads(1)


@contextmanager
def bounds_checked() -> Iterator[list[str]]:
    """Inside: every triton launch (interpreted) checks each element it loads or stores where its
    mask is true against the spans of the launch's tensor arguments (first to last element by
    their strides) and raises naming the kernel, the access and the arguments when one lies
    outside all of them. Yields the names of the kernels checked."""
    pytest.importorskip("triton")
    import numpy as np
    from triton.runtime import interpreter as interp

    spans: list[tuple[str, int, int]] = []
    checked: list[str] = []
    kernel = [""]
    init = interp.GridExecutor._init_args_hst
    builder = interp.interpreter_builder
    load, store = builder.create_masked_load, builder.create_masked_store

    def init_args(self, args_dev, kwargs):  # noqa: ANN001, ANN202 (the interpreter's own)
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        names = interp.inspect.getfullargspec(self.fn).args
        spans.clear()
        for name, arg in [*zip(names, args_hst), *kwargs_hst.items()]:
            if isinstance(arg, torch.Tensor) and arg.numel():
                last = sum((n - 1) * s for n, s in zip(arg.shape, arg.stride()))
                spans.append((name, arg.data_ptr(),
                              arg.data_ptr() + (last + 1) * arg.element_size()))
        kernel[0] = self.fn.__name__
        checked.append(kernel[0])
        return args_hst, kwargs_hst

    def check(ptrs, mask, what: str) -> None:  # noqa: ANN001 (interpreter handles)
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        addr = np.asarray(ptrs.data, dtype=np.uint64).reshape(-1)
        live = np.broadcast_to(np.asarray(mask.data, dtype=bool), ptrs.data.shape).reshape(-1)
        addr = addr[live]
        inside = np.zeros(addr.shape, dtype=bool)
        for _, lo, hi in spans:
            inside |= (addr >= lo) & (addr + size <= hi)
        if not inside.all():
            outside = [hex(int(a)) for a in addr[~inside][:4]]
            raise AssertionError(
                f"{kernel[0]}: {what} of {int((~inside).sum())} element(s) outside its tensor "
                f"arguments (first at {outside}); arguments: "
                + ", ".join(f"{n} [{hex(lo)}, +{hi - lo} B)" for n, lo, hi in spans))

    def checked_load(ptrs, mask, other, *rest):  # noqa: ANN001, ANN202
        check(ptrs, mask, "load")
        return load(ptrs, mask, other, *rest)

    def checked_store(ptrs, value, mask, *rest):  # noqa: ANN001, ANN202
        check(ptrs, mask, "store")
        return store(ptrs, value, mask, *rest)

    interp.GridExecutor._init_args_hst = init_args
    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    try:
        yield checked
    finally:
        interp.GridExecutor._init_args_hst = init
        builder.create_masked_load, builder.create_masked_store = load, store


def test_bounds_checked_catches_an_access_outside_the_arguments() -> None:
    """The check has power: `align_kernel` handed a rows buffer shorter than its length writes
    past it, and the check names the kernel and the store."""
    ids = torch.zeros(1, TOP_K, dtype=torch.int64)
    rows = torch.empty(16, dtype=torch.int64)
    block_expert = torch.empty(E, dtype=torch.int64)
    with bounds_checked(), pytest.raises(Exception, match="align_kernel: store of"):
        moe_kernels._kernels().align[(1,)](ids.reshape(-1), rows, block_expert, TOP_K, E, 0,
                                           E * moe_kernels.BLOCK_M, BLOCK=moe_kernels.BLOCK_M,
                                           EXPERTS=E, CHUNK=moe_kernels.ALIGN_CHUNK)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 13, 31, 64, 100, 127, 128])
def test_the_align_kernel_at_128_experts_top_8(rows: int) -> None:
    """Up to 1024 pairs (`ALIGN_KERNEL_PAIRS`): `align` is the one Triton program, equal to the
    torch ops and to its contract, in bounds, for every routing of `routings`."""
    assert rows * TOP_K <= moe_kernels.ALIGN_KERNEL_PAIRS and moe_kernels.BLOCK_M == BLOCK
    for name, ids in routings(rows, seed=rows).items():
        experts = E // 2 if name == "ep_slice" else E     # a rank of 64: the sentinel 64
        with bounds_checked() as ran:
            got = moe_kernels.align(ids, experts)
        assert ran == ["align_kernel"], name
        want = moe_kernels.align_torch(ids, experts)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (rows, name)
        check_alignment(ids, experts, *got)


MULTI = ["align_count_kernel", "align_scan_kernel", "align_scatter_kernel"]


@pytest.mark.parametrize("rows", [129, 512])
def test_align_beyond_the_kernel_is_the_multi_program_alignment(rows: int) -> None:
    """Past `ALIGN_KERNEL_PAIRS` (129 rows: 1032 pairs; 512 rows: 4096, batch 64 at depth 7)
    `align` is `align_multi`'s three launches, equal to the torch ops and to the contract, in
    bounds, for every routing of `routings`."""
    assert rows * TOP_K > moe_kernels.ALIGN_KERNEL_PAIRS
    for name, ids in routings(rows, seed=rows).items():
        experts = E // 2 if name == "ep_slice" else E
        with bounds_checked() as ran:
            got = moe_kernels.align(ids, experts)
        assert ran == MULTI, name
        want = moe_kernels.align_torch(ids, experts)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (rows, name)
        check_alignment(ids, experts, *got)


def _ids(pairs: int, experts: int, first: int, kind: str, seed: int) -> torch.Tensor:
    """`pairs` ids [pairs] as an expert-parallel rank whose experts are ``first .. first +
    experts - 1`` reads them: "spread" over every id of the model (this rank's and others',
    below and above), "holes" (only every third of this rank's experts, with others' ids: empty
    experts between runs), "one" (every pair on one expert, the last of the rank's)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "one":
        return torch.full((pairs,), first + experts - 1, dtype=torch.int64)
    if kind == "holes":
        pick = torch.tensor([first + e for e in range(0, experts, 3)] + [first + experts + 2])
        return pick[torch.randint(0, pick.numel(), (pairs,), generator=gen)]
    return torch.randint(0, first + experts + 5, (pairs,), generator=gen)


@pytest.mark.parametrize("pairs, experts, block, first, kind", [
    (1025, 128, 16, 0, "spread"), (1031, 8, 16, 0, "spread"), (1537, 64, 32, 64, "spread"),
    (2048, 128, 16, 0, "holes"), (2047, 128, 64, 7, "holes"), (2999, 8, 64, 3, "one"),
    (4096, 128, 16, 0, "spread"), (4096, 64, 16, 64, "one"), (4093, 128, 32, 0, "one"),
    (3001, 64, 64, 0, "holes")])
def test_align_multi_equals_the_torch_alignment(pairs: int, experts: int, block: int, first: int,
                                                kind: str) -> None:
    """`align_multi` bit for bit as `align_torch` (rows and block experts, same dtypes and
    shapes) past `ALIGN_KERNEL_PAIRS`: odd pair counts (a part chunk), 8/64/128 experts, blocks of
    16/32/64, a rank's first expert other than 0 (ids below it and past its experts: another
    rank's), empty experts and every pair on one expert (a run of many blocks); in bounds; and
    `align_kernel` (one program, any count) gives the same."""
    ids = _ids(pairs, experts, first, kind, seed=pairs + experts)
    want = moe_kernels.align_torch(ids, experts, block, first)
    with bounds_checked() as ran:
        got = moe_kernels.align_multi(ids, experts, block, first)
    assert ran == MULTI
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.int64 and g.shape == w.shape
        assert torch.equal(g, w), (pairs, experts, block, first, kind)
    shifted = torch.where((ids < first) | (ids >= first + experts), experts, ids - first)
    check_alignment(shifted, experts, *got, block=block)
    one = moe_kernels.align_kernel(ids, experts, block, first)
    assert torch.equal(one[0], want[0]) and torch.equal(one[1], want[1])


def test_align_multi_at_its_chunk_edges() -> None:
    """Pair counts at and around whole chunks of `ALIGN_MULTI_CHUNK` (and below
    `ALIGN_KERNEL_PAIRS`, called directly: the function serves any count), one pair alone."""
    c = moe_kernels.ALIGN_MULTI_CHUNK
    for pairs in (1, c - 1, c, c + 1, 17 * c, 17 * c + 1):
        ids = _ids(pairs, 16, 0, "spread", seed=pairs)
        with bounds_checked():
            got = moe_kernels.align_multi(ids, 16)
        want = moe_kernels.align_torch(ids, 16)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), pairs
    with pytest.raises(ValueError, match="align_multi: no pairs"):
        moe_kernels.align_multi(torch.zeros(0, TOP_K, dtype=torch.int64), E)


@functools.lru_cache(maxsize=2)
def moe_block(dtype: torch.dtype):
    """A Qwen3-30B-A3B-shaped MoE block (128 experts, top 8, normalised top-k) at widths D and
    F, random weights (drawn in float32, then cast), in `dtype`."""
    from workers.model.moe import MoeBlock
    from workers.model.parallel import ModelParallel

    moe = MoeBlock(_config(), ModelParallel.single("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * D ** -0.5)
    return moe.to(dtype)


def _fused_against_sparse(rows: int, path: str, dtype: torch.dtype, monkeypatch,
                          routing: str = "router") -> None:
    """`path` "pairs" or "grouped" forces that path; "shape" leaves `PAIR_PATH_PAIRS` as it is
    (the path the shape picks)."""
    if path == "shape":
        path = "pairs" if rows * TOP_K <= moe_kernels.PAIR_PATH_PAIRS else "grouped"
    else:
        monkeypatch.setattr(moe_kernels, "PAIR_PATH_PAIRS", 0 if path == "grouped" else 10 ** 6)
    x = torch.randn(rows, D, generator=torch.Generator().manual_seed(rows)).to(dtype)
    moe = moe_block(dtype)
    ids, weights = moe.route(x)
    if routing != "router":
        ids = routings(rows, seed=rows + 1)[routing]
    w13 = moe.gate_up.stacked.view(E, 2 * F, D)
    if routing == "ep_slice":   # this rank holds experts 0..63; the sentinel 64 is another's
        with bounds_checked() as ran:
            got = moe_kernels.fused_moe(x, ids, weights, w13[:E // 2],
                                        moe.down.stacked[:E // 2])
        want = moe.sparse(x, ids, weights * (ids < E // 2).to(dtype))
    else:
        with bounds_checked() as ran:
            got = moe.fused(x, ids, weights)
        want = moe.sparse(x, ids, weights)
    kernels = (["pair_gate_up_kernel", "pair_down_kernel"] if path == "pairs" else
               (["align_kernel"] if rows * TOP_K <= moe_kernels.ALIGN_KERNEL_PAIRS else MULTI)
               + ["gate_up_kernel", "down_kernel"])
    assert ran == kernels
    # bfloat16: hidden rows rounded to 8 bits after sums in different orders (as on the GPU)
    tol = ({"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else
           {"atol": 0.04 * want.abs().max().item(), "rtol": 2e-2})
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("rows, dtype, routing", [
    (1, torch.float32, "router"), (3, torch.bfloat16, "router"), (6, torch.float32, "skewed"),
    (5, torch.float32, "ep_slice")])
def test_the_pair_path_at_128_experts_equals_the_sparse_path(rows: int, dtype,
                                                             routing: str, monkeypatch) -> None:
    """Decode rows (the path forced: the shape picks it up to 16 pairs, 2 rows): the router's
    routing, every token to the same 8 experts, and an expert-parallel slice's (zeros for another
    rank's pairs)."""
    _fused_against_sparse(rows, "pairs", dtype, monkeypatch, routing)


@pytest.mark.parametrize("rows, path", [(1, "pairs"), (2, "pairs"), (3, "grouped")])
def test_the_shape_picks_the_pair_path_up_to_16_pairs(rows: int, path: str, monkeypatch) -> None:
    """Unforced: at top 8 the pair path up to 2 rows (16 pairs, `PAIR_PATH_PAIRS`: where one
    H200 measured it faster than the grouped GEMMs), the grouped GEMMs from 3; equal to the
    sparse path either way (float32: the interpreter's bfloat16 tl.dot is wrong)."""
    assert moe_kernels.PAIR_PATH_PAIRS == 16
    assert (rows * TOP_K <= moe_kernels.PAIR_PATH_PAIRS) == (path == "pairs")
    _fused_against_sparse(rows, "shape", torch.float32, monkeypatch)


@pytest.mark.parametrize("rows, routing", [(1, "router"), (9, "router"), (13, "ep_slice"),
                                           (64, "skewed"), (100, "last"), (129, "router")])
def test_the_grouped_path_at_128_experts_equals_the_sparse_path(rows: int, routing: str,
                                                                monkeypatch) -> None:
    """float32 (triton's interpreter multiplies bfloat16 tl.dot operands wrongly; the GPU test
    checks bfloat16): 1 row (8 experts of 128: 120 empty, 113 blocks past the runs), decode and
    prefill rows through the align kernel, 129 rows (1032 pairs) through `align_multi`."""
    _fused_against_sparse(rows, "grouped", torch.float32, monkeypatch, routing)


def _config():
    from workers.model.config import LlamaConfig, MoeSpec

    return LlamaConfig(vocab_size=64, hidden_size=D, intermediate_size=3 * D,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       architecture="Qwen3MoeForCausalLM",
                       moe=MoeSpec(num_experts=E, top_k=TOP_K, expert_size=F,
                                   norm_topk_prob=True))


def _ep_block(rank: int):
    """`moe_block`'s float32 weights as expert-parallel rank `rank` of 2 holds them (experts
    64·rank .. 64·rank + 63), built without processes (its collectives are not called)."""
    from collectives import Group
    from workers.model.moe import MoeBlock
    from workers.model.parallel import ModelParallel

    full = moe_block(torch.float32)
    pair = Group(name="mlp", ranks=(0, 1), rank=rank, device=torch.device("cpu"))
    block = MoeBlock(_config(), ModelParallel(attn=pair, mlp=pair, dp=Group.single("cpu"),
                                              moe="ep"))
    assert block.local == tuple(range(64 * rank, 64 * rank + 64))
    with torch.no_grad():
        block.gate.weight.copy_(full.gate.weight)
        for e in block.local:
            for mine, theirs in zip(block.experts[str(e)].parameters(),
                                    full.experts[str(e)].parameters()):
                mine.copy_(theirs)
    return block


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("rows", [2, 9, 130])
def test_moe_block_fused_on_an_expert_parallel_rank_equals_its_sparse_part(rank: int,
                                                                           rows: int) -> None:
    """`MoeBlock.fused` on rank 0 and rank 1 of `--moe-parallel ep` over 2 (64 experts each;
    rank 1's ids shifted down, the other rank's landing at 64 or more): this rank's part of the
    sum, as `MoeBlock.sparse` adds it (2 rows: the pair path; 9: the grouped GEMMs; 130: 1040
    pairs, `align_multi` reading the rank's first expert)."""
    block = _ep_block(rank)
    x = torch.randn(rows, D, generator=torch.Generator().manual_seed(rows + rank))
    ids, weights = block.route(x)
    assert ((ids >= 64) == (rank == 0)).any() and ((ids < 64) == (rank == 0)).any()
    with bounds_checked() as ran:
        got = block.fused(x, ids, weights)
    assert ("pair_down_kernel" in ran) == (rows == 2)
    assert ("align_scatter_kernel" in ran) == (rows == 130)
    torch.testing.assert_close(got, block.sparse(x, ids, weights), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_equals_the_softmax_over_every_expert(norm: bool, dtype) -> None:
    """`MoeBlock.route` (top k of the logits, then the softmax of those k when renormalised)
    against the definition, as transformers' Qwen3-MoE / Mixtral / Qwen2-MoE routers compute it:
    the float32 softmax over all 128 experts, its top 8, divided by their sum when
    `norm_topk_prob`. Every pair's weight and, tie order aside, the experts picked."""
    import dataclasses

    block = moe_block(dtype)
    x = torch.randn(200, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    spec = block.spec
    block.spec = dataclasses.replace(spec, norm_topk_prob=norm)
    try:
        ids, weights = block.route(x)
    finally:
        block.spec = spec
    probs = torch.softmax(torch.nn.functional.linear(x, block.gate.weight).float(), dim=-1)
    want, want_ids = torch.topk(probs, TOP_K, dim=-1)
    if norm:
        want = want / want.sum(dim=-1, keepdim=True)
    assert ids.shape == weights.shape == (200, TOP_K) and weights.dtype == dtype
    # the picked experts' probabilities are the top 8 (equal values may come in another order)
    torch.testing.assert_close(probs.gather(1, ids), probs.gather(1, want_ids), atol=0, rtol=0)
    if dtype == torch.float32:
        assert torch.equal(ids, want_ids)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
    torch.testing.assert_close(weights, want.to(dtype), **tol)


@pytest.mark.parametrize("experts, top_k", [(128, 8), (8, 2), (4, 3), (60, 4), (6, 6)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_route_kernel_equals_the_routing_definition(experts: int, top_k: int, norm: bool,
                                                        dtype) -> None:
    """`moe_kernels.route` (one program per row: what `MoeBlock.route` runs where the fused
    kernels serve) against the float32 softmax over every expert, its top k, renormalised when
    `norm`: the experts (of equal logits, frequent in bfloat16, the lower first) and weights.
    Expert counts that are not powers of two, a top k that is not (3) and all of them (6)."""
    gen = torch.Generator().manual_seed(experts * top_k)
    logits = (torch.randn(37, experts, generator=gen) * 2).to(dtype)
    logits[3, :3] = logits[3, 3]                # ties, in float32 too
    with bounds_checked() as ran:
        ids, weights = moe_kernels.route(logits, top_k, norm, dtype)
    assert ran == ["route_kernel"] and ids.dtype == torch.int64 and weights.dtype == dtype
    probs = torch.softmax(logits.float(), dim=-1)
    # the definition, the lower expert first among equal logits: sort by (-logit, expert)
    for row in range(logits.shape[0]):
        values = logits[row].float().tolist()
        order = sorted(range(experts), key=lambda e: (-values[e], e))[:top_k]
        assert ids[row].tolist() == order, row
    want = probs.gather(1, ids)
    if norm:
        want = want / want.sum(dim=-1, keepdim=True)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
    torch.testing.assert_close(weights, want.to(dtype), **tol)
    with pytest.raises(ValueError, match="top_k=0; allowed: 1 .. the number of experts"):
        moe_kernels.route(logits, 0, norm, dtype)


def _to_bf16_truncated(t: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 as triton's interpreter casts (the low 16 bits dropped: toward zero;
    a GPU rounds to nearest)."""
    return (t.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(
        torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared, norm", [(False, False), (True, False), (False, True),
                                          (True, True)])
def test_combine_equals_the_torch_ops_it_replaces(dtype, shared: bool, norm: bool) -> None:
    """`moe_kernels.combine` (one program per token) against the torch ops it stands for: the
    pairs' sum over the top 8 (``pairs.sum(1)``), a shared expert's rows times the sigmoid of its
    gate's logit added (``MoeBlock.shared``'s ops), the residual add and RMSNorm
    (``RMSNorm.add_forward``'s torch path), each op rounded to the dtype. float32: the sum bit
    for bit, the rest within an ulp (exp, rsqrt). bfloat16: the same ops in float32 with each
    rounding as triton's interpreter rounds (toward zero; a GPU rounds to nearest, as torch:
    tests/gpu/test_moe_gpu.py checks it against the torch ops), within an ulp. In bounds, at a
    width that is not a power of two (a masked tail)."""
    from workers.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(int(shared) + 2 * int(norm))
    n = 5
    pairs = torch.randn(n, TOP_K, D, generator=gen).to(dtype)
    rows = torch.randn(n, D, generator=gen).to(dtype) if shared else None
    gate = (torch.randn(n, 1, generator=gen) * 2).to(dtype) if shared else None
    x = torch.randn(n, D, generator=gen).to(dtype)
    rms = RMSNorm(D, 1e-6).to(dtype)
    with torch.no_grad():
        rms.weight.copy_(1 + 0.1 * torch.randn(D, generator=gen))
    rnd = (lambda t: t.to(dtype)) if dtype == torch.float32 else _to_bf16_truncated
    want = rnd(pairs.float().sum(dim=1))
    if shared:
        g = rnd(torch.sigmoid(gate.float()))
        want = rnd(want.float() + rnd(rows.float() * g.float()).float())
    if norm:
        total = rnd(x.float() + want.float())
        tf = total.float()
        y = rnd(tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + rms.eps))
        want = (total, rnd(rms.weight.float() * y.float()))
    with bounds_checked() as ran:
        got = (moe_kernels.combine(pairs, rows, gate, x, rms.weight, rms.eps) if norm else
               moe_kernels.combine(pairs, rows, gate))
    assert ran == ["combine_kernel"]
    if not norm:
        got, want = (got,), (want,)
    if dtype == torch.float32 and not shared:   # the sum alone: as torch's, bit for bit
        assert torch.equal(got[0], pairs.sum(dim=1) if not norm else x + pairs.sum(dim=1))
    ulp = {"atol": 1e-6, "rtol": 2.5e-7} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, **ulp)
    with pytest.raises(ValueError, match="shared expert's rows and its gate's logits go together"):
        moe_kernels.combine(pairs, x)
    with pytest.raises(ValueError, match=r"combine: x \(5, 7\)"):
        moe_kernels.combine(pairs, None, None, x[:, :7], rms.weight, 1e-6)


def test_fused_moe_unsummed_is_the_pairs_of_the_summed(monkeypatch) -> None:
    """`fused_moe(summed=False)`: the pairs' rows [N, k, d], whose sum over k is the summed
    result bit for bit (float32), on both paths; the grouped path's output not zeroed when
    every pair is local (`all_local`) is the same."""
    moe = moe_block(torch.float32)
    w13 = moe.gate_up.stacked.view(E, 2 * F, D)
    for rows, pairs_path in ((1, True), (5, False)):
        monkeypatch.setattr(moe_kernels, "PAIR_PATH_PAIRS", 10 ** 6 if pairs_path else 0)
        x = torch.randn(rows, D, generator=torch.Generator().manual_seed(rows))
        ids, weights = moe.route(x)
        summed = moe_kernels.fused_moe(x, ids, weights, w13, moe.down.stacked)
        parts = moe_kernels.fused_moe(x, ids, weights, w13, moe.down.stacked, summed=False,
                                      all_local=True)
        assert parts.shape == (rows, TOP_K, D)
        assert torch.equal(parts.sum(dim=1), summed)


@pytest.mark.parametrize("rows", [2, 9, 200])
def test_align_of_an_expert_parallel_rank_reads_its_first_expert(rows: int) -> None:
    """`align(..., first=f)` (rank 1 of 2: experts 64 .. 127 at 0 .. 63) equals `align` of the
    ids shifted as the rank reads them (below 64: another rank's, the sentinel; 64 .. 127: 0 ..
    63), every way (the one Triton program, the multi-program one, the torch ops), in bounds."""
    ids = routings(rows, seed=rows)["uniform"]
    shifted = torch.where(ids < 64, 64, ids - 64)
    for fn in (moe_kernels.align_kernel, moe_kernels.align_multi, moe_kernels.align_torch):
        with bounds_checked():
            got = fn(ids, 64, first=64)
        want = fn(shifted, 64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (rows, fn)
        check_alignment(shifted, 64, *got)
