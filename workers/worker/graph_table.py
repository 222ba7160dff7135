"""One table of the round's CUDA graphs, keyed by what each graph's shape depends on.

A round at shape (S draft forwards, T verify tokens) over a padded batch of Bp rows replays:
the draft loop (S, Bp), the target forward over the packed verify tokens (T alone: the same graph
serves every depth and batch), the acceptance (S, Bp, and its sampling variants) and the
draft-extend (S, Bp); at depth 0 with a head the catch-up (Bp) and the deferred prompts' forward
(Bp, width); a draft tree's round (`workers.worker.tree`) its draft, verify, acceptance and
KV commit as one graph (S, Bp, greedy or sampling), then the draft-extend; and the padded
prefill (`workers.worker.prefill`: rows, width, greedy, with or without the head's part). So the
target, the largest part of a round, is captured once per token rung instead of once per (depth,
batch, variant).

A graph's phase is a `GraphPhase`, not `ForwardMode` (`workers.attention.base`): a mode is the
shape of one attention forward, while a phase is one captured body, which may run no forward (the
acceptance) or several (the draft loop's S decode forwards). Its values are the names the start-up
timeline, `GraphKey.name` and the JSON files spell.

Without CUDA the table holds the same entries, emulated (`CudaGraphRunner`): `replay` runs the
body eagerly, so the CPU tests run exactly what the GPU replays.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Iterator

from workers.cuda_graphs import CudaGraphRunner, GraphEntry


class GraphPhase(StrEnum):
    """What a captured graph runs (a `str`: it prints and serializes as its value)."""

    DRAFT = "draft"        # the draft loop: S head forwards and their draws (S, Bp, greedy)
    TARGET = "target"      # the target over the packed verify tokens (T)
    ACCEPT = "accept"      # the acceptance (S, Bp, greedy, processed)
    EXTEND = "extend"      # draft-extend + the slot update (S, Bp)
    CATCHUP = "catchup"    # depth 0 with a head: the head's catch-up over the lag ring (Bp)
    PENDING = "pending"    # depth 0 with a head: the deferred prompts' head forward (Bp, width)
    TREE = "tree"          # a draft tree's draft, verify, acceptance and KV commit (S, Bp, greedy)
    PREFILL = "prefill"    # the padded prefill (rows, width, greedy, head)


STEPPED = (GraphPhase.DRAFT, GraphPhase.ACCEPT, GraphPhase.EXTEND, GraphPhase.TREE)
"""The phases whose shape depends on the draft forwards S (their name spells `steps`)."""
SAMPLED = (GraphPhase.DRAFT, GraphPhase.ACCEPT, GraphPhase.TREE, GraphPhase.PREFILL)
"""The phases captured greedy and sampling (their name spells `greedy`)."""


@dataclass(frozen=True)
class GraphKey:
    """A captured forward: its phase and the sizes its shape depends on."""

    phase: GraphPhase
    batch: int = 0        # padded rows (every phase but the target)
    steps: int = 0        # draft forwards S (draft, accept, extend, tree)
    tokens: int = 0       # packed verify tokens T (target); prompt width (pending, prefill)
    greedy: bool = True   # every request greedy (draft, accept, tree, prefill): the argmax alone
    processed: bool = False   # the acceptance with the logits processing (docs/sampling.md)
    head: bool = True     # the prefill with the head's part (False: deferred to the catch-up)
    topk: int = 0         # a draft tree's top-k (tree; with tokens = its N): an adaptive tree
    nodes: int = 0        # a per-request tree's N (tree; tokens: the round's packed T)

    def __post_init__(self) -> None:
        if not isinstance(self.phase, GraphPhase):
            try:
                object.__setattr__(self, "phase", GraphPhase(self.phase))
            except ValueError:
                raise ValueError(f"graph phase {self.phase!r}; allowed: "
                                 f"{', '.join(p.value for p in GraphPhase)}") from None
        if not self.head and self.phase is not GraphPhase.PREFILL:
            raise ValueError(f"graph phase {self.phase}: only the prefill runs without the head")

    @property
    def name(self) -> str:
        """The capture's name (`CudaGraphRunner`; start-up counts group captures by it)."""
        if self.phase is GraphPhase.PREFILL:   # rows and width, the prefill's own words
            return (f"prefill/rows={self.batch}/width={self.tokens}/greedy={self.greedy}"
                    + ("" if self.head else "/deferred"))
        parts = [self.phase.value] + [f"{k}={v}" for k, v in (
            ("batch", self.batch), ("steps", self.steps), ("tokens", self.tokens),
            ("topk", self.topk), ("nodes", self.nodes))
            if v or k == "steps" and self.phase in STEPPED]
        if self.phase in SAMPLED:
            parts.append(f"greedy={self.greedy}")
        if self.processed:
            parts.append("processed")
        return "/".join(parts)


class GraphTable:
    """The worker's graphs by `GraphKey` (captured at start-up, replayed every round)."""

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

    def get(self, key: GraphKey) -> GraphEntry | None:
        """The entry captured under `key`, or None."""
        return self.entries.get(key)

    def of(self, *phases: GraphPhase) -> dict[GraphKey, GraphEntry]:
        """The entries of `phases` (one or more), in capture order."""
        wanted = {GraphPhase(p) for p in phases}
        return {k: e for k, e in self.entries.items() if k.phase in wanted}

    def __iter__(self) -> Iterator[GraphKey]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
