"""Unit tests for trace parsing (adaptive_dist.trace), docs/policy.md "Consensus-only mode"."""
from __future__ import annotations

import pytest

from adaptive_dist.trace import TraceError, TraceRound, load_trace, parse_round, trace_path


# ------------------------------------------------------------------------------- good lines
@pytest.mark.parametrize("line,expected", [
    ('{"accept": [3, 0, 7]}', TraceRound((3, 0, 7), None, True)),
    ('{"accept": []}', TraceRound((), None, True)),
    ('{"accept": [1], "num_tokens": 12}', TraceRound((1,), 12, True)),
    ('{"accept": [1], "num_tokens": 0}', TraceRound((1,), 0, True)),
    ('{"accept": [2, 2], "can_graph": false}', TraceRound((2, 2), None, False)),
    ('{"accept": [0], "num_tokens": 5, "can_graph": true}', TraceRound((0,), 5, True)),
    ('  {"accept": [100]}  \n', TraceRound((100,), None, True)),  # unlimited-steps accept
])
def test_good_lines(line, expected):
    assert parse_round(line, "f:1") == expected


def test_defaults():
    r = parse_round('{"accept": [1]}', "x:1")
    assert r.num_tokens is None and r.can_graph is True
    assert isinstance(r.accept, tuple)


# -------------------------------------------------------------------------------- bad lines
@pytest.mark.parametrize("line,needle", [
    ("not json", "JSON"),
    ('{"accept": [1]', "JSON"),
    ("[1, 2]", "object"),
    ("3", "object"),
    ('"accept"', "object"),
    ("null", "object"),
    ('{"accept": [1], "acept": [2]}', "acept"),
    ('{"accept": [1], "extra": 1}', "extra"),
    ("{}", "accept"),
    ('{"num_tokens": 3}', "accept"),
    ('{"accept": [-1]}', "accept"),
    ('{"accept": [1, -2]}', "-2"),
    ('{"accept": [true]}', "accept"),
    ('{"accept": [1, false]}', "accept"),
    ('{"accept": [1.0]}', "accept"),
    ('{"accept": ["1"]}', "accept"),
    ('{"accept": 3}', "accept"),
    ('{"accept": null}', "accept"),
    ('{"accept": {"a": 1}}', "accept"),
    ('{"accept": [1], "num_tokens": -1}', "num_tokens"),
    ('{"accept": [1], "num_tokens": 1.5}', "num_tokens"),
    ('{"accept": [1], "num_tokens": true}', "num_tokens"),
    ('{"accept": [1], "num_tokens": "4"}', "num_tokens"),
    ('{"accept": [1], "can_graph": 1}', "can_graph"),
    ('{"accept": [1], "can_graph": "true"}', "can_graph"),
    ('{"accept": [1], "can_graph": null}', "can_graph"),
    ('{"accept": [1], "can_graph": 0}', "can_graph"),
])
def test_bad_lines(line, needle):
    with pytest.raises(TraceError) as ei:
        parse_round(line, "dir/rank3.jsonl:17")
    msg = str(ei.value)
    assert "dir/rank3.jsonl:17" in msg
    assert needle in msg


def test_trace_error_is_value_error():
    assert issubclass(TraceError, ValueError)


# ----------------------------------------------------------------------------------- files
def test_trace_path(tmp_path):
    assert trace_path(tmp_path, 2) == tmp_path / "rank2.jsonl"


def test_load_trace_good(tmp_path):
    (tmp_path / "rank0.jsonl").write_text(
        '{"accept": [1, 2]}\n'
        '\n'
        '{"accept": []}\n'
        '{"accept": [7], "num_tokens": 9, "can_graph": false}\n'
    )
    got = load_trace(tmp_path, 0)
    assert got == [
        TraceRound((1, 2), None, True),
        TraceRound((), None, True),
        TraceRound((7,), 9, False),
    ]


def test_load_trace_empty_file(tmp_path):
    (tmp_path / "rank1.jsonl").write_text("")
    assert load_trace(tmp_path, 1) == []


@pytest.mark.parametrize("bad,needle", [
    ("garbage", "JSON"),
    ("[1]", "object"),
    ('{"accept": [1], "foo": 2}', "foo"),
    ('{"numtokens": 1}', "accept"),
    ('{"accept": [-3]}', "accept"),
    ('{"accept": [true]}', "accept"),
    ('{"accept": [1], "num_tokens": -5}', "num_tokens"),
    ('{"accept": [1], "can_graph": 1}', "can_graph"),
])
def test_load_trace_bad_line_names_file_and_line(tmp_path, bad, needle):
    # line 1 good, line 2 blank (still counted), line 3 bad
    p = tmp_path / "rank2.jsonl"
    p.write_text('{"accept": [1]}\n\n' + bad + "\n" + '{"accept": [2]}\n')
    with pytest.raises(TraceError) as ei:
        load_trace(tmp_path, 2)
    msg = str(ei.value)
    assert f"{p}:3" in msg, msg
    assert needle in msg


def test_load_trace_missing_file(tmp_path):
    (tmp_path / "rank0.jsonl").write_text('{"accept": []}\n')
    with pytest.raises(TraceError) as ei:
        load_trace(tmp_path, 1)
    assert "rank1.jsonl" in str(ei.value)


def test_load_trace_missing_dir(tmp_path):
    d = tmp_path / "nope"
    with pytest.raises(TraceError) as ei:
        load_trace(d, 0)
    assert str(d) in str(ei.value)
