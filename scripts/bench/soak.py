"""A bounded soak of a real server: many concurrent clients, mixed requests, checked one by one.

    python -m scripts.bench.soak              # --dp 2 under torchrun: 2000 requests, 64 clients
    python -m scripts.bench.soak --requests 300 --clients 16 --dp 1 --out runs/soak
    python -m scripts.bench.soak --out docs/bench/soak    # the figures of docs/serving.md

It starts `python -m adaptive_dist serve` (``--dp 2`` under torchrun by default, ``--dp 1``: one
process) and sends `--requests` requests from `--clients` concurrent clients, each drawn at random
(seeded): chat or completions, streamed or not, a prompt of random length (a pool of
`--prompt-pool` prompts of 1 to 6 code snippets), `max_tokens` in ``[1, --max-tokens]``; 70%
greedy (a quarter of those asking for logprobs), the rest sampled with a random seed,
temperature and top_p, sometimes top_k (1, 5, 50) or a penalty. A share of the requests
(`--disconnect`, 10%) are streams the client closes after the first chunk with text; another
(`--bad`, 5%) are bad requests. Before the soak, a warm-up of the same mix (2 x `--clients`
requests, the same concurrency) is sent, after a burst of `--clients` greedy requests of the
longest prompts at `--max-tokens`, pinned evenly to the DP groups (every rank's batch full, so
every rank reaches its working set before memory is measured); its requests are checked the
same way. Checked:

- every request that was not cancelled completed: 200, a finish reason (``stop``, or ``length``
  exactly at `max_tokens`), ``usage.completion_tokens`` equal to the token ids it returned (every
  request asks for ``return_token_ids``), its text the decoding of those ids;
- a greedy one (and a sampled one with ``top_k: 1`` and no penalty, which is greedy too) has,
  token by token, the ids of the offline reference (the engine without speculation, in this
  process, on the prompt ids this process computes itself: BOS + bytes, or the bundled chat
  template rendered; the server's /tokenize must agree) and their text; with logprobs, one
  logprob entry per token;
- every bad request got 400 with the ``param`` (or ``code``, for a body that is not JSON) it
  should name;
- the server's own counters over the soak (``requests_total{outcome}``) agree: ``rejected`` =
  the bad requests, no ``error`` / ``unavailable``, ``success`` at least the completed requests,
  ``client_gone`` at most the cancelled ones;
- afterwards every DP group's KV pool is full again (free pages = usable pages, every series
  present), nothing runs, waits or is in flight;
- resident memory (VmRSS summed over every process of the job: torchrun, the ranks, the
  frontend) a few seconds after the run is within `--rss-tol` (5%) of what it was after the
  warm-up;
- no rank restarted: the job's processes after the run are exactly the ones after the warm-up,
  and /health is 200.

Progress (requests done, outcomes, rate, memory) is printed every `--progress` requests. Writes
`soak.json` (settings, outcomes by kind, latency percentiles and samples per kind, memory per
process and over time, the checks, the failures) and `soak.png` (latency CDF per kind; resident
memory over time) under `--out`; exit code 1 if any check fails. ``run_soak`` is what
``tests/multirank/test_serve_soak.py`` runs, shortened (``--dp 2``, 160 requests).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

MODEL = "tiny_pair"
TARGET_DIR = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny_pair" / "target"
SNIPPETS = ["def fib(n):", "import os\n", "x = [", "class Foo:\n    def __init__(self",
            "for i in range(10):", "# compute the mean\n", "while True:", "print('hello",
            "SGVsbG8gd29ybGQ=", "aaa aaa aaa aaa", "return {", "if __name__ ==",
            "def add(a, b):\n    return", "try:\n    import numpy", "SELECT * FROM", "<html>"]
GOOD_KINDS = ("ok", "cancelled", "bad_400")


def prompt_pool(n: int, rng: random.Random) -> list[str]:
    """`n` prompts of 1 to 6 snippets each (about 5 to 150 bytes)."""
    return ["\n".join(rng.choice(SNIPPETS) for _ in range(rng.randint(1, 6))) for _ in range(n)]


def bad_requests(dp: int, context: int) -> list[tuple[str, Any, str]]:
    """(path, the fields over a good request -- or raw bytes for the whole body --, the param its
    400 names; ``code:X`` where the error has no param and its code must be X)."""
    out: list[tuple[str, Any, str]] = [
        ("completions", {"top_k": -3}, "top_k"),
        ("completions", {"temperature": -1}, "temperature"),
        ("completions", {"max_tokens": context * 2}, "max_tokens"),
        ("completions", {"logprobs": 9}, "logprobs"),
        ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("completions", {"seed": 2 ** 64}, "seed"),
        ("completions", {"temprature": 0}, "temprature"),
        ("completions", {"prompt": [[1, 99999]]}, "prompt"),
        ("completions", {"top_p": 0}, "top_p"),
        ("completions", {"stop_token_ids": [10 ** 6]}, "stop_token_ids"),
        ("completions", b'{"model": "tiny_pair", "prompt": "x", ', "code:invalid_json"),
        ("chat", {"top_logprobs": 3}, "top_logprobs"),
        ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ("chat", {"min_tokens": 10 ** 6}, "min_tokens"),
        ("chat", {"presence_penalty": 5}, "presence_penalty"),
        ("chat", {"messages": []}, "messages")]
    if dp > 1:
        out.append(("completions", {"echo": True, "logprobs": 1}, "echo"))
    return out


@dataclass
class Job:
    """One request of the soak."""

    index: int
    path: str                     # "completions" or "chat"
    body: Any                     # the JSON body (bytes: a raw body)
    stream: bool
    exact: bool                   # its tokens must equal the greedy reference's
    disconnect: bool = False
    bad_param: Optional[str] = None
    prompt_ids: Optional[list[int]] = None
    kind: str = ""                # what it is, for the report: greedy / sampled / bad / ...


@dataclass
class Outcome:
    index: int
    kind: str                     # "ok", "cancelled", "bad_400", or a failure kind
    job_kind: str = ""
    latency_s: float = 0.0
    ttft_s: Optional[float] = None
    path: str = ""
    stream: bool = False
    tokens: int = 0
    detail: str = ""


def make_jobs(n: int, rng: random.Random, prompts: list[str], max_tokens: int, dp: int,
              context: int, disconnect: float, bad: float, first: int = 0) -> list[Job]:
    bads = bad_requests(dp, context)
    jobs = []
    for i in range(first, first + n):
        path = rng.choice(("completions", "chat"))
        prompt = rng.choice(prompts)
        m = rng.randint(1, max_tokens)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": m, "return_token_ids": True}
        if path == "completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        greedy = rng.random() < 0.7
        if greedy:
            body["temperature"] = 0
            if rng.random() < 0.25:
                if path == "completions":
                    body["logprobs"] = rng.randint(0, 5)
                else:
                    body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
            exact, kind = True, "greedy"
        else:
            body.update(temperature=rng.choice((0.7, 1.0)), seed=rng.randrange(2 ** 31),
                        top_p=rng.choice((0.9, 1.0)))
            if rng.random() < 0.3:
                body["top_k"] = rng.choice((1, 5, 50))
            if rng.random() < 0.3:
                body[rng.choice(("presence_penalty", "frequency_penalty"))] = 0.5
            exact = body.get("top_k") == 1 and "presence_penalty" not in body \
                and "frequency_penalty" not in body
            kind = "top_k_1" if exact else "sampled"
        job = Job(i, path, body, rng.random() < 0.5, exact, kind=kind)
        roll = rng.random()
        if roll < bad:
            where, fields, param = rng.choice(bads)
            raw = fields if isinstance(fields, bytes) else {**_good(where, prompt, m), **fields}
            job = Job(i, where, raw, False, False, bad_param=param, kind="bad")
        elif roll < bad + disconnect:
            job.stream, job.disconnect, job.kind = True, True, "disconnect"
            body["max_tokens"] = max_tokens
        if isinstance(job.body, dict) and job.bad_param is None:
            body["stream"] = job.stream
            if job.stream:
                body["stream_options"] = {"include_usage": True}
        jobs.append(job)
    return jobs


def burst(prompts: list[str], max_tokens: int, dp: int, clients: int, first: int) -> list[Job]:
    """The warm-up's first part: `clients` greedy requests of the longest prompts, `max_tokens`
    each, pinned evenly to the DP groups (``dp_rank``), sent at once: every rank's batch full of
    the longest requests, so that each reaches its working set before memory is measured."""
    longest = sorted(prompts, key=len)[-4:]
    jobs = []
    for i in range(clients):
        path = ("completions", "chat")[i % 2]
        body = {**_good(path, longest[i % len(longest)], max_tokens), "dp_rank": i % dp,
                "return_token_ids": True, "stream": bool(i // 2 % 2)}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        jobs.append(Job(first + i, path, body, body["stream"], True, kind="burst"))
    return jobs


def _good(path: str, prompt: str, m: int) -> dict:
    if path == "completions":
        return {"model": MODEL, "prompt": prompt, "max_tokens": m, "temperature": 0}
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": m,
            "temperature": 0}


def _key(job: Job) -> str:
    if job.path == "completions":
        return "p" + job.body["prompt"]
    return "m" + json.dumps(job.body["messages"])


def prompt_ids(url: str, jobs: list[Job]) -> None:
    """Every good job's prompt ids, computed here (completions: BOS + the prompt's bytes; chat:
    the bundled chat template rendered, its special tokens' texts as those tokens); the server's
    /tokenize must give the same ids (`RuntimeError` otherwise)."""
    import httpx

    from workers import tokenizer
    from workers.server.chat import load_chat_template

    template = load_chat_template(TARGET_DIR)
    cache: dict[str, list[int]] = {}
    with httpx.Client(timeout=30) as http:
        for job in jobs:
            if job.bad_param is not None:
                continue
            key = _key(job)
            if key not in cache:
                if job.path == "completions":
                    ids = tokenizer.encode(job.body["prompt"], add_bos=True)
                    req: dict[str, Any] = {"prompt": job.body["prompt"]}
                else:
                    ids = tokenizer.encode_with_specials(
                        template.render(job.body["messages"], True))
                    req = {"messages": job.body["messages"]}
                r = http.post(f"{url}/tokenize", json=req)
                r.raise_for_status()
                if r.json()["tokens"] != ids:
                    raise RuntimeError(f"/tokenize of {req} gives {r.json()['tokens']}, the "
                                       f"offline ids are {ids}")
                cache[key] = ids
            job.prompt_ids = cache[key]


def references(jobs: list[Job], max_tokens: int, chunk: int = 64) -> dict[tuple, list[int]]:
    """Greedy decoding without speculation (no draft head), in this process, of every exact job's
    prompt: `max_tokens` tokens each (a shorter max_tokens is a prefix: greedy decoding of a prompt
    does not depend on its limit)."""
    import torch

    from workers.config import EngineConfig
    from workers.engine import build_engine
    from workers.loading import DEFAULT_MODEL, load_pair
    from workers.sampling import SamplingParams

    torch.set_num_threads(1)
    prompts = sorted({tuple(j.prompt_ids) for j in jobs if j.exact})
    target, _ = load_pair(DEFAULT_MODEL, with_head=False)
    params = SamplingParams(max_new_tokens=max_tokens,
                            stop_token_ids=tuple(target.config.eos_token_ids))
    out: dict[tuple, list[int]] = {}
    for at in range(0, len(prompts), chunk):
        part = prompts[at:at + chunk]
        engine = build_engine(EngineConfig(max_batch_size=len(part), max_context_len=512),
                              target, None)
        for p, r in zip(part, engine.generate([list(p) for p in part], params)):
            out[p] = list(r.output_ids)
    return out


def _decode(ids: list[int]) -> str:
    from workers import tokenizer

    return tokenizer.decode(ids)


async def _one(http: Any, url: str, job: Job, refs: dict[tuple, list[int]]) -> Outcome:
    start = time.perf_counter()
    out = Outcome(job.index, "ok", job_kind=job.kind, path=job.path, stream=job.stream)
    target = f"{url}/v1/{'chat/' if job.path == 'chat' else ''}completions"
    try:
        if job.bad_param is not None:
            if isinstance(job.body, bytes):
                r = await http.post(target, content=job.body,
                                    headers={"content-type": "application/json"})
            else:
                r = await http.post(target, json=job.body)
            out.latency_s = time.perf_counter() - start
            err = r.json().get("error", {}) if r.status_code == 400 else {}
            want = job.bad_param
            got = f"code:{err.get('code')}" if want.startswith("code:") else err.get("param")
            if r.status_code == 400 and got == want and err.get("type") == "invalid_request_error":
                out.kind = "bad_400"
            else:
                out.kind, out.detail = "bad_wrong_answer", \
                    f"want 400 {want}, got {r.status_code} {r.text[:200]}"
            return out
        ids: list[int] = []
        text, finish, lp_count, usage = "", None, 0, None
        if job.stream:
            async with http.stream("POST", target, json=job.body) as r:
                if r.status_code != 200:
                    out.kind, out.detail = "status", f"{r.status_code} {(await r.aread())[:200]}"
                    return out
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out.kind, out.detail = "stream_error", str(chunk["error"])[:200]
                        return out
                    usage = chunk.get("usage") or usage
                    for c in chunk.get("choices", []):
                        piece = c.get("text", "") if job.path == "completions" else \
                            c["delta"].get("content", "") or ""
                        if piece and out.ttft_s is None:
                            out.ttft_s = time.perf_counter() - start
                        text += piece
                        ids += c.get("token_ids") or []
                        finish = c.get("finish_reason") or finish
                        lp_count += _lp_count(c.get("logprobs"), job.path)
                    if job.disconnect and text and finish is None:
                        out.kind, out.latency_s = "cancelled", time.perf_counter() - start
                        return out              # leaving the block closes the connection
                if not done:
                    out.kind, out.detail = "truncated", "the stream ended without [DONE]"
                    return out
        else:
            r = await http.post(target, json=job.body)
            if r.status_code != 200:
                out.kind, out.detail = "status", f"{r.status_code} {r.text[:200]}"
                return out
            body = r.json()
            c = body["choices"][0]
            text = c["text"] if job.path == "completions" else c["message"]["content"]
            ids, finish, usage = c.get("token_ids") or [], c["finish_reason"], body["usage"]
            lp_count = _lp_count(c.get("logprobs"), job.path)
        out.latency_s, out.tokens = time.perf_counter() - start, len(ids)
        m = job.body["max_tokens"]
        if not (finish == "length" and len(ids) == m or finish == "stop" and len(ids) <= m):
            out.kind, out.detail = "unfinished", f"finish_reason {finish!r} after {len(ids)}/{m}"
        elif usage is None or usage["completion_tokens"] != len(ids) or not 1 <= len(ids) <= m:
            out.kind, out.detail = "usage", f"{usage} for {len(ids)} token ids (max_tokens {m})"
        elif text != _decode(ids):
            out.kind, out.detail = "text", f"text {text!r} is not the decoding of {ids}"
        elif job.exact:
            want = refs[tuple(job.prompt_ids)][:m]
            if ids != want:
                out.kind, out.detail = "mismatch", f"got {ids}, the reference {want}"
            elif "logprobs" in job.body and lp_count != len(ids):
                out.kind, out.detail = "logprobs", f"{lp_count} logprobs for {len(ids)} tokens"
    except Exception as err:        # a transport error is a failure of the server
        out.kind, out.detail = "transport", f"{type(err).__name__}: {err}"[:200]
    return out


def _lp_count(lp: Any, path: str) -> int:
    if not lp:
        return 0
    return len(lp["tokens"]) if path == "completions" else len(lp["content"] or [])


async def drive(url: str, jobs: list[Job], refs: dict, clients: int,
                progress: Optional[Callable[[list[Outcome], float], None]] = None,
                every: int = 100) -> tuple[list[Outcome], float]:
    """`clients` concurrent clients (one HTTP connection pool) work through `jobs`."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    outcomes: list[Outcome] = []
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)

    async def client(http: Any) -> None:
        while not queue.empty():
            job = queue.get_nowait()
            outcomes.append(await _one(http, url, job, refs))
            if progress is not None and len(outcomes) % every == 0:
                progress(outcomes, time.perf_counter() - start)

    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return outcomes, time.perf_counter() - start


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def rss_mb(pids: set[int]) -> float:
    """Resident memory of `pids` (MB, VmRSS; a process gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            total += int(_status(pid).get("VmRSS", "0 kB").split()[0])
        except OSError:
            pass
    return total / 1024


def describe(pid: int) -> str:
    """What process `pid` of the job is: the launcher, rank N, the frontend, ..."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
    if "torch.distributed.run" in cmd:
        return "torchrun"
    if "workers.server.frontend" in cmd:
        return "frontend"
    if "adaptive_dist serve" in cmd:
        return f"rank {rank}" if rank is not None else "server (rank 0)"
    return cmd.split(" -")[0][-40:]


