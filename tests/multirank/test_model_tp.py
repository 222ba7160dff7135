"""tp=2 under gloo (two spawned CPU ranks) gives the logits of tp=1, each rank loading its shard."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multirank import run_ranks
from workers.model import (
    DenseCausalAttention,
    EagleConfig,
    EagleHead,
    LlamaConfig,
    LlamaForCausalLM,
    ModelParallel,
    load_eagle,
    load_llama,
    save_pretrained,
)

pytestmark = pytest.mark.multirank

from engine_fixtures import TINY
LENS = [6, 3, 9]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = (torch.arange(sum(LENS)) * 31 + 5) % 256
    return ids, torch.cat([torch.arange(n) for n in LENS])


def logits_of(target: LlamaForCausalLM, head: EagleHead) -> tuple[torch.Tensor, torch.Tensor]:
    ids, pos = batch()
    with torch.no_grad():
        hidden = target(ids, pos, DenseCausalAttention(LENS))
        feats = head(ids, hidden, pos, DenseCausalAttention(LENS))
        return target.compute_logits(hidden), head.compute_logits(feats)


def tp_job(rank: int, root: str) -> dict:
    """One rank: build the tp group, load this rank's shards, return logits and shard shapes."""
    from collectives import init_distributed

    ctx = init_distributed(timeout_s=30.0)
    try:
        par = ModelParallel.from_layout(ctx.layout(dp=1))
        target = load_llama(Path(root) / "target", par=par)
        head = load_eagle(Path(root) / "eagle", target)
        logits, draft = logits_of(target, head)
        attn = target.model.layers[0].self_attn
        shapes = {"q": tuple(attn.q_proj.weight.shape), "k": tuple(attn.k_proj.weight.shape),
                  "o": tuple(attn.o_proj.weight.shape),
                  "down": tuple(target.model.layers[0].mlp.down_proj.weight.shape)}
        mlp = target.model.layers[1].mlp
        fused = {"qkv": attn.qkv.weight.numpy().copy(), "gate_up": mlp.gate_up.weight.numpy().copy(),
                 "head_qkv": head.layers[0].self_attn.qkv.weight.numpy().copy(),
                 "views": attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()}
        return {"logits": logits.numpy(), "draft": draft.numpy(), "shapes": shapes,
                "fused": fused, "rank": ctx.rank}
    finally:
        ctx.shutdown()


def test_tp2_logits_equal_tp1(tmp_path):
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    head = EagleHead(EagleConfig.for_target(target.config), target).eval()
    save_pretrained(target, tmp_path / "target", dtype=torch.float32)
    save_pretrained(head, tmp_path / "eagle", dtype=torch.float32, max_shard_bytes=30_000)
    want, want_draft = logits_of(load_llama(tmp_path / "target"), head)
    results = run_ranks(tp_job, 2, str(tmp_path), timeout=60.0)
    for r in results:
        assert r.value["shapes"] == {"q": (32, 64), "k": (16, 64), "o": (64, 32), "down": (64, 48)}
        torch.testing.assert_close(torch.from_numpy(r.value["logits"]), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.from_numpy(r.value["draft"]), want_draft, atol=1e-5, rtol=1e-5)
        # each rank's fused weights are its own rows [q; k; v] and [gate; up], one buffer
        rank, fused = r.value["rank"], r.value["fused"]
        assert fused["views"]

        def rows(w: torch.Tensor) -> torch.Tensor:
            return w.chunk(2)[rank]

        attn, mlp = target.model.layers[0].self_attn, target.model.layers[1].mlp
        hattn = head.layers[0].self_attn
        for got, parts in ((fused["qkv"], (attn.q_proj, attn.k_proj, attn.v_proj)),
                           (fused["gate_up"], (mlp.gate_proj, mlp.up_proj)),
                           (fused["head_qkv"], (hattn.q_proj, hattn.k_proj, hattn.v_proj))):
            want_w = torch.cat([rows(m.weight.detach()) for m in parts])
            assert torch.equal(torch.from_numpy(got), want_w)
