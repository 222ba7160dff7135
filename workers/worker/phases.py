"""The round's phases on the device: draft, the packed verify forward, accept, draft-extend.

One round at shape (S draft forwards, T verify tokens) over `B` requests, padded to `Bp` rows (the
plan's batch: the agreed CUDA-graph bucket, or the cluster's largest batch when eager; rows beyond
`B` are dummy rows in a dummy slot whose pages are the dummy page). Request `b` drafts `d_b <= S`
tokens this round (its budget; a chain: every `d_b = S`):
1. draft: `d_1` from `g_n`; for k = 2..S one head forward of `d_{k-1}` at position `n+k-1` (every
   row runs all S steps; a row uses its first `d_b`);
2. target: one forward of the round's verify tokens packed back to back — `[x_n, d_1 .. d_{d_b}]`
   of each request at positions `n .. n+d_b`, `sum(d_b + 1) <= T`, padded to `T` with dummy
   tokens — so its cost follows the tokens, not `Bp x (S + 1)`. Each token attends over its own
   request's pages up to its position (on a GPU the fused padded attention at width 1 over the
   T tokens, each a row with its request's page table; the reference path scatters them into
   the [rows, max_steps + 1] grid of the rows' windows), so the forward's shape depends on `T`
   alone and one graph per token rung serves every depth and batch;
3. accept: each request's window `[0 .. S]` gathered from the packed outputs (positions beyond
   `d_b` repeat the last, and are never read: at most `d_b` drafts count), then acceptance on
   the device (greedy: exact match; sampling: rejection sampling) -> `a <= d_b` drafts + bonus;
4. draft-extend: the head over the `a+1` committed tokens at positions `n+1 .. n+a+1` with the
   target features `f_n .. f_{n+a}` (window rows `0..a`); its row `a` becomes `g_{n+a+1}` (the
   head's last layer stores every row's KV but goes on with row `a` only: no other output is read;
   the prefill's head likewise with each prompt's last row);
5. the slots advance on the device (`n += a+1`, last token, feature); the host reads the accepted
   lengths and tokens once and commits them to the requests.
Rejected tokens need no cleanup: their KV slots are past `n` and the next round overwrites them.
Features are `target.feature_size` (F) wide: the final hidden state (EAGLE), or with an EAGLE-3
head `[hidden | fc(three captured target states)]`, computed inside the target's forward (so
inside its graph); the head's own output has the same width. An EAGLE-3 head's
`compute_logits` scatters its draft-vocabulary logits to target ids through `d2t` (`-inf`
elsewhere), so the drafts and their distributions `q` are over target ids before verify sees them.
At `S = 0` (no speculation) the round is one target forward of `x_n` per request and a sampled
token.

Every forward of the round is padded (`attention.static_backend`), so the eager path and the CUDA
graph path run the same code; under DP attention every rank runs the same forwards with the same
row and token counts (an idle rank: all dummy rows and tokens), which is what keeps the
collectives inside them in lockstep; what a request drafts inside the agreed shape is the
rank's own. The buffers are one set for every shape (`RoundBuffers`), seen by each depth at its
widths (`StepBuffers`).

Each phase is a body over the buffers and the slot state (what a CUDA graph holds; an eager round
calls the same body). The accept phase has a processed variant, run when a request of the round
has `SamplingParams.processed` (top-k, min_tokens, penalties, logprobs): the target's logits go
through `process_logits` per window position, acceptance keeps top-k, the committed tokens are
counted in their slots and the raw logprobs of every candidate are staged; a round without such a
request runs exactly the variant it ran before them. At depth 0 with a head the accept phase also
appends each row's committed token and target feature to its lag ring
(`workers.worker.draft_lag`).
"""
from __future__ import annotations

from typing import Callable

import torch

from workers import kernels
from workers.attention import PaddedBatch
from workers.attention.static_backend import PackedAttention
from workers.spec_decode import (
    SALT_SAMPLE,
    draft_step,
    process_logits,
    sample_tokens,
    token_logprobs,
    verify,
    verify_greedy,
)
from workers.worker.draft_lag import DraftLag
from workers.worker.graph_table import GraphKey, GraphPhase, GraphTable
from workers.worker.models import RankModels
from workers.worker.slots import RoundBuffers, SlotState, StepBuffers


