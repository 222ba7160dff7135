"""The only module of the server that touches the engine.

It uses the engine's API (``Engine.add/step/abort``, ``engine.scheduler``, ``engine.last_plan``,
``Request`` with its ``logprobs`` / ``prompt_logprobs``) plus three read-only looks, each in one
small function: ``kv_pages`` (free KV pages), ``current_steps`` (the depth in force) and
``numeric_stats`` (what ``engine.stats`` / ``engine.planner.stats`` expose: the spec-decode
counters are the planner's ``RoundStats``).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workers.server.admission import generate_refusal
from workers.server.protocol import Generate, QueueStats, TokenDelta

if TYPE_CHECKING:  # the frontend process imports this module without torch
    from workers.engine import Engine

ADD_ERRORS = (ValueError, TypeError, OverflowError, IndexError, KeyError)
"""What `Engine.add` raises for a request it cannot take: errors of the request's values, which
every rank of the replica raises alike (the same message, the same replicated state). Anything
else it raises is this rank's own fault and ends the rank (docs/serving.md)."""


class Refused(Exception):
    """A request this replica does not run: HTTP `status`, the API field `param` (or None)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


@dataclass(frozen=True)
class KVPages:
    """KV pages (the target's and the draft's pools share page tables): `free` of `usable`."""

    free: int
    usable: int


def kv_pages(engine: Engine) -> KVPages:
    """Free and usable pages of the engine's page allocator (owned by its scheduler)."""
    alloc = engine.scheduler.allocator
    return KVPages(free=alloc.num_free_pages, usable=alloc.usable_pages)


def current_steps(engine: Engine) -> int:
    """The speculative depth in force (0 without speculation)."""
    return int(engine.planner.steps)


