"""The Llama target model, split over the groups of a ``ModelParallel`` (DP attention).

API (one rank; every tensor below lives on that rank's device):

    model = LlamaForCausalLM(cfg, par)
    hidden = model(input_ids [T], positions [T], attn)   # -> [T, hidden_size]
    logits = model.compute_logits(hidden)                # -> [T, vocab_size], full vocabulary

The batch is this replica's flattened ragged batch of T tokens, T padded to the size the round
agreed across replicas (padding rows carry any id/position; their outputs are dropped by the
caller). ``positions`` gives each token's position in its own sequence (RoPE); ``attn`` (a
``workers.attention.LayerAttention``) knows which tokens belong to which sequence and owns the KV
cache. Decoder layer ``i`` calls ``attn.forward(i, q, k, v)``.

**The EAGLE feature** is the hidden state this ``forward`` returns: the output of the final RMSNorm
(``model.norm``), i.e. exactly the tensor ``compute_logits`` feeds the LM head. The draft head
(``workers.model.eagle``) consumes it and produces its own in the same space.

Per layer: Q/K/V are column-parallel over the ``attn`` group (this rank's heads) and O row-parallel
with one all-reduce over ``attn``; the MLP gathers every replica's tokens, runs gate/up (column)
and down (row) over this rank's slice of the intermediate size (the ``mlp`` group: every rank), and
sums and scatters back (``ModelParallel.scatter_sum``). The embedding and the LM head split the
vocabulary over every rank. Parameter names are those of Hugging Face ``LlamaForCausalLM``
(``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``).
"""
from __future__ import annotations

import torch
from torch import nn

from collectives import ops
from workers.attention.base import LayerAttention
from workers.model.config import LlamaConfig, _DecoderDims
from workers.model.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    apply_rope,
    silu_mul,
)
from workers.model.parallel import ModelParallel


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over this rank's ``Hq/attn_tp`` query and ``Hkv/attn_tp`` KV
    heads; the output projection's partial sums are all-reduced over the ``attn`` group."""

    def __init__(self, cfg: _DecoderDims, layer_id: int, par: ModelParallel) -> None:
        super().__init__()
        d, hd, group = cfg.hidden_size, cfg.head_dim, par.attn
        self.layer_id, self.head_dim, self.group = layer_id, hd, group
        self.q_proj = ColumnParallelLinear(d, cfg.num_attention_heads * hd, group)
        self.k_proj = ColumnParallelLinear(d, cfg.num_key_value_heads * hd, group)
        self.v_proj = ColumnParallelLinear(d, cfg.num_key_value_heads * hd, group)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, d, group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: LayerAttention) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, -1, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, -1, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, -1, self.head_dim)
        out = attn.forward(self.layer_id, q, k, v)
        return ops.all_reduce(self.o_proj(out.reshape(t, -1)), self.group)


class LlamaMLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))`` over every replica's tokens and this rank's slice of
    the intermediate size; returns this replica's rows summed over the world."""

    def __init__(self, cfg: _DecoderDims, par: ModelParallel) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.par = par
        self.gate_proj = ColumnParallelLinear(d, f, par.mlp)
        self.up_proj = ColumnParallelLinear(d, f, par.mlp)
        self.down_proj = RowParallelLinear(f, d, par.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.par.gather(x)
        partial = self.down_proj(silu_mul(self.gate_proj(tokens), self.up_proj(tokens)))
        return self.par.scatter_sum(partial)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: _DecoderDims, layer_id: int, par: ModelParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, par)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: LayerAttention) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add_forward(
            x, self.self_attn(self.input_layernorm(x), cos, sin, attn))
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (Hugging Face ``model.*`` names)."""

    def __init__(self, cfg: LlamaConfig, par: ModelParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, par)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, par) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: LayerAttention) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The target: ``forward`` gives post-norm hidden states (the EAGLE feature),
    ``compute_logits`` the full-vocabulary logits of this replica's rows."""

    def __init__(self, cfg: LlamaConfig, par: ModelParallel | None = None) -> None:
        super().__init__()
        par = par if par is not None else ModelParallel.single("cpu")
        cfg.check_tp(par.attn.size, par.mlp.size)
        self.config, self.par = cfg, par
        self.model = LlamaModel(cfg, par)
        self.lm_head = VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size, par)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: LayerAttention) -> torch.Tensor:
        """Hidden states [T, hidden_size] after the final norm for flattened ``input_ids`` [T]."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab_size] from ``forward``'s hidden states (or an EAGLE head's features).
        Collective over the world: every rank calls it with the same number of rows."""
        return self.lm_head(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden_size] (shared with the EAGLE head; collective like
        ``compute_logits``)."""
        return self.model.embed_tokens(input_ids)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE frequencies) after ``to_empty``/dtype changes."""
        self.model.rotary.reset_buffers()

    @property
    def num_layers(self) -> int:
        """Number of attention layers, i.e. the layer ids ``0..num_layers-1`` of the target cache."""
        return self.config.num_hidden_layers
