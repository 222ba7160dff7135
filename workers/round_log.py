"""The round log (`--round-log FILE`): one JSON line per rank per round, what the rank ran and
what each request drafted and had accepted, so anyone can price a run with any cost table or
replay its acceptance (`python -m adaptive_dist consensus --trace FILE`; docs/cli.md).

    {"round": 12, "rank": 0, "kind": "decode", "draft_forwards": 3, "verify_tokens": 9,
     "padded_tokens": 12, "graph": false,
     "requests": [{"id": 0, "draft": 3, "accepted": 2}, {"id": 1, "draft": 1, "accepted": 0}]}

`kind` is "decode" (a speculative round: `draft` = the tokens the request drafted, `accepted` =
those accepted, the bonus excluded; `verify_tokens` = this rank's real verify tokens, the sum of
`draft + 1`; `padded_tokens` = the agreed verify tokens every rank ran; `catchup` = whether the
head's catch-up over the lag ring ran in the round, `pending` = the width of the deferred
prompts' head forward that ran with it, 0 none, `longest` = the tokens of the round's longest
request: what the cost model's catch-up term prices, `adaptive_dist.cost_tables.price_round_log`;
lines written before these keys existed lack them and price as rounds without) or "prefill" (the round's
prefill: `verify_tokens` = this rank's prompt tokens, `padded_tokens` = the agreed ones, each
request with `draft` 0 and `accepted` 0). `id` is the request's id (`generate`: the prompt's
index; `serve`: the server's request number). A rank without requests writes no line for a round.
Lines are written as rounds are read (with overlap, a round after the next was launched), each
flushed whole.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, Sequence

KINDS = ("decode", "prefill")


class RoundLog:
    """Appends this rank's lines to `path`."""

    def __init__(self, path: str | Path, rank: int = 0) -> None:
        self.path, self.rank = Path(path), rank
        self._file: IO[str] = open(self.path, "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def decode(self, plan: Any, executed: Any, rids: Sequence[int], budgets: Sequence[int],
               accepts: Sequence[int], catchup: bool = False, pending: int = 0,
               longest: int = 0) -> None:
        """A speculative round this rank ran requests in (`catchup`: the lag ring's catch-up
        forward ran in it; `pending`: the deferred prompts' head forward ran at that width;
        `longest`: the tokens of its longest request, as the host counted them when it read the
        round)."""
        if not rids:
            return
        self.write({"round": plan.round, "rank": self.rank, "kind": "decode",
                    "draft_forwards": executed.shape.draft_forwards,
                    "verify_tokens": int(sum(budgets) + len(budgets)),
                    "padded_tokens": executed.shape.verify_tokens, "graph": bool(plan.use_graph),
                    "catchup": bool(catchup), "pending": int(pending), "longest": int(longest),
                    "requests": [{"id": int(r), "draft": int(d), "accepted": int(a)}
                                 for r, d, a in zip(rids, budgets, accepts)]})

    def prefill(self, plan: Any, rids: Sequence[int], prompt_tokens: int) -> None:
        """A round's prefill on this rank."""
        if not rids:
            return
        self.write({"round": plan.round, "rank": self.rank, "kind": "prefill",
                    "draft_forwards": 0, "verify_tokens": int(prompt_tokens),
                    "padded_tokens": int(plan.extend_tokens), "graph": bool(plan.use_graph),
                    "requests": [{"id": int(r), "draft": 0, "accepted": 0} for r in rids]})

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def round_log_path(path: str | Path, rank: int, world: int) -> Path:
    """Where rank `rank` writes `--round-log path`: the path itself in a one-rank job, else
    `.rank<R>` before its suffix (`log.jsonl` -> `log.rank1.jsonl`)."""
    path = Path(path)
    if world == 1:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def read_round_log(path: str | Path) -> list[dict[str, Any]]:
    """Every line of a round log (checked: the fields and their types), in file order."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            for key in ("round", "rank", "kind", "draft_forwards", "verify_tokens",
                        "padded_tokens", "graph", "requests"):
                if key not in rec:
                    raise ValueError(f"{path}:{i}: round-log line without {key!r}")
            if rec["kind"] not in KINDS:
                raise ValueError(f"{path}:{i}: kind={rec['kind']!r}; allowed: {', '.join(KINDS)}")
            out.append(rec)
    return out
