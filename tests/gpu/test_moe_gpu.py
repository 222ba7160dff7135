"""MoE targets on the GPU: transformers-built Qwen3-MoE and Qwen2-MoE (a gated shared expert) with
an EAGLE-3 head; CUDA-graph rounds replay to eager at every depth (float64: the dense expert
path; float32: the fused grouped GEMMs of ``workers.moe_kernels``), a tier switch captures
nothing; a round's graphs and its eager bodies at the same bucket give the same logits and tokens
(bfloat16 and float32, on the measurement's rows); the fused kernels equal the sparse torch path
at the shapes of a round and of a prefill; speculative sampling keeps the target's law."""
from __future__ import annotations

import functools
import gc
import weakref
from pathlib import Path

import pytest
import torch

from adaptive_dist.config import AdaptiveConfig
from engine_fixtures import check_pages_back, engine_for, random_prompts
from workers.model import load_eagle, load_llama
from workers.sampling import SamplingParams

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
VOCAB = 96


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe_dir(request, tmp_path_factory) -> Path:
    """8 experts (top 2) of width 32, layer 2 dense; qwen2_moe: a shared expert of width 48."""
    pytest.importorskip("transformers")
    from hf_models import moe_pair
    shared = 48 if request.param == "qwen2_moe" else None
    return moe_pair(tmp_path_factory.mktemp(request.param), VOCAB, hidden=64, expert_width=32,
                    max_pos=512, shared_expert_width=shared)


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=8 + 7 * (i % 5)) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_moe_graph_replay_equals_eager_and_a_switch_captures_nothing(moe_dir, dtype) -> None:
    target = load_llama(moe_dir / "target", dtype=dtype, device="cuda")
    head = load_eagle(moe_dir / "eagle", target)
    prompts = random_prompts(8, VOCAB, seed=7)
    params = _params(len(prompts))
    reference = [r.output_ids for r in engine_for(target, None, "nospec", device="cuda")
                 .generate(prompts, params)]
    for steps in (1, 3, 7):
        engine = engine_for(target, head, "static", steps, device="cuda", cuda_graphs=True)
        assert [r.output_ids for r in engine.generate(prompts, params)] == reference, steps
        assert engine.stats.graph_rounds == engine.stats.rounds > 0
        engine.close()
        check_pages_back(engine)
    config = AdaptiveConfig(warmup_batches=1, update_interval=1, ema_alpha=0.6, initial_steps=7)
    engine = engine_for(target, head, "ema", device="cuda", cuda_graphs=True, config=config)
    captured = engine.worker.graphs.num_captures
    assert [r.output_ids for r in engine.generate(prompts, params)] == reference
    assert engine.stats.switches >= 1 and engine.stats.graph_rounds == engine.stats.rounds
    assert engine.worker.graphs.num_captures == captured, "a tier switch captured a graph"
    engine.close()
    # goodput, its cost table measured at start-up through the graphs with overlap, on the
    # borrowed slots' real rows (restored after): the same outputs
    config = AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3, 7), initial_steps=0)
    engine = engine_for(target, head, "ema", device="cuda", cuda_graphs=True, overlap=True,
                        config=config)
    assert engine.config.spec.round_cost is not None
    slots = engine.worker.slots
    assert (slots.pages[:slots.dummy] == 0).all() and not slots.cache_len.any()
    assert [r.output_ids for r in engine.generate(prompts, params)] == reference
    engine.close()
    check_pages_back(engine)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 9, 32, 33, 64 * 8, 3000])
