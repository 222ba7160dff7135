"""References for the fused MoE kernels' tests (``tests/unit/test_moe_kernels.py`` on the CPU,
``tests/gpu/test_moe_gpu.py`` on a GPU): the alignment's contract checked from its definition,
and the routings they run at the production expert count (128 experts, top 8)."""
from __future__ import annotations

import torch

E, TOP_K = 128, 8          # Qwen3-30B-A3B's
BLOCK = 16                 # workers.moe_kernels.BLOCK_M (the test asserts it)


def check_alignment(ids: torch.Tensor, num_experts: int, rows: torch.Tensor,
                    block_expert: torch.Tensor, block: int = BLOCK) -> None:
    """`moe_kernels.align`'s contract, from its definition (not from `align_torch`): the padded
    length bound, every local pair exactly once and no other rank's, each expert's pairs in their
    order, from the first row of a block that is its, followed by padding (the sentinel ``P``)
    to the end of its last block, the runs in expert order, and every block's expert (``E`` past
    the last run)."""
    flat = ids.reshape(-1).cpu()
    pairs = flat.numel()
    length = (pairs + num_experts * (block - 1) + block - 1) // block * block
    rows, block_expert = rows.cpu(), block_expert.cpu()
    assert rows.shape == (length,) and block_expert.shape == (length // block,)
    assert rows.dtype == block_expert.dtype == torch.int64
    assert ((rows >= 0) & (rows <= pairs)).all(), "a row outside [0, P]"
    local = (flat < num_experts).nonzero().flatten()
    assert sorted(rows[rows < pairs].tolist()) == local.tolist(), "local pairs not each once"
    start = 0
    for e in range(num_experts):
        mine = (flat == e).nonzero().flatten()
        padded = -(-mine.numel() // block) * block
        run = rows[start:start + padded]
        assert torch.equal(run[:mine.numel()], mine), f"expert {e}: its pairs, in order"
        assert (run[mine.numel():] == pairs).all(), f"expert {e}: padding"
        assert (block_expert[start // block:(start + padded) // block] == e).all(), e
        start += padded
    assert (rows[start:] == pairs).all() and (block_expert[start // block:] == num_experts).all()


def routings(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Top-8 expert ids [rows, 8] of 128: as a router picks them (8 distinct, uniform), skewed
    (every token the same 8 experts: long runs of many blocks), the last experts only (the
    largest offsets), and an expert-parallel slice's (ids past the 64 local experts: the
    sentinel 64, contributing nothing)."""
    gen = torch.Generator().manual_seed(seed)
    uniform = torch.rand(rows, E, generator=gen).topk(TOP_K, dim=1).indices
    return {"uniform": uniform,
            "skewed": torch.randperm(E, generator=gen)[:TOP_K].repeat(rows, 1),
            "last": E - 1 - torch.rand(rows, 12, generator=gen).topk(TOP_K, dim=1).indices,
            "ep_slice": uniform.clamp(max=E // 2)}
