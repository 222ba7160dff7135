"""Requests and continuous batching.

A `Request` carries its prompt, its sampling parameters, its generated tokens and its
seed (its random draws are a hash of the seed and the position, so they do not depend on the rest
of the batch), and, when asked, their logprobs and its prompt's; `Request.commit` appends tokens
and stops at a stop token (not before `min_tokens` tokens) or `max_new_tokens` (tokens past the
stop are dropped). The `Scheduler` owns KV admission: it keeps a FIFO of waiting
requests and the running batch; between rounds it admits waiting requests while the batch has a
free slot and the page allocator can give them their worst case (their page table and batch slot
are theirs until they finish), and retires finished ones (pages and slot go back).

Every rank of a DP replica (its attention-TP group) runs the same scheduler over the same requests,
so their batches agree without communication; replicas schedule independently and the round's
consensus agrees the padded shapes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

import numpy as np

from workers.kv_cache import PageAllocator
from workers.sampling import MAX_STOP_IDS, PendingPromptLogprobs, SamplingParams, TokenLogprob


class OutputBuffer:
    """Generated tokens of the running requests, one row per batch slot, committed for the whole
    batch at once (numpy, no loop over requests): a row keeps the round's candidates up to its
    accepted count, its first stop token and its `max_new_tokens`. Each row has `spare` columns
    past `capacity`, so a round's candidates are written whole (one scatter) and only the count
    decides what is committed."""

    def __init__(self, slots: int, capacity: int, spare: int = 16) -> None:
        self.capacity = capacity
        self.tokens = np.zeros((slots, capacity + spare), dtype=np.int64)
        self.count = np.zeros(slots, dtype=np.int64)
        self.limit = np.zeros(slots, dtype=np.int64)
        self.min_count = np.zeros(slots, dtype=np.int64)   # no stop before this many tokens
        # the first token is drawn by the first round, not the prefill (processed requests)
        self.rewound = np.zeros(slots, dtype=bool)
        self.stops = np.full((slots, MAX_STOP_IDS), -1, dtype=np.int64)
        self.accepted = np.zeros(slots, dtype=np.int64)   # draft tokens accepted, summed
        self.rounds = np.zeros(slots, dtype=np.int64)     # speculative rounds run
        self._col = np.arange(spare)

    def open(self, slot: int, params: SamplingParams) -> None:
        """Empty row `slot` for a request with `params`."""
        if len(params.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(params.stop_token_ids)} stop token ids; at most "
                             f"{MAX_STOP_IDS} are supported")
        if params.max_new_tokens > self.capacity:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} exceeds the output "
                             f"buffer's {self.capacity} tokens")
        self.count[slot] = self.accepted[slot] = self.rounds[slot] = 0
        self.limit[slot] = params.max_new_tokens
        self.min_count[slot] = params.min_tokens
        self.rewound[slot] = params.processed
        self.stops[slot] = -1
        self.stops[slot, :len(params.stop_token_ids)] = params.stop_token_ids

    def row(self, slot: int) -> list[int]:
        return self.tokens[slot, :self.count[slot]].tolist()

    def commit(self, slots: np.ndarray, cand: np.ndarray, counts: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        """Append `cand[b, :counts[b]]` to row `slots[b]` for every b (cut at a stop token, one
        at or past the row's `min_tokens`, and at the row's limit). Returns (finished by a stop
        token, finished by the limit), per b."""
        width = cand.shape[1]
        if width > self._col.shape[0]:  # wider than any round so far: more spare columns
            self.tokens = np.concatenate(
                [self.tokens, np.zeros((self.tokens.shape[0], width), dtype=np.int64)], axis=1)
            self._col = np.arange(self.tokens.shape[1] - self.capacity)
        col = self._col[:width]
        count = self.count[slots]
        room = self.limit[slots] - count
        n = np.minimum(counts, room)
        stop = (cand[:, :, None] == self.stops[slots][:, None, :]).any(-1)
        stop &= col < n[:, None]
        stop &= count[:, None] + col >= self.min_count[slots][:, None]
        stopped = stop.any(1)
        if stopped.any():
            n = np.where(stopped, stop.argmax(1) + 1, n)
        self.tokens[slots[:, None], count[:, None] + col] = cand
        self.count[slots] = count + n
        return stopped, ~stopped & (n >= room)


@dataclass(eq=False)
class Request:
    """One generation request and everything it produced so far. While it runs, its tokens live
    in the scheduler's `OutputBuffer` (committed for the whole batch at once); at retirement they
    move into the request."""

    rid: int
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    finish_reason: str | None = None       # "stop", "length" or "abort"
    slot: int | None = None                 # batch slot while admitted
    pages: list[int] = field(default_factory=list)  # KV page table while admitted
    buffer: OutputBuffer | None = field(default=None, repr=False)
    _output: list[int] = field(default_factory=list, repr=False)
    accepted: int = 0      # draft tokens accepted, over its speculative rounds (when retired)
    spec_rounds: int = 0   # speculative rounds it ran (when retired)
    # with `params.logprobs`: one per generated token, as they are committed
    logprobs: list[TokenLogprob] | None = None
    # with `params.prompt_logprobs`: one per prompt token (the first None), from its first round
    prompt_logprobs: list[TokenLogprob | None] | None = None
    pending_prompt_logprobs: PendingPromptLogprobs | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def output_ids(self) -> list[int]:
        """The tokens generated so far (a copy while the request runs)."""
        if self.buffer is not None and self.slot is not None:
            return self.buffer.row(self.slot)
        return self._output

    @property
    def finished(self) -> bool:
        """Whether the request stopped."""
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Length of `tokens`."""
        count = self.buffer.count[self.slot] if self.buffer is not None and self.slot is not None \
            else len(self._output)
        return len(self.prompt_ids) + int(count)

    @property
    def mean_accept_length(self) -> float | None:
        """Draft tokens accepted per speculative round (bonus excluded)."""
        return self.accepted / self.spec_rounds if self.spec_rounds else None

    def commit(self, tokens: list[int]) -> None:
        """Append generated `tokens` (a request not in a batch), stopping at a stop token or at
        `max_new_tokens` — the same rule `OutputBuffer.commit` applies to a batch."""
        buf = OutputBuffer(1, self.params.max_new_tokens)
        buf.open(0, self.params)
        buf.tokens[0, :len(self._output)] = self._output
        buf.count[0] = len(self._output)
        if self.finished or not tokens:
            return
        stopped, full = buf.commit(np.zeros(1, dtype=np.int64),
                                   np.asarray([list(tokens)], dtype=np.int64),
                                   np.asarray([len(tokens)]))
        self._output = buf.row(0)
        if stopped[0] or full[0]:
            self.finish_reason = "stop" if stopped[0] else "length"


