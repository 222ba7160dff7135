"""MoE targets on the GPU: a transformers-built Qwen3-MoE with an EAGLE-3 head; CUDA-graph rounds
replay to eager at every depth (float64: the dense expert path; float32: the fused grouped GEMMs
of ``workers.moe_kernels``), a tier switch captures nothing, and the fused kernels equal the
sparse torch path at the shapes of a round and of a prefill."""
from __future__ import annotations

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


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from hf_models import moe_pair
    return moe_pair(tmp_path_factory.mktemp("moe_gpu"), VOCAB, hidden=64, expert_width=32,
                    max_pos=512)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 64 * 8, 3000])
def test_fused_moe_equals_the_sparse_path_on_the_gpu(moe_dir, dtype, rows: int) -> None:
    target = load_llama(moe_dir / "target", dtype=dtype, device="cuda")
    block = target.model.layers[0].ffn
    x = torch.randn(rows, 64, device="cuda").to(dtype)
    ids, weights = block.route(x)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(block.fused(x, ids, weights), block.sparse(x, ids, weights), **tol)
