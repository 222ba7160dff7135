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
                "--attention-backend": launch.engine.attention_backend,
                "--eager": launch.eager, "--overlap": launch.overlap,
                "--mlp-scatter": launch.engine.mlp_scatter,
                "--moe-parallel": launch.engine.moe_parallel,
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
    already has them (resolved and loaded here otherwise; either way checked against the model).

    Rank 0 prints the start-up timeline as it goes (`workers.startup_log`): loading, the KV
    pool, the CUDA graphs per depth and prefill shape, the cost table, the memory split, ready."""
    from workers import startup_log

    timeline = startup_log.Timeline(printing=ctx.rank == 0)
    with startup_log.active(timeline):
        return _start_engine(ctx, launch, closers, extra, size_for, first_layout, paths,
                             tokenizer, timeline)


def _weight_file_bytes(paths: "ModelPaths") -> int:
    """Bytes of the pair's weight files (what loading reads, at most)."""
    total = 0
    for root in (paths.target, paths.draft):
        if root is not None:
            total += sum(f.stat().st_size for f in Path(root).iterdir()
                         if f.suffix in (".safetensors", ".bin") and f.is_file())
    return total


def _start_engine(ctx: "DistContext", launch: "LaunchSettings", closers: contextlib.ExitStack,
                  extra: dict, size_for: Callable[[Any, int], dict],
                  first_layout: Optional["ParallelLayout"], paths: Optional["ModelPaths"],
                  tokenizer: Optional["Tokenizer"], timeline: Any) -> Cluster:
    """`start_engine`'s steps, reported to `timeline`."""
    import time

    import torch

    from adaptive_dist.startup import agree_settings, all_ranks_or_none
    from workers import memory
    from workers.config import EngineConfig
    from workers.engine import build_engine, freeze_heap
    from workers.round_log import RoundLog, round_log_path
    from workers.loading import check_tokenizer, load_models, load_tokenizer_for, resolve_dtype
    from workers.model import ModelParallel
    from workers.startup_log import GB, fmt_bytes

    # NOTE: a dp=1 layout is valid whatever the flags say, so the checks run over its world group
    # first; only agreed degrees build the real layout (new_group is collective).
    layout = first_layout if first_layout is not None else ctx.layout(dp=1)
    spec, (dp, attn_tp), paths, settings = all_ranks_or_none(
        lambda: _prepare(ctx, launch, paths), layout.group("world"), "start-up checks")
    if dp != 1:
        layout = ctx.layout(dp=dp)
    world = layout.group("world")
    par = ModelParallel.from_layout(layout, launch.engine.mlp_scatter,
                                    moe=launch.engine.moe_parallel)
    on_gpu = settings["--device"] == "cuda"
    device = "cpu" if not on_gpu else (str(ctx.device) if ctx.device.type == "cuda" else "cuda")
    # every rank must take the same path through the memory profile (its forwards are collective)
    budget_flags = {"--dtype": launch.dtype,
                    "--gpu-memory-utilization": launch.gpu_memory_utilization,
                    "--kv-cache-memory": launch.kv_cache_memory}
    agree_settings(budget_flags, world, "start-up")
    settings.update(budget_flags)
    timeline.device = torch.device(device)
    baseline = memory.Baseline.take(timeline.device) if on_gpu else None
    age = timeline.age_at_start
    timeline.step("begin", f"{device}" + (
        f", {fmt_bytes(baseline.free)} free of {fmt_bytes(baseline.total)}" if baseline else "")
        + f", {world.size} rank(s)" + (f"; the process started {age:.1f} s ago (imports)"
                                       if age is not None else ""),
        process_age_s=age)
    dtype_used: list = []

    def load() -> tuple[Any, Any, "Tokenizer"]:
        try:
            dtype, why = resolve_dtype(launch.dtype, settings["--device"], paths)
            dtype_used[:] = [dtype, why]
            target, head = load_models(paths, par, device, with_head=spec.max_steps > 0,
                                       dtype=dtype, model_flag=launch.model)
            vocab = target.config.vocab_size
            if tokenizer is None:
                return target, head, load_tokenizer_for(paths, vocab)
            check_tokenizer(tokenizer, paths, vocab)
            return target, head, tokenizer
        except OSError as err:
            raise ValueError(str(err)) from None

    started = time.perf_counter()
    target, head, tok = all_ranks_or_none(load, world, "loading the model")
    if on_gpu:
        torch.cuda.synchronize(timeline.device)
    load_s = time.perf_counter() - started
    weights = memory.weight_bytes(target, head)
    files = _weight_file_bytes(paths)
    timeline.step("loading", f"{files / GB:.2f} GB of weight files in {load_s:.1f} s "
                  f"({files / GB / max(load_s, 1e-9):.2f} GB/s); {fmt_bytes(weights)} on this "
                  f"rank in {str(dtype_used[0]).removeprefix('torch.')} ({dtype_used[1]})",
                  seconds=load_s, file_bytes=files, weight_bytes=weights,
                  dtype=str(dtype_used[0]).removeprefix("torch."))
    config = EngineConfig.from_options(  # the engine's flags as given, and what start-up derived
        launch.engine, spec=spec, device=device, cuda_graphs=on_gpu and not launch.eager,
        overlap=launch.overlap == "on" or (launch.overlap == "auto" and on_gpu),
        dp=dp, attn_tp=attn_tp, **size_for(target.config, dp))
    config = _size_kv_pool(config, launch, target, head, world, baseline, weights, timeline)
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
    with timeline.timed("warm-up") as step:
        engine.warmup()
        step["text"] = "one dummy prefill and round"
    torch.set_grad_enabled(False)
    freeze_heap()  # start-up's objects out of the collector's walks (no full-collection pauses)
    _report_memory(engine, weights, baseline, launch, timeline)
    age = timeline.age_at_start
    total = timeline.elapsed()
    timeline.step("ready", f"{total:.1f} s after loading began" + (
        f", {age + total:.1f} s after the process started" if age is not None else ""),
        seconds=total, since_process_start=None if age is None else round(age + total, 3))
    return Cluster(ctx, config, par, world, target, engine, tok, paths.target)


