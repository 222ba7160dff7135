"""`scripts.bench.startup` on the CPU: one real `serve` start with its timeline read back, and
the capture count (issue 34 §1)."""
from __future__ import annotations

import json

from scripts.bench import startup


def test_one_server_start_is_timed_step_by_step(tmp_path):
    code = startup.main(["--device", "cpu", "--runs", "no-spec", "--max-batch-size", "2",
                         "--max-model-len", "128", "--out", str(tmp_path)])
    assert code == 0
    run = json.loads((tmp_path / "startup.json").read_text())["runs"][0]
    steps = [e["step"] for e in run["events"] if "step" in e]
    assert steps[0] == "begin" and steps[-1] == "ready" and "loading" in steps
    assert run["first_request"]["status"] == 200 and run["first_request"]["text"] is not None
    assert run["ready_s"] > 0 and "loading" in run["seconds_by_step"]
    assert run["memory_split"]["kv"] > 0


def test_count_gives_the_captures_per_family(tmp_path):
    assert startup.main(["--count", "--no-time", "--max-batch-size", "4", "--max-model-len",
                         "64", "--runs", "no-spec,goodput", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "count.json").read_text())
    for mode in ("no-spec", "goodput"):
        fams = got[mode]["families"]
        assert got[mode]["captures"] == sum(f["count"] for f in fams.values()) > 0
        assert any(name.startswith("prefill") for name in fams) and "target" in fams
    assert "draft" in got["goodput"]["families"] and "draft" not in got["no-spec"]["families"]
    assert got["goodput"]["cost_table_rounds"] > 0 == got["no-spec"]["cost_table_rounds"]
