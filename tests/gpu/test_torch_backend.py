"""The torch attention backend on a GPU (eager): lossless at every tier, sampling runs."""
from __future__ import annotations


from adaptive_dist.config import AdaptiveConfig
from engine_fixtures import check_pages_back, engine_for, lossless_params, random_prompts, tiny_pair
from workers.sampling import SamplingParams


def test_torch_backend_on_gpu_is_lossless_and_matches_cpu() -> None:
    prompts = random_prompts(16, vocab=64, seed=7)
    reference = [r.output_ids for r in engine_for(tiny_pair(seed=0)[0], None, "nospec")
                 .generate(prompts, lossless_params(len(prompts)))]
    target, head = (m.to("cuda") for m in tiny_pair(seed=0))
    plain = engine_for(target, None, "nospec", device="cuda").generate(prompts, lossless_params(len(prompts)))
    assert [r.output_ids for r in plain] == reference
    for steps in (1, 3, 7):
        engine = engine_for(target, head, "static", steps=steps, device="cuda")
        out = engine.generate(prompts, lossless_params(len(prompts)))
        assert [r.output_ids for r in out] == reference, f"steps={steps}"
        assert engine.worker.models.target_kv.k[0].is_cuda
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=20)
    engine = engine_for(target, head, "ema", config=AdaptiveConfig(warmup_batches=1, update_interval=1),
                        device="cuda")
    assert all(len(r.output_ids) == 20 for r in engine.generate(prompts, sampled, seed=1))
    check_pages_back(engine)
