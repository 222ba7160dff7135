"""Measure the per-round consensus cost: the one all-gather of the consensus vector (with the
result read on the host), and a whole ``begin_round`` (gather + pre-flight + decision + plan).

    torchrun --nproc-per-node 2 -m scripts.bench.consensus --rounds 2000 --out runs/consensus_cpu
    (on GPUs the device group is NCCL; add --backend gloo to force CPU)

Writes OUT/results.json and OUT/consensus_cost.png (rank 0).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import collectives as C
from adaptive_dist import consensus
from adaptive_dist.config import AdaptiveConfig
from adaptive_dist.controller import AdaptiveController
from scripts.bench.common import pyplot, save, write_json


def timed(fn, n: int, sync: bool, bar=None) -> list[float]:
    out = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
        if bar is not None:
            bar.update(1)
    return out


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_us": statistics.median(xs), "p10_us": xs[len(xs) // 10],
            "p90_us": xs[9 * len(xs) // 10], "mean_us": statistics.fmean(xs), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    ap.add_argument("--channel", choices=consensus.CHANNELS, default="control",
                    help="control: the gloo control group (what the engine uses); device: the "
                         "device group (NCCL on GPUs)")
    ap.add_argument("--out", default="runs/consensus")
    args = ap.parse_args()
    ctx = C.init_distributed(timeout_s=60, backend=None if args.backend == "auto" else args.backend,
                             record=False)
    layout = ctx.layout(dp=ctx.world_size)
    dp = layout.group("dp")
    sync = ctx.device.type == "cuda"
    vec = consensus.RoundVector(0, 4, 16, 0, True, False, 0, False, 4, 2.5, 4, 3, 0, -1, 7, 9)
    ctrl = AdaptiveController(AdaptiveConfig(), dp, channel=args.channel)

    channel = consensus.ConsensusChannel(dp, args.channel)

    def gather_read():
        channel.gather(vec)  # all-gather + copy to host (blocks until done)

    def ctrl_round():
        ctrl.begin_round(4, 16, True)
        ctrl.end_round([1, 2, 3, 2])

    bar = None
    if ctx.rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=2 * (args.rounds + args.warmup), desc="bench", unit="round")
    timed(gather_read, args.warmup, sync, bar)
    raw = timed(gather_read, args.rounds, sync, bar)
    timed(ctrl_round, args.warmup, sync, bar)
    full = timed(ctrl_round, args.rounds, sync, bar)
    if bar is not None:
        bar.close()
    if ctx.rank == 0:
        backend = ctx.backend or "none"
        res = {
            "backend": backend, "channel": args.channel, "world_size": ctx.world_size, "device": str(ctx.device),
            "gpu": torch.cuda.get_device_name(0) if sync else None,
            "torch": torch.__version__, "host": platform.node(),
            "vector_fields": len(consensus.FIELDS),
            "gather_and_read": stats(raw), "begin_round_full": stats(full),
        }
        write_json(os.path.join(args.out, "results.json"), res, indent=2)
        plot(raw, full, f"{backend}, {args.channel} channel",
             os.path.join(args.out, "consensus_cost.png"))
        print(json.dumps({k: res[k] for k in ("backend", "world_size", "gather_and_read",
                                               "begin_round_full")}))
    ctx.shutdown()


def plot(raw: list[float], full: list[float], backend: str, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    hi = sorted(full)[int(0.99 * len(full))]
    bins = [hi * i / 60 for i in range(61)]
    ax.hist([min(x, hi) for x in raw], bins=bins, alpha=0.6, label="all-gather + host read")
    ax.hist([min(x, hi) for x in full], bins=bins, alpha=0.6, label="whole begin_round")
    ax.set_xlabel("microseconds per round (clipped at p99)")
    ax.set_ylabel("rounds")
    ax.set_title(f"per-round consensus cost ({backend})")
    ax.legend()
    save(fig, path)


if __name__ == "__main__":
    main()
