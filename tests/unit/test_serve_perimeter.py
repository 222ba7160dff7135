"""The serving perimeter (issue 33; docs/serving.md, "Security"), attacked as another process of
the machine would: through the internal sockets, with bodies too large or too slow, with idle and
half-open connections past the open-file limit, and through a chat template that runs forever,
overflows, floods or takes all memory. One real server for the module (one process, the job's
open-file limit at 256, short timeouts); after each attack, /health answers in under a second and
a greedy request equals its baseline. And two start-ups that must fail before the model loads."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from serve_helpers import (PROMPTS, frontend_config, frontend_environment, frontend_pid,
                           health_latency, metric, metrics, offline_greedy, send_stray,
                           stray_messages, wait_until)
from collectives import free_port
from scripts.bench.server_process import ServerProcess
from workers.server.channel import SECRET_ENV
from workers.server.metrics import find

OPEN_FILES = 256
CAP = OPEN_FILES - 64 - 2        # perimeter.connection_cap: FDS_KEPT and 2 per rank
MAX_BODY = 20 << 20
TEMPLATE = """\
{%- set c = messages[0]['content'] -%}
{%- if c == 'spin' -%}{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}
{%- elif c == 'overflow' -%}{{- range(10**9) | length -}}
{%- elif c == 'flood' -%}{%- for i in range(100000) -%}{{- c * 100000 -}}{%- endfor -%}
{%- elif c == 'bomb' -%}{{- 'x' * 10**10 -}}
{%- else -%}
{{- bos_token -}}
{%- for message in messages -%}{{- '# ' + message['role'] + ':\\n' + message['content'] + '\\n' -}}{%- endfor -%}
{%- if add_generation_prompt -%}{{- '# assistant:\\n' -}}{%- endif -%}
{%- endif -%}
"""
# (spin: 10**10 loop steps, 55+ s of CPU in the report; overflow: a range past the
# sandbox's limit raises OverflowError; flood: 40 GB of output; bomb: a 10 GB string in one go;
# else: the bundled pair's own template)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("perimeter") / "chat.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess(["--steps", "3", "--max-model-len", "256",
                            "--max-body-size", str(MAX_BODY), "--header-timeout", "1",
                            "--body-timeout", "2", "--timeout-keep-alive", "1",
                            "--chat-template", str(template), "--chat-template-timeout", "1"],
                           free_port(), open_files=OPEN_FILES).wait_ready()
    yield server
    server.stop()
    assert server.left_behind() == []


def _completion(url: str) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny_pair", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _chat(url: str, content: str = "def fib(n):") -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny_pair", "messages": [{"role": "user", "content": content}],
        "max_tokens": 8, "temperature": 0})


@pytest.fixture(scope="module")
def baseline(server) -> dict:
    """Greedy answers before any attack (the completion is also the offline reference)."""
    ids = _completion(server.url)
    assert ids == offline_greedy([PROMPTS[0]], 8)[0]
    chat = _chat(server.url)
    assert chat.status_code == 200, chat.text
    return {"completion": ids, "chat": chat.json()["choices"][0]["message"]["content"]}


def _still_serving(server, baseline) -> None:
    status, seconds = health_latency(server.url)
    assert status == 200 and seconds < 1.0, (status, seconds)
    assert _completion(server.url) == baseline["completion"]
    assert _chat(server.url).json()["choices"][0]["message"]["content"] == baseline["chat"]
    out = server.output()
    assert "Traceback" not in out and "Too many open files" not in out, out[-3000:]


# ---- 1. the internal channels -------------------------------------------------------------------

def test_no_address_or_secret_on_any_command_line_and_private_endpoints(server, baseline):
    env = frontend_environment(server)
    secret, config = env[SECRET_ENV], frontend_config(server)
    addresses = [r["address"] for r in config["ranks"]] + [config["pull_address"]]
    assert all(a.startswith("ipc:///") for a in addresses), addresses     # one host: ipc
    for pid in server.record_tree():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert secret not in cmd and "ipc://" not in cmd and "tcp://" not in cmd, cmd
    for address in addresses:                 # only this user enters, only this user connects
        path = Path(address[len("ipc://"):])
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700, address
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, address
    assert stat.S_IMODE(os.stat(f"/proc/{frontend_pid(server)}/environ").st_mode) == 0o400


def test_messages_of_other_processes_are_dropped_and_counted_never_fatal(server, baseline):
    """The issue's attack: a stray message to a rank's inbox ended the cluster. Now every
    message without this job's MAC is dropped and counted, at both ends."""
    config = frontend_config(server)
    strays = stray_messages()
    send_stray(config["ranks"][0]["address"], strays)
    send_stray(config["pull_address"], strays)
    # the rank reports its counts in its next heartbeat (every 0.5 s)
    assert wait_until(lambda: metric(server.url, "dropped_messages_total", receiver="rank0",
                                     reason="unauthenticated") == len(strays), 10), \
        metrics(server.url)
    assert metric(server.url, "dropped_messages_total", receiver="frontend",
                  reason="unauthenticated") == len(strays)
    assert "rank 0's inbox dropped message(s) (not sealed by this job" in server.output()
    _still_serving(server, baseline)


