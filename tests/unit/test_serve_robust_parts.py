"""The stop-string rule without a server: a completion's tokens end with the one that completes
its first stop string, however the tokens were grouped into deltas; the value shown in error
messages is cut when long."""
from __future__ import annotations

import random

import pytest

from workers import tokenizer
from workers.server.admission import LongInt, seed_error, shown
from workers.server.text import ByteCodec, TextStream

CODEC = ByteCodec(bos_token_id=256)


def rule(ids: list[int], stops: list[str]) -> tuple[str, list[int]]:
    """The documented rule from the tokenizer alone (no `TextStream`)."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], ids[:k]
    return tokenizer.decode(ids), ids


def groupings(n: int) -> list[list[int]]:
    """Chunk sizes covering n tokens: all at once, one by one, and a few random splits."""
    rng = random.Random(n)
    out = [[n], [1] * n]
    for _ in range(4):
        sizes, left = [], n
        while left:
            sizes.append(min(left, rng.randint(1, 5)))
            left -= sizes[-1]
        out.append(sizes)
    return out


CASES = [
    ("\n    return fib(n - 1)\n", ["\n"]),                   # the stop is the first token
    ("import sys\nimport sys\n", ["sys"]),                    # 3 characters mid-output
    (", name, value):\n  self", ["value):", "ue"]),           # begun earlier, completed later
    ("na\u00efve caf\u00e9 ok", ["\u00e9"]),                  # a 2-byte character as the stop
    ("abc abc abd", ["abd", "c a"]),
    ("no stop here", ["zzz"]),
]


@pytest.mark.parametrize("text,stops", CASES)
def test_tokens_end_with_the_one_completing_the_stop_whatever_the_grouping(text, stops) -> None:
    ids = list(text.encode())
    want_text, want_ids = rule(ids, stops)
    for sizes in groupings(len(ids)):
        stream, pieces, at = TextStream(CODEC, stops), [], 0
        for size in sizes:
            at += size
            pieces.append(stream.feed(ids[at - size:at], final=at == len(ids)))
        assert (stream.text, stream.token_ids) == (want_text, want_ids), sizes
        assert "".join(pieces) == want_text
        assert stream.stopped == (want_ids != ids or any(s in text for s in stops))


def test_the_counted_tokens_of_the_issue() -> None:
    """`stop: ["\\n"]` after a first token "\\n": text "" and 1 token, not the whole round's."""
    stream = TextStream(CODEC, ["\n"])
    assert stream.feed(list(b"\n    \"\"\""), final=False) == ""
    assert stream.stopped and stream.token_ids == [10]
    ids = list(b"ab, x\nxyz more")
    stream = TextStream(CODEC, ["x\nx"])          # 3 characters, mid-output, one delta
    stream.feed(ids, final=False)
    assert (stream.text, stream.token_ids) == ("ab, ", ids[:7])


def test_a_multibyte_stop_counts_through_its_last_byte() -> None:
    ids = list("caf\u00e9!".encode())               # c a f 0xC3 0xA9 !
    stream = TextStream(CODEC, ["\u00e9"])
    stream.feed(ids[:4], final=False)
    assert not stream.stopped                          # half a character is no stop yet
    stream.feed(ids[4:], final=True)
    assert (stream.text, stream.token_ids) == ("caf", ids[:5])


def test_shown_values_are_cut() -> None:
    assert shown(12) == "12" and shown("ab") == "'ab'"
    assert shown(10 ** 400) == "100000000000... (an integer of 401 digits)"
    assert shown(LongInt("-" + "7" * 5000)) == "-77777777777... (an integer of 5000 digits)"
    assert shown("x" * 500).endswith("... (502 characters)") and len(shown("x" * 500)) < 60
    assert LongInt("1" * 5000) > 2 ** 63 and LongInt("-" + "1" * 5000) < -2 ** 63


def test_seed_ranges() -> None:
    assert seed_error(2 ** 63 - 1) is None and seed_error(-2 ** 63) is None
    assert "out of range" in seed_error(2 ** 63) and "out of range" in seed_error(True)
    assert seed_error(2 ** 63 - 3, 3) is None
    assert "allowed with 3 choices: at most 9223372036854775805" in seed_error(2 ** 63 - 2, 3)
