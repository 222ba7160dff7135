"""The settings of the engine commands (`generate`, `serve`), typed: what the command line asks
for, parsed once at the CLI (`workers.cli`, `workers.server.cli`) and handed whole to the library
(`workers.launch`, `workers.loading`, `workers.server.launch`), which never sees an argparse
namespace.

Each setting is declared once, as a field (`workers.options.setting`: name, type, default, the
help of its flag, its check); the parsers' flags (`workers.options.add_flags`) and the settings
of a parsed command line (`from_flags`) are derived from the declarations. The engine's own
settings are declared on the engine's configuration (`workers.config.EngineOptions`, carried in
`LaunchSettings.engine`); the choices come from where their meaning lives (the policies from
`adaptive_dist.config`, the dtypes from `workers.loading`, the backends, scatters and MoE modes
through `EngineOptions`).

Importing this module imports no torch (the parsers are built from it).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from adaptive_dist.cli import seconds
from adaptive_dist.config import ADAPTIVE_POLICIES
from workers.config import EngineOptions
from workers.loading import DEFAULT_MODEL, DTYPES
from workers.options import check_flags, nested, setting

if TYPE_CHECKING:
    from adaptive_dist.config import AdaptiveConfig
    from workers.model_files import ModelPaths
    from workers.sampling import SamplingParams


def fraction(text: str) -> float:
    """argparse type of `--gpu-memory-utilization`: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a fraction in (0, 1] of the GPU's "
                                         f"total memory")
    return value


def byte_count(text: str) -> int:
    """argparse type of `--kv-cache-memory`: bytes, or a number with K/M/G/T."""
    from workers.memory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


