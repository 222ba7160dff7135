"""DP attention under a phased, heterogeneous workload: static depths against adaptive policies.

    torchrun --nproc-per-node N -m scripts.bench.dp --dp D [--attn-tp A] [--device cpu|cuda]
        [--model DIR [--draft-model DIR]] [--batch B] [--new-tokens T] [--repeats R] [--policies static1 static3 static7 ema ema_min]
        [--out DIR]

Two phases: in phase A replica 0 gets high-entropy prompts (random base64: the draft is almost
always wrong) and replica 1 repetitive ones (the draft is almost always right); in phase B the
regimes swap. Every replica runs `--batch` requests of `--new-tokens` tokens per phase (greedy, no
stop token). One engine per policy (CUDA graphs captured once per engine); each run starts the
policy afresh (a new controller at the initial depth). The runs are interleaved over the repeats
(policy order rotated each repeat). Per run: tokens/s of the whole cluster per phase and overall
(rank 0's wall clock, synchronised), switches, share of rounds at each depth, the depth timeline,
and the cost of the round's one metadata + consensus collective (time in `begin_round`) and its
share of the round. Writes `OUT/results.json` and `OUT/dp_bench.png`; prints a table (medians,
min-max over the repeats).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

import collectives as C
from adaptive_dist.config import AdaptiveConfig
from adaptive_dist.coordinator import RoundCoordinator
from scripts.bench.common import (add_overlap_argument, build, encode_prompts, gpu_name,
                                  load_pair, make_prompts, overlap_of, pyplot, save,
                                  settle_heap, spread, static_spec, sync, tokenizer, write_json)
from workers.engine import Engine
from workers.loading import DEFAULT_MODEL
from workers.model import ModelParallel
from workers.sampling import SamplingParams

POLICIES = ("static1", "static3", "static7", "ema", "ema_min")


def spec_of(policy: str) -> AdaptiveConfig:
    if policy.startswith("static"):
        return static_spec(int(policy[len("static"):]))
    reducer = "min" if policy == "ema_min" else "weighted_mean"
    return AdaptiveConfig(reducer=reducer)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add_overlap_argument(p)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--attn-tp", type=int, default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="target directory, or a directory with target/ and eagle/ (as generate)")
    p.add_argument("--draft-model", default=None, help="draft head directory (as generate)")
    p.add_argument("--batch", type=int, default=8, help="requests per replica per phase")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs on cuda")
    p.add_argument("--out", default="runs/bench_dp")
    return p.parse_args()


def fresh_policy(engine: Engine, spec: AdaptiveConfig, world: Any, guard: Any) -> None:
    """Start the policy afresh: a new coordinator, the initial depth applied."""
    engine.planner = RoundCoordinator(spec, world, guard=guard,
                                      verify_ladder=engine.config.verify_ladder)
    engine.pool.apply(spec.initial_steps)


def run_once(engine: Engine, phases: list[list[list[int]]], new_tokens: int,
             device: str) -> dict[str, Any]:
    """Both phases on this rank's replica; per phase: wall seconds and tokens of this replica."""
    out: dict[str, Any] = {"phases": []}
    round0 = engine.planner.round
    plan0, total0 = engine.stats.plan_seconds, engine.stats.round_seconds
    for prompts in phases:
        sync(device)
        start = time.perf_counter()
        reqs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
        sync(device)
        out["phases"].append({"seconds": time.perf_counter() - start,
                              "tokens": sum(len(r.output_ids) for r in reqs),
                              "accepted": sum(r.accepted for r in reqs),
                              "spec_rounds": sum(r.spec_rounds for r in reqs)})
    stats = engine.planner.stats
    out.update(switches=stats.switches, rounds=engine.planner.round - round0,
               rounds_at_steps={str(k): v for k, v in sorted(stats.rounds_at_steps.items())},
               timeline=[list(x) for x in stats.steps_timeline],
               plan_seconds=engine.stats.plan_seconds - plan0,
               round_seconds=engine.stats.round_seconds - total0)
    return out


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else 4)
    backend = "gloo" if args.device == "cpu" else None
    ctx = C.init_distributed(timeout_s=120, backend=backend, record=True)
    attn_tp = args.attn_tp or ctx.world_size // args.dp
    layout = ctx.layout(dp=args.dp)
    world = layout.group("world")
    par = ModelParallel.from_layout(layout)
    device = str(ctx.device) if args.device == "cuda" else "cpu"
    target, head = load_pair(args.model, device, draft=args.draft_model, par=par,
                             half=args.device == "cuda")
    texts = make_prompts(args.batch, seed=1)
    tok = tokenizer(args.model, args.draft_model, target.config.vocab_size)
    enc = encode_prompts(texts, tok.encode)
    mine = par.replica % 2
    regimes = [["high_entropy", "repetitive"][mine], ["repetitive", "high_entropy"][mine]]
    phases = [enc[r] for r in regimes]
    longest = max(len(p) for ps in enc.values() for p in ps) + args.new_tokens
    guard = ctx.guard(world, check_every=16) if ctx.distributed else None
    engines: dict[str, Engine] = {}
    for policy in args.policies:
        engines[policy] = build(spec_of(policy), target, head, batch=args.batch,
                                context=longest, device=device,
                                graphs=args.device == "cuda" and not args.eager, group=world,
                                guard=guard, dp=args.dp, attn_tp=attn_tp,
                                **overlap_of(args, args.device))
        engines[policy].warmup()
        run_once(engines[policy], [p[:2] for p in phases], 8, args.device)  # warm every shape
    settle_heap()
    bar = None
    if ctx.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.repeats * len(args.policies), desc="bench_dp", unit="run")
    records = []
    for rep in range(args.repeats):
        order = args.policies[rep % len(args.policies):] + args.policies[:rep % len(args.policies)]
        for policy in order:
            engine = engines[policy]
            fresh_policy(engine, spec_of(policy), world, guard)
            res = run_once(engine, phases, args.new_tokens, args.device)
            parts: list[Any] = [res]
            if world.size > 1:
                import torch.distributed as dist

                parts = [None] * world.size
                dist.all_gather_object(parts, res, group=world.control_pg)
            if ctx.rank == 0:
                records.append(summarise(policy, rep, parts, layout))
                if bar is not None:
                    bar.set_postfix_str(f"{policy}: {records[-1]['tokens_per_second']:.0f} tok/s")
                    bar.update()
    if bar is not None:
        bar.close()
    for engine in engines.values():
        engine.close()
    if guard is not None:
        guard.close()
    if ctx.rank == 0:
        write(args, records, ctx, attn_tp)
    ctx.shutdown()
    return 0


