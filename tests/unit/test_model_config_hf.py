"""The config readers are total: every key of a ``config.json`` (and of its nested RoPE and
``eagle_config`` dicts) is parsed, listed as irrelevant to the forward, or refused by name; both
RoPE layouts (transformers 5's ``rope_parameters``, the older ``rope_theta`` + ``rope_scaling``)
read to the same model; the EAGLE-3 fields that change the math are honoured or refused.

The comparisons with transformers' own models are in ``test_hf_parity.py``; these are the reader's
rules, checked on dicts and on checkpoints written here."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_fixtures import random_head, random_target, swap_config, target_config, write_checkpoint
from workers.model import DenseCausalAttention, load_eagle, load_llama
from workers.model.config import (
    IRRELEVANT_KEYS,
    Eagle3Config,
    LinearRopeScaling,
    LlamaConfig,
    RopeScaling,
    YarnRopeScaling,
)
from workers.model.layers import RotaryEmbedding, rope_inv_freq

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_both_rope_layouts_read_the_same_settings() -> None:
    # the defect: transformers 5's layout was ignored (theta 10000, no scaling), silently
    new = LlamaConfig.from_hf({**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}})
    old = LlamaConfig.from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": LLAMA3})
    assert new == old
    assert new.rope_theta == 500000.0 and new.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    plain = LlamaConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
    # the legacy spelling `type` and a theta given in both places, equal
    legacy = LlamaConfig.from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": {
        **{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"},
        "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}})
    assert legacy == new


def test_linear_and_yarn_are_read_and_scale_the_frequencies() -> None:
    lin = LlamaConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "linear", "factor": 4.0}})
    assert lin.rope_scaling == LinearRopeScaling(4.0)
    torch.testing.assert_close(rope_inv_freq(8, 10000.0, lin.rope_scaling),
                               rope_inv_freq(8, 10000.0, None) / 4)
    yarn = LlamaConfig.from_hf({**BASE, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}})
    s = yarn.rope_scaling
    assert isinstance(s, YarnRopeScaling) and s.factor == 4.0 and s.beta_fast == 32.0
    assert s.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    # no factor: max_position_embeddings / original; mscale pair: their ratio
    derived = LlamaConfig.from_hf({**BASE, "rope_scaling": {
        "rope_type": "yarn", "original_max_position_embeddings": 1024, "mscale": 1.0,
        "mscale_all_dim": 1.0}}).rope_scaling
    assert derived.factor == 4.0 and derived.attention_factor == pytest.approx(1.0)
    plain, scaled = rope_inv_freq(8, 10000.0, None), rope_inv_freq(8, 10000.0, s)
    assert scaled[0] == plain[0] and scaled[-1] == pytest.approx(plain[-1] / 4)  # fast kept, slow /4
    cos, sin = RotaryEmbedding(8, 10000.0, s)(torch.tensor([0]))
    assert cos[0, 0].item() == pytest.approx(s.attention_factor) and sin.abs().max() == 0


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "'rope_parameters.rope_type' is 'dynamic': it rescales"),
    ({"rope_type": "longrope", "factor": 2.0}, "'rope_parameters.rope_type' is 'longrope'"),
    ({"rope_type": "nope"}, "'rope_parameters.rope_type' is 'nope'; supported: \\['default', 'linear'"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3},
     "'rope_parameters.beta_fast' is not understood for rope_type 'linear'"),
    ({"rope_type": "linear"}, "'rope_parameters.factor' is missing"),
    ({"rope_type": "linear", "factor": -1.0}, "'rope_parameters.factor' is -1.0"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5},
     "'rope_parameters.partial_rotary_factor' is 0.5; supported: 1.0"),
    ({"full_attention": {"rope_type": "default"}}, "gives RoPE per layer type"),
    ({**LLAMA3, "high_freq_factor": 1.0}, "'rope_parameters.high_freq_factor' is 1.0"),
])
def test_rope_settings_not_computed_are_refused_by_name(rope, match) -> None:
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf({**BASE, "rope_parameters": rope})


def test_rope_given_twice_differently_is_refused() -> None:
    with pytest.raises(ValueError, match="RoPE theta twice, differently"):
        LlamaConfig.from_hf({**BASE, "rope_theta": 10000.0, "rope_parameters": {"rope_theta": 5e5}})
    with pytest.raises(ValueError, match="'rope_parameters' and 'rope_scaling' describe different"):
        LlamaConfig.from_hf({**BASE, "rope_scaling": LLAMA3,
                             "rope_parameters": {"rope_type": "linear", "factor": 2.0}})


def test_every_key_is_understood_listed_or_refused() -> None:
    # what transformers writes beside the model's dimensions, in old and new versions
    accepted = {**BASE, **{k: None for k in IRRELEVANT_KEYS}, "layer_types": ["full_attention"] * 2,
                "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
    LlamaConfig.from_hf(accepted)
    for key, value in (("quantization_config", {"quant_method": "fp8"}), ("attn_logit_softcapping", 50.0),
                       ("use_mrope", True), ("num_experts", 8)):
        with pytest.raises(ValueError, match=f"config key '{key}' is not understood by this "
                                             f"implementation of the target LlamaForCausalLM"):
            LlamaConfig.from_hf({**BASE, key: value})
    with pytest.raises(ValueError, match="'layer_types' is \\['full_attention', 'sliding_attention'\\]"):
        LlamaConfig.from_hf({**BASE, "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(ValueError, match="'partial_rotary_factor' is 0.5"):
        LlamaConfig.from_hf({**BASE, "partial_rotary_factor": 0.5})


# ---- EAGLE-3 heads ----------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path: Path) -> Path:
    target = random_target(target_config("llama", layers=6))
    write_checkpoint(target, tmp_path / "t")
    write_checkpoint(random_head("eagle3", target, aux_layer_ids=(0, 2, 4)), tmp_path / "e3")
    write_checkpoint(random_head("eagle", target), tmp_path / "e1")
    return tmp_path


@pytest.mark.parametrize("which,changes,match", [
    ("e3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4],
                             "use_aux_hidden_state": False}},
     "e3/config.json': config key 'eagle_config.use_aux_hidden_state' is False; supported: true"),
    ("e3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], "extra": 1}},
     "config key 'eagle_config.extra' is not understood"),
    ("e3", {"eagle_aux_hidden_state_layer_ids": [0, 1, 4]},
     "'eagle_aux_hidden_state_layer_ids' \\(\\[0, 1, 4\\]\\) and 'eagle_config.eagle_aux_hidden_"
     "state_layer_ids' \\(\\[0, 2, 4\\]\\) differ"),
    ("e3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 2]}}, "three distinct"),
    ("e3", {"draft_hidden_act": "gelu"}, "e3/config.json': config key 'draft_hidden_act' is not "
                                         "understood by this implementation of an EAGLE-3 head"),
    ("e1", {"some_head_setting": 1}, "e1/config.json': config key 'some_head_setting' is not "
                                     "understood by this implementation of an EAGLE head"),
    ("t", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "t/config.json': config key 'rope_parameters.rope_type' is 'dynamic'"),
])
def test_head_refusals_name_the_file_and_key(saved: Path, which: str, changes, match) -> None:
    swap_config(saved / which, **changes)
    with pytest.raises(ValueError, match=match):
        load_eagle(saved / which, load_llama(saved / "t"))


def _features(target_dir: Path, head_dir: Path) -> torch.Tensor:
    target = load_llama(target_dir)
    load_eagle(head_dir, target)
    with torch.no_grad():
        return target(torch.arange(9), torch.arange(9), DenseCausalAttention([9]))


def test_aux_layers_are_fused_in_layer_order_and_read_from_the_top_level(saved: Path) -> None:
    ref = _features(saved / "t", saved / "e3")                   # ids [0, 2, 4]
    swap_config(saved / "e3", eagle_config={"eagle_aux_hidden_state_layer_ids": [4, 0, 2]})
    # listed out of order, the states are still concatenated in layer order (as SGLang captures
    # them): the head trained on [0, 2, 4] sees the same input
    torch.testing.assert_close(_features(saved / "t", saved / "e3"), ref, rtol=0, atol=0)
    swap_config(saved / "e3", eagle_config=None, eagle_aux_hidden_state_layer_ids=[2, 4, 0])
    torch.testing.assert_close(_features(saved / "t", saved / "e3"), ref, rtol=0, atol=0)
    swap_config(saved / "e3", eagle_aux_hidden_state_layer_ids=[0, 2, 3])
    assert (_features(saved / "t", saved / "e3") - ref).abs().max() > 1e-3   # the key is read


def test_norm_before_residual_takes_the_normed_hidden_state_as_residual() -> None:
    target = random_target(target_config("llama", layers=6))
    for flag in (False, True):
        cfg = Eagle3Config.from_hf({**Eagle3Config.for_target(target.config, 64).to_hf(),
                                    "norm_before_residual": flag})
        assert cfg.norm_before_residual is flag
        head = random_head("eagle3", target)
        head.midlayer.norm_before_residual = cfg.norm_before_residual
        with torch.no_grad():  # attention and MLP outputs zeroed: the layer returns its residual
            head.midlayer.self_attn.o_proj.weight.zero_()
            head.midlayer.mlp.down_proj.weight.zero_()
            emb, hidden = torch.randn(5, 64), torch.randn(5, 64) * 3
            out = head.midlayer(emb, hidden, *head.rotary(torch.arange(5)),
                                DenseCausalAttention([5]))
        expected = head.midlayer.hidden_norm(hidden) if flag else hidden
        torch.testing.assert_close(out, expected)
