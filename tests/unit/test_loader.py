"""Loader tests: Hugging Face layout round trips (single file, sharded, tied) and clear errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.model import (
    CheckpointError,
    DenseCausalAttention,
    EagleConfig,
    EagleHead,
    LlamaConfig,
    LlamaForCausalLM,
    load_eagle,
    load_llama,
    save_pretrained,
)

from engine_fixtures import TINY


def make_pair(tie: bool = False) -> tuple[LlamaForCausalLM, EagleHead]:
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie)).eval()
    return target, EagleHead(EagleConfig.for_target(target.config), target).eval()


def outputs(target: LlamaForCausalLM, head: EagleHead) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(20) * 7 % 256
    pos = torch.arange(20)
    with torch.no_grad():
        hidden = target(ids, pos, DenseCausalAttention([20]))
        feats = head(ids, hidden, pos, DenseCausalAttention([20]))
        return target.compute_logits(hidden), head.compute_logits(feats)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    target, head = make_pair()
    save_pretrained(target, tmp_path / "target", dtype=torch.float32)
    save_pretrained(head, tmp_path / "eagle", dtype=torch.float32)
    return tmp_path


@pytest.mark.parametrize("tie,shard_bytes", [(False, None), (False, 40_000), (True, None)])
def test_round_trip_single_sharded_and_tied(tmp_path, tie, shard_bytes):
    target, head = make_pair(tie)
    save_pretrained(target, tmp_path / "t", dtype=torch.float32, max_shard_bytes=shard_bytes)
    save_pretrained(head, tmp_path / "e", dtype=torch.float32, max_shard_bytes=shard_bytes)
    files = sorted(p.name for p in (tmp_path / "t").iterdir())
    if shard_bytes:
        assert "model.safetensors.index.json" in files and len(files) > 4
    else:
        assert files == ["config.json", "model.safetensors"]
        assert ("lm_head.weight" in load_file(tmp_path / "t" / "model.safetensors")) is not tie
    t2 = load_llama(tmp_path / "t")
    h2 = load_eagle(tmp_path / "e", t2)
    if tie:
        assert t2.lm_head.weight is t2.model.embed_tokens.weight
    for a, b in zip(outputs(target, head), outputs(t2, h2)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bf16_on_disk_loads_as_float32_by_default(tmp_path):
    target, head = make_pair()
    save_pretrained(target, tmp_path / "t")
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "t" / "model.safetensors").values())
    t2 = load_llama(tmp_path / "t")
    assert all(p.dtype == torch.float32 for p in t2.parameters())
    assert t2.model.rotary.inv_freq.dtype == torch.float32
    assert load_llama(tmp_path / "t", dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(outputs(target, head)[0], outputs(t2, head)[0], atol=0.1, rtol=0.05)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory .*nowhere.* does not exist"):
        load_llama(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_llama(tmp_path / "empty")


def test_bad_config_json(saved):
    (saved / "target" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json' is not valid JSON"):
        load_llama(saved / "target")


def test_unsupported_architecture(saved):
    path = saved / "target" / "config.json"
    raw = json.loads(path.read_text())
    raw["architectures"] = ["MistralForCausalLM"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported architecture \\['MistralForCausalLM'\\].*LlamaForCausalLM"):
        load_llama(saved / "target")
    with pytest.raises(ValueError, match="unsupported architecture.*EagleLlamaHead"):
        load_eagle(saved / "target", make_pair()[0])


def test_missing_weights_file(saved):
    (saved / "target" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has neither model.safetensors nor model.safetensors.index.json"):
        load_llama(saved / "target")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(saved, damage):
    path = saved / "target" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\x07" * 64 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_llama(saved / "target")


def test_missing_tensor_and_shape_mismatch(saved):
    path = saved / "target" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        load_llama(saved / "target")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' .* has shape \\[95, 64\\]; "
                                              "expected \\[96, 64\\]"):
        load_llama(saved / "target")


def test_missing_shard_named_in_index(tmp_path):
    target, _ = make_pair()
    save_pretrained(target, tmp_path / "t", max_shard_bytes=20_000)
    shard = sorted((tmp_path / "t").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard .*{shard.name}.* is missing"):
        load_llama(tmp_path / "t")


def test_eagle_for_a_target_of_other_width(saved):
    other = LlamaForCausalLM(LlamaConfig(**{**TINY, "hidden_size": 32}))
    with pytest.raises(ValueError, match="'hidden_size' is 64; allowed: the target's hidden_size \\(32\\)"):
        load_eagle(saved / "eagle", other)


def test_resave_replaces_old_layout(tmp_path):
    target, _ = make_pair()
    save_pretrained(target, tmp_path / "t", max_shard_bytes=20_000)
    save_pretrained(target, tmp_path / "t")
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["config.json", "model.safetensors"]


def test_bundled_pair_loads_and_fits_the_tokenizer():
    from workers import tokenizer as tok

    root = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny_pair"
    target = load_llama(root / "target")
    head = load_eagle(root / "eagle", target)
    cfg = target.config
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids) == (tok.VOCAB_SIZE, tok.BOS_ID, (tok.EOS_ID,))
    assert all(p.stat().st_size < 14 * 2**20 for p in root.rglob("*.safetensors"))
    ids = torch.tensor(tok.encode("def f(x):\n    return x", add_bos=True))
    logits, _ = outputs(target, head)
    assert torch.isfinite(logits).all()
    with torch.no_grad():
        hidden = target(ids, torch.arange(len(ids)), DenseCausalAttention([len(ids)]))
    next_id = int(target.compute_logits(hidden[-1:]).argmax())
    assert next_id < tok.NUM_BYTES or next_id == tok.EOS_ID