def test_fused_moe_equals_the_sparse_path_on_the_gpu(moe_dir, dtype, rows: int) -> None:
    """Top 2: up to 8 rows (16 pairs) the pair path, from 9 the grouped GEMMs."""
    from workers import moe_kernels
    assert (rows * 2 <= moe_kernels.PAIR_PATH_PAIRS) == (rows <= 8)
    target = load_llama(moe_dir / "target", dtype=dtype, device="cuda")
    block = target.model.layers[0].ffn
    x = torch.randn(rows, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(rows))
    x = x.to(dtype)
    ids, weights = block.route(x)
    want = block.sparse(x, ids, weights)
    # bfloat16: hidden rows rounded to 8 bits after sums in different orders: a few units in the
    # last place of the output's scale
    tol = ({"atol": 0.04 * want.abs().max().item(), "rtol": 2e-2} if dtype == torch.bfloat16
           else {"atol": 1e-4, "rtol": 1e-4})
    torch.testing.assert_close(block.fused(x, ids, weights), want, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("steps", [0])
def test_a_round_graph_equals_its_eager_bodies(moe_dir, dtype, steps: int) -> None:
    """At bucket 8 and the same staged rows (the cost measurement's: varied tokens, so the
    router spreads them), the captured round and its eager bodies give the same verify logits
    (the fused MoE path both ways) and the same committed tokens.

    Depth 0 only: the measurement's rows write every position past their context into the one
    dummy page, so at depth > 0 a verify token reads the earlier draft positions' K/V that all
    rows wrote to the same slots, in an order that differs between a replay and the eager
    bodies (on one H200 the depth-3 logits differed by up to 6; the timing is what those rows
    are for). Depths 1, 3 and 7 through graphs on real requests, against no-spec:
    `test_moe_graph_replay_equals_eager_and_a_switch_captures_nothing` above."""
    from workers.worker.round_cost import TrafficRows

    target = load_llama(moe_dir / "target", dtype=dtype, device="cuda")
    head = load_eagle(moe_dir / "eagle", target)
    config = AdaptiveConfig(policy="goodput", candidate_steps=(0, 3), initial_steps=steps,
                            round_cost={"0": 1.0, "3": 2.0})
    engine = engine_for(target, head, "ema", device="cuda", cuda_graphs=True, max_batch=8,
                        config=config)
    worker, bucket = engine.worker, 8
    engine.pool.apply(steps)
    tokens = worker.default_shape(bucket).verify_tokens
    out = {}
    with TrafficRows(worker, bucket, context=20) as rows:
        for graphs in (True, False):
            rows.start()
            worker.buffers.rows[:bucket] = torch.arange(bucket, device="cuda")
            worker.buffers.budget[:bucket] = steps
            with torch.inference_mode():
                worker.round_body(bucket, graphs=graphs)()
            torch.cuda.synchronize()
            out[graphs] = (worker.buffers.packed_logits[:tokens].float().clone(),
                           worker.state.payload.out[:bucket, :2 + steps + 1].clone())
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out[True][0], out[False][0], **tol)
    assert torch.equal(out[True][1], out[False][1])
    assert out[True][0].std() > 0
    engine.close()


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_speculative_sampling_over_a_moe_target_keeps_its_distribution_on_the_gpu(
        tmp_path: Path, kind: str) -> None:
    """Rejection sampling with an EAGLE-3 head (a draft vocabulary of 4 of the 6 target ids) over
    a transformers-built MoE target in float32 on the GPU (the fused experts; Qwen2-MoE with
    its shared expert), CUDA graphs on: the joint law of 3 sampled tokens is the target's."""
    transformers = pytest.importorskip("transformers")
    from model_fixtures import random_head, write_checkpoint
    from sampling_reference import VOCAB as V, check_keeps_target_law
    torch.manual_seed(5)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16)
    if kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, norm_topk_prob=True))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, norm_topk_prob=False, shared_expert_intermediate_size=24))
    with torch.no_grad():
        for name, p in model.eval().named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path / "target")
    reference = load_llama(tmp_path / "target", dtype=torch.float64)   # the law, on the CPU
    assert (reference.config.moe.shared_expert_size is not None) == (kind == "qwen2_moe")
    write_checkpoint(random_head("eagle3", reference, [0, 2, 3, 5], seed=4,
                                 aux_layer_ids=(-1, 0, 1)), tmp_path / "eagle")
    target = load_llama(tmp_path / "target", dtype=torch.float32, device="cuda")
    head = load_eagle(tmp_path / "eagle", target)
    engine = engine_for(target, head, "static", steps=3, max_batch=64, device="cuda",
                        cuda_graphs=True)
    check_keeps_target_law(engine, reference, seed=78)
    engine.close()


