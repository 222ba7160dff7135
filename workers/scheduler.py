"""Requests and continuous batching.

A `Request` carries its prompt, its sampling parameters, its generated tokens and its
seed (its random draws are a hash of the seed and the position, so they do not depend on the rest
of the batch); `Request.commit` appends tokens and stops at a stop token or `max_new_tokens`
(tokens past the stop are dropped). The `Scheduler` owns KV admission: it keeps a FIFO of waiting
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

from workers.kv_cache import PageAllocator
from workers.sampling import SamplingParams


@dataclass
class Request:
    """One generation request and everything it produced so far."""

    rid: int
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None       # "stop" (a stop token) or "length" (max_new_tokens)
    accept_lengths: list[int] = field(default_factory=list)  # per speculative round
    slot: int | None = None                 # batch slot while admitted
    pages: list[int] = field(default_factory=list)  # KV page table while admitted

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
        return len(self.prompt_ids) + len(self.output_ids)

    def commit(self, tokens: list[int]) -> None:
        """Append generated `tokens`, stopping at a stop token or at `max_new_tokens`."""
        for token in tokens:
            if self.finished:
                return
            self.output_ids.append(int(token))
            if token in self.params.stop_token_ids:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"


class Scheduler:
    """FIFO admission into a running batch of at most `max_batch_size` requests."""

    def __init__(self, allocator: PageAllocator, max_batch_size: int, max_context_len: int,
                 kv_tokens: Callable[[Request], int], device: torch.device | str = "cpu") -> None:
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
            self.running.append(req)
            admitted.append(req)
        return admitted

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
            for req in done:
                self.allocator.free(req.rid)
                self._free_slots.append(req.slot)
                req.slot, req.pages = None, []
        return done
