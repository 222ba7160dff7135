"""Multi-rank consensus checks on real gloo process groups (2 and 4 CPU ranks)."""
from __future__ import annotations

import dataclasses

import pytest

from adaptive_dist.config import AdaptiveConfig
from consensus_reference import adversarial_traces, phased_traces, simulate, write_traces
from multirank import format_results, run_ranks
import rank_jobs

pytestmark = pytest.mark.multirank

CONFIGS = {
    "default": {},
    "min_dwell": {"reducer": "min", "min_dwell_rounds": 7, "warmup_batches": 3, "update_interval": 2},
    "max_hyst": {"reducer": "max", "up_hysteresis": 0.3, "down_hysteresis": 0.1, "ema_alpha": 0.5,
                 "warmup_batches": 0, "update_interval": 1, "initial_steps": 1},
}


def _cfg(name: str) -> dict:
    return AdaptiveConfig.from_dict(CONFIGS[name]).to_dict()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decisions_identical_and_match_reference(tmp_path, world, name):
    traces = adversarial_traces(world, rounds=160, seed=world * 31 + len(name))
    write_traces(traces, tmp_path)
    cfg = _cfg(name)
    results = run_ranks(rank_jobs.replay_job, world, str(tmp_path), cfg, "ema", timeout=120)
    merged = sorted((rec for r in results for rec in r.value["records"]),
                    key=lambda x: (x["round"], x["rank"]))
    expected = simulate(traces, cfg, "ema")
    assert len(merged) == len(expected)
    for got, want in zip(merged, expected):
        assert got == want, f"first mismatch at round {want['round']} rank {want['rank']}"
    # every rank saw the same decisions: per-round (steps, switched, graph, global_ema) agree
    by_round: dict = {}
    for rec in merged:
        key = (rec["steps"], rec["switched"], rec["graph"], rec["global_ema"])
        by_round.setdefault(rec["round"], set()).add(key)
    assert all(len(v) == 1 for v in by_round.values())
    assert any(rec["switched"] for rec in merged), "traces should make the policy switch"
    # (b) the collective logs of all ranks are identical, and the guard checked them
    logs = [r.value["log"] for r in results]
    assert all(log == logs[0] for log in logs) and len(logs[0]) > 100
    assert len({r.value["digest"] for r in results}) == 1
    assert all(r.value["checks"] > 0 for r in results)


@pytest.mark.parametrize("mode,expect", [
    ("skip_consensus", "first differing collective is #"),
    ("state", "steps"),
    ("reshape", "shape=[8]"),
    ("skip_op", "first differing collective"),
    ("executed", "pre-flight lockstep check failed at round 6"),  # a worker ran another depth
])
def test_injected_divergence_raises_on_every_rank(mode, expect):
    timeout = 3.0
    results = run_ranks(rank_jobs.divergence_job, 2, mode, timeout=60)
    for r in results:
        assert r.value["raised"] == "DivergenceError", format_results(results)
        assert expect in r.value["message"]
        # bounded: the timeout plus the diagnosis grace, never a hang
        assert r.value["elapsed"] < timeout * 2 + 10
    assert results[0].value["message"] == results[1].value["message"]


def test_stuck_rank_ends_the_job_with_timeout_errors():
    """Rank 1 stalls outside any collective: rank 0's collective times out and raises; rank 1's
    watchdog reports and exits with EXIT_TIMEOUT. Nobody hangs."""
    import time
    from collectives import EXIT_TIMEOUT

    t0 = time.monotonic()
    results = run_ranks(rank_jobs.divergence_job, 2, "stall", 12, 5, None, 3.0, True,
                        timeout=60, check=False)
    assert results[0].ok and results[0].value["raised"] == "CollectiveTimeoutError", \
        format_results(results)
    assert "did not complete" in results[0].value["message"]
    assert results[1].exitcode == EXIT_TIMEOUT, format_results(results)
    assert time.monotonic() - t0 < 40


def test_no_divergence_without_injection():
    results = run_ranks(rank_jobs.divergence_job, 2, "none", timeout=60)
    assert all(r.value["raised"] is None for r in results)


def test_different_configs_refuse_with_same_message(tmp_path):
    per_rank = {0: {"dict": {"initial_steps": 3}}, 1: {"dict": {"initial_steps": 7}},
                2: {"dict": {"initial_steps": 3, "reducer": "min"}}}
    results = run_ranks(rank_jobs.config_job, 3, per_rank, timeout=60)
    msgs = {r.value["message"] for r in results}
    assert all(not r.value["ok"] and r.value["type"] == "ConfigMismatchError" for r in results)
    assert len(msgs) == 1
    msg = msgs.pop()
    assert "initial_steps" in msg and "reducer" in msg and "[1]" in msg and "[2]" in msg


