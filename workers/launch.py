"""Starting an engine on every rank of a cluster, the way `generate` and `serve` both need it.

`run_distributed(settings, job)` is the one error path of the engine commands: it starts
torch.distributed from the torchrun environment (gloo for `--device cpu`, NCCL when every local
rank has a GPU), runs `job`, prints what rank 0 returns, and turns every known failure into one
line per rank and the documented exit code (2 bad input or configuration, 3 divergence,
4 timeout or dead peer), leaving in bounded time after a failure.

`start_engine` resolves the cluster shape (`--dp`, `--attn-tp`, `--tp`), validates every flag on
every rank (`workers.settings.LaunchSettings`: the command line parsed once, by the CLI) (the same error everywhere if any rank's is bad), loads this rank's shards of the
model, and has the ranks agree every setting that changes the sequence of collectives or the
tokens (engine configuration, policy, sampling, seed, prompts, model) before the first collective
of the model runs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

if TYPE_CHECKING:
    from adaptive_dist.config import AdaptiveConfig
    from collectives import DistContext, Group, ParallelLayout
    from workers.config import EngineConfig
    from workers.engine import Engine
    from workers.model import LlamaForCausalLM, ModelParallel
    from workers.model_files import ModelPaths
    from workers.settings import LaunchSettings
    from workers.tokenizer import Tokenizer

S = TypeVar("S")


def run_distributed(launch: "LaunchSettings", settings: S,
                    job: Callable[["DistContext", S, contextlib.ExitStack], Optional[str]]
                    ) -> int:
    """Run `job(ctx, settings, closers)` on this rank (`launch`: the engine's part of
    `settings`); print rank 0's text; one error path (the consensus command's:
    `adaptive_dist.failures.fail_distributed`)."""
    from adaptive_dist.failures import fail_distributed
    from collectives import init_distributed

    backend = "gloo" if launch.resolved_device == "cpu" else None
    ctx = init_distributed(timeout_s=launch.timeout, backend=backend, record=True)
    try:
        with contextlib.ExitStack() as closers:  # NOTE: engines close before the process group
            text = job(ctx, settings, closers)
    except Exception as exc:
        return fail_distributed(ctx, exc)
    if text:
        print(text, flush=True)
    ctx.shutdown()
    return 0


@dataclass
class Cluster:
    """What one rank holds once the engine is up."""

    ctx: "DistContext"
    config: "EngineConfig"
    par: "ModelParallel"
    world: "Group"       # every rank (the round's consensus runs over it)
    target: "LlamaForCausalLM"
    engine: "Engine"
    tokenizer: "Tokenizer"   # the target's
    target_dir: Path         # the target's directory (its tokenizer files)

    def gather_report(self, mine: list[int], reqs: list) -> Optional[dict]:
        """Every replica's outputs (by prompt index) and statistics, on rank 0 (None elsewhere).
        A collective over the world's control group."""
        engine = self.engine
        stats = engine.stats
        part = {
            "dp_rank": self.par.replica, "attn_index": self.par.attn.rank,
            "outputs": {i: {"token_ids": r.output_ids, "finish_reason": r.finish_reason,
                            "dp_rank": self.par.replica} for i, r in zip(mine, reqs)},
            "requests": len(reqs), "rounds": stats.rounds,
            "accept_histogram": {str(k): v for k, v in sorted(stats.accept_histogram.items())},
            "mean_accept_length": stats.mean_accept_length, "elapsed_s": stats.elapsed_s,
            "switches": engine.planner.stats.switches,
            "steps_timeline": [list(x) for x in engine.planner.stats.steps_timeline],
            "cluster_rounds": engine.planner.round, "graph_rounds": stats.graph_rounds,
        }
        parts = [part]
        if self.world.size > 1:
            import torch.distributed as dist

            parts = [None] * self.world.size
            dist.all_gather_object(parts, part, group=self.world.control_pg)
        if self.ctx.rank != 0:
            return None
        leaders = sorted((p for p in parts if p["attn_index"] == 0), key=lambda p: p["dp_rank"])
        outputs = {i: o for p in leaders for i, o in p["outputs"].items()}
        tiers = {str(s): st.nbytes for s, st in engine.pool.states.items()}
        return {"replicas": leaders, "outputs": [outputs[i] for i in sorted(outputs)],
                "tier_bytes": tiers}


