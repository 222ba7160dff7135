"""Acceptance traces for consensus-only mode: ``DIR/rank{R}.jsonl``, one JSON object per round.

Each line is ``{"accept": [a, ...]}`` (per request, the draft tokens it would accept with unlimited
steps; ``[]`` is an idle round), with optional ``"num_tokens"`` (int >= 0), ``"can_graph"``
(bool) and ``"ids"`` (one request id per accept: what per-request budgets key their estimates
on; without it a request is its place in the list). Bad lines are refused with the file, the
line number and the key; so are unreadable files, invalid UTF-8, duplicate keys, and
``rank{R}.jsonl`` files for ranks the job does not have.

An engine's round log (``--round-log``, ``workers.round_log``) is a trace too: ``--trace FILE``
(one rank), or the per-rank files it writes (``FILE`` with ``.rank<R>`` before its suffix).
Each decode line becomes a round of its requests (ids kept); a prefill's prompt tokens go to the
round they ran in. A request that accepted fewer drafts than it drafted gives its exact accept
length; one that accepted all of them gives that many — a lower bound (the log cannot say how
far past its drafts it would have gone), so a replay that drafts deeper than the run did sees
no more than the run saw.
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
    ids: tuple[int, ...] | None = None


ALLOWED_KEYS = ("accept", "num_tokens", "can_graph", "ids")
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


def round_log_file(trace: str | Path, rank: int, world_size: int) -> Path:
    """The round log rank ``rank`` replays when ``--trace`` names a file: the file itself for
    one rank, else its ``.rank<R>`` sibling."""
    path = Path(trace)
    return path if world_size == 1 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def load_round_log(path: Path) -> list[TraceRound]:
    """A round log as a trace (see the module docstring)."""
    if not path.is_file():
        raise TraceError(f"round log {str(path)!r} does not exist")
    rounds: dict[int, dict] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"round log {str(path)!r} cannot be read: {exc}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        rec = _loads(line, where)
        try:
            r, kind, reqs = rec["round"], rec["kind"], rec["requests"]
            entry = rounds.setdefault(int(r), {"accept": [], "ids": [], "tokens": 0,
                                               "graph": bool(rec.get("graph", True))})
            if kind == "prefill":
                entry["tokens"] += int(rec["verify_tokens"])
            elif kind == "decode":
                for q in reqs:
                    entry["ids"].append(int(q["id"]))
                    entry["accept"].append(int(q["accepted"]))
            else:
                raise TraceError(f"{where}: kind={kind!r}; allowed: 'decode', 'prefill'")
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{where}: not a round-log line ({exc})") from None
    if not rounds:
        return []
    out = []
    for r in range(max(rounds) + 1):
        e = rounds.get(r)
        out.append(TraceRound((), 0) if e is None else
                   TraceRound(tuple(e["accept"]), e["tokens"], e["graph"], tuple(e["ids"])))
    return out


def is_round_log(trace: str | Path) -> bool:
    """Whether ``--trace`` names a round-log file (or the stem of per-rank ones)."""
    path = Path(trace)
    return not path.is_dir() and (path.is_file() or path.with_name(
        f"{path.stem}.rank0{path.suffix}").is_file())


def load_trace(trace_dir: str | Path, rank: int, world_size: Optional[int] = None) -> list[TraceRound]:
    """This rank's trace (a trace directory, or a round log: ``is_round_log``). With
    ``world_size``, also refuse files for ranks beyond it."""
    if is_round_log(trace_dir):
        return load_round_log(round_log_file(trace_dir, rank, world_size or 1))
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
    ids = obj.get("ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) != len(acc)
                            or any(not _is_int(i) for i in ids) or len(set(ids)) != len(ids)):
        raise TraceError(f"{where}: 'ids'={ids!r} must be distinct integers, one per accept")
    return TraceRound(tuple(acc), num_tokens, can_graph, None if ids is None else tuple(ids))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