def test_bad_config_on_one_rank_stops_every_rank(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"ema_alpha": 0.3, "bogus_key": 1}')
    good = tmp_path / "good.json"
    good.write_text('{"ema_alpha": 0.3}')
    per_rank = {0: {"path": str(good)}, 1: {"path": str(bad)}}
    results = run_ranks(rank_jobs.config_job, 2, per_rank, timeout=60)
    msgs = {r.value["message"] for r in results}
    assert all(not r.value["ok"] for r in results) and len(msgs) == 1
    assert "'bogus_key'" in msgs.pop()


def test_static_policy_never_switches_and_agrees_graph(tmp_path):
    traces = adversarial_traces(3, rounds=120, seed=5)
    traces[1][10] = {"accept": [1, 1], "can_graph": False}
    write_traces(traces, tmp_path)
    results = run_ranks(rank_jobs.static_job, 3, str(tmp_path), 7, timeout=90)
    recs = [rec for r in results for rec in r.value["records"]]
    assert {rec["steps"] for rec in recs} == {7}
    assert not any(rec["switched"] for rec in recs)
    at10 = [rec for rec in recs if rec["round"] == 10]
    assert len(at10) == 3 and not any(rec["graph"] for rec in at10)
    cfg = dataclasses.replace(AdaptiveConfig(), initial_steps=7).to_dict()
    assert sorted(recs, key=lambda x: (x["round"], x["rank"])) == simulate(traces, cfg, "static")


def test_static_policy_refuses_ranks_with_different_steps(tmp_path):
    per_rank = {0: {"path": None, "initial_steps": 3}, 1: {"path": None, "initial_steps": 1}}
    results = run_ranks(rank_jobs.config_job, 2, per_rank, "static", timeout=60)
    msgs = {r.value["message"] for r in results}
    assert all(not r.value["ok"] for r in results) and len(msgs) == 1
    assert "initial_steps" in msgs.pop()


# ====================================================================================== goodput
def _row(k: float) -> dict:
    return {"0": 1.0 * k, "1": 1.25 * k, "3": 1.6 * k, "7": 2.4 * k}


GOODPUT_CONFIGS = {
    # bucketed costs with a depth-0 candidate and probes
    "weighted_mean": {"candidate_steps": [0, 1, 3, 7], "initial_steps": 3, "ema_alpha": 0.3,
                      "warmup_batches": 2, "update_interval": 2, "probe_every": 2,
                      "round_cost": {"1": _row(1.0),
                                     "8": {"0": 1.0, "1": 1.6, "3": 1.9, "7": 2.6},
                                     "64": {"0": 4.0, "1": 5.5, "3": 7.5, "7": 12.0}}},
    # a flat table, dwell and a smaller margin
    "min": {"reducer": "min", "candidate_steps": [0, 1, 3, 7], "min_dwell_rounds": 5,
            "warmup_batches": 3, "update_interval": 3, "probe_every": 3, "switch_margin": 0.02,
            "round_cost": _row(1.0)},
    # each rank's own expected tokens, averaged (ranks that follow different laws)
    "mixture": {"reducer": "mixture", "candidate_steps": [0, 1, 3, 7], "initial_steps": 1,
                "ema_alpha": 0.4, "warmup_batches": 1, "update_interval": 2, "probe_every": 3,
                "round_cost": {"4": _row(1.0), "32": {"0": 2.0, "1": 2.6, "3": 3.6, "7": 6.0}}},
    # no depth 0, two rows (batches past 16 use the "16" row), decisions every round
    "max": {"reducer": "max", "candidate_steps": [1, 2, 4, 8], "initial_steps": 1,
            "switch_margin": 0.1, "warmup_batches": 0, "update_interval": 1, "ema_alpha": 0.5,
            "round_cost": {"4": {"1": 1.0, "2": 1.1, "4": 1.35, "8": 2.0},
                           "16": {"1": 2.0, "2": 2.4, "4": 3.2, "8": 5.5}}},
}


def _goodput_cfg(name: str) -> dict:
    return AdaptiveConfig.from_dict({**GOODPUT_CONFIGS[name], "policy": "goodput"}).to_dict()


