"""The EAGLE worker of one rank: prefill, speculative rounds, plain decode; one KV pool per model.

Token and cache bookkeeping of a running request with tokens `x_0 .. x_n` (prompt + generated):
- target cache: KV of positions `0 .. n-1`; `x_n` (the last committed token) is not in it yet;
- draft cache: the head's KV of positions `1 .. n` (KV index `j` is position `j+1`: the head's input
  at position `p` is token `x_p` with the target feature `f_{p-1}`, see `workers.model.eagle`);
- `features[rid]`: the head's last output `g_n`, whose logits draft `x_{n+1}`.
So both caches hold `n` tokens between rounds.

One round at `steps = s` over a batch:
1. draft: `d_1` from `g_n`; for k = 2..s one head forward (DECODE) of `d_{k-1}` at position `n+k-1`
   with the head's previous output as feature;
2. verify: one target forward (VERIFY) of `[x_n, d_1 .. d_s]` at positions `n .. n+s`;
3. accept (greedy exact match, or rejection sampling) -> `a` draft tokens and a bonus token;
4. commit `d_1 .. d_a, bonus`; truncate the target cache to `n+a+1`;
5. draft-extend: truncate the draft cache to `n`, run the head (DRAFT_EXTEND) on the committed
   tokens at positions `n+1 .. n+a+1` with the target features `f_n .. f_{n+a}`.

Everything whose shape depends on `steps` lives in a `SpecRuntimeState` whose payload is a
`StepBuffers` (metadata, input and position buffers for `max_batch x (steps+1)` tokens); the
controller pre-builds one per candidate tier and switching is `apply_runtime_state` (a reference
swap). Under tensor parallelism every TP rank runs the same batch; logits are full and identical on
every rank, so sampled tokens agree (same seeded generators).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from workers.runtime_state import SpecRuntimeState
from workers.attention.base import AttentionBackend, ForwardMode, MetadataBuffers, build_metadata
from workers.kv_cache import KVCache, pages_for
from workers.sampling import (
    accept_greedy,
    accept_rejection,
    sample,
    sample_token,
    target_probs,
)
from workers.scheduler import Request


@dataclass(frozen=True)
class WorkerConfig:
    """Sizes of one rank's worker (host values, identical on every TP rank)."""

    max_batch_size: int = 16
    max_context_len: int = 2048
    max_steps: int = 7          # the deepest tier; KV reservations include this overshoot
    page_size: int = 16
    num_pages: int | None = None  # None: room for max_batch_size full-context requests

    def __post_init__(self) -> None:
        for key in ("max_batch_size", "max_context_len", "max_steps", "page_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages={self.num_pages}: must be >= 1")

    @property
    def pages_per_request(self) -> int:
        """Pages one request of full context (plus speculative overshoot) can hold."""
        return pages_for(self.max_context_len + self.max_steps + 1, self.page_size)

    @property
    def pool_pages(self) -> int:
        """Pages in each KV pool."""
        return self.num_pages or self.max_batch_size * self.pages_per_request