@pytest.mark.parametrize("pairs", [8, 512, 1024, 4096, 24000])
def test_the_align_kernel_equals_the_torch_alignment_on_the_gpu(pairs: int) -> None:
    """`moe_kernels.align` (one Triton program up to ALIGN_KERNEL_PAIRS, torch ops beyond)
    against the torch ops, top 8 of 128 experts, with another rank's sentinel ids."""
    from workers import moe_kernels
    gen = torch.Generator().manual_seed(pairs)
    ids = torch.randint(0, 131, (pairs // 8, 8), generator=gen).clamp(max=128).cuda()
    got, want = moe_kernels.align(ids, 128), moe_kernels.align_torch(ids, 128)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- the production shape (issue 36): Qwen3-30B-A3B's MoE layer, graph-replayed ---------------
# 128 experts of 768, top 8, d 2048. Every graph below is captured, then the memory freed since
# is given back (`_scramble`: what a later capture's `empty_cache` does) and refilled with NaN,
# then it is replayed over new inputs copied into its static buffers: a graph that reads a tensor
# nobody holds any more, or baked values instead of its inputs, fails here (the bench's
# `kernels` way did the former and died with an illegal memory access).

PROD_D, PROD_F = 2048, 768
DEV = "cuda"
PROD_ROWS = [1, 2, 3, 5, 8, 9, 13, 31, 64, 100, 128, 129, 200, 256, 333, 512]


@functools.lru_cache(maxsize=2)
def _prod_block(dtype: torch.dtype):
    """A Qwen3-30B-A3B-shaped MoE block on the GPU (weights 0.02 N(0, 1), drawn in float32)."""
    from moe_reference import E, TOP_K
    from workers.model.config import LlamaConfig, MoeSpec
    from workers.model.moe import MoeBlock
    from workers.model.parallel import ModelParallel

    cfg = LlamaConfig(vocab_size=64, hidden_size=PROD_D, intermediate_size=3 * PROD_D,
                      num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4,
                      explicit_head_dim=128, architecture="Qwen3MoeForCausalLM",
                      moe=MoeSpec(num_experts=E, top_k=TOP_K, expert_size=PROD_F,
                                  norm_topk_prob=True))
    with torch.device("meta"):
        block = MoeBlock(cfg, ModelParallel.single(DEV))
    block.to_empty(device=DEV)
    gen = torch.Generator(DEV).manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=DEV).mul_(0.02))
    return block.to(dtype)


