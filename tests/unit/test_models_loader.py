"""Real checkpoint layouts, written by the tests (``model_fixtures``): Llama-3 / Llama / Qwen2 /
Qwen3 targets and EAGLE (ours, the EAGLE project's) and EAGLE-3 heads, each loaded from every
weight format, with exactly the tensor names and shapes of those layouts; every refusal names the
file and the tensor or key; EAGLE-3's vocabulary map is checked, not just tolerated."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_fixtures import (
    ARCHS,
    FORMATS,
    bigram_map,
    chain_drafts,
    draft_vocab,
    greedy_tokens,
    oracle_head,
    oracle_target,
    random_head,
    random_target,
    swap_config,
    target_config,
    write_checkpoint,
    write_generation_config,
)
from workers.model import (CheckpointError, DenseCausalAttention, Eagle3Head, EagleConfig, EagleHead,
                           load_eagle, load_llama)

torch.set_num_threads(1)
S = draft_vocab(64, 32)


def _outputs(target, head, n: int = 12) -> tuple[torch.Tensor, ...]:
    ids = (torch.arange(n) * 7 + 3) % target.config.vocab_size
    pos = torch.arange(n)
    with torch.no_grad():
        feats = target(ids, pos, DenseCausalAttention([n]))
        out = [feats, target.compute_logits(feats)]
        if head is not None:
            g = head(ids, feats, pos, DenseCausalAttention([n]))
            out += [g, head.compute_logits(g)]
    return tuple(out)


def _pair(arch: str, kind: str):
    target = random_target(target_config(arch), seed=3)
    return target, random_head(kind, target, S if kind == "eagle3" else None)


# ---- every layout from every format ---------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_each_layout_loads_from_each_format(tmp_path: Path, fmt: str) -> None:
    for arch, kind in [("llama3", "eagle"), ("llama", "own"), ("qwen2", "eagle3"),
                       ("qwen3", "eagle3"), ("llama", "eagle3"), ("qwen3", "eagle")]:
        target, head = _pair(arch, kind)
        want = _outputs(target, head)
        root = tmp_path / f"{arch}-{kind}"
        write_checkpoint(target, root / "t", fmt)
        write_checkpoint(head, root / "d", fmt)
        files = sorted(p.name for p in (root / "t").iterdir())
        index = {"safetensors-sharded": "model.safetensors.index.json",
                 "bin-sharded": "pytorch_model.bin.index.json"}.get(fmt)
        assert index is None or (index in files and len(files) > 3), files
        t2 = load_llama(root / "t")
        h2 = load_eagle(root / "d", t2)
        assert type(h2) is type(head) and t2.config == target.config
        for a, b in zip(want, _outputs(t2, h2)):
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"{arch}/{kind}/{fmt}")


def _names(path: Path) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in load_file(path / "model.safetensors").items()}


def test_checkpoints_have_the_real_layouts_names_and_shapes(tmp_path: Path) -> None:
    """Not our invention: the tensor names and shapes Hugging Face and the EAGLE project use."""
    for arch in ARCHS:
        write_checkpoint(random_target(target_config(arch)), tmp_path / arch)
    llama3, qwen2, qwen3 = (_names(tmp_path / a) for a in ("llama3", "qwen2", "qwen3"))
    assert "lm_head.weight" not in llama3                               # tied
    cfg = json.loads((tmp_path / "llama3" / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["tie_word_embeddings"] is True
    assert qwen2["model.layers.0.self_attn.q_proj.bias"] == (64,)        # q/k/v biases, no o bias
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    assert qwen3["model.layers.0.self_attn.q_norm.weight"] == (32,)      # per-head norms, head_dim 32
    assert qwen3["model.layers.0.self_attn.q_proj.weight"] == (4 * 32, 64)
    assert qwen3["model.layers.0.self_attn.o_proj.weight"] == (64, 4 * 32)
    assert json.loads((tmp_path / "qwen3" / "config.json").read_text())["architectures"] == \
        ["Qwen3ForCausalLM"]
    target = random_target(target_config("llama"))
    write_checkpoint(random_head("eagle", target), tmp_path / "eagle")
    eagle = _names(tmp_path / "eagle")
    assert eagle["fc.weight"] == (64, 128) and eagle["fc.bias"] == (64,)
    assert "layers.0.input_layernorm.weight" not in eagle and "norm.weight" not in eagle
    assert "layers.0.post_attention_layernorm.weight" in eagle
    assert json.loads((tmp_path / "eagle" / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]
    write_checkpoint(random_head("eagle3", target, S), tmp_path / "eagle3")
    e3 = load_file(tmp_path / "eagle3" / "model.safetensors")
    shapes = {k: tuple(v.shape) for k, v in e3.items()}
    assert shapes["fc.weight"] == (64, 192) and "fc.bias" not in shapes
    assert shapes["midlayer.self_attn.q_proj.weight"] == (64, 128)      # attends over [embed; hidden]
    assert shapes["midlayer.hidden_norm.weight"] == shapes["midlayer.input_layernorm.weight"] == (64,)
    assert shapes["lm_head.weight"] == (32, 64) and shapes["norm.weight"] == (64,)
    assert e3["d2t"].dtype == torch.int64 and e3["d2t"].shape == (32,)
    assert e3["t2d"].dtype == torch.bool and int(e3["t2d"].sum()) == 32
    assert (torch.arange(32) + e3["d2t"]).tolist() == S and not any("embed" in k for k in shapes)
    cfg = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 32


def test_eagle3_captures_the_configured_layers_and_may_bring_its_own_embedding(tmp_path) -> None:
    target = random_target(target_config("llama", layers=6))
    head = random_head("eagle3", target, S, aux_layer_ids=(0, 2, 4))
    assert target.feature_tap.layers == (1, 3, 5)            # id k: the residual entering layer k+1
    assert random_head("eagle3", target, S).target.feature_tap.layers == (2, 3, 3)  # 2, L//2, L-3
    head = random_head("eagle3", target, S, aux_layer_ids=(0, 2, 4))
    write_checkpoint(target, tmp_path / "t")
    write_checkpoint(head, tmp_path / "d")
    t2 = load_llama(tmp_path / "t")
    h2 = load_eagle(tmp_path / "d", t2)
    assert t2.feature_tap.layers == (1, 3, 5) and t2.feature_size == 128
    ids = torch.arange(9)
    with torch.no_grad():
        hidden, aux = t2.model.run(ids, torch.arange(9), DenseCausalAttention([9]), (1, 3, 5))
        feats = t2(ids, torch.arange(9), DenseCausalAttention([9]))
    torch.testing.assert_close(feats[:, :64], hidden)
    torch.testing.assert_close(feats[:, 64:], h2.fc(torch.cat(aux, -1)))
    # a checkpoint with its own embed_tokens.weight: the head uses it instead of the target's
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    tensors["embed_tokens.weight"] = torch.randn(64, 64)
    save_file(tensors, tmp_path / "d" / "model.safetensors")
    h3 = load_eagle(tmp_path / "d", load_llama(tmp_path / "t"))
    assert h3.embed_tokens is not None
    torch.testing.assert_close(h3.embed_tokens.weight, tensors["embed_tokens.weight"])


def test_generation_config_eos_wins(tmp_path: Path) -> None:
    write_checkpoint(random_target(target_config("llama", eos=5)), tmp_path)
    assert load_llama(tmp_path).config.eos_token_ids == (5,)
    write_generation_config(tmp_path, [5, 7, 9])
    assert load_llama(tmp_path).config.eos_token_ids == (5, 7, 9)
    write_generation_config(tmp_path, [5, 700])
    with pytest.raises(CheckpointError, match="generation_config.json'.*'eos_token_id' is 700"):
        load_llama(tmp_path)


# ---- refusals name the file and the tensor or key ------------------------------------------------

@pytest.fixture
def saved(tmp_path: Path) -> Path:
    target = random_target(target_config("llama"))
    write_checkpoint(target, tmp_path / "t")
    write_checkpoint(random_head("eagle3", target, S), tmp_path / "e3")
    write_checkpoint(random_head("eagle", target), tmp_path / "e1")
    return tmp_path


def _edit(path: Path, **tensors) -> None:
    file = path / "model.safetensors"
    data = load_file(file)
    for name, value in tensors.items():
        if value is None:
            del data[name]
        else:
            data[name] = value
    save_file(data, file)


@pytest.mark.parametrize("head,name", [("e3", "midlayer.hidden_norm.weight"), ("e3", "lm_head.weight"),
                                       ("e1", "layers.0.mlp.down_proj.weight")])
def test_missing_tensor_is_named(saved: Path, head: str, name: str) -> None:
    _edit(saved / head, **{name: None})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing from checkpoint "
                                              f"'.*{head}'"):
        load_eagle(saved / head, load_llama(saved / "t"))


@pytest.mark.parametrize("head,name,shape,want", [
    ("e3", "fc.weight", (64, 128), "[64, 192]"),               # fc over 2 states, not 3
    ("e3", "midlayer.self_attn.q_proj.weight", (64, 64), "[64, 128]"),
    ("e3", "d2t", (31,), "[32]"),                               # d2t of the wrong length
    ("e3", "t2d", (63,), "[64]"),
    ("e1", "fc.weight", (64, 192), "[64, 128]"),
])
def test_misshapen_tensor_is_named(saved: Path, head: str, name: str, shape, want: str) -> None:
    dtype = torch.int64 if name == "d2t" else torch.bool if name == "t2d" else torch.float32
    _edit(saved / head, **{name: torch.zeros(shape, dtype=dtype)})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' in '.*{head}/model.safetensors' has "
                                              + re.escape(f"shape {list(shape)}; expected {want}")):
        load_eagle(saved / head, load_llama(saved / "t"))


def test_target_tensor_missing_and_misshapen(saved: Path) -> None:
    _edit(saved / "t", **{"model.layers.3.self_attn.k_proj.weight": torch.zeros(31, 64)})
    with pytest.raises(CheckpointError, match="'model.layers.3.self_attn.k_proj.weight' in "
                                              "'.*t/model.safetensors' has shape \\[31, 64\\]"):
        load_llama(saved / "t")


@pytest.mark.parametrize("d2t,match", [
    (lambda d: d.clone().index_fill_(0, torch.tensor([5]), 1000), "d2t\\[5\\] = 1000 maps draft id 5 "
                                                                  "to target id 1005, outside"),
    (lambda d: torch.full_like(d, 0), None),   # the identity: t2d then disagrees
    (lambda d: torch.cat((d[:1], d[:1] - 1 + 0 * d[1:2], d[2:])), "d2t maps draft ids 0 and 1 to "
                                                                    "the same target id"),
])
def test_bad_vocabulary_map_is_refused(saved: Path, d2t, match) -> None:
    right = load_file(saved / "e3" / "model.safetensors")["d2t"]
    _edit(saved / "e3", d2t=d2t(right))
    expect = match or "t2d\\[\\d+\\] is (True|False), but d2t (maps|does not map)"
    with pytest.raises(CheckpointError, match=f"'.*e3/model.safetensors': {expect}"):
        load_eagle(saved / "e3", load_llama(saved / "t"))


def test_d2t_required_for_a_smaller_draft_vocabulary(saved: Path) -> None:
    _edit(saved / "e3", d2t=None, t2d=None)
    with pytest.raises(CheckpointError, match="tensor 'd2t' is missing .*draft_vocab_size 32 < "
                                              "vocab_size 64"):
        load_eagle(saved / "e3", load_llama(saved / "t"))


@pytest.mark.parametrize("which,changes,match", [
    ("t", {"architectures": ["MistralForCausalLM"]},
     "t/config.json': unsupported architecture \\['MistralForCausalLM'\\].*Qwen3ForCausalLM"),
    ("t", {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True},
     "'use_sliding_window' is True"),
    ("e3", {"architectures": ["DeepseekV3ForCausalLMNextN"]},
     "e3/config.json': unsupported architecture \\['DeepseekV3ForCausalLMNextN'\\] for a draft"),
    ("e3", {"hidden_size": 32, "head_dim": 8},
     "e3/config.json': draft config key 'hidden_size' is 32; allowed: the target's hidden_size \\(64\\)"),
    ("e1", {"hidden_size": 128},
     "e1/config.json': draft config key 'hidden_size' is 128; allowed: the target's"),
    ("e3", {"vocab_size": 100}, "draft config key 'vocab_size' is 100; allowed: the target's"),
    ("e3", {"target_hidden_size": 32}, "'target_hidden_size' is 32; allowed: the target's hidden_size"),
    ("e3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}},
     "layers to capture \\[2, 3, 10\\].*outside the target's 4 layers"),
    ("e3", {"num_hidden_layers": 2}, "'num_hidden_layers' is 2; allowed: 1"),
])
def test_config_refusals_name_the_file_and_key(saved: Path, which: str, changes, match) -> None:
    swap_config(saved / which, **changes)
    with pytest.raises(ValueError, match=match):
        target = load_llama(saved / "t")
        load_eagle(saved / which, target)


def test_a_target_given_as_draft_is_not_an_eagle_head(saved: Path) -> None:
    with pytest.raises(CheckpointError, match="has no tensor 'fc.weight': not an EAGLE head"):
        load_eagle(saved / "t", load_llama(saved / "t"))


def test_bin_weights_load_without_unpickling_code(tmp_path: Path) -> None:
    target = random_target(target_config("qwen2"))
    write_checkpoint(target, tmp_path, "bin")
    torch.testing.assert_close(_outputs(load_llama(tmp_path), None)[1], _outputs(target, None)[1])

    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "x": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin' is not a readable PyTorch "
                                              "weights file \\(loaded with weights_only=True\\)"):
        load_llama(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match="has neither model.safetensors nor .*pytorch_model.bin"):
        load_llama(tmp_path)


def test_missing_bin_shard_is_named(tmp_path: Path) -> None:
    write_checkpoint(random_target(target_config("llama")), tmp_path, "bin-sharded")
    shard = sorted(tmp_path.glob("pytorch_model-*.bin"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard .*{shard.name}.* is missing"):
        load_llama(tmp_path)


# ---- the EAGLE-3 vocabulary map is checked, not just tolerated ----------------------------------

def test_eagle3_oracle_predicts_the_target_through_d2t_and_a_wrong_map_never(tmp_path) -> None:
    """A head that computes the target's next token exactly (``model_fixtures``): with the right
    ``d2t`` (read back from its checkpoint) every draft of a 5-step chain after a generated
    token is the target's greedy token; with ``d2t`` shifted by one draft row, none is."""
    cfg = target_config("qwen3")
    f = bigram_map(64, S)
    target = oracle_target(cfg, f, eps=0.0)
    write_checkpoint(target, tmp_path / "t", dtype=torch.float64)
    write_checkpoint(oracle_head("eagle3", target, f, S), tmp_path / "d", dtype=torch.float64)
    target = load_llama(tmp_path / "t", dtype=torch.float64)
    head = load_eagle(tmp_path / "d", target)
    assert isinstance(head, Eagle3Head)
    wrong = torch.tensor(S[1:] + S[:1]) - torch.arange(32)
    for prompt in ([3, 17, 40, 9], [60, 1], [22, 22, 22, 5, 8, 13]):
        seq = greedy_tokens(target, prompt, 10)
        head.set_vocab_map(torch.tensor(S) - torch.arange(32))
        for n in range(len(prompt) + 1, len(seq) - 4):   # after the first generated token
            assert chain_drafts(target, head, seq[:n], 5) == seq[n:n + 5]
        head.set_vocab_map(wrong)
        n = len(prompt) + 1
        assert all(a != b for a, b in zip(chain_drafts(target, head, seq[:n], 5), seq[n:]))