def round_phases(steps: int) -> tuple[GraphPhase, ...]:
    """The phases of a round at `steps` draft forwards (depth 0, with or without a head: the
    target and the acceptance only; the head's catch-up is scheduled by `EagleWorker.launch`)."""
    if steps > 0:
        return GraphPhase.DRAFT, GraphPhase.TARGET, GraphPhase.ACCEPT, GraphPhase.EXTEND
    return GraphPhase.TARGET, GraphPhase.ACCEPT


def phase_key(phase: GraphPhase, batch: int, steps: int, tokens: int, greedy: bool,
              processed: bool = False) -> GraphKey:
    """The key of a chain round's `phase` at `batch` rows, `steps` draft forwards and `tokens`
    packed verify tokens: the target by `tokens` alone; draft-extend draws nothing (its greedy
    variant only); the processed variant is the acceptance's."""
    if phase is GraphPhase.TARGET:
        return GraphKey(phase, tokens=tokens)
    return GraphKey(phase, batch=batch, steps=steps, greedy=greedy or phase is GraphPhase.EXTEND,
                    processed=processed and phase is GraphPhase.ACCEPT)


def row_starts(rows: torch.Tensor, budget: torch.Tensor, dummy: int) -> torch.Tensor:
    """Where each row's verify tokens start in the packed forward: rows `rows` (their slots; the
    dummy slot for padding rows, which bring none) bring `budget[b] + 1` tokens each, back to
    back -> [rows] (inclusive end - count), with the end of every row."""
    count = (rows != dummy).to(torch.int64) * (budget + 1)
    return count.cumsum(0) - count


