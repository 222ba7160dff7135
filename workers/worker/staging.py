"""Host staging of a round: the pinned memory a launched round reads its rows from and copies its
results to, the handle of a round in flight, and what the host reads of it.

Two stages alternate (with overlap the next round is staged while the device may still copy the
previous one's results); `EagleWorker.collect` waits on a round's event, not on the stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workers.worker.request import SlotRequest


@dataclass
class RoundResult:
    """What the host reads of a round, one row per request: its first token (drawn at prefill),
    its accepted draft tokens, and the round's candidate tokens (`tokens[b, :accept[b] + 1]`
    are committed)."""

    first: np.ndarray
    accept: np.ndarray
    tokens: np.ndarray
    shadow: np.ndarray | None = None   # [n, 2] (hits, checks) of a depth-0 round's catch-up
    # a round with logprobs: per row and candidate, its raw logprob then the K most likely
    # tokens' ([n, W, 1 + K] float32), and those tokens ([n, W, K] int64)
    logprobs: tuple[np.ndarray, np.ndarray] | None = None

    def select(self, keep: np.ndarray) -> "RoundResult":
        """The rows where `keep` is True."""
        return RoundResult(self.first[keep], self.accept[keep], self.tokens[keep],
                           None if self.shadow is None else self.shadow[keep],
                           None if self.logprobs is None else
                           (self.logprobs[0][keep], self.logprobs[1][keep]))


@dataclass
class HostStage:
    """Host memory one launched round uses (pinned on CUDA): the slot and budget of each row,
    copied in,
    and the round's results, copied out (flat: a round of `n` requests at width `w` reads the
    first `n * w` values); the event recorded after that copy (reused: a stage serves every
    other round, and a round is collected before its stage is staged again)."""

    rows: torch.Tensor           # [2 * top]: each row's slot, then its draft budget
    out: torch.Tensor
    rows_np: np.ndarray          # the slots as numpy (the same memory: filled without torch ops)
    budget_np: np.ndarray        # the budgets as numpy
    done: Any = None
    lp_values: torch.Tensor | None = None   # a round's logprobs (flat), copied only when asked
    lp_ids: torch.Tensor | None = None

    @staticmethod
    def make(top: int, width: int, device: torch.device, window: int = 0,
             alternatives: int = 0) -> "HostStage":
        """The stage of rounds of up to `top` rows whose results are `width` wide, with room for
        the logprobs of `window` candidates per row with `alternatives` each."""
        pin = device.type == "cuda"
        rows = torch.zeros(2 * top, dtype=torch.int64, pin_memory=pin)
        out = torch.zeros(top * width, dtype=torch.int64, pin_memory=pin)
        lp_values = torch.zeros(top * window * (1 + alternatives), dtype=torch.float32,
                                pin_memory=pin)
        lp_ids = torch.zeros(top * window * alternatives, dtype=torch.int64, pin_memory=pin)
        return HostStage(rows=rows, out=out, rows_np=rows[:top].numpy(),
                         budget_np=rows[top:].numpy(),
                         done=torch.cuda.Event() if device.type == "cuda" else None,
                         lp_values=lp_values, lp_ids=lp_ids)


@dataclass
class LaunchedRound:
    """A round queued on the device whose results are not read yet: its requests, the host
    staging its results land in, and the event recorded after that copy (None on the CPU, where
    the round ran at launch)."""

    reqs: list[SlotRequest]
    host: torch.Tensor
    done: Any
    steps: int
    extra: int = 0          # trailing columns of `host` that are not tokens (the shadow checks)
    shadow: bool = False    # a catch-up ran after the round: those columns are fresh
    logprobs: tuple[torch.Tensor, torch.Tensor] | None = None   # host views, when copied
    shape: Any = None       # the round's `adaptive_dist.shape.RoundShape`
    budgets: tuple[int, ...] = ()   # each request's draft tokens
    catchup: bool = False   # the lag ring's catch-up forward ran in the round (before or after)
    pending: int = 0        # the deferred prompts' head forward ran at this width (0: none)
