"""Shared by the serving tests: the offline reference (single-process greedy decoding without
speculation through the engine), HTTP helpers and prompts."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import subprocess
import threading
import time
from typing import Any, Optional

import httpx

from workers.loading import DEFAULT_MODEL, encode_prompt, load_pair
from workers.server.metrics import find, parse
from scripts.bench.server_process import ServerProcess

# GPU ranks generate a few hundred tokens in well under a second: tests that must catch a request
# in flight give it a longer context there
ON_GPU = os.environ.get("ADAPTIVE_DIST_TEST_DEVICE") == "cuda"
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
    if extra and "--dtype" not in args:   # the CPU reference runs float32 (--dtype auto: bf16)
        extra += ["--dtype", "float32"]
    return ServerProcess(args + extra, free_port(), nproc=nproc).wait_ready()


# ---- the ranks as `serve` starts them, with the test in the frontend's place -------------------

def drive_ranks_job(rank: int, serve_argv: list[str], script: list[dict],
                    timeout_s: float = 60.0) -> dict:
    """One rank of a serving job started by the product's own start-up
    (`launch.serve_rank`: the HTTP port, the process group, the job's secret, the inboxes and
    the address exchange, the engine, `RankLoop`), with a `ScriptedFrontend` in the frontend's
    place: it sends `script` (``protocol.Generate`` fields, without ``seq``) to every rank's
    inbox through the product's `ClusterClient` — messages the HTTP API would refuse among them
    — waits for every request's outcome, then stops the job. Returns what this rank logged of
    its refusals (rid, round) and of how its loop ended, its exit code and, on rank 0, every
    outcome."""
    from adaptive_dist.cli import build_parser
    from workers.server.cli import serve_settings
    from workers.server.launch import serve_rank

    settings = serve_settings(build_parser().parse_args(["serve", *serve_argv, "--port", "0"]))
    frontend = ScriptedFrontend(script, timeout_s)
    with RankLog() as seen:
        code = serve_rank(settings, start_frontend=frontend.start)
    started = frontend.thread is not None
    return {"refusals": seen.refusals, "exit": seen.exit, "code": code,
            "outcomes": frontend.outcomes if started else None,
            "driver_error": frontend.error if started else None}


class RankLog(logging.Handler):
    """What a rank's serving loop logs of its refusals (``(repr(rid), round)``, in order) and of
    how it ended (``(reason, error)``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.refusals: list[tuple[str, int]] = []
        self.exit: Optional[tuple[str, bool]] = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("request %.80r refused in round %d"):
            self.refusals.append((repr(record.args[0]), record.args[1]))
        elif record.msg == "stopping: %s":
            self.exit = (record.args[0], record.levelno >= logging.ERROR)

    def __enter__(self) -> "RankLog":
        logging.getLogger("adaptive_dist.serve").addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("adaptive_dist.serve").removeHandler(self)


class ScriptedFrontend:
    """The test in the frontend's place: the product's `ClusterClient` (sealed sends in ``seq``
    order, the output pump) in a thread of rank 0, without the HTTP API in front of it. Once
    every rank is ready it sends the script's ``Generate`` messages as they are, follows each
    request (`ClusterClient.track`) to its outcome, then stops the job as the frontend does
    (``Shutdown``, then the linger). Rank 0 holds it as it holds the frontend's process
    (`launch.FrontendProcess`)."""

    def __init__(self, script: list[dict], timeout_s: float) -> None:
        self.script, self.timeout_s = script, timeout_s
        self.outcomes: dict[str, Any] = {}
        self.error: Optional[str] = None
        self.thread: Optional[threading.Thread] = None
        self.pid = os.getpid()
        self.returncode: Optional[int] = None

    def start(self, config: Any, secret: str) -> "ScriptedFrontend":
        """`launch.serve_rank`'s `start_frontend`."""
        self.thread = threading.Thread(target=asyncio.run, args=(self._run(config, secret),),
                                       name="scripted-frontend", daemon=True)
        self.thread.start()
        return self

    async def _run(self, config: Any, secret: str) -> None:
        from workers.server.channel import JobKey
        from workers.server.cluster import ClusterClient
        from workers.server.metrics import FrontendMetrics
        from workers.server.protocol import Generate

        cluster = ClusterClient(config, FrontendMetrics(), JobKey(secret))
        ready = asyncio.Event()
        cluster.on_ready.append(ready.set)
        pump = asyncio.ensure_future(cluster.pump())
        try:
            await asyncio.wait_for(ready.wait(), self.timeout_s)
            sink: asyncio.Queue = asyncio.Queue()
            rids = [f["rid"] if isinstance(f["rid"], str) else repr(f["rid"])
                    for f in self.script]
            for index, (rid, fields) in enumerate(zip(rids, self.script)):
                cluster.track(rid, index, fields["dp_rank"], 0, 0, sink)
                cluster.send(Generate, **fields)
            await asyncio.wait_for(self._collect(sink, rids), self.timeout_s)
        except Exception as err:   # reported by rank 0's result; the ranks are still stopped
            self.error = f"{type(err).__name__}: {err}"
        finally:
            cluster.fail("the test is done", orderly=True)
            await cluster.stopping.wait()
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            cluster.close()
            self.returncode = 0

    async def _collect(self, sink: asyncio.Queue, rids: list[str]) -> None:
        from workers.server.cluster import Failure

        tokens: dict[str, list[int]] = {}
        while len(self.outcomes) < len(set(rids)):
            index, event = await sink.get()
            rid = rids[index]
            if isinstance(event, Failure):
                self.outcomes[rid] = ("refused", event.status, event.param, event.message)
                continue
            tokens.setdefault(rid, []).extend(event.token_ids)
            if event.finish_reason is not None:
                self.outcomes[rid] = ("done", tokens[rid], event.finish_reason)

    # ---- what rank 0 asks of its frontend's process
    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise subprocess.TimeoutExpired("the scripted frontend", timeout or 0.0)
        return self.returncode or 0

    def terminate(self) -> None:
        """A thread takes no signal: it ends at its own deadline."""

    kill = terminate


# Generate fields (beside rid, dp_rank, prompt_ids) that no rank can run -> the field at fault;
# the HTTP frontend refuses all of them, a rank must refuse them too (`drive_ranks_job`)
NAN, INF = float("nan"), float("inf")
BAD_GENERATES = [
    ({"seed": 2 ** 63}, "seed"), ({"seed": -2 ** 63 - 1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"prompt_ids": [256, 264]}, "prompt"), ({"prompt_ids": [256, -1]}, "prompt"),
    ({"prompt_ids": []}, "prompt"), ({"prompt_ids": [256, "a"]}, "prompt"),
    ({"prompt_ids": "abc"}, "prompt"), ({"prompt_ids": [256, 10 ** 30]}, "prompt"),
    ({"max_tokens": 10 ** 6}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": NAN}, "temperature"), ({"temperature": INF}, "temperature"),
    ({"temperature": 1e-45}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": 10 ** 400}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": NAN}, "top_p"), ({"top_p": 2}, "top_p"),
    ({"rid": [1]}, "rid"), ({"sent_at": "x"}, "sent_at"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"stop_token_ids": [264]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": "10"}, "stop_token_ids"),
    ({"stop_token_ids": [10 ** 30]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(8))}, "stop_token_ids"),       # with EOS: 9 > 8
    ({"top_k": -2}, "top_k"), ({"top_k": 2 ** 63}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"min_tokens": 9}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),   # max_tokens 8
    ({"presence_penalty": NAN}, "presence_penalty"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"repetition_penalty": 1e-30}, "repetition_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": "5"}, "prompt_logprobs"),
]


