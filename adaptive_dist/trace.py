"""Acceptance traces for consensus-only mode: ``DIR/rank{R}.jsonl``, one JSON object per round.

Each line is ``{"accept": [a, ...]}`` (per request, the draft tokens it would accept with unlimited
steps; ``[]`` is an idle round), with optional ``"num_tokens"`` (int >= 0) and ``"can_graph"``
(bool). Bad lines are refused with the file, the line number and the key; so are unreadable files,
invalid UTF-8, duplicate keys, and ``rank{R}.jsonl`` files for ranks the job does not have.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


class TraceError(ValueError):
    """A trace file is missing or malformed."""


@dataclass(frozen=True)
class TraceRound:
    accept: tuple[int, ...]
    num_tokens: int | None = None
    can_graph: bool = True


ALLOWED_KEYS = ("accept", "num_tokens", "can_graph")
MAX_COUNT = 2 ** 53  # counts travel in float64 consensus vectors: exact below this
RANK_FILE = re.compile(r"rank(\d+)\.jsonl")


def trace_path(trace_dir: str | Path, rank: int) -> Path:
    return Path(trace_dir) / f"rank{rank}.jsonl"


def check_trace_dir(trace_dir: str | Path, world_size: int) -> None:
    """Refuse ``rank{R}.jsonl`` files that no rank of a ``world_size``-rank job reads (almost
    always a wrong directory or a wrong launch), naming them."""
    d = Path(trace_dir)
    if not d.is_dir():
        raise TraceError(f"--trace {str(trace_dir)!r}: not a directory" if d.exists()
                         else f"trace directory {str(trace_dir)!r} does not exist")
    extra = []
    for p in d.iterdir():
        m = RANK_FILE.fullmatch(p.name)
        if m and (int(m.group(1)) >= world_size or p.name != f"rank{int(m.group(1))}.jsonl"):
            extra.append(p.name)
    if extra:
        names = ", ".join(sorted(extra, key=lambda n: (len(n), n)))
        reads = "rank0.jsonl" if world_size == 1 else f"rank0.jsonl..rank{world_size - 1}.jsonl"
        raise TraceError(f"--trace {str(trace_dir)!r} holds {names}, but this job has "
                         f"{world_size} rank(s) and reads {reads} only: wrong directory or wrong "
                         f"number of ranks? (move or remove the extra files)")


def load_trace(trace_dir: str | Path, rank: int, world_size: Optional[int] = None) -> list[TraceRound]:
    """This rank's trace. With ``world_size``, also refuse files for ranks beyond it."""
    if world_size is not None:
        check_trace_dir(trace_dir, world_size)
    path = trace_path(trace_dir, rank)
    if not Path(trace_dir).is_dir():
        raise TraceError(f"trace directory {str(trace_dir)!r} does not exist")
    if path.is_dir():
        raise TraceError(f"trace file {str(path)!r} for rank {rank} is a directory, not a file")
    if not path.is_file():
        raise TraceError(f"trace file {str(path)!r} for rank {rank} does not exist "
                         f"(expected rank{{R}}.jsonl for every rank R)")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"trace file {str(path)!r} cannot be read: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise TraceError(f"{path}:{line}: not valid UTF-8 (byte {data[exc.start]:#04x} at "
                         f"column {column})") from None
    return [parse_round(line, f"{path}:{lineno}")
            for lineno, line in enumerate(text.split("\n"), 1) if line.strip()]


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise TraceError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _loads(line: str, where: str) -> Any:
    """``json.loads`` that refuses a duplicate key. Fast path: with no string values (a valid
    trace line has none), two quotes per key mean no key can repeat."""
    try:
        obj = json.loads(line)
        if not isinstance(obj, dict) or line.count('"') == 2 * len(obj):
            return obj
        return json.loads(line, object_pairs_hook=_refuse_duplicates)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    except TraceError as exc:
        raise TraceError(f"{where}: {exc} in one JSON object (which value is meant?)") from None


def parse_round(line: str, where: str) -> TraceRound:
    obj = _loads(line, where)
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(ALLOWED_KEYS))
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {unknown}; allowed: {list(ALLOWED_KEYS)}")
    if "accept" not in obj:
        raise TraceError(f"{where}: missing key 'accept'")
    acc = obj["accept"]
    if not isinstance(acc, list) or any(not _is_int(a) or a < 0 for a in acc):
        raise TraceError(f"{where}: 'accept'={acc!r} must be a list of integers >= 0")
    num_tokens = obj.get("num_tokens")
    if num_tokens is not None and (not _is_int(num_tokens) or not 0 <= num_tokens < MAX_COUNT):
        raise TraceError(f"{where}: 'num_tokens'={num_tokens!r} must be an integer in "
                         f"[0, 2**53) (the consensus carries it exactly as a float64)")
    if any(a >= MAX_COUNT for a in acc) or len(acc) >= MAX_COUNT:
        raise TraceError(f"{where}: 'accept' values must be below 2**53")
    can_graph = obj.get("can_graph", True)
    if not isinstance(can_graph, bool):
        raise TraceError(f"{where}: 'can_graph'={can_graph!r} must be true or false")
    return TraceRound(tuple(acc), num_tokens, can_graph)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
