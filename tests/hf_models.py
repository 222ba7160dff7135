"""Tiny models built, initialised and saved by Hugging Face transformers — the independent
reference the engine's model code is compared with (``tests/unit/test_hf_parity.py``) — and
EAGLE / EAGLE-3 draft heads in SGLang's checkpoint layout, with reference forwards assembled from
transformers' own Llama blocks.

transformers is a test-only dependency: nothing under ``workers/`` may import it.

* Targets (`build_target`): ``llama3-tied`` / ``llama3`` (``LlamaForCausalLM``, Llama-3 RoPE
  scaling, tied / untied embeddings), ``qwen2`` (``Qwen2ForCausalLM``: q/k/v biases), ``qwen3``
  (``Qwen3ForCausalLM``: q/k norms, ``head_dim`` 32 apart from ``hidden / heads`` = 16), ``llama``
  (plain, untied: the carrier of the other RoPE types, `ROPE_TYPES`). Every weight is redrawn
  (norm weights in [0.5, 1.5], biases N(0, 0.5^2), matrices N(0, 1/fan_in)) so logits are well
  apart and every part of the forward matters.
* Checkpoints (`save_target`): transformers' ``save_pretrained`` (one safetensors file, or shards
  with an index), or its tensors as ``pytorch_model.bin`` (what transformers 4 wrote with
  ``safe_serialization=False``; transformers 5 writes safetensors only). `to_legacy_layout`
  rewrites ``config.json`` as older releases wrote it: top-level ``rope_theta`` + ``rope_scaling``.
* Heads: `eagle3_tensors` / `eagle_tensors` give random weights in SGLang's names,
  `head_config` the ``config.json`` (written by transformers' ``LlamaConfig``), `write_head` the
  directory; `Eagle3Reference` / `EagleReference` compute them with transformers' blocks.
* `bigram_target` + `oracle_eagle_tensors` / `oracle_eagle3_tensors`: a target that mostly
  follows a permutation bigram and heads that draft it (the speculative tests need accepted and
  rejected drafts both; random heads are almost always rejected).
"""
from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import Optional

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 64, 128, 4, 4, 2
MAX_POS = 256
ORIGINAL_MAX_POS = 64   # Llama-3 / YaRN: see `rope_parameters`
ARCHS = ("llama3-tied", "llama3", "qwen2", "qwen3")
ROPE_TYPES = ("linear", "dynamic", "yarn")
FORMATS = ("safetensors", "sharded", "bin")
LAYOUTS = ("v5", "legacy")


def rope_parameters(kind: str, theta: float) -> dict:
    """transformers 5's ``rope_parameters`` for RoPE type `kind`.

    Llama-3: at head_dim 16 and theta 500000 the wavelengths are 6.3, 32.5, 168, ...; with an
    original context of 64 (low_freq_factor 1, high_freq_factor 4: wavelengths above 64 divided by
    8, below 16 kept, between blended) the first frequency is kept, the second blended and the
    rest divided — every branch of the scaling is used (checked by a test). YaRN: factor 4 over
    an original 64 (= 256 / 64, as transformers wants), a ramp over the first dimensions."""
    extra = {
        "default": {},
        "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": ORIGINAL_MAX_POS},
        "linear": {"factor": 4.0},
        "dynamic": {"factor": 4.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX_POS,
                 "beta_fast": 32.0, "beta_slow": 1.0},
    }[kind]
    return {"rope_type": kind, "rope_theta": theta, **extra}


