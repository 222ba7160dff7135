"""Model tests on CPU: config validation, tokenizer, attention, ragged batches, EAGLE head."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.model import (
    DenseCausalAttention,
    EagleConfig,
    EagleHead,
    LlamaConfig,
    LlamaForCausalLM,
)
from workers import tokenizer as tok
from workers.model.config import RopeScaling
from workers.model.layers import rope_inv_freq

from engine_fixtures import TINY


def tiny_pair(seed: int = 0, **overrides) -> tuple[LlamaForCausalLM, EagleHead]:
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides})
    target = LlamaForCausalLM(cfg).eval()
    head = EagleHead(EagleConfig.for_target(cfg), target).eval()
    with torch.no_grad():  # non-trivial norm weights, so a wrong norm would show
        for name, p in list(target.named_parameters()) + list(head.named_parameters()):
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return target, head


# ---------------------------------------------------------------- config


def test_config_round_trip_through_hf_dict():
    cfg = LlamaConfig(**TINY, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192))
    raw = cfg.to_hf()
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["head_dim"] == 16
    assert LlamaConfig.from_hf(raw) == cfg
    eagle = EagleConfig.for_target(cfg)
    assert EagleConfig.from_hf(eagle.to_hf()) == eagle


def test_config_accepts_eos_list_and_missing_kv_heads():
    raw = LlamaConfig(**TINY).to_hf()
    raw["eos_token_id"] = [257, 258]
    del raw["num_key_value_heads"]
    cfg = LlamaConfig.from_hf(raw)
    assert cfg.eos_token_ids == (257, 258) and cfg.num_key_value_heads == cfg.num_attention_heads


@pytest.mark.parametrize("arch", [["GPT2LMHeadModel"], None, "LlamaForCausalLM"])
def test_config_rejects_unsupported_architecture(arch):
    raw = LlamaConfig(**TINY).to_hf()
    raw["architectures"] = arch
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        LlamaConfig.from_hf(raw)


@pytest.mark.parametrize("key,value,match", [
    ("hidden_size", 66, "'hidden_size' is 66.*multiple of num_attention_heads"),
    ("num_key_value_heads", 3, "'num_key_value_heads' is 3.*divisor"),
    ("vocab_size", 0, "'vocab_size' is 0.*integer >= 1"),
    ("num_hidden_layers", 2.5, "'num_hidden_layers' is 2.5"),
    ("rms_norm_eps", -1.0, "'rms_norm_eps' is -1.0.*> 0"),
    ("rope_theta", "big", "'rope_theta' is 'big'"),
    ("bos_token_id", 999, "'bos_token_id' is 999.*\\[0, 264\\)"),
    ("tie_word_embeddings", "yes", "'tie_word_embeddings' is 'yes'"),
])
def test_config_validation_names_key_value_and_allowed(key, value, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{**TINY, key: value})


@pytest.mark.parametrize("key,value,match", [
    ("hidden_act", "gelu", "'hidden_act' is 'gelu'; supported: 'silu'"),
    ("attention_bias", True, "'attention_bias' is True"),
    ("mlp_bias", True, "'mlp_bias' is True"),
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "'rope_scaling.rope_type' is 'longrope'"),
])
def test_config_refuses_unsupported_math(key, value, match):
    raw = LlamaConfig(**TINY).to_hf()
    raw[key] = value
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(raw)


def test_config_missing_key_and_tp_split():
    raw = LlamaConfig(**TINY).to_hf()
    del raw["hidden_size"]
    with pytest.raises(ValueError, match="lacks required keys \\['hidden_size'\\]"):
        LlamaConfig.from_hf(raw)
    with pytest.raises(ValueError, match="'num_key_value_heads' is 2; attention tensor parallelism of 4"):
        LlamaConfig(**TINY).check_tp(4)


def test_eagle_config_must_fit_target():
    target = LlamaConfig(**TINY)
    with pytest.raises(ValueError, match="'hidden_size' is 128; allowed: the target's hidden_size \\(64\\)"):
        EagleConfig.for_target(target, hidden_size=128).check_target(target)
    raw = EagleConfig.for_target(target).to_hf()
    raw["architectures"] = ["MistralForCausalLM"]
    with pytest.raises(ValueError, match="unsupported architecture.*EagleLlamaHead"):
        EagleConfig.from_hf(raw)


def test_rope_llama3_scaling_keeps_high_and_divides_low_frequencies():
    plain = rope_inv_freq(64, 500000.0, None)
    scaled = rope_inv_freq(64, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192))
    assert torch.equal(plain[:4], scaled[:4])
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 8.0)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_specials():
    text = "def f(x):\n    return 'é' + x  # ✓"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.BOS_ID and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids + [tok.EOS_ID, tok.PAD_ID]) == text
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"
    assert tok.VOCAB_SIZE % 8 == 0 and tok.VOCAB_SIZE > tok.PAD_ID


# ---------------------------------------------------------------- attention and forward


def naive_causal_attention(q, k, v):
    """Reference: explicit softmax over each query's prefix; query head h reads KV head h // g."""
    t, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.empty_like(q)
    for i in range(t):
        for h in range(hq):
            scores = (k[: i + 1, h // g] @ q[i, h]) * d ** -0.5
            out[i, h] = torch.softmax(scores, 0) @ v[: i + 1, h // g]
    return out


def test_dense_attention_matches_naive_reference_with_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    out = DenseCausalAttention([7]).forward(0, q, k, v)
    torch.testing.assert_close(out, naive_causal_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_dense_attention_ragged_equals_uniform_and_checks_token_count():
    torch.manual_seed(0)
    q, k, v = torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    uniform = DenseCausalAttention.uniform(3, 4).forward(0, q, k, v)
    ragged = DenseCausalAttention([4, 4, 3, 1]).forward(0, q, k, v)
    torch.testing.assert_close(uniform[:11], ragged[:11], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="got 12 tokens; planned for 10"):
        DenseCausalAttention([5, 5]).forward(0, q, k, v)
    with pytest.raises(ValueError, match="seq_lens"):
        DenseCausalAttention([3, 0])


def test_ragged_flattened_forward_equals_per_sequence_forwards():
    target, head = tiny_pair()
    lens = [5, 9, 1, 6]
    seqs = [torch.randint(0, 256, (n,)) for n in lens]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        hidden = target(ids, pos, DenseCausalAttention(lens))
        logits = target.compute_logits(hidden)
        feats = head(ids, hidden, pos, DenseCausalAttention(lens))
        singles = [target(s, torch.arange(len(s)), DenseCausalAttention([len(s)])) for s in seqs]
        single_feats = [head(s, h, torch.arange(len(s)), DenseCausalAttention([len(s)]))
                        for s, h in zip(seqs, singles)]
    assert hidden.shape == (sum(lens), 64) and logits.shape == (sum(lens), 264)
    torch.testing.assert_close(hidden, torch.cat(singles), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feats, torch.cat(single_feats), atol=1e-5, rtol=1e-5)


def test_rope_makes_attention_depend_on_relative_positions_only():
    target, _ = tiny_pair()
    ids = torch.randint(0, 256, (10,))
    with torch.no_grad():
        a = target(ids, torch.arange(10), DenseCausalAttention([10]))
        b = target(ids, torch.arange(10) + 37, DenseCausalAttention([10]))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(a[1:], target(ids, torch.arange(10) * 2, DenseCausalAttention([10]))[1:])


class ToyKVCache:
    """A minimal cache backend, to pin the API the paged backends implement: per layer, append
    this forward's K/V for one sequence, then attend causally over everything cached."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def forward(self, layer_id, q, k, v):
        old = self.k.get(layer_id, k[:0])
        self.k[layer_id] = torch.cat((old, k))
        self.v[layer_id] = torch.cat((self.v.get(layer_id, v[:0]), v))
        keys, vals, start = self.k[layer_id], self.v[layer_id], old.shape[0]
        g = q.shape[1] // k.shape[1]
        scores = torch.einsum("thd,shd->hts", q, keys.repeat_interleave(g, 1)) * q.shape[-1] ** -0.5
        mask = torch.arange(keys.shape[0])[None, :] > (start + torch.arange(q.shape[0]))[:, None]
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return torch.einsum("hts,shd->thd", probs, vals.repeat_interleave(g, 1))


def test_incremental_decoding_through_a_cache_backend_equals_full_forward():
    target, head = tiny_pair()
    ids = torch.randint(0, 256, (12,))
    with torch.no_grad():
        full = target(ids, torch.arange(12), DenseCausalAttention([12]))
        cache = ToyKVCache()
        parts = [target(ids[:8], torch.arange(8), cache)]            # prefill
        parts.append(target(ids[8:11], torch.arange(8, 11), cache))  # multi-token verify
        parts.append(target(ids[11:], torch.arange(11, 12), cache))  # decode
        dcache = ToyKVCache()
        draft_full = head(ids[1:], full[:-1], torch.arange(1, 12), DenseCausalAttention([11]))
        draft_parts = [head(ids[1:9], full[:8], torch.arange(1, 9), dcache),
                       head(ids[9:], full[8:11], torch.arange(9, 12), dcache)]
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(draft_parts), draft_full, atol=1e-5, rtol=1e-5)
    assert sorted(dcache.k) == [0] and sorted(cache.k) == [0, 1]


# ---------------------------------------------------------------- EAGLE head


def test_eagle_head_shares_embedding_and_lm_head():
    target, head = tiny_pair()
    names = set(head.state_dict())
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    feats = torch.randn(3, 64)
    before = head.compute_logits(feats)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
    torch.testing.assert_close(head.compute_logits(feats), 2.0 * before)


def test_tied_embeddings_share_one_parameter():
    target, _ = tiny_pair(tie_word_embeddings=True)
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(target.named_parameters())


def test_configs_are_frozen():
    cfg = LlamaConfig(**TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 8  # type: ignore[misc]
    assert dataclasses.replace(cfg, num_hidden_layers=3).num_hidden_layers == 3
