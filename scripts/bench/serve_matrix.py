"""`scripts.bench.serve` over a matrix: decoding modes x concurrencies, repeats interleaved.

    python -m scripts.bench.serve_matrix --nproc 2 --serve "--dp 2 --device cuda" \
        [--modes steps1 steps3 steps7 adaptive] [--concurrency 4 32] \
        [--repeats 3] [--phases code:40,high_entropy:40,repetitive:40] [--out DIR]

One server per mode (started once, `serve SERVE MODE`); for every repeat the modes take turns
(order rotated) and each runs every concurrency against its server (`scripts.bench.serve --url`).
Writes `OUT/<mode>/c<N>_r<R>/results.json` (one per run), `OUT/summary.json` (per mode and
concurrency: medians and min-max over the repeats of tokens/s, TTFT and ITL p50/p95/p99,
and the idle probe's frontend overhead) and `OUT/serve_matrix.png`; prints a table.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from collectives import free_port
from scripts.bench.common import pyplot, save, write_json
from scripts.bench.server_process import ServerProcess


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--serve", default="", help="flags every server gets")
    p.add_argument("--modes", nargs="+", default=["steps1", "steps3", "steps7", "adaptive"],
                   help="stepsK (static depth K), adaptive, nospec")
    p.add_argument("--concurrency", nargs="+", type=int, default=[4, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--phases", default="code:40,high_entropy:40,repetitive:40")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="runs/serve_matrix")
    return p.parse_args()


def flags_of(mode: str) -> list[str]:
    if mode.startswith("steps"):
        return ["--steps", mode[len("steps"):]]
    if mode in ("adaptive", "nospec"):
        return ["--" + mode.replace("nospec", "no-spec")]
    raise SystemExit(f"--modes: unknown mode {mode!r}; allowed: stepsK, adaptive, nospec")


def run_bench(url: str, conc: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "scripts.bench.serve", "--url", url,
           "--concurrency", str(conc), "--phases", args.phases, "--max-tokens",
           str(args.max_tokens), "--idle-probe", "5", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())


def spread(xs: list[float]) -> dict[str, float]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for mode in args.modes:
            flags = shlex.split(args.serve) + flags_of(mode)
            servers[mode] = ServerProcess(flags, free_port(), nproc=args.nproc).wait_ready()
        runs: dict[tuple[str, int], list[dict]] = {}
        total = args.repeats * len(args.modes) * len(args.concurrency)
        done = 0
        for rep in range(args.repeats):
            order = args.modes[rep % len(args.modes):] + args.modes[:rep % len(args.modes)]
            for mode in order:
                for conc in args.concurrency:
                    res = run_bench(servers[mode].url, conc, args,
                                    out / mode / f"c{conc}_r{rep}")
                    runs.setdefault((mode, conc), []).append(res)
                    done += 1
                    overall = res["summary"]["overall"]
                    print(f"[{done}/{total}] {mode} c={conc}: "
                          f"{overall['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    summary = {}
    for (mode, conc), results in runs.items():
        ov = [r["summary"]["overall"] for r in results]
        probe = [r.get("idle_probe") or {} for r in results]
        summary[f"{mode} | c={conc}"] = {
            "mode": mode, "concurrency": conc, "repeats": len(results),
            "tokens_per_s": spread([o["tokens_per_s"] for o in ov]),
            **{f"{k}_{q}": spread([o[k][q] for o in ov]) for k in ("ttft_s", "itl_s")
               for q in ("p50", "p90", "p99")},
            "errors": sum(o["errors"] for o in ov),
            "frontend_overhead_s": spread([p.get("frontend_overhead_s_mean") for p in probe]),
        }
    write_json(out / "summary.json", {"args": vars(args), "summary": summary})
    plot(summary, out / "serve_matrix.png")
    print(table(summary))
    return 0


def table(summary: dict) -> str:
    def ms(x: Any) -> str:
        return "-" if x is None else f"{1000 * x:.1f}"

    lines = [f"{'mode | concurrency':<24}{'tok/s':>8}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
             f"{'ITL p50':>9}{'p90':>7}{'p99':>7}{'err':>5}{'frontend':>10}  (ms; medians)"]
    for key, s in summary.items():
        lines.append(f"{key:<24}{s['tokens_per_s']['median']:>8.0f}"
                     f"{ms(s['ttft_s_p50']['median']):>10}{ms(s['ttft_s_p90']['median']):>8}"
                     f"{ms(s['ttft_s_p99']['median']):>8}{ms(s['itl_s_p50']['median']):>9}"
                     f"{ms(s['itl_s_p90']['median']):>7}{ms(s['itl_s_p99']['median']):>7}"
                     f"{s['errors']:>5}{ms(s['frontend_overhead_s']['median']):>10}")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    modes = list(dict.fromkeys(s["mode"] for s in summary.values()))
    concs = sorted({s["concurrency"] for s in summary.values()})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        for ax, key, scale in ((axes[0], "tokens_per_s", 1), (axes[1], "ttft_s_p50", 1000)):
            xs, ys, lo, hi = [], [], [], []
            for i, c in enumerate(concs):
                s = summary.get(f"{mode} | c={c}")
                if s is None or s[key]["median"] is None:
                    continue
                xs.append(i + (k - (len(modes) - 1) / 2) * width)
                ys.append(s[key]["median"] * scale)
                lo.append((s[key]["median"] - s[key]["min"]) * scale)
                hi.append((s[key]["max"] - s[key]["median"]) * scale)
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=mode)
    for ax, title in ((axes[0], "tokens/s"), (axes[1], "TTFT p50 (ms)")):
        ax.set_xticks(range(len(concs)), [f"concurrency {c}" for c in concs])
        ax.set_title(title + " (median, min-max)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