def target_hf_config(arch: str, rope: Optional[str] = None, max_pos: int = MAX_POS,
                     **overrides):
    """The transformers config of target `arch` (`rope`: the RoPE type of the ``llama`` carrier;
    `overrides`: config fields replaced)."""
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
              num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
              max_position_embeddings=max_pos, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, attn_implementation="eager", tie_word_embeddings=False)
    if arch in ("llama3-tied", "llama3"):
        cls = LlamaConfig
        kw.update(rms_norm_eps=1e-5, tie_word_embeddings=arch == "llama3-tied",
                  rope_parameters=rope_parameters("llama3", 500000.0))
    elif arch == "llama":
        cls = LlamaConfig
        kw.update(rms_norm_eps=1e-5, rope_parameters=rope_parameters(rope or "default", 10000.0))
    elif arch == "qwen2":
        # an eps far from every default: a reader that dropped the key would be seen
        cls = Qwen2Config
        kw.update(rms_norm_eps=0.05, rope_parameters=rope_parameters("default", 1e6))
    elif arch == "qwen3":
        cls = Qwen3Config
        kw.update(rms_norm_eps=1e-6, head_dim=32, rope_parameters=rope_parameters("default", 1e6))
    else:
        raise ValueError(f"arch {arch!r}; known: {ARCHS + ('llama',)}")
    kw.update(overrides)
    return cls(**kw)


_CLASSES = {LlamaConfig: LlamaForCausalLM, Qwen2Config: Qwen2ForCausalLM,
            Qwen3Config: Qwen3ForCausalLM}


@torch.no_grad()
def randomize(model: nn.Module, seed: int) -> None:
    """Redraw every parameter (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name == "lm_head.weight":
            p.copy_(torch.randn(p.shape, generator=gen) * 2.0 / math.sqrt(p.shape[1]))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


def build_target(arch: str, seed: int = 0, rope: Optional[str] = None,
                 max_pos: int = MAX_POS, **overrides) -> nn.Module:
    """A float32 target of `arch` built by transformers, every weight redrawn from `seed`."""
    cfg = target_hf_config(arch, rope, max_pos, **overrides)
    torch.manual_seed(seed)
    model = _CLASSES[type(cfg)](cfg).float().eval()
    randomize(model, seed)
    return model


def set_eos(model: nn.Module, eos: Optional[int]) -> None:
    """End-of-sequence id in the config and the generation config (both are saved)."""
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos


def save_target(model: nn.Module, path: Path, fmt: str) -> Path:
    """`model` saved by transformers in format `fmt` (`FORMATS`)."""
    if fmt == "sharded":
        model.save_pretrained(path, max_shard_size="64KB")
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("model-*-of-*.safetensors"))) > 3
        return path
    model.save_pretrained(path)
    if fmt == "bin":
        tensors = load_file(path / "model.safetensors")
        (path / "model.safetensors").unlink()
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        assert fmt == "safetensors", fmt
    return path


def to_legacy_layout(src: Path, dst: Path) -> Path:
    """A copy of model directory `src` whose ``config.json`` is in the older layout: top-level
    ``rope_theta`` and ``rope_scaling`` (null for plain RoPE), no ``rope_parameters``,
    ``torch_dtype`` for ``dtype``."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# ---- the reference computations ---------------------------------------------------------------

@torch.no_grad()
def hf_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' next-token logits [T, V] at every position of `ids` (one forward)."""
    return model(torch.tensor([ids])).logits[0]


@torch.no_grad()
def assert_greedy_equals_generate(engine, model: nn.Module, prompts: list[list[int]],
                                  n: int = 16) -> None:
    """The engine's greedy output of `n` tokens per prompt is transformers' `generate`
    (do_sample=False, exactly `n` new tokens: no stop)."""
    from workers.sampling import SamplingParams

    got = [r.output_ids for r in engine.generate(prompts, [SamplingParams(max_new_tokens=n)]
                                                 * len(prompts))]
    for prompt, out in zip(prompts, got):
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n)[0, len(prompt):].tolist()
        assert out == ref, (prompt, out, ref)


@torch.no_grad()
def hf_generate(model: nn.Module, ids: list[int], n: int) -> tuple[list[int], float]:
    """(transformers' greedy continuation of `ids`, at most `n` tokens, stopping after the
    generation config's eos; the smallest top-1 / top-2 logit gap over its steps)."""
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=n, return_dict_in_generate=True, output_logits=True,
                         pad_token_id=0)
    top2 = torch.stack([step[0].topk(2).values for step in out.logits])
    return out.sequences[0, len(ids):].tolist(), float((top2[:, 0] - top2[:, 1]).min())


