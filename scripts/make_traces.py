"""Write phased, heterogeneous acceptance traces for consensus-only mode.

Each rank walks through phases of different acceptance regimes (high-entropy payloads where
almost nothing is accepted, code in the middle, repetitive text that saturates any depth), at
different times on different ranks, with idle stretches, bursts past the largest CUDA-graph
bucket, rounds where a rank cannot use a graph, and one rank whose trace ends early.

    python scripts/make_traces.py --ranks 2 --rounds 400 --out traces/ --seed 0
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Per-token probability that the next draft token is accepted, by regime.
REGIMES = {"entropy": 0.05, "code": 0.72, "repetitive": 0.97}
MAX_ACCEPT = 16  # "unlimited steps" is capped here; the replay caps again at the steps in force


def accept_length(rng: random.Random, p: float) -> int:
    """Consecutive accepted draft tokens when each is accepted with probability ``p``."""
    n = 0
    while n < MAX_ACCEPT and rng.random() < p:
        n += 1
    return n


def make_phases(rng: random.Random, rounds: int) -> list[tuple[int, str]]:
    """(length, regime) phases covering ``rounds``; 'idle' phases have no requests."""
    phases, left = [], rounds
    while left > 0:
        regime = rng.choices(list(REGIMES) + ["idle"], weights=[3, 4, 3, 1])[0]
        length = min(left, rng.randint(15, 90) if regime != "idle" else rng.randint(3, 25))
        phases.append((length, regime))
        left -= length
    return phases


def make_rank_trace(rng: random.Random, rounds: int) -> list[dict]:
    lines = []
    base_batch = rng.choice([2, 4, 8, 12])
    for length, regime in make_phases(rng, rounds):
        for _ in range(length):
            if regime == "idle":
                lines.append({"accept": []})
                continue
            batch = max(1, base_batch + rng.randint(-2, 2))
            if rng.random() < 0.03:
                batch = rng.randint(65, 90)  # burst past the largest graph bucket -> eager
            p = REGIMES[regime]
            acc = [accept_length(rng, p) for _ in range(batch)]
            line = {"accept": acc, "num_tokens": batch * 4}
            if rng.random() < 0.02:
                line["can_graph"] = False
            lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--early-end", type=float, default=0.6,
                    help="the last rank's trace ends after this fraction of the rounds")
    args = ap.parse_args()
    if args.ranks < 1 or args.rounds < 1:
        ap.error("--ranks and --rounds must be >= 1")
    if not 0 < args.early_end <= 1:
        ap.error(f"--early-end {args.early_end}: must be in (0, 1]")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(args.ranks):
        rng = random.Random(f"{args.seed}/{rank}")  # independent stream per (seed, rank)
        n = args.rounds
        if rank == args.ranks - 1 and args.ranks > 1:
            n = max(1, int(args.rounds * args.early_end))
        with (out / f"rank{rank}.jsonl").open("w") as f:
            for line in make_rank_trace(rng, n):
                f.write(json.dumps(line) + "\n")
    print(f"wrote {args.ranks} trace(s) of up to {args.rounds} rounds to {out}/")


if __name__ == "__main__":
    main()
