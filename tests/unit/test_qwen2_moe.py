"""Qwen2-MoE targets against transformers: tiny random ``Qwen2MoeForCausalLM`` (q/k/v biases, a
gated shared expert beside the routed experts, sparse and ``mlp_only`` layers, top-k normalised
or not) built with transformers' own classes and ``save_pretrained``, as safetensors and as
``.bin`` with an older config layout; the engine's logits at every position and its greedy
``--no-spec`` tokens equal transformers'; greedy speculation with an EAGLE-3 head equals greedy
without it; the shared expert and its gate both matter (without either the logits are far from
transformers'); bad keys are refused by name. Multi-rank (``--dp 2`` in ``ep``, ``--tp 2`` in
``tp``): ``tests/multirank/test_moe_parallel.py``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adaptive_dist.config import AdaptiveConfig
from engine_fixtures import check_pages_back, engine_for, random_prompts
from model_fixtures import random_head, write_checkpoint
from workers.model import CheckpointError, DenseCausalAttention, load_eagle, load_llama
from workers.model.config import LlamaConfig

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)
VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
KINDS = {
    # layers 0 and 2 sparse, layer 1 dense (mlp_only_layers); top 2 of 4, renormalised
    "normed": dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, shared_expert_intermediate_size=24,
                   norm_topk_prob=True, mlp_only_layers=[1]),
    # every second layer sparse (decoder_sparse_step 2: layers 1, 3); top 3 of 6 as softmax gives
    "unnormed": dict(num_hidden_layers=4, num_experts=6, num_experts_per_tok=3,
                     moe_intermediate_size=8, shared_expert_intermediate_size=40,
                     norm_topk_prob=False, decoder_sparse_step=2),
}


def _hf_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(**COMMON, **KINDS[kind])).eval()
    with torch.no_grad():  # larger than the default init, so routing and logits spread
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.25)
    return model


def _old_layout(path: Path) -> None:
    """Rewrite a transformers-5 config.json as transformers 4 wrote Qwen2-MoE's: top-level
    rope_theta, no qkv_bias or layer_types, the default sliding_window kept (unused: the window is
    off)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    for key in ("qkv_bias", "layer_types"):
        cfg.pop(key)
    cfg.update(sliding_window=4096, use_sliding_window=False, max_window_layers=21)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Per kind: the model, and its directory with `new` (one safetensors file), `sharded`
    (safetensors shards and their index) and `old` (``pytorch_model.bin``, the older config)."""
    from hf_models import save_target
    out = {}
    for kind in KINDS:
        model = _hf_model(kind)
        root = tmp_path_factory.mktemp(kind)
        save_target(model, root / "new", "safetensors")
        model.save_pretrained(root / "sharded", max_shard_size="16KB")
        assert len(list((root / "sharded").glob("model-*-of-*.safetensors"))) > 3
        save_target(model, root / "old", "bin")
        _old_layout(root / "old")
        out[kind] = (model, root)
    return out


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), DenseCausalAttention([len(ids)])))


IDS = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", ["new", "sharded", "old"])
def test_logits_at_every_position_equal_transformers(saved, kind: str, layout: str) -> None:
    model, root = saved[kind]
    if layout == "old":
        assert (root / "old" / "pytorch_model.bin").is_file()
        assert not list((root / "old").glob("*.safetensors"))
    ours = load_llama(root / layout)
    spec = ours.config.moe
    assert spec.shared_expert_size == KINDS[kind]["shared_expert_intermediate_size"]
    assert spec.norm_topk_prob == KINDS[kind]["norm_topk_prob"] and ours.config.qkv_bias
    sparse = [i for i in range(ours.num_layers) if ours.config.is_sparse(i)]
    assert sparse == ([0, 2] if kind == "normed" else [1, 3])
    with torch.no_grad():
        ref = model(IDS[None]).logits[0]
    assert (ref - _logits(ours, IDS)).abs().max().item() < 1e-4


def test_the_shared_expert_and_its_gate_both_matter(saved) -> None:
    """Without the shared expert, or with its gate ignored (every token scaled by 1), the logits
    are far from transformers': the parity above would fail."""
    model, root = saved["normed"]
    with torch.no_grad():
        ref = model(IDS[None]).logits[0]
    ours = load_llama(root / "new")
    blocks = [layer.ffn for layer in ours.model.layers if hasattr(layer.ffn, "shared_expert")]
    assert len(blocks) == 2
    for block in blocks:   # the gate is not ~1 everywhere: it varies per token
        gate = torch.sigmoid(block.shared_expert_gate(torch.randn(50, 32)))
        assert gate.min() < 0.5 < gate.max()
    real = [block.shared for block in blocks]
    for name, fake in [("ungated", lambda b: lambda t: b.shared_expert.partial(t)),
                       ("dropped", lambda b: lambda t: torch.zeros_like(t))]:
        for block in blocks:
            block.shared = fake(block)
        assert (ref - _logits(ours, IDS)).abs().max().item() > 1e-2, name
    for block, fn in zip(blocks, real):
        block.shared = fn
    assert (ref - _logits(ours, IDS)).abs().max().item() < 1e-4


