"""The guard's log comparison (pure logic) and small input checks found in review."""
from __future__ import annotations

import pytest

from adaptive_dist.trace import TraceError, parse_round
from collectives.guard import first_difference, is_prefix_gap
from collectives.recorder import CollectiveEntry


def _log(seqs, odd="all_reduce", even="all_gather", swap=None):
    return [CollectiveEntry(s, "x" if s == swap else (odd if s % 2 else even), "dp", (4,),
                            "float32") for s in seqs]


def test_truncated_windows_of_a_stalled_rank_are_not_a_divergence():
    # rank 1 is 5 collectives behind and both windows were truncated at different places
    logs = {0: _log(range(10, 20)), 1: _log(range(5, 15))}
    assert is_prefix_gap(logs)
    assert first_difference(logs).startswith("first differing collective is #15")


def test_a_different_collective_is_named_by_sequence_number():
    logs = {0: _log(range(10, 20)), 1: _log(range(5, 15), swap=12)}
    assert not is_prefix_gap(logs)
    msg = first_difference(logs)
    assert msg.startswith("first differing collective is #12") and "rank 1: #12 x(" in msg


def test_identical_logs_have_no_difference():
    assert first_difference({0: _log(range(8)), 1: _log(range(8))}) is None


def test_counts_beyond_float64_exactness_are_refused():
    with pytest.raises(TraceError, match="2\\*\\*53"):
        parse_round('{"accept": [1], "num_tokens": %d}' % 2 ** 60, "t:1")
    with pytest.raises(TraceError, match="2\\*\\*53"):
        parse_round('{"accept": [%d]}' % 2 ** 60, "t:1")