def _captured(fn):
    """(the CUDA graph of `fn()` after two warm-ups on a side stream, its output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _scramble() -> torch.Tensor:
    """Give every freed block back to the driver (a tensor nobody holds is freed when its last
    reference goes), then take 256 MiB filled with NaN (keep it until the replay is checked)."""
    torch.cuda.empty_cache()
    return torch.full((64 << 20,), float("nan"), device=DEV)


@pytest.mark.parametrize("layout", ["tp1", "ep_half"])
@pytest.mark.parametrize("path", ["pairs", "grouped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_at_the_production_shape_graph_replayed_equals_the_sparse_path(
        dtype, path: str, layout: str, monkeypatch) -> None:
    """Rows 1..512 (incl. not powers of two) through each path (the shape picks `pairs` up to 8
    rows), graph-replayed over the router's routing and over every token sent to the same 8
    experts, against `MoeBlock.sparse`. `ep_half`: this rank holds experts 0..63, so the routed
    ids past them are the sentinel 64 and add nothing (the sparse reference weights them 0)."""
    from moe_reference import E, TOP_K, routings
    from workers import moe_kernels

    monkeypatch.setattr(moe_kernels, "PAIR_PATH_PAIRS", 0 if path == "grouped" else 10 ** 6)
    block = _prod_block(dtype)
    local = E if layout == "tp1" else E // 2
    w13 = block.gate_up.stacked.view(E, 2 * PROD_F, PROD_D)[:local]
    w2 = block.down.stacked[:local]
    for rows in PROD_ROWS:
        x = torch.empty(rows, PROD_D, dtype=dtype, device=DEV)
        ids = torch.empty(rows, TOP_K, dtype=torch.int64, device=DEV)
        weights = torch.empty(rows, TOP_K, dtype=dtype, device=DEV)

        def stage(seed: int, skewed: bool) -> tuple[torch.Tensor, torch.Tensor]:
            """New inputs into the static buffers; returns the routing as routed (for the
            reference) and its weights, the ids the kernels get are the local ones."""
            gen = torch.Generator(DEV).manual_seed(seed)
            x.copy_(torch.randn(rows, PROD_D, generator=gen, device=DEV))
            routed, w = block.route(x)
            if skewed:
                routed = routings(rows, seed)["skewed"].to(DEV)
            ids.copy_(routed.clamp(max=local))
            weights.copy_(w)
            return routed, w * (routed < local).to(dtype)

        stage(rows, False)
        graph, out = _captured(lambda: moe_kernels.fused_moe(x, ids, weights, w13, w2))
        junk = _scramble()
        for seed, skewed in ((rows + 1, False), (rows + 2, True)):
            routed, w = stage(seed, skewed)
            graph.replay()
            torch.cuda.synchronize()
            want = block.sparse(x, routed, w)
            tol = ({"atol": 0.04 * want.abs().max().item(), "rtol": 2e-2}
                   if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4})
            torch.testing.assert_close(out, want, **tol, msg=lambda m: f"{rows} rows, "
                                       f"{'skewed' if skewed else 'router'}: {m}")
        del graph, junk


def test_align_at_the_production_shape_graph_replayed_every_row_count() -> None:
    """`moe_kernels.align` captured at every row count 1..128 (up to 1024 pairs: the one Triton
    program) and at 129/200/333/512 (the torch ops), replayed over uniform, skewed and
    last-experts routings (and at a few row counts an expert-parallel rank's, with other ranks'
    ids): equal to `align_torch` run eagerly and to the contract
    (`moe_reference.check_alignment`)."""
    from moe_reference import E, TOP_K, check_alignment, routings
    from workers import moe_kernels

    for rows in [*range(1, 129), 129, 200, 333, 512]:
        # E // 2: an expert-parallel rank's experts, the sentinel id 64 (at a few row counts)
        for experts in (E, E // 2) if rows in (1, 5, 64, 127, 128, 129, 512) else (E,):
            ids = torch.zeros(rows, TOP_K, dtype=torch.int64, device=DEV)
            graph, (got_rows, got_blocks) = _captured(lambda: moe_kernels.align(ids, experts))
            junk = _scramble()
            for name, routed in routings(rows, seed=rows).items():
                if (name == "ep_slice") != (experts == E // 2):
                    continue
                ids.copy_(routed)
                graph.replay()
                want = moe_kernels.align_torch(ids, experts)
                torch.cuda.synchronize()
                assert torch.equal(got_rows, want[0]) and torch.equal(got_blocks, want[1]), \
                    (rows, name)
                if rows in (1, 2, 3, 8, 9, 64, 127, 128, 129, 512):
                    check_alignment(routed, experts, got_rows, got_blocks)
            del graph, junk


@pytest.mark.parametrize("experts, top_k", [(128, 8), (60, 4), (4, 3)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_route_kernel_on_the_gpu_equals_the_routing_definition(experts: int, top_k: int,
                                                                   norm: bool, dtype) -> None:
    """`moe_kernels.route` compiled and graph-replayed at 1 and 333 rows, against the float32
    softmax over every expert, its top k (of equal logits the lower expert first), renormalised
    when `norm` (`tests/unit/test_moe_kernels.py` checks the same in the interpreter)."""
    from workers import moe_kernels

    for rows in (1, 333):
        logits = torch.zeros(rows, experts, dtype=dtype, device=DEV)
        graph, (ids, weights) = _captured(
            lambda: moe_kernels.route(logits, top_k, norm, dtype))
        junk = _scramble()
        gen = torch.Generator(DEV).manual_seed(rows * experts)
        logits.copy_(torch.randn(rows, experts, generator=gen, device=DEV) * 2)
        graph.replay()
        torch.cuda.synchronize()
        values = logits.float().cpu()
        for row in range(rows):
            want = sorted(range(experts), key=lambda e: (-values[row, e].item(), e))[:top_k]
            assert ids[row].tolist() == want, (rows, row)
        want = torch.softmax(values, dim=-1).gather(1, ids.cpu())
        if norm:
            want = want / want.sum(dim=-1, keepdim=True)
        tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
        torch.testing.assert_close(weights.cpu(), want.to(dtype), **tol)
        del graph, junk


def test_the_bench_graphs_hold_what_they_read() -> None:
    """`scripts.bench.moe_layer.graphed`'s replay keeps the callable it captured, and so the
    tensors its closure holds (before the fix a bare `graph.replay` let them go: issue 36)."""
    from scripts.bench import moe_layer

    counter = torch.zeros(5 << 20, device=DEV)     # 20 MiB: a segment of its own
    alive = weakref.ref(counter)

    def bump(counter: torch.Tensor = counter) -> None:
        counter.add_(1)
    replay = moe_layer.graphed(bump)
    del bump, counter
    gc.collect()
    junk = _scramble()
    assert alive() is not None, "the bench's graph outlived the tensor it writes"
    replay()
    torch.cuda.synchronize()
    assert bool((alive() == 3).all())       # two warm-ups and the replay
    del junk


def test_the_moe_layer_bench_runs_every_way_at_the_production_shape() -> None:
    """The bench's layer part (`moe_layer.layer_rows`) at 1, 9 and 300 rows, one repeat: every
    way (the layer graph-replayed, with the grouped GEMMs, its kernels alone, the alignment both
    ways, eager) captured and timed without a fault (its first repeat died at 1 row before)."""
    import argparse

    from scripts.bench import moe_layer

    rows = moe_layer.layer_rows(argparse.Namespace(rows=[1, 9, 300], iters=3, repeats=1,
                                                   bandwidth=3.25e12, ways=list(moe_layer.WAYS)))
    assert [r["path"] for r in rows] == ["pairs", "grouped", "grouped"]
    for r in rows:
        for way in ("graph", "graph_grouped", "kernels", "align_kernel", "align_torch", "eager"):
            assert r[f"{way}_ms"] > 0, (r["rows"], way)
    torch.cuda.synchronize()


# ---- Qwen2-MoE over several GPUs: NCCL, CUDA graphs, the cost table measured on real rows ------

def _multi_gpu_qwen2_moe(tmp_path: Path, world: int, dp: int, moe: str, modes: list[str]) -> None:
    """`world` ranks on as many GPUs (NCCL), `dp` replicas (the rest attention tensor-parallel),
    a transformers-built Qwen2-MoE target (a shared expert of width 24) in float64 with an EAGLE-3
    head, CUDA graphs; replica 0 nearly idle: every mode's greedy outputs equal one CPU process
    without speculation, every rank issued the same collectives and made the same decisions
    (goodput: the start-up cost table measured on each replica's own real rows, then agreed)."""
    pytest.importorskip("transformers")
    import dp_jobs
    from hf_models import moe_pair
    from multirank import run_ranks

    root = moe_pair(tmp_path, VOCAB, shared_expert_width=24)
    prompts = [random_prompts(1, VOCAB, seed=21, lo=3, hi=5), random_prompts(4, VOCAB, seed=22)]
    new = [[3], [20, 9, 24, 14]]
    target = load_llama(root / "target", dtype=torch.float64)
    assert target.model.layers[0].ffn.shared_expert is not None
    want = [[r.output_ids for r in engine_for(target, None, "nospec").generate(
        p, [SamplingParams(max_new_tokens=n) for n in lens])] for p, lens in zip(prompts, new)]
    results = run_ranks(dp_jobs.generate_job, world, str(root), dp, modes, prompts, new, 0.0, 0,
                        True, moe, timeout=600)
    for res in results:
        for mode in modes:
            got = res.value[mode]
            assert got["outputs"] == want[res.value["replica"]], (res.rank, mode)
            assert got["graph_rounds"] > 0 and got["captures"][0] == got["captures"][1] > 0, mode
    for mode in modes:
        first = results[0].value[mode]
        for res in results[1:]:
            assert res.value[mode]["log"] == first["log"], f"{mode}: collective logs differ"
            assert res.value[mode]["timeline"] == first["timeline"], mode
            assert res.value[mode]["round_cost"] == first["round_cost"], mode


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL")
@pytest.mark.parametrize("moe", ["ep", "tp"])
def test_qwen2_moe_dp2_on_two_gpus_lossless_in_lockstep(tmp_path: Path, moe: str) -> None:
    _multi_gpu_qwen2_moe(tmp_path, 2, 2, moe, ["static3", "forced", "goodput", "forced+overlap"])


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs for NCCL")
def test_qwen2_moe_dp2_attn_tp2_on_four_gpus_lossless_in_lockstep(tmp_path: Path) -> None:
    _multi_gpu_qwen2_moe(tmp_path, 4, 2, "ep", ["static3", "forced", "goodput"])


@pytest.mark.parametrize("shared, norm", [(False, False), (True, False), (False, True),
                                          (True, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_on_the_gpu_equals_the_torch_ops(shared: bool, norm: bool, dtype) -> None:
    """`moe_kernels.combine` compiled and graph-replayed at 1 and 200 rows of the production
    width (2048, top 8) against the torch ops it replaces: ``pairs.sum(1)``, ``+ shared *
    sigmoid(gate)``, the residual add and ``RMSNorm`` (torch's path), each rounded to the dtype
    as those ops round (to nearest: the interpreter's CPU test cannot check that). Both against a
    float64 reference of the same inputs: the kernel's error is the torch ops' own (a float32
    sum's order, exp and rsqrt differ by an ulp here and there: the first H200 run found 43% of
    float32 sums and ~1% of bfloat16 elements one ulp apart, so bit equality is not asked: its mean
    error at most twice theirs), and within a few ulps of the reference everywhere."""
    from workers import moe_kernels
    from workers.model.layers import RMSNorm

    d = 2048
    eps = torch.finfo(dtype).eps
    for rows in (1, 200):
        gen = torch.Generator(DEV).manual_seed(rows)
        pairs = torch.randn(rows, 8, d, generator=gen, device=DEV).to(dtype)
        sh = torch.randn(rows, d, generator=gen, device=DEV).to(dtype) if shared else None
        gate = (torch.randn(rows, 1, generator=gen, device=DEV) * 2).to(dtype) if shared else None
        x = torch.randn(rows, d, generator=gen, device=DEV).to(dtype)
        rms = RMSNorm(d, 1e-6).to(DEV, dtype)
        with torch.no_grad():
            rms.weight.copy_(1 + 0.1 * torch.randn(d, generator=gen, device=DEV))
        graph, got = _captured(lambda: moe_kernels.combine(pairs, sh, gate, x, rms.weight, 1e-6)
                               if norm else moe_kernels.combine(pairs, sh, gate))
        graph.replay()
        torch.cuda.synchronize()
        want = pairs.sum(dim=1)
        ref = pairs.double().sum(dim=1)
        if shared:
            want = want + sh * torch.sigmoid(gate)
            ref = ref + sh.double() * torch.sigmoid(gate.double())
        with torch.no_grad():
            if norm:
                total = x + want
                want = (total, _torch_rms(rms, total))
                total64 = x.double() + ref
                ref = (total64, rms.weight.double() * total64 * torch.rsqrt(
                    total64.pow(2).mean(-1, keepdim=True) + 1e-6))
            else:
                got, want, ref = (got,), (want,), (ref,)
        for g, w, r in zip(got, want, ref):
            assert g.dtype == dtype and g.shape == r.shape
            err_kernel = (g.double() - r).abs()
            err_torch = (w.double() - r).abs()
            scale = r.abs().max().item()
            assert err_kernel.max().item() <= 4 * eps * scale, (rows, err_kernel.max().item())
            assert err_kernel.mean().item() <= 2 * err_torch.mean().item() + eps * 1e-3 * scale, \
                (rows, err_kernel.mean().item(), err_torch.mean().item())
        del graph


def _torch_rms(rms, x: torch.Tensor) -> torch.Tensor:
    """`RMSNorm`'s torch path (the fused kernels serve CUDA tensors otherwise)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rms.eps)
    return rms.weight * xf.to(x.dtype)


@pytest.mark.parametrize("rows", [1, 2, 23])
def test_the_fused_forward_equals_the_unfused_on_the_gpu(moe_dir, rows: int,
                                                         monkeypatch) -> None:
    """The whole target in float32 on the GPU, the fused path (Triton kernels; each MoE block's
    sum, shared expert's gated add, next residual add and norm in `moe_kernels.combine`; Qwen2-
    MoE's router and gate in one GEMM) against the same weights with the fused kernels off (the
    dense expert path, torch's norms and sums): logits within 1e-4, at the pair path (1, 2
    rows) and the grouped one (23)."""
    from workers import kernels
    from workers.model import DenseCausalAttention

    target = load_llama(moe_dir / "target", dtype=torch.float32, device="cuda")
    ids = torch.randint(0, VOCAB, (rows,), generator=torch.Generator().manual_seed(rows))
    ids, pos = ids.cuda(), torch.arange(rows, device="cuda")
    with torch.no_grad():
        fused = target.compute_logits(target(ids, pos, DenseCausalAttention([rows])))
        monkeypatch.setattr(kernels, "enabled", lambda x: False)
        plain = target.compute_logits(target(ids, pos, DenseCausalAttention([rows])))
    assert (fused - plain).abs().max().item() < 1e-4