@dataclass(frozen=True)
class ClusterShape:
    """The cluster's degrees as given: `--dp`, `--attn-tp`, `--tp` (`--tp N` is the shorthand of
    `--dp 1 --attn-tp N`: plain tensor parallelism). The MLP's group, `mlp_tp`, is the world."""

    dp: int = setting(
        1, help="DP-attention replicas (each owns its requests and KV cache; default: 1)")
    attn_tp: Optional[int] = setting(
        None, help="ranks that split one replica's attention (default: world / dp)")
    tp: Optional[int] = setting(
        None, metavar="N",
        help="plain tensor parallelism over N ranks (the same as --dp 1 --attn-tp N)")

    def resolve(self, world: int) -> tuple[int, int]:
        """(dp, attn_tp) for a job of `world` ranks; `ValueError` naming the flags."""
        if self.tp is not None:
            if self.dp != 1 or self.attn_tp is not None:
                raise ValueError("--tp N is plain tensor parallelism (--dp 1 --attn-tp N); do not "
                                 "combine it with --dp or --attn-tp")
            dp, attn_tp = 1, self.tp
        else:
            dp = self.dp
            if dp < 1:
                raise ValueError(f"--dp {dp}: must be >= 1")
            attn_tp = self.attn_tp if self.attn_tp is not None else max(1, world // dp)
        if attn_tp < 1:
            raise ValueError(f"--attn-tp {attn_tp}: must be >= 1")
        if dp * attn_tp != world:
            raise ValueError(
                f"--dp {dp} x --attn-tp {attn_tp} = {dp * attn_tp} ranks, but this job has "
                f"{world}; launch with: torchrun --nproc-per-node {dp * attn_tp} -m adaptive_dist "
                f"... --dp {dp} --attn-tp {attn_tp}")
        return dp, attn_tp


@dataclass(frozen=True)
class SpecChoice:
    """The decoding mode as given: `--steps K`, `--adaptive [--policy P] [--config FILE]` or
    `--no-spec`."""

    steps: Optional[int] = setting(
        None, one_of="mode", metavar="K",
        help="static speculation with K draft steps (default: 3)")
    adaptive: bool = setting(
        False, one_of="mode",
        help="adaptive draft depth over candidate tiers, chosen by --policy (default ema, the "
             "acceptance ladder; goodput: expected tokens per measured round cost, it may turn "
             "speculation off)")
    no_spec: bool = setting(False, one_of="mode", help="plain decoding with the target")
    policy: Optional[str] = setting(
        None, choices=ADAPTIVE_POLICIES,   # the registered adaptive policies, read when used
        help="with --adaptive, one of the registered adaptive policies: %(choices)s (default: "
             "ema; docs/policy.md)")
    config: Optional[str] = setting(
        None, metavar="FILE", help="JSON file of adaptive settings (--adaptive only)")
    per_request: bool = setting(
        False,
        help="with --adaptive: per-request budgets — every request drafts what its own "
             "acceptance pays for, inside a round shape (draft forwards, verify tokens) agreed "
             "every round; implies --policy goodput")
    """`--per-request`: per-request budgets (goodput)."""
    model_costs: Optional[str] = setting(
        None, metavar="FILE",
        help="with --adaptive --policy goodput: decide on this cost table file "
             "(docs/data/cost_tables/*.json) instead of measuring one at start-up (a CPU run "
             "priced as the GPU the table was measured on)")
    """`--model-costs FILE`: decide on this cost table instead of measuring one at start-up."""
    tree_candidates: Optional[str] = setting(
        None, metavar="SxKxN[,SxKxN...]",
        help="with --adaptive: draft trees (S steps, top-k K, N verify tokens per request) among "
             "the goodput policy's candidates beside its chain depths, each priced from the "
             "cost table and chosen by expected tokens per cost (docs/policy.md, \"Draft trees\");"
             " implies --policy goodput; e.g. 3x2x6,5x4x8,7x2x12,7x4x16")
    """`--tree-candidates`: goodput's `tree_candidates` (issue 35)."""

    def build(self) -> "AdaptiveConfig":
        """The speculative settings asked for (static depth 0 for `--no-spec`); `ValueError` /
        `ConfigError` naming the flag or key."""
        from adaptive_dist.config import load_config
        from workers.config import check_depth, no_spec

        if self.no_spec:
            if self.config is not None:
                raise ValueError("--config applies to --adaptive only, not to --no-spec")
            return no_spec()
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps {self.steps}: must be >= 1 (use --no-spec for no "
                             f"speculation)")
        if self.policy is not None and not self.adaptive:
            raise ValueError(f"--policy {self.policy} applies to --adaptive only")
        if self.per_request and not self.adaptive:
            raise ValueError("--per-request applies to --adaptive (with the goodput policy)")
        if self.per_request and self.policy not in (None, "goodput"):
            raise ValueError(f"--per-request needs --policy goodput (per-request budgets are "
                             f"priced by the round cost), not --policy {self.policy}")
        if self.model_costs is not None and not self.adaptive:
            raise ValueError("--model-costs applies to --adaptive --policy goodput only")
        if self.tree_candidates is not None and not self.adaptive:
            raise ValueError("--tree-candidates applies to --adaptive (with the goodput policy); "
                             "a static tree is --speculative-eagle-topk / "
                             "--speculative-num-draft-tokens")
        if self.tree_candidates is not None and self.policy not in (None, "goodput"):
            raise ValueError(f"--tree-candidates needs --policy goodput (trees are priced by the "
                             f"round cost), not --policy {self.policy}")
        default = "goodput" if self.per_request or self.tree_candidates is not None else "ema"
        policy = (self.policy or default) if self.adaptive else "static"
        spec = load_config(self.config, policy, initial_steps=self.steps)
        if self.per_request:
            spec = spec.replace(per_request=True)
        if self.tree_candidates is not None:
            from adaptive_dist.config import ConfigError

            try:
                spec = spec.replace(tree_candidates=[
                    t.strip() for t in self.tree_candidates.split(",") if t.strip()])
            except ConfigError as err:
                raise ValueError(f"--tree-candidates {self.tree_candidates}: {err}") from None
        if self.model_costs is not None:
            from adaptive_dist.cost_tables import load_model_costs, with_model_costs

            spec = with_model_costs(spec, self.model_costs)
            if spec.policy == "goodput" and spec.tree_candidates and spec.verify_cost is None:
                verify = load_model_costs(self.model_costs)[1]
                if verify is None:
                    raise ValueError(f"--model-costs {self.model_costs}: draft trees are priced "
                                     f"with the verify forward's cost (agreed_verify_cost_ms), "
                                     f"which the file lacks")
                spec = spec.replace(verify_cost=verify)
        check_depth(spec.max_steps, f"--steps {self.steps}" if self.steps is not None
                    else "candidate_steps")
        return spec


@dataclass(frozen=True)
class LaunchSettings:
    """What an engine command's flags ask of the engine and its cluster (`generate` and `serve`
    share them: `workers.cli.add_engine_arguments`). Plain values as given; `check`,
    `ClusterShape.resolve` and `SpecChoice.build` validate them, on every rank, at start-up."""

    spec: SpecChoice = nested(SpecChoice)
    round_log: Optional[str] = setting(
        None, metavar="FILE",
        help="write one JSON line per rank per round (shape, each request's draft and accepted "
             "tokens; docs/cli.md); with several ranks each writes FILE with .rank<R> before its "
             "suffix")
    """`--round-log FILE`: one JSON line per rank per round (`workers.round_log`)."""
    model: str = setting(
        str(DEFAULT_MODEL), metavar="DIR",
        help="the target: a Hugging Face directory (config.json, weights, tokenizer.json; "
             "Llama, Qwen2, Qwen3, and the MoE families Qwen3-MoE, Mixtral, Qwen2-MoE), or a "
             "directory holding target/ and eagle/ (default: the bundled tiny pair)")
    """`--model`: a model directory, or one holding target/ and eagle/."""
    draft_model: Optional[str] = setting(
        None, metavar="DRAFT_DIR",
        help="the draft head: an EAGLE (our layout or the EAGLE project's) or EAGLE-3 (SGLang's "
             "or the speculators library's layout) head directory (default: DIR/eagle when "
             "--model DIR holds target/)")
    shape: ClusterShape = nested(ClusterShape)
    device: Optional[str] = setting(
        None, choices=("cpu", "cuda"),
        help="default: cuda for --attention-backend flashinfer, else cpu")
    """`--device` as given (None: see `resolved_device`)."""
    engine: EngineOptions = nested(EngineOptions)
    """The engine's own settings (`workers.config.EngineOptions`: a flag each)."""
    eager: bool = setting(
        False,
        help="no CUDA graphs (on a CUDA device speculative rounds replay graphs per tier and "
             "batch bucket by default)")
    overlap: str = setting(
        "auto", choices=("auto", "on", "off"),
        help="launch round r+1 before reading round r, so the host's bookkeeping runs while the "
             "GPU computes (auto, the default: on with CUDA)")
    timeout: float = setting(
        60.0, parse=seconds, metavar="S",
        help="seconds a collective may take before the job stops with an error; a finite "
             "number > 0 (default: 60)")
    """`--timeout`: seconds a collective may take."""
    dtype: str = setting(
        "auto", choices=DTYPES,
        help="the weights' and the KV cache's dtype: auto (the default) loads a checkpoint in "
             "its own dtype (config.json's torch_dtype) on CUDA and in float32 on the CPU")
    """`--dtype`: auto (the checkpoint's torch_dtype on CUDA, float32 on the CPU), bfloat16,
    float16 or float32 (`workers.loading.resolve_dtype`)."""
    gpu_memory_utilization: Optional[float] = setting(
        None, parse=fraction, metavar="F",
        help="the fraction of the GPU's total memory this engine may use; the KV pool gets what "
             "is left after the weights, the activations and the CUDA graphs, at most what "
             "--max-batch-size full contexts need (default: that pool); CUDA only")
    """`--gpu-memory-utilization F`: the fraction of the GPU's memory this engine may use; the
    KV pool gets what is left (`workers.memory`). CUDA only."""
    kv_cache_memory: Optional[int] = setting(
        None, parse=byte_count, metavar="BYTES",
        help="the KV pool's size per rank, in bytes or with a K, M, G or T suffix (powers of "
             "1024), at most what --max-batch-size full contexts need (default: that pool); not "
             "with --gpu-memory-utilization")
    """`--kv-cache-memory BYTES`: the KV pool's bytes per rank (`workers.memory`)."""

    @property
    def resolved_device(self) -> str:
        """`--device`, else cuda for `--attention-backend flashinfer`, else cpu."""
        return self.device or ("cuda" if self.engine.attention_backend == "flashinfer"
                               else "cpu")

    def check(self) -> None:
        """`ValueError` naming the flag for a device this machine lacks, or a value its
        declaration's check refuses (`workers.options.check_flags`: a size out of range, a
        choice not allowed)."""
        import torch

        device = self.resolved_device
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: this torch build or machine has no CUDA device; "
                             "use --device cpu")
        if self.engine.attention_backend == "flashinfer" and device != "cuda":
            raise ValueError("--attention-backend flashinfer needs --device cuda")
        check_flags(self)
        tree = self.engine.speculative_eagle_topk > 1 or self.engine.speculative_num_draft_tokens
        if tree and self.spec.no_spec:
            raise ValueError("--speculative-eagle-topk / --speculative-num-draft-tokens: draft "
                             "trees speculate; not with --no-spec")
        if self.gpu_memory_utilization is not None:
            from workers.memory import check_utilization

            if self.kv_cache_memory is not None:
                raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization} and "
                                 f"--kv-cache-memory {self.kv_cache_memory}: give one (the "
                                 f"second sizes the KV pool outright)")
            check_utilization(self.gpu_memory_utilization, device)
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"--kv-cache-memory {self.kv_cache_memory}: must be > 0 bytes")
        if self.round_log is not None:
            from pathlib import Path

            parent = Path(self.round_log).resolve().parent
            if not parent.is_dir() or Path(self.round_log).is_dir():
                raise ValueError(f"--round-log {self.round_log}: not a file in an existing "
                                 f"directory")

    def model_paths(self) -> "ModelPaths":
        """The target and draft directories `--model` / `--draft-model` name; `ValueError`
        naming the flag when one does not exist."""
        from workers.model_files import ModelPaths

        return ModelPaths.resolve(self.model, self.draft_model)