# ---- 2. bodies ------------------------------------------------------------------------------------

def _raw_request(port: int, head: bytes, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send `head` on a fresh connection; (what comes back before the server closes, seconds)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        data = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return data, time.monotonic() - start


def test_a_body_over_the_limit_gets_413_before_it_is_read(server, baseline):
    before = metric(server.url, "http_rejected_total", reason="body_too_large") or 0
    # 50 MB announced, nothing of it sent: the answer comes at once
    reply, seconds = _raw_request(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Type: application/json\r\n"
                                  b"Content-Length: 50000000\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413 ") and seconds < 1.0, (reply[:300], seconds)
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large" and "--max-body-size" in \
        body["error"]["message"]

    def chunks():                      # no Content-Length: counted as it arrives
        for _ in range(30):
            yield b" " * (1 << 20)

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert metric(server.url, "http_rejected_total", reason="body_too_large") == before + 2
    _still_serving(server, baseline)


def test_a_large_body_is_parsed_off_the_event_loop(server, baseline):
    """A 16 MB prompt (within the limit): decoding, validating and tokenizing it took the event
    loop for seconds; now /health answers in under a second meanwhile."""
    body = json.dumps({"model": "tiny_pair", "prompt": "a" * (16 << 20),
                       "max_tokens": 4}).encode()
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            status, seconds = health_latency(server.url)
            assert status == 200
            latencies.append(seconds)
            time.sleep(0.02)

    with cf.ThreadPoolExecutor(1) as pool:
        poller = pool.submit(poll)
        time.sleep(0.2)
        start = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                       headers={"Content-Type": "application/json"})
        took = time.monotonic() - start
        done.set()
        poller.result()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert max(latencies) < 1.0, (max(latencies), took)
    _still_serving(server, baseline)


# ---- 3. slow and idle clients, and the connection cap ----------------------------------------------