def refusal_script(prompt_ids: list[int], bad_dp: int, good_dps: tuple[int, ...]) -> list[dict]:
    """Good requests (greedy, 8 tokens, on every group of `good_dps`), every `BAD_GENERATES`
    on group `bad_dp`, then good requests again and a sampled one with the largest seed."""
    def gen(name: str, dp: int, **kw: Any) -> dict:
        return {"rid": name, "dp_rank": dp, "prompt_ids": list(prompt_ids), "max_tokens": 8,
                "temperature": 0.0, "top_p": 1.0, "seed": 0, "sent_at": 0.0, **kw}

    before = [gen(f"good-before-{g}", g) for g in good_dps]
    bad = [gen(f"bad-{i}", bad_dp, **fields) for i, (fields, _) in enumerate(BAD_GENERATES)]
    after = [gen(f"good-after-{g}", g) for g in good_dps]
    return before + bad + after + [gen("sampled", bad_dp, temperature=1.0, seed=2 ** 63 - 1)]


REFUSAL_SERVE = ["--steps", "3", "--max-batch-size", "4", "--max-model-len", "64",
                 "--timeout", "30"]


def check_outcomes(outcomes: dict, reference: list[int]) -> None:
    """Every bad request refused with 400 naming its field; every good one equal to the
    reference; the sampled one with the largest seed ran."""
    for i, (fields, param) in enumerate(BAD_GENERATES):
        rid = f"bad-{i}" if "rid" not in fields else repr(fields["rid"])
        kind, status, got_param, message = outcomes[rid]
        assert (kind, status, got_param) == ("refused", 400, param), (fields, outcomes[rid])
        assert message.startswith(f"{param}: ") and len(message) < 200, message
    good = {rid: o for rid, o in outcomes.items() if rid.startswith("good-")}
    assert len(good) >= 2, outcomes
    finish = "length" if len(reference) == 8 else "stop"
    assert all(o == ("done", reference, finish) for o in good.values()), good
    assert outcomes["sampled"][0] == "done" and len(outcomes["sampled"][1]) >= 1


