"""The settings of the engine commands (`generate`, `serve`), typed: what the command line asks
for, parsed once at the CLI (`workers.cli`, `workers.server.cli`) and handed whole to the library
(`workers.launch`, `workers.loading`, `workers.server.launch`), which never sees an argparse
namespace.

Importing this module imports only the standard library (the parsers use its choices).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from adaptive_dist.config import AdaptiveConfig
    from workers.model_files import ModelPaths
    from workers.sampling import SamplingParams

ATTENTION_BACKENDS = ("torch", "flashinfer")
"""Attention of the ragged forwards (prefill): `--attention-backend`, `EngineConfig.attention_backend`."""
MLP_SCATTERS = ("reduce_scatter", "all_reduce")
"""How MLP outputs return to the DP replicas: `--mlp-scatter`, `ModelParallel.scatter`."""
DTYPES = ("auto", "bfloat16", "float16", "float32")
"""The weights' (and so the KV cache's) dtype: `--dtype` (`workers.loading.resolve_dtype`)."""


@dataclass(frozen=True)
class ClusterShape:
    """The cluster's degrees as given: `--dp`, `--attn-tp`, `--tp` (`--tp N` is the shorthand of
    `--dp 1 --attn-tp N`: plain tensor parallelism). The MLP's group, `mlp_tp`, is the world."""

    dp: int = 1
    attn_tp: Optional[int] = None
    tp: Optional[int] = None

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

    steps: Optional[int] = None
    adaptive: bool = False
    no_spec: bool = False
    policy: Optional[str] = None
    config: Optional[str] = None
    per_request: bool = False
    """`--per-request`: per-request budgets (goodput)."""
    model_costs: Optional[str] = None
    """`--model-costs FILE`: decide on this cost table instead of measuring one at start-up."""

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
        default = "goodput" if self.per_request else "ema"
        policy = (self.policy or default) if self.adaptive else "static"
        spec = load_config(self.config, policy, initial_steps=self.steps)
        if self.per_request:
            spec = spec.replace(per_request=True)
        if self.model_costs is not None:
            from adaptive_dist.cost_tables import with_model_costs

            spec = with_model_costs(spec, self.model_costs)
        check_depth(spec.max_steps, f"--steps {self.steps}" if self.steps is not None
                    else "candidate_steps")
        return spec


@dataclass(frozen=True)
class LaunchSettings:
    """What an engine command's flags ask of the engine and its cluster (`generate` and `serve`
    share them: `workers.cli.add_engine_arguments`). Plain values as given; `check`,
    `ClusterShape.resolve` and `SpecChoice.build` validate them, on every rank, at start-up."""

    model: Optional[str] = None
    """`--model`: a model directory, or one holding target/ and eagle/ (None: the bundled pair)."""
    draft_model: Optional[str] = None
    shape: ClusterShape = field(default_factory=ClusterShape)
    spec: SpecChoice = field(default_factory=SpecChoice)
    device: Optional[str] = None
    """`--device` as given (None: see `resolved_device`)."""
    attention_backend: str = "torch"
    padded_prefill_tokens: int = 4096
    catchup_rounds: int = 32
    defer_prefill_width: int = 256
    max_batch_size: int = 16
    eager: bool = False
    overlap: str = "auto"
    mlp_scatter: str = "reduce_scatter"
    moe_parallel: str = "tp"
    timeout: float = 60.0
    """`--timeout`: seconds a collective may take."""
    round_log: Optional[str] = None
    """`--round-log FILE`: one JSON line per rank per round (`workers.round_log`)."""
    dtype: str = "auto"
    """`--dtype`: auto (the checkpoint's torch_dtype on CUDA, float32 on the CPU), bfloat16,
    float16 or float32 (`workers.loading.resolve_dtype`)."""
    gpu_memory_utilization: Optional[float] = None
    """`--gpu-memory-utilization F`: the fraction of the GPU's memory this engine may use; the
    KV pool gets what is left (`workers.memory`). CUDA only."""
    kv_cache_memory: Optional[int] = None
    """`--kv-cache-memory BYTES`: the KV pool's bytes per rank (`workers.memory`)."""

    @property
    def resolved_device(self) -> str:
        """`--device`, else cuda for `--attention-backend flashinfer`, else cpu."""
        return self.device or ("cuda" if self.attention_backend == "flashinfer" else "cpu")

    def check(self) -> None:
        """`ValueError` naming the flag for a device this machine lacks or a size out of range
        (the engine's own checks, `workers.config.check_size`, named by the flags)."""
        import torch

        from workers.config import check_size

        device = self.resolved_device
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: this torch build or machine has no CUDA device; "
                             "use --device cpu")
        if self.attention_backend == "flashinfer" and device != "cuda":
            raise ValueError("--attention-backend flashinfer needs --device cuda")
        for key in ("max_batch_size", "padded_prefill_tokens", "catchup_rounds",
                    "defer_prefill_width"):
            check_size(key, getattr(self, key), "--" + key.replace("_", "-"))
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype}: allowed: {', '.join(DTYPES)}")
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

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128

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

    launch: LaunchSettings
    prompt: Optional[str] = None
    """`--prompt` (one of `prompt`, `prompts`)."""
    prompts: Optional[str] = None
    """`--prompts FILE.jsonl`."""
    sampling: SamplingFlags = field(default_factory=SamplingFlags)
    seed: int = 0
    json: bool = False


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
