"""Synthetic checkpoints in the layouts of real ones (nothing can be downloaded here), and heads
whose drafts are right by construction.

Targets (`target_config`): ``llama3`` (Llama-3 RoPE scaling, tied embeddings), ``llama``
(untied), ``qwen2`` (q/k/v biases), ``qwen3`` (q/k norms, ``head_dim`` apart from
``hidden / heads``). Heads: ``eagle`` (the EAGLE project's layout: ``fc`` with a bias, no input
norm before the first layer's attention, no final norm), ``own`` (our ``EagleLlamaHead``),
``eagle3`` (``LlamaForCausalLMEagle3``: ``fc`` over three target states, the midlayer, its own
LM head over a draft vocabulary mapped to target ids by ``d2t``).

**Oracles.** `oracle_target` gives a target whose token embeddings are one-hot (``V <= d``) and
whose attention and MLP branches are scaled by ``eps``: at ``eps = 0`` it is exactly a bigram
model, ``next = f(token)`` (``f`` maps every id into the draft vocabulary ``S``; tied embeddings
force ``f = id``). `oracle_head` builds a head that computes ``f`` exactly:

* EAGLE: ``fc`` passes the token's embedding, the layer adds nothing, the target's LM head reads
  it: ``draft = f(token)``;
* EAGLE-3: ``fc`` maps the captured target state of the previous token ``u`` (one-hot) to
  ``e_f(u)`` — the current token, for every token the target chose itself — and the midlayer's
  MLP maps a one-hot ``e_j`` to ``e_f(j)`` (SwiGLU with one active unit), so the pre-norm output
  is the one-hot of the next token; later draft steps feed it back and the MLP applies ``f`` again.
  Its LM head row ``r`` reads target id ``S[r]``, so only the right ``d2t`` (``S[r] - r``) maps the
  argmax back to the target's next token.

At ``eps = 0`` every draft of a generated token is accepted (any wrong part — the features, the
captured layers, the vocabulary map — shows as acceptance 0); at ``eps > 0`` the target strays
from ``f`` now and then, which gives every accept length.
"""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from workers.model import (
    Eagle3Config,
    Eagle3Head,
    EagleConfig,
    EagleHead,
    LlamaConfig,
    LlamaForCausalLM,
    save_pretrained,
)
from workers.model.config import RopeScaling

ARCHS = ("llama3", "llama", "qwen2", "qwen3")
HEADS = ("eagle", "own", "eagle3")
FORMATS = ("safetensors", "safetensors-sharded", "bin", "bin-sharded")


def mixed_eps(arch: str, kind: str) -> float:
    """The eps at which the oracle pair of `arch` and `kind` gives every accept length (a tied
    Llama-3's bigram is the identity and strays least; Qwen2's random q/k/v biases stray most, and
    the EAGLE-3 oracle, which reads a captured middle layer, is the more sensitive)."""
    if kind == "eagle3" and arch == "qwen2":
        return 0.05
    return {"llama3": 0.3, "llama": 0.15, "qwen2": 0.1, "qwen3": 0.1}[arch]


def target_config(arch: str, vocab: int = 64, hidden: int = 64, layers: int = 4,
                  max_pos: int = 256, eos: Optional[int] = None) -> LlamaConfig:
    """A small target of `arch` (4 query heads, 2 KV heads)."""
    base = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=max_pos, eos_token_id=eos)
    if arch == "llama3":
        return LlamaConfig(**base, rope_theta=500000.0, tie_word_embeddings=True,
                           rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32))
    if arch == "llama":
        return LlamaConfig(**base)
    if arch == "qwen2":
        return LlamaConfig(**base, rope_theta=1e6, architecture="Qwen2ForCausalLM")
    if arch == "qwen3":
        return LlamaConfig(**base, rope_theta=1e6, explicit_head_dim=2 * hidden // 4,
                           architecture="Qwen3ForCausalLM")
    raise ValueError(f"arch {arch!r}; known: {ARCHS}")


@torch.no_grad()
def random_target(cfg: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised target with non-trivial norms and biases."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(cfg)
    for name, p in target.named_parameters():
        if p.dim() == 1:
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.5)
    return target.eval()


def draft_vocab(vocab: int, size: int, seed: int = 0) -> list[int]:
    """`size` distinct target ids, sorted (the draft vocabulary `S`)."""
    return sorted(random.Random(seed).sample(range(vocab), size))


def bigram_map(vocab: int, ids: list[int], seed: int = 0, identity: bool = False) -> list[int]:
    """`f`: every target id to an id of `ids` (the identity when `identity`)."""
    rng = random.Random(seed + 1)
    return list(range(vocab)) if identity else [rng.choice(ids) for _ in range(vocab)]


