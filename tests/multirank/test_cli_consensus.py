"""The consensus command end to end under torchrun, as a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from collectives import free_port
from consensus_reference import adversarial_traces, phased_traces, simulate, write_traces
from adaptive_dist.config import AdaptiveConfig

pytestmark = pytest.mark.multirank


def torchrun(nproc: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "-m", "adaptive_dist", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "adaptive_dist", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    assert "consensus" in out.stdout and "config" in out.stdout


def test_consensus_three_ranks_matches_reference(tmp_path):
    traces = adversarial_traces(3, rounds=150, seed=11)
    write_traces(traces, tmp_path / "tr")
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps({"reducer": "min", "min_dwell_rounds": 4, "warmup_batches": 4}))
    out_file = tmp_path / "out.jsonl"
    res = torchrun(3, "consensus", "--trace", str(tmp_path / "tr"), "--policy", "ema",
                   "--config", str(cfg_file), "--out", str(out_file), "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    last = [ln for ln in res.stdout.splitlines() if ln.strip()][-1]
    assert last.startswith("lockstep OK"), res.stdout
    lines = [json.loads(ln) for ln in out_file.read_text().splitlines()]
    assert set(lines[0]) == {"round", "rank", "steps", "local_ema", "global_ema", "switched", "graph"}
    cfg = AdaptiveConfig.from_file(cfg_file).to_dict()
    assert lines == simulate(traces, cfg, "ema")


def test_unknown_config_key_refused_on_every_rank(tmp_path):
    write_traces(adversarial_traces(2, rounds=20, seed=1), tmp_path / "tr")
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps({"ema_alfa": 0.3}))
    res = torchrun(2, "consensus", "--trace", str(tmp_path / "tr"), "--config", str(cfg_file))
    assert res.returncode != 0
    msgs = [ln for ln in res.stderr.splitlines() if "error:" in ln and "ema_alfa" in ln]
    assert len(msgs) == 2, res.stderr[-3000:]          # one line from each rank
    assert len({m.split("] ", 1)[1] for m in msgs}) == 1  # the same message


def test_missing_trace_for_a_rank_refused(tmp_path):
    write_traces(adversarial_traces(1, rounds=20, seed=1), tmp_path / "tr")
    res = torchrun(2, "consensus", "--trace", str(tmp_path / "tr"))
    assert res.returncode != 0
    assert "rank1.jsonl" in res.stderr


def test_config_given_with_static_policy_refused(tmp_path):
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text("{}")
    res = subprocess.run([sys.executable, "-m", "adaptive_dist", "config", "--policy", "static",
                          "--config", str(cfg_file)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "adaptive mode is off" in res.stderr


def test_flags_that_change_the_collectives_must_agree(tmp_path):
    """--no-progress on one rank only would change the sequence of collectives: refused by
    name on every rank at start-up instead of hanging later."""
    import rank_jobs
    from multirank import run_ranks

    write_traces(adversarial_traces(2, rounds=20, seed=3), tmp_path / "tr")
    res = run_ranks(rank_jobs.progress_mismatch_job, 2, str(tmp_path / "tr"), timeout=60)
    msgs = {r.value for r in res}
    assert len(msgs) == 1 and "progress" in msgs.pop()


GOODPUT_FILE = {"candidate_steps": [0, 1, 3, 7], "initial_steps": 3, "reducer": "max",
                "warmup_batches": 2, "update_interval": 2, "probe_every": 2,
                "round_cost": {"2": {"0": 1.0, "1": 1.3, "3": 1.7, "7": 2.6},
                               "64": {"0": 3.0, "1": 4.5, "3": 6.0, "7": 10.0}}}


@pytest.mark.parametrize("reducer", ["max", "mixture"])
def test_consensus_goodput_matches_reference(tmp_path, reducer):
    traces = phased_traces(3, rounds=120, seed=5)
    write_traces(traces, tmp_path / "tr")
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps({**GOODPUT_FILE, "reducer": reducer}))
    out_file = tmp_path / "out.jsonl"
    res = torchrun(3, "consensus", "--trace", str(tmp_path / "tr"), "--policy", "goodput",
                   "--config", str(cfg_file), "--out", str(out_file), "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines[-1].startswith("lockstep OK"), res.stdout
    assert "policy goodput" in lines[0]
    assert any(ln.startswith("final local acceptance rate") and "probes out of depth 0" in ln
               for ln in lines)
    got = [json.loads(ln) for ln in out_file.read_text().splitlines()]
    cfg = AdaptiveConfig.from_dict({**GOODPUT_FILE, "reducer": reducer,
                                    "policy": "goodput"}).to_dict()
    assert got == simulate(traces, cfg, "goodput")
    # depth 0 and back on the replay's shadow checks (no probe), and deep
    assert any(rec["steps"] == 0 and rec["switched"] and not rec["probe"] for rec in got)
    assert any(rec["steps"] == 7 for rec in got)


def test_consensus_goodput_without_round_cost_refused_on_every_rank(tmp_path):
    write_traces(adversarial_traces(2, rounds=20, seed=1), tmp_path / "tr")
    res = torchrun(2, "consensus", "--trace", str(tmp_path / "tr"), "--policy", "goodput")
    assert res.returncode != 0 and "exitcode  : 2" in res.stderr, res.stderr[-3000:]
    msgs = [ln for ln in res.stderr.splitlines() if "error:" in ln and "needs round_cost" in ln]
    assert len(msgs) == 2, res.stderr[-3000:]
    assert len({m.split("] ", 1)[1] for m in msgs}) == 1
    assert "--config" in msgs[0] and "consensus-only" in msgs[0]


def test_config_command_goodput(tmp_path):
    cmd = [sys.executable, "-m", "adaptive_dist", "config", "--policy", "goodput"]
    res = subprocess.run(cmd + ["--for", "engine"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    shown = json.loads(res.stdout)
    assert shown["policy"] == "goodput" and shown["round_cost"] is None
    assert shown["switch_margin"] == 0.05 and shown["probe_every"] == 8
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps({"round_cost": {"1": 1.0, "3": 1.5}}))
    res = subprocess.run(cmd + ["--config", str(cfg_file)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "missing ['0', '7']" in res.stderr   # goodput's 0, 1, 3, 7