@torch.no_grad()
def hf_hidden_states(model: nn.Module, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' hidden states of `ids`: ``[0]`` the embeddings, ``[k + 1]`` the output of
    layer ``k`` for ``k < L - 1``, ``[L]`` the last layer's output after the final norm."""
    return tuple(h[0] for h in model(torch.tensor([ids]), output_hidden_states=True).hidden_states)


def causal_mask(n: int) -> torch.Tensor:
    """[1, 1, n, n] additive causal mask (transformers' eager attention adds it)."""
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


# ---- draft heads in SGLang's layout ---------------------------------------------------------------

def head_config(kind: str, target: nn.Module, draft_vocab: int = 0,
                aux_ids: Optional[list[int]] = None, head_dim: Optional[int] = None,
                intermediate: int = 96, norm_before_residual: bool = False,
                aux_top_level: bool = False) -> LlamaConfig:
    """The transformers ``LlamaConfig`` of a head over `target` (its RoPE and dimensions; an
    intermediate size of its own): EAGLE (the EAGLE project's: a Llama config of one layer) or
    EAGLE-3 (``LlamaForCausalLMEagle3`` with ``draft_vocab_size`` and the aux layer ids in
    ``eagle_config``, or at the top level with `aux_top_level`, as vLLM also reads them)."""
    t = target.config
    kw = dict(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=intermediate,
              num_hidden_layers=1, num_attention_heads=t.num_attention_heads,
              num_key_value_heads=t.num_key_value_heads,
              max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps,
              rope_parameters=dict(t.rope_parameters), tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None,
              attn_implementation="eager")
    if head_dim is not None:
        kw["head_dim"] = head_dim
    if kind == "eagle":
        return LlamaConfig(**kw, architectures=["LlamaForCausalLM"])
    assert kind == "eagle3", kind
    extra = {"norm_before_residual": True} if norm_before_residual else {}
    if aux_top_level:
        extra["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    else:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    return LlamaConfig(**kw, architectures=["LlamaForCausalLMEagle3"],
                       draft_vocab_size=draft_vocab, **extra)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale


def _norm_weight(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.rand(n, generator=gen) + 0.5


def _attention_tensors(gen: torch.Generator, prefix: str, cfg: LlamaConfig, width: int,
                       bias: bool = False) -> dict[str, torch.Tensor]:
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = {f"{prefix}q_proj.weight": _randn(gen, q, width, scale=width ** -0.5),
           f"{prefix}k_proj.weight": _randn(gen, kv, width, scale=width ** -0.5),
           f"{prefix}v_proj.weight": _randn(gen, kv, width, scale=width ** -0.5),
           f"{prefix}o_proj.weight": _randn(gen, cfg.hidden_size, q, scale=q ** -0.5)}
    if bias:
        out.update({f"{prefix}{p}_proj.bias": _randn(gen, n, scale=0.5)
                    for p, n in (("q", q), ("k", kv), ("v", kv))})
    return out


def _mlp_tensors(gen: torch.Generator, prefix: str, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    d, i = cfg.hidden_size, cfg.intermediate_size
    return {f"{prefix}gate_proj.weight": _randn(gen, i, d, scale=d ** -0.5),
            f"{prefix}up_proj.weight": _randn(gen, i, d, scale=d ** -0.5),
            f"{prefix}down_proj.weight": _randn(gen, d, i, scale=i ** -0.5)}


def eagle3_tensors(cfg: LlamaConfig, draft_ids: list[int], seed: int,
                   own_embedding: bool = False) -> dict[str, torch.Tensor]:
    """Random EAGLE-3 weights in SGLang's names: ``fc`` over three target states, the
    ``midlayer`` (attention over ``[embedding; hidden]``, hence 2d-wide q/k/v), ``norm``,
    ``lm_head`` over the draft vocabulary, ``d2t`` (draft id i -> target id i + d2t[i]) and
    ``t2d`` (the target ids that have a draft id); ``embed_tokens`` when it has its own."""
    gen = torch.Generator().manual_seed(seed)
    d, v = cfg.hidden_size, cfg.vocab_size
    out = {"fc.weight": _randn(gen, d, 3 * d, scale=(3 * d) ** -0.5)}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"midlayer.{name}.weight"] = _norm_weight(gen, d)
    out.update(_attention_tensors(gen, "midlayer.self_attn.", cfg, 2 * d))
    out.update(_mlp_tensors(gen, "midlayer.mlp.", cfg))
    out["norm.weight"] = _norm_weight(gen, d)
    out["lm_head.weight"] = _randn(gen, len(draft_ids), d, scale=2 * d ** -0.5)
    ids = torch.tensor(draft_ids)
    out["d2t"] = ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    if own_embedding:
        out["embed_tokens.weight"] = _randn(gen, v, d)
    return out


def eagle_tensors(cfg: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random EAGLE (1) weights in the EAGLE project's / SGLang's names: ``fc`` (with a bias)
    over ``[embedding; feature]``, one decoder layer ``layers.0`` without its input norm, no final
    norm (its output goes to the target's LM head as it is)."""
    gen = torch.Generator().manual_seed(seed)
    d = cfg.hidden_size
    out = {"fc.weight": _randn(gen, d, 2 * d, scale=(2 * d) ** -0.5),
           "fc.bias": _randn(gen, d, scale=0.5),
           "layers.0.post_attention_layernorm.weight": _norm_weight(gen, d)}
    out.update(_attention_tensors(gen, "layers.0.self_attn.", cfg, d))
    out.update(_mlp_tensors(gen, "layers.0.mlp.", cfg))
    return out


def write_head(path: Path, cfg: LlamaConfig, tensors: dict[str, torch.Tensor],
               fmt: str = "safetensors", layout: str = "v5") -> Path:
    """A head directory: ``config.json`` written by transformers (in the older RoPE layout when
    `layout` is ``legacy``) and the tensors as ``model.safetensors`` or ``pytorch_model.bin``."""
    path.mkdir(parents=True)
    cfg.save_pretrained(path)
    if fmt == "bin":
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    if layout == "legacy":
        tmp = path.with_name(path.name + ".legacy")
        to_legacy_layout(path, tmp)
        shutil.rmtree(path)
        tmp.rename(path)
    return path


def _load(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Copy the tensors named ``prefix + name`` into `module`'s parameters; every parameter must
    be given."""
    state = {name: tensors[prefix + name] for name, _ in module.named_parameters()}
    module.load_state_dict(state, strict=True)


class Eagle3Reference(nn.Module):
    """An EAGLE-3 head as SGLang computes it, assembled from transformers' Llama blocks.

    ``fuse(hidden_states)``: ``fc`` over the target's states after layers ``aux_ids`` (concatenated
    in layer order). ``forward(ids, hidden, positions)`` over one sequence of head rows (``hidden``:
    the fused state of the previous position, or the head's own pre-norm output for a fed-back
    draft): the midlayer — attention over ``[input_layernorm(embedding); hidden_norm(hidden)]``,
    residual ``hidden`` (``hidden_norm(hidden)`` with ``norm_before_residual``), the
    post-attention norm and the MLP — then ``norm`` and ``lm_head``. Returns (logits over target
    ids, ``-inf`` off the draft vocabulary; the pre-norm output)."""

    def __init__(self, cfg: LlamaConfig, tensors: dict[str, torch.Tensor], target: nn.Module,
                 aux_ids: list[int], norm_before_residual: bool = False) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.aux_ids, self.norm_before_residual = sorted(aux_ids), norm_before_residual
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.input_layernorm, self.hidden_norm = LlamaRMSNorm(d, eps), LlamaRMSNorm(d, eps)
        self.post_attention_layernorm, self.norm = LlamaRMSNorm(d, eps), LlamaRMSNorm(d, eps)
        self.self_attn = LlamaAttention(cfg, 0)
        for p in ("q", "k", "v"):
            old = getattr(self.self_attn, f"{p}_proj")
            setattr(self.self_attn, f"{p}_proj", nn.Linear(2 * d, old.out_features, bias=False))
        self.mlp = LlamaMLP(cfg)
        self.lm_head = nn.Linear(d, tensors["lm_head.weight"].shape[0], bias=False)
        self.rotary = LlamaRotaryEmbedding(cfg)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn",
                     "mlp"):
            _load(getattr(self, name), tensors, f"midlayer.{name}.")
        for name in ("fc", "norm", "lm_head"):
            _load(getattr(self, name), tensors, f"{name}.")
        if "embed_tokens.weight" in tensors:
            self.embed = nn.Embedding.from_pretrained(tensors["embed_tokens.weight"])
        else:
            self.embed = target.get_input_embeddings()
        self.vocab = target.config.vocab_size
        self.register_buffer("to_target", torch.arange(len(tensors["d2t"])) + tensors["d2t"])
        self.eval()

    @torch.no_grad()
    def fuse(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.fc(torch.cat([hidden_states[k + 1] for k in self.aux_ids], dim=-1))

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        both = torch.cat((self.input_layernorm(self.embed(ids)), normed), dim=-1)[None]
        cos, sin = self.rotary(both, positions[None])
        attn, _ = self.self_attn(both, (cos, sin), causal_mask(len(ids)))
        x = (normed if self.norm_before_residual else hidden) + attn[0]
        x = x + self.mlp(self.post_attention_layernorm(x))
        draft = self.lm_head(self.norm(x))
        full = draft.new_full((len(ids), self.vocab), float("-inf"))
        full[:, self.to_target] = draft
        return full, x


class EagleReference(nn.Module):
    """An EAGLE (1) head as the EAGLE project and SGLang compute it, from transformers' blocks:
    ``fc([embedding; feature])`` then transformers' ``LlamaDecoderLayer`` with its input norm
    replaced by the identity, no final norm, the target's LM head. ``forward(ids, feats,
    positions)`` returns (logits, the head's output feature)."""

    def __init__(self, cfg: LlamaConfig, tensors: dict[str, torch.Tensor], target: nn.Module) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.fc = nn.Linear(2 * d, d, bias="fc.bias" in tensors)
        self.layer = LlamaDecoderLayer(cfg, 0)
        self.layer.input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(cfg)
        _load(self.fc, tensors, "fc.")
        _load(self.layer, tensors, "layers.0.")
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.eval()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, feats: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat((self.embed(ids), feats), dim=-1))[None]
        cos, sin = self.rotary(x, positions[None])
        x = self.layer(x, attention_mask=causal_mask(len(ids)), position_embeddings=(cos, sin))[0]
        return self.lm_head(x), x


# ---- a target that follows a bigram, and heads that draft it ------------------------------------

@torch.no_grad()
def bigram_target(seed: int, eps: float) -> tuple[nn.Module, list[int]]:
    """An untied Llama-3 target (transformers) whose next token is mostly ``perm[token]``:
    orthogonal embeddings ``E`` (rows of norm sqrt(d)), LM-head row ``t`` reading
    ``E[perm^-1(t)]`` through the final norm's weight, the attention and MLP branches scaled by
    `eps` (so the context moves the argmax now and then). Returns (model, perm)."""
    model = build_target("llama3", seed)
    gen = torch.Generator().manual_seed(seed + 100)
    d, v = HIDDEN, VOCAB
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    emb = q[:v] * math.sqrt(d)
    perm = torch.randperm(v, generator=gen).tolist()
    inverse = [0] * v
    for u, t in enumerate(perm):
        inverse[t] = u
    model.model.embed_tokens.weight.copy_(emb)
    w = model.model.norm.weight
    model.lm_head.weight.copy_(0.15 * emb[inverse] / w)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(eps)
        layer.mlp.down_proj.weight.mul_(eps)
    return model, perm


@torch.no_grad()
def oracle_eagle_tensors(cfg: LlamaConfig, target: nn.Module, seed: int,
                         noise: float = 0.02) -> dict[str, torch.Tensor]:
    """EAGLE (1) weights (random, `eagle_tensors`) whose ``fc`` passes ``w * embedding``
    (``w``: the target's final-norm weight) and whose layer adds little: the target's LM head then
    reads the target's bigram of the token, at every draft step."""
    out = eagle_tensors(cfg, seed)
    d = cfg.hidden_size
    out["fc.weight"] *= noise
    out["fc.weight"][:, :d] += torch.diag(target.model.norm.weight.detach())
    out["fc.bias"] *= noise
    out["layers.0.self_attn.o_proj.weight"] *= noise
    out["layers.0.mlp.down_proj.weight"] *= noise
    return out


@torch.no_grad()
def oracle_eagle3_tensors(cfg: LlamaConfig, target: nn.Module, perm: list[int],
                          draft_ids: list[int], seed: int,
                          noise: float = 0.005) -> dict[str, torch.Tensor]:
    """EAGLE-3 weights (random, `eagle3_tensors`) that draft `perm`: ``fc`` passes the first
    captured state (~ the embedding ``E[u]`` of the previous token), the midlayer's MLP maps
    ``E[j]`` to ``E[perm[j]]`` (gate and up read the one-hot ``E E[j] / d``; one unit active), so
    the pre-norm output is ``E`` of the current token — and, fed back, of each draft; LM-head row
    ``r`` reads ``E[perm^-1(S[r])]``, so only the right ``d2t`` maps the argmax to ``perm`` of it."""
    out = eagle3_tensors(cfg, draft_ids, seed)
    d, v = cfg.hidden_size, cfg.vocab_size
    emb = target.model.embed_tokens.weight.detach()
    inverse = [0] * v
    for u, t in enumerate(perm):
        inverse[t] = u
    out["fc.weight"] *= noise
    out["fc.weight"][:, :d] += torch.eye(d)
    out["midlayer.self_attn.o_proj.weight"] *= noise
    out["midlayer.post_attention_layernorm.weight"] = torch.ones(d)
    gain = 4.0
    silu = gain / (1 + math.exp(-gain))
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"midlayer.mlp.{name}.weight"] *= noise
    out["midlayer.mlp.gate_proj.weight"][:v] += gain * emb / d
    out["midlayer.mlp.up_proj.weight"][:v] += emb / d
    out["midlayer.mlp.down_proj.weight"][:, :v] += (emb[perm] - emb).T / silu
    out["norm.weight"] = torch.ones(d)
    out["lm_head.weight"] = 0.15 * emb[[inverse[t] for t in draft_ids]]
    return out


def draft_vocab(size: int, seed: int) -> list[int]:
    """`size` distinct target ids, sorted (an EAGLE-3 draft vocabulary)."""
    return sorted(random.Random(seed).sample(range(VOCAB), size))


# ---- MoE targets ------------------------------------------------------------------------------

def moe_pair(root: Path, vocab: int, hidden: int = 32, expert_width: int = 16,
             max_pos: int = 256, shared_expert_width: Optional[int] = None,
             experts: int = 8, top_k: int = 2, layers: int = 4,
             dense_layers: tuple[int, ...] = (2,), std: float = 0.25) -> Path:
    """A transformers-built Qwen3-MoE target (4 layers, 8 experts, top 2 normalised, layer 2 dense;
    weights redrawn larger than the default init so routing and logits spread) saved in
    `root/target`, and a random EAGLE-3 head over it (`model_fixtures.random_head`, aux ids
    0/1/2) in `root/eagle`, both float32. With `shared_expert_width`: a Qwen2-MoE target of the
    same shape (q/k/v biases, no q/k norms, top 2 unnormalised) with a shared expert that wide.
    `experts`, `top_k`, `layers`, `dense_layers` change the shape; `std` the matrices' N(0, std^2)
    (norm weights N(1, 0.1^2); 0.02 with norms 1.0 is `scripts.gen.make_checkpoint`'s draw, the
    one the production-shape benchmarks run)."""
    from model_fixtures import random_head, write_checkpoint
    from workers.model import load_llama

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3 // 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_width,
        mlp_only_layers=list(dense_layers), max_position_embeddings=max_pos,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if shared_expert_width is None:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=hidden // 4, norm_topk_prob=True)).eval()
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, norm_topk_prob=False,
            shared_expert_intermediate_size=shared_expert_width)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, std)
    model.save_pretrained(root / "target")
    target = load_llama(root / "target")
    aux = (0, layers // 2, layers - 1) if layers != 4 else (0, 1, 2)
    write_checkpoint(random_head("eagle3", target, aux_layer_ids=aux), root / "eagle")
    return root