@dataclass
class StepBuffers:
    """Everything a round at one `steps` needs whose shape depends on `steps` (pre-allocated).

    `graphs` is the place for CUDA graphs (draft, verify, draft-extend per batch bucket), keyed
    by `(phase, bucket)`; the CPU reference leaves it empty.
    """

    steps: int
    max_batch: int
    draft_meta: MetadataBuffers    # one draft step: max_batch tokens
    verify_meta: MetadataBuffers   # max_batch * (steps + 1) tokens
    extend_meta: MetadataBuffers   # draft-extend: up to max_batch * (steps + 1) tokens
    input_ids: torch.Tensor        # [max_batch * (steps + 1)] int64
    positions: torch.Tensor        # [max_batch * (steps + 1)] int64
    graphs: dict[tuple[str, int], Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (graphs' pools are accounted by whoever captures them)."""
        tensors = (self.input_ids, self.positions)
        return sum(t.numel() * t.element_size() for t in tensors) + self.draft_meta.nbytes \
            + self.verify_meta.nbytes + self.extend_meta.nbytes


def _fill(buf: torch.Tensor, values: list[int]) -> torch.Tensor:
    """Copy host `values` into the front of `buf`; return that view."""
    view = buf[:len(values)]
    view.copy_(torch.tensor(values, dtype=buf.dtype), non_blocking=True)
    return view


class EagleWorker:
    """Runs the target (and the EAGLE head, unless `head` is None: plain decoding only).

    Implements `workers.runtime_state.AdaptiveSpecWorker`.
    """

    def __init__(self, target: torch.nn.Module, head: torch.nn.Module | None,
                 backend: AttentionBackend, config: WorkerConfig,
                 device: torch.device | str = "cpu",
                 graph_buckets: Sequence[int] | None = None) -> None:
        self.target, self.head, self.backend = target, head, backend
        self.config, self.device = config, torch.device(device)
        tp_size = target.tp_group.size
        use_graphs = bool(graph_buckets) and head is not None
        spare = 1 if use_graphs else 0  # the CUDA-graph runner's dummy page
        self.target_cache = self._make_cache(target, tp_size, spare)
        self.draft_cache = self._make_cache(head, tp_size, spare) if head is not None else None
        self.features: dict[int, torch.Tensor] = {}  # rid -> g_n, the head's last output [d]
        self.state: SpecRuntimeState | None = None
        self.graphs = None     # CudaGraphRunner: graphs per (steps, bucket), built per tier
        self._graph_bucket: int | None = None  # set during a graph round
        if use_graphs:
            from workers.cuda_graphs import CudaGraphRunner

            self.graphs = CudaGraphRunner(self, graph_buckets)

    def _make_cache(self, model: torch.nn.Module, tp_size: int, spare: int = 0) -> KVCache:
        """A pool for `model`'s layers holding this TP rank's KV heads (in the backend's format)."""
        cfg, dtype = model.config, next(model.parameters()).dtype
        head_dim = cfg.head_dim
        kv_format = getattr(self.backend, "kv_format", None)
        if kv_format is not None:  # flashinfer: padded head dim, float16/bfloat16
            head_dim, dtype = kv_format(head_dim, dtype)
        return KVCache(model.num_layers, self.config.pool_pages + spare, self.config.page_size,
                       cfg.num_key_value_heads // tp_size, head_dim, dtype=dtype,
                       device=self.device)

    def can_use_graph(self, reqs: Sequence[Request]) -> bool:
        """Whether this rank could run a round over `reqs` with CUDA graphs (before padding)."""
        if self.graphs is None or not reqs:
            return False
        longest = max(r.num_tokens for r in reqs) + self.config.max_steps
        return self.graphs.can_use_graph(len(reqs), longest)

    def close(self) -> None:
        """Release the CUDA graphs (before the process group goes; idempotent)."""
        if self.graphs is not None:
            self.graphs.close()

    @property
    def speculative(self) -> bool:
        """Whether this worker has a draft head."""
        return self.head is not None

    @property
    def steps(self) -> int:
        """Draft steps of the runtime state in force."""
        if self.state is None:
            raise RuntimeError("no runtime state applied; call apply_runtime_state first")
        return self.state.steps

    # ---- AdaptiveSpecWorker -----------------------------------------------------------------
    def build_runtime_state(self, steps: int) -> SpecRuntimeState:
        """Pre-allocate everything a round at `steps` needs (called once per tier at start-up)."""
        if not 1 <= steps <= self.config.max_steps:
            raise ValueError(f"steps={steps}: must be in [1, max_steps={self.config.max_steps}]")
        batch, width = self.config.max_batch_size, steps + 1
        pages = batch * self.config.pages_per_request
        bufs = StepBuffers(
            steps=steps, max_batch=batch,
            draft_meta=MetadataBuffers.allocate(batch, batch, pages, self.device),
            verify_meta=MetadataBuffers.allocate(batch, batch * width, pages, self.device),
            extend_meta=MetadataBuffers.allocate(batch, batch * width, pages, self.device),
            input_ids=torch.zeros(batch * width, dtype=torch.int64, device=self.device),
            positions=torch.zeros(batch * width, dtype=torch.int64, device=self.device))
        nbytes = bufs.nbytes
        if self.graphs is not None:
            tier = self.graphs.capture_tier(steps)
            bufs.graphs, nbytes = tier.entries, nbytes + tier.nbytes
        return SpecRuntimeState(steps=steps, payload=bufs, nbytes=nbytes)

    def apply_runtime_state(self, state: SpecRuntimeState) -> None:
        """Make `state` the one in force (a reference swap: nothing is built or allocated)."""
        self.state = state

    # ---- KV admission (the scheduler's view) --------------------------------------------------
    def max_kv_tokens(self, req: Request) -> int:
        """The most tokens `req` can ever hold in either cache (speculative overshoot included)."""
        extra = self.config.max_steps + 1 if self.speculative else 0
        return len(req.prompt_ids) + req.params.max_new_tokens + extra

    def check_fits(self, req: Request) -> None:
        """Raise `RequestTooLargeError` if `req` could never fit the KV pool."""
        self.target_cache.check_fits(self.max_kv_tokens(req))

    def can_admit(self, req: Request) -> bool:
        """Whether the pools can reserve `req`'s worst case now."""
        need = self.max_kv_tokens(req)
        caches = [self.target_cache] + ([self.draft_cache] if self.draft_cache else [])
        return all(c.can_admit(need) for c in caches)

    def admit(self, req: Request) -> None:
        """Reserve `req`'s KV in both pools and create its generator."""
        for cache in self._caches():
            cache.admit(req.rid, self.max_kv_tokens(req))
        req.make_generator(self.device)

    def release(self, req: Request) -> None:
        """Give back everything `req` holds."""
        for cache in self._caches():
            if cache.has(req.rid):
                cache.free(req.rid)
        self.features.pop(req.rid, None)

    def _caches(self) -> list[KVCache]:
        return [self.target_cache] + ([self.draft_cache] if self.draft_cache is not None else [])

    # ---- forwards ---------------------------------------------------------------------------
    def _forward(self, model: torch.nn.Module, cache: KVCache, mode: ForwardMode,
                 reqs: list[Request], qo_lens: list[int], input_ids: torch.Tensor,
                 positions: torch.Tensor, features: torch.Tensor | None = None,
                 out: MetadataBuffers | None = None) -> torch.Tensor:
        """Grow each request's pages by its `qo_lens`, then one forward of `model` over `cache`."""
        cached = [cache.seq_len(r.rid) for r in reqs]
        for req, n in zip(reqs, qo_lens):
            cache.extend(req.rid, n)
        if self._graph_bucket is not None:
            return self.graphs.forward(self.state.payload.graphs, self._graph_bucket, mode, cache,
                                       [r.rid for r in reqs], cached, qo_lens, input_ids,
                                       positions, features)
        meta = build_metadata(mode, [cache.page_table(r.rid) for r in reqs], cached, qo_lens,
                              cache.page_size, self.device, out=out)
        attn = self.backend.plan(meta, cache)
        if features is None:
            return model(input_ids, positions, attn)
        return model(input_ids, features, positions, attn)

    def _ids(self, buf: torch.Tensor | None, values: list[int]) -> torch.Tensor:
        if buf is None:
            return torch.tensor(values, dtype=torch.int64, device=self.device)
        return _fill(buf, values)

    # ---- prefill ----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, reqs: list[Request]) -> None:
        """Run new requests' prompts through the target (and the head); commit their first token."""
        if not reqs:
            return
        prompts = [r.prompt_ids for r in reqs]
        lens = [len(p) for p in prompts]
        ids = self._ids(None, [t for p in prompts for t in p])
        pos = self._ids(None, [i for n in lens for i in range(n)])
        hidden = self._forward(self.target, self.target_cache, ForwardMode.EXTEND, reqs, lens,
                               ids, pos)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        logits = self.target.compute_logits(hidden[last])
        for req, row in zip(reqs, logits):
            req.commit([sample_token(row, req.params, req.generator)])
        if self.head is not None:
            shifted = [r.tokens[1:n + 1] for r, n in zip(reqs, lens)]  # x_1 .. x_P
            self._draft_extend(reqs, shifted, hidden, [0] * len(reqs), ForwardMode.EXTEND)

    def _draft_extend(self, reqs: list[Request], new_tokens: list[list[int]],
                      features: torch.Tensor, cached: list[int], mode: ForwardMode,
                      bufs: StepBuffers | None = None) -> None:
        """Head over `new_tokens[b]` (positions `cached[b]+1 ..`) with target `features` [T, d].

        Afterwards `self.features[rid]` is the head's output at the request's last position.
        """
        lens = [len(t) for t in new_tokens]
        ids = self._ids(bufs.input_ids if bufs else None, [t for toks in new_tokens for t in toks])
        pos = self._ids(bufs.positions if bufs else None,
                        [c + 1 + i for c, n in zip(cached, lens) for i in range(n)])
        out_feat = self._forward(self.head, self.draft_cache, mode, reqs, lens, ids, pos,
                                 features=features, out=bufs.extend_meta if bufs else None)
        ends = torch.tensor(lens, device=self.device).cumsum(0) - 1
        for req, g in zip(reqs, out_feat[ends]):
            self.features[req.rid] = g

    # ---- plain decoding -----------------------------------------------------------------------
    @torch.inference_mode()
    def decode_round(self, reqs: list[Request]) -> None:
        """One token per request from the target alone (the `--no-spec` path)."""
        if not reqs:
            return
        n = [r.num_tokens - 1 for r in reqs]
        ids = self._ids(None, [r.tokens[-1] for r in reqs])
        pos = self._ids(None, n)
        hidden = self._forward(self.target, self.target_cache, ForwardMode.DECODE, reqs,
                               [1] * len(reqs), ids, pos)
        logits = self.target.compute_logits(hidden)
        for req, row in zip(reqs, logits):
            req.commit([sample_token(row, req.params, req.generator)])

    # ---- speculative round --------------------------------------------------------------------
    @torch.inference_mode()
    def spec_round(self, reqs: list[Request], graph_bucket: int | None = None) -> list[int]:
        """One draft/verify/accept/draft-extend round at the steps in force; accept length per request.

        Accept lengths (accepted draft tokens, bonus excluded) are in the order of `reqs`.
        `graph_bucket` (the plan's padded batch, agreed across ranks) runs the round's forwards
        through the CUDA graphs of that bucket; None runs them eagerly.
        """
        if graph_bucket is not None and self.graphs is None:
            raise RuntimeError(f"the plan says CUDA graphs at bucket {graph_bucket}, but this "
                               "worker has none (can_use_graph was not honest)")
        self._graph_bucket = graph_bucket
        try:
            return self._spec_round(reqs)
        finally:
            self._graph_bucket = None

    def _spec_round(self, reqs: list[Request]) -> list[int]:
        if self.head is None:
            raise RuntimeError("spec_round needs a draft head; this worker decodes without one")
        if not reqs:
            return []
        bufs: StepBuffers = self.state.payload if self.state is not None else None
        if bufs is None:
            raise RuntimeError("no runtime state applied; call apply_runtime_state first")
        if len(reqs) > bufs.max_batch:
            raise RuntimeError(f"batch of {len(reqs)} exceeds max_batch_size {bufs.max_batch}")
        base = [r.num_tokens - 1 for r in reqs]  # n: tokens in each cache
        drafts, draft_probs = self._draft(reqs, base, bufs)
        features, accepts, committed = self._verify(reqs, base, drafts, draft_probs, bufs)
        for req, n, a in zip(reqs, base, accepts):
            self.target_cache.truncate(req.rid, n + a + 1)
            self.draft_cache.truncate(req.rid, n)
        self._draft_extend(reqs, committed, features, base, ForwardMode.DRAFT_EXTEND, bufs)
        for req, a, toks in zip(reqs, accepts, committed):
            req.accept_lengths.append(a)
            req.commit(toks)
        return accepts

    def _draft(self, reqs: list[Request], base: list[int],
               bufs: StepBuffers) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """`steps` draft tokens per request (chain drafting), and their draft distributions."""
        steps = bufs.steps
        feats = torch.stack([self.features[r.rid] for r in reqs])
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        for k in range(1, steps + 1):
            if k > 1:
                ids = _fill(bufs.input_ids, [d[-1] for d in drafts])
                pos = _fill(bufs.positions, [n + k - 1 for n in base])
                feats = self._forward(self.head, self.draft_cache, ForwardMode.DECODE, reqs,
                                      [1] * len(reqs), ids, pos, features=feats,
                                      out=bufs.draft_meta)
            logits = self.head.compute_logits(feats)
            for b, (req, row) in enumerate(zip(reqs, logits)):
                token, q = self._draft_token(req, row)
                drafts[b].append(token)
                probs[b].append(q)
        stacked = [None if req.params.greedy else torch.stack(p) for req, p in zip(reqs, probs)]
        return drafts, stacked

    @staticmethod
    def _draft_token(req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft token (argmax, or sampled from q) and q itself when sampling."""
        if req.params.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits[None], req.params.temperature, req.params.top_p)
        return int(sample(q, req.generator)), q[0]

    def _verify(self, reqs: list[Request], base: list[int], drafts: list[list[int]],
                draft_probs: list[torch.Tensor | None], bufs: StepBuffers,
                ) -> tuple[torch.Tensor, list[int], list[list[int]]]:
        """Target over `[x_n, d_1..d_s]`; returns the features to feed draft-extend, accepts, commits."""
        width = bufs.steps + 1
        ids = _fill(bufs.input_ids, [t for r, d in zip(reqs, drafts) for t in [r.tokens[-1]] + d])
        pos = _fill(bufs.positions, [n + i for n in base for i in range(width)])
        hidden = self._forward(self.target, self.target_cache, ForwardMode.VERIFY, reqs,
                               [width] * len(reqs), ids, pos, out=bufs.verify_meta)
        logits = self.target.compute_logits(hidden).view(len(reqs), width, -1)
        accepts, committed, keep = [], [], []
        for b, req in enumerate(reqs):
            if req.params.greedy:
                a, toks = accept_greedy(drafts[b], logits[b].argmax(-1).tolist())
            else:
                p = target_probs(logits[b], req.params.temperature, req.params.top_p)
                a, toks = accept_rejection(drafts[b], draft_probs[b], p, req.generator)
            accepts.append(a)
            committed.append(toks)
            keep.extend(range(b * width, b * width + a + 1))
        features = hidden.index_select(0, torch.tensor(keep, device=hidden.device))
        return features, accepts, committed