def summarise(policy: str, rep: int, parts: list[dict], layout: Any) -> dict[str, Any]:
    """One run across the cluster (rank 0's clock; tokens of every replica's leader)."""
    leaders = parts[::layout.attn_tp]
    phases = []
    for i in range(len(parts[0]["phases"])):
        secs = parts[0]["phases"][i]["seconds"]
        tokens = sum(p["phases"][i]["tokens"] for p in leaders)
        accepted = sum(p["phases"][i]["accepted"] for p in leaders)
        rounds = sum(p["phases"][i]["spec_rounds"] for p in leaders)
        phases.append({"tokens": tokens, "seconds": secs, "tokens_per_second": tokens / secs,
                       "mean_accept": accepted / rounds if rounds else None})
    total_s = sum(p["seconds"] for p in phases)
    total_t = sum(p["tokens"] for p in phases)
    lead = parts[0]
    rounds = max(lead["rounds"], 1)
    # the rank that reaches the collective last waits least: its time is the collective's own
    # cost (plus the decision); the others' also hold their wait for the slower rank
    last = min(parts, key=lambda p: p["plan_seconds"])
    return {"policy": policy, "repeat": rep, "tokens_per_second": total_t / total_s,
            "phases": phases, "switches": lead["switches"], "rounds": lead["rounds"],
            "rounds_at_steps": lead["rounds_at_steps"], "timeline": lead["timeline"],
            "consensus_us_per_round": 1e6 * lead["plan_seconds"] / rounds,
            "consensus_us_last_arriver": 1e6 * last["plan_seconds"] / rounds,
            "round_us": 1e6 * lead["round_seconds"] / rounds,
            "consensus_share": lead["plan_seconds"] / max(lead["round_seconds"], 1e-9)}