class Scheduler:
    """FIFO admission into a running batch of at most `max_batch_size` requests."""

    def __init__(self, allocator: PageAllocator, max_batch_size: int, max_context_len: int,
                 kv_tokens: Callable[[Request], int], device: torch.device | str = "cpu",
                 prompt_logprobs: bool = True) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1")
        self.allocator = allocator
        self.max_batch_size = max_batch_size
        self.max_context_len = max_context_len
        self.kv_tokens = kv_tokens
        self.device = torch.device(device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_batch_size - 1, -1, -1))
        self.outputs = OutputBuffer(max_batch_size + 1, max_context_len)
        # whether requests may ask for prompt logprobs: their prefill computes the logits of
        # every prompt position, a collective every rank must run alike (False with several DP
        # replicas, whose prefills the round does not agree on that)
        self.prompt_logprobs = prompt_logprobs
        self._scoring: list[Request] = []   # running requests whose prompt logprobs are pending

    def validate(self, req: Request, what: str | None = None) -> None:
        """Raise `ValueError` naming what is wrong (and `what`, default "request <rid>") if
        `req` can never run."""
        what = what or f"request {req.rid}"
        if not req.prompt_ids:
            raise ValueError(f"{what}: the prompt is empty; give at least one token")
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if len(req.prompt_ids) >= self.max_context_len:
            raise ValueError(
                f"{what}: prompt of {len(req.prompt_ids)} tokens is longer than the "
                f"context length ({self.max_context_len} tokens, room for at least one new token)")
        if total > self.max_context_len:
            raise ValueError(
                f"{what}: prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                f"({req.params.max_new_tokens}) = {total} exceeds the context length "
                f"({self.max_context_len} tokens)")
        if req.params.prompt_logprobs is not None and not self.prompt_logprobs:
            raise ValueError(
                f"{what}: prompt_logprobs is not supported with several DP replicas (the "
                "prefill's logits of every prompt position are a collective the replicas do "
                "not agree on); run with dp 1")
        self.allocator.check_fits(self.kv_tokens(req))

    def add(self, req: Request) -> None:
        """Queue `req` (validated first: an impossible request is refused, never queued)."""
        self.validate(req)
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def admit(self) -> list[Request]:
        """Move waiting requests into the batch, in arrival order, while they fit; return them."""
        admitted = []
        while self.waiting and self._free_slots \
                and self.allocator.can_allocate(self.kv_tokens(self.waiting[0])):
            req = self.waiting.popleft()
            req.pages = self.allocator.allocate(req.rid, self.kv_tokens(req))
            req.slot = self._free_slots.pop()
            self.outputs.open(req.slot, req.params)
            req.buffer = self.outputs
            self.running.append(req)
            admitted.append(req)
            if req.params.prompt_logprobs is not None:
                self._scoring.append(req)
        return admitted

    def commit_round(self, reqs: list[Request], first: np.ndarray, accept: np.ndarray,
                     tokens: np.ndarray,
                     logprobs: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Commit a round for the whole batch at once: row b brings `first[b]` (its first token,
        drawn at prefill; committed if it has none yet, unless the request is processed: its
        first round drew it), then `tokens[b, :accept[b] + 1]`. Requests that reach a stop token
        or their limit are marked finished. `logprobs` (a round with logprobs: per row and
        candidate the raw logprob and the top ones, and their ids): appended to the requests
        that ask for them, for the tokens committed. Prompt logprobs of requests prefilled
        before this round (their copy ran before its results) reach their requests."""
        if not reqs:
            return
        if self._scoring:
            self._settle_prompt_logprobs(reqs)
        slots = np.fromiter((r.slot for r in reqs), dtype=np.int64, count=len(reqs))
        out = self.outputs
        before = out.count[slots] if logprobs is not None else None
        fresh = (out.count[slots] == 0) & ~out.rewound[slots]
        if fresh.any():  # the round after a prefill: the first token leads those rows
            cand = np.concatenate([first[:, None], tokens], axis=1)
            cand[~fresh, :-1] = tokens[~fresh]
            counts = accept + 1 + fresh
        else:
            cand, counts = tokens, accept + 1
        out.accepted[slots] += accept
        out.rounds[slots] += 1
        stopped, full = out.commit(slots, cand, counts)
        if logprobs is not None:
            self._commit_logprobs(reqs, cand, out.count[slots] - before, logprobs)
        for b in np.flatnonzero(stopped | full):  # only the requests that just finished
            if not reqs[b].finished:
                reqs[b].finish_reason = "stop" if stopped[b] else "length"

    @staticmethod
    def _commit_logprobs(reqs: list[Request], cand: np.ndarray, committed: np.ndarray,
                         logprobs: tuple[np.ndarray, np.ndarray]) -> None:
        """The logprobs of the `committed[b]` tokens row b just committed (`cand[b, :n]`; rows
        with logprobs are never fresh, so their candidates are the round's tokens)."""
        values, ids = logprobs
        for b, req in enumerate(reqs):
            if req.logprobs is None:
                continue
            k = min(req.params.logprobs, ids.shape[2])
            for j in range(int(committed[b])):
                req.logprobs.append(TokenLogprob(
                    int(cand[b, j]), float(values[b, j, 0]),
                    tuple(zip(ids[b, j, :k].tolist(), values[b, j, 1:1 + k].tolist()))))

    def _settle_prompt_logprobs(self, reqs: list[Request]) -> None:
        """Prompt logprobs of this round's requests (prefilled before it was launched, so their
        copy is done once its results are read) into `Request.prompt_logprobs`."""
        here = {id(r) for r in reqs}
        waiting = []
        for req in self._scoring:
            pending = req.pending_prompt_logprobs
            if pending is None or id(req) not in here:
                waiting.append(req)
                continue
            lo, n = pending.offset, pending.count
            token_lp = pending.token_lp[lo:lo + n].tolist()
            top_lp = pending.top_lp[lo:lo + n].tolist()
            top_ids = pending.top_ids[lo:lo + n].tolist()
            k = min(req.params.prompt_logprobs, pending.top_ids.shape[1])
            req.prompt_logprobs = [None] + [
                TokenLogprob(t, token_lp[i], tuple(zip(top_ids[i][:k], top_lp[i][:k])))
                for i, t in enumerate(req.prompt_ids[1:])]
            req.pending_prompt_logprobs = None
        self._scoring = waiting

    def abort(self, req: Request) -> None:
        """Finish `req` with reason "abort": a waiting one leaves the queue at once, a running
        one at the next `retire`."""
        req.finish_reason = "abort"
        if req in self.waiting:
            self.waiting.remove(req)

    def retire(self) -> list[Request]:
        """Remove finished requests from the batch, give back their pages and slot; return them."""
        done = [r for r in self.running if r.finished]
        if done:
            self.running = [r for r in self.running if not r.finished]
            if self._scoring:   # aborted before a round read them: none
                self._scoring = [r for r in self._scoring if not r.finished]
            for req in done:
                self.allocator.free(req.rid)
                req._output = self.outputs.row(req.slot)
                req.accepted = int(self.outputs.accepted[req.slot])
                req.spec_rounds = int(self.outputs.rounds[req.slot])
                self._free_slots.append(req.slot)
                req.slot, req.pages, req.buffer = None, [], None
        return done
