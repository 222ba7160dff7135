"""The draft lag: depth 0 with a head, where the head's cache falls behind and catches up.

Depth 0 with a head (a tier the goodput policy may pick) is a plain round: the head does not run,
so its cache falls behind. Each such round appends the committed token `x_{n+1}` and the target
feature `f_n` to the slot's lag ring (`lag` entries, at most `catchup_every`); a catch-up forward
runs the head over the ring (positions `n-lag+1 .. n`, draft KV index `n-lag ..`, one padded
forward of width `catchup_every`), writes those KV entries, sets `g_n` from its last real row and
empties the ring. It runs after every `catchup_every`-th consecutive depth-0 round and before the
first round at a depth > 0, so drafting always resumes from a current draft cache, and a depth-0
round costs one head forward per `catchup_every` rounds instead of one per round. The catch-up
also checks the head's greedy guesses against the ring: its output at entry j predicts the token
of entry j+1, already committed, so a row with `lag` entries gives `lag - 1` free depth-1 checks;
a depth-0 round after which the catch-up ran reports each row's (hits, checks), the shadow
acceptance the goodput policy reads at depth 0 (`adaptive_dist.coordinator`). The count of depth-0
rounds is the worker's own, the same on every rank (every rank launches every round of the
cluster), so every rank runs the catch-up, and the collectives inside the head, in the same round.

A padded prefill run at depth 0 may leave the head's part out as well (prompts whose width is at
most `EngineConfig.defer_prefill_width`): the head's inputs (the prompt's tokens shifted by one,
the first token last, and the target's features) wait in the slot, and the next catch-up first
runs one head forward over every waiting prompt of the round's rows (a graph per bucket and
width: the widest width deferred since the last catch-up), then the ring, whose entries follow
the prompt. A prefill that does not defer clears its slot's waiting prompt.
"""
from __future__ import annotations

from typing import Callable

import torch

from workers import kernels
from workers.config import EngineConfig
from workers.worker.graph_table import GraphKey, GraphPhase, GraphTable
from workers.worker.models import RankModels
from workers.worker.slots import SHADOW_COLUMNS, SlotState, StepBuffers

CATCHUP, PENDING = GraphPhase.CATCHUP, GraphPhase.PENDING


