"""The EAGLE worker of one rank: prefill and the speculative round, on shapes the plan fixes.

Per request the worker keeps, on the device, in the request's batch slot (`SlotState`, see
`workers.worker.slots`): its page table, `n` (tokens in each cache), its last committed token `x_n`
and the head's last output `g_n`.

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

Depth 0 with a head runs the same plain round and lets the head's cache lag; the lag ring, the
deferred prompts and the catch-up are `DraftLag`'s (`workers.worker.draft_lag`).

Every forward of the round is padded (`attention.static_backend`), so the eager path and the CUDA
graph path run the same code; under DP attention every rank runs the same forwards with the same
row counts (an idle rank: all dummy rows), which is what keeps the collectives inside them in
lockstep. Everything whose shape depends on `S` lives in a `SpecRuntimeState` (one per tier,
pre-built).

Prefill takes one of two paths, chosen from the round's agreed sizes (so every rank takes the same):
a padded prefill — `rows` requests (a bucket) by `width` token slots (a power of two >= the longest
prompt, >= 32), at most `padded_prefill_tokens` slots — runs through the same padded attention
as the round, as a CUDA graph per (rows, width, every request greedy or not: the argmax alone or
device sampling, as the round) when the round uses graphs (eager otherwise, the
same body); anything larger runs ragged through `attention_backend`, padded to the agreed token
count. The padded path exists because an eager prefill of a small model is all host work and
launches: thousands of operator calls, several milliseconds, tens of decode rounds' worth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from workers.attention import ForwardMode, build_metadata
from workers.attention.base import AttentionBackend, upload
from workers.config import EngineConfig
from workers.cuda_graphs import CudaGraphRunner, GraphEntry
from workers.kv_cache import pages_for
from workers.runtime_state import SpecRuntimeState
from workers.scheduler import Request
from workers.spec_decode import SALT_SAMPLE, draft_step, sample_tokens, verify
from workers.worker.draft_lag import CATCHUP, DraftLag
from workers.worker.models import RankModels
from workers.worker.slots import SHADOW_COLUMNS, SlotState, StepBuffers

PHASES = ("draft", "verify", "extend")


@dataclass
class RoundResult:
    """What the host reads of a round, one row per request: its first token (drawn at prefill),
    its accepted draft tokens, and the round's candidate tokens (`tokens[b, :accept[b] + 1]`
    are committed)."""

    first: np.ndarray
    accept: np.ndarray
    tokens: np.ndarray
    shadow: np.ndarray | None = None   # [n, 2] (hits, checks) of a depth-0 round's catch-up


@dataclass
class HostStage:
    """Host memory one launched round uses (pinned on CUDA): the slot of each row, copied in,
    and the round's results, copied out (flat: a round of `n` requests at width `w` reads the
    first `n * w` values); the event recorded after that copy (reused: a stage serves every
    other round, and a round is collected before its stage is staged again)."""

    rows: torch.Tensor
    out: torch.Tensor
    rows_np: np.ndarray          # `rows` as numpy (the same memory: filled without torch ops)
    done: Any = None

    @staticmethod
    def make(top: int, width: int, device: torch.device) -> "HostStage":
        pin = device.type == "cuda"
        rows = torch.zeros(top, dtype=torch.int64, pin_memory=pin)
        out = torch.zeros(top * width, dtype=torch.int64, pin_memory=pin)
        return HostStage(rows=rows, out=out, rows_np=rows.numpy(),
                         done=torch.cuda.Event() if device.type == "cuda" else None)


@dataclass
class LaunchedRound:
    """A round queued on the device whose results are not read yet: its requests, the host
    staging its results land in, and the event recorded after that copy (None on the CPU, where
    the round ran at launch)."""

    reqs: list[Request]
    host: torch.Tensor
    done: Any
    steps: int
    extra: int = 0          # trailing columns of `host` that are not tokens (the shadow checks)
    shadow: bool = False    # a catch-up ran after the round: those columns are fresh


class EagleWorker:
    """Runs the target (and the EAGLE head, unless `head` is None) of one rank.

    Implements `workers.runtime_state.AdaptiveSpecWorker`.
    """

    def __init__(self, target: torch.nn.Module, head: torch.nn.Module | None,
                 config: EngineConfig, backend: AttentionBackend) -> None:
        if config.speculative and head is None:
            raise ValueError("speculative decoding needs a draft head; use --no-spec without one")
        if head is not None and head.feature_size != target.feature_size:
            raise ValueError(f"the draft head reads {head.feature_size}-wide features, the target "
                             f"gives {target.feature_size} (an EAGLE-3 head attaches its feature "
                             f"tap to the target it is built for)")
        self.config = config
        self.device = torch.device(config.device)
        self.models = RankModels(target, head, config, backend, self.device)
        dtype = next(target.parameters()).dtype
        self.slots = SlotState(config, target.feature_size, dtype, self.device)
        self.lag = DraftLag(config, self.slots, self.models)

        def zeros(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=self.device)

        # the padded prefill: its shapes, its static inputs (token ids of `rows x width` slots,
        # then the slot of each row, then each row's prompt length) and its graphs
        self._pf_cap = config.padded_prefill_tokens
        self._pf_buckets = config.graph_buckets or tuple(
            1 << i for i in range(config.max_batch_size.bit_length() + 1)
            if 1 << i < 2 * config.max_batch_size)
        self._pf_top = self._pf_buckets[-1]
        self.pf_buf = zeros(self._pf_cap + 2 * self._pf_top) if self._pf_cap else None
        self._prefill_graphs: dict[tuple[int, int, bool], GraphEntry] = {}  # (rows, width, greedy)
        self._deferred_graphs: dict[tuple[int, int, bool], GraphEntry] = {}  # the head left out
        self.prefill_graph_bytes = 0   # growth of the shared graph pool while they captured
        # host staging of a round (rows in, results out), two sets: with overlap the next round is
        # staged while the device may still copy the previous one's
        top = self.slots.round_rows.shape[0]
        self._stages = [HostStage.make(top, 2 + config.max_steps + 1 + SHADOW_COLUMNS,
                                       self.device) for _ in range(2)]
        self._launches = 0
        self.graphs = CudaGraphRunner(self.device) if config.graph_buckets else None
        self.buckets = config.graph_buckets
        self.state: SpecRuntimeState | None = None

    @property
    def steps(self) -> int:
        """Draft steps of the runtime state in force."""
        if self.state is None:
            raise RuntimeError("no runtime state applied; call apply_runtime_state first")
        return self.state.steps

    def can_use_graph(self, reqs: Sequence[Request]) -> bool:
        """Whether this rank could run a round over `reqs` through the CUDA graphs (an idle rank
        always can: it runs dummy rows). The controller ANDs this over the ranks."""
        return bool(self.buckets) and not self.graphs.closed and len(reqs) <= self.buckets[-1]

    def close(self) -> None:
        """Release the CUDA graphs (before the process group goes; idempotent)."""
        if self.graphs is not None:
            self.graphs.close()

    # ---- AdaptiveSpecWorker -----------------------------------------------------------------
    def build_runtime_state(self, steps: int) -> SpecRuntimeState:
        """Pre-allocate (and capture, with graphs) everything a round at `steps` needs."""
        if not 0 <= steps <= self.config.max_steps:
            raise ValueError(f"steps={steps}: must be in [0, max_steps={self.config.max_steps}]")
        dim = self.models.target.feature_size
        top = max([self.config.max_batch_size, *self.buckets])
        vocab = self.models.target.config.vocab_size
        if steps == 0 and self.models.speculative and not self.lag.built:
            self.lag.allocate()
        extra = SHADOW_COLUMNS if steps == 0 and self.lag.built else 0
        bufs = StepBuffers.allocate(steps, self.slots.round_rows, top, vocab, dim,
                                    self.slots.feature.dtype, extra, self.device)
        nbytes = bufs.nbytes
        if steps == 0 and self.lag.built:
            nbytes += self.lag.nbytes
        if self.graphs is not None:
            before = self.graphs.pool_bytes()
            self._capture(bufs)
            nbytes += self.graphs.pool_bytes() - before
        return SpecRuntimeState(steps=steps, payload=bufs, nbytes=nbytes)

    def apply_runtime_state(self, state: SpecRuntimeState) -> None:
        """Make `state` the one in force (a reference swap: nothing is built or allocated)."""
        self.state = state

    def _capture(self, bufs: StepBuffers) -> None:
        """Capture every phase at every bucket, largest bucket first (start-up only): the whole
        draft loop, verify + accept, draft-extend + the slot update; the draft and verify phases
        once with device sampling (any request) and once greedy-only (argmax, cheaper)."""
        bufs.rows.fill_(self.slots.dummy)
        reach = self.slots.reach
        for bucket in sorted(self.buckets, reverse=True):
            for phase in self._phases(bufs.steps):
                for greedy in ((False, True) if phase != "extend" else (True,)):
                    body = self._body(bufs, phase, bucket, reach, greedy)
                    name = f"{phase}/steps={bufs.steps}/bucket={bucket}/greedy={greedy}"
                    bufs.graphs[(phase, bucket, greedy)] = self.graphs.capture_body(name, body)
            self.lag.capture(self.graphs, bufs, bucket, reach)
        self.slots.set_dummy_length(0)

    @staticmethod
    def _phases(steps: int) -> tuple[str, ...]:
        """The phases of a round at `steps` (depth 0, with or without a head: the target only;
        the head's catch-up is scheduled by `launch`)."""
        return PHASES if steps > 0 else ("verify",)

    # ---- the round's three bodies (what a graph holds; eager rounds call them directly) ---------
    def _body(self, bufs: StepBuffers, phase: str, bp: int, reach: int,
              greedy: bool) -> Callable[[], None]:
        """Phase `phase` of a round over `bp` rows whose KV reach is `reach` pages; reads and
        writes only the tier's static buffers and the slot state."""
        fn = {"draft": self._draft_phase, "verify": self._verify_phase,
              "extend": self._extend_phase, CATCHUP: self.lag.catchup_phase}[phase]
        return lambda: fn(bufs, bp, reach, greedy)

    def _draft_phase(self, bufs: StepBuffers, bp: int, reach: int, greedy: bool) -> None:
        """`steps` draft tokens per row (chain drafting) and their distributions (an all-greedy
        round keeps only the tokens: its acceptance is an exact match and reads no `q`)."""
        rows = bufs.rows[:bp]
        n, real = self.slots.row_state(rows)
        temp, top_p, seed = self.slots.sampling(rows, greedy)
        pages = self.slots.pages_of(rows, reach) if bufs.steps > 1 else None
        g = self.slots.feature[rows]
        for k in range(1, bufs.steps + 1):
            if k > 1:  # the head over d_{k-1} at position n+k-1 (draft KV index n+k-2)
                attn = self.models.padded_attn(self.models.draft_kv, pages, n + k - 2, real, 1)
                g = self.models.head(bufs.drafts[:bp, k - 2], g, n + k - 1, attn)
            logits = self.models.head.compute_logits(g)
            if greedy:
                bufs.drafts[:bp, k - 1] = logits.argmax(-1)
                continue
            token, q = draft_step(logits.float(), temp, top_p, seed, n, k)
            bufs.drafts[:bp, k - 1] = token
            bufs.q[:bp, k - 1] = q

    def _verify_phase(self, bufs: StepBuffers, bp: int, reach: int, greedy: bool) -> None:
        """The target over `[x_n, d_1..d_S]`, then acceptance on the device."""
        steps, width = bufs.steps, bufs.steps + 1
        rows = bufs.rows[:bp]
        n, real = self.slots.row_state(rows)
        temp, top_p, seed = self.slots.sampling(rows, greedy)
        offsets = torch.arange(width, device=self.device)
        ids = torch.cat([self.slots.last_token[rows][:, None], bufs.drafts[:bp]], dim=1).reshape(-1)
        attn = self.models.padded_attn(self.models.target_kv, self.slots.pages_of(rows, reach), n, real * width, width)
        hidden = self.models.target(ids, (n[:, None] + offsets).reshape(-1), attn)
        logits = self.models.target.compute_logits(hidden).float().view(bp, width, -1)
        if steps == 0:
            tokens = sample_tokens(logits[:, 0], temp, top_p, seed, n, SALT_SAMPLE,
                                   all_greedy=greedy)[:, None]
            accept = torch.zeros_like(n)
        else:
            accept, tokens = verify(bufs.drafts[:bp], bufs.q[:bp], logits, temp, top_p, seed, n,
                                    real * steps, all_greedy=greedy)
        bufs.hidden[:bp * width] = hidden
        bufs.accept[:bp] = accept * real
        bufs.tokens[:bp] = tokens
        bufs.out[:bp, 0] = self.slots.last_token[rows]
        if steps == 0:
            if self.lag.built:  # the head's inputs at position n+1, for the catch-up
                self.lag.append(rows, tokens[:, 0], hidden, real)
            self._advance(bufs, bp, rows, n, None)

    def _extend_phase(self, bufs: StepBuffers, bp: int, reach: int, greedy: bool) -> None:
        """The head over the committed tokens at positions n+1.. (draft KV index n..), fed the
        target features f_n.. (verify rows 0..a); its row a is the next g; the slots advance."""
        width = bufs.steps + 1
        rows = bufs.rows[:bp]
        n, real = self.slots.row_state(rows)
        accept = bufs.accept[:bp]
        offsets = torch.arange(width, device=self.device)
        pages = self.slots.pages_of(rows, reach)
        attn = self.models.padded_attn(self.models.draft_kv, pages, n, real * (accept + 1), width)
        last = torch.arange(bp, device=self.device) * width + accept
        g = self.models.head(bufs.tokens[:bp].reshape(-1), bufs.hidden[:bp * width],
                      (n[:, None] + 1 + offsets).reshape(-1), attn, last=last)
        self._advance(bufs, bp, rows, n, g)

    def _advance(self, bufs: StepBuffers, bp: int, rows: torch.Tensor, n: torch.Tensor,
                 g: torch.Tensor | None) -> None:
        """Move every row's slot past its committed tokens and stage what the host reads."""
        accept = bufs.accept[:bp]
        index = torch.arange(bp, device=self.device)
        self.slots.cache_len.index_copy_(0, rows, n + accept + 1)
        self.slots.last_token.index_copy_(0, rows, bufs.tokens[:bp][index, accept])
        if g is not None:
            self.slots.feature.index_copy_(0, rows, g)
        self.slots.cache_len[self.slots.dummy:].zero_()
        bufs.out[:bp, 1] = accept
        bufs.out[:bp, 2:2 + bufs.steps + 1] = bufs.tokens[:bp]   # then the shadow columns, if any

    # ---- prefill ------------------------------------------------------------------------------
    def prefill_shape(self, pad_requests: int, width: int) -> tuple[int, int] | None:
        """(rows, width) of the padded prefill of `pad_requests` requests whose longest prompt
        is `width` tokens (both agreed), or None: the prefill runs ragged."""
        if not self._pf_cap or width < 1:
            return None
        rows = next((b for b in self._pf_buckets if b >= pad_requests), None)
        slots = max(32, 1 << (width - 1).bit_length())
        if rows is None or rows * slots > self._pf_cap:
            return None
        return rows, slots

    def capture_prefill(self) -> None:
        """Capture the padded prefill at every shape that can occur (with graphs; start-up only,
        after the tiers: a body resets the lag ring of the slots it fills if tier 0 has one)."""
        if self.graphs is None or not self._pf_cap:
            return
        self.pf_buf.zero_()
        self.prefill_inputs(self._pf_top, 0)[1].fill_(self.slots.dummy)
        longest = 1 << (self.config.max_context_len - 1).bit_length()
        before = self.graphs.pool_bytes()
        for rows in sorted(self.buckets, reverse=True):
            width = 32
            while rows * width <= self._pf_cap and width <= max(longest, 32):
                for greedy in (False, True):
                    body = self._prefill_body(rows, width, greedy)
                    self._prefill_graphs[(rows, width, greedy)] = self.graphs.capture_body(
                        f"prefill/rows={rows}/width={width}/greedy={greedy}", body)
                    if self.lag.deferred_len is not None and width in self.lag.defer_widths:
                        body = self._prefill_body(rows, width, greedy, defer=True)
                        self._deferred_graphs[(rows, width, greedy)] = self.graphs.capture_body(
                            f"prefill/rows={rows}/width={width}/greedy={greedy}/deferred", body)
                width *= 2
        self.slots.set_dummy_length(0)
        self.prefill_graph_bytes = self.graphs.pool_bytes() - before

    def prefill_inputs(self, bp: int, width: int) -> tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
        """The padded prefill's static inputs for `bp` rows of `width` slots (views of one
        buffer, what its graphs read): token ids [bp * width], each row's slot [bp] and prompt
        length [bp]."""
        cap, top = self._pf_cap, self._pf_top
        return (self.pf_buf[:bp * width], self.pf_buf[cap:cap + bp],
                self.pf_buf[cap + top:cap + top + bp])

    def _prefill_body(self, rows: int, width: int, greedy: bool,
                      defer: bool = False) -> Callable[[], None]:
        return lambda: self._prefill_padded(rows, width, greedy, defer)

    def _prefill_padded(self, bp: int, width: int, greedy: bool = False,
                        defer: bool = False) -> None:
        """The padded prefill over `bp` rows of `width` token slots, from the static inputs:
        the target over each row's prompt at positions 0.., its first token drawn at the last
        prompt position (`greedy`: every request greedy, the argmax alone — like the round, one
        graph each way), the head over x_1 .. x_P (the first token last) with f_0 .. f_{P-1} at
        positions 1 .. (`defer`: those inputs kept in the rows' slots for the next catch-up
        instead), and the rows' slots set. Dummy rows (length 0) write the dummy slot."""
        ids, rows, lens = self.prefill_inputs(bp, width)
        reach = min(pages_for(width, self.config.page_size), self.slots.reach)
        pages = self.slots.pages_of(rows, reach)
        start = torch.zeros_like(lens)
        pos = torch.arange(width, device=self.device).repeat(bp)
        hidden = self.models.target(ids, pos, self.models.padded_attn(self.models.target_kv, pages, start, lens, width))
        last = torch.arange(bp, device=self.device) * width + (lens - 1).clamp(min=0)
        logits = self.models.target.compute_logits(hidden[last]).float()
        temp, top_p, seed = self.slots.sampling(rows)
        first = sample_tokens(logits, temp, top_p, seed, lens - 1, SALT_SAMPLE, all_greedy=greedy)
        if self.models.speculative:
            nxt = torch.cat([ids.view(bp, width)[:, 1:], start[:, None]], dim=1).reshape(-1)
            nxt = nxt.index_copy(0, last, first)
            if defer:
                self.lag.store_prompts(rows, width, nxt, hidden)
            else:
                g = self.models.head(nxt, hidden, pos + 1,
                              self.models.padded_attn(self.models.draft_kv, pages, start, lens, width), last=last)
                self.slots.feature.index_copy_(0, rows, g)
        self._filled(rows, lens, first, defer)

    def _filled(self, slots: torch.Tensor, lens: torch.Tensor, first: torch.Tensor,
                deferred: bool = False) -> None:
        """Prefilled slots: their cache length, first token, an empty lag ring and (`deferred`)
        the prompt's head forward waiting for the catch-up, or none."""
        self.slots.cache_len.index_copy_(0, slots, lens)
        self.slots.last_token.index_copy_(0, slots, first)
        self.lag.reset(slots, lens, deferred)
        self.slots.cache_len[self.slots.dummy:].zero_()

    @torch.inference_mode()
    def prefill(self, reqs: list[Request], pad_tokens: int, pad_requests: int, width: int = 0,
                graph: bool = False) -> None:
        """Run new requests' prompts through the target (and the head); their first token is
        drawn on the device into their slot (the host reads it with the round's tokens). Every
        rank calls it when any rank prefills: `pad_tokens` / `pad_requests` / `width` (the
        longest prompt) are the round's agreed sizes (this rank's rows beyond its own are
        padding); `graph`: the round runs through CUDA graphs (agreed), so a captured padded
        prefill replays. Padded or ragged: see the module docstring."""
        shape = self.prefill_shape(pad_requests, width)
        if shape is not None:
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
                self.device, ids.reshape(-1).tolist(),
                [r.slot for r in reqs] + [self.slots.dummy] * pad, lens + [0] * pad)
            for dst, src in zip(self.prefill_inputs(bp, slots), (dev_ids, dev_rows, dev_lens)):
                dst.copy_(src)
            greedy = all(r.params.greedy for r in reqs)
            defer = self.lag.defers(slots, None if self.state is None else self.state.steps)
            graphs = self._deferred_graphs if defer else self._prefill_graphs
            entry = graphs.get((bp, slots, greedy)) if graph else None
            if entry is not None:
                entry.replay()
            else:
                self._prefill_padded(bp, slots, greedy, defer)
            if defer:
                self.lag.mark_deferred(slots)
            return
        lens = [len(r.prompt_ids) for r in reqs]
        total = sum(lens)
        if total > pad_tokens or len(reqs) > pad_requests:
            raise RuntimeError(f"prefill of {len(reqs)} requests / {total} tokens exceeds the "
                               f"agreed {pad_requests} / {pad_tokens}")
        self.slots.admit(reqs)
        pad = pad_requests - len(reqs)
        ends = [sum(lens[:i + 1]) - 1 for i in range(len(reqs))]
        fields = {  # every host value of the prefill, uploaded in one copy
            "ids": self._padded([t for r in reqs for t in r.prompt_ids], pad_tokens),
            "pos": self._padded([i for n in lens for i in range(n)], pad_tokens),
            "last": self._padded(ends, pad_requests),
            "slots": [r.slot for r in reqs] + [self.slots.dummy] * pad,
            "lens": self._padded(lens, pad_requests)}
        if self.models.speculative:  # the head over x_1 .. x_P with f_0 .. f_{P-1}: positions 1 .. P
            fields["nxt"] = self._padded(
                [t for r, n in zip(reqs, lens) for t in r.prompt_ids[1:n] + [0]], pad_tokens)
            fields["pos2"] = self._padded([i + 1 for n in lens for i in range(n)], pad_tokens)
        dev = dict(zip(fields, upload(self.device, *fields.values())))
        meta = build_metadata(ForwardMode.EXTEND, [r.pages for r in reqs], [0] * len(reqs), lens,
                              self.config.page_size, self.device)
        hidden = self.models.target(dev["ids"], dev["pos"], self.models.backend.plan(meta, self.models.target_kv))
        last, slots = dev["last"], dev["slots"]
        logits = self.models.target.compute_logits(hidden[last]).float()
        temp, top_p, seed = self.slots.sampling(slots)
        first = sample_tokens(logits, temp, top_p, seed, dev["lens"] - 1, SALT_SAMPLE,
                              all_greedy=all(r.params.greedy for r in reqs))
        if self.models.speculative:
            nxt = dev["nxt"]
            nxt[last[:len(reqs)]] = first[:len(reqs)]
            g = self.models.head(nxt, hidden, dev["pos2"], self.models.backend.plan(meta, self.models.draft_kv),
                          last=last)
            self.slots.feature.index_copy_(0, slots, g)
        self._filled(slots, dev["lens"], first)

    @staticmethod
    def _padded(values: list[int], size: int) -> list[int]:
        return values + [0] * (size - len(values))

    # ---- the speculative round ------------------------------------------------------------------
    @torch.inference_mode()
    def spec_round(self, reqs: list[Request], batch_pad: int,
                   graph_bucket: int | None = None) -> "RoundResult":
        """One round at the depth in force over `reqs`, padded to `batch_pad` rows (the plan's
        batch); `graph_bucket` replays the CUDA graphs of that bucket (None: the same bodies,
        eager). Returns the round's rows for `reqs` (first tokens of fresh requests, accept lengths
        — draft tokens accepted, bonus excluded — and candidate tokens), read from the device once;
        the scheduler commits them. `launch` then `collect`."""
        return self.collect(self.launch(reqs, batch_pad, graph_bucket))

    @torch.inference_mode()
    def launch(self, reqs: list[Request], batch_pad: int,
               graph_bucket: int | None = None) -> "LaunchedRound":
        """Queue one round (as `spec_round`) and the copy of its results to the host; returns
        without waiting for the device. Two launched rounds may be outstanding (their host
        staging alternates); `collect` them in launch order."""
        bp = graph_bucket if graph_bucket is not None else batch_pad
        if len(reqs) > bp:
            raise RuntimeError(f"{len(reqs)} requests do not fit the agreed batch of {bp}")
        if graph_bucket is not None and (self.graphs is None or graph_bucket not in self.buckets):
            raise RuntimeError(f"the plan says CUDA graphs at bucket {graph_bucket}, but this "
                               f"worker captured {list(self.buckets)}")
        bufs: StepBuffers = self.state.payload
        stage = self._stages[self._launches % 2]
        self._launches += 1
        staged = stage.rows_np
        staged[:len(reqs)] = [r.slot for r in reqs]
        staged[len(reqs):bp] = self.slots.dummy
        bufs.rows[:bp].copy_(stage.rows[:bp], non_blocking=True)
        greedy = all(r.params.greedy for r in reqs)
        reach = self._reach(reqs, graph_bucket)
        if bufs.steps > 0 and self.lag.behind:
            self.lag.catch_up(bufs, bp, reach, graph_bucket)   # drafting resumes: first the cache
        for phase in self._phases(bufs.steps):
            if graph_bucket is None:
                self._body(bufs, phase, bp, reach, greedy)()
            else:  # draft-extend samples nothing: one graph serves both
                bufs.graphs[(phase, graph_bucket, greedy or phase == "extend")].replay()
        shadow = False
        if bufs.steps == 0 and self.lag.built and self.lag.count_round():
            self.lag.catch_up(bufs, bp, reach, graph_bucket)   # a full ring
            shadow = True
        width = bufs.out.shape[1]
        out = bufs.out[:len(reqs)]
        host = stage.out[:len(reqs) * width].view(len(reqs), width)
        host.copy_(out, non_blocking=True)
        done = stage.done
        if done is not None:
            done.record(torch.cuda.current_stream(self.device))
        extra = bufs.extra_columns
        return LaunchedRound(reqs=reqs, host=host, done=done, steps=bufs.steps, extra=extra,
                             shadow=shadow)

    def collect(self, launched: "LaunchedRound") -> "RoundResult":
        """Wait for a launched round and read its results (the round's one host synchronisation:
        on the event recorded after its copy, so later launched work keeps the device busy)."""
        if launched.done is not None:
            launched.done.synchronize()
        rows = launched.host.numpy()
        end = rows.shape[1] - launched.extra
        return RoundResult(first=rows[:, 0].copy(), accept=rows[:, 1].copy(),
                           tokens=rows[:, 2:end].copy(),
                           shadow=rows[:, end:].copy() if launched.shadow else None)

    def _reach(self, reqs: Sequence[Request], bucket: int | None) -> int:
        """Pages of KV each row may read: the captured reach for graphs, else what this batch
        needs (attention is local to the rank, so eager ranks may differ)."""
        full = self.slots.reach
        if bucket is not None:
            return full
        if not reqs:
            return 1
        # the host's token count may lag the device's by the round launched before (overlap)
        longest = max(r.num_tokens for r in reqs) + self.config.round_overshoot
        return min(pages_for(longest, self.config.page_size), full)