def test_slow_and_idle_clients_are_cut_off(server, baseline):
    before = {k: metric(server.url, "http_rejected_total", reason=k) or 0
              for k in ("header_timeout", "body_timeout")}
    with cf.ThreadPoolExecutor(3) as pool:
        # headers one byte every 0.3 s: 408 at --header-timeout (1 s)
        def trickle() -> tuple[bytes, float]:
            start = time.monotonic()
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                try:
                    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n":
                        sock.sendall(bytes([byte]))
                        time.sleep(0.3)
                except OSError:
                    pass
                try:
                    return sock.recv(4096), time.monotonic() - start
                except OSError:
                    return b"", time.monotonic() - start

        headers = pool.submit(trickle)
        idle = pool.submit(_raw_request, server.port, b"")        # says nothing at all
        body = pool.submit(_raw_request, server.port,             # headers, then 1 of 100 bytes
                           b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        reply, seconds = headers.result()
        assert reply.startswith(b"HTTP/1.1 408 ") and 0.9 < seconds < 3.0, (reply, seconds)
        reply, seconds = idle.result()
        assert reply == b"" and 0.9 < seconds < 3.0, (reply, seconds)   # --timeout-keep-alive
        reply, seconds = body.result()
        assert reply.startswith(b"HTTP/1.1 408 ") and 1.9 < seconds < 4.0, (reply, seconds)
        assert b"--body-timeout" in reply
    for kind in before:
        assert metric(server.url, "http_rejected_total", reason=kind) == before[kind] + 1
    _still_serving(server, baseline)


def test_connections_past_the_cap_are_closed_without_running_out_of_files(server, baseline):
    """The issue's 1100 half-open connections at a file limit of 1024, scaled to 256: the
    frontend holds at most CAP (below the limit), closes the rest at once, logs that once, never
    hits EMFILE; the held ones are closed after --timeout-keep-alive."""
    before = metric(server.url, "http_connections_refused_total")
    sockets, reset = [], 0
    try:
        for _ in range(2 * CAP):
            try:
                sockets.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
            except ConnectionResetError:      # refused so fast the connect itself saw the reset
                reset += 1
        assert wait_until(lambda: f"connections open, the cap is {CAP}" in server.output(), 10)
    finally:
        for sock in sockets:
            sock.close()
    assert wait_until(lambda: health_latency(server.url)[0] == 200, 10)
    refused = metric(server.url, "http_connections_refused_total") - before
    assert reset <= refused <= 2 * CAP and refused > 0, (refused, reset)
    assert server.output().count("refusing new HTTP connections") <= 2
    assert wait_until(lambda: metric(server.url, "http_connections_open") <= 2, 5)
    _still_serving(server, baseline)


# ---- 4 and 5. chat templates -----------------------------------------------------------------------

def test_a_chat_template_is_bounded_in_time_output_and_memory_and_every_failure_is_a_400(
        server, baseline):
    latencies: list[float] = []
    with cf.ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        spin = pool.submit(_chat, server.url, "spin")
        while not spin.done():
            status, seconds = health_latency(server.url)
            assert status == 200
            latencies.append(seconds)
            time.sleep(0.05)
        took = time.monotonic() - start
    assert max(latencies) < 1.0 and took < 4.0, (max(latencies), took)
    outcomes = {"spin": spin.result()}
    for content in ("overflow", "flood", "bomb"):
        outcomes[content] = _chat(server.url, content)
    expect = {"spin": ("timeout", "did not finish within 1 s (--chat-template-timeout)"),
              "overflow": ("error", "OverflowError"),
              "flood": ("too_long", "output passed"),
              "bomb": ("error", "MemoryError")}
    for content, (kind, words) in expect.items():
        r = outcomes[content]
        error = r.json()["error"]
        assert r.status_code == 400, (content, r.text)
        assert (error["param"], error["code"], error["type"]) == \
            ("messages", "chat_template_error", "invalid_request_error"), (content, error)
        assert error["message"].startswith("messages: ") and words in error["message"], error
    m = metrics(server.url)
    assert find(m, "chat_template_failures_total", kind="timeout") >= 1
    assert find(m, "chat_template_failures_total", kind="too_long") >= 1
    assert find(m, "chat_template_failures_total", kind="error") >= 2
    renders = [pid for pid in server.record_tree()
               if _cmdline(pid) and b"workers.server.render" in _cmdline(pid)]
    assert len(renders) <= 2, renders               # the spinning one was killed, not leaked
    _still_serving(server, baseline)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# ---- issue 34: start-ups that fail before anything loads -----------------------------------------

def _serve_exits(args: list[str], open_files: int = 0) -> tuple[subprocess.CompletedProcess,
                                                                  float]:
    def limit() -> None:
        if open_files:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "adaptive_dist", "serve", *args],
                         capture_output=True, text=True, timeout=120, preexec_fn=limit,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out, time.monotonic() - start


def test_a_busy_port_fails_before_the_model_loads_with_exit_2():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out, _ = _serve_exits(["--port", str(port), "--steps", "3"])
    assert out.returncode == 2, out.stderr
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in out.stderr, out.stderr
    assert "in use" in out.stderr, out.stderr
    assert "loading the model" not in out.stderr and "serving" not in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_a_connection_cap_above_the_file_limit_is_refused_by_name():
    out, _ = _serve_exits(["--port", str(free_port()), "--max-connections", "1000"],
                          open_files=OPEN_FILES)
    assert out.returncode == 2, out.stderr
    assert f"--max-connections 1000: above what the open-file limit allows ({OPEN_FILES} " \
           f"files" in out.stderr and f"at most {CAP}" in out.stderr, out.stderr
    assert "loading the model" not in out.stderr