def _size_kv_pool(config: "EngineConfig", launch: "LaunchSettings", target: Any, head: Any,
                  world: "Group", baseline: Any, weights: int, timeline: Any) -> "EngineConfig":
    """The KV pool every rank holds (`workers.memory`): what the batch needs, or what
    `--kv-cache-memory` / `--gpu-memory-utilization` leave room for, the smallest of the
    ranks'; reported to `timeline`. Collective."""
    import torch

    from adaptive_dist.startup import all_ranks_or_none
    from workers import memory
    from workers.startup_log import fmt_bytes

    util = launch.gpu_memory_utilization
    profile = None
    if util is not None:
        with timeline.timed("memory profile") as step:
            profile = memory.profile_engine(config, target, head)
            step["text"] = (f"{profile.captures} CUDA graphs to capture ({profile.round_graphs} "
                            f"round, {profile.prefill_graphs} prefill; estimate "
                            f"{fmt_bytes(profile.graphs_estimate)}), buffers "
                            f"{fmt_bytes(profile.buffers)}, activations "
                            f"{fmt_bytes(profile.activations)} ({profile.largest})")
            step.update(captures=profile.captures, buffers=profile.buffers,
                        activations=profile.activations, graphs_estimate=profile.graphs_estimate)

    def plan() -> "memory.KVPlan":
        measured = (memory.budget_split(util, baseline, weights, profile)
                    if profile is not None else None)
        kv_plan = memory.plan_kv_pages(config, target, head, launch.kv_cache_memory, util,
                                       measured)
        if kv_plan.source == "batch" and baseline is not None:
            free = torch.cuda.mem_get_info(baseline.device)[0]
            if kv_plan.nbytes > free:
                raise ValueError(
                    f"the KV pool for --max-batch-size {config.max_batch_size} requests of "
                    f"{config.max_context_len} tokens needs {fmt_bytes(kv_plan.nbytes)}, but "
                    f"{fmt_bytes(free)} are free on the GPU after the weights: lower them, or "
                    f"size the pool to memory with --gpu-memory-utilization F or "
                    f"--kv-cache-memory BYTES")
        return kv_plan

    kv = all_ranks_or_none(plan, world, "sizing the KV cache")
    pages = memory.agree_pages(kv.pages, world)
    sized = config.replace(num_pages=None if pages == kv.need_pages else pages)
    tokens = (pages - 1) * config.page_size
    full = (pages - 1) // config.pages_per_request
    if kv.source == "batch":
        why = f"what --max-batch-size {config.max_batch_size} full contexts need"
    elif kv.source == "--kv-cache-memory":
        why = f"--kv-cache-memory {fmt_bytes(launch.kv_cache_memory or 0)}"
    else:
        why = f"--gpu-memory-utilization {util}: {memory.budget_text(kv.budget)}"
    capped = " (capped at what the batch needs)" if pages == kv.need_pages and \
        kv.source != "batch" else ""
    timeline.step("KV pool", f"{tokens} tokens ({pages} pages of {config.page_size}, "
                  f"{fmt_bytes(pages * kv.page_bytes)}; room for {full} request(s) of the full "
                  f"context, {config.max_context_len} tokens, at once) from {why}{capped}"
                  + (f"; the smallest of {world.size} ranks" if world.size > 1 else ""),
                  tokens=tokens, pages=pages, kv_bytes=pages * kv.page_bytes, source=kv.source,
                  budget=kv.budget or None)
    return sized


def _report_memory(engine: "Engine", weights: int, baseline: Any, launch: "LaunchSettings",
                   timeline: Any) -> None:
    """The memory split once the engine is built (`workers.memory.memory_split`), with a warning
    when the process holds more than `--gpu-memory-utilization` allowed."""
    from workers import memory
    from workers.startup_log import fmt_bytes

    worker = engine.worker
    kv = worker.models.target_kv.nbytes + (worker.models.draft_kv.nbytes
                                           if worker.models.draft_kv is not None else 0)
    graphs = worker.graphs.pool_bytes() if worker.graphs is not None else 0
    split = memory.memory_split(worker.device, weights, kv, graphs, baseline)
    budget = None
    if launch.gpu_memory_utilization is not None and baseline is not None:
        budget = int(launch.gpu_memory_utilization * baseline.total)
    timeline.step("memory", memory.split_text(split, budget), split=split)
    if budget is not None and split.get("process", 0) > budget:
        timeline.say(f"warning: this process holds {fmt_bytes(split['process'])}, "
                     f"{fmt_bytes(split['process'] - budget)} more than "
                     f"--gpu-memory-utilization {launch.gpu_memory_utilization} allows "
                     f"({fmt_bytes(budget)}); the CUDA graphs took {fmt_bytes(graphs)} "
                     f"(estimated before capture: see workers/memory.py)")
