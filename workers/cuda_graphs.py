"""CUDA graphs for the speculative round: draft step, verify and draft-extend, keyed by
`(steps, batch bucket)`.

What is captured. For every tier `steps` and every batch bucket `Bp` the runner captures three
forwards, each with a fixed layout of `Bp` requests by `W` tokens:
- `draft`:  one head forward (a draft step), `W = 1`;
- `verify`: one target forward over `[x_n, d_1..d_s]`, `W = steps + 1`;
- `extend`: one head forward over the committed tokens, `W = steps + 1` (a request with `a + 1`
  committed tokens fills the first `a + 1` of its `W` rows).
Logits, sampling and acceptance stay outside the graphs (host decisions, per-request generators).

Attention inside a graph. The graphs keep the torch reference math (gather, mask, SDPA) in a
static-shape form (`StaticAttention`): each request's KV is gathered through a page table padded to
`max_pages` pages, and the mask is computed on the device from the cached and new lengths. With
`--backend flashinfer` the same graphs read flashinfer's cache format (zero-padded head dim,
float16/bfloat16); flashinfer runs the eager forwards (prefill, plain decode, rounds that do not
fit a bucket). So the graph path never calls flashinfer's planner, and a graph's KV reach is
bounded by `max_pages` (a batch beyond it runs eager: `can_use_graph` says no).

Padding. A batch of `B < Bp` requests is padded with dummy requests whose page tables point at a
reserved dummy page in each cache (`DUMMY_RID` holds it); padded rows and padded requests write
their K/V into that page and their outputs are dropped.

Static buffers. One `GraphInputs` per tier (token ids, positions, head features, and one int64
block holding page tables, lengths and the ragged-to-padded index) is shared by that tier's
buckets and phases; the host fills it with one copy before a replay. Outputs live in the graphs'
memory pool: one pool shared by every capture (largest bucket first within a tier), safe because
graphs run one at a time on one stream and each graph's output stays allocated.

Lifetime. The worker builds the runner when it is built with graph buckets; each tier's graphs are
captured inside `EagleWorker.build_runtime_state(steps)` and live in the tier's `StepBuffers`, so
a tier switch is a reference swap (`num_captures` does not move). `close()` releases the graphs,
the pool and the dummy pages.
# NOTE: close() must run before the process group is destroyed (graphs with tensor-parallel
# collectives hold NCCL resources); the CLI and the engine call it before `ctx.shutdown()`.
# NOTE: under tensor parallelism the graphs hold the layers' all-reduces; a replay issues them
# without passing through `collectives.ops`, so a recording lockstep guard logs them only at
# capture. The graph path itself is agreed per round by the controller (`plan.use_graph`).

Not graphed: prefill, plain decoding (`--no-spec`), logits and sampling.

Without CUDA (`capture=False`) the runner executes the same padded static forwards eagerly: the
CPU tests check the padding and layout logic that the GPU graphs replay.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn.functional as F

from adaptive_dist.policy import pick_bucket
from workers.attention.base import ForwardMode
from workers.kv_cache import KVCache

if TYPE_CHECKING:
    from workers.eagle_worker import EagleWorker

DUMMY_RID = -1  # the cache entry that holds each pool's dummy page
PHASES = {ForwardMode.DECODE: "draft", ForwardMode.VERIFY: "verify",
          ForwardMode.DRAFT_EXTEND: "extend"}


def capture_buckets(config_buckets: Sequence[int], max_batch: int) -> tuple[int, ...]:
    """The buckets to capture: the configured ones up to the smallest that holds `max_batch`."""
    top = pick_bucket(max_batch, sorted(config_buckets)) or max(config_buckets)
    return tuple(sorted(b for b in config_buckets if b <= top))


def _pad_heads(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


class StaticAttention:
    """Attention over a paged cache with every shape fixed (capturable): `batch` requests by
    `width` new tokens, KV reach `page_tab.shape[1]` pages.

    `page_tab` [Bp, P] (int64 page ids, padded with the dummy page), `cached` [Bp] (KV tokens
    before this forward) and `qo_len` [Bp] (real new tokens, the rest of the `width` rows are
    padding) are device tensors read at run time; the slot table, the mask and the write slots are
    computed from them on the device, once per forward.
    """

    def __init__(self, cache: KVCache, page_tab: torch.Tensor, cached: torch.Tensor,
                 qo_len: torch.Tensor, width: int, dummy_slot: int) -> None:
        self.cache, self.width = cache, width
        self.batch, max_pages = page_tab.shape
        ps, device = cache.page_size, page_tab.device
        kv_idx = torch.arange(max_pages * ps, device=device)
        self.slots = page_tab[:, kv_idx // ps] * ps + kv_idx % ps           # [Bp, L]
        rows = torch.arange(width, device=device)
        kv_pos = cached[:, None] + rows[None, :]                              # [Bp, W]
        # NOTE: token i of request b sees KV 0 .. cached+i; padded rows see more of the same
        # request's pages (or the dummy page): finite values, outputs dropped. Every row sees
        # KV index 0, so no row is fully masked.
        self.mask = (kv_idx[None, None, :] <= kv_pos[:, :, None])[:, None]    # [Bp, 1, W, L]
        real = rows[None, :] < qo_len[:, None]
        page = page_tab.gather(1, (kv_pos // ps).clamp(max=max_pages - 1))
        self.out_slots = torch.where(real, page * ps + kv_pos % ps, dummy_slot).reshape(-1)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Store K/V (padded rows into the dummy page), then attention: [Bp*W, Hq, D]."""
        cache, size = self.cache, self.cache.head_dim
        cache.write(layer_id, self.out_slots, _pad_heads(k, size), _pad_heads(v, size))
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        query = q.reshape(self.batch, self.width, num_q_heads, head_dim).transpose(1, 2)
        keys = self._gather(cache.k[layer_id], num_q_heads, head_dim, q.dtype)
        values = self._gather(cache.v[layer_id], num_q_heads, head_dim, q.dtype)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=self.mask,
                                             scale=head_dim ** -0.5)
        return out.transpose(1, 2).reshape(self.batch * self.width, num_q_heads, head_dim)

    def _gather(self, pages: torch.Tensor, num_q_heads: int, head_dim: int,
                dtype: torch.dtype) -> torch.Tensor:
        """[Bp, Hq, L, D] K or V of every request (KV heads repeated for grouped-query attention)."""
        flat = pages.view(-1, pages.shape[2], pages.shape[3])
        out = flat[self.slots][..., :head_dim].to(dtype).transpose(1, 2)    # [Bp, Hkv, L, D]
        groups = num_q_heads // out.shape[1]
        return out.repeat_interleave(groups, dim=1) if groups > 1 else out


