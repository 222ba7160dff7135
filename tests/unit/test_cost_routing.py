"""The start-up cost measurement routes like traffic (issue 36 §1): on tiny random Qwen3-MoE and
Qwen2-MoE (shared expert) targets built with transformers' own classes and ``save_pretrained``,
a measurement round at batch 8 spreads over the experts as a round of 8 real requests does
(distinct experts per MoE layer, `workers.model.moe.routed_experts`), where the all-dummy round
it ran before picked ``top_k`` experts per layer; the measurement itself (eager on the CPU, so
every forward is seen) routes so, writes no KV outside the dummy page and leaves the slots as
it found them."""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import engine_for, random_prompts
from workers.model import load_eagle, load_llama
from workers.model.moe import routed_experts
from workers.worker.round_cost import measurement_routing, round_routing

pytest.importorskip("transformers")
torch.set_num_threads(1)
VOCAB, BATCH, TOP_K, SPARSE_LAYERS = 96, 8, 2, 3   # moe_pair: 8 experts, top 2, layer 2 dense


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def pair(request, tmp_path_factory):
    from hf_models import moe_pair
    shared = 24 if request.param == "qwen2_moe" else None
    root = moe_pair(tmp_path_factory.mktemp(request.param), VOCAB, shared_expert_width=shared)
    target = load_llama(root / "target")
    assert (target.config.moe.shared_expert_size is not None) == (shared is not None)
    return target, load_eagle(root / "eagle", target)


def _real_round(engine, steps: int) -> list[int]:
    """Distinct experts per layer of one round over BATCH admitted, prefilled requests."""
    from workers.sampling import SamplingParams
    for ids in random_prompts(BATCH, VOCAB, seed=11, lo=3, hi=20):
        engine.add(ids, SamplingParams(max_new_tokens=16))
    admitted = engine.scheduler.admit()
    assert len(admitted) == BATCH
    engine.worker.prefill(admitted, sum(len(r.prompt_ids) for r in admitted), len(admitted))
    engine.pool.apply(steps)
    return round_routing(engine.worker, admitted, BATCH)


def _engine(pair):
    """Tiers 0 and 3 (goodput, its table given: nothing measured at build), 8 rows, eager."""
    from adaptive_dist.config import AdaptiveConfig
    target, head = pair
    config = AdaptiveConfig(policy="goodput", candidate_steps=(0, 3), initial_steps=3,
                            round_cost={"0": 1.0, "3": 2.0})
    return engine_for(target, head, "ema", max_batch=BATCH, page_size=4, config=config)


@pytest.mark.parametrize("steps", [0, 3])
def test_a_measurement_round_spreads_over_the_experts_as_real_requests_do(pair, steps) -> None:
    engine = _engine(pair)
    worker = engine.worker
    engine.pool.apply(steps)
    dummy = measurement_routing(worker, BATCH, dummy=True)
    measured = measurement_routing(worker, BATCH, context=9)
    real = _real_round(engine, steps)
    assert dummy == [TOP_K] * SPARSE_LAYERS, dummy    # every dummy row: the same inputs
    assert len(measured) == len(real) == SPARSE_LAYERS
    assert min(real) >= 6 and min(measured) >= 6, (measured, real)
    assert abs(sum(measured) - sum(real)) <= SPARSE_LAYERS * 1.5, (measured, real)
    engine.close()


def test_the_measurement_routes_like_traffic_and_writes_no_kv_outside_the_dummy_page(pair) -> None:
    target, _ = pair
    engine = _engine(pair)
    worker = engine.worker
    slots = worker.slots
    pools = [worker.models.target_kv, worker.models.draft_kv]
    for pool in pools:   # something to keep in every page but the dummy one
        for t in pool.k + pool.v:
            t[1:].normal_()
    kv = [t[1:].clone() for pool in pools for t in pool.k + pool.v]
    state = [t.clone() for t in (slots.pages, slots.cache_len, slots.last_token, slots.feature)]
    with routed_experts(target) as seen:
        table = engine.measure_round_costs(repeats=1, context=10)
    assert sorted(table) == [1, 2, 4, 8] and all(sorted(row) == [0, 3] for row in table.values())
    # its rounds of 1 .. 8 rows (up to 32 verify tokens) touch every expert in each layer
    assert seen.counts() == [8] * SPARSE_LAYERS, seen.counts()
    assert all(torch.equal(a, t[1:]) for a, t in
               zip(kv, [t for pool in pools for t in pool.k + pool.v])), "KV written outside page 0"
    for before, now in zip(state, (slots.pages, slots.cache_len, slots.last_token, slots.feature)):
        assert torch.equal(before, now)
    assert (worker.buffers.rows == slots.dummy).all() and not worker.buffers.budget.any()
    verify = worker.measure_verify_costs(repeats=1, context=10)
    assert sorted(verify) == list(worker.ladder)
    assert all(torch.equal(a, t[1:]) for a, t in
               zip(kv, [t for pool in pools for t in pool.k + pool.v]))
    engine.close()
