"""`generate` on ranks launched by hand (as a multi-node launch does, so each rank can get other
flags): everything that changes the collectives or the tokens is agreed at start-up, and a
difference is the same one line on every rank naming the flag and the ranks (exit 2)."""
from __future__ import annotations

import pytest

from multirank import format_hand, launch_by_hand

START_S = 90.0
BASE = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--timeout", "20"]


def _lines(results) -> list[str]:
    out = []
    for r in results:
        assert r.returncode == 2, format_hand(results)
        assert "Traceback" not in r.stderr, format_hand(results)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith(f"[rank {r.rank}] ")]
        assert len(errors) == 1, format_hand(results)
        out.append(errors[0].split("] ", 1)[1])
    assert len(set(out)) == 1, out
    return out


@pytest.mark.parametrize("rank1,needle", [
    (["--seed", "7"], "--seed (ranks [0] have 0, ranks [1] have 7)"),
    (["--temperature", "0.5"], "--temperature (ranks [0] have 0.0, ranks [1] have 0.5)"),
    (["--no-spec"], "--steps/--adaptive/--no-spec/--config"),
    (["--prompt", "other"], "--prompt/--prompts (contents)"),
])
def test_ranks_with_different_generate_flags_refuse_with_one_line(rank1, needle) -> None:
    res = launch_by_hand([BASE + ["--dp", "2"], BASE + ["--dp", "2"] + rank1], timeout=START_S)
    line = _lines(res)[0]
    assert line.startswith("error: start-up: ranks were started with different settings"), line
    assert needle in line, line
