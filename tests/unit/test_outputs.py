"""Output paths are checked at start-up, naming the flag, and written whole or not at all."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive_dist import outputs
from adaptive_dist.outputs import OutputError, check_output_dir, check_output_file, write_lines


def test_missing_parent_directory_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(OutputError, match=r"^--out '.*/nope/x.jsonl': directory '.*/nope' does not exist"):
        check_output_file(str(tmp_path / "nope" / "x.jsonl"), "--out")


def test_a_directory_given_as_the_file_is_refused(tmp_path):
    with pytest.raises(OutputError, match=r"^--out '.*' is a directory; give the path of a file"):
        check_output_file(str(tmp_path), "--out")


def test_a_file_given_as_the_parent_directory_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match=r"--out '.*/f/x.jsonl': '.*/f' is not a directory"):
        check_output_file(str(tmp_path / "f" / "x.jsonl"), "--out")


def test_record_dir_naming_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match=r"^--record-dir '.*/f' is a file, not a directory"):
        check_output_dir(str(tmp_path / "f"), "--record-dir")


def test_record_dir_is_created_when_missing(tmp_path):
    check_output_dir(str(tmp_path / "a" / "b"), "--record-dir")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


def _unprivileged(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` where file permissions apply: as is for a normal user; for root, without
    the capabilities that bypass them (root can write a mode-444 file)."""
    cmd = [sys.executable, "-c", code, *args]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: permissions cannot be enforced")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


CHECK = """
import sys
from adaptive_dist.outputs import OutputError, check_output_dir, check_output_file
check = check_output_dir if sys.argv[2] == "dir" else check_output_file
try:
    check(sys.argv[1], sys.argv[3])
    print("accepted")
except OutputError as exc:
    print(exc)
"""


def test_an_unwritable_file_is_refused(tmp_path):
    f = tmp_path / "ro.jsonl"
    f.write_text("old\n")
    f.chmod(0o444)
    res = _unprivileged(CHECK, str(f), "file", "--out")
    assert res.stdout.startswith(f"--out '{f}' is not writable: Permission denied"), res
    assert f.read_text() == "old\n"


def test_an_unwritable_directory_is_refused(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        res = _unprivileged(CHECK, str(d / "x.jsonl"), "file", "--out")
        assert res.stdout.startswith(f"--out '{d}/x.jsonl': cannot create files in '{d}': "
                                     f"Permission denied"), res
        res = _unprivileged(CHECK, str(d / "sub"), "dir", "--record-dir")
        assert res.stdout.startswith(f"--record-dir '{d}/sub': cannot create the directory"), res
    finally:
        d.chmod(0o755)


def test_a_full_disk_leaves_the_old_file_whole_and_says_how_many_lines(tmp_path, monkeypatch):
    target = tmp_path / "out.jsonl"
    target.write_text("old 1\nold 2\n")
    budget = {"bytes": 25}  # 2 lines of 10 bytes fit, the third is torn by a full disk
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        if budget["bytes"] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, data[: budget["bytes"]])
        budget["bytes"] -= n
        return n

    monkeypatch.setattr(outputs.os, "write", write)
    lines = [f"line {i:04d}" for i in range(5)]  # 9 characters + newline each
    with pytest.raises(OutputError) as info:
        write_lines(str(target), lines, "--out")
    assert str(info.value) == (f"--out '{target}': write failed with 2 of 5 lines complete (No "
                               f"space left on device); '{target}' was left as it was (no partial "
                               f"file)")
    assert target.read_text() == "old 1\nold 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]  # no temporary left


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")

    def crash(fd: int, data: bytes) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs.os, "write", crash)
    with pytest.raises(KeyboardInterrupt):
        write_lines(str(target), ["new"], "--out")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_dev_full_gets_whole_lines_and_the_count_of_complete_ones():
    with pytest.raises(OutputError, match=r"^--out '/dev/full': write failed with 0 of 3 lines "
                                          r"complete \(No space left on device\)"):
        write_lines("/dev/full", ["a", "b", "c"], "--out")


def test_a_write_replaces_the_file_whole_and_keeps_its_mode(tmp_path):
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    target.chmod(0o640)
    assert write_lines(str(target), [f"{i}" for i in range(100_000)], "--out") == 100_000
    text = target.read_text()
    assert text.endswith("99999\n") and text.count("\n") == 100_000
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
