"""Per-rank job functions for the multi-rank tests (module level, so spawned ranks import them).

Each takes ``(rank, ...)``, sets up real process groups from the torchrun-style environment the
harness provides, and returns plain data for the parent to compare.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

import collectives as C
from adaptive_dist.config import AdaptiveConfig, load_config
from adaptive_dist.coordinator import Executed, RoundCoordinator, RoundReport
from adaptive_dist.shape import RoundShape
from adaptive_dist.replay import replay, run_consensus
from adaptive_dist.startup import agree_config
from adaptive_dist.trace import load_trace


def _ctx(backend: Optional[str], timeout: float = 20.0, strict: bool = False) -> C.DistContext:
    return C.init_distributed(timeout_s=timeout, backend=backend, record=True, strict=strict,
                              keep_log=True)


def replay_job(rank: int, trace_dir: str, cfg_dict: dict, policy: str,
               backend: Optional[str] = None) -> dict:
    """Replay this rank's trace; return its records and its whole collective log."""
    ctx = _ctx(backend)
    layout = ctx.layout(dp=ctx.world_size)
    world = layout.group("world")
    cfg = agree_config(lambda: AdaptiveConfig.from_dict({**cfg_dict, "policy": policy}), world)
    guard = ctx.guard(world, check_every=cfg.lockstep_check_every)
    result = replay(load_trace(trace_dir, rank), cfg, layout.group("dp"), guard)
    guard.close()
    log = [e.signature() for e in ctx.recorder.log]
    ctx.shutdown()
    return {"records": result.records, "log": log, "digest": result.decision_digest,
            "checks": guard.checks}


def consensus_cli_job(rank: int, trace_dir: str, config_path: Optional[str], policy: str,
                      initial_steps: Optional[int]) -> str:
    """The consensus command's body; returns rank 0's summary."""
    ctx = _ctx(None)
    try:
        return run_consensus(ctx, trace_dir, policy, config_path, initial_steps, None,
                             show_progress=False)
    finally:
        ctx.shutdown(aborted=True)


def divergence_job(rank: int, mode: str, rounds: int = 12, bad_round: int = 5,
                   backend: Optional[str] = None, timeout: float = 3.0,
                   watchdog_exit: bool = False) -> dict:
    """Run rounds with one model-style all-reduce each; rank 1 misbehaves at ``bad_round``.

    modes: ``skip_consensus`` (rank 1 skips a round's consensus collective), ``skip_op``
    (rank 1 skips its model all-reduce), ``reshape`` (rank 1 all-reduces a different shape;
    strict lockstep), ``state`` (rank 1's policy state is tampered with).
    """
    ctx = _ctx(backend, timeout=timeout, strict=(mode == "reshape"))
    guard, ctrl, dp = _divergence_setup(ctx)
    guard.exit_on_watchdog = watchdog_exit
    t0 = time.monotonic()
    try:
        _misbehave(ctx, guard, ctrl, dp, rank, mode, rounds, bad_round)
        return {"raised": None, "elapsed": time.monotonic() - t0}
    except (C.DivergenceError, C.CollectiveTimeoutError) as exc:
        return {"raised": type(exc).__name__, "message": str(exc),
                "elapsed": time.monotonic() - t0}
    finally:
        guard.close()
        ctx.shutdown(aborted=True)


def divergence_exit_job(rank: int, mode: str, stamp_dir: str, timeout: float = 3.0) -> None:
    """``divergence_job``'s failure ended the way the CLI ends one (``fail_distributed``: one
    line, the exit code, no teardown). Writes, per rank, the seconds from the start of the bad
    round to the moment the failure reached the handler into ``stamp_dir/rank{R}``."""
    import os

    from adaptive_dist.cli import fail_distributed

    ctx = _ctx(None, timeout=timeout)
    guard, ctrl, dp = _divergence_setup(ctx)
    marks: dict = {}
    try:
        _misbehave(ctx, guard, ctrl, dp, rank, mode, 12, 5, marks)
    except Exception as exc:
        with open(os.path.join(stamp_dir, f"rank{rank}"), "w") as f:
            f.write(str(time.monotonic() - marks["bad"]))
        guard.close()
        fail_distributed(ctx, exc)


def _divergence_setup(ctx: C.DistContext):
    layout = ctx.layout(dp=ctx.world_size)
    world, dp = layout.group("world"), layout.group("dp")
    cfg = AdaptiveConfig(lockstep_check_every=2)
    guard = ctx.guard(world, check_every=cfg.lockstep_check_every)
    return guard, RoundCoordinator(cfg, dp, guard=guard), dp