def _percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def _stats(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50": _percentile(values, 0.5), "p99": _percentile(values, 0.99),
            "mean": statistics.fmean(values) if values else None,
            "max": max(values) if values else None}


def _settled(m: dict, dp: int) -> bool:
    from workers.server.metrics import find

    def zero(name: str, **labels: Any) -> bool:
        return find(m, name, **labels) == 0       # absent (None) is not zero

    return zero("requests_in_flight") and all(
        find(m, "kv_usable_pages", dp_rank=g) is not None
        and find(m, "kv_usable_pages", dp_rank=g) > 0
        and find(m, "kv_free_pages", dp_rank=g) == find(m, "kv_usable_pages", dp_rank=g)
        and zero("queue_requests", dp_rank=g, state="running")
        and zero("queue_requests", dp_rank=g, state="waiting")
        for g in range(dp))


def _outcomes_metric(m: dict) -> dict[str, float]:
    from workers.server.metrics import find

    return {k: find(m, "requests_total", outcome=k) or 0.0
            for k in ("success", "rejected", "client_gone", "error", "unavailable")}


def run_soak(*, requests: int, clients: int, dp: int = 2, max_tokens: int = 12, seed: int = 0,
             disconnect: float = 0.1, bad: float = 0.05, rss_tol: float = 0.05,
             serve: tuple[str, ...] = ("--steps", "3", "--max-batch-size", "8"),
             context: int = 256, warmup: Optional[int] = None, prompt_pool_size: int = 64,
             progress_every: Optional[int] = None, log: Callable[[str], None] = print
             ) -> dict[str, Any]:
    """Start a server, soak it, check it (see the module docstring); the report (``passed``:
    every check held; ``checks``: each of them)."""
    import httpx

    from collectives import free_port
    from workers.server.metrics import find, parse
    from scripts.bench.server_process import ServerProcess

    def say(msg: str) -> None:
        log(f"[soak {time.perf_counter() - t0:6.1f} s] {msg}")

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    rng = random.Random(seed)
    pool = prompt_pool(prompt_pool_size, rng)
    warmup = 2 * clients if warmup is None else warmup
    warm = make_jobs(warmup, random.Random(seed + 1), pool, max_tokens, dp, context, disconnect,
                     bad, first=-warmup)
    jobs = make_jobs(requests, rng, pool, max_tokens, dp, context, disconnect, bad)
    warm = burst(pool, max_tokens, dp, clients, first=-warmup - clients) + warm
    every = progress_every or max(10, requests // 20)
    args = ["--dp", str(dp), *serve, "--max-model-len", str(context),
            "--max-queue", str(max(64, clients * 2))]
    server = ServerProcess(args, free_port(), nproc=dp).wait_ready(timeout_s=300)
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    try:
        url = server.url
        say(f"server ready: serve {' '.join(args)}")
        prompt_ids(url, jobs + warm)
        refs = references(jobs + warm, max_tokens)
        say(f"{len(refs)} offline references (no speculation) of {max_tokens} tokens; the "
            f"server's /tokenize agrees on every prompt")
        warm_out, _ = asyncio.run(drive(url, warm, refs, clients))
        deadline = time.monotonic() + 30
        while not _settled(parse(httpx.get(f"{url}/metrics", timeout=10).text), dp) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)
        pids = server.record_tree()
        rss_warm = rss_mb(pids)
        per_warm = {p: rss_mb({p}) for p in pids}
        m_before = parse(httpx.get(f"{url}/metrics", timeout=10).text)

        def sample() -> None:
            while not stop.wait(1.0):
                samples.append((round(time.perf_counter() - t0, 2), round(rss_mb(pids), 2)))

        samples.append((round(time.perf_counter() - t0, 2), round(rss_warm, 2)))
        threading.Thread(target=sample, daemon=True).start()
        say(f"warm-up: {clients} requests of the longest prompts pinned to the DP groups "
            f"at once, then {warmup} of the mix, from {clients} clients: "
            f"{sum(o.kind not in GOOD_KINDS for o in warm_out)} failed; resident memory "
            f"{rss_warm:.0f} MB over {len(pids)} processes "
            f"({', '.join(f'{describe(p)} {per_warm[p]:.0f}' for p in sorted(pids))})")
        say(f"soaking: {requests} requests from {clients} clients")

        def progress(outs: list[Outcome], elapsed: float) -> None:
            counts: dict[str, int] = {}
            for o in outs:
                counts[o.kind] = counts.get(o.kind, 0) + 1
            failed = sum(v for k, v in counts.items() if k not in GOOD_KINDS)
            say(f"{len(outs)}/{requests} requests in {elapsed:.0f} s "
                f"({len(outs) / elapsed:.1f}/s): {counts}, {failed} failed; resident memory "
                f"{rss_mb(pids):.0f} MB")

        outcomes, wall = asyncio.run(drive(url, jobs, refs, clients, progress, every))
        say(f"soak done in {wall:.1f} s; waiting for the cluster to settle")
        deadline = time.monotonic() + 30
        while not _settled(parse(httpx.get(f"{url}/metrics", timeout=10).text), dp) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        m = parse(httpx.get(f"{url}/metrics", timeout=10).text)
        kv_full = _settled(m, dp)
        time.sleep(2.0)
        rss_after = rss_mb(pids)
        per_after = {p: rss_mb({p}) for p in pids}
        samples.append((round(time.perf_counter() - t0, 2), round(rss_after, 2)))
        after = server.record_tree()
        health = httpx.get(f"{url}/health", timeout=10)
        names = {p: describe(p) for p in pids}
    finally:
        stop.set()
        log_text = server.output()
        server.stop()
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    by_job: dict[str, int] = {}
    for j in jobs:
        by_job[j.kind] = by_job.get(j.kind, 0) + 1
    kinds = {f"{p}{'_stream' if s else ''}": (p, s) for p in ("completions", "chat")
             for s in (False, True)}
    lat = {k: [o.latency_s for o in outcomes if o.kind == "ok" and (o.path, o.stream) == ps]
           for k, ps in kinds.items()}
    ok_lat = [o.latency_s for o in outcomes if o.kind == "ok"]
    ttft = [o.ttft_s for o in outcomes if o.kind == "ok" and o.ttft_s is not None]
    failures = [o.__dict__ for o in outcomes + warm_out if o.kind not in GOOD_KINDS]
    expected_bad = sum(j.bad_param is not None for j in jobs)
    served = _outcomes_metric(m)
    before = _outcomes_metric(m_before)
    delta = {k: served[k] - before[k] for k in served}
    growth = (rss_after - rss_warm) / rss_warm
    checks = {
        "every request answered": len(outcomes) == requests,
        "no failed request": not failures,
        "every bad request got its 400": counts.get("bad_400", 0) == expected_bad > 0
        or (bad == 0 and expected_bad == 0),
        "some requests cancelled mid-stream": counts.get("cancelled", 0) > 0 or disconnect == 0,
        "greedy requests checked against the reference":
            sum(o.kind == "ok" and o.job_kind in ("greedy", "top_k_1") for o in outcomes) > 0,
        "server counters agree": delta["rejected"] == expected_bad and delta["error"] == 0
        and delta["unavailable"] == 0 and delta["success"] >= counts.get("ok", 0)
        and delta["client_gone"] <= counts.get("cancelled", 0),
        "KV pool full, nothing in flight": kv_full,
        f"resident memory within {rss_tol:.0%} of after warm-up": abs(growth) <= rss_tol,
        "same processes (no rank restarted)": after == pids,
        "healthy after": health.status_code == 200,
    }
    report = {
        "settings": {"requests": requests, "clients": clients, "dp": dp,
                     "max_tokens": max_tokens, "seed": seed, "disconnect": disconnect,
                     "bad": bad, "serve": args, "warmup": warmup, "context": context,
                     "prompt_pool": prompt_pool_size, "rss_tol": rss_tol},
        "machine": {"cpus": os.cpu_count(), "load_before": load_before,
                    "load_after": os.getloadavg()},
        "wall_s": wall, "requests_per_s": len(outcomes) / wall,
        "jobs_by_kind": by_job, "counts": counts, "expected_bad": expected_bad,
        "bad_by_param": {p: sum(j.bad_param == p for j in jobs)
                         for p in sorted({j.bad_param for j in jobs if j.bad_param})},
        "exact_checked": {k: sum(o.kind == "ok" and o.job_kind == k for o in outcomes)
                          for k in ("greedy", "top_k_1")},
        "completion_tokens": sum(o.tokens for o in outcomes if o.kind == "ok"),
        "server_requests_total": delta,
        "latency_s": {"all": _stats(ok_lat), "ttft_stream": _stats(ttft),
                      "bad_400": _stats([o.latency_s for o in outcomes if o.kind == "bad_400"]),
                      "cancelled": _stats([o.latency_s for o in outcomes
                                           if o.kind == "cancelled"]),
                      **{k: _stats(v) for k, v in lat.items()}},
        "latency_samples_ms": {k: sorted(round(x * 1000, 1) for x in v) for k, v in lat.items()},
        "rss_mb": {"after_warmup": rss_warm, "after_run": rss_after, "growth": growth,
                   "peak": max(r for _, r in samples),
                   "per_process": [{"pid": p, "what": names[p], "after_warmup": per_warm[p],
                                    "after_run": per_after[p]} for p in sorted(pids)],
                   "samples": samples},
        "kv_full_after": kv_full, "same_processes": after == pids,
        "healthy_after": health.status_code == 200,
        "warmup": {"requests": len(warm_out),
                   "failed": sum(o.kind not in GOOD_KINDS for o in warm_out)},
        "generation_tokens": find(m, "generation_tokens_total"),
        "spec": {str(g): {k: find(m, f"spec_decode_num_{k}_total", dp_rank=g)
                          for k in ("drafts", "draft_tokens", "accepted_tokens")}
                 for g in range(dp)},
        "server_log_tracebacks": log_text.count("Traceback"),
        "checks": checks,
        "failures": failures[:50],
    }
    report["passed"] = all(checks.values())
    say("checks: " + "; ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in checks.items()))
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    from scripts.bench.common import pyplot, save

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for k, v in report["latency_samples_ms"].items():
        if v:
            left.plot(v, [(i + 1) / len(v) for i in range(len(v))],
                      label=f"{k} (n={len(v)}, p50 {_percentile(v, 0.5):.0f} ms, "
                            f"p99 {_percentile(v, 0.99):.0f} ms)")
    left.set_xscale("log")
    left.set_xlabel("latency of a completed request (ms)")
    left.set_ylabel("fraction of requests")
    left.set_title("latency CDF by kind")
    left.legend(fontsize=7, loc="lower right")
    xs = [t for t, _ in report["rss_mb"]["samples"]]
    ys = [r for _, r in report["rss_mb"]["samples"]]
    base, tol = report["rss_mb"]["after_warmup"], report["settings"]["rss_tol"]
    right.plot(xs, ys, label="every process of the job")
    right.axhline(base, linestyle="--", color="gray", label="after warm-up")
    right.axhspan(base * (1 - tol), base * (1 + tol), color="gray", alpha=0.15,
                  label=f"±{tol:.0%}")
    right.set_xlabel("time since start (s)")
    right.set_ylabel("resident memory (MB)")
    right.legend(fontsize=8)
    s = report["settings"]
    right.set_title(f"{s['requests']} requests, {s['clients']} clients, dp {s['dp']}: "
                    f"{report['rss_mb']['growth']:+.1%}")
    save(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=256, help="--max-model-len")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disconnect", type=float, default=0.1)
    p.add_argument("--bad", type=float, default=0.05)
    p.add_argument("--rss-tol", type=float, default=0.05)
    p.add_argument("--prompt-pool", type=int, default=64)
    p.add_argument("--warmup", type=int, default=None, help="default: 2 x --clients")
    p.add_argument("--progress", type=int, default=None, help="default: every 5%%")
    p.add_argument("--serve", default="--steps 3 --max-batch-size 8",
                   help="the server's flags (besides --dp, --max-model-len, --max-queue)")
    p.add_argument("--out", default="runs/soak")
    args = p.parse_args(argv)
    from scripts.bench.common import write_json

    report = run_soak(requests=args.requests, clients=args.clients, dp=args.dp,
                      max_tokens=args.max_tokens, seed=args.seed, disconnect=args.disconnect,
                      bad=args.bad, rss_tol=args.rss_tol, serve=tuple(args.serve.split()),
                      context=args.context, warmup=args.warmup,
                      prompt_pool_size=args.prompt_pool, progress_every=args.progress,
                      log=lambda s: print(s, flush=True))
    out = Path(args.out)
    write_json(out / "soak.json", report)
    plot(report, out / "soak.png")
    summary = {k: report[k] for k in ("counts", "expected_bad", "exact_checked", "wall_s",
                                      "requests_per_s", "server_requests_total", "checks",
                                      "passed")}
    summary["latency_s"] = {k: {q: report["latency_s"][k][q] for q in ("n", "p50", "p99")}
                            for k in report["latency_s"]}
    summary["rss_mb"] = {k: v for k, v in report["rss_mb"].items()
                         if k not in ("samples", "per_process")}
    print(json.dumps(summary, indent=1))
    for f in report["failures"][:10]:
        print("failure:", f, file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
