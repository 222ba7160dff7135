"""SGLang's serving benchmark, unmodified (`python -m sglang.bench_serving`), against this server:
a one-process server and a `--dp 2` torchrun cluster, its completions backend (`vllm`) and a chat
backend (`vllm-chat`), its random dataset at small input/output lengths, its tokenizer the
bundled pair's (`workers/assets/tiny_pair/target`: tokenizer.json + tokenizer_config.json).

    python -m scripts.bench.sglang_client [--setups one,dp2] [--backends vllm,vllm-chat] \\
        [--num-prompts 24] [--input-len 64] [--output-len 32] [--concurrency 4] \\
        [--serve "--steps 3 --max-batch-size 8"] [--out runs/sglang_client]

It installs nothing: `sglang.bench_serving` must import in this interpreter. The 0.4.x wheels'
module does without the rest of sglang's runtime (0.4.9.post6 and 0.4.10.post2 have the chat
backends); importing it loads the `sglang` package, which needs aiohttp, requests, IPython and
pybase64 besides numpy, tqdm and transformers (none of torch's weight: `pip install
sglang==0.4.10.post2 --no-deps` plus those, or into a folder on PYTHONPATH). `--check` only says
whether it imports (exit 0) or why not (exit 2).

The random dataset draws its text from a ShareGPT-shaped file, which this script writes from the
code prompts of `scripts.bench.common` (nothing is downloaded; HF_HUB_OFFLINE=1). Every request
is greedy with `ignore_eos` (the benchmark's defaults), so every one makes `--output-len` tokens.
Writes OUT/results.json (settings, one row per setup and backend: the benchmark's own result
line, and its printed table) and OUT/sglang_client.png (output throughput, TTFT, ITL).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "workers" / "assets" / "tiny_pair" / "target"
SETUPS = {"one": ([], 1), "dp2": (["--dp", "2"], 2)}
COLUMNS = [("completed", "requests", "{:.0f}"), ("duration", "duration (s)", "{:.2f}"),
           ("request_throughput", "req/s", "{:.2f}"), ("output_throughput", "output tok/s",
                                                       "{:.1f}"),
           ("median_ttft_ms", "TTFT p50 (ms)", "{:.0f}"), ("p99_ttft_ms", "TTFT p99 (ms)",
                                                          "{:.0f}"),
           ("median_itl_ms", "ITL p50 (ms)", "{:.1f}"), ("p99_itl_ms", "ITL p99 (ms)", "{:.1f}"),
           ("median_e2e_latency_ms", "latency p50 (ms)", "{:.0f}")]


def importable(python: str = sys.executable, env: Optional[dict] = None) -> Optional[str]:
    """None when `python -m sglang.bench_serving` can run here, else why not."""
    res = subprocess.run([python, "-c", "import sglang.bench_serving"], capture_output=True,
                         text=True, timeout=300, env=env, cwd="/")
    if res.returncode == 0:
        return None
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    return lines[-1] if lines else f"exit code {res.returncode}"


def write_dataset(path: Path, n: int, seed: int = 0) -> Path:
    """A ShareGPT-shaped file (what the random dataset samples its text from): code prompts."""
    from scripts.bench.common import code_prompts

    rng = random.Random(seed)
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": p},
                                             {"from": "gpt", "value": "pass"}]}
            for i, p in enumerate(code_prompts(n, rng))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))
    return path


def bench_command(backend: str, url: str, args: argparse.Namespace, dataset: Path,
                  output: Path) -> list[str]:
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", url,
            "--dataset-name", "random", "--dataset-path", str(dataset),
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--random-range-ratio", "1.0",
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
            "--tokenizer", str(TOKENIZER), "--seed", str(args.seed), "--disable-tqdm",
            "--output-file", str(output)]


def table_lines(stdout: str) -> list[str]:
    """The benchmark's printed result table (from its title line to the closing rule)."""
    lines = stdout.splitlines()
    start = next((i for i, x in enumerate(lines) if "Serving Benchmark Result" in x), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if set(lines[i]) == {"="}), len(lines))
    return lines[start:end + 1]


