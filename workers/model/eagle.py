"""The EAGLE (1/2) draft head: ``fc([embed(token); feature]) -> decoder layer(s) -> [norm] ->
feature``, in our layout (``EagleLlamaHead``) or the EAGLE project's (no norm before the first
layer's attention, no final norm; ``fc`` with or without a bias). Parameter names are the
checkpoints'.

    head = EagleHead(cfg, target)
    feat = head(input_ids [T], features [T, d], positions [T], attn)   # -> [T, d]
    feat = head(..., attn, last=rows)   # -> [R, d]: each request's last new token only
    logits = head.compute_logits(feat)                                  # target's LM head

The embedding and the LM head are the target's modules (shared, not in the head's state dict).
The head's layers have layer ids ``0..num_layers-1`` in the *draft* KV cache, so ``attn`` must be
a backend over the draft cache. The input at position ``p`` is token ``x_p`` with the target
feature ``f_{p-1}``; its output approximates ``f_p`` (the pairing in full:
``docs/ARCHITECTURE.md``, "Draft heads"). ``fc`` is replicated; the decoder layer is split like
the target's.
"""
from __future__ import annotations

import torch
from torch import nn

from workers.model.config import EagleConfig
from workers.attention.base import LayerAttention
from workers.model.layers import RMSNorm, RotaryEmbedding
from workers.model.llama import LlamaDecoderLayer, LlamaForCausalLM, run_layers


class EagleHead(nn.Module):
    """One EAGLE draft head bound to its target (whose embedding and LM head it uses)."""

    def __init__(self, cfg: EagleConfig, target: LlamaForCausalLM) -> None:
        super().__init__()
        cfg.check_target(target.config)
        cfg.check_tp(target.par.attn.size, target.par.mlp.size)
        self.config = cfg
        self._target = (target,)  # a tuple: shared, not registered as a submodule
        d = cfg.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, target.par, input_norm=i > 0 or cfg.first_input_norm)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.final_norm else nn.Identity()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    @property
    def target(self) -> LlamaForCausalLM:
        """The target model whose embedding and LM head this head shares."""
        return self._target[0]

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                attn: LayerAttention, last: torch.Tensor | None = None) -> torch.Tensor:
        """Next features [T, d] for tokens [T] paired with the previous position's features
        [T, d]; with ``last`` (row indices [R], each request's last new token in request order,
        see ``LayerAttention.forward_last``) only those rows' features, [R, d] — every row's KV is
        still written."""
        cos, sin = self.rotary(positions)
        emb = self.target.embed(input_ids).to(features.dtype)
        x = self.fc(torch.cat((emb, features), dim=-1))
        return run_layers(self.layers, x, cos, sin, attn, self.norm, last=last)[1]

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab_size] through the target's LM head."""
        return self.target.compute_logits(features)

    @property
    def feature_size(self) -> int:
        """Width of ``forward``'s input features and of its output: ``hidden_size``."""
        return self.config.hidden_size

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE frequencies) after ``to_empty``/dtype changes."""
        self.rotary.reset_buffers()

    @property
    def num_layers(self) -> int:
        """Number of attention layers, i.e. the layer ids ``0..num_layers-1`` of the draft cache."""
        return self.config.num_hidden_layers