def numeric_stats(stats: Any) -> tuple[dict[str, float], dict[str, int]]:
    """(numeric fields, accept histogram) of a stats object's `to_dict()` (`EngineStats`, the
    planner's `RoundStats`)."""
    raw = stats.to_dict()
    numbers = {k: float(v) for k, v in raw.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for key, value in raw.items():   # Counters keyed by int (e.g. rounds_at_steps) flatten
        if isinstance(value, Mapping) and key != "accept_histogram":
            for sub, n in value.items():
                if isinstance(n, (int, float)) and not isinstance(n, bool):
                    numbers[f"{key}_{sub}"] = float(n)
    hist = raw.get("accept_histogram") or {}
    return numbers, {str(k): int(v) for k, v in dict(hist).items()}


def serving_sizes(model_config: Any, max_batch_size: int, max_model_len: int | None
                  ) -> dict[str, int]:
    """Engine sizes for serving: `max_batch_size` requests per DP replica of up to
    `max_model_len` tokens each (default: the model's context)."""
    limit = model_config.max_position_embeddings
    length = limit if max_model_len is None else max_model_len
    if not 2 <= length <= limit:
        raise ValueError(f"--max-model-len {length}: must be in [2, {limit}] "
                         f"(the model's context length)")
    return {"max_batch_size": max_batch_size, "max_context_len": length}


def token_logprob(lp: Any) -> list:
    """A ``TokenLogprob`` on the wire: [token_id, logprob, [[id, logprob], ...]]."""
    return [int(lp.token_id), float(lp.logprob), [[int(t), float(v)] for t, v in lp.top]]


@dataclass
class _Live:
    """A request this rank runs, and how much of it the frontend already has."""

    req: Any
    sent_at: float
    applied_at: float
    reported: int = 0
    admitted_at: float | None = None    # the start of the round that admitted it
    prompt_sent: bool = False


class EngineAdapter:
    """Adds, aborts and steps requests by the frontend's ids; turns progress into deltas."""

    def __init__(self, engine: Engine, eos_token_ids: tuple[int, ...], dp_rank: int,
                 vocab_size: int) -> None:
        self.engine = engine
        self.eos_token_ids = tuple(eos_token_ids)
        self.dp_rank = dp_rank
        self.vocab_size = vocab_size
        self.live: dict[str, _Live] = {}
        self.rounds = 0
        self.round_seconds = 0.0

    @property
    def has_work(self) -> bool:
        return bool(self.engine.scheduler.has_work)

    @property
    def context(self) -> int:
        """Tokens a request may span (prompt and output) on this replica."""
        return int(self.engine.scheduler.max_context_len)

    def add(self, msg: Generate) -> None:
        """Queue `msg` in the engine, or raise `Refused` if it cannot run. The verdict depends
        on the message and on state every rank of the replica shares (its settings, the requests
        it runs), never on this rank alone: every rank of the replica refuses alike, in the same
        round, and the replica stays in lockstep."""
        from workers.sampling import SamplingParams

        refusal = generate_refusal(msg, self.context, self.vocab_size, self.eos_token_ids)
        if refusal is not None:
            raise Refused(refusal.message, 400, refusal.param)
        if msg.rid in self.live:
            raise Refused(f"rid: request id {msg.rid!r} is already running", 400, "rid")
        try:
            stops = (() if msg.ignore_eos else self.eos_token_ids) + tuple(msg.stop_token_ids)
            if msg.prompt_logprobs is not None \
                    and not self.engine.scheduler.prompt_logprobs:
                raise Refused("echo: prompt logprobs (echo with logprobs) need one DP replica; "
                              "this server runs several (--dp > 1)", 400, "echo")
            # k at or past the vocabulary keeps every token: the same as no top-k
            top_k = 0 if msg.top_k >= self.vocab_size else msg.top_k
            params = SamplingParams(temperature=float(msg.temperature), top_p=float(msg.top_p),
                                    max_new_tokens=msg.max_tokens,
                                    stop_token_ids=tuple(dict.fromkeys(stops)),
                                    top_k=top_k, min_tokens=msg.min_tokens,
                                    presence_penalty=float(msg.presence_penalty),
                                    frequency_penalty=float(msg.frequency_penalty),
                                    repetition_penalty=float(msg.repetition_penalty),
                                    logprobs=msg.logprobs, prompt_logprobs=msg.prompt_logprobs)
            req = self.engine.add(list(msg.prompt_ids), params, seed=msg.seed)
        except ValueError as err:           # the engine's own checks (e.g. its KV pool)
            raise Refused(f"the engine cannot run this request: {err}", 400) from None
        except ADD_ERRORS as err:
            raise Refused(f"the engine failed to add this request ({type(err).__name__}: "
                          f"{err})", 500) from None
        self.live[msg.rid] = _Live(req, msg.sent_at, time.time())

    def abort(self, rid: str) -> None:
        """Finish `rid` early (its final delta, reason "abort", follows from `collect`)."""
        live = self.live.get(rid) if isinstance(rid, str) else None
        if live is not None:
            self.engine.abort(live.req.rid)

    def step(self, seq: int, leave: bool, pending: bool) -> Any:
        """One engine round on every rank of the cluster (the round's consensus agrees the
        messages to apply and whether to stop); returns the agreed plan."""
        start, wall = time.perf_counter(), time.time()
        self.engine.step(seq=seq, leave=leave, pending=pending)
        self.round_seconds += time.perf_counter() - start
        self.rounds += 1
        for live in self.live.values():    # admitted at this round's start
            if live.admitted_at is None and live.req.slot is not None:
                live.admitted_at = wall
        return self.engine.last_plan

    def collect(self) -> list[TokenDelta]:
        """Deltas of every request that produced tokens or finished since the last call."""
        deltas, now = [], time.time()
        for rid, live in list(self.live.items()):
            req = live.req
            n = len(req.output_ids)
            if n == live.reported and not req.finished:
                continue
            first = live.reported == 0 and n > 0
            logprobs = prompt = None
            if req.logprobs is not None:
                logprobs = [token_logprob(lp) for lp in req.logprobs[live.reported:n]]
            if req.prompt_logprobs is not None and not live.prompt_sent:
                prompt = [None if lp is None else token_logprob(lp) for lp in req.prompt_logprobs]
                live.prompt_sent = True
            queued = (live.admitted_at if live.admitted_at is not None else now) - live.applied_at
            deltas.append(TokenDelta(
                rid=rid, token_ids=list(req.output_ids[live.reported:n]),
                finish_reason=req.finish_reason,
                wake_s=live.applied_at - live.sent_at if first and live.sent_at else None,
                first_token_s=now - live.sent_at if first and live.sent_at else None,
                queue_s=max(0.0, queued) if first else None,
                logprobs=logprobs, prompt_logprobs=prompt))
            live.reported = n
            if req.finished:
                del self.live[rid]
        return deltas

    def queue_stats(self) -> QueueStats:
        """This DP group's queue, KV pool and engine counters."""
        sched, engine = self.engine.scheduler, self.engine
        pages = kv_pages(engine)
        eng_numbers, eng_hist = numeric_stats(engine.stats)
        spec = engine.planner.stats
        plan_numbers, _ = numeric_stats(spec)
        return QueueStats(
            dp_rank=self.dp_rank, running_requests=len(sched.running),
            waiting_requests=len(sched.waiting),
            running_tokens=sum(r.num_tokens for r in sched.running),
            waiting_tokens=sum(len(r.prompt_ids) + r.params.max_new_tokens for r in sched.waiting),
            kv_free_pages=pages.free, kv_usable_pages=pages.usable,
            steps=current_steps(engine), rounds=self.rounds,
            round_seconds_total=self.round_seconds, engine=eng_numbers, planner=plan_numbers,
            accept_histogram=eng_hist, spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens, spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_pos))