def _replay_matches_reference(tmp_path, traces, cfg: dict) -> list[dict]:
    write_traces(traces, tmp_path)
    results = run_ranks(rank_jobs.replay_job, len(traces), str(tmp_path), cfg, "goodput",
                        timeout=120)
    merged = sorted((rec for r in results for rec in r.value["records"]),
                    key=lambda x: (x["round"], x["rank"]))
    expected = simulate(traces, cfg, "goodput")
    assert len(merged) == len(expected)
    for got, want in zip(merged, expected):
        assert got == want, f"first mismatch at round {want['round']} rank {want['rank']}"
    assert len({r.value["digest"] for r in results}) == 1
    logs = [r.value["log"] for r in results]
    assert all(log == logs[0] for log in logs)
    return merged


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(GOODPUT_CONFIGS))
def test_goodput_decisions_identical_and_match_reference(tmp_path, world, name):
    traces = adversarial_traces(world, rounds=160, seed=world * 17 + len(name))
    cfg = _goodput_cfg(name)
    merged = _replay_matches_reference(tmp_path, traces, cfg)
    assert any(rec["switched"] for rec in merged), "traces should make the policy switch"
    # the traces hold surprises: without the reset the reference's records differ
    assert simulate(traces, {**cfg, "reset_nats": 0.0}, "goodput") != merged
    if name == "mixture":   # and its decisions are not the pooled rate's
        pooled = simulate(traces, {**cfg, "reducer": "weighted_mean"}, "goodput")
        assert [r["steps"] for r in pooled] != [r["steps"] for r in merged]
    assert set(merged[0]) == {"round", "rank", "steps", "local_ema", "global_ema", "switched",
                              "graph", "local_ema_fail", "accept_rate", "cost_row", "probe"}
    rows = {rec["cost_row"] for rec in merged}
    assert rows == ({None} if name == "min" else {int(b) for b in cfg["round_cost"]})


def test_goodput_goes_to_zero_and_comes_back_on_two_ranks(tmp_path):
    """Low acceptance on every rank for the first half, high after: the cluster goes to depth
    0 and stays there while acceptance stays low (the replay's shadow checks: one per request of
    a depth-0 round, so no probe is due), then leaves it on the scores — not by a probe — and
    goes deep."""
    traces = phased_traces(2, rounds=200, seed=3)
    cfg = _goodput_cfg("weighted_mean")
    merged = _replay_matches_reference(tmp_path, traces, cfg)
    rank0 = [rec for rec in merged if rec["rank"] == 0]
    first, second = [r for r in rank0 if r["round"] < 100], [r for r in rank0 if r["round"] >= 100]
    assert any(r["steps"] == 0 for r in first)
    assert not any(r["probe"] for r in rank0)
    assert all(r["steps"] == 0 for r in first if r["round"] > 60)   # stays at 0 while low
    left = [r for r in second if r["steps"] == 0 and r["switched"]]
    assert left and left[0]["accept_rate"] is not None             # left on a rate, no probe
    assert second[-1]["steps"] == 7 and min(r["steps"] for r in second[-30:]) > 0


def test_agree_round_cost_takes_the_elementwise_maximum(tmp_path):
    cfg = {"candidate_steps": [0, 1, 3], "initial_steps": 1, "warmup_batches": 0,
           "update_interval": 1}
    measured = {
        0: {1: {0: 0.010, 1: 0.014, 3: 0.020}, 8: {0: 0.030, 1: 0.036, 3: 0.050}},
        1: {1: {0: 0.011, 1: 0.013, 3: 0.022}, 8: {0: 0.029, 1: 0.040, 3: 0.049}},
        2: {8: {0: 0.028, 1: 0.035, 3: 0.051}, 1: {3: 0.019, 1: 0.015, 0: 0.009}},
    }
    results = run_ranks(rank_jobs.round_cost_job, 3, measured, cfg, 6, timeout=60)
    want = {"1": {"0": 0.011, "1": 0.015, "3": 0.022}, "8": {"0": 0.030, "1": 0.040, "3": 0.051}}
    assert all(r.value["ok"] for r in results), format_results(results)
    assert all(r.value["round_cost"] == want for r in results)
    assert len({r.value["digest"] for r in results}) == 1   # ran 6 rounds past the pre-flight
    assert len({r.value["steps"] for r in results}) == 1


@pytest.mark.parametrize("bad,expect", [
    ({1: {0: 0.01, 1: 0.02, 3: 0.03}}, "ranks measured different batch buckets"),
    ({1: {0: 0.01, 1: 0.02, 3: 0.03}, 8: {0: 0.01, 1: float("nan"), 3: 0.03}}, "nan"),
    ({1: {0: 0.01, 1: 0.02}, 8: {0: 0.01, 1: 0.02, 3: 0.03}}, "missing ['3']"),
    ({"1": {0: 0.01, 1: 0.02, 3: 0.03}, 8: {0: 0.01, 1: 0.02, 3: 0.03}}, "must be an integer"),
])
def test_agree_round_cost_refuses_on_every_rank(bad, expect):
    good = {1: {0: 0.01, 1: 0.02, 3: 0.03}, 8: {0: 0.01, 1: 0.02, 3: 0.03}}
    cfg = {"candidate_steps": [0, 1, 3], "initial_steps": 1}
    results = run_ranks(rank_jobs.round_cost_job, 2, {0: good, 1: bad}, cfg, timeout=60)
    msgs = {r.value["message"] for r in results}
    assert all(not r.value["ok"] for r in results) and len(msgs) == 1, format_results(results)
    msg = msgs.pop()
    assert expect in msg and "[1]" in msg and "round cost" in msg
