"""The host's single-thread speed over time: is this machine's CPU steady enough to benchmark on?

    python -m scripts.diag.host_probe [--seconds 60] [--window 0.25] [--out runs/host_probe]

A fixed pure-Python workload (the kind of work the engine's host side does per round) is counted
in consecutive windows of `--window` seconds for `--seconds`; each window's rate is reported
against the median window. The engine's rounds at depth 0 and at small batches are close to
host-bound, so a host whose speed swings by 1.8x (seen on the benchmark machine: stretches of
seconds to tens of seconds at one of two speeds) swings their tokens/s with it, one-sidedly:
interleaved repeats then show spreads far beyond the device's, and the medians of host-bound
configurations move between runs. Run it before and after a benchmark; with `share_below_0.8`
(windows slower than 0.8x the median) or `max_rel / min_rel` well above 1.2, read the benchmark's
best-of-N beside its medians. Writes OUT/host_probe.json and OUT/host_probe.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to probe")
    p.add_argument("--window", type=float, default=0.25, help="seconds per sample window")
    p.add_argument("--out", default="runs/host_probe")
    args = p.parse_args()
    if not args.window > 0:
        p.error(f"--window {args.window}: must be > 0")
    if not args.seconds >= args.window:
        p.error(f"--seconds {args.seconds}: must be >= --window ({args.window})")
    return args


def work() -> int:
    total = 0
    for i in range(2000):
        total += i * i
    return total


def probe(seconds: float, window: float) -> list[float]:
    """Workload runs per second, one value per window."""
    from tqdm import tqdm

    rates: list[float] = []
    windows = int(seconds / window)
    for _ in tqdm(range(windows), desc="host_probe", unit="window", mininterval=1.0):
        start = time.perf_counter()
        runs = 0
        while time.perf_counter() - start < window:
            work()
            runs += 1
        rates.append(runs / (time.perf_counter() - start))
    return rates


def summary(rates: list[float]) -> dict:
    med = statistics.median(rates)
    rel = [r / med for r in rates]
    return {"windows": len(rates), "median_rate": med, "min_rel": min(rel), "max_rel": max(rel),
            "share_below_0.8": sum(r < 0.8 for r in rel) / len(rel),
            "share_above_1.25": sum(r > 1.25 for r in rel) / len(rel),
            "timeline_rel": [round(r, 3) for r in rel]}


def plot(result: dict, window: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rel = result["timeline_rel"]
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.plot([i * window for i in range(len(rel))], rel, lw=0.8)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xlabel("seconds")
    ax.set_ylabel("speed / median window")
    ax.set_title("host single-thread speed")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = summary(probe(args.seconds, args.window))
    result["meta"] = {"seconds": args.seconds, "window": args.window,
                      "command": " ".join(sys.argv)}
    (out / "host_probe.json").write_text(json.dumps(result, indent=1))
    plot(result, args.window, out / "host_probe.png")
    print(f"host speed over {result['windows']} windows: min x{result['min_rel']:.2f}, "
          f"max x{result['max_rel']:.2f} of the median; {100 * result['share_below_0.8']:.0f}% "
          f"below x0.8, {100 * result['share_above_1.25']:.0f}% above x1.25")
    print(f"wrote {out / 'host_probe.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
