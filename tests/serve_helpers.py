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
from scripts.bench.server_process import ServerProcess

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


# ---- the rank side without the frontend: the test drives the ranks' inboxes itself ---------------

def drive_ranks_job(rank: int, serve_argv: list[str], script: list[dict],
                    timeout_s: float = 60.0) -> dict:
    """One rank of a serving cluster built by the real launch code (`launch._build_loop`: the
    engine, `EngineAdapter`, `RankLoop`), with this test as the frontend: rank 0 also runs
    `_Driver`, which PUSHes `script` (``protocol.Generate`` fields, without ``seq``) to every rank's
    real inbox — messages the HTTP frontend would refuse among them — waits for every request's
    outcome, then sends ``Shutdown``. Returns this rank's refusals (rid, loop round), how its loop
    ended and, on rank 0, every outcome."""
    import contextlib
    import threading

    import zmq

    from adaptive_dist.cli import build_parser
    from collectives import init_distributed
    from workers.server.channel import Endpoints, JobKey
    from workers.server.engine_glue import Refused
    from workers.server.inbox import Inbox, Outbox
    from workers.server.cli import serve_settings
    from workers.server.launch import _build_loop, gather_addresses, rank_role
    from workers.server.protocol import RankAddress
    from workers.server.rank import StopFlag

    settings = serve_settings(build_parser().parse_args(["serve", *serve_argv]))
    role = rank_role(settings.launch.shape)
    ctx = init_distributed(timeout_s=timeout_s, backend="gloo", record=True)
    zctx = zmq.Context()
    endpoints = Endpoints()                 # one host: private ipc endpoints
    inbox = Inbox(zctx, endpoints, DRIVER_KEY)
    first = ctx.layout(dp=1)
    pg = first.group("world").control_pg if ctx.distributed else None
    pull = endpoints.address_for("frontend") if rank == 0 else None
    ranks, pulls = gather_addresses(RankAddress(rank, role.dp_rank, role.is_leader,
                                                inbox.address), pull, pg)
    driver = _Driver(zctx, pulls[0], ranks, script, timeout_s) if rank == 0 else None
    outbox = Outbox(zctx, pulls[0], DRIVER_KEY)
    closers = contextlib.ExitStack()
    refusals: list[tuple[str, int]] = []
    try:
        loop = _build_loop(ctx, first, settings, role, inbox, outbox, StopFlag(), None, closers)
        add = loop.adapter.add

        def recording_add(msg):          # the real add; notes which requests it refused, when
            try:
                add(msg)
            except Refused:
                refusals.append((repr(msg.rid), loop.adapter.rounds))
                raise

        loop.adapter.add = recording_add
        thread = threading.Thread(target=driver.run, daemon=True) if driver else None
        if thread is not None:
            thread.start()
        result = loop.run()
        if thread is not None:
            thread.join(timeout=10)
    finally:
        closers.close()
        outbox.close()
        inbox.close()
        if driver is not None:
            driver.close()
        zctx.term()
        endpoints.close()
    if ctx.distributed:
        ctx.shutdown()
    return {"refusals": refusals, "exit": (result.reason, result.error),
            "outcomes": driver.outcomes if driver else None,
            "driver_error": driver.error if driver else None}


def _driver_key():
    from workers.server.channel import JobKey

    return JobKey("the secret of the test's own serving job")


DRIVER_KEY = _driver_key()


class _Driver:
    """The test's frontend: sequenced sends to every rank (sealed with the job's key, as the
    frontend seals them), outcomes from the leaders."""

    def __init__(self, zctx, pull_address: str, ranks: list, script: list[dict],
                 timeout_s: float) -> None:
        import zmq

        from workers.server.channel import Signer, Verifier

        self.signer = Signer(DRIVER_KEY.control)
        self.verifier = Verifier(DRIVER_KEY.output, "the test's driver")
        self.pull = zctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(pull_address)
        self.push = []
        for r in ranks:
            sock = zctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(r.address)
            self.push.append(sock)
        self.script, self.timeout_s = script, timeout_s
        self.seq = 0
        self.outcomes: dict[str, Any] = {}
        self.tokens: dict[str, list[int]] = {}
        self.error: Optional[str] = None

    def send(self, cls, **fields) -> None:
        from workers.server import protocol

        self.seq += 1
        msg = cls(seq=self.seq, **fields)
        data = json.dumps({"type": cls.__name__, **msg.__dict__}).encode()   # NaN allowed
        assert protocol.decode(data).seq == self.seq
        sealed = self.signer.seal(data)
        for sock in self.push:
            sock.send(sealed)

    def run(self) -> None:
        from workers.server.protocol import Generate, Shutdown

        try:
            for fields in self.script:
                self.send(Generate, **fields)
            self._collect({repr(f["rid"]) if not isinstance(f["rid"], str) else f["rid"]
                           for f in self.script})
        except Exception as err:   # reported by rank 0's result; the ranks are still stopped
            self.error = f"{type(err).__name__}: {err}"
        finally:
            self.send(Shutdown, reason="the test is done")

    def _collect(self, rids: set[str]) -> None:
        import zmq

        from workers.server import protocol
        from workers.server.protocol import RequestError, StepOutput

        deadline = time.monotonic() + self.timeout_s
        while set(self.outcomes) < rids:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no outcome for {sorted(rids - set(self.outcomes))}")
            if not self.pull.poll(200, zmq.POLLIN):
                continue
            payload = self.verifier.open(self.pull.recv())
            assert payload is not None, self.verifier.dropped
            msg = protocol.decode(payload)
            if isinstance(msg, RequestError):
                self.outcomes[msg.rid] = ("refused", msg.status, msg.param, msg.message)
            elif isinstance(msg, StepOutput):
                for d in msg.deltas:
                    self.tokens.setdefault(d.rid, []).extend(d.token_ids)
                    if d.finish_reason is not None:
                        self.outcomes[d.rid] = ("done", self.tokens[d.rid], d.finish_reason)

    def close(self) -> None:
        for sock in self.push:
            sock.close()
        self.pull.close()


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
