"""The EAGLE worker of one rank: prefill and the speculative round, on shapes the plan fixes.

Per request the worker keeps, on the device, in the request's batch slot (`SlotState`, see
`workers.worker.slots`): its page table, `n` (tokens in each cache), its last committed token `x_n`
and the head's last output `g_n`.

One round at shape (S draft forwards, T verify tokens; `adaptive_dist.shape.RoundShape`) runs
four device phases on the agreed padded batch — the whole draft loop, the target over the packed
verify tokens, the acceptance, draft-extend + the slot update (`RoundPhases`,
`workers.worker.phases`) — as CUDA graphs from one `GraphTable`: the target's per token rung,
the others per depth and bucket (greedy-only and sampling variants; the acceptance also with the
logits processing of `docs/sampling.md`); the same bodies eager. Each request drafts its own
budget inside the shape (the plan's, per row). The host reads the round's rows once (`collect`).
Depth 0 with a head runs the plain round and lets the head's cache lag; the lag ring, the
deferred prompts and the catch-up are `DraftLag`'s (`workers.worker.draft_lag`).

Prefill (padded or ragged; the padded prefill's CUDA graphs in the same table) is
`PrefillRunner`'s (`workers.worker.prefill`); the host memory a round is staged in and read from is
`workers.worker.staging`'s.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from adaptive_dist.shape import RoundShape, token_bucket
from workers import startup_log
from workers.attention.base import AttentionBackend
from workers.config import EngineConfig
from workers.cuda_graphs import CudaGraphRunner
from workers.kv_cache import pages_for
from workers.runtime_state import RuntimeStatePool, SpecRuntimeState
from workers.worker.draft_lag import DraftLag
from workers.worker.graph_table import GraphKey, GraphPhase, GraphTable
from workers.worker.models import RankModels
from workers.worker.phases import RoundPhases, phase_key, round_phases
from workers.worker.prefill import PrefillRunner
from workers.worker.request import SlotRequest
from workers.worker.round_cost import measure_targets, measure_tiers
from workers.worker.slots import (SHADOW_COLUMNS, RoundBuffers, SlotState, StepBuffers,
                                  logprob_width)
from workers.worker.staging import HostStage, LaunchedRound, RoundResult
from workers.worker.tree import TreeRound
from adaptive_dist.policy.tree import trees_of
from adaptive_dist.shape import TreeShape


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
        self.ladder = config.verify_ladder
        self.buffers = RoundBuffers.allocate(
            self.slots, config.max_steps, self.ladder[-1], vocab, target.feature_size, dtype,
            SHADOW_COLUMNS if self.models.speculative else 0, self.device)
        self.phases = RoundPhases(self.slots, self.models, self.lag, self.buffers)
        self.prefill_runner = PrefillRunner(config, self.slots, self.models, self.lag)
        # draft trees (--speculative-eagle-topk > 1): eager rounds of `workers.worker.tree`
        self.tree = (TreeRound(config.tree, self.slots, self.models)
                     if config.tree is not None and self.models.speculative else None)
        # adaptive trees (goodput's tree_candidates): one TreeRound per shape, the plan's
        # shape picks it each round (issue 35 §2)
        self.trees: dict[TreeShape, TreeRound] = {}
        if self.models.speculative and config.spec.adaptive:
            for s_, k_, n_, _ in trees_of(config.spec):
                shape_ = TreeShape(s_, k_, n_)
                self.trees[shape_] = TreeRound(shape_, self.slots, self.models)
        # with per-request budgets a tree round is ragged: each row its own N_b best nodes, the
        # verify forward the plan's T packed tokens (one graph per tree, bucket and rung)
        self.ragged_trees = bool(self.trees) and bool(getattr(config.spec, "per_request", False))
        # host staging of a round (rows and budgets in, results out), two sets: with overlap the
        # next round is staged while the device may still copy the previous one's
        top = self.slots.round_rows.shape[0]
        self._stages = [HostStage.make(top, 2 + config.max_steps + 1 + SHADOW_COLUMNS,
                                       self.device, config.max_steps + 1, logprob_width(vocab))
                        for _ in range(2)]
        self._launches = 0
        self.graphs = CudaGraphRunner(self.device) if config.graph_buckets else None
        self.table = GraphTable(self.graphs) if self.graphs is not None else None
        self.buckets = config.graph_buckets
        self.state: SpecRuntimeState | None = None

    @property
    def steps(self) -> int:
        """Draft steps of the runtime state in force."""
        if self.state is None:
            raise RuntimeError("no runtime state applied; call apply_runtime_state first")
        return self.state.steps

    def can_use_graph(self, reqs: Sequence[SlotRequest]) -> bool:
        """Whether this rank could run a round over `reqs` through the CUDA graphs (an idle rank
        always can: it runs dummy rows). The controller ANDs this over the ranks."""
        return bool(self.buckets) and not self.graphs.closed and len(reqs) <= self.buckets[-1]

    def close(self) -> None:
        """Release the CUDA graphs (before the process group goes; idempotent)."""
        if self.graphs is not None:
            self.graphs.close()

    # ---- AdaptiveSpecWorker -----------------------------------------------------------------
    def build_runtime_state(self, steps: int) -> SpecRuntimeState:
        """The buffers of depth `steps` and, with graphs, every phase of it captured at every
        bucket (the first state built also captures the target's packed verify forward at every
        token rung, which every depth shares, and holds the shared buffers' bytes)."""
        if not 0 <= steps <= self.config.max_steps:
            raise ValueError(f"steps={steps}: must be in [0, max_steps={self.config.max_steps}]")
        if steps == 0 and self.models.speculative and not self.lag.built:
            self.lag.allocate()
        extra = SHADOW_COLUMNS if steps == 0 and self.lag.built else 0
        first = not self.buffers.views
        bufs = self.buffers.view(steps, extra)
        nbytes = self.buffers.nbytes if first else 0
        if steps == 0 and self.lag.built:
            nbytes += self.lag.nbytes
        if self.graphs is not None:
            before = self.graphs.pool_bytes()
            self._capture(bufs)
            nbytes += self.graphs.pool_bytes() - before
        else:
            startup_log.current().step(f"depth {steps}", f"buffers "
                                       f"{startup_log.fmt_bytes(nbytes)}; eager (no CUDA graphs)",
                                       buffer_bytes=nbytes)
        return SpecRuntimeState(steps=steps, payload=bufs, nbytes=nbytes)

    def apply_runtime_state(self, state: SpecRuntimeState) -> None:
        """Make `state` the one in force (a reference swap: nothing is built or allocated)."""
        self.state = state

    def _capture(self, bufs: StepBuffers) -> None:
        """Capture (start-up only) the target's packed verify forward at every token rung (once,
        largest first), then every phase of the depth at every bucket, largest bucket first: the
        whole draft loop, the acceptance, draft-extend + the slot update (`RoundPhases.capture`),
        and at depth 0 with a head the catch-up forwards (`DraftLag.capture`)."""
        bufs.rows.fill_(self.slots.dummy)
        bufs.budget.zero_()
        reach = self.slots.reach
        start, count = time.perf_counter(), len(self.table)
        held = startup_log.reserved(self.device)
        if self.tree is not None and bufs.steps > 0:   # the tree round, then draft-extend
            for bucket in sorted(self.buckets, reverse=True):
                for greedy in (False, True):
                    self.table.capture(GraphKey(GraphPhase.TREE, batch=bucket,
                                                steps=bufs.steps, greedy=greedy),
                                       lambda b=bucket, g=greedy: self.tree.run(bufs, b, reach, g))
                key = GraphKey(GraphPhase.EXTEND, batch=bucket, steps=bufs.steps)
                self.table.capture(key, self.phases.body(key, bufs, reach))
            self.slots.set_dummy_length(0)
            startup_log.captured(f"tree {self.tree.tree}", len(self.table) - count,
                                 time.perf_counter() - start,
                                 startup_log.reserved(self.device) - held,
                                 buckets=list(self.buckets))
            return
        for tokens in sorted(self.ladder, reverse=True):
            self.phases.capture_target(self.table, tokens, reach)
        if len(self.table) > count:   # the first state: the verify forward, every depth's
            now, size = time.perf_counter(), startup_log.reserved(self.device)
            startup_log.captured("verify forward", len(self.table) - count, now - start,
                                 size - held, rungs=list(self.ladder))
            start, count, held = now, len(self.table), size
        for bucket in sorted(self.buckets, reverse=True):
            self.phases.capture(self.table, bufs, bucket, reach)
            self.lag.capture(self.table, bufs, bucket, reach)
            for tree, runner in self.trees.items():   # adaptive trees drafting this depth
                if tree.steps != bufs.steps:
                    continue
                for packed in self.tree_rungs(tree, bucket):
                    for greedy in (False, True):
                        self.table.capture(
                            self.tree_key(tree, bucket, greedy, packed),
                            lambda b=bucket, g=greedy, r=runner, t=packed: r.run(
                                bufs, b, reach, g, t or None))
        self.slots.set_dummy_length(0)
        startup_log.captured(f"depth {bufs.steps}", len(self.table) - count,
                             time.perf_counter() - start,
                             startup_log.reserved(self.device) - held, buckets=list(self.buckets))

    # ---- prefill ------------------------------------------------------------------------------
    def capture_prefill(self) -> None:
        """Capture the padded prefill at every shape that can occur (with graphs; start-up only,
        after the tiers: a body resets the lag ring of the slots it fills if tier 0 has one)."""
        self.prefill_runner.capture(self.table, self.buckets)

    @torch.inference_mode()
    def prefill(self, reqs: list[SlotRequest], pad_tokens: int, pad_requests: int, width: int = 0,
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
    def spec_round(self, reqs: list[SlotRequest], batch_pad: int, graph_bucket: int | None = None,
                   shape: RoundShape | None = None,
                   budgets: Sequence[int] | None = None) -> "RoundResult":
        """One round at the depth in force over `reqs`, padded to `batch_pad` rows (the plan's
        batch); `graph_bucket` replays the CUDA graphs of that bucket (None: the same bodies,
        eager); `shape` and `budgets`: see `launch`. Returns the round's rows for `reqs` (first
        tokens of fresh requests, accept lengths — draft tokens accepted, bonus excluded — and
        candidate tokens), read from the device once; the scheduler commits them. `launch` then
        `collect`."""
        return self.collect(self.launch(reqs, batch_pad, graph_bucket, shape, budgets))

    def default_shape(self, batch_pad: int) -> RoundShape:
        """The full chain at the depth in force over `batch_pad` rows (what a round without a
        plan's shape runs: every row drafting every step)."""
        return RoundShape(self.steps, token_bucket(batch_pad * (self.steps + 1), self.ladder))

    @torch.inference_mode()
    def launch(self, reqs: list[SlotRequest], batch_pad: int, graph_bucket: int | None = None,
               shape: RoundShape | None = None,
               budgets: Sequence[int] | None = None) -> "LaunchedRound":
        """Queue one round (as `spec_round`) and the copy of its results to the host; returns
        without waiting for the device. `shape`: the agreed shape (its draft forwards the depth
        in force; default: `default_shape`); `budgets`: each request's draft tokens inside it
        (default: every request the shape's draft forwards). Two launched rounds may be
        outstanding (their host staging alternates); `collect` them in launch order."""
        bp = graph_bucket if graph_bucket is not None else batch_pad
        if len(reqs) > bp:
            raise RuntimeError(f"{len(reqs)} requests do not fit the agreed batch of {bp}")
        if graph_bucket is not None and (self.graphs is None or graph_bucket not in self.buckets):
            raise RuntimeError(f"the plan says CUDA graphs at bucket {graph_bucket}, but this "
                               f"worker captured {list(self.buckets)}")
        bufs: StepBuffers = self.state.payload
        shape = shape if shape is not None else self.default_shape(bp)
        steps, tokens = shape.draft_forwards, shape.verify_tokens
        if steps != bufs.steps:
            raise RuntimeError(f"the round's shape drafts {steps} tokens but the depth in force "
                               f"is {bufs.steps}: the runtime state was not applied")
        runner = None
        if self.tree is not None and steps > 0:
            # a tree round: the agreed batch's trees, N tokens per row (the plan's chain
            # bucket does not apply); the same shape on every rank of the cluster
            shape = self.tree.tree.round_shape(bp)
            tokens = shape.verify_tokens
            runner = self.tree
            if any(r.params.processed for r in reqs):
                raise RuntimeError("top-k, min_tokens, penalties and logprobs are not "
                                   "implemented with draft trees (--speculative-eagle-topk)")
        elif shape.tree is not None:   # an adaptive tree: the plan's (B_pad * N tokens)
            runner = self.trees.get(shape.tree)
            if runner is None:
                raise RuntimeError(f"the round's shape is the tree {shape.tree}, which this "
                                   f"worker did not build (its trees: {list(self.trees)})")
            if self.ragged_trees:   # per-request: the plan's rung, each row its nodes
                if tokens not in self.tree_rungs(shape.tree, bp):
                    raise RuntimeError(f"the round's tree shape {shape} verifies {tokens} "
                                       f"tokens, not a rung of {bp} rows' trees "
                                       f"{list(self.tree_rungs(shape.tree, bp))}")
            elif shape.verify_tokens != bp * shape.tree_tokens:
                raise RuntimeError(f"the round's tree shape {shape} does not fit {bp} rows")
            if any(r.params.processed for r in reqs):
                raise RuntimeError("top-k, min_tokens, penalties and logprobs are not "
                                   "implemented with draft trees (tree_candidates)")
        elif tokens not in self.ladder:
            raise RuntimeError(f"the round's shape verifies {tokens} tokens, not a rung of this "
                               f"worker's ladder {list(self.ladder)}")
        ragged = self.ragged_trees and shape.tree is not None
        if ragged:   # a tree's budgets are verify nodes (0 .. N - 1; default: all N - 1)
            budgets = ([shape.tree_tokens - 1] * len(reqs) if budgets is None
                       else list(budgets))
            fits = (all(0 <= d < shape.tree_tokens for d in budgets)
                    and sum(budgets) + len(budgets) <= tokens)
        else:
            budgets = [steps] * len(reqs) if budgets is None else list(budgets)
            fits = shape.fits(budgets)
        if len(budgets) != len(reqs) or not fits:
            raise RuntimeError(f"budgets {budgets} of {len(reqs)} requests do not fit the "
                               f"round's shape {shape}")
        stage = self._stages[self._launches % 2]
        self._launches += 1
        top = self.slots.round_rows.shape[0]
        staged, budget = stage.rows_np, stage.budget_np
        staged[:len(reqs)] = [r.slot for r in reqs]
        staged[len(reqs):top] = self.slots.dummy
        budget[:len(reqs)] = budgets
        budget[len(reqs):top] = 0
        self.buffers.staged.copy_(stage.rows, non_blocking=True)
        greedy = all(r.params.greedy for r in reqs)
        # processed: some request's logits are processed (top-k, min_tokens, penalties,
        # logprobs): the acceptance's variant with the processing; none: the plain variant
        processed = any(r.params.processed for r in reqs)
        reach = self._reach(reqs, graph_bucket)
        pending, caught = 0, False
        if bufs.steps > 0 and self.lag.behind:
            # drafting resumes: first the cache
            pending, caught = self.lag.catch_up(bufs, bp, reach, graph_bucket)
        if shape.tree is not None:   # draft, verify, accept and commit; then draft-extend
            if graph_bucket is None:
                runner.run(bufs, bp, reach, greedy, tokens if ragged else None)
            elif runner is self.tree:
                self.table.replay(GraphKey(GraphPhase.TREE, batch=bp, steps=steps,
                                           greedy=greedy))
            else:
                self.table.replay(self.tree_key(shape.tree, bp, greedy,
                                                tokens if ragged else 0))
        for phase in round_phases(bufs.steps):
            if shape.tree is not None and phase is not GraphPhase.EXTEND:
                continue
            key = phase_key(phase, bp, steps, tokens, greedy, processed)
            if graph_bucket is None:
                self.phases.body(key, bufs, reach)()
            else:   # bp is the graph bucket
                self.table.replay(key)
        shadow = False
        if bufs.steps == 0 and self.lag.built and self.lag.count_round():
            pending, caught = self.lag.catch_up(bufs, bp, reach, graph_bucket)   # a full ring
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
                             shadow=shadow, logprobs=logprobs, shape=shape,
                             budgets=tuple(budgets), catchup=caught, pending=pending)

    @staticmethod
    def tree_key(tree: TreeShape, bucket: int, greedy: bool, packed: int = 0) -> GraphKey:
        """The graph of an adaptive tree's round (draft, verify, accept, commit) at a bucket;
        `packed`: a per-request tree round's verify tokens T (its N in `nodes`)."""
        if packed:
            return GraphKey(GraphPhase.TREE, batch=bucket, steps=tree.steps, tokens=packed,
                            greedy=greedy, topk=tree.topk, nodes=tree.tokens)
        return GraphKey(GraphPhase.TREE, batch=bucket, steps=tree.steps, tokens=tree.tokens,
                        greedy=greedy, topk=tree.topk)

    def tree_rungs(self, tree: TreeShape, bucket: int) -> tuple[int, ...]:
        """The verify tokens a tree round at padded batch `bucket` may run: (0,) — every row its
        N — without per-request budgets; with them the ladder's rungs from the one holding the
        next smaller bucket's batch + 1 (a batch this bucket serves; 1 without graphs or for
        the smallest bucket) to the one holding `bucket * N` (`policy.tree.TreeBudgetRule.shape`
        never asks more)."""
        if not self.ragged_trees:
            return (0,)
        smaller = [b for b in self.buckets if b < bucket]
        low = token_bucket(max(smaller) + 1, self.ladder) if smaller else 1
        high = token_bucket(bucket * tree.tokens, self.ladder)
        return tuple(t for t in self.ladder if low <= t <= high)

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

    def _reach(self, reqs: Sequence[SlotRequest], bucket: int | None) -> int:
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

    def measure_verify_costs(self, repeats: int = 5, context: int = 0) -> dict[int, float]:
        """Seconds of the packed verify forward alone at every token rung, {tokens: seconds}
        (its graph with graphs, else its eager body; dummy tokens whose cache holds `context`
        positions). Collective, like `measure_round_costs`."""
        return measure_targets(self, self.ladder, repeats, context)

    def round_body(self, bucket: int, greedy: bool = True,
                   graphs: bool | None = None) -> Callable[[], None]:
        """The phases of a round at the depth in force over `bucket` rows, as they are staged
        (the rows' slots and budgets already in the round buffers; the full chain's tokens):
        their graphs' replays with graphs at that bucket (`graphs` False: the eager bodies),
        else their eager bodies. For benchmarks and diagnostics (no catch-up, no host copy)."""
        if self.tree is not None:
            raise RuntimeError("round_body: a draft tree's round runs through launch "
                               "(spec_round); its phase bodies are not separable")
        bufs: StepBuffers = self.state.payload
        shape = self.default_shape(bucket)
        captured = self.table is not None and bucket in self.buckets
        graphs = captured if graphs is None else graphs and captured
        calls = []
        for phase in round_phases(bufs.steps):
            key = phase_key(phase, bucket, bufs.steps, shape.verify_tokens, greedy)
            calls.append((lambda k=key: self.table.replay(k)) if graphs else
                         self.phases.body(key, bufs, self.slots.reach))
        return lambda: [call() for call in calls] and None

    def target_body(self, tokens: int, context: int = 0) -> Callable[[], None]:
        """The packed verify forward at `tokens` tokens: its graph's replay, or its eager body
        over the pages `context` positions need (as an eager round of dummy rows reads)."""
        key = GraphKey(GraphPhase.TARGET, tokens=tokens)
        if self.table is not None and key in self.table:
            return lambda: self.table.replay(key)
        reach = min(pages_for(max(context, 1), self.config.page_size), self.slots.reach)
        return self.phases.body(key, None, reach)
