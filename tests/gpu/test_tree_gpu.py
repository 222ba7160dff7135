"""Draft trees on a CUDA GPU (issue 35): the torch tree attention against the dense-mask reference
on the device, greedy trees equal plain greedy decoding eager and through CUDA graphs (the tiny
float64 pair: no near-tie can flip an argmax; the bundled pair in float32), sampled trees keep the
target's law, the whole tree round captured (draft, verify, acceptance, KV commit) with no host
synchronisation inside. Skipped without CUDA.

    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tree_gpu.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine_fixtures import check_pages_back, engine_for, lossless_params, random_prompts, tiny_pair
from workers.sampling import SamplingParams

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
BUNDLED = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny_pair"
SHAPES = [(3, 2, 6), (5, 4, 8)]


@pytest.fixture(scope="module")
def gpu_pair():
    target, head = tiny_pair(seed=0)
    return target.to("cuda"), head.to("cuda")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(10, vocab=64, seed=7)


@pytest.fixture(scope="module")
def reference(gpu_pair, prompts) -> list[list[int]]:
    engine = engine_for(gpu_pair[0], None, "nospec", device="cuda")
    return [r.output_ids for r in engine.generate(prompts, lossless_params(len(prompts)))]


def _tree(target, head, steps, topk, tokens, **kw):
    return engine_for(target, head, "static", steps=steps, device="cuda",
                      speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens, **kw)


def test_tree_attention_on_cuda_equals_dense_reference() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import test_tree_attention as t
    from workers.kv_cache import KVPool

    for seed, batch, nodes in ((1, 3, 8), (2, 4, 13)):
        pool, pages, cached, parents = t._case(seed, batch, nodes)
        q = torch.randn(batch, nodes, t.HQ, t.D)
        k = torch.randn(batch, nodes, t.HKV, t.D)
        v = torch.randn(batch, nodes, t.HKV, t.D)
        ref = t._dense_reference(pool, pages, cached, parents, q, k, v)
        dev = torch.device("cuda")
        gpu = KVPool(1, t.PAGES, t.PAGE, t.HKV, t.D, dtype=torch.float32, device=dev)
        gpu.k[0].copy_(pool.k[0])
        gpu.v[0].copy_(pool.v[0])
        memory = t.TreeKV(1, batch, nodes, t.HKV, t.D, torch.float32, dev)
        attn = t.TreeAttention(gpu, pages.to(dev), cached.to(dev), memory, 0,
                               t.ancestors(parents.to(dev), nodes))
        out = attn.forward(0, q.reshape(-1, t.HQ, t.D).to(dev), k.reshape(-1, t.HKV, t.D).to(dev),
                           v.reshape(-1, t.HKV, t.D).to(dev))
        torch.testing.assert_close(out.view(batch, nodes, t.HQ, t.D).cpu(), ref, rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("steps,topk,tokens", SHAPES)
def test_greedy_tree_equals_plain_greedy(gpu_pair, prompts, reference, steps, topk, tokens,
                                         graphs) -> None:
    engine = _tree(*gpu_pair, steps, topk, tokens, cuda_graphs=graphs)
    out = engine.generate(prompts, lossless_params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    if graphs:
        assert engine.stats.graph_rounds > 0
        assert engine.worker.graphs.num_captures > 0
    engine.close()
    check_pages_back(engine)


def test_tree_graphs_with_overlap(gpu_pair, prompts, reference) -> None:
    engine = _tree(*gpu_pair, 3, 2, 6, cuda_graphs=True, overlap=True)
    out = engine.generate(prompts, lossless_params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    engine.close()


def test_bundled_pair_float32_tree_equals_no_spec() -> None:
    from workers.loading import encode_prompt, load_pair

    target, head = load_pair(BUNDLED, device="cuda")
    texts = ["def merge_intervals(spans):\n    ", "The lighthouse keeper wrote in her log"]
    prompts = [encode_prompt(p, target.config) for p in texts]
    params = SamplingParams(max_new_tokens=40, stop_token_ids=target.config.eos_token_ids)
    ref = [r.output_ids for r in engine_for(target, None, "nospec", device="cuda")
           .generate(prompts, params)]
    for graphs in (False, True):
        engine = _tree(target, head, 5, 4, 8, cuda_graphs=graphs)
        assert [r.output_ids for r in engine.generate(prompts, params)] == ref, graphs
        engine.close()


def test_tree_sampling_through_graphs_matches_target_distribution() -> None:
    from engine_fixtures import tiny_config
    from sampling_reference import ALPHA, PROMPT, VOCAB, chi_square_pvalue, exact_joint

    target, head = tiny_pair(seed=2, eps=1.0, cfg=tiny_config(vocab=VOCAB, hidden=32))
    engine = _tree(target.to("cuda"), head.to("cuda"), 3, 4, 8, cuda_graphs=True, max_batch=64)
    out = engine.generate([PROMPT] * 8000, SamplingParams(temperature=0.7, top_p=0.8,
                                                          max_new_tokens=3), seed=1000)
    counts = torch.zeros(VOCAB ** 3)
    for req in out:
        t0, t1, t2 = req.output_ids
        counts[(t0 * VOCAB + t1) * VOCAB + t2] += 1
    assert chi_square_pvalue(counts, exact_joint(target.cpu(), 0.7, 0.8)) > ALPHA
    engine.close()


@pytest.mark.parametrize("cycle", [False, True], ids=["policy", "every-candidate"])
def test_adaptive_trees_through_graphs_equal_plain_greedy(gpu_pair, prompts, reference, cycle,
                                                          monkeypatch) -> None:
    """goodput over chains 0/1/3/7 and trees (3,2,6), (5,4,8), (6,8,16) through CUDA graphs (one
    graph per tree shape and bucket, captured at start-up beside the chains'): the policy's own
    choices, and every candidate in turn (every transition, the pick replaced by the next
    index); greedy output equals plain greedy, rounds ran through the graphs, trees and chains
    both ran, and no graph was captured after start-up."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_tree_policy import TABLE_8B, goodput

    from adaptive_dist.cost_tables import load_model_costs

    if cycle:
        import adaptive_dist.policy.goodput as goodput_module

        monkeypatch.setattr(goodput_module, "goodput_pick",
                            lambda scores, index, margin: (index + 1) % len(scores))
    table, verify, _ = load_model_costs(str(TABLE_8B))
    cfg = goodput(table, verify, [[3, 2, 6], [5, 4, 8], [6, 8, 16]], update_interval=1,
                  warmup_batches=0, switch_margin=0.0, graph_buckets=(1, 2, 4))
    engine = engine_for(*gpu_pair, "ema", config=cfg, device="cuda", cuda_graphs=True)
    captured = engine.worker.graphs.num_captures
    out = engine.generate(prompts, lossless_params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    assert engine.stats.graph_rounds > 0
    assert engine.worker.graphs.num_captures == captured
    shapes = engine.planner.stats.rounds_at_shape
    assert any(len(k) == 5 for k in shapes) and any(len(k) == 3 for k in shapes), dict(shapes)
    if cycle:
        assert {k[3:] for k in shapes if len(k) == 5} == {(2, 6), (4, 8), (8, 16)}
    check_pages_back(engine)


@pytest.mark.parametrize("cycle", [False, True], ids=["policy", "every-candidate"])
def test_per_request_trees_through_graphs_equal_plain_greedy(gpu_pair, prompts, reference, cycle,
                                                             monkeypatch) -> None:
    """Per-request trees (``per_request`` with trees (3,2,6), (5,4,8), (6,8,16)) through CUDA
    graphs: one graph per tree, bucket and verify rung captured at start-up (the ragged verify's
    T packed tokens, each row its own N_i best nodes); the rule's own shapes and every candidate
    in turn at every rung in turn; greedy output equals plain greedy, rounds ran through the
    graphs, trees ran (cycling: at fewer tokens than every row's whole tree), nothing was
    captured after start-up."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_tree_policy import TABLE_8B, goodput

    from adaptive_dist.cost_tables import load_model_costs
    from adaptive_dist.policy.tree import TreeBudgetRule

    if cycle:
        orig = TreeBudgetRule.decide

        def every(self, state, summed, n_sum, n_max, batch):
            new, dec = orig(self, state, summed, n_sum, n_max, batch)
            index = (state.index + 1) % (len(self.candidates) + len(self.trees))
            tokens = self.ladder[new.counted % len(self.ladder)]   # every rung in turn
            return type(new)(index=index, counted=new.counted, last_switch=new.counted,
                             tokens=tokens), dec
        monkeypatch.setattr(TreeBudgetRule, "decide", every)
    table, verify, _ = load_model_costs(str(TABLE_8B))
    cfg = goodput(table, verify, [[3, 2, 6], [5, 4, 8], [6, 8, 16]], per_request=True,
                  graph_buckets=(1, 2, 4))
    engine = engine_for(*gpu_pair, "ema", config=cfg, device="cuda", cuda_graphs=True)
    captured = engine.worker.graphs.num_captures
    out = engine.generate(prompts, lossless_params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    assert engine.stats.graph_rounds > 0
    assert engine.worker.graphs.num_captures == captured
    shapes = engine.planner.stats.rounds_at_shape
    trees = [k for k in shapes if len(k) == 5]
    assert trees, dict(shapes)
    if cycle:
        assert any(k[2] < k[1] * k[4] for k in trees), dict(shapes)
        assert {k[3:] for k in trees} == {(2, 6), (4, 8), (8, 16)}, dict(shapes)
    check_pages_back(engine)

