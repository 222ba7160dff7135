"""Trace files that used to give tracebacks or be silently misread: each refused by name."""
from __future__ import annotations

import pytest

from adaptive_dist.config import AdaptiveConfig
from adaptive_dist.replay import replay, summary
from adaptive_dist.trace import TraceError, load_trace, parse_round
from collectives.group import Group


def _write(d, name: str, data: bytes) -> None:
    (d / name).write_bytes(data)


def test_invalid_utf8_names_the_file_and_line(tmp_path):
    _write(tmp_path, "rank0.jsonl", b'{"accept": [1]}\n{"accept": [2]}\n{"accept": "\xff"}\n')
    with pytest.raises(TraceError, match=rf"^{tmp_path}/rank0.jsonl:3: not valid UTF-8 \(byte 0xff"):
        load_trace(tmp_path, 0)


def test_a_directory_in_place_of_the_rank_file_is_named(tmp_path):
    (tmp_path / "rank0.jsonl").mkdir()
    with pytest.raises(TraceError, match=rf"trace file '{tmp_path}/rank0.jsonl' for rank 0 is a directory"):
        load_trace(tmp_path, 0, world_size=1)


def test_rank_files_beyond_the_world_size_are_refused_by_name(tmp_path):
    for r in (0, 1, 7, 12):
        _write(tmp_path, f"rank{r}.jsonl", b'{"accept": [1]}\n')
    with pytest.raises(TraceError, match=r"holds rank7.jsonl, rank12.jsonl, but this job has 2 "
                                         r"rank\(s\) and reads rank0.jsonl..rank1.jsonl only"):
        load_trace(tmp_path, 0, world_size=2)
    assert load_trace(tmp_path, 0, world_size=13)  # the same directory fits 13 ranks


def test_a_zero_padded_rank_file_is_refused(tmp_path):
    _write(tmp_path, "rank0.jsonl", b'{"accept": [1]}\n')
    _write(tmp_path, "rank01.jsonl", b'{"accept": [1]}\n')
    with pytest.raises(TraceError, match="holds rank01.jsonl"):
        load_trace(tmp_path, 0, world_size=2)


def test_a_duplicate_key_names_file_line_and_key(tmp_path):
    _write(tmp_path, "rank0.jsonl", b'{"accept": [1]}\n{"accept": [1], "accept": [5]}\n')
    with pytest.raises(TraceError, match=rf"^{tmp_path}/rank0.jsonl:2: duplicate key 'accept'"):
        load_trace(tmp_path, 0)
    with pytest.raises(TraceError, match="t:9: duplicate key 'can_graph'"):
        parse_round('{"accept": [], "can_graph": true, "can_graph": false}', "t:9")


def test_empty_rank_files_give_a_summary_without_blanks(tmp_path):
    _write(tmp_path, "rank0.jsonl", b"")
    trace = load_trace(tmp_path, 0, world_size=1)
    cfg = AdaptiveConfig()
    result = replay(trace, cfg, Group.single())
    text = summary(result.records, result, 1, cfg, None, 0)
    assert "final local EMA: none (no round had requests on any rank)" in text
    assert not any(line.rstrip().endswith(":") for line in text.splitlines()), text
    assert text.splitlines()[-1].startswith("lockstep OK")
