"""The engine on real checkpoint layouts (one process): greedy speculative output equals greedy
output without speculation, token for token, for Llama-3 / Llama / Qwen2 / Qwen3 targets with
EAGLE (the EAGLE project's layout, ours) and EAGLE-3 heads, at every tier and adaptive (the ema
and the goodput policies); EAGLE-3 acceptance follows its vocabulary map; speculative sampling
with an EAGLE-3 head (draft distribution mapped into target ids) keeps the target's
distribution."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaptive_dist.config import AdaptiveConfig
from engine_fixtures import check_pages_back, engine_for, random_prompts
from model_fixtures import (
    ARCHS,
    FORMATS,
    bigram_map,
    draft_vocab,
    mixed_eps,
    oracle_head,
    oracle_target,
    random_head,
    random_target,
    target_config,
    write_checkpoint,
)
from workers.model import load_eagle, load_llama
from workers.sampling import SamplingParams

torch.set_num_threads(1)
S = draft_vocab(64, 32)
PAIRS = [(a, k) for a in ARCHS for k in ("eagle", "eagle3")] + [("llama", "own")]
MODES = [("static", 1, None), ("static", 3, None), ("static", 7, None),
         ("ema", 3, AdaptiveConfig(warmup_batches=1, update_interval=1)),
         # goodput: round costs measured at start-up; its depth-0 tier still runs draft-extend
         ("ema", 1, AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3, 7), initial_steps=1,
                                   warmup_batches=1, update_interval=1, probe_every=2))]
STOP = 13


def oracle_pair(arch: str, kind: str, eps: float, root: Path, fmt: str = "safetensors"):
    """An oracle pair (``model_fixtures``) written as checkpoints and loaded back (float64)."""
    cfg = target_config(arch)
    f = bigram_map(64, S, identity=cfg.tie_word_embeddings)
    target = oracle_target(cfg, f, eps)
    write_checkpoint(target, root / "target", fmt, dtype=torch.float64)
    write_checkpoint(oracle_head(kind, target, f, S), root / "draft", fmt, dtype=torch.float64)
    loaded = load_llama(root / "target", dtype=torch.float64)
    return loaded, load_eagle(root / "draft", loaded)


@pytest.mark.parametrize("arch,kind", PAIRS)
def test_greedy_speculation_equals_no_speculation(tmp_path: Path, arch: str, kind: str) -> None:
    target, head = oracle_pair(arch, kind, mixed_eps(arch, kind), tmp_path,
                               FORMATS[PAIRS.index((arch, kind)) % 4])
    prompts = random_prompts(6, 64, seed=11, lo=1, hi=20)
    params = [SamplingParams(max_new_tokens=10 + 7 * (i % 3),
                             stop_token_ids=(STOP,) if i % 2 else ()) for i in range(6)]
    reference = [r.output_ids for r in engine_for(target, None, "nospec").generate(prompts, params)]
    hist: dict[int, int] = {}
    for mode, steps, cfg in MODES:
        engine = engine_for(target, head, mode, steps=steps, config=cfg)
        got = [r.output_ids for r in engine.generate(prompts, params)]
        assert got == reference, f"{arch}/{kind}, {mode} {steps}"
        check_pages_back(engine)
        for k, v in engine.stats.accept_histogram.items():
            hist[k] = hist.get(k, 0) + v
    assert hist.get(0, 0) > 0 and sum(v for k, v in hist.items() if k >= 3) > 0, hist


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_eagle3_graph_path_equals_no_speculation(tmp_path: Path, arch: str) -> None:
    """The bodies CUDA graphs capture (on a CPU run uncaptured, at the bucket's padded shapes):
    the draft loop through the head's d2t map, verify over the target's wide features, draft-extend
    — greedy output equal to no speculation at a static depth, adaptive and under goodput."""
    target, head = oracle_pair(arch, "eagle3", mixed_eps(arch, "eagle3"), tmp_path)
    prompts = random_prompts(6, 64, seed=12, lo=1, hi=20)
    params = [SamplingParams(max_new_tokens=9 + 6 * (i % 3)) for i in range(6)]
    reference = [r.output_ids for r in engine_for(target, None, "nospec").generate(prompts, params)]
    for mode, steps, cfg in MODES[1:]:
        engine = engine_for(target, head, mode, steps=steps, config=cfg, cuda_graphs=True)
        assert [r.output_ids for r in engine.generate(prompts, params)] == reference, (mode, steps)
        assert engine.stats.graph_rounds == engine.stats.rounds > 0
        engine.close()
        check_pages_back(engine)


@pytest.mark.parametrize("right", [True, False])
def test_eagle3_acceptance_follows_the_vocabulary_map(tmp_path: Path, right: bool) -> None:
    """The oracle head at eps 0: with the right d2t every draft is accepted, with d2t shifted by
    one draft row none is (and the output is the same: verification is against the target)."""
    target, head = oracle_pair("qwen2", "eagle3", 0.0, tmp_path)
    if not right:
        head.set_vocab_map(torch.tensor(S[1:] + S[:1]) - torch.arange(32))
    prompts = random_prompts(4, 64, seed=5, lo=2, hi=9)
    params = SamplingParams(max_new_tokens=16)
    reference = [r.output_ids for r in engine_for(target, None, "nospec").generate(prompts, params)]
    engine = engine_for(target, head, "static", steps=3)
    assert [r.output_ids for r in engine.generate(prompts, params)] == reference
    hist = engine.stats.accept_histogram
    if right:
        assert set(hist) == {3} or (hist.get(0, 0) == 0 and engine.stats.mean_accept_length > 2.5), hist
    else:
        assert set(hist) == {0}, hist


def test_eagle3_speculative_sampling_keeps_the_target_distribution() -> None:
    """Draft distributions live on a draft vocabulary of 4 of the 6 target ids; mapped into
    target ids (zero elsewhere), rejection sampling still yields the target's joint law."""
    from sampling_reference import VOCAB, check_keeps_target_law

    cfg = target_config("qwen3", vocab=VOCAB, hidden=32)
    target = random_target(cfg, seed=2).double()
    head = random_head("eagle3", target, [0, 2, 3, 5], seed=4)
    engine = engine_for(target, head, "static", steps=3, max_batch=64)
    check_keeps_target_law(engine, target)


def test_worker_refuses_a_head_of_another_feature_width() -> None:
    """An EAGLE-3 head widens its target's features; an EAGLE head on that target is refused."""
    target = random_target(target_config("llama"), seed=1)
    random_head("eagle3", target, S)                   # attaches its feature tap
    with pytest.raises(ValueError, match="reads 64-wide features, the target gives 128"):
        engine_for(target, random_head("eagle", target), "static")
