"""Shared by the serving tests: the offline reference (single-process greedy decoding without
speculation through the engine), HTTP helpers and prompts."""
from __future__ import annotations

import functools
import json
import time
from typing import Any, Optional

import httpx

from workers.loading import DEFAULT_MODEL, encode_prompt, load_pair
from workers.server.metrics import find, parse
from workers.server.process import ServerProcess

# GPU ranks generate a few hundred tokens in well under a second: tests that must catch a request
# in flight give it a longer context there
ON_GPU = __import__("os").environ.get("ADAPTIVE_DIST_TEST_DEVICE") == "cuda"
LONG_CONTEXT = 2048 if ON_GPU else 512

PROMPTS = ["def fib(n):", "import os\n", "x = [", "class Foo:\n    def __init__(self",
           "for i in range(10):", "# compute the mean\n", "while True:", "print('hello",
           "SGVsbG8gd29ybGQ=", "aaa aaa aaa aaa", "return {", "if __name__ =="]


@functools.lru_cache(maxsize=1)
def _offline_pair() -> tuple[Any, Any]:
    import torch

    torch.set_num_threads(1)
    target, _ = load_pair(DEFAULT_MODEL, with_head=False)
    return target, target.config


def offline_greedy(prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids of greedy decoding without speculation, one engine over all prompts (the
    `generate --no-spec` path)."""
    from workers.config import EngineConfig
    from workers.engine import build_engine
    from workers.sampling import SamplingParams

    target, cfg = _offline_pair()
    engine = build_engine(EngineConfig(max_batch_size=len(prompts), max_context_len=512),
                          target, None)
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=cfg.eos_token_ids)
    reqs = engine.generate([encode_prompt(p, cfg) for p in prompts], params)
    return [r.output_ids for r in reqs]


def decode(ids: list[int]) -> str:
    from workers import tokenizer

    return tokenizer.decode(ids)


def metrics(url: str) -> dict[str, float]:
    return parse(httpx.get(f"{url}/metrics", timeout=10).text)


def metric(url: str, name: str, **labels: Any) -> Optional[float]:
    return find(metrics(url), name, **labels)


def wait_until(check, timeout_s: float = 20.0, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every_s)
    return check()


def kv_back_to_full(url: str, dp: int = 1) -> bool:
    """Every DP group idle with every KV page free again."""
    m = metrics(url)
    return all(find(m, "kv_free_pages", dp_rank=g) == find(m, "kv_usable_pages", dp_rank=g)
               and find(m, "queue_requests", dp_rank=g, state="running") == 0
               and find(m, "queue_requests", dp_rank=g, state="waiting") == 0
               for g in range(dp)) and find(m, "requests_in_flight") == 0


def sse_chunks(response: httpx.Response) -> list[dict]:
    """The JSON events of a streamed response (up to [DONE])."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            if line == "data: [DONE]":
                out.append({"done": True})
                break
            out.append(json.loads(line[6:]))
    return out


def start_server(args: list[str], nproc: int = 1) -> ServerProcess:
    """A real server subprocess, ready. ``ADAPTIVE_DIST_TEST_DEVICE=cuda`` runs the same tests
    against GPU ranks (NCCL between them); the offline reference stays on the CPU."""
    import os

    from collectives import free_port

    device = os.environ.get("ADAPTIVE_DIST_TEST_DEVICE")
    extra = ["--device", device] if device and "--device" not in args else []
    return ServerProcess(args + extra, free_port(), nproc=nproc).wait_ready()
