"""The per-round consensus collective: one fixed-size vector per rank, all-gathered over the DP
group, so every rank holds the same matrix and reduces it in the same order.

The vector carries the rank's statistics (from the round that just ended: its request count, its
EMA of accepted draft tokens, its EMA of the share of requests that rejected a draft token, its
weight), its view of the upcoming round (requests, the tokens and requests of its extend/prefill
forward and its longest prompt, CUDA-graph eligibility, whether it is done; when serving, the
highest request-message sequence number it has received and whether it wants the cluster to
stop), and the state every
rank must share (steps in force, counted rounds, last switch, config hash, hash of the previous
round's plan).
The shared-state columns are the pre-flight lockstep check: a mismatch raises ``DivergenceError``
on every rank, naming ranks and fields, before any device collective of the round is issued.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from collectives import DivergenceError, Group, ops

MAGIC = 0x5ADC  # vector format version (0x5ADB: before extend_len; 0x5ADA: before period;
                #   0x5AD9: before ema_fail)
FIELDS = (
    "magic", "round", "n_req", "num_tokens", "n_extend", "extend_len", "can_graph",  # the upcoming
    "done",                                                                       # round
    "seq", "leave",                                                     # serving: inbox, stop
    "prev_n_req", "ema", "ema_fail", "weight", "period",                # the round that ended
    "steps", "counted", "last_switch", "config_hash", "prev_plan_hash",  # must agree
)
MUST_AGREE = ("magic", "round", "steps", "counted", "last_switch", "config_hash", "prev_plan_hash")
COL = {name: i for i, name in enumerate(FIELDS)}
_AGREE_COLS = tuple(COL[name] for name in MUST_AGREE)


def hash48(*parts: object) -> int:
    """A 48-bit hash (exact in float64) of ``parts``' reprs; equal on every rank for equal parts."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=6).digest()
    return int.from_bytes(h, "little")


@dataclass(frozen=True)
class RoundVector:
    """One rank's contribution to a round's consensus."""

    round: int
    n_req: int
    num_tokens: int
    n_extend: int
    can_graph: bool
    done: bool
    seq: int
    leave: bool
    prev_n_req: int
    ema: float
    weight: int
    steps: int
    counted: int
    last_switch: int
    config_hash: int
    prev_plan_hash: int
    ema_fail: float = 1.0  # last in the dataclass (positional callers), placed by FIELDS
    period: float = -1.0   # seconds from the previous round's begin to this one's; -1: untimed
    extend_len: int = 0    # the longest prompt of its extend forward (0: none)

    def values(self) -> list[float]:
        return [float(MAGIC)] + [float(getattr(self, f)) for f in FIELDS[1:]]


CHANNELS = ("control", "device")


class ConsensusChannel:
    """Pre-allocated buffers for the per-round all-gather over ``group``, so a round allocates
    nothing.

    ``channel="control"`` (what the engine uses) all-gathers host memory over the group's gloo
    control group: the planning channel is separate from the device group that carries the
    model's collectives, so a rank that strays from the plan (skips a forward, say) leaves its
    peers waiting in *different* process groups — a timeout the guard diagnoses — instead of
    meeting them inside one group with mismatched tensors (gloo aborts the process; NCCL can
    complete with garbage). ``channel="device"`` uses the device group (pinned host staging and
    one stream synchronisation on CUDA)."""

    def __init__(self, group: Group, channel: str = "control") -> None:
        if channel not in CHANNELS:
            raise ValueError(f"consensus channel={channel!r}; allowed: {', '.join(CHANNELS)}")
        self.group, self.channel = group, channel
        n = len(FIELDS)
        cuda = group.device.type == "cuda" and channel == "device"
        self.host_in = torch.zeros(n, dtype=torch.float64, pin_memory=cuda)
        self._host_in = self.host_in.numpy()  # the same memory: filled without a torch op
        self.dev_in = self.host_in.to(group.device) if cuda else self.host_in
        self.host_out = torch.zeros(group.size * n, dtype=torch.float64, pin_memory=cuda)
        self.cuda = cuda

    def gather(self, vec: "RoundVector") -> list[list[float]]:
        """All-gather every member's vector (one collective) and return the [size][len(FIELDS)]
        matrix as Python floats, identical on every member."""
        self._host_in[:] = vec.values()
        if self.cuda:
            self.dev_in.copy_(self.host_in, non_blocking=True)
        out = ops.all_gather(self.dev_in, self.group, control=self.channel == "control")
        if self.cuda:
            self.host_out.copy_(out, non_blocking=True)
            torch.cuda.current_stream(self.group.device).synchronize()
            flat = self.host_out.tolist()
        else:
            flat = out.tolist()
        n = len(FIELDS)
        return [flat[i * n:(i + 1) * n] for i in range(self.group.size)]


def preflight(matrix: list[list[float]], group: Group) -> None:
    """Raise ``DivergenceError`` (the same on every rank) if the must-agree columns differ."""
    first = [matrix[0][i] for i in _AGREE_COLS]
    if all([row[i] for i in _AGREE_COLS] == first for row in matrix[1:]):
        return
    bad = []
    for name in MUST_AGREE:
        col = column(matrix, name)
        if any(v != col[0] for v in col):
            values: dict[float, list[int]] = {}
            for i, v in enumerate(col):
                values.setdefault(v, []).append(group.ranks[i])
            shown = ", ".join(f"ranks {rs} have {_fmt(name, v)}" for v, rs in values.items())
            bad.append(f"{name} ({shown})")
    if bad:
        rnd = int(matrix[0][COL["round"]])
        raise DivergenceError(
            f"pre-flight lockstep check failed at round {rnd} on group {group.name!r}: "
            f"ranks disagree on " + "; ".join(bad)
        )


def _fmt(name: str, v: float) -> str:
    if name.endswith("hash") or name == "magic":
        return f"{int(v):#x}"
    return str(int(v)) if float(v).is_integer() else repr(v)


def column(matrix: list[list[float]], name: str) -> list[float]:
    i = COL[name]
    return [row[i] for row in matrix]


def columns(matrix: list[list[float]]) -> dict[str, Sequence[float]]:
    """Every column of ``matrix`` by field name (one pass, for a round that reads many)."""
    return dict(zip(FIELDS, zip(*matrix)))


@functools.lru_cache(maxsize=1024)
def plan_hash(steps: int, use_graph: bool, bucket: int | None, mode: str) -> int:
    """Hash of what a rank runs in a round: depth, graph or eager, padded bucket, forward mode."""
    return hash48(int(steps), bool(use_graph), bucket, mode)