class DraftLag:
    """Every slot's lag ring and deferred prompt (allocated with tier 0, with a head), the
    depth-0 rounds since the last catch-up, the catch-up forwards and their CUDA graphs."""

    def __init__(self, config: EngineConfig, slots: SlotState, models: RankModels) -> None:
        self.slots, self.models = slots, models
        self.catchup_every = config.catchup_rounds  # the catch-up forward's width
        # committed tokens not in the draft cache yet
        self.ring_len: torch.Tensor | None = None       # [slots] entries in the ring
        self.ring_tokens: torch.Tensor | None = None    # [slots, catchup_every] x_{p}
        self.ring_features: torch.Tensor | None = None  # [slots, catchup_every, F] f_{p-1}
        self.rounds_behind = 0                          # depth-0 rounds since the last catch-up
        self.table: GraphTable | None = None   # the worker's, once it captures
        # prompts whose head forward waits for the catch-up (when `defer_prefill_width` admits a
        # padded prefill width)
        self.deferred_len: torch.Tensor | None = None       # [slots] tokens waiting (0: none)
        self.deferred_tokens: torch.Tensor | None = None    # [slots, W] the head's x_1 .. x_P
        self.deferred_features: torch.Tensor | None = None  # [slots, W, F] f_0 .. f_{P-1}
        self.deferred_width = 0     # the widest deferred prefill since the last catch-up
        # the padded prefill widths whose head forward may wait for the catch-up
        self.defer_widths: tuple[int, ...] = ()
        cap = config.padded_prefill_tokens
        if config.speculative and cap:
            width, widths = 32, []
            while width <= min(config.defer_prefill_width, cap):
                widths.append(width)
                width *= 2
            self.defer_widths = tuple(widths)

    @property
    def built(self) -> bool:
        """Whether the lag ring exists (a head and a depth-0 tier)."""
        return self.ring_len is not None

    def allocate(self) -> None:
        """The ring and (with `defer_widths`) the deferred prompts of every slot."""
        def zeros(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=self.slots.device)

        dim, dtype = self.models.target.feature_size, self.slots.feature.dtype
        slots, lag = self.slots.count, self.catchup_every
        self.ring_len = zeros(slots)
        self.ring_tokens = zeros(slots, lag)
        self.ring_features = zeros(slots, lag, dim, dt=dtype)
        if self.defer_widths:
            self.deferred_len = zeros(slots)
            self.deferred_tokens = zeros(slots, self.defer_widths[-1])
            self.deferred_features = zeros(slots, self.defer_widths[-1], dim, dt=dtype)

    @property
    def nbytes(self) -> int:
        """Device bytes of the ring and the deferred prompts."""
        return sum(t.numel() * t.element_size()
                   for t in (self.ring_len, self.ring_tokens, self.ring_features,
                             self.deferred_len, self.deferred_tokens, self.deferred_features)
                   if t is not None)

    # ---- what the round and the prefill tell it ------------------------------------------------
    @property
    def behind(self) -> bool:
        """Whether the draft cache lags (a depth-0 round or a deferred prompt since the last
        catch-up): drafting must not resume before a catch-up."""
        return bool(self.rounds_behind or self.deferred_width)

    def count_round(self) -> bool:
        """A depth-0 round ran; whether the ring is now full (for a row in every round): the
        catch-up runs after this round."""
        self.rounds_behind += 1
        return self.rounds_behind == self.catchup_every

    def append(self, rows: torch.Tensor, token: torch.Tensor, hidden: torch.Tensor,
               real: torch.Tensor) -> None:
        """A depth-0 round's committed token and target feature (the head's inputs at position
        n+1) onto each real row's ring (inside the round's forward)."""
        if kernels.enabled(hidden):
            kernels.lag_append(rows, token, hidden, self.ring_len, self.ring_tokens,
                               self.ring_features, self.slots.dummy)
        else:
            lag = self.ring_len[rows]
            self.ring_tokens[rows, lag] = token
            self.ring_features[rows, lag] = hidden
            self.ring_len.index_copy_(0, rows, lag + real)

    def defers(self, width: int, depth: int | None) -> bool:
        """Whether a padded prefill of `width` slots at `depth` (the tier in force, agreed)
        leaves the head's part to the catch-up: at depth 0 with the deferral buffers, at a
        width they hold."""
        return self.deferred_len is not None and depth == 0 and width in self.defer_widths

    def store_prompts(self, rows: torch.Tensor, width: int, tokens: torch.Tensor,
                      features: torch.Tensor) -> None:
        """A deferred prefill's head inputs (`rows` x `width`) into the rows' slots (inside the
        prefill's forward)."""
        bp = rows.shape[0]
        self.deferred_tokens[rows, :width] = tokens.view(bp, width)
        self.deferred_features[rows, :width] = features.view(bp, width, -1)

    def mark_deferred(self, width: int) -> None:
        """A prefill of `width` slots deferred its head part (host side, after the forward)."""
        self.deferred_width = max(self.deferred_width, width)

    def reset(self, slots: torch.Tensor, lens: torch.Tensor, deferred: bool) -> None:
        """Prefilled slots: an empty ring and (`deferred`) `lens` prompt tokens waiting for the
        catch-up, or none."""
        if self.ring_len is not None:
            self.ring_len.index_copy_(0, slots, torch.zeros_like(slots))
        if self.deferred_len is not None:
            self.deferred_len.index_copy_(0, slots, lens if deferred else torch.zeros_like(slots))
            self.deferred_len[self.slots.dummy:].zero_()

    # ---- the catch-up ------------------------------------------------------------------------
    def catch_up(self, bufs: StepBuffers, bp: int, reach: int,
                 graph_bucket: int | None) -> tuple[int, bool]:
        """The draft cache caught up: the deferred prompts (if any prefill left its head part
        since the last catch-up), then the lag ring (if any depth-0 round ran since). Returns
        what ran: (the deferred prompts' forward width, 0: none; whether the ring's forward
        ran), for the round log and the cost model's catch-up term."""
        width = self.deferred_width
        ring = bool(self.rounds_behind)
        if width:
            if graph_bucket is None:
                self.prompt_phase(bp, reach, width)
            else:
                self.table.replay(GraphKey(PENDING, batch=graph_bucket, tokens=width))
            self.deferred_width = 0
        if self.rounds_behind:
            if graph_bucket is None:
                self.catchup_phase(bufs, bp, reach, True)
            else:
                self.table.replay(GraphKey(CATCHUP, batch=graph_bucket))
            self.rounds_behind = 0
        return width, ring

    def catchup_phase(self, bufs: StepBuffers, bp: int, reach: int, greedy: bool) -> None:
        """The head over each row's lag ring: `lag` tokens at positions n-lag+1 .. n (draft KV
        index n-lag ..) fed the target features recorded with them; its row lag-1 is the new g.
        Rows without lag (and dummy rows) write nothing and keep their g. With the shadow
        columns (tier 0's buffers) each row's hits and checks of the head's greedy guesses
        against the ring's next tokens go to the last two columns of `out`."""
        models, slots, width = self.models, self.slots, self.catchup_every
        rows = bufs.rows[:bp]
        n, real = slots.row_state(rows)
        lag = self.ring_len[rows] * real
        base = n - lag
        offsets = torch.arange(width, device=slots.device)
        attn = models.padded_attn(models.draft_kv, slots.pages_of(rows, reach), base, lag, width)
        out = models.head(self.ring_tokens[rows].reshape(-1),
                          self.ring_features[rows].reshape(bp * width, -1),
                          (base[:, None] + 1 + offsets).reshape(-1), attn)
        g = out.view(bp, width, -1)[torch.arange(bp, device=slots.device), (lag - 1).clamp(min=0)]
        fresh = torch.where((lag > 0)[:, None], g, slots.feature[rows])
        slots.feature.index_copy_(0, rows, fresh)
        self.ring_len.index_copy_(0, rows, torch.zeros_like(lag))
        if bufs.extra_columns == SHADOW_COLUMNS:
            # NOTE: one logits row per ring entry (bp x catchup_every rows, once per catch-up)
            guess = models.head.compute_logits(out).argmax(-1).view(bp, width)[:, :-1]
            checks = (lag - 1).clamp(min=0)
            valid = offsets[None, :-1] < checks[:, None]
            hits = ((guess == self.ring_tokens[rows][:, 1:]) & valid).sum(1)
            bufs.out[:bp, -2] = hits
            bufs.out[:bp, -1] = checks

    def prompt_phase(self, bp: int, reach: int, width: int) -> None:
        """The head over each row's deferred prompt (the part of a padded prefill run at depth 0
        that was left out): `P` tokens x_1 .. x_P at positions 1 .. P (draft KV index 0 ..) fed
        f_0 .. f_{P-1}; its row P-1 is the new g. Rows without a deferred prompt (and dummy
        rows) write nothing and keep their g; `width` >= every waiting prompt's bucket. Runs
        with the catch-up, before the ring (whose entries follow the prompt)."""
        models, slots = self.models, self.slots
        rows = slots.round_rows[:bp]
        real = slots.real(rows)
        length = self.deferred_len[rows] * real
        start = torch.zeros_like(length)
        pos = torch.arange(1, width + 1, device=slots.device).repeat(bp)
        last = torch.arange(bp, device=slots.device) * width + (length - 1).clamp(min=0)
        attn = models.padded_attn(models.draft_kv, slots.pages_of(rows, reach), start, length,
                                  width)
        g = models.head(self.deferred_tokens[rows, :width].reshape(-1),
                        self.deferred_features[rows, :width].reshape(bp * width, -1), pos, attn,
                        last=last)
        fresh = torch.where((length > 0)[:, None], g, slots.feature[rows])
        slots.feature.index_copy_(0, rows, fresh)
        self.deferred_len.index_copy_(0, rows, start)

    def capture(self, table: GraphTable, bufs: StepBuffers, bucket: int, reach: int) -> None:
        """Capture the catch-up at `bucket` and the deferred prompts' forward at `bucket` and
        every deferral width (with tier 0's buffers; once per bucket)."""
        if bufs.steps != 0 or not self.built:
            return
        self.table = table
        table.capture(GraphKey(CATCHUP, batch=bucket), self._catchup_body(bufs, bucket, reach))
        if self.deferred_len is not None:
            for width in self.defer_widths:
                table.capture(GraphKey(PENDING, batch=bucket, tokens=width),
                              self._prompt_body(bucket, reach, width))

    def catchup_phase_body(self, bufs: StepBuffers, bp: int,
                           reach: int) -> Callable[[], None]:
        """The catch-up's eager body at `bp` rows (what its graph holds)."""
        return self._catchup_body(bufs, bp, reach)

    def _catchup_body(self, bufs: StepBuffers, bp: int, reach: int) -> Callable[[], None]:
        return lambda: self.catchup_phase(bufs, bp, reach, True)

    def _prompt_body(self, bp: int, reach: int, width: int) -> Callable[[], None]:
        return lambda: self.prompt_phase(bp, reach, width)