@dataclass
class GraphInputs:
    """Static inputs of one tier's graphs, filled by the host before every replay."""

    input_ids: torch.Tensor   # [Bmax * W] int64
    positions: torch.Tensor   # [Bmax * W] int64
    features: torch.Tensor    # [Bmax * W, d] head feature input (model dtype)
    meta: torch.Tensor        # int64: page table | cached lens | new lens | ragged->padded index

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())


@dataclass
class GraphEntry:
    """One captured forward: `phase` at batch bucket `bucket`, `width` rows per request."""

    phase: str
    bucket: int
    width: int
    inputs: GraphInputs
    body: Callable[[], torch.Tensor]
    graph: Any = None                 # torch.cuda.CUDAGraph, or None when emulated on CPU
    output: torch.Tensor | None = None
    closed: bool = False

    def meta_views(self, max_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page table [Bp, P], cached [Bp], new lens [Bp]): this entry's views of `inputs.meta`."""
        n = self.bucket * max_pages
        meta = self.inputs.meta
        return (meta[:n].view(self.bucket, max_pages), meta[n:n + self.bucket],
                meta[n + self.bucket:n + 2 * self.bucket])

    def replay(self) -> torch.Tensor:
        """Run the forward on the current inputs; the output rows are `[bucket * width, d]`."""
        if self.closed:
            raise RuntimeError(f"CUDA graph {self.phase}/{self.bucket} used after close()")
        if self.graph is None:
            return self.body()
        self.graph.replay()
        return self.output


@dataclass
class TierGraphs:
    """What `capture_tier` returns for one tier: its entries and the bytes they added
    (`nbytes` = static inputs + the growth of the shared graph pool while capturing this tier)."""

    steps: int
    entries: dict[tuple[str, int], GraphEntry] = field(default_factory=dict)
    input_bytes: int = 0
    pool_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.input_bytes + self.pool_bytes


