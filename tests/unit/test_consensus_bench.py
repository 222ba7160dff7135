"""The consensus bench's figures (scripts/bench/consensus.py, issue 37): the collective's time
counts from the last rank's call, the skew apart, from every rank's clock readings."""
from __future__ import annotations

import numpy as np
import pytest

from scripts.bench import consensus as bench


def test_figures_count_from_the_last_call():
    # 3 ranks, 2 iterations; readings in seconds: [rank, iteration, (call, return)]
    t = np.array([[[0.000100, 0.000400], [1.0, 1.000050]],
                  [[0.000300, 0.000390], [1.000020, 1.000060]],
                  [[0.000350, 0.000380], [1.000010, 1.000040]]])
    f = bench.figures(t, steady=False)
    assert f["from_last_us"] == pytest.approx([400 - 350, 60 - 20])   # last return - last call
    assert f["rank0_us"] == pytest.approx([300, 50])                   # the skew included
    assert f["skew_us"] == pytest.approx([250, 20])


def test_steady_figures_are_per_call_and_have_no_skew():
    # readings after the first call and after the last of STEADY calls
    t = np.array([[[0.0, 0.000300]], [[0.000030, 0.000330]]])
    f = bench.figures(t, steady=True)
    assert f["from_last_us"] == pytest.approx([300 / (bench.STEADY - 1)])
    assert f["rank0_us"] == pytest.approx([300 / (bench.STEADY - 1)])
    assert "skew_us" not in f


def test_an_older_run_reads_as_rank_0s_time():
    old = {"cases": {"reduce_shm": {"median_us": 142.0, "p90_us": 199.0}}}
    new = {"cases": {"reduce_shm": {"from_last_us": {"median_us": 40.0}, "rank0_us": {}}}}
    assert bench.case_fig(old, "reduce_shm")["median_us"] == 142.0
    assert bench.case_fig(new, "reduce_shm")["median_us"] == 40.0


def test_local_round_and_its_pieces_run():
    """``--local --pieces``: the round's host work and each piece alone, with counted bytecodes
    (a few rounds: that it runs and reports every piece, not how fast)."""
    import argparse

    from scripts.bench.consensus import local

    args = argparse.Namespace(batch=4, rounds=50, repeats=1, warmup=5, cold_us=0.0, pieces=True)
    out = local(args)
    for name in ("round", "reduce", "agreed_decode", "p_encode", "p_pack_unpack", "p_agreed",
                 "p_decode", "p_decide", "p_plan", "p_plan_hash_digest", "p_observe",
                 "p_count_drafts", "p_report"):
        assert out[name]["cpu_us"] > 0 and out[name]["wall_us"] > 0, name
    assert 500 < out["bytecodes_per_round"] < 5000
