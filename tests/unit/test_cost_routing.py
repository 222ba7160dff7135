"""The start-up cost measurement routes like traffic (issue 36 §1): on random Qwen3-MoE and Qwen2-MoE
(shared expert) targets built with transformers' own classes and ``save_pretrained``, a
measurement round spreads over the experts as a round of as many real requests does (distinct
experts per MoE layer, `workers.model.moe.routed_experts`), where the all-dummy round it ran
before picked ``top_k`` experts per layer: at batch 8 over 8 experts (tiny pairs), and at batch 16
over 64 experts top 4 with 128 cached positions, the pool holding what retired requests left
(where rows that all read the same pages collapsed onto a few experts). The measurement itself
(eager on the CPU, so every forward is seen) routes so, writes KV only into its rows' own pages
(1 .. its sets' end, seeded content, zero again after) and leaves the slots as it found them."""
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


def _engine_config():
    from adaptive_dist.config import AdaptiveConfig
    return AdaptiveConfig(policy="goodput", candidate_steps=(0, 3), initial_steps=3,
                          round_cost={"0": 1.0, "3": 2.0})


def _engine(pair):
    """Tiers 0 and 3 (goodput, its table given: nothing measured at build), 8 rows, eager."""
    target, head = pair
    return engine_for(target, head, "ema", max_batch=BATCH, page_size=4,
                      config=_engine_config())


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


def _changed_pages(before: list[torch.Tensor], pools) -> tuple[set[int], set[int]]:
    """(pages >= 1 whose K or V differs from `before` in some layer of some pool, pages >= 1
    that are all zero in every layer of every pool)."""
    now = [t[1:] for pool in pools for t in pool.k + pool.v]
    changed, zero = set(), None
    for a, b in zip(before, now):
        diff = (a != b).flatten(1).any(1).nonzero().flatten() + 1
        changed.update(diff.tolist())
        z = set(((b == 0).flatten(1).all(1).nonzero().flatten() + 1).tolist())
        zero = z if zero is None else zero & z
    return changed, zero or set()


def test_the_measurement_routes_like_traffic_and_writes_kv_only_into_its_rows_pages(pair) -> None:
    from workers.worker.round_cost import TrafficRows
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
    # the rows' own pages: 8 sets of pages 1 .. (each row 10 cached positions and a chain's
    # growth), zero after; every other page as it was
    rows = TrafficRows(worker, 8, 10, max(8, worker.lag.catchup_every or 0))
    used = set(rows.used_pages)
    rows.restore()
    assert rows.sets == 8 and len(used) == 8 * rows.pages_per_row >= 8 * 3
    changed, zero = _changed_pages(kv, pools)
    assert changed == used and used <= zero, (sorted(changed), sorted(used))
    for before, now in zip(state, (slots.pages, slots.cache_len, slots.last_token, slots.feature)):
        assert torch.equal(before, now)
    assert (worker.buffers.rows == slots.dummy).all() and not worker.buffers.budget.any()
    kv = [t[1:].clone() for pool in pools for t in pool.k + pool.v]
    verify = worker.measure_verify_costs(repeats=1, context=10)
    assert sorted(verify) == list(worker.ladder)
    changed, zero = _changed_pages(kv, pools)
    assert changed <= zero and changed <= set(range(1, 1 + 8 * rows.pages_per_row))
    engine.close()


def test_the_rows_pages_are_their_own_and_fit_the_pool(pair) -> None:
    """Each row its own `pages_per_row` pages while the pool holds them, the rows' sets shared
    round-robin when it does not; `context` positions readable (filled) in each."""
    from workers.worker.round_cost import TrafficRows
    engine = _engine(pair)
    worker, slots = engine.worker, engine.worker.slots
    with TrafficRows(worker, BATCH, 9, chain=1) as rows:
        tables = rows.tables.tolist()
        per = rows.pages_per_row
        assert per == -(-(9 + rows.growth + 1) // slots.page_size) and rows.context == 9
        own = [t[:per] for t in tables]
        assert len({p for t in own for p in t}) == BATCH * per     # no page shared
        assert all(p == 0 for t in tables for p in t[per:])         # then the dummy page
        k = worker.models.target_kv.k[0]
        assert all(k[t[0]].abs().sum() > 0 for t in own)            # seeded content
        assert not torch.equal(k[own[0][0]], k[own[1][0]])
    assert not worker.models.target_kv.k[0][1:].any()
    engine.close()
    small = engine_for(pair[0], pair[1], "ema", max_batch=BATCH, page_size=4,
                       num_pages=1 + 3 * per + 1, config=_engine_config())
    with TrafficRows(small.worker, BATCH, 9, chain=1) as rows:   # 3 sets fit, rows share them
        assert rows.pages_per_row == per and rows.sets == 3 and rows.context == 9
        assert rows.tables[:, :per].tolist() == [tables[r % 3][:per] for r in range(BATCH)]
    small.close()


MID_BATCH, MID_CONTEXT = 16, 128


@pytest.fixture(scope="module")
def mid_pair(tmp_path_factory):
    """Qwen3-MoE, 64 experts top 4 in every one of 4 layers, hidden 64 (transformers-built)."""
    from hf_models import moe_pair
    root = moe_pair(tmp_path_factory.mktemp("mid"), 512, hidden=64, expert_width=32,
                    experts=64, top_k=4, layers=4, dense_layers=(), max_pos=512)
    target = load_llama(root / "target")
    return target, load_eagle(root / "eagle", target)


def test_at_64_experts_the_measurement_spreads_as_a_real_round_after_requests(mid_pair) -> None:
    """Batch 16 at depth 0: a round of 16 real requests of 64 .. 192 prompt tokens, then, the
    requests retired (their KV left in the pool, as after traffic), the measurement's rows
    reading 128 cached positions: distinct experts per layer within 10% of the requests' (rows
    that all read the same pages, the first ones of the requests' KV, routed about 29 per layer
    against the requests' 39: their attention outputs alike)."""
    from adaptive_dist.config import AdaptiveConfig
    from workers.sampling import SamplingParams
    target, head = mid_pair
    config = AdaptiveConfig(policy="goodput", candidate_steps=(0, 3), initial_steps=3,
                            round_cost={"0": 1.0, "3": 2.0})
    engine = engine_for(target, head, "ema", max_batch=MID_BATCH, page_size=16, config=config)
    worker = engine.worker
    engine.pool.apply(0)
    for ids in random_prompts(MID_BATCH, 512, seed=11, lo=MID_CONTEXT // 2, hi=MID_CONTEXT * 3 // 2):
        engine.add(ids, SamplingParams(max_new_tokens=16))
    admitted = engine.scheduler.admit()
    assert len(admitted) == MID_BATCH
    worker.prefill(admitted, sum(len(r.prompt_ids) for r in admitted), len(admitted))
    real = round_routing(worker, admitted, MID_BATCH)
    for req in admitted:
        engine.abort(req.rid)
    engine.scheduler.retire()
    engine.scheduler.allocator.check_empty()
    measured = measurement_routing(worker, MID_BATCH, MID_CONTEXT)
    assert len(measured) == len(real) == 4
    mean_m, mean_r = sum(measured) / 4, sum(real) / 4
    assert abs(mean_m - mean_r) <= 0.1 * mean_r, (measured, real)
    engine.close()