def _misbehave(ctx: C.DistContext, guard, ctrl, dp, rank: int, mode: str, rounds: int,
               bad_round: int, marks: Optional[dict] = None) -> None:
    bad = rank == 1
    for r in range(rounds):
        if marks is not None and r == bad_round:
            marks["bad"] = time.monotonic()
        with guard.round(r):
            if mode == "stall" and bad and r == bad_round:
                time.sleep(60)  # stuck outside any collective: only the watchdog sees it
            if mode == "state" and bad and r == bad_round:
                from dataclasses import replace
                ctrl.state = replace(ctrl.state, index=0)
            if not (mode == "skip_consensus" and bad and r == bad_round):
                plan = ctrl.begin_round(RoundReport(2, 8, True))
            n = 8 if (mode == "reshape" and bad and r == bad_round) else 4
            x = torch.ones(n, device=ctx.device)
            if not (mode == "skip_op" and bad and r == bad_round):
                C.ops.all_reduce(x, dp)
            if mode == "executed" and bad and r == bad_round:
                ctrl.ran(Executed(RoundShape(7, plan.shape.verify_tokens), plan.use_graph,
                                  plan.batch_bucket))
                ctrl.end_round([1, 2])
            else:
                ctrl.end_round([1, 2])


def config_job(rank: int, per_rank: dict, policy: str = "ema") -> dict:
    """Each rank builds its own config from ``per_rank[rank]`` (kwargs of load_config-like
    settings or a dict for AdaptiveConfig.from_dict); return what start-up said."""
    ctx = _ctx(None)
    world = ctx.layout().group("world")
    spec = per_rank[rank]
    try:
        if "path" in spec:
            build = lambda: load_config(spec["path"], policy, spec.get("initial_steps"))
        else:
            build = lambda: AdaptiveConfig.from_dict({**spec["dict"], "policy": policy})
        cfg = agree_config(build, world)
        return {"ok": True, "digest": cfg.digest()}
    except ValueError as exc:
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    finally:
        ctx.shutdown(aborted=True)


def static_job(rank: int, trace_dir: str, initial_steps: int, backend: Optional[str] = None) -> dict:
    ctx = _ctx(backend)
    layout = ctx.layout(dp=ctx.world_size)
    world = layout.group("world")
    cfg = agree_config(lambda: load_config(None, "static", initial_steps), world)
    result = replay(load_trace(trace_dir, rank), cfg, layout.group("dp"))
    ctx.shutdown()
    return {"records": result.records}


def layout_ops_job(rank: int, dp: int) -> dict:
    """Run every typed op on every named group of a (dp, tp=world) layout; return the results."""
    ctx = _ctx(None)
    layout = ctx.layout(dp=dp)
    out = {"attn_tp_degree": layout.attn_tp}
    for name in C.GROUP_NAMES:
        g = layout.group(name)
        x = torch.full((2, 4), float(rank + 1))
        rs_in = torch.arange(4.0 * g.size).reshape(2 * g.size, 2) * (rank + 1)
        rs_copy = rs_in.clone()
        out[name] = {
            "ranks": list(g.ranks), "index": g.rank,
            "all_reduce": C.ops.all_reduce(x.clone(), g)[0, 0].item(),
            "all_reduce_max": C.ops.all_reduce(x.clone(), g, op="max")[0, 0].item(),
            "all_gather0": C.ops.all_gather(x, g)[:, 0].tolist(),
            "all_gather1": C.ops.all_gather(x, g, dim=1)[0].tolist(),
            "reduce_scatter": C.ops.reduce_scatter(rs_in, g).tolist(),
            "reduce_scatter_input_kept": rs_in.tolist() == rs_copy.tolist(),
            "broadcast": C.ops.broadcast(x.clone(), g, src=g.size - 1)[0, 0].item(),
        }
    out["log"] = [e.signature() for e in ctx.recorder.log]
    ctx.shutdown()
    return out


def progress_mismatch_job(rank: int, trace_dir: str) -> str:
    """Rank 0 shows progress, rank 1 does not: start-up must refuse on both."""
    from adaptive_dist.config import ConfigError

    ctx = _ctx(None)
    try:
        run_consensus(ctx, trace_dir, "ema", None, None, None, show_progress=(rank == 0))
        return "ran"
    except ConfigError as exc:
        return str(exc)
    finally:
        ctx.shutdown(aborted=True)


def round_cost_job(rank: int, measured_per_rank: dict, cfg_dict: dict, rounds: int = 0) -> dict:
    """Agree the config, then the goodput cost table from this rank's measurement
    (``measured_per_rank[rank]``: bucket -> steps -> seconds); run ``rounds`` consensus rounds
    with the agreed config (the pre-flight compares config hashes). Returns what start-up said."""
    from adaptive_dist.startup import agree_round_cost

    ctx = _ctx(None)
    world = ctx.layout().group("world")
    try:
        cfg = agree_config(lambda: AdaptiveConfig.from_dict({**cfg_dict, "policy": "goodput"}),
                           world)
        cfg = agree_round_cost(cfg, measured_per_rank[rank], world)
        ctrl = RoundCoordinator(cfg, world)
        for _ in range(rounds):
            plan = ctrl.begin_round(RoundReport(2))
            ctrl.end_round([min(1, plan.steps)] * 2)
        return {"ok": True, "round_cost": cfg.to_dict()["round_cost"], "digest": cfg.digest(),
                "steps": ctrl.steps}
    except ValueError as exc:
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    finally:
        ctx.shutdown(aborted=True)