@dataclass(frozen=True)
class SamplingFlags:
    """`generate`'s sampling flags as given (`params` validates them)."""

    temperature: float = setting(0.0, help="0 = greedy (default)")
    top_p: float = setting(1.0, help="nucleus sampling mass, in (0, 1] (default: 1.0)")
    max_new_tokens: int = setting(
        128, metavar="N",
        help="tokens to generate per prompt at most, >= 1; a prompt also ends at the model's "
             "end-of-sequence token (default: 128)")

    def params(self, stop_token_ids: tuple[int, ...] = ()) -> "SamplingParams":
        """The `SamplingParams` of every prompt; `ValueError` naming the flag."""
        import math

        from workers.sampling import SamplingParams

        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"--temperature {self.temperature}: must be a finite number >= 0 "
                             "(0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens}: must be an integer >= 1")
        return SamplingParams(temperature=self.temperature, top_p=self.top_p,
                              max_new_tokens=self.max_new_tokens,
                              stop_token_ids=stop_token_ids)


@dataclass(frozen=True)
class GenerateSettings:
    """The `generate` command: the engine's settings, the prompts, sampling and output."""

    prompt: Optional[str] = setting(None, one_of="prompts", required=True, help="one prompt")
    """`--prompt` (one of `prompt`, `prompts`)."""
    prompts: Optional[str] = setting(
        None, one_of="prompts", required=True, metavar="FILE.jsonl",
        help='one {"prompt": "...", "dp_rank": k (optional)} per line')
    """`--prompts FILE.jsonl`."""
    launch: LaunchSettings = nested(LaunchSettings)
    sampling: SamplingFlags = nested(SamplingFlags)
    seed: int = setting(0, help="prompt i samples with seed S+i (default: 0)")
    json: bool = setting(
        False, help="print one JSON object (outputs and statistics) as the last line")


