"""The padded prefill (requests bucket x longest-prompt bucket, the round's padded attention, a CUDA
graph per shape on the graph path) must leave exactly what the ragged prefill leaves: the same
first tokens, cache lengths and last tokens, the same target and draft KV and head feature (to
rounding), hence the same outputs; its shapes follow the rule in `workers.worker.prefill`, and
a prefill beyond `padded_prefill_tokens` runs ragged."""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import engine_for, lossless_params, random_prompts, tiny_pair
from workers.config import EngineConfig
from workers.sampling import SamplingParams
from workers.worker.graph_table import GraphPhase
from workers.worker.prefill import PrefillRunner


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


def test_prefill_shape_rule(pair) -> None:
    worker = engine_for(*pair, "static", steps=3, max_batch=4).worker   # buckets 1, 2, 4
    assert worker.prefill_runner.shape(3, 20) == (4, 32)      # width: a power of two, at least 32
    assert worker.prefill_runner.shape(1, 33) == (1, 64)
    assert worker.prefill_runner.shape(2, 64) == (2, 64)
    assert worker.prefill_runner.shape(4, 1024) == (4, 1024)  # 4096 slots: the default limit
    assert worker.prefill_runner.shape(4, 1025) is None       # 8192 slots: ragged
    assert worker.prefill_runner.shape(5, 10) is None         # more requests than any bucket
    assert worker.prefill_runner.shape(2, 0) is None          # nothing to prefill
    off = engine_for(*pair, "static", steps=3, max_batch=4, padded_prefill_tokens=0).worker
    assert off.prefill_runner.shape(1, 8) is None
    graphs = engine_for(*pair, "static", steps=3, max_batch=4, cuda_graphs=True,
                        padded_prefill_tokens=256).worker
    # the shapes captured: every bucket, every width up to the limit and the context, each with
    # device sampling and greedy-only
    shapes = [(1, 32), (1, 64), (1, 128), (1, 256), (2, 32), (2, 64), (2, 128), (4, 32), (4, 64)]
    assert list(graphs.table.of(GraphPhase.PREFILL)) == [   # captured largest bucket first
        PrefillRunner.key(*s, g) for s in sorted(shapes, key=lambda s: (-s[0], s[1]))
        for g in (False, True)]


def test_padded_prefill_tokens_and_catchup_rounds_are_checked() -> None:
    with pytest.raises(ValueError, match="padded_prefill_tokens=-1: must be an integer >= 0"):
        EngineConfig(padded_prefill_tokens=-1)
    with pytest.raises(ValueError, match="catchup_rounds=0: must be an integer >= 1"):
        EngineConfig(catchup_rounds=0)


def _prefilled(pair, prompts, graphs: bool, **kw):
    """An engine after one prefill of `prompts` (not yet decoded): its worker and requests."""
    engine = engine_for(*pair, "static", steps=3, max_batch=4, cuda_graphs=graphs, **kw)
    reqs = [engine.add(p, SamplingParams(max_new_tokens=6), seed=i)
            for i, p in enumerate(prompts)]
    admitted = engine.scheduler.admit()
    assert admitted == reqs
    width = max(len(p) for p in prompts)
    engine.worker.prefill(admitted, sum(len(p) for p in prompts), len(prompts), width, graphs)
    return engine.worker, reqs


def _kv(pool, req, n: int) -> torch.Tensor:
    ps = pool.page_size
    flat = torch.tensor([req.pages[j // ps] * ps + j % ps for j in range(n)])
    return torch.stack([t.view(-1, *t.shape[2:])[flat] for t in pool.k + pool.v])


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_padded_prefill_leaves_what_the_ragged_one_leaves(pair, graphs) -> None:
    prompts = random_prompts(3, vocab=64, seed=5, lo=2, hi=40)
    ragged, reqs_r = _prefilled(pair, prompts, False, padded_prefill_tokens=0)
    padded, reqs_p = _prefilled(pair, prompts, graphs)
    assert padded.prefill_runner.shape(3, max(len(p) for p in prompts)) is not None
    for a, b, p in zip(reqs_r, reqs_p, prompts):
        n = len(p)
        assert int(padded.slots.cache_len[b.slot]) == int(ragged.slots.cache_len[a.slot]) == n
        assert int(padded.slots.last_token[b.slot]) == int(ragged.slots.last_token[a.slot])
        torch.testing.assert_close(padded.slots.feature[b.slot], ragged.slots.feature[a.slot])
        torch.testing.assert_close(_kv(padded.models.target_kv, b, n),
                                   _kv(ragged.models.target_kv, a, n))
        torch.testing.assert_close(_kv(padded.models.draft_kv, b, n),
                                   _kv(ragged.models.draft_kv, a, n))


@pytest.mark.parametrize("mode,graphs", [("nospec", False), ("static", False), ("static", True),
                                         ("ema", True)])
def test_outputs_equal_with_either_prefill(pair, mode, graphs) -> None:
    """Greedy and sampled requests arriving over several rounds (prefills of 1..4 requests of
    varied lengths): the same tokens with the padded prefill as with the ragged one."""
    prompts = random_prompts(7, vocab=64, seed=9, lo=1, hi=60)
    params = lossless_params(len(prompts))
    outs = []
    for cap in (0, 4096):
        engine = engine_for(*pair, mode, steps=3, max_batch=4, cuda_graphs=graphs,
                            padded_prefill_tokens=cap)
        outs.append([r.output_ids for r in engine.generate(prompts, params, seed=1)])
    assert outs[0] == outs[1]


def test_prefill_beyond_the_limit_runs_ragged(pair) -> None:
    prompts = random_prompts(4, vocab=64, seed=3, lo=40, hi=70)   # 4 x 128 slots > 256
    worker = engine_for(*pair, "static", steps=3, max_batch=4, padded_prefill_tokens=256).worker
    assert worker.prefill_runner.shape(4, 70) is None and worker.prefill_runner.shape(
        2, 70) == (2, 128)
    outs = []
    for cap in (0, 256):
        engine = engine_for(*pair, "static", steps=3, max_batch=4, padded_prefill_tokens=cap)
        outs.append([r.output_ids for r in engine.generate(
            prompts, SamplingParams(max_new_tokens=10))])
    assert outs[0] == outs[1]
