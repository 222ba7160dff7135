"""The EAGLE worker of one rank: prefill and the speculative round, on shapes the plan fixes.

Per request the worker keeps, on the device, in the request's batch slot (`SlotState`, see
`workers.worker.slots`): its page table, `n` (tokens in each cache), its last committed token `x_n`
and the head's last output `g_n`.

One round at depth `S` runs three device phases on the agreed padded batch — the whole draft
loop, verify + accept, draft-extend + the slot update (`RoundPhases`, `workers.worker.phases`) —
one CUDA graph each per depth and bucket (greedy-only and sampling variants; the verify phase
also with the logits processing of `docs/sampling.md`), the same bodies eager; the host reads the round's rows once (`collect`). Depth 0 with a head runs the plain round
and lets the head's cache lag; the lag ring, the deferred prompts and the catch-up are
`DraftLag`'s (`workers.worker.draft_lag`).

Prefill (padded or ragged, and the padded prefill's CUDA graphs) is `PrefillRunner`'s
(`workers.worker.prefill`); the host memory a round is staged in and read from is
`workers.worker.staging`'s.
"""
from __future__ import annotations

from typing import Sequence

import torch

from workers.attention.base import AttentionBackend
from workers.config import EngineConfig
from workers.cuda_graphs import CudaGraphRunner
from workers.kv_cache import pages_for
from workers.runtime_state import RuntimeStatePool, SpecRuntimeState
from workers.scheduler import Request
from workers.worker.draft_lag import DraftLag
from workers.worker.models import RankModels
from workers.worker.phases import RoundPhases, round_phases
from workers.worker.prefill import PrefillRunner
from workers.worker.round_cost import measure_tiers
from workers.worker.slots import SHADOW_COLUMNS, SlotState, StepBuffers, logprob_width
from workers.worker.staging import HostStage, LaunchedRound, RoundResult


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
        vocab = target.config.vocab_size
        self.slots = SlotState(config, target.feature_size, dtype, self.device, vocab)
        self.lag = DraftLag(config, self.slots, self.models)
        self.phases = RoundPhases(self.slots, self.models, self.lag)
        self.prefill_runner = PrefillRunner(config, self.slots, self.models, self.lag)
        # host staging of a round (rows in, results out), two sets: with overlap the next round is
        # staged while the device may still copy the previous one's
        top = self.slots.round_rows.shape[0]
        self._stages = [HostStage.make(top, 2 + config.max_steps + 1 + SHADOW_COLUMNS,
                                       self.device, config.max_steps + 1, logprob_width(vocab))
                        for _ in range(2)]
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
        draft loop, verify + accept, draft-extend + the slot update (`RoundPhases.capture`), and
        at depth 0 with a head the catch-up forwards (`DraftLag.capture`)."""
        bufs.rows.fill_(self.slots.dummy)
        reach = self.slots.reach
        for bucket in sorted(self.buckets, reverse=True):
            self.phases.capture(self.graphs, bufs, bucket, reach)
            self.lag.capture(self.graphs, bufs, bucket, reach)
        self.slots.set_dummy_length(0)

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
        # processed: some request's logits are processed (top-k, min_tokens, penalties,
        # logprobs): the verify phase's variant with the processing; none: today's variant
        processed = any(r.params.processed for r in reqs)
        reach = self._reach(reqs, graph_bucket)
        if bufs.steps > 0 and self.lag.behind:
            self.lag.catch_up(bufs, bp, reach, graph_bucket)   # drafting resumes: first the cache
        for phase in round_phases(bufs.steps):
            if graph_bucket is None:
                self.phases.body(bufs, phase, bp, reach, greedy, processed)()
            elif processed and phase == "verify":
                bufs.processed_graphs[(graph_bucket, greedy)].replay()
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
        logprobs = None
        if processed and any(r.params.logprobs is not None for r in reqs):
            n, w, k1 = len(reqs), bufs.steps + 1, bufs.lp_values.shape[2]
            values = stage.lp_values[:n * w * k1].view(n, w, k1)
            ids = stage.lp_ids[:n * w * (k1 - 1)].view(n, w, k1 - 1)
            values.copy_(bufs.lp_values[:n], non_blocking=True)
            ids.copy_(bufs.lp_ids[:n], non_blocking=True)
            logprobs = (values, ids)
        done = stage.done
        if done is not None:
            done.record(torch.cuda.current_stream(self.device))
        extra = bufs.extra_columns
        return LaunchedRound(reqs=reqs, host=host, done=done, steps=bufs.steps, extra=extra,
                             shadow=shadow, logprobs=logprobs)

    def collect(self, launched: "LaunchedRound") -> "RoundResult":
        """Wait for a launched round and read its results (the round's one host synchronisation:
        on the event recorded after its copy, so later launched work keeps the device busy)."""
        if launched.done is not None:
            launched.done.synchronize()
        rows = launched.host.numpy()
        end = rows.shape[1] - launched.extra
        logprobs = None if launched.logprobs is None else tuple(
            t.numpy().copy() for t in launched.logprobs)
        return RoundResult(first=rows[:, 0].copy(), accept=rows[:, 1].copy(),
                           tokens=rows[:, 2:end].copy(),
                           shadow=rows[:, end:].copy() if launched.shadow else None,
                           logprobs=logprobs)

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

    # ---- start-up ---------------------------------------------------------------------------
    def measure_round_costs(self, tiers: RuntimeStatePool, eager_buckets: Sequence[int],
                            overlap: bool, repeats: int = 5,
                            context: int = 0) -> dict[int, dict[int, float]]:
        """Seconds of one round at every tier of `tiers` and batch bucket, {bucket: {steps:
        seconds}}, on dummy rows (`workers.worker.round_cost`): at the captured buckets through
        the CUDA graphs, without graphs at `eager_buckets`; `overlap`: rounds run as the engine
        runs them with overlap; `context`: the dummy rows' cache length. Leaves the last tier
        applied. Collective: every rank measures the same tiers and buckets in the same order."""
        return measure_tiers(self, tiers, self.buckets or tuple(eager_buckets), bool(self.buckets),
                             overlap, self.lag.catchup_every if self.lag.built else None,
                             repeats, context)
