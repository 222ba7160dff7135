"""The graph path on a CPU: the padded static forwards that CUDA graphs replay
(`workers.cuda_graphs`, run without capture) give exactly the eager greedy outputs, batches that do
not fit a bucket fall back to eager, and every KV page comes back. The captured versions are in
`tests/gpu/`."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from adaptive_dist.config import AdaptiveConfig, load_config
from engine_fixtures import random_prompts, tiny_pair
from workers.attention import ForwardMode, build_metadata
from workers.attention.torch_backend import TorchBackend
from workers.cuda_graphs import capture_buckets
from workers.eagle_worker import WorkerConfig
from workers.engine import Engine, make_engine
from workers.kv_cache import KVCache
from workers.model import DenseCausalAttention
from workers.sampling import SamplingParams

CUDA = torch.cuda.is_available()
HAS_FLASHINFER = CUDA and importlib.util.find_spec("flashinfer") is not None
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="needs CUDA and flashinfer")
BUNDLED = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny_pair"


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=8 + 7 * (i % 5)) for i in range(n)]


def _engine(target, head, mode: str, steps: int = 3, *, graphs: bool = False,
            backend: str = "torch", device: str = "cpu", max_batch: int = 4,
            page_size: int = 4, config: AdaptiveConfig | None = None,
            max_context: int | None = None) -> Engine:
    wcfg = WorkerConfig(max_batch_size=max_batch, page_size=page_size,
                        max_context_len=max_context or target.config.max_position_embeddings)
    if mode == "nospec":
        return make_engine(target, None, adaptive_config=None, worker_config=wcfg,
                           backend=backend, device=device)
    cfg = config if mode == "ema" else load_config(None, "static", initial_steps=steps)
    return make_engine(target, head, adaptive_config=cfg, worker_config=wcfg,
                       backend=backend, device=device, cuda_graphs=graphs)


def _outputs(engine: Engine, prompts, params) -> list[list[int]]:
    return [r.output_ids for r in engine.generate(prompts, params)]


def _close_and_check_pages(engine: Engine) -> None:
    engine.close()
    engine.worker.target_cache.check_empty()
    if engine.worker.draft_cache is not None:
        engine.worker.draft_cache.check_empty()


# ---- everywhere: the padded static path the graphs capture ------------------------------------

@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(10, vocab=64, seed=7)


@pytest.fixture(scope="module")
def reference(pair, prompts) -> list[list[int]]:
    return _outputs(_engine(pair[0], None, "nospec"), prompts, _params(len(prompts)))


def test_capture_buckets_cover_the_max_batch() -> None:
    assert capture_buckets((1, 2, 4, 8, 16, 32, 64), 16) == (1, 2, 4, 8, 16)
    assert capture_buckets((1, 2, 4, 8, 16, 32, 64), 10) == (1, 2, 4, 8, 16)
    assert capture_buckets((1, 2, 4), 16) == (1, 2, 4)


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_static_graph_path_equals_eager(pair, prompts, reference, steps: int) -> None:
    engine = _engine(*pair, "static", steps, graphs=True)
    assert _outputs(engine, prompts, _params(len(prompts))) == reference
    assert engine.stats.graph_rounds == engine.stats.rounds > 0
    hist = engine.stats.accept_histogram
    assert hist[0] > 0 and hist[steps] > 0, f"accept paths not all exercised: {hist}"
    _close_and_check_pages(engine)


def test_graph_path_adaptive_with_switches_equals_eager(pair, prompts, reference) -> None:
    config = AdaptiveConfig(warmup_batches=1, update_interval=1, ema_alpha=0.6, initial_steps=7)
    engine = _engine(*pair, "ema", graphs=True, config=config)
    assert _outputs(engine, prompts, _params(len(prompts))) == reference
    assert engine.stats.switches >= 1 and engine.stats.graph_rounds == engine.stats.rounds
    _close_and_check_pages(engine)


def test_batches_beyond_the_buckets_or_the_reach_run_eager(pair, prompts, reference) -> None:
    """Buckets (1, 2) with up to 4 requests in flight: graph rounds once the batch has shrunk to
    two, eager rounds before; the same tokens either way."""
    config = AdaptiveConfig(graph_buckets=(1, 2), warmup_batches=1, update_interval=1)
    engine = _engine(*pair, "ema", graphs=True, config=config)
    assert engine.worker.graphs.buckets == (1, 2)
    assert _outputs(engine, prompts, _params(len(prompts))) == reference
    assert 0 < engine.stats.graph_rounds < engine.stats.rounds
    _close_and_check_pages(engine)


def test_graph_bucket_without_graphs_is_an_error(pair) -> None:
    engine = _engine(*pair, "static", 3)
    assert not engine.worker.can_use_graph([])
    with pytest.raises(RuntimeError, match="has none"):
        engine.worker.spec_round([], graph_bucket=4)


# ---- GPU: capture and replay ------------------------------------------------------------------

