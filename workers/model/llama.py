"""The target model (Llama, or its Qwen2 / Qwen3 / MoE variants) split over the groups of a
``ModelParallel`` (DP attention).

    model = LlamaForCausalLM(cfg, par)
    feats = model(input_ids [T], positions [T], attn)    # -> [T, model.feature_size]
    logits = model.compute_logits(feats)                 # -> [T, vocab_size], full vocabulary

The batch is this replica's flattened ragged batch, ``T`` padded to the size the round agreed
(padding rows' outputs are dropped by the caller). ``attn`` (a ``workers.attention.LayerAttention``)
owns the KV cache; layer ``i`` calls ``attn.forward(i, q, k, v)``. ``forward`` returns the
final-norm hidden (``hidden_size`` wide), or with a ``FeatureTap`` attached (an EAGLE-3 head)
``[final-norm hidden | tap.project(captured residuals)]``; ``feature_size`` says which. How each
layer is split and which collectives it issues: ``docs/ARCHITECTURE.md``, "The cluster".
Parameter names are Hugging Face ``LlamaForCausalLM``'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from collectives import ops
from workers import kernels
from workers.attention.base import LayerAttention
from workers.model.config import LlamaConfig, _DecoderDims
from workers.model.layers import (
    ColumnParallelLinear,
    FusedColumns,
    FusedOwner,
    LlamaMLP,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    apply_rope,
)
from workers.model.moe import MOE_NAMES, MoeBlock, MoeOutput, settle
from workers.model.parallel import ModelParallel


class LlamaAttention(FusedOwner):
    """Grouped-query self-attention over this rank's ``Hq/attn_tp`` query and ``Hkv/attn_tp`` KV
    heads; the output projection's partial sums are all-reduced over the ``attn`` group.

    ``in_features`` is the input width (default ``hidden_size``; an EAGLE-3 midlayer attends over
    ``2 * hidden_size``). ``cfg.qkv_bias`` adds q/k/v biases (Qwen2); ``cfg.qk_norm`` RMS-normalises
    every query and key head before RoPE (Qwen3: ``q_norm`` / ``k_norm`` over ``head_dim``).

    Q, K and V are one GEMM (``FusedColumns``: this rank's rows ``[q; k; v]`` in one buffer, the
    parameters ``q_proj``/``k_proj``/``v_proj`` views of it) and Q and K are rotated in one RoPE
    launch (they are adjacent in the GEMM's output); with ``qk_norm`` on the fused path that
    launch normalises them too (``kernels.qk_norm_rope``: one kernel where four ran)."""

    def __init__(self, cfg: _DecoderDims, layer_id: int, par: ModelParallel,
                 in_features: int | None = None) -> None:
        super().__init__()
        d, hd, group = cfg.hidden_size, cfg.head_dim, par.attn
        width = in_features or d
        self.layer_id, self.head_dim, self.group = layer_id, hd, group
        self.q_proj = ColumnParallelLinear(width, cfg.num_attention_heads * hd, group, cfg.qkv_bias)
        self.k_proj = ColumnParallelLinear(width, cfg.num_key_value_heads * hd, group, cfg.qkv_bias)
        self.v_proj = ColumnParallelLinear(width, cfg.num_key_value_heads * hd, group, cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, d, group)
        self.qkv = FusedColumns(self.q_proj, self.k_proj, self.v_proj)
        self._fused = (self.qkv,)
        self.qkv.fuse()
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: LayerAttention, last: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of `x` [T, in_features] -> [T, hidden_size]; with `last` (row indices [R]:
        each request's last new token, request order) K/V are still stored for every row, and only
        those rows attend: -> [R, hidden_size] (`LayerAttention.forward_last`)."""
        t, hd = x.shape[0], self.head_dim
        nq, nk, _ = self.qkv.split
        qkv = self.qkv(x)                                     # [T, (Hq + 2 Hkv) * D]
        v = qkv[:, nq + nk:].view(t, -1, hd)
        if self.q_norm is not None and kernels.enabled(qkv) and self.q_norm.eps == self.k_norm.eps:
            # the q and k heads side by side: both norms and the rotation in one launch
            q, k = kernels.qk_norm_rope(qkv, nq // hd, nk // hd, hd, self.q_norm.weight,
                                        self.k_norm.weight, self.q_norm.eps, cos, sin)
        elif self.q_norm is not None:
            q = apply_rope(self.q_norm(qkv[:, :nq].view(t, -1, hd)), cos, sin)
            k = apply_rope(self.k_norm(qkv[:, nq:nq + nk].view(t, -1, hd)), cos, sin)
        else:  # q and k heads side by side: one rotation
            qk = apply_rope(qkv[:, :nq + nk].view(t, -1, hd), cos, sin)
            q, k = qk[:, :nq // hd], qk[:, nq // hd:]
        if last is None:
            out = attn.forward(self.layer_id, q, k, v)
        else:
            out = attn.forward_last(self.layer_id, q.index_select(0, last), k, v)
        return ops.all_reduce(self.o_proj(out.reshape(out.shape[0], -1)), self.group)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``. ``input_norm=False``
    drops the first norm (the first layer of an EAGLE project head has none).

    A stack of layers runs as ``enter`` / ``body`` pairs (``run_layers``): a layer's last residual
    add is left to the next norm, which adds and normalises in one launch
    (``RMSNorm.add_forward``); the sums are the same. A MoE block on the fused path of one rank
    leaves its own sum over the top k (and its shared expert's gated add) to that launch too
    (``MoeOutput``)."""

    def __init__(self, cfg: _DecoderDims, layer_id: int, par: ModelParallel,
                 input_norm: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = LlamaAttention(cfg, layer_id, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_name = "mlp"
        if isinstance(cfg, LlamaConfig) and cfg.is_sparse(layer_id):
            self.ffn_name = MOE_NAMES[cfg.moe.names][0]      # Mixtral: block_sparse_moe
            setattr(self, self.ffn_name, MoeBlock(cfg, par))
        else:
            self.mlp = LlamaMLP(cfg, par)

    @property
    def ffn(self) -> nn.Module:
        """The layer's MLP: dense (``mlp``) or sparse (``mlp`` / ``block_sparse_moe``)."""
        return getattr(self, self.ffn_name)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: LayerAttention) -> torch.Tensor:
        x, delta = self.body(*self.enter(x, None), cos, sin, attn)
        return x + settle(delta)

    def enter(self, x: torch.Tensor, delta: torch.Tensor | MoeOutput | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream entering the layer, ``x + delta``; its input norm)."""
        return add_norm(self.input_layernorm, x, delta)

    def body(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             attn: LayerAttention, last: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | MoeOutput]:
        """The layer over residual ``x`` and its norm ``h``: (the residual after attention, the
        MLP's output, or a MoE block's not summed yet: ``MoeOutput``); the layer's output is
        their sum. With ``last`` (row indices) every row's K/V is stored but only those rows go
        on (``LlamaAttention.forward``)."""
        out = self.self_attn(h, cos, sin, attn, last)
        if last is not None:
            x = x.index_select(0, last)
        x, h = self.post_attention_layernorm.add_forward(x, out)
        ffn = self.ffn
        return x, (ffn.pending(h) if isinstance(ffn, MoeBlock) else ffn(h))


def add_norm(norm: nn.Module, x: torch.Tensor, delta: torch.Tensor | MoeOutput | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, norm(s))`` for ``s = x + delta`` (``x`` when ``delta`` is None); one launch for an
    ``RMSNorm`` on the fused path, a `MoeOutput`'s sum included."""
    if delta is None:
        return x, norm(x)
    if isinstance(delta, MoeOutput):
        if isinstance(norm, RMSNorm):
            return delta.add_norm(x, norm.weight, norm.eps)
        delta = delta.total()
    if isinstance(norm, RMSNorm):
        return norm.add_forward(x, delta)
    x = x + delta
    return x, norm(x)


def run_layers(layers: nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attn: LayerAttention, final_norm: nn.Module, capture: tuple[int, ...] = (),
               last: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """``x`` through ``layers`` then ``final_norm``: (the residual stream after the last layer,
    its norm, the residual stream entering each layer in ``capture``), each residual add fused
    into the norm that follows it. ``last`` (row indices): the last layer goes on with those rows
    only (the outputs are theirs; every row's K/V is stored)."""
    delta, seen = None, {}
    final = len(layers) - 1
    for i, layer in enumerate(layers):
        x, h = layer.enter(x, delta)
        if i in capture:
            seen[i] = x
        x, delta = layer.body(x, h, cos, sin, attn, last if i == final else None)
    x, out = add_norm(final_norm, x, delta)
    return x, out, seen


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
        return self.run(input_ids, positions, attn)[0]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: LayerAttention,
            capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(final-norm hidden states, the residual stream entering each layer in ``capture``;
        index ``num_layers``: after the last layer, before the final norm)."""
        cos, sin = self.rotary(positions)
        x, out, seen = run_layers(self.layers, self.embed_tokens(input_ids), cos, sin, attn,
                                  self.norm, capture)
        seen[len(self.layers)] = x
        return out, [seen[i] for i in capture]


@dataclass(frozen=True, eq=False)
class FeatureTap:
    """What a draft head needs from the target beyond its final hidden state: the residual
    stream entering ``layers`` (see ``LlamaModel.run``), concatenated and projected by
    ``project`` (an EAGLE-3 head's ``fc``), inside the target's forward."""

    layers: tuple[int, ...]
    project: nn.Module


class LlamaForCausalLM(nn.Module):
    """The target: ``forward`` gives the features (see the module docstring), ``compute_logits``
    the full-vocabulary logits of this replica's rows."""

    def __init__(self, cfg: LlamaConfig, par: ModelParallel | None = None) -> None:
        super().__init__()
        par = par if par is not None else ModelParallel.single("cpu")
        cfg.check_tp(par.attn.size, par.mlp.size, moe_parallel=par.moe)
        self.config, self.par = cfg, par
        self.model = LlamaModel(cfg, par)
        self.lm_head = VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size, par)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.feature_tap: FeatureTap | None = None  # a plain attribute: the head owns the module

    def attach_feature_tap(self, tap: FeatureTap | None) -> None:
        """Make ``forward`` also return ``tap``'s projection (an EAGLE-3 head attaches its ``fc``
        when it is built; the last head attached is the one served). ``None`` detaches."""
        self.feature_tap = tap

    @property
    def feature_size(self) -> int:
        """Width of ``forward``'s rows: ``hidden_size``, or ``2 * hidden_size`` with a tap."""
        d = self.config.hidden_size
        return d if self.feature_tap is None else 2 * d

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: LayerAttention) -> torch.Tensor:
        """Features [T, feature_size] for flattened ``input_ids`` [T]: the hidden states after the
        final norm, followed, with a tap, by the tap's projection of the captured layers."""
        if self.feature_tap is None:
            return self.model(input_ids, positions, attn)
        hidden, aux = self.model.run(input_ids, positions, attn, self.feature_tap.layers)
        fused = self.feature_tap.project(torch.cat(aux, dim=-1).to(hidden.dtype))
        return torch.cat((hidden, fused.to(hidden.dtype)), dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab_size] from ``forward``'s features (their first ``hidden_size``
        columns) or an EAGLE head's. Collective over the world: every rank calls it with the same
        number of rows."""
        return self.lm_head(hidden[..., :self.config.hidden_size])

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
