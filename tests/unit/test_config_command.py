"""`config` checks a file as `consensus` does (one check for both, issue 34 §4), and a
one-process run words its start-up failures for one process."""
from __future__ import annotations

import json

import pytest

from adaptive_dist.cli import main

GOODPUT_COST = {"round_cost": {"0": 1.0, "1": 1.2, "3": 1.5, "7": 2.2}}


@pytest.fixture(autouse=True)
def _quiet_torch(monkeypatch):
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "FATAL")  # main() would set it for the process


def _run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, [ln for ln in err.splitlines() if ln.strip()]


@pytest.mark.parametrize("policy,content", [
    ("goodput", {"round_cost": None}),                  # the file the issue found
    ("goodput", None),                                  # no file: goodput's defaults, no table
    ("goodput", {"candidate_steps": [1, 3]}),           # no table
    ("goodput", GOODPUT_COST),                          # accepted by both
    ("goodput", {"round_cost": {"1": 1.0, "3": 1.5}}),  # misses candidates 0 and 7
    ("ema", {"ema_alfa": 0.3}),                         # unknown key
    ("ema", GOODPUT_COST),                              # round_cost with another policy
    ("ema", {"ema_alpha": 0.3}),
], ids=["round_cost-null", "no-file", "no-table", "table", "short-table", "unknown-key",
        "table-with-ema", "ema"])
def test_config_refuses_exactly_what_consensus_refuses(capsys, tmp_path, policy, content):
    trace = tmp_path / "tr"
    trace.mkdir()
    (trace / "rank0.jsonl").write_text('{"accept": [1, 2]}\n' * 20)
    given = []
    if content is not None:
        (tmp_path / "cfg.json").write_text(json.dumps(content))
        given = ["--config", str(tmp_path / "cfg.json")]
    c_code, c_out, c_err = _run(capsys, "config", "--policy", policy, *given)
    r_code, r_out, r_err = _run(capsys, "consensus", "--trace", str(trace), "--policy", policy,
                                "--no-progress", *given)
    assert c_code == r_code, (c_err, r_err)
    if r_code == 0:
        assert json.loads(c_out)["policy"] == policy and r_out.splitlines()[-1].startswith(
            "lockstep OK")
        return
    assert c_code == 2 and c_out == "" and r_out == "" and len(c_err) == len(r_err) == 1
    # the same message; the consensus names the start-up step it failed in
    prefix = "[rank 0] error: "
    assert c_err[0].startswith(prefix) and r_err[0].startswith(prefix + "configuration check "
                                                                         "failed: ")
    assert r_err[0] == prefix + "configuration check failed: " + c_err[0][len(prefix):]


def test_config_for_the_engine_leaves_round_cost_to_the_measurement(capsys, tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"round_cost": None}))
    code, out, err = _run(capsys, "config", "--policy", "goodput", "--config",
                          str(tmp_path / "cfg.json"), "--for", "engine")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["policy"] == "goodput" and shown["round_cost"] is None
    code, out, err = _run(capsys, "config", "--policy", "goodput", "--config",
                          str(tmp_path / "cfg.json"))
    assert code == 2 and out == "" and "needs round_cost" in err[0], err


def test_a_one_process_start_up_failure_names_no_ranks(capsys, tmp_path):
    """A one-process job has no peers: its failure says what failed, not 'on every rank:
    rank(s) [0]'."""
    (tmp_path / "tr").mkdir()
    code, out, err = _run(capsys, "consensus", "--trace", str(tmp_path / "tr"), "--out",
                          str(tmp_path / "tr"), "--no-progress")
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("[rank 0] error: checking the output paths failed: --out "), err
    assert "every rank" not in err[0] and "rank(s)" not in err[0], err
