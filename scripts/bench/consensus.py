"""Measure the per-round consensus cost, the old all-gather against the new reduction, and fit an
alpha-beta model to extrapolate both to large clusters (issue 27).

    python -m scripts.bench.consensus --worlds 2 4 8 --rounds 600 --out runs/consensus
    (launches one torchrun per world size on this host: gloo over loopback, CPU ranks)

Per world size: the collective alone (the gather of every rank's vector and its host read; the
reduction by recursive doubling; gloo's own ring all-reduce, SUM then MAX) and a whole
``begin_round`` + ``end_round`` under each scheme; medians and p90 (rank 0's clock). Then
per-hop latency and per-byte cost fitted to those points, extrapolated with a stated inter-node
latency. Writes OUT/results.json and OUT/consensus_cost.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

NODE = 8                 # ranks per node in the extrapolation (8 GPUs a node)


def timed(fn, n: int, barrier) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    barrier()
    return out


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_us": statistics.median(xs), "p10_us": xs[len(xs) // 10],
            "p90_us": xs[9 * len(xs) // 10], "mean_us": statistics.fmean(xs), "n": len(xs)}


# ---------------------------------------------------------------------------------- one world
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import collectives as C
    from adaptive_dist import consensus
    from adaptive_dist.config import AdaptiveConfig
    from adaptive_dist.coordinator import RoundCoordinator, RoundReport
    from adaptive_dist.policy import depth_policy

    ctx = C.init_distributed(timeout_s=120, backend="gloo", record=False)
    world = ctx.layout(dp=ctx.world_size).group("dp")
    barrier = lambda: dist.barrier(group=world.control_pg)
    cfg = AdaptiveConfig()
    vec = consensus.RoundVector(0, 4, 16, 0, True, False, 0, False, 4, 2.5, 4, 3, 0, -1, 7, 9)
    layout = consensus.ReducedLayout(depth_policy(cfg).reducer.needs)
    gather = consensus.ConsensusChannel(world)
    doubling = consensus.ReduceChannel(world, layout, "doubling")
    ring = consensus.ReduceChannel(world, layout, "gloo")
    coords = {s: RoundCoordinator(cfg, world, scheme=s, clock=None) for s in consensus.SCHEMES}

    def round_of(ctrl):
        def fn():
            ctrl.begin_round(RoundReport(4, 16, True))
            ctrl.end_round([1, 2, 3, 2])
        return fn

    cases = {"gather": lambda: gather.gather(vec), "reduce": lambda: doubling.reduce(vec),
             "reduce_gloo_ring": lambda: ring.reduce(vec),
             "begin_round_gather": round_of(coords["gather"]),
             "begin_round_reduce": round_of(coords["reduce"])}
    # interleaved: every iteration runs each case once (a barrier between them, untimed), so a
    # slow stretch of this shared host falls on every case alike
    samples: dict = {name: [] for name in cases}
    total = args.warmup + args.rounds
    for i in range(total):
        if ctx.rank == 0 and i % max(1, total // 10) == 0:
            print(f"[consensus] world {ctx.world_size}: iteration {i}/{total}", flush=True)
        for name, fn in cases.items():
            barrier()
            t0 = time.perf_counter()
            fn()
            if i >= args.warmup:
                samples[name].append((time.perf_counter() - t0) * 1e6)
    res = {name: stats(xs) for name, xs in samples.items()}
    # the per-byte cost: the bare reduction (doubling) of larger vectors
    sweep = {}
    for n in (128, 4096, 32768):
        t = torch.zeros(n, dtype=torch.int64)
        fn = lambda: C.ops.all_reduce_sum_max(t, world, n // 2, "doubling")
        timed(fn, 10, barrier)
        sweep[str(n * 8)] = stats(timed(fn, max(30, args.rounds // 10), barrier))
    if ctx.rank == 0:
        out = {"world_size": ctx.world_size, "gather_bytes_per_rank": 8 * len(consensus.FIELDS),
               "reduce_bytes": 8 * layout.size, "cases": res, "doubling_by_bytes": sweep}
        with open(args.worker_out, "w") as f:
            json.dump(out, f)
    ctx.shutdown()


# ---------------------------------------------------------------------------------- the model
def hops(scheme: str, n: int) -> int:
    """Sequential message steps of one collective over ``n`` ranks."""
    if n <= 1:
        return 0
    if scheme == "gather":          # gloo's ring all-gather
        return n - 1
    if scheme == "ring_allreduce":  # gloo's ring all-reduce (reduce-scatter + all-gather), x2 ops
        return 2 * 2 * (n - 1)
    k = int(math.log2(n))           # recursive doubling; +2 when n is not a power of two
    return k + (0 if 1 << k == n else 2)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = c + a x``: (c, a)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - a * mx, a


CASE_OF = {"gather": "gather", "reduce": "reduce", "ring_allreduce": "reduce_gloo_ring"}


def model(runs: list[dict], cpus: int, inter_alpha_us: float, inter_gbps: float) -> dict:
    """The alpha-beta model, fitted only to world sizes that fit this host's cores (a rank more
    than the cores waits for the scheduler at every hop, which is the host's cost, not the
    collective's; those points are plotted, not fitted).

    alpha per scheme: median of (time / hops) over the fitted worlds, the host work of the round
    folded into it (so an upper bound per hop: a scheme's fixed cost is charged at every hop);
    beta: the slope of the doubling's time against bytes x hops (the size sweep). The
    extrapolation places ``NODE`` ranks a node: a hop inside a node costs alpha + bytes x beta;
    a hop between nodes adds ``inter_alpha_us`` and moves its bytes at ``inter_gbps``. A ring
    step waits for its slowest link, so past one node every ring step crosses; recursive
    doubling's first log2(NODE) steps stay inside the node (partners differ in the low bits)."""
    fitted = [r for r in runs if r["world_size"] <= cpus] or [min(runs, key=lambda r: r["world_size"])]
    fits = {}
    for scheme, case in CASE_OF.items():
        per_hop = [r["cases"][case]["median_us"] / hops(scheme, r["world_size"]) for r in fitted]
        fits[scheme] = {"alpha_us_per_hop": statistics.median(per_hop),
                        "fitted_worlds": [r["world_size"] for r in fitted]}
    base = min(fitted, key=lambda r: r["world_size"])
    sweep = sorted((int(b), s["median_us"]) for b, s in base["doubling_by_bytes"].items())
    _, per_byte = fit([(b * hops("reduce", base["world_size"]), t) for b, t in sweep])
    beta_intra = max(per_byte, 0.0) * 1e3            # ns per byte per step
    beta_inter = 1.0 / inter_gbps                    # ns per byte (GB/s)
    m_g, m_r = base["gather_bytes_per_rank"], base["reduce_bytes"]
    extra = {}
    for n in (2, 4, 8, 16, 32, 64, 256, 1024):
        row = {}
        for scheme, size in (("gather", m_g), ("reduce", m_r), ("ring_allreduce", m_r)):
            alpha = fits[scheme]["alpha_us_per_hop"]
            h_all = hops(scheme, n)
            if scheme == "reduce":
                h_in = min(h_all, hops("reduce", min(n, NODE)))
            else:
                h_in = h_all if n <= NODE else 0
            h_out = h_all - h_in
            step = size if scheme != "ring_allreduce" else size / n
            row[scheme] = (h_in * (alpha + step * beta_intra * 1e-3)
                           + h_out * (alpha + inter_alpha_us + step * beta_inter * 1e-3))
        extra[str(n)] = row
    return {"fits": fits, "beta_intra_ns_per_byte": beta_intra,
            "beta_inter_ns_per_byte": beta_inter, "inter_alpha_us": inter_alpha_us,
            "ranks_per_node": NODE, "extrapolated_us": extra}


def plot(runs: list[dict], mdl: dict, path: str) -> None:
    from scripts.bench.common import pyplot, save

    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ws = [r["world_size"] for r in runs]
    for case, label in (("gather", "all-gather + read (old)"), ("reduce", "reduce, doubling"),
                        ("reduce_gloo_ring", "gloo ring all-reduce x2"),
                        ("begin_round_gather", "begin_round, gather"),
                        ("begin_round_reduce", "begin_round, reduce")):
        med = [r["cases"][case]["median_us"] for r in runs]
        p90 = [r["cases"][case]["p90_us"] for r in runs]
        a1.errorbar(ws, med, yerr=[[0] * len(med), [p - m for p, m in zip(p90, med)]],
                    marker="o", capsize=3, label=label)
    a1.set_xscale("log", base=2)
    a1.set_xlabel("ranks (this host, oversubscribed past its cores)")
    a1.set_ylabel("µs per round (median, bar to p90)")
    a1.set_title("measured, gloo over loopback")
    a1.legend(fontsize=8)
    ext = mdl["extrapolated_us"]
    ns = sorted(int(n) for n in ext)
    for scheme, label in (("gather", "ring all-gather (old)"), ("reduce", "recursive doubling"),
                          ("ring_allreduce", "gloo ring all-reduce x2")):
        a2.plot(ns, [ext[str(n)][scheme] for n in ns], marker="o", label=label)
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel(f"ranks ({NODE} a node, {mdl['inter_alpha_us']:g} µs between nodes)")
    a2.set_ylabel("µs per collective (model)")
    a2.set_title("alpha-beta model, extrapolated")
    a2.legend(fontsize=8)
    save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--inter-node-latency-us", type=float, default=15.0)
    ap.add_argument("--inter-node-gbps", type=float, default=25.0, help="GB/s between nodes")
    ap.add_argument("--out", default="runs/consensus")
    ap.add_argument("--refit", action="store_true",
                    help="no measurement: fit the model again to OUT/world*.json")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    os.makedirs(args.out, exist_ok=True)
    runs = []
    for n in args.worlds:
        part = os.path.join(args.out, f"world{n}.json")
        if args.refit:
            with open(part) as f:
                runs.append(json.load(f))
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
               "--master-port", str(29500 + n), "-m", "scripts.bench.consensus",
               "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--worker-out", part]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(part) as f:
            runs.append(json.load(f))
        print(json.dumps({"world": n, **{k: round(v["median_us"]) for k, v in
                                         runs[-1]["cases"].items()}}), flush=True)
    mdl = model(runs, os.cpu_count() or 1, args.inter_node_latency_us, args.inter_node_gbps)
    import torch

    res = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "backend": "gloo (loopback, CPU ranks)", "rounds": args.rounds,
           "oversubscribed": [n for n in args.worlds if n > (os.cpu_count() or 1)],
           "runs": runs, "model": mdl}
    from scripts.bench.common import write_json

    write_json(os.path.join(args.out, "results.json"), res, indent=2)
    plot(runs, mdl, os.path.join(args.out, "consensus_cost.png"))
    print(json.dumps(mdl["fits"]), json.dumps(mdl["extrapolated_us"]))


if __name__ == "__main__":
    main()
