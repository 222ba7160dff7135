"""Measure the per-round consensus cost — the old all-gather, the reduction by recursive doubling
over gloo, and the reduction through shared memory within a host (issue 37) — and fit an
alpha-beta model to extrapolate them to large clusters (issues 27, 37).

    python -m scripts.bench.consensus --worlds 2 4 8 16 --rounds 1000 --repeats 3 --out runs/consensus
    python -m scripts.bench.consensus --local [--batch 4] [--rounds 2000] [--repeats 5] [--cold-us 500]
    (launches one torchrun per world size on this host: CPU ranks, gloo over loopback and one
    shared-memory segment; plain python3 + torch, the plot only when matplotlib is installed)

Per world size, ``--repeats`` times, the cases interleaved with a barrier before each (their
order rotated every iteration: with a fixed order a case's position confounded its figure): the
reduction alone by recursive doubling over gloo and through shared memory (also with the spin
off, ``reduce_shm_spin0``: every early rank blocks in the kernel and is woken; with
``--early-wake``, ``reduce_shm_early``: the last but one arrival wakes the sleepers too), a whole
``begin_round`` + ``end_round`` over each, and over a group of one (``begin_round_local``: the
round's host work with no collective, every rank at once); ``*_steady``: back-to-back calls
after a first one (the ranks follow each other as in an engine's loop, and the caches are warm);
``--all-cases`` adds the old all-gather, gloo's ring all-reduce and the gathered
``begin_round`` (slow at 16 ranks).

Every rank reads one clock (``perf_counter``, CLOCK_MONOTONIC: the same for every process of the
host) around each call; after a repeat the readings are gathered, and a call's figure is
``from_last_us``: from the last rank's call until every rank has returned — the collective's
cost without the skew with which the ranks arrive (a gloo barrier lets ranks go tens to
hundreds of µs apart, ``skew_us`` says how far; an engine's ranks arrive as their rounds end). That is the figure the issue's
goals are read against. ``rank0_us`` (rank 0's wall time in the call, skew included: this
bench's figure before) and ``skew_us`` (last call minus first) are beside it. Medians and p90 of
each repeat, then their median. The ranks are not pinned (``--pin``: one CPU each, by local
rank); a host with fewer free cores than ranks puts the scheduler's delays into every figure.

Then what a waiting rank costs the host: rank 0 arrives, every other rank 2 ms later; rank 0's
process time (every thread) and its waiting thread's time over its wall time in the collective,
and that thread time less the same call's when rank 0 comes 2 ms after the others and does not
wait (``wait_cpu_us_per_call``), for shared memory with each spin bound and for gloo. Then per-hop latency and per-byte cost
fitted to those points, extrapolated with a stated inter-node latency: the hierarchical scheme
(shared memory in a host, recursive doubling between hosts' leaders) beside the flat one (and,
with ``--all-cases``, the old ones).
Writes OUT/results.json and OUT/consensus_cost.png.
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
CASES = ("gather", "reduce", "reduce_gloo_ring", "reduce_shm", "reduce_shm_spin<us>",
         "begin_round_gather", "begin_round_reduce", "begin_round_shm",
         "reduce_steady", "reduce_shm_steady", "begin_round_shm_steady",
         "begin_round_local", "begin_round_local_steady")
OLD_CASES = ("gather", "reduce_gloo_ring", "begin_round_gather")   # measured with --all-cases
STEADY = 4               # back-to-back calls of a steady case (the first one not timed)
SPIN_OLD = 50e-6         # an older tree's collectives.shm: a fixed spin
WAIT_MS = 2.0            # how late the other ranks arrive in the waiting-rank measurement
FIGURES = ("from_last_us", "rank0_us", "skew_us")


def figures(t: "np.ndarray", steady: bool) -> dict:
    """Per iteration, from every rank's two clock readings ``t[rank, iteration, 0:2]``
    (``perf_counter``: CLOCK_MONOTONIC, one clock for every process of the host):

    - ``from_last_us``: from the last rank's call until every rank has returned — the
      collective's own cost, without the ranks' arrival skew (which a barrier, or an engine's
      uneven rounds, puts before it); what the issue's goals are about;
    - ``rank0_us``: rank 0's wall time in the call (the figure before: the skew included);
    - ``skew_us``: how far apart the ranks called (last minus first).

    A steady case's readings are after its first call and after its last; its figures are per
    call (divided by ``STEADY - 1``), and it has no skew of its own."""
    import numpy as np

    div = (STEADY - 1) if steady else 1
    out = {"from_last_us": (t[:, :, 1].max(0) - t[:, :, 0].max(0)) / div * 1e6,
           "rank0_us": (t[0, :, 1] - t[0, :, 0]) / div * 1e6}
    if not steady:
        out["skew_us"] = (t[:, :, 0].max(0) - t[:, :, 0].min(0)) * 1e6
    return {k: np.asarray(v).tolist() for k, v in out.items()}


def worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import collectives as C
    from collectives import shm as shm_mod
    from adaptive_dist import consensus
    from adaptive_dist.config import AdaptiveConfig
    from adaptive_dist.coordinator import RoundCoordinator, RoundReport
    from adaptive_dist.policy import depth_policy

    ctx = C.init_distributed(timeout_s=120, backend="gloo", record=False)
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ.get("LOCAL_RANK", ctx.rank)) % len(cpus)]})
    world = ctx.layout(dp=ctx.world_size).group("dp")
    barrier = lambda: dist.barrier(group=world.control_pg)
    cfg = AdaptiveConfig()
    vec = consensus.RoundVector(0, 4, 16, 0, True, False, 0, False, 4, 2.5, 4, 3, 0, -1, 7, 9)
    layout = consensus.ReducedLayout(depth_policy(cfg).reducer.needs)
    gather = consensus.ConsensusChannel(world)
    doubling = consensus.ReduceChannel(world, layout, "doubling")
    ring = consensus.ReduceChannel(world, layout, "gloo")
    shm = consensus.ReduceChannel(world, layout, "shm")
    spin_env = getattr(shm_mod, "SPIN_ENV", "ADAPTIVE_DIST_SHM_SPIN_US")   # (an older tree: none)
    spin = os.environ.get(spin_env)
    by_spin = {}                        # the same transport with another spin bound (0: none)
    for us in args.spin_us:
        os.environ[spin_env] = f"{us:g}"
        by_spin[f"reduce_shm_spin{us:g}"] = consensus.ReduceChannel(world, layout, "shm")
    if spin is None:
        os.environ.pop(spin_env, None)
    else:
        os.environ[spin_env] = spin
    early_env = getattr(shm_mod, "EARLY_WAKE_ENV", None)
    if args.early_wake and early_env is not None:   # the last but one arrival wakes too
        early = os.environ.get(early_env)
        os.environ[early_env] = "1"
        by_spin["reduce_shm_early"] = consensus.ReduceChannel(world, layout, "shm")
        if early is None:
            os.environ.pop(early_env, None)
        else:
            os.environ[early_env] = early
    coords = {"gather": RoundCoordinator(cfg, world, scheme="gather", clock=None),
              "reduce": RoundCoordinator(cfg, world, algorithm="doubling", clock=None),
              "shm": RoundCoordinator(cfg, world, algorithm="shm", clock=None),
              # the round's host work alone: a group of one (no collective), every rank at once
              "local": RoundCoordinator(cfg, C.Group.single(), clock=None)}

    def round_of(ctrl):
        def fn():
            ctrl.begin_round(RoundReport(4, 16, True))
            ctrl.end_round([1, 2, 3, 2])
        return fn

    def steady(fn):
        """Back-to-back calls after the barrier: the first absorbs the barrier's skew; the
        readings bracket the others (a call's cost when the ranks follow each other, as in an
        engine's loop; and, for the local round, with warm caches)."""
        def run(t):
            fn()
            t[0] = time.perf_counter()
            for _ in range(STEADY - 1):
                fn()
            t[1] = time.perf_counter()
        run.steady = True
        return run

    cases = {"gather": lambda: gather.gather(vec), "reduce": lambda: doubling.reduce(vec),
             "reduce_gloo_ring": lambda: ring.reduce(vec), "reduce_shm": lambda: shm.reduce(vec),
             **{name: (lambda ch=ch: ch.reduce(vec)) for name, ch in by_spin.items()},
             "begin_round_gather": round_of(coords["gather"]),
             "begin_round_reduce": round_of(coords["reduce"]),
             "begin_round_shm": round_of(coords["shm"]),
             "reduce_steady": steady(lambda: doubling.reduce(vec)),
             "reduce_shm_steady": steady(lambda: shm.reduce(vec)),
             "begin_round_shm_steady": steady(round_of(coords["shm"])),
             "begin_round_local": round_of(coords["local"]),
             "begin_round_local_steady": steady(round_of(coords["local"]))}
    if not args.all_cases:
        cases = {k: v for k, v in cases.items() if k not in OLD_CASES}
    names = list(cases)
    repeats = []
    for rep in range(args.repeats):
        # interleaved: every iteration runs each case once (a barrier before each, untimed), so a
        # slow stretch of a shared host falls on every case alike
        total = args.warmup + args.rounds
        t = np.zeros((len(names), args.rounds, 2))
        for i in range(total):
            if ctx.rank == 0 and i % max(1, total // 5) == 0:
                print(f"[consensus] world {ctx.world_size}: repeat {rep + 1}/{args.repeats}, "
                      f"iteration {i}/{total}", flush=True)
            j = i - args.warmup
            # the order rotates every iteration (the same on every rank): each case follows each
            # other equally often, so none is always the one after gloo's exchange (the coldest)
            r = i % len(names)
            for c in (*range(r, len(names)), *range(r)):
                name = names[c]
                fn = cases[name]
                barrier()
                if getattr(fn, "steady", False):
                    row = t[c, j] if j >= 0 else np.zeros(2)
                    fn(row)
                else:
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    if j >= 0:
                        t[c, j] = t0, t1
        # every rank's readings to every rank (one gather after the repeat, untimed)
        mine = torch.from_numpy(t)
        allt = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(allt, mine, group=world.control_pg)
        every = torch.stack(allt).numpy()                 # [rank, case, iteration, 2]
        rep_res = {}
        for c, name in enumerate(names):
            figs = figures(every[:, c], getattr(cases[name], "steady", False))
            rep_res[name] = {fig: stats(xs) for fig, xs in figs.items()}
        repeats.append(rep_res)
    res = {name: {fig: {k: statistics.median(r[name][fig][k] for r in repeats)
                        for k in ("median_us", "p10_us", "p90_us", "mean_us")}
                  for fig in repeats[0][name]} for name in names}
    # a waiting rank's host time: rank 0 first, the others WAIT_MS later; and the same call when
    # rank 0 comes WAIT_MS after the others (it does not wait): the difference is the wait's
    waits = {}
    n_wait = max(20, args.rounds // 20)
    for name, ch in (("shm", shm), *((k[len("reduce_"):], c) for k, c in by_spin.items()),
                     ("doubling", doubling)):
        got = {}
        for first in (True, False):
            cpu = thread = wall = 0.0
            for i in range(n_wait):
                barrier()
                if (ctx.rank != 0) == first:
                    time.sleep(WAIT_MS / 1e3)
                c0, h0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
                ch.reduce(vec)
                cpu += time.process_time() - c0
                thread += time.thread_time() - h0
                wall += time.perf_counter() - t0
            got[first] = (cpu, thread, wall)
        (cpu, thread, wall), (_, thread_last, _) = got[True], got[False]
        # process time: every thread of the rank (gloo's too); thread time: the waiting thread
        waits[name] = {"wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu, "cpu_share": cpu / wall,
                       "thread_cpu_ms": 1e3 * thread, "thread_cpu_share": thread / wall,
                       "thread_cpu_us_per_call": 1e6 * thread / n_wait,
                       "thread_cpu_us_per_call_not_waiting": 1e6 * thread_last / n_wait,
                       "wait_cpu_us_per_call": 1e6 * (thread - thread_last) / n_wait}
    host = shm.host
    shm_waits = None if host is None else {
        "waits": host.waits, "slept": getattr(host, "slept", None),
        "waited_ms": 1e3 * host.waited_s, "spin_max_us": 1e6 * getattr(host, "spin_max_s", SPIN_OLD),
        "futex": host._futex is not None}
    # the per-byte cost: the bare reduction (doubling) of larger vectors
    sweep = {}
    for n in (128, 4096, 32768):
        tt = torch.zeros(n, dtype=torch.int64)
        fn = lambda: C.ops.all_reduce_sum_max(tt, world, n // 2, "doubling")
        timed(fn, 10, barrier)
        sweep[str(n * 8)] = stats(timed(fn, max(30, args.rounds // 10), barrier))
    if ctx.rank == 0:
        out = {"world_size": ctx.world_size, "gather_bytes_per_rank": 8 * len(consensus.FIELDS),
               "reduce_bytes": 8 * layout.size, "pinned": bool(args.pin),
               "figure": "from_last_us (see figures())", "cases": res, "repeats": repeats,
               "waiting_rank": {"others_late_ms": WAIT_MS, **waits},
               "shm_rank0_waits": shm_waits, "doubling_by_bytes": sweep}
        with open(args.worker_out, "w") as f:
            json.dump(out, f)
    ctx.shutdown()


# ------------------------------------------------------------------------ host work, one process
def local(args) -> dict:
    """The round's own host work with no collective (issue 37): ``begin_round`` + ``end_round``
    of a coordinator over a group of one, ``--batch`` requests a round, and the reduced vector's
    parts alone (encode into the channel's buffer and read back, ``agreed`` + ``decode``).
    Per repeat the median wall time of a round and its thread CPU time (which a loaded host
    inflates less), then the medians over the repeats; microseconds. ``--cold-us`` adds
    ``round_cold``: a quarter of ``--rounds`` rounds each after a sleep of that long, timed one
    by one (an engine's round follows its wait for the GPU: the caches as the wait left them).
    ``bytecodes_per_round`` / ``python_calls_per_round``: the round's Python work counted over
    200 rounds (``sys.settrace`` opcode events; independent of the host's load)."""
    import torch

    from collectives import Group
    from adaptive_dist import consensus
    from adaptive_dist.config import AdaptiveConfig
    from adaptive_dist.coordinator import RoundCoordinator, RoundReport
    from adaptive_dist.policy import depth_policy

    torch.set_num_threads(1)
    cfg = AdaptiveConfig()
    b = args.batch
    accepts = [i % 4 for i in range(b)]
    coord = RoundCoordinator(cfg, Group.single(), clock=time.perf_counter,
                             verify_ladder=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128,
                                            192, 256, 384, 512))
    layout = consensus.ReducedLayout(depth_policy(cfg).reducer.needs)
    channel = consensus.ReduceChannel(Group.single(), layout, "doubling")
    vec = consensus.RoundVector(7, b, 0, 0, True, False, 0, False, b, 2.4837, b, 3, 0, -1, 7, 9,
                                ema_fail=0.3, period=0.004)
    red = channel.reduce(vec)

    def one_round() -> None:
        coord.begin_round(RoundReport(b, 0, True))
        coord.end_round(accepts)

    parts = {"round": one_round, "reduce": lambda: channel.reduce(vec),
             "agreed_decode": lambda: layout.agreed(red) and layout.decode(red)}
    if args.pieces:
        # the round's pieces one by one, each on a fixed input of the round above (the sum of
        # the pieces is not the round: a piece alone runs with warmer caches than in the round)
        from adaptive_dist.coordinator import RoundStats

        policy = coord.policy
        agree = (vec.round, vec.steps, vec.tokens, vec.counted, vec.last_switch,
                 vec.config_hash, vec.prev_plan_hash)
        enc_args = (vec.n_req, vec.num_tokens, vec.n_extend, vec.extend_len, vec.can_graph,
                    vec.done, vec.seq, vec.leave, vec.prev_n_req, vec.ema, vec.ema_fail,
                    vec.weight, vec.period, agree, vec.values)
        encode_round = getattr(layout, "encode_round", None)   # (an older tree: encode only)
        enc = encode_round(*enc_args) if encode_round else layout.encode(vec)
        reduce_encoded = getattr(channel, "reduce_encoded", None)
        cluster = layout.decode(red)
        state, estimate, scratch = coord.state, coord.local, RoundStats()
        parts.update({
            "p_report": lambda: RoundReport(b, 0, True),
            "p_encode": ((lambda: encode_round(*enc_args)) if encode_round
                         else (lambda: layout.encode(vec))),
            "p_pack_unpack": ((lambda: reduce_encoded(enc, 7)) if reduce_encoded
                              else (lambda: channel.reduce(vec))),
            "p_agreed": lambda: layout.agreed(red),
            "p_decode": lambda: layout.decode(red),
            "p_decide": lambda: policy.decide_pooled(state, cluster.prev_n_req_sum,
                                                     cluster.pooled, batch=b, table=None),
            "p_plan": lambda: coord._plan(cluster, False, ()),
            "p_plan_hash_digest": lambda: consensus.hash48(
                0, 7, consensus.plan_hash(3, 16, True, 4)),
            "p_observe": lambda: policy.observe(estimate, accepts, 3, None),
            "p_count_drafts": lambda: scratch.count_drafts(accepts, 3),
        })
    for _ in range(args.warmup):
        for fn in parts.values():
            fn()
    per = {name: {"wall_us": [], "cpu_us": []} for name in parts}
    chunk = 50
    for _ in range(args.repeats):
        samples = {name: ([], []) for name in parts}
        for _ in range(max(1, args.rounds // chunk)):
            for name, fn in parts.items():      # interleaved: a slow stretch falls on each
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(chunk):
                    fn()
                samples[name][0].append((time.perf_counter() - t0) / chunk * 1e6)
                samples[name][1].append((time.thread_time() - c0) / chunk * 1e6)
        for name, (wall, cpu) in samples.items():
            per[name]["wall_us"].append(statistics.median(wall))
            per[name]["cpu_us"].append(statistics.median(cpu))
        if args.cold_us > 0:
            # the engine's pattern: the host sleeps while the GPU runs, then one round, with
            # what the sleep left of the caches (each round timed alone)
            wall, cpu = [], []
            for _ in range(max(1, args.rounds // 4)):
                time.sleep(args.cold_us / 1e6)
                t0, c0 = time.perf_counter(), time.thread_time()
                one_round()
                cpu.append((time.thread_time() - c0) * 1e6)
                wall.append((time.perf_counter() - t0) * 1e6)
            cold = per.setdefault("round_cold", {"wall_us": [], "cpu_us": []})
            cold["wall_us"].append(statistics.median(wall))
            cold["cpu_us"].append(statistics.median(cpu))
    # the round's Python work, counted (independent of the host's load): bytecodes executed and
    # Python calls a round, by sys.settrace's opcode events over 200 rounds
    count = {"call": 0, "opcode": 0}

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event in count:
            count[event] += 1
        return trace
    sys.settrace(trace)
    try:
        for _ in range(200):
            one_round()
    finally:
        sys.settrace(None)
    return {"batch": b, "rounds": args.rounds, "repeats": args.repeats,
            "cold_us": args.cold_us, "bytecodes_per_round": count["opcode"] / 200,
            "python_calls_per_round": count["call"] / 200,
            **{name: {k: statistics.median(v) for k, v in d.items()} | {"per_repeat": d}
               for name, d in per.items()}}


# ---------------------------------------------------------------------------------- the model
def case_fig(run: dict, case: str, fig: str = "from_last_us") -> dict:
    """A case's statistics of figure ``fig`` (a run of this bench before the figures split has
    only rank 0's time, which it returns)."""
    entry = run["cases"][case]
    return entry[fig] if fig in entry else entry


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
        if any(case not in r["cases"] for r in fitted):
            continue
        per_hop = [case_fig(r, case)["median_us"] / hops(scheme, r["world_size"]) for r in fitted]
        fits[scheme] = {"alpha_us_per_hop": statistics.median(per_hop),
                        "fitted_worlds": [r["world_size"] for r in fitted]}
    base = min(fitted, key=lambda r: r["world_size"])
    sweep = sorted((int(b), s["median_us"]) for b, s in base["doubling_by_bytes"].items())
    _, per_byte = fit([(b * hops("reduce", base["world_size"]), t) for b, t in sweep])
    beta_intra = max(per_byte, 0.0) * 1e3            # ns per byte per step
    beta_inter = 1.0 / inter_gbps                    # ns per byte (GB/s)
    m_g, m_r = base["gather_bytes_per_rank"], base["reduce_bytes"]
    # shared memory within a host: every rank reads every slot, so a line in the ranks on it
    c_shm, a_shm = fit([(r["world_size"], case_fig(r, "reduce_shm")["median_us"])
                        for r in fitted]) if len(fitted) > 1 else \
        (case_fig(fitted[0], "reduce_shm")["median_us"], 0.0)
    fits["shm"] = {"intra_us": [c_shm, a_shm], "fitted_worlds": [r["world_size"] for r in fitted],
                   "what": "collective within one host: intra_us[0] + intra_us[1] x ranks"}

    def intra(k: int) -> float:
        return max(c_shm + a_shm * k, 0.0)

    def hierarchical(n: int) -> float:
        """shm in each host, recursive doubling among the hosts' leaders, the result published
        back through the segment (a one-flag hand-off, priced as a 2-rank exchange)."""
        if n <= NODE:
            return intra(n)
        hosts = math.ceil(n / NODE)
        hop = fits["reduce"]["alpha_us_per_hop"] + inter_alpha_us + m_r * beta_inter * 1e-3
        return intra(NODE) + hops("reduce", hosts) * hop + intra(2)

    extra = {}
    for n in (2, 4, 8, 16, 32, 64, 256, 1024):
        row = {}
        for scheme, size in (("gather", m_g), ("reduce", m_r), ("ring_allreduce", m_r)):
            if scheme not in fits:
                continue
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
        row["shm_hierarchical"] = hierarchical(n)
        extra[str(n)] = row
    return {"fits": fits, "beta_intra_ns_per_byte": beta_intra,
            "beta_inter_ns_per_byte": beta_inter, "inter_alpha_us": inter_alpha_us,
            "ranks_per_node": NODE, "extrapolated_us": extra,
            "hosts_128_of_8_us": extra["1024"]}


def plot(runs: list[dict], mdl: dict, path: str) -> None:
    from scripts.bench.common import pyplot, save

    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ws = [r["world_size"] for r in runs]
    for case, label in (("gather", "all-gather + read (old)"), ("reduce", "reduce, doubling"),
                        ("reduce_gloo_ring", "gloo ring all-reduce x2"),
                        ("reduce_shm", "reduce, shared memory"),
                        ("reduce_shm_spin0", "reduce, shared memory, no spin"),
                        ("reduce_shm_early", "reduce, shared memory, early wake"),
                        ("reduce_steady", "reduce, doubling, back to back"),
                        ("reduce_shm_steady", "reduce, shared memory, back to back"),
                        ("begin_round_gather", "begin_round, gather"),
                        ("begin_round_reduce", "begin_round, reduce (doubling)"),
                        ("begin_round_shm", "begin_round, reduce (shared memory)"),
                        ("begin_round_shm_steady", "begin_round, shared memory, back to back"),
                        ("begin_round_local", "begin_round, host work alone (group of one)"),
                        ("begin_round_local_steady", "begin_round, host work alone, back to back")):
        if any(case not in r["cases"] for r in runs):
            continue
        med = [case_fig(r, case)["median_us"] for r in runs]
        p90 = [case_fig(r, case)["p90_us"] for r in runs]
        a1.errorbar(ws, med, yerr=[[0] * len(med), [p - m for p, m in zip(p90, med)]],
                    marker="o", capsize=3, label=label)
    a1.set_xscale("log", base=2)
    a1.set_xlabel("ranks (this host, oversubscribed past its cores)")
    a1.set_ylabel("µs from the last rank's call (median, bar to p90)")
    a1.set_title("measured, CPU ranks on one host")
    a1.legend(fontsize=8)
    ext = mdl["extrapolated_us"]
    ns = sorted(int(n) for n in ext)
    for scheme, label in (("gather", "ring all-gather (old)"), ("reduce", "recursive doubling"),
                          ("ring_allreduce", "gloo ring all-reduce x2"),
                          ("shm_hierarchical", "shm in a node, doubling across")):
        if scheme not in ext[str(ns[0])]:
            continue
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
    ap.add_argument("--all-cases", action="store_true",
                    help="also the old all-gather and gloo's ring all-reduce (slow at 16 ranks)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="measurements of every case per world (medians of their medians)")
    ap.add_argument("--inter-node-latency-us", type=float, default=15.0)
    ap.add_argument("--inter-node-gbps", type=float, default=25.0, help="GB/s between nodes")
    ap.add_argument("--out", default="runs/consensus")
    ap.add_argument("--refit", action="store_true",
                    help="no measurement: fit the model again to OUT/world*.json")
    ap.add_argument("--local", action="store_true",
                    help="no ranks: the round's host work in this process (begin_round + "
                         "end_round over a group of one, and the reduced vector's parts)")
    ap.add_argument("--batch", type=int, default=4, help="--local: requests a round")
    ap.add_argument("--pieces", action="store_true",
                    help="--local: also each piece of the round alone (p_*: the report, "
                         "encode, the buffer's pack and unpack, agreed, decode, the policy's "
                         "decision, the plan, its hash and the digest, observe, count_drafts)")
    ap.add_argument("--cold-us", type=float, default=500.0,
                    help="--local: also round_cold, each round after a sleep of this many µs "
                         "(0: not measured)")
    ap.add_argument("--spin-us", type=float, nargs="*", default=[0.0],
                    help="also the shared-memory reduction with these spin bounds, in µs "
                         "(reduce_shm_spin<us>; 0: never spin; the default channel has the "
                         "transport's own bound, ADAPTIVE_DIST_SHM_SPIN_US if set)")
    ap.add_argument("--early-wake", action="store_true",
                    help="also the shared-memory reduction whose last but one arrival wakes the "
                         "sleepers (reduce_shm_early; ADAPTIVE_DIST_SHM_EARLY_WAKE=1)")
    ap.add_argument("--pin", action="store_true",
                    help="pin each rank to one CPU (its local rank modulo the CPUs it may use); "
                         "default: not pinned, the scheduler places the ranks")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    if args.local:
        print(json.dumps(local(args)), flush=True)
        return
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
               "--rounds", str(args.rounds), "--warmup", str(args.warmup),
               "--repeats", str(args.repeats), "--worker-out", part] + \
            (["--all-cases"] if args.all_cases else []) + (["--pin"] if args.pin else []) + \
            ["--spin-us", *(f"{us:g}" for us in args.spin_us)] + \
            (["--early-wake"] if args.early_wake else [])
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(part) as f:
            runs.append(json.load(f))
        print(json.dumps({"world": n, **{k: [round(case_fig(runs[-1], k)["median_us"]),
                                             round(case_fig(runs[-1], k)["p90_us"])]
                                         for k in runs[-1]["cases"]},
                          "skew_us": {k: round(v["skew_us"]["median_us"])
                                      for k, v in runs[-1]["cases"].items() if "skew_us" in v},
                          "waiting_rank_cpu_share": {
                              k: [round(v["cpu_share"], 3), round(v.get("thread_cpu_share", -1), 3),
                                  round(v.get("wait_cpu_us_per_call", -1), 1)]
                              for k, v in
                              runs[-1]["waiting_rank"].items() if isinstance(v, dict)}}),
              flush=True)
    mdl = model(runs, os.cpu_count() or 1, args.inter_node_latency_us, args.inter_node_gbps)
    import torch

    res = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "backend": "gloo (loopback, CPU ranks) and shared memory", "rounds": args.rounds,
           "repeats": args.repeats, "pinned": args.pin,
           "oversubscribed": [n for n in args.worlds if n > (os.cpu_count() or 1)],
           "runs": runs, "model": mdl}
    from scripts.bench.common import write_json

    write_json(os.path.join(args.out, "results.json"), res, indent=2)
    try:
        plot(runs, mdl, os.path.join(args.out, "consensus_cost.png"))
    except ImportError as exc:
        print(f"[consensus] no plot ({exc}); the numbers are in results.json", flush=True)
    print(json.dumps(mdl["fits"]), json.dumps(mdl["extrapolated_us"]))
    print("128 hosts of 8 (model, us):", json.dumps(mdl["hosts_128_of_8_us"]))


if __name__ == "__main__":
    main()
