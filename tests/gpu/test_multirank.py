"""The multi-rank consensus checks on 2 GPUs with NCCL device groups (skipped without them)."""
from __future__ import annotations

import time

import pytest
import torch

from collectives import EXIT_DIVERGENCE
from consensus_reference import adversarial_traces, simulate, write_traces
from multirank import format_results, run_ranks
from adaptive_dist.config import AdaptiveConfig
import rank_jobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL"),
]


@pytest.mark.parametrize("cfg_over", [{}, {"reducer": "max", "min_dwell_rounds": 5}])
def test_nccl_decisions_match_reference(tmp_path, cfg_over):
    traces = adversarial_traces(2, rounds=200, seed=3)
    write_traces(traces, tmp_path)
    cfg = AdaptiveConfig.from_dict(cfg_over).to_dict()
    results = run_ranks(rank_jobs.replay_job, 2, str(tmp_path), cfg, "ema", "nccl", timeout=180)
    merged = sorted((rec for r in results for rec in r.value["records"]),
                    key=lambda x: (x["round"], x["rank"]))
    assert merged == simulate(traces, cfg, "ema")
    assert results[0].value["log"] == results[1].value["log"]


def test_nccl_static_policy(tmp_path):
    traces = adversarial_traces(2, rounds=80, seed=4)
    traces[0][7] = {"accept": [2], "can_graph": False}
    write_traces(traces, tmp_path)
    results = run_ranks(rank_jobs.static_job, 2, str(tmp_path), 3, "nccl", timeout=180)
    recs = [rec for r in results for rec in r.value["records"]]
    assert {rec["steps"] for rec in recs} == {3} and not any(rec["switched"] for rec in recs)
    assert not any(rec["graph"] for rec in recs if rec["round"] == 7)


@pytest.mark.parametrize("mode", ["state", "reshape"])
def test_nccl_divergence_raises_before_issuing(mode):
    results = run_ranks(rank_jobs.divergence_job, 2, mode, 12, 5, "nccl", 5.0, timeout=120)
    for r in results:
        assert r.value["raised"] == "DivergenceError", format_results(results)
    assert results[0].value["message"] == results[1].value["message"]


def test_nccl_skipped_collective_exits_with_divergence():
    """A skipped NCCL collective may never raise on the host: each rank either raises
    DivergenceError (pre-flight saw the corrupted consensus) or its watchdog names the divergence
    and ends it with EXIT_DIVERGENCE, within the timeout plus a few seconds."""
    t0 = time.monotonic()
    results = run_ranks(rank_jobs.divergence_job, 2, "skip_op", 12, 5, "nccl", 5.0, True,
                        timeout=60, check=False)
    for r in results:
        raised = r.ok and r.value["raised"] == "DivergenceError"
        assert raised or r.exitcode == EXIT_DIVERGENCE, format_results(results)
    assert time.monotonic() - t0 < 45


# ---- DP attention on NCCL with CUDA graphs -------------------------------------------------------

def test_nccl_dp2_graphs_lossless_in_lockstep(tmp_path):
    """Two H200s, --dp 2: the MLP's gather/scatter collectives inside the CUDA graphs, forced tier
    switches every round, an idle replica running dummy rows; the same outputs as one CPU
    process without speculation, every graph captured at start-up only."""
    import dataclasses

    import dp_jobs
    from engine_fixtures import engine_for, random_prompts, save_pair, tiny_config, tiny_pair
    from workers.model import load_llama
    from workers.sampling import SamplingParams

    cfg = dataclasses.replace(tiny_config(vocab=264, eos=257), bos_token_id=256)
    save_pair(*tiny_pair(seed=3, cfg=cfg), tmp_path)
    prompts = [random_prompts(1, 256, seed=21, lo=3, hi=5), random_prompts(5, 256, seed=22)]
    new = [[3], [24, 9, 30, 16, 20]]
    target = load_llama(tmp_path / "target", dtype=torch.float64)
    want = [[r.output_ids for r in engine_for(target, None, "nospec").generate(
        p, [SamplingParams(max_new_tokens=n) for n in lens])] for p, lens in zip(prompts, new)]
    modes = ["static3", "ema", "forced", "static3+overlap", "ema+overlap", "forced+overlap"]
    results = run_ranks(dp_jobs.generate_job, 2, str(tmp_path), 2, modes, prompts, new, 0.0, 0,
                        True, timeout=400)
    for res in results:
        for mode in modes:
            got = res.value[mode]
            assert got["outputs"] == want[res.value["replica"]], mode
            assert got["graph_rounds"] > 0 and got["captures"][0] == got["captures"][1] > 0, mode
    for mode in modes:
        a, b = results[0].value[mode], results[1].value[mode]
        assert a["timeline"] == b["timeline"] and a["digest"] == b["digest"], mode
        assert a["log"] == b["log"], mode
    assert results[0].value["forced"]["switches"] >= 3
