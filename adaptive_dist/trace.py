"""Acceptance traces for consensus-only mode: ``DIR/rank{R}.jsonl``, one JSON object per round.

Each line is ``{"accept": [a, ...]}`` (per request, the draft tokens it would accept with unlimited
steps; ``[]`` is an idle round), with optional ``"num_tokens"`` (int >= 0) and ``"can_graph"``
(bool). Bad lines are refused with the file, the line number and the key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """A trace file is missing or malformed."""


@dataclass(frozen=True)
class TraceRound:
    accept: tuple[int, ...]
    num_tokens: int | None = None
    can_graph: bool = True


ALLOWED_KEYS = ("accept", "num_tokens", "can_graph")
MAX_COUNT = 2 ** 53  # counts travel in float64 consensus vectors: exact below this


def trace_path(trace_dir: str | Path, rank: int) -> Path:
    return Path(trace_dir) / f"rank{rank}.jsonl"


def load_trace(trace_dir: str | Path, rank: int) -> list[TraceRound]:
    path = trace_path(trace_dir, rank)
    if not Path(trace_dir).is_dir():
        raise TraceError(f"trace directory {str(trace_dir)!r} does not exist")
    if not path.is_file():
        raise TraceError(f"trace file {str(path)!r} for rank {rank} does not exist "
                         f"(expected rank{{R}}.jsonl for every rank R)")
    rounds = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                rounds.append(parse_round(line, f"{path}:{lineno}"))
    return rounds


def parse_round(line: str, where: str) -> TraceRound:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
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
