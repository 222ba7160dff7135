"""Shared test set-up.

Three tiers, one folder each: ``unit/`` (pure logic and single-process engines on CPU),
``multirank/`` (real processes and real gloo process groups through ``multirank.run_ranks`` or
torchrun), ``gpu/`` (CUDA, NCCL, CUDA graphs, flashinfer; skipped cleanly without GPUs).
The helpers (``engine_fixtures``, ``multirank``, ``rank_jobs``, ``consensus_reference``) sit in
this folder, which pytest puts on ``sys.path`` (spawned ranks inherit it).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Without a GPU, triton's kernels (workers.kernels) run in its interpreter: the switch must be set
# before triton is first imported.
if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "" or not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test by its folder, so ``-m gpu`` / ``-m multirank`` select a tier, and skip
    the GPU tier when CUDA has no device."""
    import torch

    cuda = torch.cuda.is_available()
    for item in items:
        tier = Path(str(item.fspath)).resolve().parent.name
        if tier == "gpu":
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif tier == "multirank":
            item.add_marker(pytest.mark.multirank)