@torch.no_grad()
def oracle_target(cfg: LlamaConfig, f: list[int], eps: float, seed: int = 0) -> LlamaForCausalLM:
    """See the module docstring (float64)."""
    v, d = cfg.vocab_size, cfg.hidden_size
    assert v <= d, "one-hot embeddings need vocab_size <= hidden_size"
    target = random_target(cfg, seed)
    target.model.embed_tokens.weight.copy_(torch.eye(v, d))
    if not cfg.tie_word_embeddings:
        target.lm_head.weight.copy_(_one_hot_map(f, v, d))
    else:
        assert f == list(range(v)), "tied one-hot embeddings make the bigram the identity"
    target.model.norm.weight.fill_(1.0)
    for layer in target.model.layers:
        layer.self_attn.o_proj.weight.mul_(eps)
        layer.mlp.down_proj.weight.mul_(eps)
    return target.double().eval()


def _one_hot_map(f: list[int], rows: int, cols: int) -> torch.Tensor:
    """[rows, cols]: column i holds a one at row f(i)."""
    m = torch.zeros(rows, cols)
    for i, t in enumerate(f):
        m[t, i] = 1.0
    return m


def head_config(kind: str, target: LlamaConfig, draft_ids: Optional[list[int]] = None,
                aux_layer_ids: Optional[tuple[int, ...]] = None) -> EagleConfig | Eagle3Config:
    """The config of a head of `kind` for `target`."""
    if kind == "eagle":
        return EagleConfig.for_target(target, layout="eagle", fc_bias=True,
                                      first_input_norm=False, final_norm=False)
    if kind == "own":
        return EagleConfig.for_target(target)
    if kind == "eagle3":
        size = len(draft_ids) if draft_ids is not None else target.vocab_size
        return Eagle3Config.for_target(target, size, aux_layer_ids=aux_layer_ids,
                                       rope_theta=target.rope_theta)
    raise ValueError(f"head kind {kind!r}; known: {HEADS}")


@torch.no_grad()
def random_head(kind: str, target: LlamaForCausalLM, draft_ids: Optional[list[int]] = None,
                seed: int = 1, aux_layer_ids: Optional[tuple[int, ...]] = None
                ) -> EagleHead | Eagle3Head:
    """A randomly initialised head of `kind` (EAGLE-3: over `draft_ids`) on `target`'s dtype."""
    torch.manual_seed(seed)
    cfg = head_config(kind, target.config, draft_ids, aux_layer_ids)
    head = (Eagle3Head if kind == "eagle3" else EagleHead)(cfg, target)
    for name, p in head.named_parameters():
        if p.dim() == 1:
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.5)
    if kind == "eagle3" and draft_ids is not None:
        head.set_vocab_map(torch.tensor(draft_ids) - torch.arange(len(draft_ids)))
    return head.to(next(target.parameters()).dtype).eval()


@torch.no_grad()
def oracle_head(kind: str, target: LlamaForCausalLM, f: list[int], draft_ids: list[int],
                d2t: Optional[torch.Tensor] = None) -> EagleHead | Eagle3Head:
    """A head that computes the target's bigram `f` exactly (see the module docstring); `d2t`
    overrides the right vocabulary map (to show what a wrong one does)."""
    head = random_head(kind, target, draft_ids)
    d = target.config.hidden_size
    if kind != "eagle3":
        head.fc.weight.zero_()
        head.fc.weight[:, :d] = torch.eye(d)
        if head.fc.bias is not None:
            head.fc.bias.zero_()
        for layer in head.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        if isinstance(head.norm, torch.nn.Module) and hasattr(head.norm, "weight"):
            head.norm.weight.fill_(1.0)
        return head
    v = target.config.vocab_size
    step = _one_hot_map(f, d, d)                         # e_j -> e_f(j) (ids below v)
    step[v:, v:] = torch.eye(d - v)
    head.fc.weight.zero_()
    head.fc.weight[:, :d] = step                         # the first captured state only
    mid = head.midlayer
    mid.self_attn.o_proj.weight.zero_()
    mid.post_attention_layernorm.weight.fill_(1.0)
    gain, s = 4.0, d ** 0.5                              # the MLP input is sqrt(d) * e_j
    mid.mlp.gate_proj.weight.zero_()
    mid.mlp.up_proj.weight.zero_()
    mid.mlp.gate_proj.weight[:d] = gain * torch.eye(d)
    mid.mlp.up_proj.weight[:d] = torch.eye(d)
    mid.mlp.down_proj.weight.zero_()
    mid.mlp.down_proj.weight[:, :d] = (step - torch.eye(d)) / (F.silu(torch.tensor(gain * s)) * s)
    head.norm.weight.fill_(1.0)
    head.lm_head.weight.copy_(torch.eye(d)[draft_ids])   # draft row r reads target id S[r]
    right = torch.tensor(draft_ids) - torch.arange(len(draft_ids))
    head.set_vocab_map(right if d2t is None else d2t)
    return head.double()


