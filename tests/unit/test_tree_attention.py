"""Tree attention (issue 35 §3) against a dense reference nobody here wrote: per request, the
context's K/V and the tree nodes' K/V laid out densely, an explicit boolean mask (every node sees
the whole context, itself and its ancestors), plain
`torch.nn.functional.scaled_dot_product_attention`. Random trees, random context lengths, grouped
query heads, float32 tolerance; and the commit of an accepted path into contiguous positions."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from workers import kernels
from workers.attention.tree import TreeAttention, TreeKV, commit
from workers.kv_cache import DUMMY_PAGE, KVPool
from workers.worker.tree import ancestors

PAGE, PAGES, HQ, HKV, D = 4, 128, 4, 2, 8


def _random_parents(rng: random.Random, nodes: int) -> list[int]:
    """A random tree in topological order: node 0 the root (its own parent)."""
    return [0] + [rng.randrange(i) for i in range(1, nodes)]


def _case(seed: int, batch: int, nodes: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = KVPool(1, PAGES, PAGE, HKV, D, dtype=torch.float32, device=torch.device("cpu"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    reach = 5 + nodes // PAGE
    free = list(range(1, PAGES))
    rng.shuffle(free)
    pages = torch.tensor([[free.pop() for _ in range(reach)] for _ in range(batch)])
    cached = torch.tensor([rng.randint(0, reach * PAGE - nodes) for _ in range(batch)])
    parents = torch.tensor([_random_parents(rng, nodes) for _ in range(batch)])
    return pool, pages, cached, parents


def _dense_reference(pool, pages, cached, parents, q, k, v):
    """Per request: context K/V read page by page, the nodes' K/V after it, an explicit mask."""
    batch, nodes = parents.shape
    hq, hkv, dim, page = q.shape[2], k.shape[2], q.shape[3], pool.page_size
    out = torch.zeros(batch, nodes, hq, dim)
    for b in range(batch):
        n = int(cached[b])
        ctx = [int(pages[b, i // page]) * page + i % page for i in range(n)]
        keys = torch.cat([pool.k[0].view(-1, hkv, dim)[ctx], k[b]])            # [n+N, Hkv, D]
        values = torch.cat([pool.v[0].view(-1, hkv, dim)[ctx], v[b]])
        mask = torch.zeros(nodes, n + nodes, dtype=torch.bool)
        mask[:, :n] = True
        for i in range(nodes):
            j = i
            while True:
                mask[i, n + j] = True
                if j == 0:
                    break
                j = int(parents[b, j])
        rep = hq // hkv
        ref = F.scaled_dot_product_attention(
            q[b].transpose(0, 1), keys.repeat_interleave(rep, 1).transpose(0, 1),
            values.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask)
        out[b] = ref.transpose(0, 1)
    return out


@pytest.mark.parametrize("seed,batch,nodes", [(0, 1, 2), (1, 3, 8), (2, 4, 13), (3, 2, 1)])
def test_tree_attention_equals_dense_mask_reference(seed: int, batch: int, nodes: int) -> None:
    pool, pages, cached, parents = _case(seed, batch, nodes)
    q = torch.randn(batch, nodes, HQ, D)
    k = torch.randn(batch, nodes, HKV, D)
    v = torch.randn(batch, nodes, HKV, D)
    before = pool.k[0].clone()
    memory = TreeKV(1, batch, nodes, HKV, D, torch.float32, torch.device("cpu"))
    attn = TreeAttention(pool, pages, cached, memory, 0, ancestors(parents, nodes))
    out = attn.forward(0, q.reshape(-1, HQ, D), k.reshape(-1, HKV, D), v.reshape(-1, HKV, D))
    ref = _dense_reference(pool, pages, cached, parents, q, k, v)
    torch.testing.assert_close(out.view(batch, nodes, HQ, D), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.k[0], before), "a tree forward writes no page"


@pytest.mark.parametrize("seed,batch,nodes,dtype", [
    (1, 3, 8, torch.float32), (1, 3, 8, torch.float16), (2, 1, 70, torch.float32),
    (3, 2, 1, torch.float32)])
def test_tree_attention_kernel_equals_dense_mask_reference(seed, batch, nodes, dtype) -> None:
    """The fused kernel (compiled on a GPU, triton's interpreter here) against the same dense
    reference; 70 nodes span two blocks of the tree loop, row 0 may see no context."""
    pool, pages, cached, parents = _case(seed, batch, nodes)
    cached[0] = 0
    q = torch.randn(batch, nodes, HQ, D)
    k = torch.randn(batch, nodes, HKV, D)
    v = torch.randn(batch, nodes, HKV, D)
    ref = _dense_reference(pool, pages, cached, parents, q, k, v)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = kernels.tree_attention(q.reshape(-1, HQ, D).to(dev, dtype), pool.k[0].to(dev, dtype),
                                 pool.v[0].to(dev, dtype), pages.to(dev), cached.to(dev),
                                 k.to(dev, dtype), v.to(dev, dtype),
                                 ancestors(parents, nodes).to(dev), D ** -0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.view(batch, nodes, HQ, D).float().cpu(), ref, **tol)


def test_tree_attention_in_steps_sees_earlier_steps_nodes() -> None:
    """The draft's way: the nodes arrive a level per forward; each level's forward writes its
    slots of the store and attends to the ancestors earlier forwards stored."""
    batch, nodes = 2, 7
    pool, pages, cached, _ = _case(5, batch, nodes)
    parents = torch.tensor([[0, 0, 0, 1, 1, 2, 2]] * batch)     # root, two levels of two
    q = torch.randn(batch, nodes, HQ, D)
    k = torch.randn(batch, nodes, HKV, D)
    v = torch.randn(batch, nodes, HKV, D)
    ref = _dense_reference(pool, pages, cached, parents, q, k, v)
    memory = TreeKV(1, batch, nodes, HKV, D, torch.float32, torch.device("cpu"))
    mask = ancestors(parents, nodes)
    for start, end in ((0, 1), (1, 3), (3, 7)):
        attn = TreeAttention(pool, pages, cached, memory, start, mask[:, start:end])
        out = attn.forward(0, q[:, start:end].reshape(-1, HQ, D),
                           k[:, start:end].reshape(-1, HKV, D), v[:, start:end].reshape(-1, HKV, D))
        torch.testing.assert_close(out.view(batch, end - start, HQ, D), ref[:, start:end],
                                   rtol=1e-5, atol=1e-5)


def test_commit_writes_the_path_contiguously_and_nothing_else() -> None:
    batch, nodes = 3, 6
    pool, pages, cached, _ = _case(7, batch, nodes)
    memory = TreeKV(1, batch, nodes, HKV, D, torch.float32, torch.device("cpu"))
    memory.k.normal_()
    memory.v.normal_()
    path = torch.tensor([[0, 2, 5], [0, 1, 1], [0, 3, 4]])
    count = torch.tensor([3, 2, 0])
    before_k = pool.k[0].clone()
    commit(pool, memory, pages, cached, path, count)
    flat_k, flat_v = pool.k[0].view(-1, HKV, D), pool.v[0].view(-1, HKV, D)
    touched = set()
    for b in range(batch):
        for j in range(int(count[b])):
            pos = int(cached[b]) + j
            slot = int(pages[b, pos // PAGE]) * PAGE + pos % PAGE
            touched.add(slot)
            assert torch.equal(flat_k[slot], memory.k[0, b, path[b, j]])
            assert torch.equal(flat_v[slot], memory.v[0, b, path[b, j]])
    before = before_k.view(-1, HKV, D)
    for slot in range(flat_k.shape[0]):
        if slot not in touched and slot // PAGE != DUMMY_PAGE:
            assert torch.equal(flat_k[slot], before[slot]), slot


def test_ancestors_mask() -> None:
    parents = torch.tensor([[0, 0, 1, 0, 3, 2]])
    mask = ancestors(parents, 3)[0]
    expect = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 3}, 4: {0, 3, 4}, 5: {0, 1, 2, 5}}
    for i, seen in expect.items():
        assert {j for j in range(6) if mask[i, j]} == seen


@pytest.mark.parametrize("seed,batch,nodes", [(5, 3, 9), (6, 2, 70)])
def test_tree_kernel_nodes_not_live_read_no_context(seed, batch, nodes) -> None:
    """The fused kernel's `live` input (per-request trees' grid; compiled on a GPU, triton's
    interpreter here): a live node's output equals the dense-mask reference; a node not live
    attends to its tree slots alone (the reference at no context)."""
    pool, pages, cached, parents = _case(seed, batch, nodes)
    q = torch.randn(batch, nodes, HQ, D)
    k = torch.randn(batch, nodes, HKV, D)
    v = torch.randn(batch, nodes, HKV, D)
    live = torch.rand(batch, nodes, generator=torch.Generator().manual_seed(seed)) < 0.5
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = kernels.tree_attention(q.reshape(-1, HQ, D).to(dev), pool.k[0].to(dev),
                                 pool.v[0].to(dev), pages.to(dev), cached.to(dev), k.to(dev),
                                 v.to(dev), ancestors(parents, nodes).to(dev), D ** -0.5,
                                 live=live.to(dev))
    out = out.view(batch, nodes, HQ, D).cpu()
    ref = _dense_reference(pool, pages, cached, parents, q, k, v)
    alone = _dense_reference(pool, pages, torch.zeros_like(cached), parents, q, k, v)
    torch.testing.assert_close(out[live], ref[live], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[~live], alone[~live], rtol=1e-5, atol=1e-5)


def test_packed_tree_attention_equals_the_grid() -> None:
    """`PackedTreeAttention` (per-request trees' ragged verify): each row's live nodes packed
    back to back, padding tokens after; every live token's output equals the grid's
    `TreeAttention` at that node, and the store holds the live nodes' K/V at their slots."""
    from workers.attention.tree import PackedTreeAttention

    batch, nodes = 3, 6
    pool, pages, cached, parents = _case(7, batch, nodes)
    live = torch.tensor([[1, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]],
                        dtype=torch.bool)
    # a node left out is its own parent; the live ones keep their (live) ancestors
    idx = torch.arange(nodes)[None, :].expand(batch, -1)
    parents = torch.where(live, parents, idx)
    live[0, 1:] &= live[0, parents[0, 1:]]
    live[2] = True
    q = torch.randn(batch, nodes, HQ, D)
    k = torch.randn(batch, nodes, HKV, D)
    v = torch.randn(batch, nodes, HKV, D)
    mask = ancestors(parents, nodes)
    grid_mem = TreeKV(1, batch, nodes, HKV, D, torch.float32, torch.device("cpu"))
    grid = TreeAttention(pool, pages, cached, grid_mem, 0, mask).forward(
        0, q.reshape(-1, HQ, D), k.reshape(-1, HKV, D), v.reshape(-1, HKV, D))
    cells = torch.nonzero(live.reshape(-1))[:, 0]
    tokens = int(cells.numel()) + 2
    index = torch.cat([cells, torch.full((2,), batch * nodes)])
    memory = TreeKV(1, batch + 1, nodes, HKV, D, torch.float32, torch.device("cpu"))
    attn = PackedTreeAttention(pool, pages, cached, memory, mask, index, live)
    flat_q = torch.cat([q.reshape(-1, HQ, D), torch.zeros(1, HQ, D)])[index]
    flat_k = torch.cat([k.reshape(-1, HKV, D), torch.zeros(1, HKV, D)])[index]
    flat_v = torch.cat([v.reshape(-1, HKV, D), torch.zeros(1, HKV, D)])[index]
    out = attn.forward(0, flat_q, flat_k, flat_v)
    assert out.shape[0] == tokens
    torch.testing.assert_close(out[:cells.numel()], grid[cells], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(memory.k[0, :batch].reshape(-1, HKV, D)[cells],
                               k.reshape(-1, HKV, D)[cells])


def _tiled_case(seed: int, batch: int, nodes: int, groups: int, dim: int, context: str,
                dtype: torch.dtype):
    """Llama-like shapes for the tiled kernel: pages of 16, 2 KV heads x `groups` query heads,
    head_dim `dim`; contexts "none" (0), "pages" (a few pages, ends mid-page) or "long" (several
    hundred keys, a reach of 512 so the context splits); inputs rounded to `dtype` (the
    reference runs in float32 on the same values)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    page, hkv = 16, 2
    reach_pages = 32
    pool = KVPool(1, batch * reach_pages + 1, page, hkv, dim, dtype=torch.float32,
                  device=torch.device("cpu"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    pool.k[0].copy_(pool.k[0].to(dtype).float())
    pool.v[0].copy_(pool.v[0].to(dtype).float())
    free = list(range(1, batch * reach_pages + 1))
    rng.shuffle(free)
    pages = torch.tensor([[free.pop() for _ in range(reach_pages)] for _ in range(batch)])
    span = {"none": (0, 0), "pages": (17, 70), "long": (300, 512)}[context]
    cached = torch.tensor([rng.randint(*span) for _ in range(batch)])
    parents = torch.tensor([_random_parents(rng, nodes) for _ in range(batch)])
    q = torch.randn(batch, nodes, hkv * groups, dim).to(dtype).float()
    k = torch.randn(batch, nodes, hkv, dim).to(dtype).float()
    v = torch.randn(batch, nodes, hkv, dim).to(dtype).float()
    return pool, pages, cached, parents, q, k, v


@pytest.mark.parametrize("seed,batch,nodes,groups,dim,context,dtype,splits,live", [
    (11, 1, 6, 4, 128, "long", torch.float32, 4, False),
    (12, 4, 8, 1, 64, "pages", torch.float32, 1, True),
    (13, 2, 16, 4, 64, "none", torch.float32, 2, False),
    (14, 3, 13, 4, 128, "pages", torch.float16, 3, True),
    (15, 1, 16, 1, 128, "long", torch.float16, 8, True),
    (16, 2, 7, 4, 64, "long", torch.float16, 1, False),
    (17, 4, 6, 4, 64, "long", torch.float32, 5, True),
])
def test_tiled_tree_attention_equals_dense_reference_and_the_per_node_kernel(
        seed, batch, nodes, groups, dim, context, dtype, splits, live) -> None:
    """The tiled tree kernel (a tile of nodes x the query heads of one KV head, tl.dot; the
    context split in `splits` chunks merged after; compiled on a GPU, triton's interpreter here)
    equals the dense SDPA reference with an explicit boolean mask and the per-(node, query head)
    kernel; nodes not live read no context."""
    pool, pages, cached, parents, q, k, v = _tiled_case(seed, batch, nodes, groups, dim, context,
                                                        dtype)
    alive = (torch.rand(batch, nodes, generator=torch.Generator().manual_seed(seed)) < 0.6
             if live else None)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hq, hkv = q.shape[2], k.shape[2]
    args = (q.reshape(-1, hq, dim).to(dev, dtype), pool.k[0].to(dev, dtype),
            pool.v[0].to(dev, dtype), pages.to(dev), cached.to(dev), k.to(dev, dtype),
            v.to(dev, dtype), ancestors(parents, nodes).to(dev), dim ** -0.5)
    extra = dict(live=alive.to(dev)) if live else {}
    tiled = kernels.tree_attention(*args, tiled=True, splits=splits, **extra)
    per_node = kernels.tree_attention(*args, tiled=False, **extra)
    tiled = tiled.view(batch, nodes, hq, dim).float().cpu()
    per_node = per_node.view(batch, nodes, hq, dim).float().cpu()
    ref = _dense_reference(pool, pages, cached, parents, q, k, v)
    if live:
        alone = _dense_reference(pool, pages, torch.zeros_like(cached), parents, q, k, v)
        ref = torch.where(alive[:, :, None, None], ref, alone)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(tiled, ref, **tol)
    torch.testing.assert_close(tiled, per_node, **tol)


def test_tiled_tree_attention_is_deterministic_and_refuses_what_it_cannot_run() -> None:
    pool, pages, cached, parents, q, k, v = _tiled_case(21, 2, 8, 4, 64, "long", torch.float32)
    args = (q.reshape(-1, 8, 64), pool.k[0], pool.v[0], pages, cached, k, v,
            ancestors(parents, 8), 0.125)
    if torch.cuda.is_available():   # compiled on a GPU (CPU tensors only in the interpreter)
        args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    first = kernels.tree_attention(*args, splits=3)
    assert torch.equal(first, kernels.tree_attention(*args, splits=3)), "same bits each run"
    with pytest.raises(ValueError, match="splits=0"):
        kernels.tree_attention(*args, splits=0)
    with pytest.raises(ValueError, match="tiled=False"):
        kernels.tree_attention(*args, tiled=False, splits=2)
    with pytest.raises(ValueError, match="tiled=True with torch.float64"):
        kernels.tree_attention(args[0].double(), *(a.double() if a.is_floating_point() else a
                                                   for a in args[1:8]), 0.125, tiled=True)
    with pytest.raises(ValueError, match="8 rows for a mask"):
        kernels.tree_attention(args[0][:8], *args[1:])


def test_tree_attention_splits_from_static_shapes() -> None:
    """Llama-8B heads (32/8) on 132 SMs: one row of 8 or 16 nodes is 8 programs, so a long
    reach splits to about 2 x SMs programs; short reaches and busy grids do not split."""
    assert kernels.tree_attention_splits(1, 8, 32, 8, 4096, 132) == 33
    assert kernels.tree_attention_splits(1, 16, 32, 8, 4096, 132) == 33
    assert kernels.tree_attention_splits(16, 16, 32, 8, 4096, 132) == 3
    assert kernels.tree_attention_splits(1, 8, 32, 8, 128, 132) == 1
    assert kernels.tree_attention_splits(64, 8, 32, 8, 4096, 132) == 1
    assert kernels.tree_attention_splits(1, 8, 32, 8, 1024, 132) == 16   # chunks >= 64 keys


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture is CUDA's")
@pytest.mark.parametrize("batch,nodes", [(1, 8), (4, 16)])
def test_tiled_tree_attention_in_a_cuda_graph(batch: int, nodes: int) -> None:
    """As the engine runs it on a GPU: Llama-8B heads (32/8 of 128), bfloat16, a long reach so
    the automatic split count is > 1, captured in a CUDA graph and replayed with other cached
    lengths and live masks (chunks past the live keys write empty states): equal to the dense
    reference and the per-node kernel, the same bits on every replay."""
    torch.manual_seed(31)
    rng = random.Random(31)
    hq, hkv, dim, page, reach_pages = 32, 8, 128, 16, 256
    dev = torch.device("cuda")
    pool = KVPool(1, batch * reach_pages + 1, page, hkv, dim, dtype=torch.bfloat16, device=dev)
    pool.k[0].normal_()
    pool.v[0].normal_()
    pages = (torch.randperm(batch * reach_pages)[:batch * reach_pages] + 1).view(batch, -1)
    parents = torch.tensor([_random_parents(rng, nodes) for _ in range(batch)])
    mask = ancestors(parents, nodes).to(dev)
    q = torch.randn(batch * nodes, hq, dim, device=dev).to(torch.bfloat16)
    k = torch.randn(batch, nodes, hkv, dim, device=dev).to(torch.bfloat16)
    v = torch.randn(batch, nodes, hkv, dim, device=dev).to(torch.bfloat16)
    cached = torch.full((batch,), 4000, device=dev)
    live = torch.ones(batch, nodes, dtype=torch.bool, device=dev)
    sms = kernels._sm_count(torch.cuda.current_device())
    assert kernels.tree_attention_splits(batch, nodes, hq, hkv, reach_pages * page, sms) > 1
    args = (q, pool.k[0], pool.v[0], pages.to(dev), cached, k, v, mask, dim ** -0.5)
    kernels.tree_attention(*args, live=live)          # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.tree_attention(*args, live=live)
    for lengths in ([4000, 17, 0, 2900], [63, 4095, 1024, 5], [0, 0, 300, 300]):
        cached.copy_(torch.tensor(lengths[:batch]))
        live.copy_(torch.rand(batch, nodes) < 0.7)
        graph.replay()
        first = out.clone()
        graph.replay()
        assert torch.equal(out, first)
        per_node = kernels.tree_attention(*args, live=live, tiled=False)
        torch.testing.assert_close(out.float(), per_node.float(), atol=2e-2, rtol=2e-2)
        cpu = KVPool(1, batch * reach_pages + 1, page, hkv, dim, dtype=torch.float32,
                     device=torch.device("cpu"))
        cpu.k[0].copy_(pool.k[0].float())
        cpu.v[0].copy_(pool.v[0].float())
        qf = q.float().cpu().view(batch, nodes, hq, dim)
        kf, vf = k.float().cpu(), v.float().cpu()
        ref = _dense_reference(cpu, pages, cached.cpu(), parents, qf, kf, vf)
        alone = _dense_reference(cpu, pages, torch.zeros(batch, dtype=torch.int64), parents,
                                 qf, kf, vf)
        ref = torch.where(live.cpu()[:, :, None, None], ref, alone)
        torch.testing.assert_close(out.float().cpu().view(batch, nodes, hq, dim), ref,
                                   atol=2e-2, rtol=2e-2)
