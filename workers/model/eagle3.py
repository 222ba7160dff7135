"""The EAGLE-3 draft head (``architectures: ["LlamaForCausalLMEagle3"]``).

    head = Eagle3Head(cfg, target)          # attaches its fc to the target (a FeatureTap)
    out = head(input_ids [T], features [T, 2d], positions [T], attn)   # -> [T, 2d]
    logits = head.compute_logits(out)       # -> [T, vocab_size]: target ids, -inf off the draft vocab

``fc`` maps the residual stream entering three target layers (``cfg.capture_layers(L)``, by
default 2, ``L // 2``, ``L - 3``) to ``d``, inside the target's forward. Features are ``2 * d``
wide: the target's ``[h | fc(captured)]``, the head's ``[norm(x) | x]``; the head reads the second
half, ``compute_logits`` the first. The midlayer attends over ``[input_layernorm(embed);
hidden_norm(hidden)]``. Draft id ``i`` is target id ``i + d2t[i]``; ``compute_logits`` scatters
the draft logits into the target vocabulary, so verification runs against the target unchanged.
The embedding is the target's unless the checkpoint holds its own. More:
``docs/ARCHITECTURE.md``, "Draft heads" and "EAGLE-3 in the round".
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from workers.attention.base import LayerAttention
from workers.model.config import Eagle3Config
from workers.model.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding, VocabParallelLMHead
from workers.model.llama import FeatureTap, LlamaAttention, LlamaForCausalLM, LlamaMLP
from workers.model.parallel import ModelParallel


class Eagle3Layer(nn.Module):
    """The midlayer: attention over ``[input_layernorm(embedding); hidden_norm(hidden)]``, the
    residual being the hidden state (``hidden_norm(hidden)`` with ``norm_before_residual``), then
    the post-attention norm and the MLP."""

    def __init__(self, cfg: Eagle3Config, par: ModelParallel) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.self_attn = LlamaAttention(cfg, 0, par, in_features=2 * d)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = LlamaMLP(cfg, par)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embedding: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attn: LayerAttention) -> torch.Tensor:
        x, delta = self.parts(embedding, hidden, cos, sin, attn)
        return x + delta

    def parts(self, embedding: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, attn: LayerAttention, last: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual after attention, the MLP's output): ``forward`` is their sum, left
        to the caller's norm to add (one launch). ``last`` (row indices): every row's K/V is
        stored, only those rows go on."""
        normed = self.hidden_norm(hidden)
        both = torch.cat((self.input_layernorm(embedding), normed), dim=-1)
        out = self.self_attn(both, cos, sin, attn, last)
        if self.norm_before_residual:
            hidden = normed
        if last is not None:
            hidden = hidden.index_select(0, last)
        x, h = self.post_attention_layernorm.add_forward(hidden, out)
        return x, self.mlp(h)


def vocab_map_problem(d2t: torch.Tensor, t2d: Optional[torch.Tensor], vocab: int) -> Optional[str]:
    """What is wrong with the draft-to-target map (None: nothing): every draft id must map to a
    distinct target id inside ``[0, vocab)``, and ``t2d`` (when given) must mark exactly those."""
    draft_ids = torch.arange(d2t.numel(), dtype=torch.int64)
    ids = draft_ids + d2t.to(torch.int64).cpu()
    outside = ((ids < 0) | (ids >= vocab)).nonzero()
    if outside.numel():
        i = int(outside[0])
        return (f"d2t[{i}] = {int(d2t[i])} maps draft id {i} to target id {int(ids[i])}, outside "
                f"the target's vocabulary [0, {vocab})")
    order = ids.argsort()
    same = (ids[order][1:] == ids[order][:-1]).nonzero()
    if same.numel():
        j = int(same[0])
        a, b = sorted((int(order[j]), int(order[j + 1])))
        return f"d2t maps draft ids {a} and {b} to the same target id {int(ids[a])}"
    if t2d is not None:
        marked = t2d.cpu().bool()
        mapped = torch.zeros(vocab, dtype=torch.bool)
        mapped[ids] = True
        differ = (marked != mapped).nonzero()
        if differ.numel():
            t = int(differ[0])
            return (f"t2d[{t}] is {bool(marked[t])}, but d2t {'maps' if mapped[t] else 'does not map'}"
                    f" a draft id to target id {t} (t2d must mark exactly the ids d2t maps to)")
    return None


