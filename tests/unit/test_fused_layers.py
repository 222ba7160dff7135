"""Fused Q/K/V and gate/up GEMMs, Q+K in one RoPE launch, residual adds fused into the next norm
and the one-launch KV store: the same math as the unfused layers (written out here as the
reference), whatever moves the weights (dtype casts, ``to_empty`` + loading, in-place writes,
replaced parameters), with gradients, and with the fused kernels on (triton's interpreter)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from model_fixtures import random_head, random_target, target_config
from workers import kernels
from workers.model import DenseCausalAttention, load_eagle, load_llama, save_pretrained
from workers.model.layers import apply_rope, silu_mul
from workers.model.llama import LlamaForCausalLM

LENS = [5, 3, 7]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = (torch.arange(sum(LENS)) * 13 + 3) % 64
    return ids, torch.cat([torch.arange(n) for n in LENS])


def ref_attention(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  a: DenseCausalAttention) -> torch.Tensor:
    """The unfused attention block: three GEMMs, two rotations."""
    t, hd = x.shape[0], attn.head_dim
    q = attn.q_proj.forward(x).view(t, -1, hd)
    k = attn.k_proj.forward(x).view(t, -1, hd)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = attn.v_proj.forward(x).view(t, -1, hd)
    return attn.o_proj(a.forward(attn.layer_id, q, k, v).reshape(t, -1))


def ref_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(silu_mul(mlp.gate_proj.forward(x), mlp.up_proj.forward(x)))


def ref_logits(model: LlamaForCausalLM, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The target as it was before fusing: separate linears, a residual add per layer."""
    a = DenseCausalAttention(LENS)
    cos, sin = model.model.rotary(pos)
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        x, h = layer.post_attention_layernorm.add_forward(
            x, ref_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, a))
        x = x + ref_mlp(layer.mlp, h)
    return model.compute_logits(model.model.norm(x))


def logits(model: LlamaForCausalLM) -> torch.Tensor:
    ids, pos = batch()
    return model.compute_logits(model(ids, pos, DenseCausalAttention(LENS)))


def assert_views(model: nn.Module) -> None:
    """Every fused group's parameters are views of its one buffer (no second copy)."""
    for module in model.modules():
        for group in getattr(module, "_fused", ()):
            base = group.weight
            assert base is not None
            lo = 0
            for m in group.linears:
                assert m.weight.data_ptr() == base[lo:].data_ptr()
                assert m.weight.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                lo += m.weight.shape[0]
            assert lo == base.shape[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_fused_forward_is_the_unfused_math(arch: str) -> None:
    model = random_target(target_config(arch, layers=3)).double()
    assert_views(model)
    ids, pos = batch()
    torch.testing.assert_close(logits(model), ref_logits(model, ids, pos), atol=1e-10, rtol=1e-10)


@torch.no_grad()
def test_in_place_writes_reach_the_fused_weights_and_replaced_ones_still_count() -> None:
    model = random_target(target_config("qwen2", layers=2)).double()
    ids, pos = batch()
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[0].mlp
    attn.k_proj.weight.mul_(1.5)              # in place: the fused buffer sees it
    attn.v_proj.bias.add_(0.25)
    mlp.up_proj.weight[:4] = 0.0
    assert_views(model)
    torch.testing.assert_close(logits(model), ref_logits(model, ids, pos), atol=1e-10, rtol=1e-10)
    # a replaced parameter is no view any more: the forward concatenates (same result)
    attn.q_proj.weight = nn.Parameter(attn.q_proj.weight * 0.5)
    mlp.gate_proj.weight = nn.Parameter(mlp.gate_proj.weight.clone().normal_())
    torch.testing.assert_close(logits(model), ref_logits(model, ids, pos), atol=1e-10, rtol=1e-10)
    model.to(torch.float64)                   # any _apply re-fuses
    assert_views(model)
    torch.testing.assert_close(logits(model), ref_logits(model, ids, pos), atol=1e-10, rtol=1e-10)


@torch.enable_grad()  # whatever an in-process CLI test left (start-up turns gradients off)
def test_gradients_reach_every_projection() -> None:
    model = random_target(target_config("llama", layers=2)).double().train()
    ids, pos = batch()
    logits(model).square().mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref_logits(model, ids, pos).square().mean().backward()
    for name, p in model.named_parameters():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], p.grad, atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize("kind", ["own", "eagle", "eagle3"])
def test_save_load_round_trip_keeps_names_and_logits(tmp_path, kind: str) -> None:
    target = random_target(target_config("llama", layers=4))
    head = random_head(kind, target)
    names = {n for n, _ in target.named_parameters()} | {n for n, _ in head.named_parameters()}
    assert not any("qkv" in n or "gate_up" in n for n in names)   # checkpoint names unchanged
    save_pretrained(target, tmp_path / "t", dtype=torch.float32)
    save_pretrained(head, tmp_path / "d", dtype=torch.float32)
    target2 = load_llama(tmp_path / "t")
    head2 = load_eagle(tmp_path / "d", target2)
    assert_views(target2)
    assert_views(head2)
    ids, pos = batch()
    with torch.no_grad():
        a = DenseCausalAttention(LENS)
        want = head.compute_logits(head(ids, target(ids, pos, a), pos, a))
        got = head2.compute_logits(head2(ids, target2(ids, pos, a), pos, a))
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(logits(target2), logits(target), atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["own", "eagle3"])
@torch.no_grad()
def test_fused_kernels_match_eager(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The whole target and head with the triton kernels forced on (interpreted on a CPU)."""
    pytest.importorskip("triton")
    target = random_target(target_config("llama", layers=4))
    head = random_head(kind, target)
    ids, pos = batch()
    a = DenseCausalAttention(LENS)
    want_t = target(ids, pos, a)
    want_h = head(ids, want_t, pos, a)
    monkeypatch.setattr(kernels, "enabled", lambda x: True)
    got_t = target(ids, pos, a)
    got_h = head(ids, got_t, pos, a)
    torch.testing.assert_close(got_t, want_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)
