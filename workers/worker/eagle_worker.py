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

Prefill (padded or ragged, and the padded prefill's CUDA graphs) is `PrefillRunner`'s
(`workers.worker.prefill`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from workers.attention.base import AttentionBackend
from workers.config import EngineConfig
from workers.cuda_graphs import CudaGraphRunner
from workers.kv_cache import pages_for
from workers.runtime_state import SpecRuntimeState
from workers.scheduler import Request
from workers.spec_decode import SALT_SAMPLE, draft_step, sample_tokens, verify
from workers.worker.draft_lag import CATCHUP, DraftLag
from workers.worker.models import RankModels
from workers.worker.prefill import PrefillRunner
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
        self.prefill_runner = PrefillRunner(config, self.slots, self.models, self.lag)
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
    def capture_prefill(self) -> None:
        """Capture the padded prefill at every shape that can occur (with graphs; start-up only,
        after the tiers: a body resets the lag ring of the slots it fills if tier 0 has one)."""
        self.prefill_runner.capture(self.graphs, self.buckets)

    @torch.inference_mode()
    def prefill(self, reqs: list[Request], pad_tokens: int, pad_requests: int, width: int = 0,
                graph: bool = False) -> None:
        """Run new requests' prompts through the target (and the head); their first token is
        drawn on the device into their slot (the host reads it with the round's tokens). Every
        rank calls it when any rank prefills: `pad_tokens` / `pad_requests` / `width` (the
        longest prompt) are the round's agreed sizes (this rank's rows beyond its own are
        padding); `graph`: the round runs through CUDA graphs (agreed), so a captured padded
        prefill replays. Padded or ragged: see `workers.worker.prefill`."""
        self.prefill_runner.run(reqs, pad_tokens, pad_requests, width, graph,
                                None if self.state is None else self.state.steps)

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
