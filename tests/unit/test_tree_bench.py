"""scripts.bench.tree on the bundled pair: the run writes its JSON and plot, trees equal the chain
token for token (greedy), and bad arguments are refused by name."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.bench.tree", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_tree_bench_one_regime_writes_json_and_plot(tmp_path) -> None:
    out = tmp_path / "tree.json"
    res = bench("--steps", "3", "--trees", "2x6", "--prompts", "1", "--new-tokens", "6",
                "--repeats", "1", "--regimes", "repetitive", "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "[tree] built and warmed tree3/2x6 (2/2" in res.stdout
    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"repetitive chain3", "repetitive tree3/2x6"}
    assert all(s["equal_to_chain"] for s in data["summary"].values())
    assert "tree3/2x6" in data["calibration"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_tree_bench_refuses_bad_arguments() -> None:
    res = bench("--ways", "graphs")
    assert res.returncode != 0 and "--ways graphs: CUDA graphs need --device cuda" in res.stderr
    res = bench("--regimes", "nonsense", "--steps", "3", "--trees", "2x6")
    assert res.returncode != 0 and "--regimes: unknown ['nonsense']" in res.stderr
