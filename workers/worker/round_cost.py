"""The start-up round-cost measurement: seconds of one round at every tier and batch bucket, and
of the packed verify forward alone at every token rung.

What the goodput policy weighs depths with (`adaptive_dist.startup.agree_round_cost` agrees the
ranks' tables). The rounds run through the CUDA graphs when the worker has them. A round's shape
prices as its tier's full chain at its bucket (`measure_tiers`: every row drafting every step,
`bucket x (steps + 1)` verify tokens) with the verify forward's part exchanged for the one its
own token count costs (`measure_targets`): per-request budgets change only the verify forward's
tokens. Each sample of a round is a chain of `COST_CHAIN` rounds run as the engine runs them —
back to back, each read after the next is launched, with overlap; launched and read one by one
without — divided by its length; at depth 0 with a draft head the chain is the catch-up interval
(`catchup_every` rounds), which holds one catch-up of the draft cache, so the tier's share of it
is in the cost. The median of `repeats` chains after a warm-up chain. Collective: every rank
measures the same tiers and buckets in the same order.

The rows are routed like traffic (`TrafficRows`): a round's rows are real rows in borrowed
request slots, each with its own last token, feature and draft tokens (seeded, different per DP
replica, the same on a replica's ranks), so a MoE target's router spreads them over the experts
as it spreads a batch of requests; dummy rows, which all share the dummy slot's inputs, would all
pick the same top-k experts and price every batch above 1 as if it read `top_k` experts' weights.
Each row also has KV pages of its own, as a request has, its `context` cached positions filled
with seeded random K and V: rows that all read the same pages (once a pool held requests' KV)
and whose writes all went to the one dummy page got alike attention outputs and routed to a few
experts (issue 36). So a measurement writes KV into pages from 1 on (its rows' own, which no
request may hold: it runs at start-up or on an idle engine), and zeroes them after, as a fresh
pool holds them; the slots' state is restored after. `routing_check` counts the distinct
experts per MoE layer of such a round against a round of real requests.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from workers import startup_log
from workers.kv_cache import DUMMY_PAGE
from workers.runtime_state import RuntimeStatePool
from workers.sampling import SamplingParams
from workers.worker.request import SlotRequest
from workers.worker.slots import SlotState

COST_CHAIN = 8
"""Rounds per sample (but at depth 0 with a head: its catch-up interval)."""

TRAFFIC_SEED = 36
"""The measurement rows' inputs are drawn from this seed plus the DP replica."""


class TimedWorker(Protocol):
    """What the measurement runs rounds through (`EagleWorker`)."""

    device: torch.device
    slots: SlotState
    config: Any       # EngineConfig: max_steps
    models: Any       # RankModels: the target (its DP replica)
    buffers: Any      # RoundBuffers: rows, budget, drafts
    lag: Any          # DraftLag: the ring's lengths, when built

    def launch(self, reqs: list[SlotRequest], batch_pad: int,
               graph_bucket: int | None = None) -> Any: ...

    def collect(self, launched: Any) -> Any: ...

    def target_body(self, tokens: int, context: int = 0) -> Callable[[], None]: ...


@dataclass
class TrafficRow:
    """A measurement row as `EagleWorker.launch` reads a request: its slot, greedy sampling (the
    variant an all-dummy round ran), the tokens it may hold (the eager path's attention reach)."""

    slot: int
    num_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    pages: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    seed: int = 0
    pending_prompt_logprobs: Optional[Any] = None


