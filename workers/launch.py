"""Starting an engine on every rank of a cluster, the way `generate` and `serve` both need it.

`run_distributed(args, job)` is the one error path of the engine commands: it starts
torch.distributed from the torchrun environment (gloo for `--device cpu`, NCCL when every local
rank has a GPU), runs `job`, prints what rank 0 returns, and turns every known failure into one
line per rank and the documented exit code (2 bad input or configuration, 3 divergence,
4 timeout or dead peer), leaving in bounded time after a failure.

`start_engine` resolves the cluster shape (`--dp`, `--attn-tp`, `--tp`), validates every flag on
every rank (the same error everywhere if any rank's is bad), loads this rank's shards of the
model, and has the ranks agree every setting that changes the sequence of collectives or the
tokens (engine configuration, policy, sampling, seed, prompts, model) before the first collective
of the model runs.
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

def _device(args: argparse.Namespace) -> str:
    return args.device or ("cuda" if args.attention_backend == "flashinfer" else "cpu")


def run_distributed(args: argparse.Namespace,
                    job: Callable[[Any, argparse.Namespace, contextlib.ExitStack], Optional[str]]
                    ) -> int:
    """Run `job(ctx, args, closers)` on this rank; print rank 0's text; one error path (the
    consensus command's: `adaptive_dist.failures.fail_distributed`)."""
    from adaptive_dist.failures import fail_distributed
    from collectives import init_distributed

    backend = "gloo" if _device(args) == "cpu" else None
    ctx = init_distributed(timeout_s=args.timeout, backend=backend, record=True)
    try:
        with contextlib.ExitStack() as closers:  # NOTE: engines close before the process group
            text = job(ctx, args, closers)
    except Exception as exc:
        return fail_distributed(ctx, exc)
    if text:
        print(text, flush=True)
    ctx.shutdown()
    return 0


@dataclass
class Cluster:
    """What one rank holds once the engine is up."""

    ctx: Any
    config: Any          # EngineConfig
    par: Any             # ModelParallel
    world: Any           # Group: every rank (the round's consensus runs over it)
    target: Any
    engine: Any
    tokenizer: Any = None    # workers.tokenizer.Tokenizer of the target
    target_dir: Any = None   # Path of the target's directory (its tokenizer files)

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


def resolve_degrees(args: argparse.Namespace, world: int) -> tuple[int, int]:
    """(dp, attn_tp) from `--dp`, `--attn-tp`, `--tp` and the job's world size."""
    if args.tp is not None:
        if args.dp != 1 or args.attn_tp is not None:
            raise ValueError("--tp N is plain tensor parallelism (--dp 1 --attn-tp N); do not "
                             "combine it with --dp or --attn-tp")
        dp, attn_tp = 1, args.tp
    else:
        dp = args.dp
        if dp < 1:
            raise ValueError(f"--dp {dp}: must be >= 1")
        attn_tp = args.attn_tp if args.attn_tp is not None else max(1, world // dp)
    if attn_tp < 1:
        raise ValueError(f"--attn-tp {attn_tp}: must be >= 1")
    if dp * attn_tp != world:
        raise ValueError(
            f"--dp {dp} x --attn-tp {attn_tp} = {dp * attn_tp} ranks, but this job has {world}; "
            f"launch with: torchrun --nproc-per-node {dp * attn_tp} -m adaptive_dist ... "
            f"--dp {dp} --attn-tp {attn_tp}")
    return dp, attn_tp


def _spec(args: argparse.Namespace) -> Any:
    """The speculative settings the flags ask for (static depth 0 for --no-spec)."""
    from adaptive_dist.config import load_config
    from workers.config import no_spec

    if args.no_spec:
        if args.config is not None:
            raise ValueError("--config applies to --adaptive only, not to --no-spec")
        return no_spec()
    from workers.config import check_depth

    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be >= 1 (use --no-spec for no speculation)")
    if args.policy is not None and not args.adaptive:
        raise ValueError(f"--policy {args.policy} applies to --adaptive only")
    policy = (args.policy or "ema") if args.adaptive else "static"
    spec = load_config(args.config, policy, initial_steps=args.steps)
    check_depth(spec.max_steps, f"--steps {args.steps}" if args.steps is not None
                else "candidate_steps")
    return spec


def _prepare(ctx: Any, args: argparse.Namespace) -> tuple[Any, tuple[int, int], dict]:
    """Validate every flag on this rank: (speculative settings, (dp, attn_tp), settings that
    must agree). Raises `ValueError` naming the flag."""
    import torch

    from workers.config import check_size
    from workers.loading import model_paths, pair_digest

    device = _device(args)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch build or machine has no CUDA device; "
                         "use --device cpu")
    if args.attention_backend == "flashinfer" and device != "cuda":
        raise ValueError("--attention-backend flashinfer needs --device cuda")
    for key in ("max_batch_size", "padded_prefill_tokens", "catchup_rounds",
                "defer_prefill_width"):
        check_size(key, getattr(args, key), "--" + key.replace("_", "-"))
    degrees = resolve_degrees(args, ctx.world_size)
    spec = _spec(args)
    paths = model_paths(args.model, args.draft_model)  # a missing head: refused after the target
    try:
        digest = pair_digest(paths)
    except OSError as err:
        raise ValueError(f"--model/--draft-model ({paths.describe()}): cannot be read "
                         f"({err.strerror})") from None
    settings = {"--model/--draft-model (contents)": digest, "--device": device,
                "--attention-backend": args.attention_backend, "--eager": args.eager,
                "--overlap": args.overlap,
                "--mlp-scatter": args.mlp_scatter, "--moe-parallel": args.moe_parallel,
                "--timeout": ctx.timeout_s,
                "--dp": degrees[0], "--attn-tp": degrees[1],
                "--steps/--adaptive/--no-spec/--config": spec.to_dict()}
    return spec, degrees, settings


