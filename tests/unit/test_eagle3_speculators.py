"""EAGLE-3 heads in the speculators library's layout (as vLLM reads it): a head saved in that
layout and in SGLang's gives the same drafts; the nested ``transformer_layer_config`` is read as
transformers reads it (its defaults for absent keys); the aux layer ids count from the embedding;
every key is read or refused by name (issue 34 §3)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_fixtures import chain_drafts, random_head, random_target, swap_config, target_config
from workers.model import (
    CheckpointError,
    DenseCausalAttention,
    Eagle3Head,
    load_eagle,
    save_pretrained,
)
from workers.model.config import Eagle3Config
from workers.model.config_speculators import LLAMA_DEFAULTS, eagle3_from_speculators

S = list(range(1, 64, 2))       # the draft vocabulary: 32 odd target ids


def _target(layers: int = 4):
    """A fresh target each time: loading a head attaches its capture to the target."""
    return random_target(target_config("llama", layers=layers), seed=3)


def _head(target, **overrides):
    """A random EAGLE-3 head over `S` for `target`, with these config fields changed."""
    head = random_head("eagle3", target, S, aux_layer_ids=overrides.pop("aux_layer_ids", None))
    if not overrides:
        return head
    other = Eagle3Head(dataclasses.replace(head.config, **overrides), target)
    params, gen = dict(head.named_parameters()), torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in other.named_parameters():
            p.copy_(params[name] if name in params else torch.randn(p.shape, generator=gen))
        other.set_vocab_map(head.d2t.clone())
    return other.eval()


@torch.no_grad()
def _logits(target, head, tokens: list[int]) -> torch.Tensor:
    """The head's logits over target ids at every position after one draft-extend pass."""
    ids, n = torch.tensor(tokens), len(tokens) - 1
    feats = target(ids[:-1], torch.arange(n), DenseCausalAttention([n]))
    out = head(ids[1:], feats, torch.arange(1, n + 1), DenseCausalAttention([n]))
    return head.compute_logits(out)


@pytest.mark.parametrize("settings", [
    {},
    {"aux_layer_ids": (0, 1, 3), "norm_before_residual": True},
    {"aux_layer_ids": (-1, 2, 3), "fc_bias": True, "own_embedding": True},
], ids=["defaults", "ids-norm-before-residual", "embedding-id-fc-bias-own-embedding"])
def test_a_head_saved_in_both_layouts_gives_the_same_drafts(tmp_path: Path, settings) -> None:
    head = _head(_target(), **settings)
    save_pretrained(head, tmp_path / "sglang", dtype=torch.float32)
    save_pretrained(head, tmp_path / "speculators", dtype=torch.float32, layout="speculators")
    written = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert written["speculators_model_type"] == "eagle3" and "eagle_config" not in written
    assert written["architectures"] == ["Eagle3Speculator"]
    tensors = load_file(tmp_path / "speculators" / "model.safetensors")
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any(
        k.startswith("midlayer.") for k in tensors)

    target_a, target_b = _target(), _target()
    a = load_eagle(tmp_path / "sglang", target_a)
    b = load_eagle(tmp_path / "speculators", target_b)
    assert b.config.layout == "speculators" and a.config.layout == "sglang"
    assert dataclasses.replace(b.config, layout="sglang") == a.config
    assert target_a.feature_tap.layers == target_b.feature_tap.layers
    tokens = [3, 17, 5, 40, 9, 22, 11, 7]
    assert torch.equal(_logits(target_a, a, tokens), _logits(target_b, b, tokens))
    drafts = chain_drafts(target_a, a, tokens, 5)
    assert drafts == chain_drafts(target_b, b, tokens, 5)
    assert all(d in S for d in drafts)
    # saved again, a head keeps the layout it came in
    save_pretrained(b, tmp_path / "again", dtype=torch.float32)
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == written


def test_the_speculators_ids_count_from_the_embedding(tmp_path: Path) -> None:
    """vLLM and the library's data generation take id k as the state entering target layer k:
    [2, L//2, L-3] are the default layers; SGLang's layout reads the same ids one layer later."""
    target = _target(layers=8)
    save_pretrained(_head(target), tmp_path / "h", dtype=torch.float32, layout="speculators")
    swap_config(tmp_path / "h", eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    fresh = _target(layers=8)
    load_eagle(tmp_path / "h", fresh)
    assert fresh.feature_tap.layers == (2, 4, 5)
    save_pretrained(_head(target), tmp_path / "s", dtype=torch.float32)
    swap_config(tmp_path / "s", eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})
    load_eagle(tmp_path / "s", fresh)
    assert fresh.feature_tap.layers == (3, 5, 6)


def test_the_layer_config_is_read_as_transformers_writes_and_reads_it(tmp_path: Path) -> None:
    """The library serializes transformer_layer_config with transformers' to_diff_dict; an
    absent key means transformers' LlamaConfig default."""
    transformers = pytest.importorskip("transformers")
    defaults = transformers.LlamaConfig()
    for key, value in LLAMA_DEFAULTS.items():
        assert getattr(defaults, key) == value, key
    head = _head(_target())
    save_pretrained(head, tmp_path / "h", dtype=torch.float32, layout="speculators")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    mine = eagle3_from_speculators(raw, load_file(tmp_path / "h" / "model.safetensors"))
    layer = raw["transformer_layer_config"]
    theirs = transformers.LlamaConfig(**{k: v for k, v in layer.items()
                                         if k not in ("model_type", "rope_scaling", "rope_theta")},
                                      rope_theta=layer["rope_theta"]).to_diff_dict()
    assert theirs["model_type"] == "llama"
    read = eagle3_from_speculators({**raw, "transformer_layer_config": theirs},
                                   load_file(tmp_path / "h" / "model.safetensors"))
    assert read == mine
    # keys left out: transformers' defaults (rms_norm_eps 1e-6, 32 heads, the RoPE theta)
    sparse = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1}
    cfg = eagle3_from_speculators({**raw, "transformer_layer_config": sparse})
    ref = transformers.LlamaConfig(**sparse)
    assert (cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.rope_theta, cfg.max_position_embeddings) == (
        ref.rms_norm_eps, ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim,
        ref.rope_parameters["rope_theta"], ref.max_position_embeddings)


