"""The cost model's measurements on a CUDA GPU (issues 32 and 34): the context, prefill and
catch-up terms measured through the engine's CUDA graphs (every padded prefill shape and every
catch-up bucket replays its captured graph), with positive times, and the engine generating
afterwards exactly what plain greedy decoding generates (the measurement leaves the slots, the
static prefill inputs and the dummy slot as it found them). Skipped without CUDA.

    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cost_model_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import (engine_for, lossless_params, per_request_config, random_prompts,
                             tiny_pair)

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


def test_the_terms_measure_through_the_graphs_and_leave_the_engine_as_it_was() -> None:
    from adaptive_dist.cost_tables import ContextTerm, fit_prefill
    from workers.worker.round_cost import (measure_prefills, measure_target_contexts,
                                           prefill_shapes)

    target, head = tiny_pair(seed=0)
    target, head = target.to("cuda"), head.to("cuda")
    prompts = random_prompts(6, vocab=64, seed=7)
    plain = engine_for(target, None, "nospec", device="cuda")
    reference = [r.output_ids for r in plain.generate(prompts, lossless_params(len(prompts)))]
    plain.close()
    engine = engine_for(target, head, "ema", config=per_request_config(top_tokens=64),
                        device="cuda", cuda_graphs=True, max_batch=4, overlap=True)
    worker = engine.worker
    runner = worker.prefill_runner
    shapes = prefill_shapes(worker, [2 * runner.cap])
    assert all(runner.table.get(runner.key(r, w, True)) is not None for r, w in shapes if r)
    at = measure_target_contexts(worker, worker.ladder, [0, 128, 400], repeats=2)
    assert list(at)[0] == 0 and len(at) == 3
    term = ContextTerm.parse({str(c): {str(t): v for t, v in row.items()}
                              for c, row in at.items()})
    assert all(c > 0 for row in term.costs for c in row)
    samples = measure_prefills(worker, repeats=2, ragged=[2 * runner.cap])
    assert [(s.rows, s.width) for s in samples] == shapes
    fitted = fit_prefill([(s.slots, s.positions, s.seconds) for s in samples])
    assert fitted.slots[-1] == 2 * runner.cap and all(c > 0 for c in fitted.costs)
    out = [r.output_ids for r in engine.generate(prompts, lossless_params(len(prompts)))]
    assert out == reference
    engine.close()


def test_the_catchup_term_measures_through_its_graphs_and_leaves_the_engine_as_it_was() -> None:
    """The catch-up term (cost model version 2) on the tiny pair held at depth 0 with CUDA
    graphs: one catch-up per captured bucket replayed at three contexts, positive times, and
    the engine generating afterwards what plain greedy decoding generates."""
    from adaptive_dist.cost_tables import CatchupTerm
    from scripts.bench.common import held_at_zero
    from workers.worker.graph_table import GraphPhase
    from workers.worker.round_cost import measure_catchups

    target, head = tiny_pair(seed=0)
    target, head = target.to("cuda"), head.to("cuda")
    prompts = random_prompts(6, vocab=64, seed=7)
    plain = engine_for(target, None, "nospec", device="cuda")
    reference = [r.output_ids for r in plain.generate(prompts, lossless_params(len(prompts)))]
    plain.close()
    engine = engine_for(target, head, "ema", config=held_at_zero(1), device="cuda",
                        cuda_graphs=True, max_batch=4, overlap=True, catchup_rounds=8)
    worker = engine.worker
    assert worker.lag.built and len(worker.table.of(GraphPhase.CATCHUP)) == len(worker.buckets)
    at = measure_catchups(worker, engine.pool, worker.buckets, [0, 64, 200], graphs=True,
                          repeats=2)
    engine.pool.apply(engine.config.spec.initial_steps)
    assert list(at) == [8, 64, 200]
    term = CatchupTerm.parse({str(c): {str(b): 1e3 * v for b, v in row.items()}
                              for c, row in at.items()}, 8)
    assert term.buckets == tuple(worker.buckets) and all(c > 0 for r in term.costs for c in r)
    out = [r.output_ids for r in engine.generate(prompts, lossless_params(len(prompts)))]
    assert out == reference
    engine.close()
