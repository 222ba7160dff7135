"""Adaptive draft trees under DP (issue 35 §2), `--dp 2` over gloo:

- greedy goodput over chains and trees (the policy's own choices; and every candidate in turn,
  chains and trees switched at random, seeded alike on both ranks) equals plain greedy decoding
  of one process token for token, under heterogeneous load, every rank making the same
  decisions and issuing the same collectives;
- the hazard: a rank that would run another tree (same steps, another top-k and N) is caught
  before the forwards of that round, on every rank, in bounded time (the tree's code is in the
  round vector's must-agree `tokens` column and in the plan hash), never a hang.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dp_jobs
from engine_fixtures import engine_for, random_prompts, save_pair, tiny_config, tiny_pair
from multirank import run_ranks
from workers.model import load_eagle, load_llama
from workers.sampling import SamplingParams

PROMPTS = [random_prompts(1, 256, seed=21, lo=3, hi=5), random_prompts(5, 256, seed=22)]
NEW = [[3], [24, 9, 30, 16, 20]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    import dataclasses

    cfg = dataclasses.replace(tiny_config(vocab=264, eos=257), bos_token_id=256)
    return save_pair(*tiny_pair(seed=3, cfg=cfg), tmp_path_factory.mktemp("dp_tree_pair"))


def _reference(model_dir: Path) -> list[list[list[int]]]:
    target = load_llama(model_dir / "target", dtype=torch.float64)
    out = []
    for mine, lens in zip(PROMPTS, NEW):
        engine = engine_for(target, None, "nospec")
        reqs = engine.generate(mine, [SamplingParams(max_new_tokens=n) for n in lens])
        out.append([r.output_ids for r in reqs])
    return out


def test_dp2_greedy_adaptive_trees_equal_one_process_in_lockstep(model_dir: Path) -> None:
    modes = ["goodtree", "cycletrees", "cycletrees+overlap"]
    results = run_ranks(dp_jobs.generate_job, 2, str(model_dir), 2, modes, PROMPTS, NEW,
                        timeout=240)
    reference = _reference(model_dir)
    for res in results:
        for mode in modes:
            assert res.value[mode]["outputs"] == reference[res.value["replica"]], \
                f"rank {res.rank} (replica {res.value['replica']}), {mode}"
    for mode in modes:
        first = results[0].value[mode]
        for res in results[1:]:
            got = res.value[mode]
            assert got["timeline"] == first["timeline"] and got["digest"] == first["digest"]
            assert got["log"] == first["log"], f"{mode}: collective logs differ"
    for mode in ("cycletrees", "cycletrees+overlap"):   # trees and chains both ran
        shapes = results[0].value[mode]["shapes"]
        assert any(len(k) == 5 for k in shapes) and any(len(k) == 3 for k in shapes), shapes
        assert results[0].value[mode]["switches"] >= 5


def test_a_rank_that_would_run_another_tree_is_caught_before_its_forwards(model_dir: Path
                                                                          ) -> None:
    prompts = [[[7] * 6], random_prompts(3, 256, seed=5)]
    new = [[30], [40, 40, 40]]
    results = run_ranks(dp_jobs.hazard_job, 2, str(model_dir), "local_tree", prompts, new, 3.0,
                        timeout=90, check=False)
    for res in results:
        assert res.ok, res.traceback
        value = res.value
        assert value["raised"] == "DivergenceError", value
        msg = value["message"]
        # the decision point's check (the plan hash holds the tree), or the next round's
        # pre-flight (the tree's code in the must-agree tokens column)
        assert "decisions differ" in msg or ("pre-flight" in msg and "tokens" in msg), msg
        assert value["elapsed"] < 30


def test_dp2_greedy_per_request_trees_equal_one_process_in_lockstep(model_dir: Path) -> None:
    """Per-request trees (``per_request`` with the trees): each request its own nodes of the
    agreed tree, the verify forward the agreed T packed tokens; under heterogeneous load (1
    request on one replica, 5 on the other) greedy equals one process and both ranks make the
    same decisions and issue the same collectives."""
    modes = ["pertree", "pertree+overlap"]
    results = run_ranks(dp_jobs.generate_job, 2, str(model_dir), 2, modes, PROMPTS, NEW,
                        timeout=240)
    reference = _reference(model_dir)
    for res in results:
        for mode in modes:
            assert res.value[mode]["outputs"] == reference[res.value["replica"]], \
                f"rank {res.rank} (replica {res.value['replica']}), {mode}"
    for mode in modes:
        first = results[0].value[mode]
        for res in results[1:]:
            got = res.value[mode]
            assert got["timeline"] == first["timeline"] and got["digest"] == first["digest"]
            assert got["log"] == first["log"], f"{mode}: collective logs differ"
        assert any(len(k) == 5 for k in first["shapes"]), first["shapes"]


def test_a_rank_that_would_run_another_per_request_tree_is_caught_before_its_forwards(
        model_dir: Path) -> None:
    """Per-request trees: rank 1 alone moves to another tree of the same steps (another top-k
    and N): the next round's pre-flight names the must-agree column (the tree's code rides in
    ``tokens`` beside T), before any device collective of that round, in bounded time."""
    prompts = [[[7] * 6], random_prompts(3, 256, seed=5)]
    new = [[30], [40, 40, 40]]
    results = run_ranks(dp_jobs.hazard_job, 2, str(model_dir), "local_pertree", prompts, new,
                        3.0, timeout=90, check=False)
    for res in results:
        assert res.ok, res.traceback
        value = res.value
        assert value["raised"] == "DivergenceError", value
        msg = value["message"]
        assert "pre-flight" in msg and ("tokens" in msg or "steps" in msg), msg
        assert value["elapsed"] < 30
