"""Flags are never abbreviated: a prefix of a flag (`--served 1` for `--served-model-name 1`) is
refused by every command of ``python -m adaptive_dist``, with the one-line error and exit code 2,
while the whole flag still parses."""
from __future__ import annotations

import subprocess
import sys

import pytest

from adaptive_dist.cli import EXIT_CONFIG, build_parser
from workers import cli as generate_cli

# (command line with the whole flag, the same with a prefix of it)
CASES = {
    "generate": (["generate", "--prompt", "a", "--max-new-tokens", "3"],
                 ["generate", "--prompt", "a", "--max-new", "3"]),
    "serve": (["serve", "--served-model-name", "1"], ["serve", "--served", "1"]),
    "serve (engine flag)": (["serve", "--max-batch-size", "2"], ["serve", "--max-batch", "2"]),
    "client": (["client", "--prompt", "a", "--max-tokens", "3"],
               ["client", "--prompt", "a", "--max-tok", "3"]),
    "consensus": (["consensus", "--trace", "t", "--initial-steps", "3"],
                  ["consensus", "--trace", "t", "--initial", "3"]),
    "config": (["config", "--policy", "ema"], ["config", "--pol", "ema"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_prefix_of_a_flag_is_refused(name, capsys) -> None:
    whole, prefix = CASES[name]
    parser = build_parser()
    parser.parse_args(whole)                      # the whole flag is fine
    with pytest.raises(SystemExit) as info:
        parser.parse_args(prefix)
    assert info.value.code == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {' '.join(prefix[-2:])}" in err, err


def test_generate_alone_refuses_a_prefix_too(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        generate_cli.main(["generate", "--prompt", "a", "--max-new", "3"])
    assert info.value.code == 2
    assert "unrecognized arguments: --max-new 3" in capsys.readouterr().err


def test_serve_with_a_prefix_exits_before_starting() -> None:
    """The reported case: `serve --served 1` started a server named "1"."""
    out = subprocess.run([sys.executable, "-m", "adaptive_dist", "serve", "--served", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert "unrecognized arguments: --served 1" in out.stderr