class Eagle3Head(nn.Module):
    """One EAGLE-3 draft head bound to its target (see the module docstring)."""

    def __init__(self, cfg: Eagle3Config, target: LlamaForCausalLM) -> None:
        super().__init__()
        cfg.check_target(target.config)
        cfg.check_tp(target.par.attn.size, target.par.mlp.size)
        self.config = cfg
        self._target = (target,)  # a tuple: shared, not registered as a submodule
        d, par = cfg.hidden_size, target.par
        self.fc = nn.Linear(cfg.fused_width, d, bias=cfg.fc_bias)
        self.midlayer = Eagle3Layer(cfg, par)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = VocabParallelLMHead(d, cfg.draft_vocab_size, par)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, d, par)
                             if cfg.own_embedding else None)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # the identity map until a checkpoint's d2t is loaded (set_vocab_map)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size),
                             persistent=False)
        target.attach_feature_tap(FeatureTap(cfg.capture_layers(target.config.num_hidden_layers),
                                             self.fc))

    @property
    def target(self) -> LlamaForCausalLM:
        """The target model whose embedding (unless the head has its own) this head shares."""
        return self._target[0]

    def set_vocab_map(self, d2t: torch.Tensor) -> None:
        """Draft id ``i`` becomes target id ``i + d2t[i]`` (and ``t2d`` marks those target ids);
        ``ValueError`` when the map is not one-to-one into the target's vocabulary."""
        problem = vocab_map_problem(d2t, None, self.config.vocab_size)
        if problem is not None:
            raise ValueError(problem)
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.draft_to_target.copy_(torch.arange(d2t.numel(), device=self.d2t.device) + self.d2t)
            self.t2d.zero_()
            self.t2d[self.draft_to_target] = True

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                attn: LayerAttention, last: torch.Tensor | None = None) -> torch.Tensor:
        """``[norm(x) | x]`` [T, 2d] for tokens [T] paired with the previous position's features
        [T, 2d] (the target's or this head's own: the second half is read); with ``last`` (row
        indices [R], as ``EagleHead.forward``) only those rows, [R, 2d]."""
        d = self.config.hidden_size
        if features.shape[-1] != 2 * d:
            raise ValueError(f"EAGLE-3 features are {2 * d} wide ([norm | hidden]); got "
                             f"{features.shape[-1]} (is the head attached to this target?)")
        hidden = features[..., d:]
        embed = self.embed_tokens if self.embed_tokens is not None else self.target.embed
        cos, sin = self.rotary(positions)
        x, delta = self.midlayer.parts(embed(input_ids).to(hidden.dtype), hidden, cos, sin, attn,
                                       last)
        x, normed = self.norm.add_forward(x, delta)
        return torch.cat((normed, x), dim=-1)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab_size] over target ids: the draft logits at ``draft_to_target``,
        ``-inf`` elsewhere. Collective over the world (the draft vocabulary is split)."""
        draft = self.lm_head(out[..., :self.config.hidden_size])
        full = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_to_target, draft)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE frequencies, the id map) after ``to_empty`` or
        loading ``d2t``."""
        self.rotary.reset_buffers()
        with torch.no_grad():
            self.draft_to_target.copy_(torch.arange(self.d2t.numel(), device=self.d2t.device)
                                       + self.d2t)

    @property
    def feature_size(self) -> int:
        """Width of ``forward``'s features: ``2 * hidden_size``."""
        return 2 * self.config.hidden_size

    @property
    def num_layers(self) -> int:
        """Attention layers in the draft cache: one (layer id 0)."""
        return 1
