"""Stopping a single-process server: Ctrl-C (SIGINT) with requests in flight, the frontend dying,
the launch dying. Every case: in-flight requests get an error with a message, the processes exit
in bounded time with a clear message, nothing is left running."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx

from serve_helpers import frontend_pid, start_server
from scripts.bench.server_process import alive

LONG = {"model": "tiny_pair", "prompt": "def main():", "max_tokens": 490, "temperature": 0}
# (greedy runs the whole max_tokens on this prompt: no early end of sequence)


def _stream_until_error(url: str) -> dict:
    """Open a long stream; return the error event it ends with (or what went wrong)."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {\"error\""):
                import json

                return json.loads(line[6:])["error"]
            if line == "data: [DONE]":
                return {"message": "finished normally"}
    return {"message": "stream ended without an error event"}


def _post(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=LONG, timeout=60)


def _in_flight(server, pool):
    stream = pool.submit(_stream_until_error, server.url)
    plain = pool.submit(_post, server.url)
    time.sleep(0.5)                                  # both are generating now
    assert not stream.done() and not plain.done()
    return stream, plain


def test_ctrl_c_answers_in_flight_requests_and_leaves_nothing() -> None:
    server = start_server(["--steps", "3", "--max-model-len", "512"])
    with cf.ThreadPoolExecutor(2) as pool:
        stream, plain = _in_flight(server, pool)
        server.signal(signal.SIGINT)
        start = time.monotonic()
        assert "shutting down" in stream.result(timeout=30)["message"]
        r = plain.result(timeout=30)
        assert r.status_code == 503 and "received SIGINT" in r.json()["error"]["message"]
    code = server.wait_exit(15)
    assert code == 0 and time.monotonic() - start < 10, server.output()
    assert server.left_behind() == []
    out = server.output()
    assert "[rank 0] stopping: received SIGINT" in out and "frontend exited (code 0)" in out
    server.stop()


def test_frontend_death_stops_the_rank_with_a_message() -> None:
    server = start_server(["--no-spec"])
    os.kill(frontend_pid(server), signal.SIGKILL)   # (its chat template worker follows it)
    code = server.wait_exit(15)
    assert code == 1, server.output()
    assert "the frontend exited unexpectedly (code -9)" in server.output()
    assert server.left_behind() == []
    server.stop()


def test_launch_death_stops_the_frontend_and_fails_requests() -> None:
    server = start_server(["--steps", "2", "--max-model-len", "512"])
    frontend = frontend_pid(server)
    with cf.ThreadPoolExecutor(2) as pool:
        stream, plain = _in_flight(server, pool)
        os.kill(server.proc.pid, signal.SIGKILL)     # rank 0 dies without a word
        assert "rank 0 (the launch) exited" in stream.result(timeout=30)["message"]
        r = plain.result(timeout=30)
        assert r.status_code == 503 and "rank 0 (the launch) exited" in r.text
    deadline = time.monotonic() + 10
    while alive(frontend) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(frontend)
    assert server.left_behind() == []
    server.stop()
