"""The round's three phases on the device: draft, verify + accept, draft-extend.

One round at depth `S` over `B` requests, padded to `Bp` rows (the plan's batch: the agreed
CUDA-graph bucket, or the cluster's largest batch when eager; rows beyond `B` are dummy rows in a
dummy slot whose pages are the dummy page):
1. draft: `d_1` from `g_n`; for k = 2..S one head forward of `d_{k-1}` at position `n+k-1`;
2. verify: one target forward of `[x_n, d_1 .. d_S]` at positions `n .. n+S`;
3. accept (greedy: exact match on the device; sampling: rejection sampling) -> `a` drafts + bonus;
4. draft-extend: the head over the `a+1` committed tokens at positions `n+1 .. n+a+1` with the
   target features `f_n .. f_{n+a}` (verify rows `0..a`); its row `a` becomes `g_{n+a+1}` (the
   head's last layer stores every row's KV but goes on with row `a` only: no other output is read;
   the prefill's head likewise with each prompt's last row);
5. the slots advance on the device (`n += a+1`, last token, feature); the host reads the accepted
   lengths and tokens once and commits them to the requests.
Rejected tokens need no cleanup: their KV slots are past `n` and the next round overwrites them.
Features are `target.feature_size` (F) wide: the final hidden state (EAGLE), or with an EAGLE-3
head `[hidden | fc(three captured target states)]`, computed inside the target's forward (so
inside the verify graph); the head's own output has the same width. An EAGLE-3 head's
`compute_logits` scatters its draft-vocabulary logits to target ids through `d2t` (`-inf`
elsewhere), so the drafts and their distributions `q` are over target ids before verify sees them.
At `S = 0` (no speculation) the round is one target forward of `x_n` and a sampled token.

Every forward of the round is padded (`attention.static_backend`), so the eager path and the CUDA
graph path run the same code; under DP attention every rank runs the same forwards with the same
row counts (an idle rank: all dummy rows), which is what keeps the collectives inside them in
lockstep. Everything whose shape depends on `S` lives in a `SpecRuntimeState` (one per tier,
pre-built).

Each phase is a body over a tier's `StepBuffers` and the slot state (what a CUDA graph holds; an
eager round calls the same body). The verify phase has a processed variant (its own graphs), run
when a request of the round has `SamplingParams.processed` (top-k, min_tokens, penalties,
logprobs): the target's logits go through `process_logits` per window position, acceptance keeps
top-k, the committed tokens are counted in their slots and the raw logprobs of every candidate
are staged; a round without such a request runs exactly the variant it ran before them. At depth 0 with a head the verify phase also appends each row's
committed token and target feature to its lag ring (`workers.worker.draft_lag`).
"""
from __future__ import annotations

from typing import Callable

import torch

from workers.cuda_graphs import CudaGraphRunner
from workers.spec_decode import (
    SALT_SAMPLE,
    draft_step,
    process_logits,
    sample_tokens,
    token_logprobs,
    verify,
)
from workers.worker.draft_lag import CATCHUP, DraftLag
from workers.worker.models import RankModels
from workers.worker.slots import SlotState, StepBuffers

PHASES = ("draft", "verify", "extend")


def round_phases(steps: int) -> tuple[str, ...]:
    """The phases of a round at `steps` (depth 0, with or without a head: the target only; the
    head's catch-up is scheduled by `EagleWorker.launch`)."""
    return PHASES if steps > 0 else ("verify",)


class RoundPhases:
    """The bodies of a round's phases over the slot state and a tier's buffers."""

    def __init__(self, slots: SlotState, models: RankModels, lag: DraftLag) -> None:
        self.slots, self.models, self.lag = slots, models, lag

    def body(self, bufs: StepBuffers, phase: str, bp: int, reach: int, greedy: bool,
             processed: bool = False) -> Callable[[], None]:
        """Phase `phase` (or the catch-up) of a round over `bp` rows whose KV reach is `reach`
        pages; reads and writes only the tier's static buffers and the slot state. `processed`:
        the verify phase's variant with the logits processing (other phases have none)."""
        if phase == "verify":
            return lambda: self.verify_phase(bufs, bp, reach, greedy, processed)
        fn = {"draft": self.draft_phase, "extend": self.extend_phase,
              CATCHUP: self.lag.catchup_phase}[phase]
        return lambda: fn(bufs, bp, reach, greedy)

    def capture(self, graphs: CudaGraphRunner, bufs: StepBuffers, bucket: int,
                reach: int) -> None:
        """Capture every phase of the tier at `bucket` into `bufs.graphs`: the draft and verify
        phases once with device sampling (any request) and once greedy-only (argmax, cheaper);
        draft-extend samples nothing: once. The verify phase each way again with the logits
        processing, into `bufs.processed_graphs`."""
        for phase in round_phases(bufs.steps):
            for greedy in ((False, True) if phase != "extend" else (True,)):
                for processed in ((False, True) if phase == "verify" else (False,)):
                    body = self.body(bufs, phase, bucket, reach, greedy, processed)
                    name = f"{phase}/steps={bufs.steps}/bucket={bucket}/greedy={greedy}" + (
                        "/processed" if processed else "")
                    entry = graphs.capture_body(name, body)
                    if processed:
                        bufs.processed_graphs[(bucket, greedy)] = entry
                    else:
                        bufs.graphs[(phase, bucket, greedy)] = entry

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

    def verify_phase(self, bufs: StepBuffers, bp: int, reach: int, greedy: bool,
                     processed: bool = False) -> None:
        """The target over `[x_n, d_1..d_S]`, then acceptance on the device (`processed`: on
        the processed logits, then the committed tokens counted and the raw logprobs of every
        candidate staged)."""
        slots, models = self.slots, self.models
        steps, width = bufs.steps, bufs.steps + 1
        rows = bufs.rows[:bp]
        n, real = slots.row_state(rows)
        temp, top_p, seed = slots.sampling(rows, greedy)
        offsets = torch.arange(width, device=slots.device)
        ids = torch.cat([slots.last_token[rows][:, None], bufs.drafts[:bp]], dim=1).reshape(-1)
        attn = models.padded_attn(models.target_kv, slots.pages_of(rows, reach), n, real * width,
                                  width)
        hidden = models.target(ids, (n[:, None] + offsets).reshape(-1), attn)
        logits = models.target.compute_logits(hidden).float().view(bp, width, -1)
        raw, top_k = logits, None
        if processed:
            controls = slots.controls(rows)
            logits = process_logits(raw, n, controls, bufs.drafts[:bp] if steps else None)
            top_k = None if greedy else controls.top_k
        if steps == 0:
            tokens = sample_tokens(logits[:, 0], temp, top_p, seed, n, SALT_SAMPLE,
                                   all_greedy=greedy, top_k=top_k)[:, None]
            accept = torch.zeros_like(n)
        else:
            accept, tokens = verify(bufs.drafts[:bp], bufs.q[:bp], logits, temp, top_p, seed, n,
                                    real * steps, all_greedy=greedy, top_k=top_k)
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

    def extend_phase(self, bufs: StepBuffers, bp: int, reach: int, greedy: bool) -> None:
        """The head over the committed tokens at positions n+1.. (draft KV index n..), fed the
        target features f_n.. (verify rows 0..a); its row a is the next g; the slots advance."""
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
