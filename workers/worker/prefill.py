"""Prefill: new requests' prompts through the target (and the head), their first token drawn on
the device into their slot (the host reads it with the round's tokens).

A prefill takes one of two paths, chosen from the round's agreed sizes (so every rank takes the
same): a padded prefill — `rows` requests (a bucket) by `width` token slots (a power of two >= the
longest prompt, >= 32), at most `padded_prefill_tokens` slots — runs through the same padded
attention as the round, as a CUDA graph per (rows, width, every request greedy or not: the argmax
alone or device sampling, as the round; with or without the head's part) in the worker's
`GraphTable` (phase `GraphPhase.PREFILL`) when the round uses graphs (eager otherwise, the same
body); anything larger runs ragged through `attention_backend`, padded to the agreed token count.
The padded path exists because an eager prefill of a small model is all host work and launches:
thousands of operator calls, several milliseconds, tens of decode rounds' worth. At depth 0 a
padded prefill may leave the head's part to the next catch-up (`workers.worker.draft_lag`).

Two sampling features touch the prefill (`docs/sampling.md`). A request whose logits the round
processes (`SamplingParams.processed`: top-k, min_tokens, penalties, logprobs) does not keep the
prefill's first token: after the prefill its slot steps back one position (`SlotState.rewind`),
so its first round draws the first token with the processing; the prefill itself, and its graphs,
are unchanged. A request that asks for `prompt_logprobs` runs its prefill eagerly (the padded body
without its graph, or the ragged path as always) and, after it, the target's logits of every
prompt position but the last (in chunks of `PROMPT_LOGPROB_ROWS` rows; collective like every
`compute_logits`: every rank of the replica runs the same, and the scheduler refuses them when
DP replicas would disagree); their logprobs are copied to the host without a synchronisation and
read with the next round's results.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from workers import startup_log
from workers.attention import ForwardMode, build_metadata
from workers.attention.base import upload
from workers.config import EngineConfig
from workers.kv_cache import pages_for
from workers.sampling import PendingPromptLogprobs
from workers.spec_decode import SALT_SAMPLE, sample_tokens, token_logprobs
from workers.worker.draft_lag import DraftLag
from workers.worker.graph_table import GraphKey, GraphPhase, GraphTable
from workers.worker.models import RankModels
from workers.worker.request import SlotRequest
from workers.worker.slots import SlotState, logprob_width

PROMPT_LOGPROB_ROWS = 512
"""Prompt positions per logits chunk of the prompt logprobs (bounds the [rows, V] logits)."""


class PrefillRunner:
    """The padded prefill's shapes, static inputs and CUDA graphs, and both prefill paths."""

    def __init__(self, config: EngineConfig, slots: SlotState, models: RankModels,
                 lag: DraftLag) -> None:
        self.config, self.slots, self.models, self.lag = config, slots, models, lag
        device = slots.device
        # the padded prefill: its shapes, its static inputs (token ids of `rows x width` slots,
        # then the slot of each row, then each row's prompt length) and its graphs
        self.cap = config.padded_prefill_tokens
        self.row_buckets = config.graph_buckets or tuple(
            1 << i for i in range(config.max_batch_size.bit_length() + 1)
            if 1 << i < 2 * config.max_batch_size)
        self.top_rows = self.row_buckets[-1]
        self.buf = (torch.zeros(self.cap + 2 * self.top_rows, dtype=torch.int64, device=device)
                    if self.cap else None)
        self.table: GraphTable | None = None   # the worker's, once it captures
        self.graph_bytes = 0   # growth of the shared graph pool while they captured

    def shape(self, pad_requests: int, width: int) -> tuple[int, int] | None:
        """(rows, width) of the padded prefill of `pad_requests` requests whose longest prompt
        is `width` tokens (both agreed), or None: the prefill runs ragged."""
        if not self.cap or width < 1:
            return None
        rows = next((b for b in self.row_buckets if b >= pad_requests), None)
        slots = max(32, 1 << (width - 1).bit_length())
        if rows is None or rows * slots > self.cap:
            return None
        return rows, slots

    def inputs(self, bp: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded prefill's static inputs for `bp` rows of `width` slots (views of one
        buffer, what its graphs read): token ids [bp * width], each row's slot [bp] and prompt
        length [bp]."""
        cap, top = self.cap, self.top_rows
        return (self.buf[:bp * width], self.buf[cap:cap + bp], self.buf[cap + top:cap + top + bp])

    def capture(self, table: GraphTable | None, buckets: tuple[int, ...]) -> None:
        """Capture the padded prefill into `table` at every shape that can occur (with graphs;
        start-up only, after the tiers: a body resets the lag ring of the slots it fills if tier
        0 has one)."""
        if table is None or not self.cap:
            return
        self.table = table
        runner = table.runner
        self.buf.zero_()
        self.inputs(self.top_rows, 0)[1].fill_(self.slots.dummy)
        longest = 1 << (self.config.max_context_len - 1).bit_length()
        deferrable = self.lag.deferred_len is not None
        before = runner.pool_bytes()
        for rows in sorted(buckets, reverse=True):
            start, count = time.perf_counter(), len(table)
            held = startup_log.reserved(runner.device)
            width, widths = 32, []
            while rows * width <= self.cap and width <= max(longest, 32):
                widths.append(width)
                for greedy in (False, True):
                    table.capture(self.key(rows, width, greedy),
                                  self._body(rows, width, greedy))
                    if deferrable and width in self.lag.defer_widths:
                        table.capture(self.key(rows, width, greedy, defer=True),
                                      self._body(rows, width, greedy, defer=True))
                width *= 2
            if len(table) > count:
                startup_log.captured(f"prefill graphs, {rows} rows", len(table) - count,
                                     time.perf_counter() - start,
                                     startup_log.reserved(runner.device) - held,
                                     rows=rows, widths=widths)
        self.slots.set_dummy_length(0)
        self.graph_bytes = runner.pool_bytes() - before

    @staticmethod
    def key(rows: int, width: int, greedy: bool, defer: bool = False) -> GraphKey:
        """The padded prefill's graph at `rows` x `width` (`defer`: without the head's part)."""
        return GraphKey(GraphPhase.PREFILL, batch=rows, tokens=width, greedy=greedy,
                        head=not defer)

    def _body(self, rows: int, width: int, greedy: bool,
              defer: bool = False) -> Callable[[], None]:
        return lambda: self.padded(rows, width, greedy, defer)

    def run(self, reqs: list[SlotRequest], pad_tokens: int, pad_requests: int, width: int,
            graph: bool, depth: int | None) -> None:
        """Prefill `reqs` at the agreed sizes (see `EagleWorker.prefill`); `depth`: the tier in
        force (at 0 a padded prefill may defer the head's part)."""
        shape = self.shape(pad_requests, width)
        scoring = any(r.params.prompt_logprobs is not None for r in reqs)
        if shape is None:
            hidden, starts = self._ragged(reqs, pad_tokens, pad_requests)
            self._finish(reqs, hidden if scoring else None, starts)
            return
        lens = [len(r.prompt_ids) for r in reqs]
        if max(lens, default=0) > width or len(reqs) > pad_requests:
            raise RuntimeError(f"prefill of {len(reqs)} requests, longest {max(lens)} tokens, "
                               f"exceeds the agreed {pad_requests} / {width}")
        self.slots.admit(reqs)
        bp, slots = shape
        ids = np.zeros((bp, slots), dtype=np.int64)
        for i, r in enumerate(reqs):
            ids[i, :lens[i]] = r.prompt_ids
        pad = bp - len(reqs)
        dev_ids, dev_rows, dev_lens = upload(
            self.slots.device, ids.reshape(-1).tolist(),
            [r.slot for r in reqs] + [self.slots.dummy] * pad, lens + [0] * pad)
        for dst, src in zip(self.inputs(bp, slots), (dev_ids, dev_rows, dev_lens)):
            dst.copy_(src)
        greedy = all(r.params.greedy for r in reqs)
        defer = self.lag.defers(slots, depth)
        entry = (self.table.get(self.key(bp, slots, greedy, defer))
                 if graph and not scoring and self.table is not None else None)
        hidden = None
        if entry is not None:
            entry.replay()
        else:
            hidden = self._padded(bp, slots, greedy, defer)
        if defer:
            self.lag.mark_deferred(slots)
        self._finish(reqs, hidden if scoring else None, [i * slots for i in range(len(reqs))])

    def _finish(self, reqs: list[SlotRequest], hidden: torch.Tensor | None,
                starts: list[int]) -> None:
        """After a prefill's forwards: the prompt logprobs of the requests that ask for them
        (from `hidden`, the prefill's features; request i's prompt at rows `starts[i]` ..), then
        the processed requests' slots step back one position."""
        if hidden is not None:
            self._prompt_logprobs(reqs, hidden, starts)
        self.slots.rewind(reqs)

    def _prompt_logprobs(self, reqs: list[SlotRequest], hidden: torch.Tensor,
                         starts: list[int]) -> None:
        """Each asking request's prompt logprobs: the target's raw log-probability of prompt
        token i given tokens 0 .. i-1 (i >= 1) and the most likely tokens there, from the
        prefill's features at positions 0 .. P-2; copied to the host without waiting (read once
        the next round's results are)."""
        models, device = self.models, self.slots.device
        asking = [(r, s) for r, s in zip(reqs, starts) if r.params.prompt_logprobs is not None]
        rows = [s + i for r, s in asking for i in range(len(r.prompt_ids) - 1)]
        targets = [t for r, _ in asking for t in r.prompt_ids[1:]]
        k = logprob_width(models.target.config.vocab_size)
        pin = device.type == "cuda"
        host = (torch.empty(len(rows), dtype=torch.float32, pin_memory=pin),
                torch.empty(len(rows), k, dtype=torch.float32, pin_memory=pin),
                torch.empty(len(rows), k, dtype=torch.int64, pin_memory=pin))
        if rows:
            dev_rows, dev_targets = upload(device, rows, targets)
            parts = []
            for lo in range(0, len(rows), PROMPT_LOGPROB_ROWS):
                chunk = slice(lo, lo + PROMPT_LOGPROB_ROWS)
                logits = models.target.compute_logits(hidden[dev_rows[chunk]]).float()
                parts.append(token_logprobs(logits, dev_targets[chunk], k))
            for dst, src in zip(host, zip(*parts)):
                dst.copy_(torch.cat(src), non_blocking=True)
        offset = 0
        for r, _ in asking:
            n = len(r.prompt_ids) - 1
            r.pending_prompt_logprobs = PendingPromptLogprobs(*host, offset, n)
            offset += n

    def padded(self, bp: int, width: int, greedy: bool = False, defer: bool = False) -> None:
        """The padded prefill's body (what its graphs hold): `_padded`, its features dropped."""
        self._padded(bp, width, greedy, defer)

    def _padded(self, bp: int, width: int, greedy: bool = False,
                defer: bool = False) -> torch.Tensor:
        """The padded prefill over `bp` rows of `width` token slots, from the static inputs:
        the target over each row's prompt at positions 0.., its first token drawn at the last
        prompt position (`greedy`: every request greedy, the argmax alone — like the round, one
        graph each way), the head over x_1 .. x_P (the first token last) with f_0 .. f_{P-1} at
        positions 1 .. (`defer`: those inputs kept in the rows' slots for the next catch-up
        instead), and the rows' slots set. Dummy rows (length 0) write the dummy slot. Returns
        the target's features of every token slot ([bp * width, F])."""
        models, device = self.models, self.slots.device
        ids, rows, lens = self.inputs(bp, width)
        reach = min(pages_for(width, self.config.page_size), self.slots.reach)
        pages = self.slots.pages_of(rows, reach)
        start = torch.zeros_like(lens)
        pos = torch.arange(width, device=device).repeat(bp)
        hidden = models.target(ids, pos,
                               models.padded_attn(models.target_kv, pages, start, lens, width))
        last = torch.arange(bp, device=device) * width + (lens - 1).clamp(min=0)
        logits = models.target.compute_logits(hidden[last]).float()
        temp, top_p, seed = self.slots.sampling(rows)
        first = sample_tokens(logits, temp, top_p, seed, lens - 1, SALT_SAMPLE, all_greedy=greedy)
        if models.speculative:
            nxt = torch.cat([ids.view(bp, width)[:, 1:], start[:, None]], dim=1).reshape(-1)
            nxt = nxt.index_copy(0, last, first)
            if defer:
                self.lag.store_prompts(rows, width, nxt, hidden)
            else:
                g = models.head(nxt, hidden, pos + 1,
                                models.padded_attn(models.draft_kv, pages, start, lens, width),
                                last=last)
                self.slots.feature.index_copy_(0, rows, g)
        self._filled(rows, lens, first, defer)
        return hidden

    def _ragged(self, reqs: list[SlotRequest], pad_tokens: int,
                pad_requests: int) -> tuple[torch.Tensor, list[int]]:
        """The prefill through `attention_backend`: every prompt's tokens back to back, padded to
        the agreed `pad_tokens` and `pad_requests`. Returns the target's features of every token
        and the row each request's prompt starts at."""
        models, device = self.models, self.slots.device
        lens = [len(r.prompt_ids) for r in reqs]
        total = sum(lens)
        if total > pad_tokens or len(reqs) > pad_requests:
            raise RuntimeError(f"prefill of {len(reqs)} requests / {total} tokens exceeds the "
                               f"agreed {pad_requests} / {pad_tokens}")
        self.slots.admit(reqs)
        pad = pad_requests - len(reqs)
        ends = [sum(lens[:i + 1]) - 1 for i in range(len(reqs))]
        fields = {  # every host value of the prefill, uploaded in one copy
            "ids": _padded([t for r in reqs for t in r.prompt_ids], pad_tokens),
            "pos": _padded([i for n in lens for i in range(n)], pad_tokens),
            "last": _padded(ends, pad_requests),
            "slots": [r.slot for r in reqs] + [self.slots.dummy] * pad,
            "lens": _padded(lens, pad_requests)}
        if models.speculative:  # the head over x_1 .. x_P with f_0 .. f_{P-1}: positions 1 .. P
            fields["nxt"] = _padded(
                [t for r, n in zip(reqs, lens) for t in r.prompt_ids[1:n] + [0]], pad_tokens)
            fields["pos2"] = _padded([i + 1 for n in lens for i in range(n)], pad_tokens)
        dev = dict(zip(fields, upload(device, *fields.values())))
        meta = build_metadata(ForwardMode.EXTEND, [r.pages for r in reqs], [0] * len(reqs), lens,
                              self.config.page_size, device)
        hidden = models.target(dev["ids"], dev["pos"], models.backend.plan(meta, models.target_kv))
        last, slots = dev["last"], dev["slots"]
        logits = models.target.compute_logits(hidden[last]).float()
        temp, top_p, seed = self.slots.sampling(slots)
        first = sample_tokens(logits, temp, top_p, seed, dev["lens"] - 1, SALT_SAMPLE,
                              all_greedy=all(r.params.greedy for r in reqs))
        if models.speculative:
            nxt = dev["nxt"]
            nxt[last[:len(reqs)]] = first[:len(reqs)]
            g = models.head(nxt, hidden, dev["pos2"], models.backend.plan(meta, models.draft_kv),
                            last=last)
            self.slots.feature.index_copy_(0, slots, g)
        self._filled(slots, dev["lens"], first)
        return hidden, [end + 1 - n for end, n in zip(ends, lens)]

    def _filled(self, slots: torch.Tensor, lens: torch.Tensor, first: torch.Tensor,
                deferred: bool = False) -> None:
        """Prefilled slots: their cache length, first token, an empty lag ring and (`deferred`)
        the prompt's head forward waiting for the catch-up, or none."""
        self.slots.cache_len.index_copy_(0, slots, lens)
        self.slots.last_token.index_copy_(0, slots, first)
        self.lag.reset(slots, lens, deferred)
        self.slots.cache_len[self.slots.dummy:].zero_()


def _padded(values: list[int], size: int) -> list[int]:
    return values + [0] * (size - len(values))
