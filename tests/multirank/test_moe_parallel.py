"""MoE targets on real gloo process groups: a Qwen3-MoE target built and saved by transformers, an
EAGLE-3 head over it; experts split by width (``--moe-parallel tp``) or whole per rank (``ep``),
under ``--tp 2``, ``--dp 2`` (heterogeneous load: one replica idle for most rounds) and
``--dp 2 --attn-tp 2``. Greedy outputs equal one process without speculation at static depths,
adaptive and with a forced switch every round; every rank issued the same collectives (the
routing never shapes one) and made the same decisions. A Qwen2-MoE target (a gated shared expert,
its width split over the world in both modes) at ``--dp 2`` in ``ep`` and ``--tp 2`` in ``tp``."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dp_jobs
from engine_fixtures import engine_for, random_prompts
from multirank import run_ranks
from workers.model import load_llama
from workers.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank
VOCAB = 96
PROMPTS = [random_prompts(1, VOCAB, seed=21, lo=3, hi=5), random_prompts(4, VOCAB, seed=22)]
NEW = [[3], [20, 9, 24, 14]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """8 experts (top 2, normalised) of width 16, every layer sparse but layer 2; float32."""
    from hf_models import moe_pair
    return moe_pair(tmp_path_factory.mktemp("moe_pair"), VOCAB)


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory) -> Path:
    """The same shape as Qwen2-MoE (top 2 unnormalised) with a shared expert of width 24."""
    from hf_models import moe_pair
    return moe_pair(tmp_path_factory.mktemp("qwen2_moe_pair"), VOCAB, shared_expert_width=24)


def _reference(root: Path, prompts, new_tokens) -> list[list[list[int]]]:
    target = load_llama(root / "target", dtype=torch.float64)
    return [[r.output_ids for r in engine_for(target, None, "nospec").generate(
        mine, [SamplingParams(max_new_tokens=n) for n in lens])]
        for mine, lens in zip(prompts, new_tokens)]


def _check(results, modes, reference) -> None:
    for res in results:
        for mode in modes:
            assert res.value[mode]["outputs"] == reference[res.value["replica"]], \
                f"rank {res.rank}, {mode}"
    for mode in modes:
        first = results[0].value[mode]
        for res in results[1:]:
            assert res.value[mode]["log"] == first["log"], f"{mode}: collective logs differ"
            assert res.value[mode]["timeline"] == first["timeline"], mode


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_moe_dp2_lossless_in_lockstep(moe_dir: Path, moe: str) -> None:
    modes = ["nospec", "static1", "static3", "static7", "ema", "forced", "goodput"]
    if moe == "tp":   # the split that differs in the MLP only: fewer modes
        modes = ["nospec", "static3", "forced"]
    results = run_ranks(dp_jobs.generate_job, 2, str(moe_dir), 2, modes, PROMPTS, NEW, 0.0, 0,
                        False, moe, timeout=300)
    _check(results, modes, _reference(moe_dir, PROMPTS, NEW))
    busy = next(r.value for r in results if r.value["replica"] == 1)
    assert busy["forced"]["switches"] >= busy["forced"]["rounds"] - 2


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_moe_tp2_lossless(moe_dir: Path, moe: str) -> None:
    prompts, new = [PROMPTS[1]], [NEW[1]]
    modes = ["static3", "ema"]
    results = run_ranks(dp_jobs.generate_job, 2, str(moe_dir), 1, modes, prompts, new, 0.0, 0,
                        False, moe, timeout=300)
    _check(results, modes, _reference(moe_dir, prompts, new))


def test_moe_dp2_attn_tp2_ep_lossless(moe_dir: Path) -> None:
    modes = ["static3", "forced"]
    results = run_ranks(dp_jobs.generate_job, 4, str(moe_dir), 2, modes, PROMPTS, NEW, 0.0, 0,
                        False, "ep", timeout=400)
    _check(results, modes, _reference(moe_dir, PROMPTS, NEW))


@pytest.mark.parametrize("dp, moe", [(2, "ep"), (1, "tp")], ids=["dp2-ep", "tp2-tp"])
def test_qwen2_moe_shared_expert_lossless(qwen2_moe_dir: Path, dp: int, moe: str) -> None:
    """Each rank scales its slice of the shared expert by the replicated gate before the sum."""
    assert load_llama(qwen2_moe_dir / "target").model.layers[0].ffn.shared_expert is not None
    prompts, new = (PROMPTS, NEW) if dp == 2 else ([PROMPTS[1]], [NEW[1]])
    modes = ["nospec", "static3", "forced"] if dp == 2 else ["static3", "forced"]
    results = run_ranks(dp_jobs.generate_job, 2, str(qwen2_moe_dir), dp, modes, prompts, new, 0.0,
                        0, False, moe, timeout=300)
    _check(results, modes, _reference(qwen2_moe_dir, prompts, new))
