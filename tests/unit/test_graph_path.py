"""The graph path on a CPU: the padded static forwards that CUDA graphs replay (captured bodies,
run without capture) give exactly the eager greedy outputs, batches that do not fit a bucket fall
back to eager, and every KV page comes back. The captured versions are in `tests/gpu/`."""
from __future__ import annotations

import pytest

from adaptive_dist.config import AdaptiveConfig
from engine_fixtures import check_pages_back, engine_config, engine_for, random_prompts, tiny_pair
from workers.engine import Engine
from workers.sampling import SamplingParams


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=8 + 7 * (i % 5)) for i in range(n)]


def _outputs(engine: Engine, prompts, params) -> list[list[int]]:
    return [r.output_ids for r in engine.generate(prompts, params)]


def _close_and_check_pages(engine: Engine) -> None:
    engine.close()
    check_pages_back(engine)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(10, vocab=64, seed=7)


@pytest.fixture(scope="module")
def reference(pair, prompts) -> list[list[int]]:
    return _outputs(engine_for(pair[0], None, "nospec"), prompts, _params(len(prompts)))


def test_capture_buckets_cover_the_max_batch() -> None:
    assert engine_config(max_batch=16, cuda_graphs=True).graph_buckets == (1, 2, 4, 8, 16)
    assert engine_config(max_batch=10, cuda_graphs=True).graph_buckets == (1, 2, 4, 8, 16)
    small = AdaptiveConfig(policy="static", graph_buckets=(1, 2, 4))
    assert engine_config("ema", config=small.replace(policy="ema"), max_batch=16,
                         cuda_graphs=True).graph_buckets == (1, 2, 4)
    assert engine_config(max_batch=16).graph_buckets == ()


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_static_graph_path_equals_eager(pair, prompts, reference, steps: int) -> None:
    engine = engine_for(*pair, "static", steps, cuda_graphs=True)
    assert _outputs(engine, prompts, _params(len(prompts))) == reference
    assert engine.stats.graph_rounds == engine.stats.rounds > 0
    hist = engine.stats.accept_histogram
    assert hist[0] > 0 and hist[steps] > 0, f"accept paths not all exercised: {hist}"
    _close_and_check_pages(engine)


def test_no_spec_graph_path_equals_eager(pair, prompts, reference) -> None:
    engine = engine_for(pair[0], None, "nospec", cuda_graphs=True)
    assert _outputs(engine, prompts, _params(len(prompts))) == reference
    assert engine.stats.graph_rounds == engine.stats.rounds > 0
    _close_and_check_pages(engine)


def test_graph_path_adaptive_with_switches_equals_eager(pair, prompts, reference) -> None:
    config = AdaptiveConfig(warmup_batches=1, update_interval=1, ema_alpha=0.6, initial_steps=7)
    engine = engine_for(*pair, "ema", config=config, cuda_graphs=True)
    assert _outputs(engine, prompts, _params(len(prompts))) == reference
    assert engine.stats.switches >= 1 and engine.stats.graph_rounds == engine.stats.rounds
    _close_and_check_pages(engine)


def test_batches_beyond_the_buckets_run_eager(pair, prompts, reference) -> None:
    """Buckets (1, 2) with up to 4 requests in flight: graph rounds once the batch has shrunk to
    two, eager rounds before; the same tokens either way."""
    config = AdaptiveConfig(graph_buckets=(1, 2), warmup_batches=1, update_interval=1)
    engine = engine_for(*pair, "ema", config=config, cuda_graphs=True)
    assert engine.worker.buckets == (1, 2)
    assert _outputs(engine, prompts, _params(len(prompts))) == reference
    assert 0 < engine.stats.graph_rounds < engine.stats.rounds
    _close_and_check_pages(engine)


def test_graph_bucket_without_graphs_is_an_error(pair) -> None:
    engine = engine_for(*pair, "static", 3)
    assert not engine.worker.can_use_graph([])
    with pytest.raises(RuntimeError, match="captured"):
        engine.worker.spec_round([], 4, graph_bucket=4)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_sampled_requests_on_the_graph_path_equal_eager(pair, prompts, overlap: bool) -> None:
    """Sampled (and mixed greedy/sampled) batches replay the device-sampling graphs of draft and
    verify and the one draft-extend graph; the tokens are the eager path's."""
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.8, top_p=0.9 if i % 2 else 1.0,
                             max_new_tokens=6 + 5 * (i % 4)) for i in range(len(prompts))]
    eager = _outputs(engine_for(*pair, "static", 3), prompts, params)
    engine = engine_for(*pair, "static", 3, cuda_graphs=True, overlap=overlap)
    assert _outputs(engine, prompts, params) == eager
    assert engine.stats.graph_rounds == engine.stats.rounds > 0
    _close_and_check_pages(engine)