@dataclass(frozen=True)
class ServeSettings:
    """The `serve` command: the engine's settings and the HTTP frontend's (the API key travels in
    the frontend's environment, never here)."""

    launch: LaunchSettings
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 256
    routing: str = "shortest"
    served_model_name: Optional[str] = None
    max_model_len: Optional[int] = None
    chat_template: Optional[str] = None
    """An absolute path (the parser resolves and checks it)."""
    max_body_size: int = 32 << 20
    """Bytes a request body may hold; a bigger one is a 413 before it is read."""
    header_timeout: float = 10.0
    """Seconds from a request's first byte to the end of its headers."""
    body_timeout: float = 60.0
    """Seconds from a request's headers to the end of its body."""
    timeout_keep_alive: float = 5.0
    """Seconds a connection without a request in progress may stay silent."""
    max_connections: Optional[int] = None
    """Open HTTP connections at most (None: what the file limit allows)."""
    chat_template_timeout: float = 5.0
    """Seconds one chat template render may take."""

    def check(self) -> None:
        """`ValueError` naming the flag."""
        import math

        if self.max_queue < 0:
            raise ValueError(f"--max-queue {self.max_queue}: must be >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port}: must be in [0, 65535] (0: any free port)")
        if self.max_body_size < 1024:
            raise ValueError(f"--max-body-size {self.max_body_size}: must be at least 1024 "
                             "bytes")
        for flag, value in (("--header-timeout", self.header_timeout),
                            ("--body-timeout", self.body_timeout),
                            ("--timeout-keep-alive", self.timeout_keep_alive),
                            ("--chat-template-timeout", self.chat_template_timeout)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{flag} {value}: must be a finite number of seconds > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections {self.max_connections}: must be >= 1")
