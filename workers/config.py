"""`EngineConfig`: every size and switch of one engine, built once and passed whole.

Each setting is declared once, here (`workers.options.setting`: name, type, default, check, and
the help of its flag when the command line sets it). `EngineOptions` holds the settings the
engine commands take as flags (`generate` and `serve` derive their flags from it and carry the
values as given in `LaunchSettings.engine`); `EngineConfig` adds what start-up derives (the
speculative settings, the cluster's degrees, the device, the sizes) and checks every value.

The speculative settings (`spec`: policy, depth tiers, graph buckets) are the adaptive layer's
`AdaptiveConfig`; plain decoding is the static policy at depth 0. Everything a round's shapes
depend on is derived here, in one place (`max_steps`, KV pages per request, pool size, buckets).

Importing this module imports no torch (the parsers read the declarations).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from adaptive_dist.config import AdaptiveConfig, load_config
from adaptive_dist.policy import pick_bucket
from adaptive_dist.shape import TreeShape, token_ladder
from workers.attention import BACKENDS
from workers.model.config import MOE_PARALLEL
from workers.model.parallel import SCATTERS
from workers.options import check_values, setting, values

MAX_STEPS_LIMIT = 32
"""The deepest draft a run may ask for (a verify forward of `steps + 1` tokens per request)."""


def check_depth(max_steps: int, where: str | None = None) -> None:
    """`ValueError` when a draft depth of `max_steps` is beyond `MAX_STEPS_LIMIT` (`where`: the
    flag or key that asked for it, named first)."""
    if max_steps > MAX_STEPS_LIMIT:
        named = f"{where}: " if where else ""
        raise ValueError(f"{named}draft depth {max_steps} is beyond the maximum of "
                         f"{MAX_STEPS_LIMIT} steps")


def check_tree(config: "EngineConfig") -> None:
    """`ValueError` naming the flag for a draft tree the engine does not run: a tree needs the
    static policy (`--steps`), the torch attention backend and
    `--speculative-num-draft-tokens`; top-k 1 is the chain (N = --steps + 1)."""
    k, n = config.speculative_eagle_topk, config.speculative_num_draft_tokens
    from adaptive_dist.policy.tree import trees_of

    if config.spec.adaptive and trees_of(config.spec):
        if k != 1 or n:
            raise ValueError(f"--speculative-eagle-topk {k} / --speculative-num-draft-tokens "
                             f"{n}: a static tree; with --adaptive the trees are the goodput "
                             f"policy's tree_candidates (not both)")
        if config.attention_backend != "torch":
            raise ValueError(f"tree_candidates: draft trees need --attention-backend torch (the "
                             f"{config.attention_backend} backend's tree mask is not "
                             f"implemented)")
    if k == 1:
        if n not in (0, config.max_steps + 1):
            raise ValueError(f"--speculative-num-draft-tokens {n} with --speculative-eagle-topk 1:"
                             f" top-k 1 is the chain, which verifies --steps + 1 = "
                             f"{config.max_steps + 1} tokens")
        return
    spec = config.spec
    if spec.adaptive or spec.per_request:
        raise ValueError(f"--speculative-eagle-topk {k}: draft trees run at a static depth "
                         f"(--steps); --adaptive and --per-request are not implemented with them")
    if n == 0:
        raise ValueError(f"--speculative-eagle-topk {k} needs --speculative-num-draft-tokens N "
                         f"(the tokens each request verifies, the root included)")
    if config.attention_backend != "torch":
        raise ValueError(f"--speculative-eagle-topk {k}: draft trees need --attention-backend "
                         f"torch (the {config.attention_backend} backend's tree mask is not "
                         f"implemented)")
    TreeShape(spec.initial_steps, k, n)


def no_spec() -> AdaptiveConfig:
    """The speculative settings of plain decoding: the static policy at depth 0."""
    return load_config(None, "static", initial_steps=0)


@dataclass(frozen=True)
class EngineOptions:
    """The engine's settings the engine commands take as flags, each declared once (its flag is
    ``--`` and its name with ``-``). As given: `EngineConfig` checks them, and
    `LaunchSettings.check` names the flag of a bad one."""

    attention_backend: str = setting(
        "torch", choices=BACKENDS,
        help="attention of the ragged prefill forwards, those beyond --padded-prefill-tokens "
             "(flashinfer needs a CUDA GPU; default: torch)")
    """Attention of the ragged forwards (prefill): torch or flashinfer."""
    padded_prefill_tokens: int = setting(
        4096, minimum=0, metavar="N",
        help="a prefill of at most N token slots (requests bucket x longest-prompt bucket) runs "
             "padded, as a CUDA graph per shape (0: every prefill ragged; default: 4096)")
    """A prefill of at most this many token slots (requests bucket x longest-prompt bucket) runs
    padded, as a CUDA graph per shape with `cuda_graphs`; larger ones run ragged through
    `attention_backend` (0: every prefill ragged)."""
    catchup_rounds: int = setting(
        32, minimum=1, metavar="N",
        help="at depth 0 (a goodput policy's plain rounds) the draft head's cache lags up to N "
             "rounds, then one head forward catches it up (default: 32)")
    """With a draft head and a depth-0 tier: depth-0 rounds the head's cache may lag behind the
    target's before one head forward over them catches it up (the lag ring holds that many
    tokens and target features per slot; see `workers.worker.draft_lag`)."""
    defer_prefill_width: int = setting(
        256, minimum=0, metavar="N",
        help="at depth 0 with a draft head, a padded prefill whose longest prompt fits N token "
             "slots leaves the head's part to the next catch-up (0: never; default: 256)")
    """With a draft head and a depth-0 tier: a padded prefill run at depth 0 whose width (the
    longest prompt's bucket, a power of two >= 32) is at most this many tokens skips the head; the
    prompt's head inputs (tokens and target features) wait in a per-slot buffer of the widest
    such width and the head runs over them with the next catch-up of the draft cache, one forward
    for every prompt admitted since the last (0: the head always runs in the prefill). The buffer
    holds `max_batch_size + 1` slots x this width of features (`target.feature_size` each)."""
    max_batch_size: int = setting(
        16, minimum=1, metavar="B", help="requests per replica at once (default: 16)")
    """Requests one rank runs at once."""
    mlp_scatter: str = setting(
        "reduce_scatter", choices=SCATTERS,
        help="how MLP outputs return to the DP replicas (the same values; default: "
             "reduce_scatter)")
    """How the MLP output goes back to the replicas (see workers.model.parallel)."""
    moe_parallel: str = setting(
        "tp", choices=MOE_PARALLEL,
        help="a MoE target's experts: every rank a slice of every expert's width (tp), or "
             "E/world whole experts per rank (ep); the same collectives either way "
             "(default: tp)")
    """How a MoE target's experts split over the ranks: tp (width) or ep (whole experts); see
    workers.model.moe."""
    speculative_eagle_topk: int = setting(
        1, minimum=1, metavar="K",
        help="draft trees (EAGLE-2): each draft step expands the K most likely children of the "
             "K best nodes by cumulative draft log-probability (1: a chain; default: 1)")
    """Top-k of a draft tree (1: the chain); see `adaptive_dist.shape.TreeShape`."""
    speculative_num_draft_tokens: int = setting(
        0, minimum=0, metavar="N",
        help="with --speculative-eagle-topk K > 1: tokens each request verifies per round, its "
             "last token and the tree's N-1 best nodes (0: --steps + 1, the chain's; default: 0)")
    """Verify tokens per request of a draft tree, the root included (0: the chain's S + 1)."""


@dataclass(frozen=True)
class EngineConfig(EngineOptions):
    """Sizes and switches of one engine (identical on every rank; agreed at start-up): the
    `EngineOptions` and what start-up derives."""

    spec: AdaptiveConfig = field(default_factory=no_spec)
    """Policy, depth tiers and CUDA-graph buckets (static depth 0: no speculation)."""
    max_context_len: int = setting(2048, minimum=1)
    """Prompt + generated tokens of one request."""
    page_size: int = setting(16, minimum=1)
    """Tokens per KV page."""
    num_pages: int | None = None
    """KV pages per pool (dummy page included); None: room for max_batch_size full contexts."""
    device: str = "cpu"
    cuda_graphs: bool = False
    """Capture the speculative round's forwards per (depth, batch bucket) (CUDA only)."""
    dp: int = setting(1, minimum=1)
    """DP-attention replicas; world = dp x attn_tp."""
    attn_tp: int = setting(1, minimum=1)
    """Ranks that split one replica's attention."""
    overlap: bool = False
    """Launch round r+1 before reading round r's results (the host's work of a round runs while
    the device computes the next one); see `workers.engine`."""

    def __post_init__(self) -> None:
        check_values(self)
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages}: must be >= 2 (one is the dummy page)")
        check_depth(self.max_steps)
        if self.max_steps + 2 > self.max_context_len:
            raise ValueError(f"draft depth {self.max_steps} does not fit a context of "
                             f"{self.max_context_len} tokens")
        if self.speculative:
            check_tree(self)

    @classmethod
    def from_options(cls, options: EngineOptions, **derived: Any) -> "EngineConfig":
        """The configuration of `options` (as the command line gave them) and what start-up
        derived (`derived` replaces an option of the same name: generate's batch size)."""
        return cls(**{**values(options), **derived})

    # ---- derived ------------------------------------------------------------------------------
    @property
    def max_steps(self) -> int:
        """The deepest tier a run may use (0: no speculation)."""
        return self.spec.max_steps

    @property
    def speculative(self) -> bool:
        return self.max_steps > 0

    @property
    def tree(self) -> TreeShape | None:
        """The draft tree every round drafts (`--speculative-eagle-topk` > 1), None: chains."""
        if not self.speculative or self.speculative_eagle_topk == 1:
            return None
        return TreeShape(self.spec.initial_steps, self.speculative_eagle_topk,
                         self.speculative_num_draft_tokens)

    @property
    def world_size(self) -> int:
        return self.dp * self.attn_tp

    @property
    def max_kv_tokens(self) -> int:
        """The most KV tokens one request may hold (context + the deepest draft's overshoot, and
        with `overlap` one more round's, run before the host knows the request finished)."""
        return self.max_context_len + self.round_overshoot

    @property
    def pages_per_request(self) -> int:
        from workers.kv_cache import pages_for

        return pages_for(self.max_kv_tokens, self.page_size)

    @property
    def pool_pages(self) -> int:
        """Pages in each KV pool (the dummy page included)."""
        return self.num_pages or self.max_batch_size * self.pages_per_request + 1

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """Buckets to capture: the configured ones up to the smallest that holds the batch."""
        if not self.cuda_graphs:
            return ()
        buckets = sorted(self.spec.graph_buckets)
        top = pick_bucket(self.max_batch_size, buckets) or buckets[-1]
        return tuple(b for b in buckets if b <= top)

    @property
    def verify_ladder(self) -> tuple[int, ...]:
        """The verify forward's token rungs (`adaptive_dist.shape.token_ladder`), up to the first
        that holds every row of the largest padded batch (a full batch, or the largest graph
        bucket) verifying the deepest tier's window: the shapes a round may take (one target
        graph each with `cuda_graphs`)."""
        rows = max(self.max_batch_size, *self.graph_buckets) if self.graph_buckets else \
            self.max_batch_size
        return token_ladder(rows * (self.max_steps + 1))

    @property
    def mode(self) -> str:
        """A short description of the decoding mode (for reports, /v1/models and logs)."""
        spec = self.spec
        if not self.speculative:
            return "no speculation"
        if spec.adaptive:
            return (f"adaptive ({spec.policy} over {list(spec.candidate_steps)}, "
                    f"start {spec.initial_steps})")
        return f"static steps={spec.initial_steps}"

    @property
    def round_overshoot(self) -> int:
        """KV positions a request may write past its last token: a round writes up to
        `max_steps + 1` beyond it, and with `overlap` the round launched before the host read
        that the request finished writes as many again."""
        return (self.max_steps + 1) * (2 if self.overlap else 1)

    def kv_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        """KV tokens a request may ever hold (what admission reserves)."""
        return prompt_len + max_new_tokens + self.round_overshoot

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every setting (for the start-up agreement and the run report)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "spec"}
        out["spec"] = self.spec.to_dict()
        return out
