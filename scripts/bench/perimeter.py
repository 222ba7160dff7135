"""Figures of the serving perimeter (issue 33; docs/serving.md, "Security"): each attack on a real
server, timed, with /health polled meanwhile.

    python -m scripts.bench.perimeter [--only body,template,connections,frozen,killed]

- body: a 50 MB Content-Length (no body sent) -> 413, seconds; a 30 MB prompt within the
  default --max-body-size -> its 400, seconds, and the slowest /health answer meanwhile;
- template: a nested range(100000) loop with --chat-template-timeout 1 -> its 400, seconds, and
  the slowest /health meanwhile;
- connections: 400 connections at an open-file limit of 256 -> held, reset, log lines, EMFILE;
- frozen: SIGSTOP of rank 1 of `--dp 2 --timeout 30` under torchrun -> /health 503 after (s),
  torchrun gone after that (s);
- killed: SIGKILL of rank 1 -> the failure clients read.

Prints one JSON object per part as it goes (progress on stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from scripts.bench.server_process import ServerProcess, descendants

SPIN = ("{%- if messages[0]['content'] == 'spin' -%}{%- for i in range(100000) -%}"
        "{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}{%- else -%}x{%- endif -%}")


def _say(text: str) -> None:
    sys.stderr.write(f"[perimeter] {text}\n")
    sys.stderr.flush()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _while_polling(url: str, work: Callable[[], object]) -> tuple[object, float, float]:
    """(work's result, its seconds, the slowest /health answer while it ran)."""
    import httpx

    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            start = time.monotonic()
            try:
                httpx.get(f"{url}/health", timeout=30)
            except httpx.HTTPError:
                pass
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)

    thread = threading.Thread(target=poll)
    thread.start()
    time.sleep(0.2)
    start = time.monotonic()
    result = work()
    took = time.monotonic() - start
    done.set()
    thread.join()
    return result, took, max(latencies)


def body() -> dict:
    import httpx

    server = ServerProcess(["--steps", "3", "--max-model-len", "512"], _free_port()).wait_ready()
    try:
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                         b"50000000\r\nContent-Type: application/json\r\n\r\n")
            head = sock.recv(4096).split(b"\r\n", 1)[0].decode()
        announced = time.monotonic() - start
        data = json.dumps({"model": "tiny_pair", "prompt": "a" * 30_000_000,
                           "max_tokens": 4}).encode()
        r, took, health = _while_polling(server.url, lambda: httpx.post(
            f"{server.url}/v1/completions", content=data, timeout=120,
            headers={"Content-Type": "application/json"}))
        return {"part": "body", "announced_50MB": head, "announced_s": round(announced, 4),
                "accepted_30MB_status": r.status_code, "accepted_30MB_s": round(took, 2),
                "health_max_s": round(health, 3)}
    finally:
        server.stop()


def template(tmp: Path) -> dict:
    import httpx

    path = tmp / "spin.jinja"
    path.write_text(SPIN)
    server = ServerProcess(["--steps", "3", "--max-model-len", "256", "--chat-template",
                            str(path), "--chat-template-timeout", "1"],
                           _free_port()).wait_ready()
    try:
        r, took, health = _while_polling(server.url, lambda: httpx.post(
            f"{server.url}/v1/chat/completions", timeout=120, json={
                "model": "tiny_pair", "max_tokens": 4,
                "messages": [{"role": "user", "content": "spin"}]}))
        return {"part": "template", "status": r.status_code,
                "message": r.json()["error"]["message"], "s": round(took, 2),
                "health_max_s": round(health, 3)}
    finally:
        server.stop()


def connections() -> dict:
    import httpx

    server = ServerProcess(["--steps", "3", "--max-model-len", "256"], _free_port(),
                           open_files=256).wait_ready()
    try:
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(400)]
        time.sleep(1.0)
        for s in socks:
            s.close()
        time.sleep(6.0)                     # the held ones: closed after --timeout-keep-alive
        page = httpx.get(f"{server.url}/metrics", timeout=10).text
        refused = next(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                       if line.startswith("adaptive_dist_http_connections_refused_total"))
        out = server.output()
        return {"part": "connections", "opened": 400, "refused": int(refused),
                "held": 400 - int(refused),
                "log_lines_refusing": out.count("refusing new HTTP connections"),
                "emfile": out.count("Too many open files"),
                "health_after": httpx.get(f"{server.url}/health", timeout=10).status_code}
    finally:
        server.stop()


def _rank_pid(server: ServerProcess, rank: int) -> int:
    for pid in descendants(server.proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"serve" in cmd \
                and b"torch.distributed.run" not in cmd:
            return pid
    raise RuntimeError(f"no rank {rank}")


def _rank_fails(how: int) -> dict:
    import httpx

    server = ServerProcess(["--dp", "2", "--steps", "3", "--max-model-len", "256",
                            "--timeout", "30"], _free_port(), nproc=2).wait_ready()
    try:
        start = time.monotonic()
        os.kill(_rank_pid(server, 1), how)
        declared, message = None, None
        while server.proc.poll() is None and time.monotonic() - start < 90:
            try:
                r = httpx.get(f"{server.url}/health", timeout=2)
                if r.status_code == 503 and declared is None:
                    declared, message = time.monotonic() - start, r.json()["message"]
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        gone = time.monotonic() - start
        return {"part": "frozen" if how == signal.SIGSTOP else "killed",
                "health_503_after_s": round(declared or -1, 2), "message": message,
                "torchrun_gone_after_s": round(gone, 2),
                "gone_after_declared_s": round(gone - (declared or 0), 2),
                "exit_code": server.proc.returncode}
    finally:
        server.stop()


def main() -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="body,template,connections,frozen,killed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        parts = {"body": body, "template": lambda: template(Path(tmp)),
                 "connections": connections,
                 "frozen": lambda: _rank_fails(signal.SIGSTOP),
                 "killed": lambda: _rank_fails(signal.SIGKILL)}
        for name in args.only.split(","):
            _say(f"{name} ...")
            print(json.dumps(parts[name]()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