def start_engine(ctx: Any, args: argparse.Namespace, closers: contextlib.ExitStack,
                 extra: dict, size_for: Callable[[Any, int], dict],
                 first_layout: Any = None) -> Cluster:
    """Validate, load, agree, build: the engine of this rank, ready for its first round.

    `extra` holds the command's own settings that must agree (sampling, seed, prompts, ...);
    `size_for(model_config, dp)` returns EngineConfig sizes (the same on every rank);
    `first_layout` is a dp=1 layout the caller already built (its world group runs the checks)."""
    import torch

    from adaptive_dist.startup import agree_settings, all_ranks_or_none
    from workers.config import EngineConfig
    from workers.engine import build_engine, freeze_heap
    from workers.loading import load_pair, load_tokenizer_for, model_paths
    from workers.model import ModelParallel

    # NOTE: a dp=1 layout is valid whatever the flags say, so the checks run over its world group
    # first; only agreed degrees build the real layout (new_group is collective).
    layout = first_layout if first_layout is not None else ctx.layout(dp=1)
    spec, (dp, attn_tp), settings = all_ranks_or_none(lambda: _prepare(ctx, args),
                                                      layout.group("world"), "start-up checks")
    if dp != 1:
        layout = ctx.layout(dp=dp)
    world = layout.group("world")
    par = ModelParallel.from_layout(layout, args.mlp_scatter, moe=args.moe_parallel)
    on_gpu = settings["--device"] == "cuda"
    device = "cpu" if not on_gpu else (str(ctx.device) if ctx.device.type == "cuda" else "cuda")

    def load() -> tuple[Any, Any, Any]:
        try:
            target, head = load_pair(args.model, par, device, with_head=spec.max_steps > 0,
                                     draft=args.draft_model)
            tok = load_tokenizer_for(model_paths(args.model, args.draft_model),
                                     target.config.vocab_size)
            return target, head, tok
        except OSError as err:
            raise ValueError(str(err)) from None

    target, head, tokenizer = all_ranks_or_none(load, world, "loading the model")
    config = EngineConfig(spec=spec, attention_backend=args.attention_backend, device=device,
                          cuda_graphs=on_gpu and not args.eager,
                          overlap=args.overlap == "on" or (args.overlap == "auto" and on_gpu),
                          dp=dp, attn_tp=attn_tp, mlp_scatter=args.mlp_scatter,
                          moe_parallel=args.moe_parallel,
                          padded_prefill_tokens=args.padded_prefill_tokens,
                          catchup_rounds=args.catchup_rounds,
                          defer_prefill_width=args.defer_prefill_width,
                          **size_for(target.config, dp))
    engine_settings = {f"engine {k}": v for k, v in config.to_dict().items()
                       if k not in ("spec", "device")}  # cuda:0 on rank 0, cuda:1 on rank 1
    agree_settings({**settings, **extra, **engine_settings}, world, "start-up")
    guard = ctx.guard(world, check_every=spec.lockstep_check_every) if ctx.distributed else None
    if guard is not None:
        closers.callback(guard.close)
    engine = build_engine(config, target, head, group=world, guard=guard)
    closers.callback(engine.close)
    engine.warmup()
    torch.set_grad_enabled(False)
    freeze_heap()  # start-up's objects out of the collector's walks (no full-collection pauses)
    return Cluster(ctx, config, par, world, target, engine, tokenizer,
                   model_paths(args.model, args.draft_model).target)