class CudaGraphRunner:
    """Captures and replays the speculative round's forwards for one `EagleWorker`."""

    def __init__(self, worker: "EagleWorker", config_buckets: Sequence[int],
                 capture: bool | None = None) -> None:
        if worker.head is None or worker.draft_cache is None:
            raise ValueError("CUDA graphs need a speculative worker (a draft head)")
        self.worker = worker
        self.capture = worker.device.type == "cuda" if capture is None else capture
        if self.capture and worker.device.type != "cuda":
            raise ValueError(f"capturing CUDA graphs needs a CUDA device, not {worker.device}")
        cfg = worker.config
        self.buckets = capture_buckets(config_buckets, cfg.max_batch_size)
        self.max_pages = min(cfg.pages_per_request, cfg.pool_pages)
        self.caches = {"target": worker.target_cache, "draft": worker.draft_cache}
        self.dummy_page: dict[str, int] = {}
        for name, cache in self.caches.items():
            cache.admit(DUMMY_RID, cache.page_size)
            cache.extend(DUMMY_RID, cache.page_size)
            self.dummy_page[name] = cache.page_table(DUMMY_RID)[0]
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # NOTE: one side stream for every warm-up and capture: each new stream would get its own
        # cuBLAS workspace (tens of MiB apiece).
        self.stream = torch.cuda.Stream(device=worker.device) if self.capture else None
        self.num_captures = 0
        self.entries: list[GraphEntry] = []
        self.closed = False

    # ---- eligibility --------------------------------------------------------------------------
    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    @property
    def max_kv_tokens(self) -> int:
        """The most KV tokens a request may hold during a graph round."""
        return self.max_pages * self.worker.config.page_size

    def can_use_graph(self, batch: int, max_kv_tokens: int) -> bool:
        """Whether a round of `batch` requests, none holding more than `max_kv_tokens` KV tokens
        during the round, fits the captured graphs (this rank's view; the controller ANDs them)."""
        return (not self.closed and 0 < batch <= self.max_bucket
                and max_kv_tokens <= self.max_kv_tokens)

    # ---- capture ------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_tier(self, steps: int) -> TierGraphs:
        """Capture draft, verify and draft-extend at every bucket for tier `steps` (start-up only)."""
        if self.closed:
            raise RuntimeError("CUDA graph runner is closed")
        pool_before = self.pool_bytes()
        w = self.worker
        width, top = steps + 1, self.max_bucket
        dim = w.target.config.hidden_size
        dtype = next(w.head.parameters()).dtype
        meta_len = top * self.max_pages + 2 * top + top * width

        def zeros(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=w.device)

        inputs = GraphInputs(input_ids=zeros(top * width), positions=zeros(top * width),
                             features=zeros(top * width, dim, dt=dtype), meta=zeros(meta_len))
        tier = TierGraphs(steps, input_bytes=inputs.nbytes)
        for bucket in sorted(self.buckets, reverse=True):  # largest first into the shared pool
            for phase, phase_width in (("verify", width), ("extend", width), ("draft", 1)):
                entry = self._make_entry(phase, bucket, phase_width, inputs)
                self._capture(entry)
                tier.entries[(phase, bucket)] = entry
        tier.pool_bytes = self.pool_bytes() - pool_before
        return tier

    def _make_entry(self, phase: str, bucket: int, width: int, inputs: GraphInputs) -> GraphEntry:
        w = self.worker
        name = _cache_name(phase)
        cache, dummy_slot = self.caches[name], self.dummy_page[name] * self.caches[name].page_size
        entry = GraphEntry(phase, bucket, width, inputs, body=lambda: torch.empty(0))
        page_tab, cached, qo_len = entry.meta_views(self.max_pages)
        rows = bucket * width

        def body() -> torch.Tensor:
            attn = StaticAttention(cache, page_tab, cached, qo_len, width, dummy_slot)
            ids, pos = inputs.input_ids[:rows], inputs.positions[:rows]
            if phase == "verify":
                return w.target(ids, pos, attn)
            return w.head(ids, inputs.features[:rows], pos, attn)

        entry.body = body
        return entry

    def _capture(self, entry: GraphEntry) -> None:
        """Warm up, then capture `entry` (all rows padding: every K/V write hits the dummy page)."""
        page_tab, cached, qo_len = entry.meta_views(self.max_pages)
        page_tab.fill_(self.dummy_page[_cache_name(entry.phase)])
        cached.zero_()
        qo_len.zero_()
        self.entries.append(entry)
        if not self.capture:
            return
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.worker.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                entry.body()
        torch.cuda.current_stream(self.worker.device).wait_stream(stream)
        torch.cuda.synchronize(self.worker.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            entry.output = entry.body()
        entry.graph = graph
        self.num_captures += 1

    def pool_bytes(self) -> int:
        """Device bytes held by the shared graph memory pool (its cudaMalloc'd segments)."""
        if not self.capture or self.pool is None:
            return 0
        torch.cuda.synchronize(self.worker.device)
        pool = tuple(self.pool)
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == pool)

    # ---- replay -------------------------------------------------------------------------------
    def forward(self, entries: dict[tuple[str, int], GraphEntry], bucket: int, mode: ForwardMode,
                cache: KVCache, rids: Sequence[int], cached: Sequence[int], qo_lens: Sequence[int],
                input_ids: torch.Tensor, positions: torch.Tensor,
                features: torch.Tensor | None) -> torch.Tensor:
        """One forward of the round through the graph for `mode` at `bucket`.

        The requests' pages must already hold the new tokens (`cache.extend`); inputs are ragged
        (request-major, `qo_lens[b]` rows each) as in the eager path, and so is the result.
        """
        phase = PHASES.get(mode)
        entry = entries.get((phase, bucket)) if phase is not None else None
        if entry is None:
            raise RuntimeError(f"no CUDA graph for {mode.value} at batch bucket {bucket} "
                               f"(captured buckets {list(self.buckets)})")
        batch, width, bp = len(rids), entry.width, entry.bucket
        if batch > bp or any(n > width for n in qo_lens):
            raise RuntimeError(f"{batch} requests with {list(qo_lens)} new tokens do not fit the "
                             f"{phase} graph of {bp} x {width}")
        dummy_page = self.dummy_page[_cache_name(phase)]
        table: list[int] = []
        for rid in rids:
            pages = cache.page_table(rid)
            if len(pages) > self.max_pages:
                raise RuntimeError(f"request {rid} holds {len(pages)} pages; graphs reach "
                                 f"{self.max_pages} (can_use_graph should have said no)")
            table += pages + [dummy_page] * (self.max_pages - len(pages))
        pad = bp - batch
        table += [dummy_page] * (pad * self.max_pages)
        dense = all(n == width for n in qo_lens)
        dest = [] if dense else [b * width + i for b, n in enumerate(qo_lens) for i in range(n)]
        host = table + list(cached) + [0] * pad + list(qo_lens) + [0] * pad + dest
        meta = entry.inputs.meta
        meta[:len(host)].copy_(torch.tensor(host, dtype=torch.int64))
        tokens = sum(qo_lens)
        inputs = entry.inputs
        if dense:
            inputs.input_ids[:tokens].copy_(input_ids)
            inputs.positions[:tokens].copy_(positions)
            if features is not None:
                inputs.features[:tokens].copy_(features)
        else:
            index = meta[len(host) - len(dest):len(host)]
            inputs.input_ids.index_copy_(0, index, input_ids)
            inputs.positions.index_copy_(0, index, positions)
            if features is not None:
                inputs.features.index_copy_(0, index, features.to(inputs.features.dtype))
        out = entry.replay()
        return out[:tokens] if dense else out.index_select(0, index)

    # ---- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Release every graph, the pool and the dummy pages (idempotent).

        # NOTE: call before the process group is destroyed (see the module docstring).
        """
        if self.closed:
            return
        if self.capture:
            torch.cuda.synchronize(self.worker.device)
        for entry in self.entries:
            if entry.graph is not None:
                entry.graph.reset()
            entry.graph, entry.output, entry.closed = None, None, True
        self.entries.clear()
        self.pool, self.stream = None, None
        for cache in self.caches.values():
            if cache.has(DUMMY_RID):
                cache.free(DUMMY_RID)
        self.closed = True


def _cache_name(phase: str) -> str:
    return "target" if phase == "verify" else "draft"


__all__ = ["CudaGraphRunner", "StaticAttention", "GraphEntry", "GraphInputs", "TierGraphs",
           "capture_buckets", "DUMMY_RID"]
