"""Chat template renders in worker processes, bounded in time, output and memory.

A template is code from a checkpoint (``tokenizer_config.json``) or ``--chat-template``; Jinja's
sandbox stops attribute tricks but not a loop of 10**10 iterations or a string of gigabytes. So
the frontend never renders one itself: ``RenderPool.render`` sends the messages to a worker
process (``python -m workers.server.render``, which imports jinja2 and ``workers.server.chat``
only) over a pipe and waits at most ``timeout_s``; a worker that has not answered by then is
killed (SIGKILL) and replaced, and the request fails alone. The worker renders through
``ChatTemplate.render_bounded`` (the output stops at ``max_chars``) under an address-space limit,
so a render that would take all memory fails with ``MemoryError`` in the worker, not the
frontend. Every failure reaches the caller as ``TemplateRefusal`` with its ``kind``: "refused"
(the template's ``raise_exception``), "error" (any other failure of the render), "timeout",
"too_long".

Frames on the pipes: a 4-byte big-endian length, then JSON (UTF-8, lone surrogates passed
through). The worker's first frame is the template; then one request frame -> one reply frame.
A worker exits when its input closes or its parent is gone.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO, Optional

from workers.server.chat import TemplateRefusal, TemplateSource

log = logging.getLogger("adaptive_dist.serve")

_LENGTH = struct.Struct(">I")
MAX_FRAME = (1 << 32) - 1


def _dump(obj: Any) -> bytes:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if len(data) > MAX_FRAME:
        raise ValueError(f"a frame of {len(data)} bytes is too large for the render pipe")
    return _LENGTH.pack(len(data)) + data


def _load(data: bytes) -> Any:
    return json.loads(data.decode("utf-8", "surrogatepass"))


def memory_limit(max_chars: int) -> int:
    """The worker's address-space limit: room for the interpreter, the messages and an output
    of `max_chars` characters (4 bytes each at worst) a few times over."""
    return max(2 << 30, 24 * max_chars)


class _Worker:
    """One render process and its pipes."""

    def __init__(self, setup: dict) -> None:
        env = dict(os.environ)
        for key in ("ADAPTIVE_DIST_SERVE_SECRET", "ADAPTIVE_DIST_FRONTEND_CONFIG",
                    "ADAPTIVE_DIST_API_KEY"):
            env.pop(key, None)            # a template has no business with these
        self.proc = subprocess.Popen([sys.executable, "-m", "workers.server.render"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.stdin: BinaryIO = self.proc.stdin      # type: ignore[assignment]
        self.stdout: BinaryIO = self.proc.stdout    # type: ignore[assignment]
        self.stdin.write(_dump(setup))
        self.stdin.flush()

    def call(self, request: dict, timeout_s: float) -> dict:
        """The worker's reply; `TimeoutError` past `timeout_s`, `EOFError` when it died."""
        deadline = time.monotonic() + timeout_s
        self.stdin.write(_dump(request))
        self.stdin.flush()
        size, = _LENGTH.unpack(self._read(_LENGTH.size, deadline))
        return _load(self._read(size, deadline))

    def _read(self, n: int, deadline: float) -> bytes:
        fd = self.stdout.fileno()
        parts, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError()
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise EOFError(f"the render process ended (code {self.proc.poll()})")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (self.stdin, self.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class RenderPool:
    """Up to `size` render workers for one template (thread-safe; `render` blocks its thread)."""

    def __init__(self, source: TemplateSource, specials: dict[str, str], timeout_s: float,
                 max_chars: int, size: int = 2) -> None:
        self.timeout_s, self.max_chars, self.size = timeout_s, max_chars, size
        self._setup = {"template": source.text, "origin": source.origin, "specials": specials,
                       "max_chars": max_chars, "memory": memory_limit(max_chars)}
        self._idle: "queue.LifoQueue[_Worker]" = queue.LifoQueue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    def warm(self) -> None:
        """Start the workers now (the first chat requests do not wait for them, and the job's
        processes do not change while it serves)."""
        try:
            for _ in range(self.size):
                self._idle.put(self._start())
        except (OSError, RuntimeError) as err:
            log.warning("could not start a chat template worker: %s", err)

    def _start(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the server is stopping")
            worker = _Worker(self._setup)
            self._all.add(worker)
            return worker

    def _take(self) -> _Worker:
        """An idle worker, a new one while fewer than `size` run, else the next one freed."""
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                room = len(self._all) < self.size
            if room:
                return self._start()
            try:
                return self._idle.get(timeout=0.1)
            except queue.Empty:
                continue          # a busy one may have been killed meanwhile: room again

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The prompt text; `TemplateRefusal` (with its `kind`) for every failure."""
        request = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        worker = self._take()
        try:
            try:
                reply = worker.call(request, self.timeout_s)
            except BrokenPipeError:       # it died while idle (not this request's doing): anew
                self._discard(worker)
                worker = self._take()
                reply = worker.call(request, self.timeout_s)
        except TimeoutError:
            self._discard(worker)
            raise TemplateRefusal(f"the chat template did not finish within {self.timeout_s:g} s "
                                  f"(--chat-template-timeout); it was stopped",
                                  kind="timeout") from None
        except (EOFError, OSError, ValueError) as err:
            self._discard(worker)
            raise TemplateRefusal(f"the chat template failed on them (the render process "
                                  f"ended: {err})", kind="error") from None
        except BaseException:
            self._discard(worker)
            raise
        self._idle.put(worker)
        if "text" in reply:
            return reply["text"]
        raise TemplateRefusal(reply.get("error", "the chat template failed"),
                              kind=reply.get("kind", "error"))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        for worker in workers:
            worker.kill()


# ---- the worker process -------------------------------------------------------------------------

def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def worker_main() -> int:
    """``python -m workers.server.render``: render requests from stdin until it closes."""
    import resource
    import signal

    from workers.server.chat import ChatTemplate

    for sig in (signal.SIGINT, signal.SIGTERM):   # the frontend ends it (a terminal's Ctrl-C and
        signal.signal(sig, signal.SIG_IGN)        # torchrun's SIGTERM reach the whole group)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def read_frame() -> Optional[Any]:
        head = stdin.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            return None
        size, = _LENGTH.unpack(head)
        return _load(stdin.read(size))

    def write_frame(obj: Any) -> None:
        stdout.write(_dump(obj))
        stdout.flush()

    setup = read_frame()
    if setup is None:
        return 0
    try:
        resource.setrlimit(resource.RLIMIT_AS, (setup["memory"], setup["memory"]))
    except (ValueError, OSError):
        pass
    try:
        template: Optional[ChatTemplate] = ChatTemplate(
            TemplateSource(setup["template"], setup["origin"]), setup["specials"])
        broken = None
    except ValueError as err:
        template, broken = None, str(err)
    while True:
        request = read_frame()
        if request is None:
            return 0
        try:
            if template is None:
                raise TemplateRefusal(broken or "the chat template does not compile",
                                      kind="error")
            reply = {"text": template.render_bounded(request["messages"],
                                                     request["add_generation_prompt"],
                                                     setup["max_chars"])}
        except TemplateRefusal as err:
            reply = {"error": str(err), "kind": err.kind}
        except BaseException as err:   # MemoryError, RecursionError, ...: the render failed
            reply = {"error": f"the template failed on them ({type(err).__name__}: "
                              f"{str(err)[:300]})", "kind": "error"}
        try:
            write_frame(reply)
        except MemoryError:
            write_frame({"error": "the template failed on them (MemoryError: its output is "
                                  "too large to send)", "kind": "error"})


if __name__ == "__main__":
    code = worker_main()
    sys.stdout.flush()
    os._exit(code)
