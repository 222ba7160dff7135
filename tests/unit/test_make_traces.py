"""scripts.gen.make_traces: ``--out`` is checked before anything is written, each rank file is
written whole or not at all, and stale rank files of another run are refused."""
from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path


from adaptive_dist import outputs
from adaptive_dist.trace import load_trace

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.gen.make_traces", *argv],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_writes_one_readable_file_per_rank(tmp_path):
    out = tmp_path / "a" / "b"  # parents are created, as mkdir -p would
    res = _run("--ranks", "3", "--rounds", "40", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["rank0.jsonl", "rank1.jsonl", "rank2.jsonl"]
    assert len(load_trace(out, 0, world_size=3)) == 40


def test_out_naming_a_file_is_refused_before_writing(tmp_path):
    f = tmp_path / "f"
    f.write_text("keep")
    res = _run("--out", str(f))
    assert res.returncode == 2 and f.read_text() == "keep"
    assert res.stderr.strip() == f"make_traces.py: error: --out '{f}' is a file, not a directory"


def test_stale_rank_files_of_another_run_are_refused(tmp_path):
    assert _run("--ranks", "4", "--rounds", "10", "--out", str(tmp_path)).returncode == 0
    res = _run("--ranks", "2", "--rounds", "10", "--out", str(tmp_path))
    assert res.returncode == 2
    assert "already holds rank2.jsonl, rank3.jsonl from another run" in res.stderr


def test_a_full_disk_leaves_no_torn_rank_file(tmp_path, monkeypatch):
    from scripts.gen import make_traces as mod

    calls = {"n": 0}
    real_write = outputs.os.write

    def write(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] > 1:  # rank0.jsonl (one chunk) is written, rank1.jsonl hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(outputs.os, "write", write)
    monkeypatch.setattr(sys, "argv", ["make_traces.py", "--ranks", "2", "--rounds", "20",
                                      "--out", str(tmp_path)])
    assert mod.main() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.jsonl"]  # no rank1, no temp
    assert len(load_trace(tmp_path, 0)) == 20