def _prepare(ctx: "DistContext", launch: "LaunchSettings", paths: Optional["ModelPaths"]
             ) -> tuple["AdaptiveConfig", tuple[int, int], "ModelPaths", dict]:
    """Validate every flag on this rank: (speculative settings, (dp, attn_tp), the model's
    directories, settings that must agree). Raises `ValueError` naming the flag."""
    from workers.loading import pair_digest

    launch.check()
    degrees = launch.shape.resolve(ctx.world_size)
    spec = launch.spec.build()
    if paths is None:
        paths = launch.model_paths()  # a missing head: refused after the target
    try:
        digest = pair_digest(paths)
    except OSError as err:
        raise ValueError(f"--model/--draft-model ({paths.describe()}): cannot be read "
                         f"({err.strerror})") from None
    settings = {"--model/--draft-model (contents)": digest, "--device": launch.resolved_device,
                "--attention-backend": launch.attention_backend, "--eager": launch.eager,
                "--overlap": launch.overlap,
                "--mlp-scatter": launch.mlp_scatter, "--moe-parallel": launch.moe_parallel,
                "--timeout": ctx.timeout_s,
                "--dp": degrees[0], "--attn-tp": degrees[1],
                "--steps/--adaptive/--no-spec/--config": spec.to_dict()}
    return spec, degrees, paths, settings


def start_engine(ctx: "DistContext", launch: "LaunchSettings", closers: contextlib.ExitStack,
                 extra: dict, size_for: Callable[[Any, int], dict],
                 first_layout: Optional["ParallelLayout"] = None,
                 paths: Optional["ModelPaths"] = None,
                 tokenizer: Optional["Tokenizer"] = None) -> Cluster:
    """Validate, load, agree, build: the engine of this rank, ready for its first round.

    `extra` holds the command's own settings that must agree (sampling, seed, prompts, ...);
    `size_for(model_config, dp)` returns EngineConfig sizes (the same on every rank);
    `first_layout` is a dp=1 layout the caller already built (its world group runs the checks);
    `paths` and `tokenizer`: the model's directories and the target's tokenizer when the caller
    already has them (resolved and loaded here otherwise; either way checked against the model)."""
    import torch

    from adaptive_dist.startup import agree_settings, all_ranks_or_none
    from workers.config import EngineConfig
    from workers.engine import build_engine, freeze_heap
    from workers.round_log import RoundLog, round_log_path
    from workers.loading import check_tokenizer, load_models, load_tokenizer_for
    from workers.model import ModelParallel

    # NOTE: a dp=1 layout is valid whatever the flags say, so the checks run over its world group
    # first; only agreed degrees build the real layout (new_group is collective).
    layout = first_layout if first_layout is not None else ctx.layout(dp=1)
    spec, (dp, attn_tp), paths, settings = all_ranks_or_none(
        lambda: _prepare(ctx, launch, paths), layout.group("world"), "start-up checks")
    if dp != 1:
        layout = ctx.layout(dp=dp)
    world = layout.group("world")
    par = ModelParallel.from_layout(layout, launch.mlp_scatter, moe=launch.moe_parallel)
    on_gpu = settings["--device"] == "cuda"
    device = "cpu" if not on_gpu else (str(ctx.device) if ctx.device.type == "cuda" else "cuda")

    def load() -> tuple[Any, Any, "Tokenizer"]:
        try:
            target, head = load_models(paths, par, device, with_head=spec.max_steps > 0,
                                       model_flag=launch.model)
            vocab = target.config.vocab_size
            if tokenizer is None:
                return target, head, load_tokenizer_for(paths, vocab)
            check_tokenizer(tokenizer, paths, vocab)
            return target, head, tokenizer
        except OSError as err:
            raise ValueError(str(err)) from None

    target, head, tok = all_ranks_or_none(load, world, "loading the model")
    config = EngineConfig(spec=spec, attention_backend=launch.attention_backend, device=device,
                          cuda_graphs=on_gpu and not launch.eager,
                          overlap=launch.overlap == "on" or (launch.overlap == "auto" and on_gpu),
                          dp=dp, attn_tp=attn_tp, mlp_scatter=launch.mlp_scatter,
                          moe_parallel=launch.moe_parallel,
                          padded_prefill_tokens=launch.padded_prefill_tokens,
                          catchup_rounds=launch.catchup_rounds,
                          defer_prefill_width=launch.defer_prefill_width,
                          **size_for(target.config, dp))
    engine_settings = {f"engine {k}": v for k, v in config.to_dict().items()
                       if k not in ("spec", "device")}  # cuda:0 on rank 0, cuda:1 on rank 1
    agree_settings({**settings, **extra, **engine_settings}, world, "start-up")
    guard = ctx.guard(world, check_every=spec.lockstep_check_every) if ctx.distributed else None
    if guard is not None:
        closers.callback(guard.close)
    engine = build_engine(config, target, head, group=world, guard=guard)
    closers.callback(engine.close)
    if launch.round_log is not None:
        engine.round_log = RoundLog(round_log_path(launch.round_log, ctx.rank, ctx.world_size),
                                    ctx.rank)
        closers.callback(engine.round_log.close)
    engine.warmup()
    torch.set_grad_enabled(False)
    freeze_heap()  # start-up's objects out of the collector's walks (no full-collection pauses)
    return Cluster(ctx, config, par, world, target, engine, tok, paths.target)
