"""The consensus command's single-process failures: one line naming the flag, the right exit
code, before any replay; ``--help`` without torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adaptive_dist.cli import build_parser, main


@pytest.fixture(autouse=True)
def _quiet_torch(monkeypatch):
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "FATAL")  # main() would set it for the process


def _trace_dir(tmp_path, lines=('{"accept": [1, 2]}',) * 30):
    d = tmp_path / "tr"
    d.mkdir()
    (d / "rank0.jsonl").write_text("".join(line + "\n" for line in lines))
    return d


def _run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, [ln for ln in err.splitlines() if ln.strip()]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0", "-1", "ten"])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_at_parse_time(capsys, tmp_path, value):
    code, out, err = _run(capsys, "consensus", "--trace", str(tmp_path), f"--timeout={value}")
    assert code == 2 and out == ""
    assert len(err) == 1, err
    assert err[0].startswith("[rank 0] error: python -m adaptive_dist consensus: argument "
                             f"--timeout: '{value}'"), err


def test_consensus_flags_have_help_text():
    sub = build_parser()._subparsers._group_actions[0].choices["consensus"]
    helps = {a.option_strings[0]: a.help for a in sub._actions if a.option_strings}
    for flag in ("--trace", "--policy", "--config", "--initial-steps", "--out", "--no-progress",
                 "--timeout", "--backend", "--strict-lockstep", "--record-dir"):
        assert helps.get(flag), f"{flag} has no help text"


def test_output_paths_are_checked_before_the_traces_are_read(capsys, tmp_path):
    trace = _trace_dir(tmp_path, lines=("not json",))  # would fail too, but later
    code, out, err = _run(capsys, "consensus", "--trace", str(trace), "--out",
                          str(tmp_path / "missing" / "out.jsonl"), "--no-progress")
    assert code == 2 and out == "" and len(err) == 1, err
    assert "--out" in err[0] and "missing' does not exist" in err[0] and "rank0.jsonl" not in err[0]


@pytest.mark.parametrize("flag,make,needle", [
    ("--out", lambda p: p.mkdir(), "is a directory"),
    ("--record-dir", lambda p: p.write_text("x"), "is a file, not a directory"),
])
def test_an_output_path_of_the_wrong_kind_is_refused(capsys, tmp_path, flag, make, needle):
    target = tmp_path / "target"
    make(target)
    code, out, err = _run(capsys, "consensus", "--trace", str(_trace_dir(tmp_path)), flag,
                          str(target), "--no-progress")
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("[rank 0] error: checking the output paths failed") and flag in err[0]
    assert needle in err[0]


def test_out_must_not_overwrite_a_trace_file(capsys, tmp_path):
    trace = _trace_dir(tmp_path)
    code, _, err = _run(capsys, "consensus", "--trace", str(trace), "--out",
                        str(trace / "rank0.jsonl"), "--no-progress")
    assert code == 2 and "would overwrite a trace file" in err[0]


@pytest.mark.skipif(sys.platform != "linux", reason="needs /dev/full")
def test_a_full_disk_at_the_end_is_one_line_with_the_complete_line_count(capsys, tmp_path):
    code, out, err = _run(capsys, "consensus", "--trace", str(_trace_dir(tmp_path)), "--out",
                          "/dev/full", "--no-progress")
    assert code == 2 and out == "" and len(err) == 1, err
    assert "--out '/dev/full': write failed with 0 of 30 lines complete (No space left on device)" in err[0]


def test_record_dir_and_out_are_written_whole(capsys, tmp_path):
    out_file, rec = tmp_path / "out.jsonl", tmp_path / "rec" / "deep"
    code, out, err = _run(capsys, "consensus", "--trace", str(_trace_dir(tmp_path)), "--out",
                          str(out_file), "--record-dir", str(rec), "--no-progress")
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith("lockstep OK")
    assert len([json.loads(ln) for ln in out_file.read_text().splitlines()]) == 30
    assert sorted(p.name for p in rec.iterdir()) == ["collectives.rank0.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "rec", "tr"]


def test_empty_traces_summary_has_no_blank_value(capsys, tmp_path):
    code, out, err = _run(capsys, "consensus", "--trace", str(_trace_dir(tmp_path, lines=())),
                          "--no-progress")
    assert code == 0, err
    assert "final local EMA: none (no round had requests on any rank)" in out


def test_help_and_the_parser_do_not_import_torch():
    """adaptive_dist's side of ``--help`` (the built-in commands; plug-ins are their own)."""
    code = ("import sys\n"
            "import adaptive_dist, collectives, adaptive_dist.cli as cli\n"
            "p = cli.Parser(prog='x'); sub = p.add_subparsers()\n"
            "cli.register_consensus(sub); cli.register_config(sub)\n"
            "p.format_help(); sub.choices['consensus'].format_help()\n"
            "from collectives import CollectiveTimeoutError, DivergenceError, EXIT_TIMEOUT\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout
