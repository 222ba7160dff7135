"""The EAGLE worker of one rank: prefill and the speculative round, on shapes the plan fixes.

Per request the worker keeps, on the device, in the request's batch slot: its page table (given by
the scheduler at admission, fixed while it runs), `n` (tokens in each cache), its last committed
token `x_n` (not in the caches yet) and the head's last output `g_n`. Caches, for tokens
`x_0 .. x_n`: the target holds the KV of positions `0 .. n-1`; the draft head holds positions
`1 .. n` (KV index `j` is position `j+1`: the head's input at position `p` is `x_p` with the target
feature `f_{p-1}`, see `workers.model.eagle`).

One round at depth `S` over `B` requests, padded to `Bp` rows (the plan's batch: the agreed
CUDA-graph bucket, or the cluster's largest batch when eager; rows beyond `B` are dummy rows in a
dummy slot whose pages are the dummy page):
1. draft: `d_1` from `g_n`; for k = 2..S one head forward of `d_{k-1}` at position `n+k-1`;
2. verify: one target forward of `[x_n, d_1 .. d_S]` at positions `n .. n+S`;
3. accept (greedy: exact match on the device; sampling: rejection sampling) -> `a` drafts + bonus;
4. draft-extend: the head over the `a+1` committed tokens at positions `n+1 .. n+a+1` with the
   target features `f_n .. f_{n+a}` (verify rows `0..a`); its row `a` becomes `g_{n+a+1}`;
5. the slots advance on the device (`n += a+1`, last token, feature); the host reads the accepted
   lengths and tokens once and commits them to the requests.
Rejected tokens need no cleanup: their KV slots are past `n` and the next round overwrites them.
At `S = 0` (no speculation) the round is one target forward of `x_n` and a sampled token.

Every forward of the round is padded (`attention.static_backend`), so the eager path and the CUDA
graph path run the same code; under DP attention every rank runs the same forwards with the same
row counts (an idle rank: all dummy rows), which is what keeps the collectives inside them in
lockstep. Prefill (ragged, `attention_backend`) is padded to the round's agreed token count.
Everything whose shape depends on `S` lives in a `SpecRuntimeState` (one per tier, pre-built).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from workers.attention import ForwardMode, PaddedBatch, StaticBackend, build_metadata
from workers.attention.base import AttentionBackend
from workers.config import EngineConfig
from workers.cuda_graphs import CudaGraphRunner, GraphEntry
from workers.kv_cache import DUMMY_PAGE, KVPool, pages_for
from workers.runtime_state import SpecRuntimeState
from workers.sampling import accept_rejection, sample, target_probs
from workers.scheduler import Request

PHASES = ("logits", "draft", "verify", "extend")


@dataclass
class StepBuffers:
    """The static inputs of one tier's padded forwards (fixed addresses), and its graphs."""

    steps: int
    rows: torch.Tensor       # [Bmax] slot of each batch row
    ids: torch.Tensor        # [Bmax * W] token ids
    pos: torch.Tensor        # [Bmax * W] positions
    feats: torch.Tensor      # [Bmax * W, d] head feature inputs
    page_tab: torch.Tensor   # [Bmax, P] page table of each row
    cached: torch.Tensor     # [Bmax] KV tokens before the forward
    qo_len: torch.Tensor     # [Bmax] real new tokens of each row (0: a dummy row)
    graphs: dict[tuple[str, int], GraphEntry] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = (self.rows, self.ids, self.pos, self.feats, self.page_tab, self.cached,
                   self.qo_len)
        return sum(t.numel() * t.element_size() for t in tensors)


class EagleWorker:
    """Runs the target (and the EAGLE head, unless `head` is None) of one rank.

    Implements `workers.runtime_state.AdaptiveSpecWorker`.
    """

    def __init__(self, target: torch.nn.Module, head: torch.nn.Module | None,
                 config: EngineConfig, backend: AttentionBackend) -> None:
        if config.speculative and head is None:
            raise ValueError("speculative decoding needs a draft head; use --no-spec without one")
        self.target, self.head, self.backend, self.config = target, head, backend, config
        self.device = torch.device(config.device)
        self.static = StaticBackend()
        attn_tp = target.par.attn.size
        self.target_kv = self._pool(target, attn_tp)
        self.draft_kv = self._pool(head, attn_tp) if config.speculative else None
        slots, reach = config.max_batch_size + 1, config.pages_per_request
        self.dummy_slot = config.max_batch_size
        dim, dtype = target.config.hidden_size, next(target.parameters()).dtype
        self.slot_pages = torch.full((slots, reach), DUMMY_PAGE, dtype=torch.int64, device=self.device)
        self.slot_len = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.slot_last = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.slot_feature = torch.zeros(slots, dim, dtype=dtype, device=self.device)
        self.graphs = CudaGraphRunner(self.device) if config.graph_buckets else None
        self.buckets = config.graph_buckets
        self.state: SpecRuntimeState | None = None

    def _pool(self, model: torch.nn.Module, attn_tp: int) -> KVPool:
        """A pool for `model`'s layers holding this rank's KV heads (in the backend's format)."""
        cfg, dtype = model.config, next(model.parameters()).dtype
        head_dim = cfg.head_dim
        kv_format = getattr(self.backend, "kv_format", None)
        if kv_format is not None:  # flashinfer: padded head dim, float16/bfloat16
            head_dim, dtype = kv_format(head_dim, dtype)
        return KVPool(model.num_layers, self.config.pool_pages, self.config.page_size,
                      cfg.num_key_value_heads // attn_tp, head_dim, dtype=dtype, device=self.device)

    @property
    def speculative(self) -> bool:
        return self.head is not None and self.config.speculative

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
        width, dim = steps + 1, self.target.config.hidden_size
        top = max([self.config.max_batch_size, *self.buckets])
        dtype = self.slot_feature.dtype

        def zeros(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=self.device)

        bufs = StepBuffers(steps=steps, rows=zeros(top), ids=zeros(top * width),
                           pos=zeros(top * width), feats=zeros(top * width, dim, dt=dtype),
                           page_tab=zeros(top, self.config.pages_per_request), cached=zeros(top),
                           qo_len=zeros(top))
        nbytes = bufs.nbytes
        if self.graphs is not None:
            before = self.graphs.pool_bytes()
            self._capture(bufs)
            nbytes += self.graphs.pool_bytes() - before
        return SpecRuntimeState(steps=steps, payload=bufs, nbytes=nbytes)

    def apply_runtime_state(self, state: SpecRuntimeState) -> None:
        """Make `state` the one in force (a reference swap: nothing is built or allocated)."""
        self.state = state

    def _phases(self, steps: int) -> list[tuple[str, int]]:
        """(phase, width) of every padded forward a round at `steps` runs."""
        if steps == 0:
            return [("verify", 1)]
        out = [("verify", steps + 1), ("extend", steps + 1), ("logits", 1)]
        return out + ([("draft", 1)] if steps > 1 else [])

    def _capture(self, bufs: StepBuffers) -> None:
        """Capture every phase at every bucket, largest bucket first (start-up only)."""
        bufs.rows.fill_(self.dummy_slot)
        bufs.page_tab.fill_(DUMMY_PAGE)
        bufs.cached.zero_()
        bufs.qo_len.zero_()
        reach = bufs.page_tab.shape[1]
        for bucket in sorted(self.buckets, reverse=True):
            for phase, width in self._phases(bufs.steps):
                body = self._body(bufs, phase, bucket, width, reach)
                name = f"{phase}/steps={bufs.steps}/bucket={bucket}"
                bufs.graphs[(phase, bucket)] = self.graphs.capture_body(name, body)

    # ---- the padded forwards ------------------------------------------------------------------
    def _body(self, bufs: StepBuffers, phase: str, rows: int, width: int,
              reach: int) -> Callable[[], Any]:
        """One padded forward of `rows` rows by `width` tokens over `bufs` (what a graph holds)."""
        n = rows * width

        def attn(pool: KVPool) -> Any:
            meta = PaddedBatch(bufs.page_tab[:rows, :reach], bufs.cached[:rows],
                               bufs.qo_len[:rows], width)
            return self.static.plan(meta, pool)

        def verify() -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.target(bufs.ids[:n], bufs.pos[:n], attn(self.target_kv))
            return hidden, self.target.compute_logits(hidden)

        def extend() -> torch.Tensor:
            return self.head(bufs.ids[:n], bufs.feats[:n], bufs.pos[:n], attn(self.draft_kv))

        def draft() -> tuple[torch.Tensor, torch.Tensor]:
            g = extend()
            return g, self.head.compute_logits(g)

        def logits() -> torch.Tensor:
            return self.head.compute_logits(bufs.feats[:rows])

        return {"verify": verify, "extend": extend, "draft": draft, "logits": logits}[phase]

    def _run(self, phase: str, width: int, bp: int, bucket: int | None, reach: int) -> Any:
        """Replay the graph of `phase` at `bucket`, or run the same body eagerly at `bp` rows."""
        bufs: StepBuffers = self.state.payload
        if bucket is None:
            return self._body(bufs, phase, bp, width, reach)()
        entry = bufs.graphs.get((phase, bucket))
        if entry is None:
            raise RuntimeError(f"no CUDA graph for {phase} at steps={bufs.steps}, bucket {bucket} "
                               f"(captured buckets {list(self.buckets)})")
        return entry.replay()

    # ---- prefill ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, reqs: list[Request], pad_tokens: int, pad_requests: int) -> None:
        """Run new requests' prompts through the target (and the head) and commit their first
        token. Every rank calls it when any rank prefills: `pad_tokens` / `pad_requests` are the
        round's agreed sizes (this rank's rows beyond its own are padding)."""
        lens = [len(r.prompt_ids) for r in reqs]
        total = sum(lens)
        if total > pad_tokens or len(reqs) > pad_requests:
            raise RuntimeError(f"prefill of {len(reqs)} requests / {total} tokens exceeds the "
                               f"agreed {pad_requests} / {pad_tokens}")
        for req in reqs:
            self.slot_pages[req.slot].fill_(DUMMY_PAGE)
            self.slot_pages[req.slot, :len(req.pages)] = torch.tensor(req.pages)
        ps = self.config.page_size
        ids = self._tensor([t for r in reqs for t in r.prompt_ids], pad_tokens)
        pos = self._tensor([i for n in lens for i in range(n)], pad_tokens)
        meta = build_metadata(ForwardMode.EXTEND, [r.pages for r in reqs], [0] * len(reqs), lens,
                              ps, self.device)
        hidden = self.target(ids, pos, self.backend.plan(meta, self.target_kv))
        ends = [sum(lens[:i + 1]) - 1 for i in range(len(reqs))]
        last = self._tensor(ends, pad_requests)
        logits = self.target.compute_logits(hidden[last])
        first = self._pick(logits, reqs)
        slots = self._tensor([r.slot for r in reqs])
        firsts = self._tensor(first)
        for req, token in zip(reqs, first):
            req.commit([token])
        if self.speculative:
            shifted = [t for r, n in zip(reqs, lens) for t in r.prompt_ids[1:n] + [r.output_ids[0]]]
            ids2 = self._tensor(shifted, pad_tokens)
            pos2 = self._tensor([i + 1 for n in lens for i in range(n)], pad_tokens)
            out = self.head(ids2, hidden, pos2, self.backend.plan(meta, self.draft_kv))
            self.slot_feature.index_copy_(0, slots, out[last[:len(reqs)]])
        self.slot_len.index_copy_(0, slots, self._tensor(lens))
        self.slot_last.index_copy_(0, slots, firsts)

    def _tensor(self, values: list[int], pad_to: int | None = None) -> torch.Tensor:
        """`values` (zero-padded to `pad_to`) as an int64 device tensor."""
        pad = [] if pad_to is None else [0] * (pad_to - len(values))
        return torch.tensor(values + pad, dtype=torch.int64).to(self.device)

    def _pick(self, logits: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
        """The next token of each request from its row of `logits` (argmax, or a sample)."""
        tokens = logits.argmax(-1)[:len(reqs)].tolist()
        for b, req in enumerate(reqs):
            if not req.params.greedy:
                p = target_probs(logits[b][None], req.params.temperature, req.params.top_p)
                tokens[b] = int(sample(p, req.generator))
        return tokens

    # ---- the speculative round ------------------------------------------------------------------
    @torch.inference_mode()
    def spec_round(self, reqs: list[Request], batch_pad: int,
                   graph_bucket: int | None = None) -> list[int]:
        """One round at the depth in force over `reqs`, padded to `batch_pad` rows (the plan's
        batch); `graph_bucket` replays the CUDA graphs of that bucket (None: eager). Returns the
        accept lengths (draft tokens accepted, bonus excluded) in the order of `reqs`."""
        steps, width = self.steps, self.steps + 1
        bp = graph_bucket if graph_bucket is not None else batch_pad
        if len(reqs) > bp:
            raise RuntimeError(f"{len(reqs)} requests do not fit the agreed batch of {bp}")
        if graph_bucket is not None and (self.graphs is None or graph_bucket not in self.buckets):
            raise RuntimeError(f"the plan says CUDA graphs at bucket {graph_bucket}, but this "
                               f"worker captured {list(self.buckets)}")
        bufs: StepBuffers = self.state.payload
        reach = self._reach(reqs, bufs, graph_bucket)
        bufs.rows[:bp].copy_(self._tensor([r.slot for r in reqs]
                                          + [self.dummy_slot] * (bp - len(reqs))))
        rows = bufs.rows[:bp]
        real = (rows != self.dummy_slot).to(torch.int64)
        n = self.slot_len[rows]
        bufs.page_tab[:bp].copy_(self.slot_pages[rows])
        drafts, probs = self._draft(reqs, bufs, rows, n, real, bp, graph_bucket, reach)
        tokens_in = torch.cat([self.slot_last[rows][:, None], drafts], dim=1)
        self._fill(bufs, bp, width, tokens_in, n[:, None] + torch.arange(width, device=self.device),
                   cached=n, qo_len=real * width)
        hidden, logits = self._run("verify", width, bp, graph_bucket, reach)
        accept, committed = self._accept(reqs, logits.view(bp, width, -1), drafts, probs, real)
        row_idx = torch.arange(bp, device=self.device)
        if steps > 0:
            self._fill(bufs, bp, width, committed,
                       n[:, None] + 1 + torch.arange(width, device=self.device),
                       cached=n, qo_len=real * (accept + 1), feats=hidden)
            out = self._run("extend", width, bp, graph_bucket, reach)
            self.slot_feature.index_copy_(0, rows, out.view(bp, width, -1)[row_idx, accept])
        self.slot_len.index_copy_(0, rows, n + accept + 1)
        self.slot_last.index_copy_(0, rows, committed[row_idx, accept])
        self.slot_len[self.dummy_slot] = 0
        host = torch.cat([accept[:, None], committed], dim=1)[:len(reqs)].tolist()  # the one read
        for req, row in zip(reqs, host):
            req.accept_lengths.append(row[0])
            req.commit(row[1:row[0] + 2])
        return [row[0] for row in host]

    def _reach(self, reqs: Sequence[Request], bufs: StepBuffers, bucket: int | None) -> int:
        """Pages of KV each row may read: the captured reach for graphs, else what this batch
        needs (attention is local to the rank, so eager ranks may differ)."""
        if bucket is not None or not reqs:
            return bufs.page_tab.shape[1] if bucket is not None else 1
        longest = max(r.num_tokens for r in reqs) + self.steps
        return min(pages_for(longest, self.config.page_size), bufs.page_tab.shape[1])

    def _fill(self, bufs: StepBuffers, bp: int, width: int, ids: torch.Tensor, pos: torch.Tensor,
              cached: torch.Tensor, qo_len: torch.Tensor, feats: torch.Tensor | None = None) -> None:
        """Write one padded forward's inputs into the tier's static buffers."""
        rows = bp * width
        bufs.ids[:rows].copy_(ids.reshape(-1))
        bufs.pos[:rows].copy_(pos.reshape(-1))
        bufs.cached[:bp].copy_(cached)
        bufs.qo_len[:bp].copy_(qo_len)
        if feats is not None:
            bufs.feats[:rows].copy_(feats.reshape(rows, -1))

    def _draft(self, reqs: list[Request], bufs: StepBuffers, rows: torch.Tensor, n: torch.Tensor,
               real: torch.Tensor, bp: int, bucket: int | None, reach: int,
               ) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
        """`steps` draft tokens per row [Bp, S] (chain drafting) and, for sampling requests, the
        draft distributions they were drawn from (by row)."""
        steps = self.steps
        drafts: list[torch.Tensor] = []
        probs: dict[int, list[torch.Tensor]] = {}
        if steps == 0:
            return torch.zeros(bp, 0, dtype=torch.int64, device=self.device), probs
        g = self.slot_feature[rows]
        bufs.feats[:bp].copy_(g)
        logits = self._run("logits", 1, bp, bucket, reach)
        for k in range(1, steps + 1):
            if k > 1:
                self._fill(bufs, bp, 1, drafts[-1], n + k - 1, cached=n + k - 2, qo_len=real,
                           feats=g)
                g, logits = self._run("draft", 1, bp, bucket, reach)
            drafts.append(self._draft_tokens(logits, reqs, probs))
        return torch.stack(drafts, dim=1), probs

    def _draft_tokens(self, logits: torch.Tensor, reqs: list[Request],
                      probs: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """One draft token per row: argmax (on the device), or drawn from q for sampling rows."""
        tokens = logits.argmax(-1)
        sampled = [b for b, r in enumerate(reqs) if not r.params.greedy]
        if not sampled:
            return tokens
        picks = tokens.tolist()
        for b in sampled:
            req = reqs[b]
            q = target_probs(logits[b][None], req.params.temperature, req.params.top_p)
            picks[b] = int(sample(q, req.generator))
            probs.setdefault(b, []).append(q[0])
        return torch.tensor(picks, dtype=torch.int64, device=self.device)

    def _accept(self, reqs: list[Request], logits: torch.Tensor, drafts: torch.Tensor,
                probs: dict[int, list[torch.Tensor]], real: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted drafts [Bp], committed tokens [Bp, W]): row b commits `committed[b, :a+1]`.
        Greedy rows on the device: the target's argmax matches the drafts for `a` tokens, and the
        committed tokens are exactly the argmax row. Sampling rows: rejection sampling."""
        argmax = logits.argmax(-1)
        steps = drafts.shape[1]
        if steps:
            accept = (drafts == argmax[:, :steps]).to(torch.int64).cumprod(dim=1).sum(dim=1)
        else:
            accept = torch.zeros_like(real)
        accept = accept * real
        sampled = [b for b, r in enumerate(reqs) if not r.params.greedy]
        if not sampled:
            return accept, argmax
        accept_host, committed_host = accept.tolist(), argmax.tolist()
        draft_host = drafts.tolist()
        for b in sampled:
            req = reqs[b]
            p = target_probs(logits[b], req.params.temperature, req.params.top_p)
            if steps == 0:
                a, toks = 0, [int(sample(p[:1], req.generator))]
            else:
                a, toks = accept_rejection(draft_host[b], torch.stack(probs[b]), p, req.generator)
            accept_host[b] = a
            committed_host[b][:len(toks)] = toks
        return (torch.tensor(accept_host, dtype=torch.int64, device=self.device),
                torch.tensor(committed_host, dtype=torch.int64, device=self.device))
