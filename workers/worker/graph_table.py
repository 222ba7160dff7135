"""One table of the round's CUDA graphs, keyed by what each graph's shape depends on.

A round at shape (S draft forwards, T verify tokens) over a padded batch of Bp rows replays:
the draft loop (S, Bp), the target forward over the packed verify tokens (T alone: the same graph
serves every depth and batch), the acceptance (S, Bp, and its sampling variants) and the
draft-extend (S, Bp); at depth 0 with a head the catch-up (Bp) and the deferred prompts' forward
(Bp, width); a draft tree's round (`workers.worker.tree`) its draft, verify, acceptance and
KV commit as one graph (S, Bp, greedy or sampling), then the draft-extend. So the target, the
largest part of a round, is captured once per token rung instead
of once per (depth, batch, variant).

Without CUDA the table holds the same entries, emulated (`CudaGraphRunner`): `replay` runs the
body eagerly, so the CPU tests run exactly what the GPU replays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from workers.cuda_graphs import CudaGraphRunner, GraphEntry

PHASES = ("draft", "target", "accept", "extend", "catchup", "pending", "tree")


@dataclass(frozen=True)
class GraphKey:
    """A captured forward of the round: its phase and the sizes its shape depends on."""

    phase: str
    batch: int = 0        # padded rows (every phase but the target)
    steps: int = 0        # draft forwards S (draft, accept, extend)
    tokens: int = 0       # packed verify tokens T (target); prompt width (pending)
    greedy: bool = True   # every request greedy (draft, accept): the argmax alone
    processed: bool = False   # the acceptance with the logits processing (docs/sampling.md)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"graph phase {self.phase!r}; allowed: {', '.join(PHASES)}")

    @property
    def name(self) -> str:
        parts = [self.phase] + [f"{k}={v}" for k, v in (
            ("batch", self.batch), ("steps", self.steps), ("tokens", self.tokens))
            if v or k == "steps" and self.phase in ("draft", "accept", "extend", "tree")]
        if self.phase in ("draft", "accept", "tree"):
            parts.append(f"greedy={self.greedy}")
        if self.processed:
            parts.append("processed")
        return "/".join(parts)


class GraphTable:
    """The round's graphs by `GraphKey` (captured at start-up, replayed every round)."""

    def __init__(self, runner: CudaGraphRunner) -> None:
        self.runner = runner
        self.entries: dict[GraphKey, GraphEntry] = {}

    def capture(self, key: GraphKey, body: Callable[[], Any]) -> GraphEntry:
        """Capture `body` under `key` (once: a key captured before keeps its graph)."""
        if key not in self.entries:
            self.entries[key] = self.runner.capture_body(key.name, body)
        return self.entries[key]

    def replay(self, key: GraphKey) -> Any:
        entry = self.entries.get(key)
        if entry is None:
            raise RuntimeError(f"no CUDA graph {key.name} was captured (the plan asks for one "
                               f"this worker did not build)")
        return entry.replay()

    def __contains__(self, key: GraphKey) -> bool:
        return key in self.entries

    def of(self, phase: str) -> dict[GraphKey, GraphEntry]:
        """The entries of one phase."""
        return {k: e for k, e in self.entries.items() if k.phase == phase}

    def __iter__(self) -> Iterator[GraphKey]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