def write(args: argparse.Namespace, records: list[dict], ctx: Any, attn_tp: int) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for policy in args.policies:
        mine = [r for r in records if r["policy"] == policy]
        summary[policy] = {
            "tokens_per_second": spread([r["tokens_per_second"] for r in mine]),
            "phase_tokens_per_second": [spread([r["phases"][i]["tokens_per_second"] for r in mine])
                                        for i in range(len(mine[0]["phases"]))],
            "switches": spread([r["switches"] for r in mine]),
            "consensus_us_per_round": spread([r["consensus_us_per_round"] for r in mine]),
            "consensus_us_last_arriver": spread([r["consensus_us_last_arriver"] for r in mine]),
            "round_us": spread([r["round_us"] for r in mine]),
            "consensus_share": spread([r["consensus_share"] for r in mine]),
            "rounds_at_steps": mine[-1]["rounds_at_steps"]}
    meta = {"world": ctx.world_size, "dp": args.dp, "attn_tp": attn_tp, "device": args.device,
            "overlap": bool(overlap_of(args, args.device)),
            "gpu": gpu_name(args.device),
            "backend": ctx.backend, "torch": torch.__version__, "batch_per_replica": args.batch,
            "new_tokens": args.new_tokens, "repeats": args.repeats,
            "cuda_graphs": args.device == "cuda" and not args.eager,
            "phases": ["A: replica 0 high-entropy, replica 1 repetitive", "B: swapped"],
            "command": " ".join(sys.argv)}
    write_json(out / "results.json", {"meta": meta, "summary": summary, "runs": records})
    plot(summary, records, meta, out / "dp_bench.png")
    print(table(summary))
    print(f"wrote {out / 'results.json'} and {out / 'dp_bench.png'}")


def table(summary: dict) -> str:
    lines = [f"{'policy':<10}{'tok/s median (min-max)':>28}{'phase A':>10}{'phase B':>10}"
             f"{'switches':>10}{'consensus us':>14}{'(last rank)':>12}{'share':>8}"]
    for policy, s in summary.items():
        t = s["tokens_per_second"]
        pa, pb = (x["median"] for x in s["phase_tokens_per_second"])
        lines.append(f"{policy:<10}{t['median']:>12.0f} ({t['min']:.0f}-{t['max']:.0f})"
                     f"{pa:>10.0f}{pb:>10.0f}{s['switches']['median']:>10.0f}"
                     f"{s['consensus_us_per_round']['median']:>14.0f}"
                     f"{s['consensus_us_last_arriver']['median']:>12.0f}"
                     f"{100 * s['consensus_share']['median']:>7.1f}%")
    return "\n".join(lines)


def plot(summary: dict, records: list[dict], meta: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    names = list(summary)
    med = [summary[n]["tokens_per_second"]["median"] for n in names]
    lo = [m - summary[n]["tokens_per_second"]["min"] for n, m in zip(names, med)]
    hi = [summary[n]["tokens_per_second"]["max"] - m for n, m in zip(names, med)]
    ax.bar(names, med, yerr=[lo, hi], capsize=4, color="tab:blue")
    ax.set_ylabel("cluster tokens/s (median, min-max)")
    ax.set_title(f"dp={meta['dp']} x attn_tp={meta['attn_tp']}, {meta['device']}, "
                 f"{meta['batch_per_replica']} req/replica/phase")
    ax.grid(axis="y", alpha=0.3)
    for n in names:
        if n.startswith("ema"):
            run = next(r for r in records if r["policy"] == n)
            xs, ys = [], []
            for (r0, s0), (r1, _) in zip(run["timeline"], run["timeline"][1:] + [[run["rounds"], 0]]):
                xs += [r0, r1]
                ys += [s0, s0]
            ax2.plot(xs, ys, label=n)
    ax2.set_xlabel("round")
    ax2.set_ylabel("draft depth in force")
    ax2.set_title("depth timeline (first repeat; phase B starts halfway)")
    ax2.legend()
    ax2.grid(alpha=0.3)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
