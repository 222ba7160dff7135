"""The Llama target model, tensor-parallel over a ``collectives.Group``.

API (one rank; every tensor below lives on that rank's device):

    model = LlamaForCausalLM(cfg, tp_group)
    hidden = model(input_ids [T], positions [T], attn)   # -> [T, hidden_size], replicated over TP
    logits = model.compute_logits(hidden)                # -> [T, vocab_size], full vocab on every rank

The batch is a flattened ragged batch of T tokens; ``positions`` gives each token's position in
its own sequence (used by RoPE), ``attn`` (an ``AttentionBackend``) knows which tokens belong to
which sequence and owns the KV cache. Decoder layer ``i`` calls ``attn.forward(i, q, k, v)``.

**The EAGLE feature** is the hidden state this ``forward`` returns: the output of the final
RMSNorm (``model.norm``), i.e. exactly the tensor ``compute_logits`` feeds the LM head. The draft
head (``workers.model.eagle``) consumes it and produces its own in the same space.

Per layer: Q/K/V and gate/up are column-parallel (this rank's heads / MLP slice), O and down are
row-parallel (one all-reduce each over the TP group); embedding, norms and the LM head are
replicated (fine for a small vocabulary). Parameter names are those of Hugging Face
``LlamaForCausalLM`` (``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from collectives import Group
from workers.model.config import LlamaConfig, _DecoderDims
from workers.model.layers import (
    AttentionBackend,
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    apply_rope,
)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over this rank's ``Hq/tp`` query and ``Hkv/tp`` KV heads."""

    def __init__(self, cfg: _DecoderDims, layer_id: int, group: Group) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.layer_id, self.head_dim = layer_id, hd
        self.q_proj = ColumnParallelLinear(d, cfg.num_attention_heads * hd, group)
        self.k_proj = ColumnParallelLinear(d, cfg.num_key_value_heads * hd, group)
        self.v_proj = ColumnParallelLinear(d, cfg.num_key_value_heads * hd, group)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, d, group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, -1, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, -1, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, -1, self.head_dim)
        out = attn.forward(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(t, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` over this rank's slice of the intermediate size."""

    def __init__(self, cfg: _DecoderDims, group: Group) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(d, f, group)
        self.up_proj = ColumnParallelLinear(d, f, group)
        self.down_proj = RowParallelLinear(f, d, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: _DecoderDims, layer_id: int, group: Group) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (Hugging Face ``model.*`` names)."""

    def __init__(self, cfg: LlamaConfig, group: Group) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, group) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The target: ``forward`` gives post-norm hidden states (the EAGLE feature),
    ``compute_logits`` the full-vocabulary logits on every TP rank."""

    def __init__(self, cfg: LlamaConfig, tp_group: Group | None = None) -> None:
        super().__init__()
        group = tp_group if tp_group is not None else Group.single("cpu")
        cfg.check_tp(group.size)
        self.config, self.tp_group = cfg, group
        self.model = LlamaModel(cfg, group)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        """Hidden states [T, hidden_size] after the final norm for flattened ``input_ids`` [T]."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab_size] from ``forward``'s hidden states (or an EAGLE head's features)."""
        return self.lm_head(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden_size] (shared with the EAGLE head)."""
        return self.model.embed_tokens(input_ids)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE frequencies) after ``to_empty``/dtype changes."""
        self.model.rotary.reset_buffers()

    @property
    def num_layers(self) -> int:
        """Number of attention layers, i.e. the layer ids ``0..num_layers-1`` of the target cache."""
        return self.config.num_hidden_layers
