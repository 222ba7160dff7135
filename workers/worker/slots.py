"""The slot state: what the worker keeps per request on the device, and a tier's round buffers.

Per request the worker keeps, on the device, in the request's batch slot: its page table (given by
the scheduler at admission, fixed while it runs), `n` (tokens in each cache), its last committed
token `x_n` (not in the caches yet), the head's last output `g_n`, and its sampling settings
(seed, temperature, top-p), and, for a request whose logits the round processes
(`SamplingParams.processed`), its controls (top-k, min_tokens' stop ids and end, penalties) and
its counts: `[slots, V]` generated-token counts and prompt-token flags for the penalties, updated
on the device as tokens are committed (`docs/sampling.md`). Caches, for tokens `x_0 .. x_n`: the target holds the KV of positions
`0 .. n-1`; the draft head holds positions `1 .. n` (KV index `j` is position `j+1`: the head's
input at position `p` is `x_p` with the target feature `f_{p-1}`, see `workers.model.eagle`).

The last slot is the dummy slot: a round's rows beyond its requests (padding up to the plan's
batch) are dummy rows in it; its pages are the dummy page and its cache length is 0 after every
forward that writes it (a measurement may set it first: the dummy rows then read that many
positions). `round_rows` holds the slot of each row of the round in force: every tier's buffers
share it (one round runs at a time).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.attention.base import upload
from workers.config import EngineConfig
from workers.kv_cache import DUMMY_PAGE
from workers.sampling import MAX_LOGPROBS, MAX_STOP_IDS
from workers.spec_decode import Controls
from workers.worker.request import SlotRequest

SHADOW_COLUMNS = 2  # depth 0 with a head: the catch-up's (hits, checks) per row, after the tokens


def logprob_width(vocab: int) -> int:
    """The alternatives a round computes per token for logprobs: MAX_LOGPROBS (or the whole
    vocabulary when it is smaller)."""
    return min(MAX_LOGPROBS, vocab)


class SlotState:
    """The per-slot device tensors (one row per batch slot, the last is the dummy slot) and the
    slot of each row of the round."""

    def __init__(self, config: EngineConfig, feature_size: int, dtype: torch.dtype,
                 device: torch.device, vocab: int) -> None:
        slots, reach = config.max_batch_size + 1, config.pages_per_request
        self.device = device
        self.page_size, self.pool_pages = config.page_size, config.pool_pages
        self.dummy = config.max_batch_size

        def zeros(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=device)

        self.pages = torch.full((slots, reach), DUMMY_PAGE, dtype=torch.int64, device=device)
        self.cache_len = zeros(slots)                      # n: tokens in each cache
        self.last_token = zeros(slots)                     # x_n: the last committed token
        self.feature = zeros(slots, feature_size, dt=dtype)   # g_n: the head's last output
        self.seed = zeros(slots)
        self.temperature = zeros(slots, dt=torch.float32)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        # the controls of processed requests (neutral in every other slot, the dummy's too)
        self.vocab = vocab
        self.top_k = zeros(slots)
        self.stop_ids = zeros(slots, MAX_STOP_IDS)   # padded with repeats of the first id
        self.stop_until = zeros(slots)   # a token below this absolute position is no stop
        self.presence = zeros(slots, dt=torch.float32)
        self.frequency = zeros(slots, dt=torch.float32)
        self.repetition = torch.ones(slots, dtype=torch.float32, device=device)
        self.counts = zeros(slots, vocab, dt=torch.int32)   # generated tokens, per token id
        self.seen = zeros(slots, vocab, dt=torch.bool)      # prompt tokens, per token id
        self._processed: set[int] = set()   # host: slots whose controls are not neutral
        top = max([slots, *config.graph_buckets])
        # the slot of each row of the round, read by every tier's bodies (one round runs at a
        # time, and the catch-up of the draft cache runs within whichever tier is in force)
        self.round_rows = torch.full((top,), self.dummy, dtype=torch.int64, device=device)

    @property
    def count(self) -> int:
        """Slots, the dummy slot included."""
        return self.cache_len.shape[0]

    @property
    def reach(self) -> int:
        """Pages of a slot's page table (what a captured forward may read)."""
        return self.pages.shape[1]

    def real(self, rows: torch.Tensor) -> torch.Tensor:
        """1 for a real row, 0 for a dummy one."""
        return (rows != self.dummy).to(torch.int64)

    def row_state(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's cache length n, 1 for a real row / 0 for a dummy one)."""
        return self.cache_len[rows], self.real(rows)

    def pages_of(self, rows: torch.Tensor, reach: int) -> torch.Tensor:
        """The first `reach` pages of each row's page table."""
        return self.pages[rows][:, :reach]

    def sampling(self, rows: torch.Tensor,
                 greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's temperature, top-p and seed; for an all-greedy round (which reads none of
        them) views of the right shape instead of three gathers."""
        if greedy:
            bp = rows.shape[0]
            return self.temperature[:bp], self.top_p[:bp], self.seed[:bp]
        return self.temperature[rows], self.top_p[rows], self.seed[rows]

    def admit(self, reqs: list[SlotRequest]) -> None:
        """Page tables and sampling settings of newly admitted requests into their slots (two
        host-to-device copies, whatever the number of requests)."""
        if not reqs:
            return
        reach = self.reach
        tables = [r.pages + [DUMMY_PAGE] * (reach - len(r.pages)) for r in reqs]
        slots, seeds, pages = upload(self.device, [r.slot for r in reqs], [r.seed for r in reqs],
                                     [p for t in tables for p in t])
        self.pages.index_copy_(0, slots, pages.view(len(reqs), reach))
        self.seed.index_copy_(0, slots, seeds)
        temp, top_p = upload(self.device, [float(r.params.temperature) for r in reqs],
                             [float(r.params.top_p) for r in reqs], dtype=torch.float32)
        self.temperature.index_copy_(0, slots, temp)
        self.top_p.index_copy_(0, slots, top_p)
        self._admit_controls(reqs)

    def _admit_controls(self, reqs: list[SlotRequest]) -> None:
        """The controls of newly admitted processed requests, and neutral ones for any other
        request whose slot held a processed one (nothing at all when neither is admitted: a
        request that uses none of the features costs what it cost before them). A penalised
        request's counts start at zero and its prompt's tokens are flagged."""
        touched = [r for r in reqs if r.params.processed or r.slot in self._processed]
        if not touched:
            return
        ints: list[list[int]] = [[], [], [], []]   # slot, top_k, stop_until, stop ids (flat)
        floats: list[list[float]] = [[], [], []]   # presence, frequency, repetition
        for r in touched:
            params, on = r.params, r.params.processed
            (self._processed.add if on else self._processed.discard)(r.slot)
            stops = [t for t in params.stop_token_ids if 0 <= t < self.vocab] if on else []
            masked = bool(stops) and params.min_tokens > 0
            ints[0].append(r.slot)
            ints[1].append(params.top_k if on and not params.greedy else 0)
            ints[2].append(len(r.prompt_ids) + params.min_tokens if masked else 0)
            ints[3].extend(stops + stops[:1] * (MAX_STOP_IDS - len(stops)) if stops
                           else [0] * MAX_STOP_IDS)
            floats[0].append(float(params.presence_penalty) if on else 0.0)
            floats[1].append(float(params.frequency_penalty) if on else 0.0)
            floats[2].append(float(params.repetition_penalty) if on else 1.0)
        slots, top_k, until, stops = upload(self.device, *ints)
        presence, frequency, repetition = upload(self.device, *floats, dtype=torch.float32)
        self.top_k.index_copy_(0, slots, top_k)
        self.stop_until.index_copy_(0, slots, until)
        self.stop_ids.index_copy_(0, slots, stops.view(len(touched), MAX_STOP_IDS))
        self.presence.index_copy_(0, slots, presence)
        self.frequency.index_copy_(0, slots, frequency)
        self.repetition.index_copy_(0, slots, repetition)
        penalised = [r for r in touched if r.params.processed and r.params.penalised]
        if penalised:
            own, flat_slots, flat_ids = upload(
                self.device, [r.slot for r in penalised],
                [r.slot for r in penalised for _ in r.prompt_ids],
                [t for r in penalised for t in r.prompt_ids])
            self.counts.index_fill_(0, own, 0)
            self.seen.index_fill_(0, own, False)
            self.seen.index_put_((flat_slots, flat_ids.clamp(0, self.vocab - 1)),
                                 torch.ones_like(flat_ids, dtype=torch.bool))

    def rewind(self, reqs: list[SlotRequest]) -> None:
        """After their prefill: processed requests step back one position (n = P - 1, the last
        token the prompt's last), so their first round's verify draws the first token at window
        position 0, with the processing (the prefill's draw, unprocessed, is dropped; the head's
        entry it left at position P is overwritten before it is read). Nothing for others."""
        back = [r for r in reqs if r.params.processed]
        if not back:
            return
        slots, lens, last = upload(self.device, [r.slot for r in back],
                                   [len(r.prompt_ids) - 1 for r in back],
                                   [r.prompt_ids[-1] for r in back])
        self.cache_len.index_copy_(0, slots, lens)
        self.last_token.index_copy_(0, slots, last)

    def controls(self, rows: torch.Tensor) -> Controls:
        """Each row's controls and counts (a processed round's gathers)."""
        return Controls(top_k=self.top_k[rows], stop_ids=self.stop_ids[rows],
                        stop_until=self.stop_until[rows], presence=self.presence[rows],
                        frequency=self.frequency[rows], repetition=self.repetition[rows],
                        counts=self.counts[rows], seen=self.seen[rows])

    def count_committed(self, rows: torch.Tensor, tokens: torch.Tensor, accept: torch.Tensor,
                        real: torch.Tensor) -> None:
        """Add a round's committed tokens (`tokens[b, :accept[b] + 1]` of real rows) to their
        slots' counts (on the device, inside the round)."""
        width = tokens.shape[1]
        valid = (torch.arange(width, device=tokens.device)[None, :] <= accept[:, None]) \
            & (real[:, None] > 0)
        flat = rows[:, None] * self.vocab + tokens.clamp(0, self.vocab - 1)
        self.counts.view(-1).index_add_(0, flat.reshape(-1), valid.reshape(-1).to(torch.int32))

    def set_dummy_length(self, tokens: int) -> None:
        """The dummy slot's cache length: how many positions the dummy rows' attention reads
        (0 but in measurements; every forward that writes the slot sets it back to 0). Above 0
        its page table points at distinct pages (pages 1.. of the pools, free at start-up), so a
        measurement's attention reads memory as a request of that length does, not one page
        over and over; at 0 it is the dummy page again. Dummy rows never write those pages
        (their K/V go to the dummy page)."""
        self.cache_len[self.dummy] = tokens
        row = self.pages[self.dummy]
        row.fill_(DUMMY_PAGE)
        if tokens > 0:
            n = min(-(-tokens // self.page_size), row.shape[0], self.pool_pages - 1)
            row[:n] = torch.arange(1, n + 1, device=row.device)


@dataclass
class RoundBuffers:
    """The round's static buffers, one set for every round shape (fixed addresses: what every
    CUDA graph of the round reads and writes; one round runs at a time). Two kinds:

    - fixed layouts, read by the target forward of any shape: each row's slot and draft budget,
      the drafts (`[top, max_steps]`: draft k of row b at `[b, k-1]` whatever the depth), and
      the packed verify forward's outputs (`[max_tokens, ...]`: its features, logits and their
      argmax);
    - flat storage that each depth views at its own widths (`StepBuffers`): the draft
      distributions, the verify window's features, the accepted lengths, the committed
      candidates, the host's row and the logprobs.
    """

    rows: torch.Tensor           # [top] in: the slot of each row (dummy slot beyond the batch)
    budget: torch.Tensor         # [top] in: draft tokens of each row this round (<= S; dummy 0)
    staged: torch.Tensor         # [2 * top]: rows then budget (one host-to-device copy)
    drafts: torch.Tensor         # [top, max_steps] draft tokens            (draft -> target)
    packed_hidden: torch.Tensor  # [max_tokens, F] the verify forward's features (target -> accept)
    packed_logits: torch.Tensor  # [max_tokens, V] its logits, model dtype        (target -> accept)
    packed_arg: torch.Tensor     # [max_tokens] their argmax                       (target -> accept)
    q: torch.Tensor              # flat: [top, S, V] float32 draft distributions per depth
    hidden: torch.Tensor         # flat: [top * W, F] the verify window's features (accept -> extend)
    accept: torch.Tensor         # [top] accepted drafts (accept -> extend, host)
    tokens: torch.Tensor         # flat: [top, W] committed candidates
    out: torch.Tensor            # flat: [top, 2 + W + extra] what the host reads once per round
    lp_values: torch.Tensor      # flat: [top, W, 1 + K] processed rounds' logprobs ...
    lp_ids: torch.Tensor         # flat: [top, W, K]     ... and their token ids
    logprob_k: int               # K: the alternatives a processed round keeps per candidate
    views: dict[int, "StepBuffers"] = field(default_factory=dict)   # per depth

    @staticmethod
    def allocate(slots: SlotState, max_steps: int, max_tokens: int, vocab: int,
                 feature_size: int, dtype: torch.dtype, extra: int,
                 device: torch.device) -> "RoundBuffers":
        """The buffers of every shape up to `max_steps` draft forwards and `max_tokens` verify
        tokens, for up to `len(slots.round_rows)` rows; `extra` columns of the host's row after
        the tokens at depth 0 (the shadow checks)."""
        top, width, k = slots.round_rows.shape[0], max_steps + 1, logprob_width(vocab)

        def zeros(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=device)

        staged = zeros(2 * top)
        staged[:top].fill_(slots.dummy)
        # NOTE: the slot state's round rows become the staged rows (one host-to-device copy
        # brings a round's rows and budgets); nothing holds the old tensor yet
        slots.round_rows = staged[:top]
        return RoundBuffers(
            rows=slots.round_rows, budget=staged[top:], staged=staged,
            drafts=zeros(top, max_steps), packed_hidden=zeros(max_tokens, feature_size, dt=dtype),
            packed_logits=zeros(max_tokens, vocab, dt=dtype), packed_arg=zeros(max_tokens),
            q=zeros(top * max_steps * vocab, dt=torch.float32),
            hidden=zeros(top * width, feature_size, dt=dtype), accept=zeros(top),
            tokens=zeros(top * width), out=zeros(top * (2 + max(width, 1 + extra))),
            lp_values=zeros(top * width * (1 + k), dt=torch.float32), lp_ids=zeros(top * width * k),
            logprob_k=k)

    def view(self, steps: int, extra: int = 0) -> "StepBuffers":
        """The buffers of depth `steps` (views, made once per depth: a graph captured on them
        reads the same addresses every replay); `extra` columns of `out` after the tokens."""
        if steps not in self.views:
            top, width = self.rows.shape[0], steps + 1
            vocab, k = self.packed_logits.shape[1], self.logprob_k
            self.views[steps] = StepBuffers(
                steps=steps, rows=self.rows, budget=self.budget, drafts=self.drafts[:, :steps],
                q=self.q[:top * steps * vocab].view(top, steps, vocab),
                hidden=self.hidden[:top * width], accept=self.accept,
                tokens=self.tokens[:top * width].view(top, width),
                out=self.out[:top * (2 + width + extra)].view(top, 2 + width + extra),
                lp_values=self.lp_values[:top * width * (1 + k)].view(top, width, 1 + k),
                lp_ids=self.lp_ids[:top * width * k].view(top, width, k), shared=self)
        return self.views[steps]

    @property
    def nbytes(self) -> int:
        tensors = (self.staged, self.drafts, self.packed_hidden, self.packed_logits,
                   self.packed_arg, self.q, self.hidden, self.accept, self.tokens, self.out,
                   self.lp_values, self.lp_ids)
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class StepBuffers:
    """The round buffers as depth `steps` sees them (views of `RoundBuffers`)."""

    steps: int
    rows: torch.Tensor       # [top] the slot of each row (shared by every depth)
    budget: torch.Tensor     # [top] each row's draft tokens this round (<= steps)
    drafts: torch.Tensor     # [top, S] draft tokens (a strided view of the fixed layout)
    q: torch.Tensor          # [top, S, V] draft distributions
    hidden: torch.Tensor     # [top * W, F] the verify window's features
    accept: torch.Tensor     # [top] accepted drafts
    tokens: torch.Tensor     # [top, W] committed candidates
    out: torch.Tensor        # [top, 2 + W + extra] what the host reads
    lp_values: torch.Tensor  # [top, W, 1 + K]
    lp_ids: torch.Tensor     # [top, W, K]
    shared: RoundBuffers

    @property
    def extra_columns(self) -> int:
        """Columns of `out` after the round's tokens: SHADOW_COLUMNS for tier 0 with a head."""
        return self.out.shape[1] - 2 - self.steps - 1