def test_the_dense_and_sparse_expert_paths_agree_with_a_shared_expert(saved) -> None:
    """The dense-weighted routed path (CUDA's eager path) against the sparse one; the shared
    expert is added the same way on both."""
    block = load_llama(saved["unnormed"][1] / "new").model.layers[1].ffn
    x = torch.randn(17, 32)
    ids, weights = block.route(x)
    assert ids.shape == (17, 3) and not torch.allclose(weights.sum(-1), torch.ones(17))
    torch.testing.assert_close(block.dense(x, ids, weights) + block.shared(x), block(x),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_no_spec_equals_transformers_generate(saved, kind: str) -> None:
    from hf_models import assert_greedy_equals_generate
    model, root = saved[kind]
    engine = engine_for(load_llama(root / "old"), None, "nospec")
    assert_greedy_equals_generate(engine, model, random_prompts(3, VOCAB, seed=5, lo=4, hi=12))


def test_greedy_speculation_with_an_eagle3_head_equals_no_speculation(saved, tmp_path: Path) -> None:
    from workers.sampling import SamplingParams
    target = load_llama(saved["normed"][1] / "new")
    write_checkpoint(random_head("eagle3", target, aux_layer_ids=(0, 1, 2)), tmp_path / "head")
    head = load_eagle(tmp_path / "head", target)
    prompts = random_prompts(4, VOCAB, seed=7, lo=2, hi=14)
    params = [SamplingParams(max_new_tokens=8 + 5 * (i % 3)) for i in range(4)]
    reference = [r.output_ids for r in engine_for(target, None, "nospec").generate(prompts, params)]
    for mode, steps, cfg in [("static", 1, None), ("static", 3, None), ("static", 7, None),
                             ("ema", 3, AdaptiveConfig(warmup_batches=1, update_interval=1))]:
        engine = engine_for(target, head, mode, steps=steps, config=cfg)
        assert [r.output_ids for r in engine.generate(prompts, params)] == reference, (mode, steps)
        check_pages_back(engine)


def _base() -> dict:
    return {"architectures": ["Qwen2MoeForCausalLM"],
            **{k: v for k, v in COMMON.items() if not k.endswith("token_id")},
            "num_hidden_layers": 2, "num_experts": 4, "moe_intermediate_size": 16,
            "num_experts_per_tok": 2, "shared_expert_intermediate_size": 24, "qkv_bias": True,
            "sliding_window": 0, "use_sliding_window": False, "max_window_layers": 28}


def test_bad_qwen2_moe_keys_are_refused_by_name() -> None:
    base = _base()
    spec = LlamaConfig.from_hf(base).moe
    assert (spec.shared_expert_size, spec.top_k, spec.norm_topk_prob) == (24, 2, False)
    no_top_k = {k: v for k, v in base.items() if k != "num_experts_per_tok"}
    assert LlamaConfig.from_hf(no_top_k).moe.top_k == 4           # transformers' Qwen2-MoE default
    with pytest.raises(ValueError, match="config key 'shared_expert_bias' is not understood"):
        LlamaConfig.from_hf({**base, "shared_expert_bias": True})
    with pytest.raises(ValueError, match="lacks the Qwen2-MoE key 'shared_expert_intermediate_size'"):
        LlamaConfig.from_hf({k: v for k, v in base.items() if k != "shared_expert_intermediate_size"})
    with pytest.raises(ValueError, match="'shared_expert_intermediate_size' is 0"):
        LlamaConfig.from_hf({**base, "shared_expert_intermediate_size": 0})
    with pytest.raises(ValueError, match="config key 'qkv_bias' is False; supported: true"):
        LlamaConfig.from_hf({**base, "qkv_bias": False})
    with pytest.raises(ValueError, match="config key 'use_sliding_window' is True"):
        LlamaConfig.from_hf({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="'layer_types' is .*sliding_attention"):
        LlamaConfig.from_hf({**base, "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match="'hidden_act' is 'gelu'"):
        LlamaConfig.from_hf({**base, "hidden_act": "gelu"})
    # the shared expert's width splits over the ranks in both modes
    odd = LlamaConfig.from_hf({**base, "shared_expert_intermediate_size": 25})
    for mode in ("tp", "ep"):
        with pytest.raises(ValueError, match="'shared_expert_intermediate_size' is 25; the shared "
                                             "expert's tensor parallelism over 2 ranks"):
            odd.check_tp(1, 2, moe_parallel=mode)
    # Qwen2-MoE's keys are not Qwen3-MoE's
    qwen3 = {k: v for k, v in base.items() if k not in ("shared_expert_intermediate_size", "qkv_bias")}
    qwen3["architectures"] = ["Qwen3MoeForCausalLM"]
    assert LlamaConfig.from_hf(qwen3).moe.shared_expert_size is None
    for key in ("shared_expert_intermediate_size", "qkv_bias"):
        with pytest.raises(ValueError, match=f"config key '{key}' is not understood"):
            LlamaConfig.from_hf({**qwen3, key: base[key]})
    assert LlamaConfig.from_hf(LlamaConfig.from_hf(base).to_hf()) == LlamaConfig.from_hf(base)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.shared_expert_gate.weight",
                                  "model.layers.2.mlp.shared_expert.down_proj.weight"])
def test_a_missing_shared_expert_tensor_is_named(saved, tmp_path: Path, name: str) -> None:
    _, root = saved["normed"]
    (tmp_path / "config.json").write_text((root / "new" / "config.json").read_text())
    tensors = load_file(root / "new" / "model.safetensors")
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=name.replace(".", "\\.")):
        load_llama(tmp_path)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rows", [1, 23])
def test_the_fused_kernels_forced_on_equal_transformers(saved, kind: str, rows: int,
                                                        monkeypatch) -> None:
    """Qwen2-MoE with every fused kernel forced on, in triton's interpreter: the router's and the
    shared expert gate's logits in one GEMM (`RouterRows`), the fused experts left unsummed, and
    each sparse layer's sum, gated shared expert, residual add and next norm in one launch
    (`moe_kernels.combine`: into the next layer's input norm, the last layer's into the final
    norm); logits within 1e-4 of transformers' (1 row: the pair path; 23: the grouped GEMMs)."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through triton's interpreter (on a GPU: tests/gpu/)")
    from workers import kernels, moe_kernels

    model, root = saved[kind]
    ours = load_llama(root / "new")
    blocks = [layer.ffn for layer in ours.model.layers if hasattr(layer.ffn, "shared_expert")]
    with torch.no_grad():   # (with gradients on: two GEMMs over the parameters)
        assert blocks and all(b.router.weight is not None for b in blocks)
        for block in blocks:   # the parameters are views of the one buffer the GEMM reads
            base = block.router.weight
            assert block.gate.weight.data_ptr() == base.data_ptr()
            assert block.shared_expert_gate.weight.data_ptr() == base[-1].data_ptr()
    ids = torch.randint(0, VOCAB, (rows,), generator=torch.Generator().manual_seed(rows))
    combined: list[bool] = []
    real = moe_kernels.combine

    def counted(pairs, shared=None, gate=None, x=None, *rest):  # noqa: ANN001, ANN202
        combined.append(shared is not None and x is not None)
        return real(pairs, shared, gate, x, *rest)
    monkeypatch.setattr(moe_kernels, "combine", counted)
    monkeypatch.setattr(kernels, "enabled", lambda x: True)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    got = _logits(ours, ids)
    assert combined == [True] * len(blocks)     # each with its shared expert, into a norm
    assert (ref - got).abs().max().item() < 1e-4