def packing(rows: torch.Tensor, budget: torch.Tensor, dummy: int,
            tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each of `tokens` packed verify tokens comes from (`row_starts`' layout) -> (row
    [T], clamped to a valid index; window position k [T]; real [T] bool). Tokens past the rows'
    total are padding (real False, k 0)."""
    top = rows.shape[0]
    count = (rows != dummy).to(torch.int64) * (budget + 1)
    end = count.cumsum(0)
    j = torch.arange(tokens, device=rows.device)
    row = torch.searchsorted(end, j, right=True)
    real = row < top
    row = row.clamp(max=top - 1)
    k = torch.where(real, j - (end - count)[row], torch.zeros_like(j))
    return row, k, real


class RoundPhases:
    """The bodies of a round's phases over the slot state and the round buffers."""

    def __init__(self, slots: SlotState, models: RankModels, lag: DraftLag,
                 buffers: RoundBuffers) -> None:
        self.slots, self.models, self.lag, self.buffers = slots, models, lag, buffers

    def body(self, key: GraphKey, bufs: StepBuffers | None, reach: int) -> Callable[[], None]:
        """The body of the phase `key` names (`bufs`: the depth's buffers; the target phase
        reads the shared ones) whose rows' KV reach is `reach` pages."""
        match key.phase:
            case GraphPhase.TARGET:
                return lambda: self.target_phase(key.tokens, reach)
            case GraphPhase.DRAFT:
                return lambda: self.draft_phase(bufs, key.batch, reach, key.greedy)
            case GraphPhase.ACCEPT:
                return lambda: self.accept_phase(bufs, key.batch, key.greedy, key.processed)
            case GraphPhase.EXTEND:
                return lambda: self.extend_phase(bufs, key.batch, reach)
            case GraphPhase.CATCHUP:
                return lambda: self.lag.catchup_phase(bufs, key.batch, reach, True)
        raise ValueError(f"no round body for phase {key.phase} (the tree's, the deferred "
                         f"prompts' and the prefill's bodies are their owners')")

    def keys(self, steps: int, batch: int) -> list[GraphKey]:
        """The graphs of depth `steps` at `batch` rows (not the target's, which are per token
        rung): the draft loop and the acceptance with device sampling (any request) and greedy
        (the argmax alone, cheaper), each acceptance again with the logits processing;
        draft-extend samples nothing: once."""
        keys = []
        for phase in round_phases(steps):
            if phase is GraphPhase.TARGET:
                continue
            for greedy in ((False, True) if phase is not GraphPhase.EXTEND else (True,)):
                for processed in ((False, True) if phase is GraphPhase.ACCEPT else (False,)):
                    keys.append(GraphKey(phase, batch=batch, steps=steps, greedy=greedy,
                                         processed=processed))
        return keys

    def capture(self, table: GraphTable, bufs: StepBuffers, batch: int, reach: int) -> None:
        """Capture depth `bufs.steps`'s graphs at `batch` rows into `table`."""
        for key in self.keys(bufs.steps, batch):
            table.capture(key, self.body(key, bufs, reach))

    def capture_target(self, table: GraphTable, tokens: int, reach: int) -> None:
        """Capture the packed verify forward at `tokens` tokens into `table`."""
        key = GraphKey(GraphPhase.TARGET, tokens=tokens)
        table.capture(key, self.body(key, None, reach))

    # ---- the bodies ----------------------------------------------------------------------------
    def draft_phase(self, bufs: StepBuffers, bp: int, reach: int, greedy: bool) -> None:
        """`steps` draft tokens per row (chain drafting) and their distributions (an all-greedy
        round keeps only the tokens: its acceptance is an exact match and reads no `q`)."""
        slots, models = self.slots, self.models
        rows = bufs.rows[:bp]
        n, real = slots.row_state(rows)
        temp, top_p, seed = slots.sampling(rows, greedy)
        pages = slots.pages_of(rows, reach) if bufs.steps > 1 else None
        g = slots.feature[rows]
        for k in range(1, bufs.steps + 1):
            if k > 1:  # the head over d_{k-1} at position n+k-1 (draft KV index n+k-2)
                attn = models.padded_attn(models.draft_kv, pages, n + k - 2, real, 1)
                g = models.head(bufs.drafts[:bp, k - 2], g, n + k - 1, attn)
            logits = models.head.compute_logits(g)
            if greedy:
                bufs.drafts[:bp, k - 1] = logits.argmax(-1)
                continue
            token, q = draft_step(logits.float(), temp, top_p, seed, n, k)
            bufs.drafts[:bp, k - 1] = token
            bufs.q[:bp, k - 1] = q

    def target_phase(self, tokens: int, reach: int) -> None:
        """The target over the round's `tokens` packed verify tokens (`packing`: each row's
        `[x_n, d_1 .. d_budget]` at positions `n ..`), each attending over its own request's
        pages; its features, logits and their argmax into the packed buffers."""
        slots, models, buf = self.slots, self.models, self.buffers
        row, k, real = packing(buf.rows, buf.budget, slots.dummy, tokens)
        slot = torch.where(real, buf.rows[row], torch.full_like(row, slots.dummy))
        pos = slots.cache_len[slot] + k
        ids = slots.last_token[slot]
        if buf.drafts.shape[1]:
            drafted = buf.drafts[row, (k - 1).clamp(0, buf.drafts.shape[1] - 1)]
            ids = torch.where(k > 0, drafted, ids)
        if kernels.enabled(pos):
            # each token a width-1 row of its request's pages: the fused kernel's programs are
            # the tokens' (a [rows, max_steps + 1] grid would launch every batch slot's, the
            # dummy ones too: measured 1.2 ms more per 8B round at batch 1)
            attn = models.padded_attn(models.target_kv, slots.pages_of(slot, reach), pos,
                                      real.to(torch.int64), 1)
        else:   # the reference: through a [rows, S+1] grid, each row's KV gathered once
            width = buf.drafts.shape[1] + 1
            rows = buf.rows
            count = (rows != slots.dummy).to(torch.int64) * (buf.budget + 1)
            grid = PaddedBatch(slots.pages_of(rows, reach), slots.cache_len[rows], count, width)
            index = torch.where(real, row * width + k,
                                torch.full_like(row, rows.shape[0] * width))
            attn = PackedAttention(grid, index, models.target_kv)
        hidden = models.target(ids, pos, attn)
        logits = models.target.compute_logits(hidden)
        buf.packed_hidden[:tokens] = hidden
        buf.packed_logits[:tokens] = logits
        buf.packed_arg[:tokens] = logits.argmax(-1)

    def accept_phase(self, bufs: StepBuffers, bp: int, greedy: bool,
                     processed: bool = False) -> None:
        """Each row's verify window gathered from the packed outputs, then acceptance on the
        device (`processed`: on the processed logits, then the committed tokens counted and the
        raw logprobs of every candidate staged)."""
        slots, buf = self.slots, self.buffers
        steps, width = bufs.steps, bufs.steps + 1
        rows = bufs.rows[:bp]
        n, real = slots.row_state(rows)
        budget = bufs.budget[:bp] * real
        temp, top_p, seed = slots.sampling(rows, greedy)
        start = row_starts(rows, bufs.budget[:bp], slots.dummy)
        offsets = torch.arange(width, device=slots.device)
        window = (start[:, None] + torch.minimum(offsets[None, :], budget[:, None]))
        window = window.clamp(max=buf.packed_arg.shape[0] - 1).reshape(-1)   # [bp * W]
        hidden = buf.packed_hidden[window]
        top_k = None
        if greedy and not processed:
            raw = None
            target_arg = buf.packed_arg[window].view(bp, width)
        else:
            raw = logits = buf.packed_logits[window].float().view(bp, width, -1)
            if processed:
                controls = slots.controls(rows)
                logits = process_logits(raw, n, controls, bufs.drafts[:bp] if steps else None)
                top_k = None if greedy else controls.top_k
            target_arg = logits.argmax(-1)
        if steps == 0:
            tokens = (target_arg[:, :1] if greedy else
                      sample_tokens(logits[:, 0], temp, top_p, seed, n, SALT_SAMPLE,
                                    top_k=top_k)[:, None])
            accept = torch.zeros_like(n)
        elif greedy:
            accept, tokens = verify_greedy(bufs.drafts[:bp], target_arg, budget,
                                           buf.packed_logits.shape[1])
        else:
            accept, tokens = verify(bufs.drafts[:bp], bufs.q[:bp], logits, temp, top_p, seed, n,
                                    budget, top_k=top_k)
        if processed:
            slots.count_committed(rows, tokens, accept, real)
            k = bufs.lp_ids.shape[2]
            token_lp, top_lp, top_ids = token_logprobs(raw.reshape(bp * width, -1),
                                                       tokens.reshape(-1), k)
            bufs.lp_values[:bp, :, 0] = token_lp.view(bp, width)
            bufs.lp_values[:bp, :, 1:] = top_lp.view(bp, width, k)
            bufs.lp_ids[:bp] = top_ids.view(bp, width, k)
        bufs.hidden[:bp * width] = hidden
        bufs.accept[:bp] = accept * real
        bufs.tokens[:bp] = tokens
        bufs.out[:bp, 0] = slots.last_token[rows]
        if steps == 0:
            if self.lag.built:  # the head's inputs at position n+1, for the catch-up
                self.lag.append(rows, tokens[:, 0], hidden, real)
            self._advance(bufs, bp, rows, n, None)

    def extend_phase(self, bufs: StepBuffers, bp: int, reach: int) -> None:
        """The head over the committed tokens at positions n+1.. (draft KV index n..), fed the
        target features f_n.. (window rows 0..a); its row a is the next g; the slots advance."""
        slots, models = self.slots, self.models
        width = bufs.steps + 1
        rows = bufs.rows[:bp]
        n, real = slots.row_state(rows)
        accept = bufs.accept[:bp]
        offsets = torch.arange(width, device=slots.device)
        pages = slots.pages_of(rows, reach)
        attn = models.padded_attn(models.draft_kv, pages, n, real * (accept + 1), width)
        last = torch.arange(bp, device=slots.device) * width + accept
        g = models.head(bufs.tokens[:bp].reshape(-1), bufs.hidden[:bp * width],
                        (n[:, None] + 1 + offsets).reshape(-1), attn, last=last)
        self._advance(bufs, bp, rows, n, g)

    def _advance(self, bufs: StepBuffers, bp: int, rows: torch.Tensor, n: torch.Tensor,
                 g: torch.Tensor | None) -> None:
        """Move every row's slot past its committed tokens and stage what the host reads."""
        slots = self.slots
        accept = bufs.accept[:bp]
        index = torch.arange(bp, device=slots.device)
        slots.cache_len.index_copy_(0, rows, n + accept + 1)
        slots.last_token.index_copy_(0, rows, bufs.tokens[:bp][index, accept])
        if g is not None:
            slots.feature.index_copy_(0, rows, g)
        slots.cache_len[slots.dummy:].zero_()
        bufs.out[:bp, 1] = accept
        bufs.out[:bp, 2:2 + bufs.steps + 1] = bufs.tokens[:bp]   # then the shadow columns, if any
