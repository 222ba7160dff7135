"""Write phased, heterogeneous acceptance traces for consensus-only mode.

Each rank walks through phases of different acceptance regimes (high-entropy payloads where
almost nothing is accepted, code in the middle, repetitive text that saturates any depth), at
different times on different ranks, with idle stretches, bursts past the largest CUDA-graph
bucket, rounds where a rank cannot use a graph, and one rank whose trace ends early.

    python -m scripts.gen.make_traces --ranks 2 --rounds 400 --out traces/ --seed 0
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from adaptive_dist.outputs import OutputError, check_output_dir, write_lines
from adaptive_dist.trace import RANK_FILE

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


def check_out_dir(out: Path, ranks: int) -> None:
    """At start: ``--out`` must be (or become) a writable directory without trace files of
    other ranks (a later run on it would read, or refuse, stale ones)."""
    check_output_dir(str(out), "--out")
    stale = sorted((p.name for p in out.iterdir()
                    if (m := RANK_FILE.fullmatch(p.name)) and not int(m.group(1)) < ranks),
                   key=lambda n: (len(n), n))
    if stale:
        raise OutputError(f"--out {str(out)!r} already holds {', '.join(stale)} from another run "
                          f"(this run writes {ranks} rank file(s)); remove them or choose an "
                          f"empty directory")


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="number of ranks (one file each)")
    ap.add_argument("--rounds", type=int, default=400, help="rounds of the longest trace")
    ap.add_argument("--out", required=True, help="directory for rank{R}.jsonl (created if needed)")
    ap.add_argument("--seed", type=int, default=0, help="random seed")
    ap.add_argument("--early-end", type=float, default=0.6,
                    help="the last rank's trace ends after this fraction of the rounds")
    args = ap.parse_args()
    if args.ranks < 1 or args.rounds < 1:
        ap.error("--ranks and --rounds must be >= 1")
    if not 0 < args.early_end <= 1:
        ap.error(f"--early-end {args.early_end}: must be in (0, 1]")
    out = Path(args.out)
    try:
        check_out_dir(out, args.ranks)
        for rank in range(args.ranks):
            rng = random.Random(f"{args.seed}/{rank}")  # independent stream per (seed, rank)
            n = args.rounds
            if rank == args.ranks - 1 and args.ranks > 1:
                n = max(1, int(args.rounds * args.early_end))
            # each file whole or not at all (temporary file + rename): no torn line on a full disk
            write_lines(str(out / f"rank{rank}.jsonl"),
                        (json.dumps(line) for line in make_rank_trace(rng, n)), "--out")
    except OutputError as exc:
        sys.stderr.write(f"make_traces.py: error: {exc}\n")
        return 2
    print(f"wrote {args.ranks} trace(s) of up to {args.rounds} rounds to {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