@pytest.mark.parametrize("kind", ["eagle", "own"])
def test_eagle_oracle_predicts_the_target(kind: str) -> None:
    cfg = target_config("llama")
    f = bigram_map(64, S)
    target = oracle_target(cfg, f, eps=0.0)
    head = oracle_head(kind, target, f, S)
    assert isinstance(head, EagleHead) and (kind == "own") == (head.config.layout == "own")
    seq = greedy_tokens(target, [3, 17, 40], 8)
    assert chain_drafts(target, head, seq[:4], 5) == seq[4:9]


def test_eagle_project_head_with_qkv_biases(tmp_path: Path) -> None:
    """The EAGLE project's heads for Qwen2 targets carry q/k/v biases: found in the tensors, used."""
    target = random_target(target_config("qwen2"), seed=2)
    torch.manual_seed(0)
    cfg = EagleConfig.for_target(target.config, layout="eagle", fc_bias=False,
                                 first_input_norm=False, final_norm=False, attention_qkv_bias=True)
    head = EagleHead(cfg, target).eval()
    with torch.no_grad():
        head.layers[0].self_attn.q_proj.bias.normal_()
    write_checkpoint(target, tmp_path / "t")
    write_checkpoint(head, tmp_path / "d", "bin")
    t2 = load_llama(tmp_path / "t")
    h2 = load_eagle(tmp_path / "d", t2)
    assert h2.config.qkv_bias and not h2.config.fc_bias
    for a, b in zip(_outputs(target, head), _outputs(t2, h2)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # any of the three biases makes all three required: a missing one is named
    write_checkpoint(head, tmp_path / "d2")
    _edit(tmp_path / "d2", **{"layers.0.self_attn.k_proj.bias": None})
    with pytest.raises(CheckpointError, match="tensor 'layers.0.self_attn.k_proj.bias' is missing"):
        load_eagle(tmp_path / "d2", t2)


@pytest.mark.parametrize("arch,kind", [("qwen3", "eagle3"), ("qwen2", "eagle"), ("llama3", "eagle3")])
def test_fused_kernels_serve_every_layout(monkeypatch: pytest.MonkeyPatch, arch: str,
                                          kind: str) -> None:
    """The fused kernels (`workers.kernels`: RMSNorm with the residual add, RoPE, SiLU-mul) that
    serve CUDA tensors, here forced on for CPU tensors in triton's interpreter: the same features
    and logits as the torch code for Qwen3's per-head q/k norms (head_dim apart from d / heads),
    Qwen2's biases, the EAGLE project's head without an input norm and the EAGLE-3 midlayer."""
    pytest.importorskip("triton", reason="the fused kernels need triton")
    from workers import kernels

    target, head = _pair(arch, kind)
    want = _outputs(target, head, n=7)
    monkeypatch.setattr(kernels, "enabled", lambda x: True)
    for a, b in zip(_outputs(target, head, n=7), want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
