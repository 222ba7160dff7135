"""Load generator for the server: phased prompt mix, concurrency and request rate, per-request
time to first token (TTFT), inter-token latency (ITL) and latency percentiles, tokens/s.

    python -m scripts.bench.serve --url http://127.0.0.1:8000 [--concurrency C] [--rate R] \
        [--phases code:40,high_entropy:40,repetitive:40] [--max-tokens N] [--out DIR]
    python -m scripts.bench.serve --launch "--adaptive --max-batch-size 16" [--nproc N] ...

``--launch ARGS`` starts ``python -m adaptive_dist serve ARGS`` itself (under torchrun with
``--nproc`` > 1) on a free port and stops it afterwards. Requests are sent in phase order (all
of the first phase's prompts, then the next phase's: code, high-entropy base64, repetitive runs,
the prompt sets of ``scripts.bench.engine``), at most ``--concurrency`` at once, arriving as a
Poisson process of ``--rate`` requests/s (default: as fast as the concurrency allows). Every
request streams (greedy unless ``--temperature``); TTFT is the time to the first token, ITL the
gap between successive streamed chunks divided by the tokens in the later chunk, latency the time
to the last token. A sampler reads ``/metrics`` every ``--sample-every`` s for the depth in force
and the queues. Writes ``OUT/results.json`` (settings, summary per phase and overall, the
server's wake-up / first-token / frontend-overhead figures, an idle probe of ``--idle-probe``
one-token requests before the load, every request, the samples) and
``OUT/bench_serve.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx
from tqdm import tqdm

from scripts.bench.common import make_prompts, pyplot, save, write_json
from workers.server.metrics import find, parse


@dataclass
class Record:
    """One request as the client saw it."""

    index: int
    phase: str
    prompt_chars: int
    start: float = 0.0                 # seconds since the run began
    ttft: Optional[float] = None
    latency: Optional[float] = None
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None


def parse_phases(text: str) -> list[tuple[str, int]]:
    phases = []
    for part in text.split(","):
        name, _, count = part.partition(":")
        if name not in ("code", "high_entropy", "repetitive") or not count.isdigit():
            raise SystemExit(f"--phases {text!r}: expected NAME:COUNT,... with NAME in code, "
                             f"high_entropy, repetitive")
        phases.append((name, int(count)))
    return phases


def build_requests(phases: list[tuple[str, int]], seed: int) -> list[tuple[str, str]]:
    largest = max(n for _, n in phases)
    pool = make_prompts(largest, seed)
    return [(name, pool[name][i % len(pool[name])]) for name, n in phases for i in range(n)]


async def one_request(http: httpx.AsyncClient, model: str, rec: Record, prompt: str,
                      args: argparse.Namespace, t0: float) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": True, "return_token_ids": True}
    rec.start = time.perf_counter() - t0
    start = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec.error = event["error"]["message"]
                    return
                now = time.perf_counter()
                for choice in event["choices"]:
                    n = len(choice.get("token_ids") or [])
                    if n and rec.ttft is None:
                        rec.ttft = now - start
                    elif n and last is not None:
                        rec.itl.append((now - last) / n)
                    if n:
                        last = now
                    rec.tokens += n
                    rec.finish_reason = choice["finish_reason"] or rec.finish_reason
        rec.latency = time.perf_counter() - start
    except httpx.HTTPError as err:
        rec.error = f"{type(err).__name__}: {err}"


async def sampler(http: httpx.AsyncClient, every_s: float, t0: float, out: list[dict],
                  stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            m = parse((await http.get("/metrics")).text)
            groups = sorted({int(k.split('dp_rank="')[1].split('"')[0]) for k in m
                             if "spec_steps" in k})
            out.append({"t": time.perf_counter() - t0,
                        "steps": [find(m, "spec_steps", dp_rank=g) for g in groups],
                        "running": [find(m, "queue_requests", dp_rank=g, state="running")
                                    for g in groups],
                        "waiting": [find(m, "queue_requests", dp_rank=g, state="waiting")
                                    for g in groups]})
        except (httpx.HTTPError, IndexError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def idle_probe(http: httpx.AsyncClient, model: str, n: int) -> dict[str, Any]:
    """`n` one-token requests, each sent to an idle server: the ranks' wake-up (frontend send ->
    rank applied), first token on the rank, and the end-to-end HTTP latency; the difference
    between the last two is the frontend's (and HTTP's) overhead per request."""
    if n <= 0:
        return {}
    before = parse((await http.get("/metrics")).text)
    e2e = []
    for _ in range(n):
        await asyncio.sleep(0.3)                  # the ranks are idle, blocked in poll
        start = time.perf_counter()
        r = await http.post("/v1/completions", json={"model": model, "prompt": "def f(x):",
                                                      "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        e2e.append(time.perf_counter() - start)
    after = parse((await http.get("/metrics")).text)
    figures = server_figures(before, after)
    wake = figures["wake_seconds"]["mean"]
    first = figures["rank_first_token_seconds"]["mean"]
    return {"requests": n, "wake_s_mean": wake, "rank_first_token_s_mean": first,
            "e2e_s": percentiles(e2e),
            "frontend_overhead_s_mean": statistics.fmean(e2e) - first if first else None,
            "frontend_pre_s_mean": figures["frontend_pre_seconds"]["mean"]}


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    requests = build_requests(parse_phases(args.phases), args.seed)
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout,
                                 limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        probe = await idle_probe(http, model, args.idle_probe)
        before = parse((await http.get("/metrics")).text)
        records = [Record(i, phase, len(p)) for i, (phase, p) in enumerate(requests)]
        gate = asyncio.Semaphore(args.concurrency)
        bar = tqdm(total=len(records), desc="requests", unit="req")
        samples: list[dict] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        sampling = asyncio.ensure_future(sampler(http, args.sample_every, t0, samples, stop))

        async def guarded(rec: Record, prompt: str) -> None:
            async with gate:
                await one_request(http, model, rec, prompt, args, t0)
            bar.update(1)

        tasks = []
        for rec, (_, prompt) in zip(records, requests):
            tasks.append(asyncio.ensure_future(guarded(rec, prompt)))
            if args.rate > 0:
                await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        stop.set()
        await sampling
        bar.close()
        after = parse((await http.get("/metrics")).text)
    return {"settings": {k: v for k, v in vars(args).items()}, "url": url, "model": model,
            "elapsed_s": elapsed, "summary": summarize(records, elapsed),
            "idle_probe": probe,
            "server": server_figures(before, after), "requests": [asdict(r) for r in records],
            "samples": samples}


def percentiles(values: list[float]) -> dict[str, Optional[float]]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"mean": statistics.fmean(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(records: list[Record], elapsed: float) -> dict[str, Any]:
    def block(recs: list[Record], span: float) -> dict[str, Any]:
        ok = [r for r in recs if r.error is None]
        tokens = sum(r.tokens for r in ok)
        return {"requests": len(recs), "errors": len(recs) - len(ok), "tokens": tokens,
                "tokens_per_s": tokens / span if span > 0 else 0.0,
                "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
                "itl_s": percentiles([x for r in ok for x in r.itl]),
                "latency_s": percentiles([r.latency for r in ok if r.latency is not None])}

    out = {"overall": block(records, elapsed)}
    for phase in dict.fromkeys(r.phase for r in records):
        recs = [r for r in records if r.phase == phase]
        span = max((r.start + (r.latency or 0.0) for r in recs), default=0.0) - min(
            r.start for r in recs)
        out[phase] = block(recs, span)
    return out


def server_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Means over this run of the server's own timings (wake-up, first token, frontend work)."""
    out: dict[str, Any] = {}
    for name in ("wake_seconds", "rank_first_token_seconds", "frontend_pre_seconds",
                 "time_to_first_token_seconds", "request_latency_seconds"):
        n = (find(after, f"{name}_count") or 0) - (find(before, f"{name}_count") or 0)
        total = (find(after, f"{name}_sum") or 0) - (find(before, f"{name}_sum") or 0)
        out[name] = {"count": n, "mean": total / n if n else None,
                     "max_since_start": find(after, f"{name}_max")}
    hist: dict[str, float] = {}
    for key, value in after.items():
        if key.startswith("adaptive_dist_accept_length_bucket"):
            hist[key.split("{", 1)[1].rstrip("}")] = value - before.get(key, 0.0)
    out["accept_length_buckets"] = hist
    out["switches"] = {k.split("{", 1)[1].rstrip("}"): v - before.get(k, 0.0)
                       for k, v in after.items() if k.startswith("adaptive_dist_switches_total")}
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    recs = [r for r in result["requests"] if r["error"] is None and r["ttft"] is not None]
    phases = list(dict.fromkeys(r["phase"] for r in result["requests"]))
    colors = dict(zip(phases, ("tab:blue", "tab:red", "tab:green", "tab:purple")))
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for phase in phases:
        mine = [r for r in recs if r["phase"] == phase]
        axes[0].scatter([r["start"] for r in mine], [r["ttft"] * 1000 for r in mine], s=10,
                        color=colors[phase], label=f"{phase} TTFT")
        axes[1].scatter([r["start"] for r in mine],
                        [r["tokens"] / r["latency"] if r["latency"] else 0 for r in mine],
                        s=10, color=colors[phase], label=phase)
    axes[0].set_ylabel("time to first token (ms)")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[1].set_ylabel("tokens/s per request")
    samples = result["samples"]
    if samples:
        groups = len(samples[0]["steps"])
        for g in range(groups):
            axes[2].step([s["t"] for s in samples], [s["steps"][g] for s in samples],
                         where="post", label=f"depth, DP group {g}")
        twin = axes[2].twinx()
        twin.plot([s["t"] for s in samples], [sum(x or 0 for x in s["running"]) for s in samples],
                  color="gray", alpha=0.6, label="running requests")
        twin.set_ylabel("running requests")
        axes[2].legend(loc="upper left", fontsize=8)
    axes[2].set_ylabel("speculative depth")
    axes[2].set_xlabel("time since start (s)")
    s = result["summary"]["overall"]
    fig.suptitle(f"bench_serve: {s['requests']} requests, {s['tokens_per_s']:.0f} tokens/s, "
                 f"TTFT p50 {1000 * (s['ttft_s']['p50'] or 0):.0f} ms, "
                 f"ITL p50 {1000 * (s['itl_s']['p50'] or 0):.1f} ms")
    save(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--launch", metavar="ARGS", help="start `serve ARGS` for the run")
    p.add_argument("--nproc", type=int, default=1, help="ranks for --launch (torchrun if > 1)")
    p.add_argument("--phases", default="code:40,high_entropy:40,repetitive:40")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (0: no pacing)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-every", type=float, default=0.25)
    p.add_argument("--idle-probe", type=int, default=10,
                   help="one-token requests to an idle server before the load (wake-up and "
                        "frontend overhead)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out", default="runs/bench_serve")
    args = p.parse_args(argv)
    server = None
    url = args.url
    if args.launch is not None:
        from collectives import free_port
        from scripts.bench.server_process import ServerProcess

        print(f"launching: serve {args.launch}", file=sys.stderr)
        server = ServerProcess(shlex.split(args.launch), free_port(), nproc=args.nproc)
        url = server.wait_ready().url
    try:
        result = asyncio.run(run(args, url.rstrip("/")))
    finally:
        if server is not None:
            server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    plot(result, out / "bench_serve.png")
    print_summary(result)
    print(f"wrote {out / 'results.json'} and {out / 'bench_serve.png'}")
    return 0


def print_summary(result: dict[str, Any]) -> None:
    def ms(x: Optional[float]) -> str:
        return "-" if x is None else f"{1000 * x:.1f}"

    print(f"{'phase':<14}{'req':>5}{'err':>5}{'tok/s':>9}{'TTFT p50':>10}{'p99':>8}"
          f"{'ITL p50':>9}{'p99':>8}{'lat p50':>9}{'p99':>8}   (ms)")
    for phase, s in result["summary"].items():
        print(f"{phase:<14}{s['requests']:>5}{s['errors']:>5}{s['tokens_per_s']:>9.1f}"
              f"{ms(s['ttft_s']['p50']):>10}{ms(s['ttft_s']['p99']):>8}"
              f"{ms(s['itl_s']['p50']):>9}{ms(s['itl_s']['p99']):>8}"
              f"{ms(s['latency_s']['p50']):>9}{ms(s['latency_s']['p99']):>8}")
    probe = result.get("idle_probe") or {}
    if probe:
        print(f"idle probe ({probe['requests']} one-token requests): wake-up "
              f"{ms(probe['wake_s_mean'])} ms, first token on the rank "
              f"{ms(probe['rank_first_token_s_mean'])} ms, end to end "
              f"{ms(probe['e2e_s']['mean'])} ms -> frontend + HTTP overhead "
              f"{ms(probe['frontend_overhead_s_mean'])} ms (of which before sending "
              f"{ms(probe['frontend_pre_s_mean'])} ms)")
    srv = result["server"]
    print("server: " + ", ".join(f"{k} mean {ms(v['mean'])} ms" for k, v in srv.items()
                                 if isinstance(v, dict) and "mean" in v))


if __name__ == "__main__":
    sys.exit(main())