def _layer(**changes):
    def edit(cfg: dict) -> None:
        cfg["transformer_layer_config"].update(changes)
    return edit


def _top(**changes):
    def edit(cfg: dict) -> None:
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
    return edit


def _spec(**changes):
    def edit(cfg: dict) -> None:
        cfg["speculators_config"].update(changes)
    return edit


@pytest.mark.parametrize("edit,message", [
    (_top(medusa_num_heads=4), "config key 'medusa_num_heads' is not understood by this "
                               "implementation of an EAGLE-3 head in the speculators layout"),
    (_spec(tree_choices=[[0]]), "config key 'speculators_config.tree_choices' is not understood"),
    (_spec(algorithm="eagle"), "config key 'speculators_config.algorithm' is 'eagle'; "
                               "supported: 'eagle3'"),
    (_layer(logit_scale=0.5), "config key 'transformer_layer_config.logit_scale' is not understood"),
    (_layer(model_type="qwen3"), "config key 'transformer_layer_config.model_type' is 'qwen3'; "
                                 "supported: 'llama'"),
    (_layer(num_hidden_layers=2), "transformer_layer_config: config key 'num_hidden_layers' is 2; "
                                  "allowed: 1"),
    (_layer(hidden_act="gelu"), "transformer_layer_config: config key 'hidden_act' is 'gelu'; "
                                "supported: 'silu'"),
    (_top(speculators_model_type="eagle"), "config key 'speculators_model_type' is 'eagle'; "
                                           "supported: 'eagle3'"),
    (_top(architectures=["EagleSpeculator"]), "unsupported architecture ['EagleSpeculator']"),
    (_top(norm_before_fc=True), "config key 'norm_before_fc' is true"),
    (_top(fc_norm=True), "config key 'fc_norm' is true"),
    (_top(norm_output=True), "config key 'norm_output' is true"),
    (_top(norm_before_residual=None), "config key 'norm_before_residual' is missing"),
    (_top(draft_vocab_size=None), "config key 'draft_vocab_size' is missing"),
    (_top(draft_vocab_size=100), "config key 'draft_vocab_size' is 100; allowed: at most "
                                 "transformer_layer_config.vocab_size (64)"),
    (_top(transformer_layer_config=None), "config key 'transformer_layer_config' is missing"),
    (_top(eagle_aux_hidden_state_layer_ids=[1, 2]), "config key "
                                                    "'eagle_aux_hidden_state_layer_ids' is [1, 2]"),
    (_top(eagle_aux_hidden_state_layer_ids=[1, 2, 9]), "eagle_aux_hidden_state_layer_ids "
                                                       r"\[1, 2, 9\], the speculators layout's"),
])
def test_each_key_is_read_or_refused_by_name(tmp_path: Path, edit, message) -> None:
    import re

    save_pretrained(_head(_target()), tmp_path / "h", dtype=torch.float32, layout="speculators")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    edit(cfg)
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        load_eagle(tmp_path / "h", _target())
    assert "config.json" in str(err.value)
    assert re.search(message if "\\[" in message else re.escape(message), str(err.value)), err.value


def test_what_does_not_change_the_forward_is_accepted(tmp_path: Path) -> None:
    """The library's version and training switches, the proposal hints, the verifier's name and
    transformers' bookkeeping keys load; the head is the same."""
    save_pretrained(_head(_target()), tmp_path / "h", dtype=torch.float32, layout="speculators")
    plain = load_eagle(tmp_path / "h", _target()).config
    swap_config(tmp_path / "h", speculators_version="0.3.0", embed_requires_grad=False,
                enable_sp_ulysses=False, tie_word_embeddings=True, transformers_version="4.55.0",
                speculators_config={"algorithm": "eagle3", "default_proposal_method": "greedy",
                                    "proposal_methods": [{"proposal_type": "greedy",
                                                          "speculative_tokens": 5}],
                                    "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B",
                                                 "architectures": ["LlamaForCausalLM"]}})
    assert load_eagle(tmp_path / "h", _target()).config == plain


def test_a_missing_tensor_is_named_as_the_layout_names_it(tmp_path: Path) -> None:
    save_pretrained(_head(_target()), tmp_path / "h", dtype=torch.float32, layout="speculators")
    file = tmp_path / "h" / "model.safetensors"
    tensors = load_file(file)
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.up_proj\.weight"):
        load_eagle(tmp_path / "h", _target())


def test_save_refuses_a_layout_for_other_models(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layout='speculators' applies to an EAGLE-3 head only"):
        save_pretrained(_target(), tmp_path / "t", layout="speculators")
    with pytest.raises(ValueError, match="EAGLE-3 layout 'vllm'; allowed: 'sglang', 'speculators'"):
        Eagle3Config.for_target(_target().config, 32, layout="vllm")