class TrafficRows:
    """Request slots `0 .. n-1` borrowed as the measurement's rows (`n`: at most `rows`, and the
    worker's request slots), set up as requests whose caches hold `context` positions.

    `start()` gives every row a random last token, feature (N(0, 1)) and draft tokens, its cache
    length `context`, an empty lag ring: call it before every chain (a chain's rounds then
    advance the rows as a request's rounds advance it: the committed tokens are the model's
    own). Every row has pages of its own, as a request has: `pages_per_row` pages (all it reads
    and writes: `context` cached positions and a chain's growth), the row's set `r % sets` of
    `sets` consecutive sets from page 1 (`sets` = `n` when the pool holds them, else as many as
    it holds: rows then share sets round-robin); its page table is its set, then the dummy page.
    At construction every position of those pages, in the target's and the head's pools, is
    filled with seeded N(0, 1) K and V (the model's channels of a head; one draw per DP
    replica), so each row attends a cached context of its own, as a request does: rows that all
    read the same pages (of a pool holding retired requests' KV) and wrote to one dummy page
    got alike attention outputs, and a MoE router sent them to few experts (29 distinct per
    layer against a real round's 39 at 64 experts top 4, batch 16: the test; 36 against 125 at
    Qwen3-30B-A3B's shape, batch 64). `restore()` puts the slots' state back and zeroes those
    pages (what a fresh pool holds). Those pages must be pages no request holds: the
    measurement runs at start-up, or on an idle engine. `context` is capped so that a chain of
    `chain` rounds at the deepest depth stays inside a slot's pages (and a row's pages inside
    the pool)."""

    def __init__(self, worker: TimedWorker, rows: int, context: int = 0,
                 chain: int = COST_CHAIN) -> None:
        slots = worker.slots
        self.worker, self.slots = worker, slots
        self.count = max(0, min(rows, slots.dummy))
        n, ps = self.count, slots.page_size
        self.growth = chain * (worker.config.max_steps + 1)
        usable = slots.pool_pages - 1   # all but the dummy page
        room = min(slots.reach, usable) * ps - self.growth - 1
        self.context = max(0, min(context, room))
        # at most a slot's reach (a chain longer than a slot holds writes its last page again,
        # as before) and the pool (a row's positions beyond it on the dummy page)
        self.pages_per_row = min(-(-(self.context + self.growth + 1) // ps), slots.reach,
                                 usable)
        self.sets = max(1, min(n, usable // self.pages_per_row)) if n else 0
        replica = worker.models.target.par.replica
        self.seed = TRAFFIC_SEED + 1000 * replica
        gen = torch.Generator().manual_seed(self.seed)
        vocab, dev = slots.vocab, slots.device
        self.tokens = torch.randint(0, vocab, (n,), generator=gen).to(dev)
        self.features = torch.randn(n, slots.feature.shape[1], generator=gen).to(
            dev, slots.feature.dtype)
        drafts = worker.buffers.drafts
        self.drafts = torch.randint(0, vocab, (n, drafts.shape[1]), generator=gen).to(dev)
        per, width = self.pages_per_row, slots.reach
        self.tables = torch.full((n, width), DUMMY_PAGE, dtype=torch.int64)
        for r in range(n):
            first = 1 + (r % self.sets) * per
            self.tables[r, :per] = torch.arange(first, first + per)
        self.tables = self.tables.to(dev)
        lag = worker.lag
        self._ring = lag.ring_len if getattr(lag, "built", False) else None
        self._saved = [t[:n].clone() for t in self._state()]
        self._fill()

    @property
    def used_pages(self) -> range:
        """The pages the rows read and write (filled at construction, zeroed by `restore`)."""
        return range(1, 1 + self.sets * self.pages_per_row) if self.count else range(0)

    def _pools(self) -> list[tuple[Any, int]]:
        """(pool, the model's channels per KV head) of the target and, when built, the head."""
        models = self.worker.models
        out = [(models.target_kv, models.target.config.head_dim)]
        if getattr(models, "draft_kv", None) is not None:
            out.append((models.draft_kv, models.head.config.head_dim))
        return out

    def _fill(self) -> None:
        """Seeded N(0, 1) K and V in every position of `used_pages`, the model's channels only
        (a kernel's format may pad a head with zero channels), drawn on the device."""
        pages = self.used_pages
        if not len(pages):
            return
        dev = self.slots.device
        gen = torch.Generator(device=dev).manual_seed(self.seed)
        for pool, dim in self._pools():
            for t in pool.k + pool.v:
                t[pages.start:pages.stop, ..., :dim].normal_(generator=gen)

    def _state(self) -> list[torch.Tensor]:
        slots = self.slots
        state = [slots.pages, slots.cache_len, slots.last_token, slots.feature]
        return state + ([self._ring] if self._ring is not None else [])

    def requests(self, bucket: int) -> list[TrafficRow]:
        """The rows of a round padded to `bucket` (the rows beyond them: dummy rows)."""
        top = self.context + self.growth
        return [TrafficRow(slot=s, num_tokens=top) for s in range(min(bucket, self.count))]

    def start(self) -> None:
        """Every row's inputs as at the start of a chain (device copies, in stream order)."""
        n, slots = self.count, self.slots
        if not n:
            return
        slots.pages[:n] = self.tables
        slots.cache_len[:n] = self.context
        slots.last_token[:n] = self.tokens
        slots.feature[:n] = self.features
        self.worker.buffers.drafts[:n] = self.drafts
        if self._ring is not None:
            self._ring[:n] = 0

    def restore(self) -> None:
        """The borrowed slots' state as it was, the round's rows all dummy rows again, the
        rows' pages zero."""
        n = self.count
        for tensor, saved in zip(self._state(), self._saved):
            tensor[:n] = saved
        self.worker.buffers.rows.fill_(self.slots.dummy)
        self.worker.buffers.budget.zero_()
        pages = self.used_pages
        for pool, _ in self._pools():
            for t in pool.k + pool.v:
                t[pages.start:pages.stop].zero_()

    def __enter__(self) -> "TrafficRows":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def measure_tiers(worker: TimedWorker, tiers: RuntimeStatePool, buckets: Sequence[int],
                  graphs: bool, overlap: bool, catchup_every: int | None,
                  repeats: int = 5, context: int = 0) -> dict[int, dict[int, float]]:
    """Seconds of one round per bucket and tier: {bucket: {steps: seconds}}. Applies each of
    `tiers`' states in turn (the last stays applied); `graphs`: replay each bucket's graphs;
    `overlap`: one round in flight while the next is launched; `catchup_every`: the catch-up
    interval of depth 0 with a head (None: no lag ring); `context`: the cache length of the
    rows (`TrafficRows`) when each chain starts."""
    sync = (torch.cuda.synchronize if worker.device.type == "cuda" else (lambda: None))
    table: dict[int, dict[int, float]] = {}
    begun, total = time.perf_counter(), len(buckets) * len(tiers.states) * (repeats + 1)
    longest = max(COST_CHAIN, catchup_every or 0)
    with TrafficRows(worker, max(buckets), context, longest) as rows:
        for bucket in buckets:
            graph = bucket if graphs else None
            reqs = rows.requests(bucket)
            for steps in tiers.states:
                tiers.apply(steps)
                chain = catchup_every if steps == 0 and catchup_every is not None else COST_CHAIN
                times = []
                for _ in range(repeats + 1):  # the first is a warm-up
                    startup_log.current().progress(
                        "cost table", sum(map(len, table.values())) * (repeats + 1) + len(times),
                        total, f"chains of rounds; bucket {bucket}, depth {steps}", since=begun)
                    rows.start()
                    sync()
                    start = time.perf_counter()
                    queued = []   # launched, not read yet
                    in_flight = 1 if overlap else 0   # as the engine runs rounds
                    for _ in range(chain):
                        queued.append(worker.launch(reqs, bucket, graph))
                        if len(queued) > in_flight:
                            worker.collect(queued.pop(0))
                    for handle in queued:
                        worker.collect(handle)
                    sync()
                    times.append((time.perf_counter() - start) / chain)
                table.setdefault(bucket, {})[steps] = statistics.median(times[1:])
    return table


def stage_tokens(worker: TimedWorker, rows: TrafficRows, tokens: int) -> None:
    """The round buffers' rows and budgets for a packed verify forward of `tokens` tokens over
    `rows`: as many rows as hold them, each bringing at most `max_steps + 1` tokens (its last
    token and drafts), the tokens beyond the rows' room padding."""
    bufs, width = worker.buffers, worker.config.max_steps + 1
    bufs.rows.fill_(worker.slots.dummy)
    bufs.budget.zero_()
    used = min(rows.count, -(-tokens // width)) if tokens else 0
    if not used:
        return
    base, extra = divmod(min(tokens, used * width), used)
    budget = [base + (1 if r < extra else 0) - 1 for r in range(used)]
    bufs.rows[:used] = torch.arange(used, device=bufs.rows.device)
    bufs.budget[:used] = torch.tensor(budget, dtype=bufs.budget.dtype).to(bufs.budget.device)


def measure_targets(worker: TimedWorker, ladder: Sequence[int], repeats: int = 5,
                    context: int = 0) -> dict[int, float]:
    """Seconds of the packed verify forward alone per token rung: {tokens: seconds}, each the
    median of `repeats` chains of `COST_CHAIN` forwards after a warm-up chain, on the tokens of
    `TrafficRows` (`stage_tokens`; their attention reads `context` positions)."""
    sync = (torch.cuda.synchronize if worker.device.type == "cuda" else (lambda: None))
    table: dict[int, float] = {}
    begun = time.perf_counter()
    top = -(-max(ladder) // (worker.config.max_steps + 1))
    with TrafficRows(worker, top, context, chain=1) as rows:
        for tokens in ladder:
            startup_log.current().progress("verify costs", len(table), len(ladder),
                                           f"{tokens} tokens", since=begun)
            body = worker.target_body(tokens, rows.context + rows.growth)
            times = []
            for _ in range(repeats + 1):
                rows.start()
                stage_tokens(worker, rows, tokens)
                sync()
                start = time.perf_counter()
                for _ in range(COST_CHAIN):
                    body()
                sync()
                times.append((time.perf_counter() - start) / COST_CHAIN)
            table[tokens] = statistics.median(times[1:])
    return table



def room(worker: TimedWorker, context: int, chain: int = 1) -> int:
    """The cached positions `TrafficRows(worker, ..., context, chain)` gives its rows (`context`
    held inside a slot's pages)."""
    slots = worker.slots
    growth = chain * (worker.config.max_steps + 1)
    pages = min(slots.reach, slots.pool_pages - 1)
    return max(0, min(context, pages * slots.page_size - growth - 1))


def measure_target_contexts(worker: TimedWorker, ladder: Sequence[int],
                            contexts: Sequence[int], repeats: int = 3
                            ) -> dict[int, dict[int, float]]:
    """The context term of the cost model (`adaptive_dist.cost_tables.ContextTerm`): the packed
    verify forward per token rung (`measure_targets`) with every token's row holding each of
    `contexts` cached positions: {context actually held: {tokens: seconds}} (a context beyond a
    slot's pages is held at what fits; a repeated one measured once; 0 measures the term's own
    base, in the same process and repeats as the others)."""
    out: dict[int, dict[int, float]] = {}
    for context in contexts:
        held = room(worker, context)
        if held in out or (held < 1 and context > 0):
            continue
        out[held] = measure_targets(worker, ladder, repeats, held)
    return out


def measure_catchups(worker: TimedWorker, tiers: RuntimeStatePool, buckets: Sequence[int],
                     contexts: Sequence[int], graphs: bool, repeats: int = 3
                     ) -> dict[int, dict[int, float]]:
    """The catch-up term of the cost model (`adaptive_dist.cost_tables.CatchupTerm`): seconds of
    one catch-up forward of the draft cache (`DraftLag.catchup_phase`: the head over every row's
    full lag ring, `catchup_every` entries, attending the head's cache) per batch bucket, every
    row holding each of `contexts` cached positions: {context actually held: {bucket:
    seconds}}, each the median of `repeats` chains of `COST_CHAIN` catch-ups after a warm-up
    chain; through the catch-up's CUDA graph at the bucket (`graphs`, when captured), else its
    eager body. Before every catch-up each row's ring is full again (one small device fill,
    timed with it). {} without a lag ring (no head, or no depth-0 tier). Applies tier 0 (the
    caller applies the one it wants after). A context beyond a slot's pages is held at what
    fits, below the ring's length at the ring's length (none when a slot cannot hold the ring);
    a repeated one measured once.
    Collective like every measurement: every rank the same buckets and contexts in order."""
    lag = worker.lag
    if not getattr(lag, "built", False) or 0 not in tiers.states:
        return {}
    from workers.kv_cache import pages_for
    from workers.worker.graph_table import GraphKey, GraphPhase

    sync = (torch.cuda.synchronize if worker.device.type == "cuda" else (lambda: None))
    tiers.apply(0)
    bufs = tiers.states[0].payload   # tier 0's StepBuffers (the shadow columns)
    every, slots = lag.catchup_every, worker.slots
    out: dict[int, dict[int, float]] = {}
    begun, total = time.perf_counter(), len(contexts) * len(buckets)
    for context in contexts:
        held = max(every, room(worker, context, 1))
        if held in out or held > room(worker, held, 1):
            continue   # measured already, or a slot cannot hold the ring's entries
        row: dict[int, float] = {}
        with TrafficRows(worker, max(buckets), held, chain=1) as rows:
            held = rows.context
            n = rows.count
            for bucket in buckets:
                startup_log.current().progress(
                    "catch-up costs", len(out) * len(buckets) + len(row), total,
                    f"bucket {bucket}, context {held}", since=begun)
                key = GraphKey(GraphPhase.CATCHUP, batch=bucket)
                table = lag.table
                if graphs and table is not None and key in table:
                    body = (lambda k=key: table.replay(k))
                else:
                    reach = min(pages_for(held + 1, slots.page_size), slots.reach)
                    body = lag.catchup_phase_body(bufs, bucket, reach)
                used = min(bucket, n)
                times = []
                for _ in range(repeats + 1):   # the first is a warm-up
                    rows.start()
                    bufs.rows.fill_(slots.dummy)
                    bufs.rows[:used] = torch.arange(used, device=bufs.rows.device)
                    sync()
                    start = time.perf_counter()
                    for _ in range(COST_CHAIN):
                        lag.ring_len[:used] = every   # a full ring, as after `every` rounds
                        body()
                    sync()
                    times.append((time.perf_counter() - start) / COST_CHAIN)
                row[bucket] = statistics.median(times[1:])
        out[held] = row
    return out


PREFILL_CHAIN = 2
"""Prefills per sample of a prefill's cost."""


@dataclass
class PrefillSample:
    """One measured prefill shape: `rows` x `width` token slots (padded; `rows` 0: the ragged
    path over `width` tokens, no requests), seconds per prefill."""

    rows: int
    width: int
    seconds: float

    @property
    def slots(self) -> int:
        return max(self.rows, 1) * self.width

    @property
    def positions(self) -> int:
        """KV positions its attention reads: every padded slot attends its row causally (the
        prompts' lengths do not enter); the ragged path without requests reads none."""
        return padded_positions(self.rows, self.width) if self.rows else 0

    def as_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "width": self.width, "slots": self.slots,
                "positions": self.positions, "seconds": self.seconds}


def padded_positions(rows: int, width: int) -> int:
    """KV positions a padded prefill of `rows` x `width` slots reads (each slot `w` its row's
    `0 .. w`, whatever the prompts' lengths)."""
    return rows * width * (width + 1) // 2


def prefill_shapes(worker: Any, ragged: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The prefills `measure_prefills` times, (rows, width): the narrowest width (32) at every
    rows bucket within the padded cap, and the next width at the most rows (the slots' part,
    little attention), then one row at every wider width the engine captures and as many rows
    of the widest as the cap holds (the same slots with more attention: its per-position cost),
    and `ragged` token counts beyond the cap (rows 0: the ragged path)."""
    runner = worker.prefill_runner
    cap = runner.cap
    longest = max(32, 1 << (worker.config.max_context_len - 1).bit_length())
    shapes: list[tuple[int, int]] = []
    if cap >= 32:
        rows = [r for r in runner.row_buckets if r * 32 <= cap]
        shapes += [(r, 32) for r in rows]
        if rows[-1] * 64 <= cap and longest >= 64:
            shapes.append((rows[-1], 64))
        width = 64
        while width <= longest and width <= cap:
            shapes.append((1, width))
            width *= 2
        top = width // 2
        shapes += [(r, top) for r in runner.row_buckets if 1 < r and r * top <= cap]
    shapes = list(dict.fromkeys(shapes))
    shapes += [(0, t) for t in ragged if t > cap]
    return shapes


def measure_prefills(worker: Any, repeats: int = 3, ragged: Sequence[int] = (),
                     graphs: bool = True) -> list[PrefillSample]:
    """Seconds of a prefill at each of `prefill_shapes` (median of `repeats` chains of
    `PREFILL_CHAIN` prefills after a warm-up chain): the padded prefill through its CUDA graph
    where the worker captured it (`graphs`), its body otherwise, its rows all the dummy slot
    (every position they write lands on the dummy page) with full-width prompts of random
    tokens; the ragged path as an idle rank runs it (`EagleWorker.prefill` with no requests).
    The head's part included (not the deferred variant). Collective like every measurement:
    every rank the same shapes in the same order. The static inputs are left as the capture
    left them."""
    sync = (torch.cuda.synchronize if worker.device.type == "cuda" else (lambda: None))
    runner, slots = worker.prefill_runner, worker.slots
    shapes = prefill_shapes(worker, ragged)
    gen = torch.Generator().manual_seed(TRAFFIC_SEED)
    out: list[PrefillSample] = []
    begun = time.perf_counter()
    for i, (rows, width) in enumerate(shapes):
        startup_log.current().progress("prefill costs", i, len(shapes),
                                       f"{max(rows, 1)} x {width} slots", since=begun)
        if rows:
            ids, where, lens = runner.inputs(rows, width)
            entry = (runner.table.get(runner.key(rows, width, True))
                     if graphs and runner.table is not None else None)

            def stage(ids=ids, where=where, lens=lens, width=width) -> None:
                ids.copy_(torch.randint(0, slots.vocab, ids.shape, generator=gen))
                where.fill_(slots.dummy)
                lens.fill_(width)
            body = (entry.replay if entry is not None else
                    (lambda r=rows, w=width: runner.padded(r, w, True)))
        else:
            def stage() -> None:
                pass
            body = (lambda t=width: worker.prefill([], t, 1, t, False))
        times = []
        for _ in range(repeats + 1):
            stage()
            sync()
            start = time.perf_counter()
            for _ in range(PREFILL_CHAIN):
                body()
            sync()
            times.append((time.perf_counter() - start) / PREFILL_CHAIN)
        out.append(PrefillSample(rows, width, statistics.median(times[1:])))
    if runner.buf is not None:   # as the capture left them
        runner.buf.zero_()
        runner.inputs(runner.top_rows, 0)[1].fill_(slots.dummy)
    slots.cache_len[slots.dummy:].zero_()
    return out

# ---- the check: does a measurement round route like traffic? ----------------------------------

def measurement_routing(worker: TimedWorker, bucket: int, context: int = 0,
                        dummy: bool = False) -> list[int]:
    """Distinct experts per MoE layer of the target in one eager round of the measurement at
    `bucket` rows and the depth in force (`dummy`: the all-dummy round the measurement ran
    before `TrafficRows`); [] for a dense target. Leaves the slots as it found them."""
    from workers.model.moe import routed_experts

    lag = worker.lag
    behind = lag.rounds_behind
    with TrafficRows(worker, bucket, context) as rows, \
            routed_experts(worker.models.target) as seen:
        rows.start()
        worker.collect(worker.launch([] if dummy else rows.requests(bucket), bucket, None))
    lag.rounds_behind = behind    # the ring's lengths are restored: no catch-up owed
    return seen.counts()


def round_routing(worker: TimedWorker, reqs: list[SlotRequest], bucket: int) -> list[int]:
    """Distinct experts per MoE layer of the target in one eager round over the admitted
    requests `reqs` padded to `bucket` rows, at the depth in force. The round advances the
    requests' slots on the device and nobody commits its tokens: for a diagnostic at the end
    of a run."""
    from workers.model.moe import routed_experts

    with routed_experts(worker.models.target) as seen:
        worker.collect(worker.launch(list(reqs), bucket, None))
    return seen.counts()