def write_checkpoint(model: torch.nn.Module, path: Path, fmt: str = "safetensors",
                     dtype: torch.dtype = torch.float32) -> Path:
    """Save `model` in format `fmt` (one of `FORMATS`); the sharded ones split every few KB."""
    weights = "bin" if fmt.startswith("bin") else "safetensors"
    shard = 20_000 if fmt.endswith("sharded") else None
    save_pretrained(model, path, dtype=dtype, max_shard_bytes=shard, weights_format=weights)
    return path


def write_generation_config(path: Path, eos: list[int]) -> None:
    """`generation_config.json` with these end-of-sequence ids."""
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def swap_config(path: Path, **changes) -> None:
    """Rewrite keys of `path/config.json` (None deletes a key)."""
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def with_vocab(cfg: LlamaConfig, vocab: int, **changes) -> LlamaConfig:
    """`cfg` with another vocabulary (and other field changes)."""
    return dataclasses.replace(cfg, vocab_size=vocab, **changes)


# ---- tokenizers ---------------------------------------------------------------------------------

CORPUS = ["def f(x):\n    return x + 1\n", "import os\nprint('hello world')\n",
          "for i in range(10):\n    total += i\n", "class A:\n    pass\n"]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def write_tokenizer(path: Path, kind: str = "bytelevel", vocab: int = 300) -> int:
    """Write `path/tokenizer.json` (+ `tokenizer_config.json`); return its vocabulary size.

    ``bytelevel``: Llama-3 / Qwen style byte-level BPE trained on ASCII code (so every non-ASCII
    character is split over byte tokens), specials first, a template adding
    ``<|begin_of_text|>``. ``sentencepiece``: Llama-2 style BPE with byte fallback (``<0xE2>``
    tokens), ``▁`` for spaces, no template, ``add_bos_token: true`` in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    path.mkdir(parents=True, exist_ok=True)
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(CORPUS * 20, trainer=trainer)
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    elif kind == "sentencepiece":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        trainer = trainers.BpeTrainer(vocab_size=vocab - 256, special_tokens=["<unk>", "<s>", "</s>"],
                                      show_progress=False)
        tok.train_from_iterator(CORPUS * 20, trainer=trainer)
        raw = json.loads(tok.to_str())       # the byte tokens join the model's vocabulary
        table = raw["model"]["vocab"]
        table.update({f"<0x{b:02X}>": len(table) + b for b in range(256)})
        raw["model"]["byte_fallback"] = True
        raw["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
        tok = Tokenizer.from_str(json.dumps(raw))
        config = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}
    else:
        raise ValueError(f"tokenizer kind {kind!r}; known: bytelevel, sentencepiece")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size(with_added_tokens=True)


# ---- the models alone, without the engine ---------------------------------------------------------

@torch.no_grad()
def greedy_tokens(target: LlamaForCausalLM, tokens: list[int], n: int) -> list[int]:
    """`tokens` followed by the target's `n` greedy tokens (dense attention, no cache)."""
    from workers.model import DenseCausalAttention

    out = list(tokens)
    for _ in range(n):
        ids = torch.tensor(out)
        feats = target(ids, torch.arange(len(ids)), DenseCausalAttention([len(ids)]))
        out.append(int(target.compute_logits(feats[-1:]).argmax()))
    return out


@torch.no_grad()
def chain_drafts(target: LlamaForCausalLM, head: torch.nn.Module, tokens: list[int],
                 steps: int) -> list[int]:
    """The head's `steps` greedy drafts after `tokens` (the last one committed, not yet in the
    target's cache), paired as the engine pairs them: draft-extend over tokens 1..n with target
    features 0..n-1, then each draft fed back with the head's own output as the feature."""
    from workers.model import DenseCausalAttention

    ids, n = torch.tensor(tokens), len(tokens) - 1
    feats = target(ids[:-1], torch.arange(n), DenseCausalAttention([n]))
    h_ids, h_feats, pos = ids[1:], feats, torch.arange(1, n + 1)
    drafts: list[int] = []
    for k in range(steps):
        out = head(h_ids, h_feats, pos, DenseCausalAttention([len(h_ids)]))
        token = head.compute_logits(out[-1:]).argmax(-1)
        drafts.append(int(token))
        h_ids, h_feats = torch.cat((h_ids, token)), torch.cat((h_feats, out[-1:]))
        pos = torch.cat((pos, torch.tensor([n + 1 + k])))
    return drafts