def run_one(setup: str, backend: str, url: str, args: argparse.Namespace, dataset: Path,
            out: Path) -> dict[str, Any]:
    result_file = out / f"{setup}_{backend}.jsonl"
    result_file.unlink(missing_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.time()
    res = subprocess.run(bench_command(backend, url, args, dataset, result_file),
                         capture_output=True, text=True, env=env, cwd=out,
                         timeout=args.bench_timeout)
    (out / f"{setup}_{backend}.log").write_text(res.stdout + res.stderr)
    row: dict[str, Any] = {"setup": setup, "backend": backend, "exit_code": res.returncode,
                           "wall_s": round(time.time() - start, 1),
                           "table": table_lines(res.stdout)}
    if res.returncode == 0 and result_file.is_file():
        row["result"] = json.loads(result_file.read_text().strip().splitlines()[-1])
    else:
        row["error"] = (res.stderr or res.stdout)[-2000:]
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    from scripts.bench.server_process import ServerProcess
    from collectives import free_port

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    dataset = write_dataset(out / "sharegpt_code.json", max(64, args.num_prompts))
    rows = []
    for setup in args.setups:
        extra, nproc = SETUPS[setup]
        server = ServerProcess([*shlex.split(args.serve), *extra], free_port(), nproc=nproc)
        try:
            server.wait_ready(timeout_s=300)
            for backend in args.backends:
                print(f"[sglang_client] {setup}: {backend} ...", file=sys.stderr, flush=True)
                rows.append(run_one(setup, backend, server.url, args, dataset, out))
                rows[-1]["serve"] = f"{args.serve} {' '.join(extra)}".strip()
                rows[-1]["nproc"] = nproc
        finally:
            server.stop()
    return {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    """The rows as a Markdown table."""
    head = ["setup", "backend", *[title for _, title, _ in COLUMNS]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["rows"]:
        r = row.get("result")
        cells = [row["setup"], row["backend"]]
        cells += [fmt.format(r[key]) if r and r.get(key) is not None else "failed"
                  for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    from scripts.bench.common import pyplot, save

    plt = pyplot()
    rows = [r for r in report["rows"] if r.get("result")]
    if not rows:
        return
    labels = [f"{r['setup']}\n{r['backend']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (keys, title) in zip(axes, (
            (("output_throughput",), "output tokens/s"),
            (("median_ttft_ms", "p99_ttft_ms"), "TTFT (ms): p50, p99"),
            (("median_itl_ms", "p99_itl_ms"), "ITL (ms): p50, p99"))):
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            ax.bar([i + j * width for i in range(len(rows))], [r["result"][key] for r in rows],
                   width, label=key)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(rows))], labels,
                      fontsize=8)
        ax.set_title(title, fontsize=10)
    s = report["settings"]
    fig.suptitle(f"sglang.bench_serving, random {s['input_len']} in / {s['output_len']} out, "
                 f"{s['num_prompts']} prompts, concurrency {s['concurrency']}", fontsize=10)
    save(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", type=lambda s: s.split(","), default=["one", "dp2"],
                   help="one (a single process) and/or dp2 (torchrun --nproc-per-node 2, --dp 2)")
    p.add_argument("--backends", type=lambda s: s.split(","), default=["vllm", "vllm-chat"],
                   help="bench_serving backends (vllm: /v1/completions, vllm-chat: "
                        "/v1/chat/completions)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--serve", default="--steps 3 --max-batch-size 8 --max-model-len 512",
                   help="the server's flags (each setup adds its own)")
    p.add_argument("--bench-timeout", type=float, default=900.0)
    p.add_argument("--out", default="runs/sglang_client")
    p.add_argument("--check", action="store_true", help="only say whether sglang imports")
    args = p.parse_args(argv)
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown:
        p.error(f"--setups: {unknown[0]!r}; allowed: {', '.join(SETUPS)}")
    problem = importable()
    if problem is not None:
        print(f"sglang.bench_serving does not import here ({problem}); install sglang 0.4.x "
              f"(see this module's docstring)", file=sys.stderr)
        return 2
    if args.check:
        return 0
    from scripts.bench.common import write_json

    report = run(args)
    out = Path(args.out)
    report["markdown"] = markdown(report)
    write_json(out / "results.json", report)
    plot(report, out / "sglang_client.png")
    print(report["markdown"])
    failed = [f"{r['setup']}/{r['backend']}" for r in report["rows"] if not r.get("result")]
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