# ---- the perimeter: what another process of the machine can do to a running job -----------------

def frontend_pid(server: ServerProcess) -> int:
    """The pid of the job's frontend process."""
    from pathlib import Path

    for pid in sorted(server.record_tree()):
        try:
            if b"workers.server.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no frontend in {server.tree}")


def frontend_environment(server: ServerProcess) -> dict[str, str]:
    """The frontend's environment (readable by the job's own user only): its configuration
    (`protocol.CONFIG_ENV`) and the job's secret are there, and nowhere on a command line."""
    from pathlib import Path

    raw = Path(f"/proc/{frontend_pid(server)}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def frontend_config(server: ServerProcess) -> dict:
    from workers.server.protocol import CONFIG_ENV

    return json.loads(frontend_environment(server)[CONFIG_ENV])


# what a process that found a socket sends it: the 15 bytes of the report, a control
# message in the right format without a MAC, the same sealed with another job's secret, one cut
# short, and a stray 1-byte frame
def stray_messages() -> list[bytes]:
    from workers.server import protocol
    from workers.server.channel import JobKey, Signer
    from workers.server.protocol import Shutdown

    shutdown = protocol.encode(Shutdown(1, "an attacker", error=True))
    foreign = Signer(JobKey("the secret of some other job entirely").control).seal(shutdown)
    return [b"\x00not json at all", shutdown, foreign, foreign[:20], b"x"]


def send_stray(address: str, messages: list[bytes]) -> None:
    """PUSH `messages` to a zmq PULL socket at `address`, as any process of the machine could
    (once it knows the address: ipc endpoints are in a directory only the job's user enters)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    for message in messages:
        sock.send(message)
    sock.close()
    ctx.term()


def health_latency(url: str) -> tuple[int, float]:
    start = time.monotonic()
    status = httpx.get(f"{url}/health", timeout=10).status_code
    return status, time.monotonic() - start


def secret_job(rank: int, cases: list[dict]) -> list[dict]:
    """One rank of a job that only agrees its serving secret (`launch.job_secret`, as `serve`
    does right after the process group starts), once per case: `case[rank]` in its environment
    (absent: unset). Returns per case its secret's digest, or the error every rank must raise."""
    import os

    from collectives import init_distributed
    from workers.server.channel import SECRET_ENV, secret_digest
    from workers.server.launch import RankRole, job_secret

    ctx = init_distributed(timeout_s=30, backend="gloo")
    out = []
    for case in cases:
        if case.get(rank) is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = case[rank]
        try:
            secret, key = job_secret(ctx, RankRole(rank, 2, 2, 1))
            out.append({"digest": secret_digest(secret), "control": key.control.hex(),
                        "given": secret == case.get(rank)})
        except ValueError as err:
            out.append({"error": str(err)})
    ctx.shutdown()
    return out
