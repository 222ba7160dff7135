"""The HTTP side's limits: what a client can hold of the frontend, and for how long.

- ``bind_http``: rank 0 binds and listens on ``--host:--port`` before anything loads (a busy
  port fails the start at once, exit 2) and hands the socket to the frontend.
- ``connection_cap``: open connections at most, below the open-file limit (raised to its hard
  limit first, as vLLM does), so accepting never runs out of file descriptors.
- ``accept_connections``: the frontend's accept loop, one connection at a time, closing at once
  what comes past that cap.
- ``guarded_protocol``: uvicorn's HTTP protocol with an idle timer from the moment a connection
  opens (``--timeout-keep-alive``; uvicorn arms it only after a response) and a header timer
  (``--header-timeout``: from a request's first byte to the end of its headers; then 408 and the
  connection closes).
- ``RequestLimits``: ASGI middleware: a body larger than ``--max-body-size`` is a 413 (from its
  Content-Length, before any of it is read; counted as it arrives otherwise), a body slower than
  ``--body-timeout`` a 408.
- ``RateLimitedLog`` / ``quiet_exhaustion``: resource exhaustion (refused connections, accept
  errors such as EMFILE, malformed requests) is logged once per interval with a count, never
  once per event.

No torch here; uvicorn and starlette are imported by the functions that need them.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
import time
from typing import Any, Callable, Optional

log = logging.getLogger("adaptive_dist.serve")

LOG_EVERY_S = 10.0
FDS_KEPT = 64            # file descriptors the frontend keeps for itself, besides 2 per rank
FD_TARGET = 65536        # the open-file limit the frontend raises its soft limit towards


# ---- the listening socket ---------------------------------------------------------------------

def bind_http(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on `host`:`port` (as uvicorn binds one: IPv6 when the host has a
    colon, SO_REUSEADDR); `ValueError` naming `--host` / `--port` when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        what = err.strerror or str(err)
        hint = " (another server listens there: pick another --port)" \
            if err.errno in (98, 48) else ""
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {what}{hint}") \
            from None
    except (OverflowError, socket.gaierror) as err:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {err}") from None
    sock.set_inheritable(True)
    return sock


# ---- the connection cap -----------------------------------------------------------------------

def raise_file_limit() -> tuple[int, int]:
    """Raise this process's soft open-file limit towards its hard limit (at most `FD_TARGET`);
    the (soft, hard) limits after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_TARGET if hard == resource.RLIM_INFINITY else min(hard, FD_TARGET)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft, hard


def connection_cap(requested: Optional[int], ranks: int) -> int:
    """Open connections the frontend allows: `requested` (`--max-connections`), or all the
    open-file limit leaves after what the frontend keeps for itself (`FDS_KEPT` plus 2 per
    rank); `ValueError` naming the flag when `requested` is above that."""
    soft, _ = raise_file_limit()
    kept = FDS_KEPT + 2 * ranks
    room = (FD_TARGET if soft < 0 else soft) - kept
    if room < 1:
        raise ValueError(f"the open-file limit ({soft}) leaves no room for connections (the "
                         f"server keeps {kept} for itself): raise it (ulimit -n)")
    if requested is None:
        return room
    if requested > room:
        raise ValueError(f"--max-connections {requested}: above what the open-file limit allows "
                         f"({soft} files, {kept} kept for the server: at most {room}); raise the "
                         f"limit (ulimit -n) or lower the flag")
    return requested


# ---- rate-limited logging ---------------------------------------------------------------------

class RateLimitedLog:
    """Counts events of one kind and logs them at most once per `every_s` (the first at once),
    with how many happened since the last line."""

    def __init__(self, what: str, every_s: float = LOG_EVERY_S,
                 logger: logging.Logger = log) -> None:
        self.what, self.every_s, self.logger = what, every_s, logger
        self.total = 0
        self._since = 0
        self._last = -1e18

    def event(self, detail: str = "") -> None:
        self.total += 1
        self._since += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self.logger.warning("%s: %d time(s) in the last %.0f s (%d in all)%s", self.what,
                                self._since, min(self.every_s, now - self._last), self.total,
                                f"; {detail}" if detail else "")
            self._last, self._since = now, 0


class _RepeatFilter(logging.Filter):
    """Lets each distinct message of a logger through at most once per interval (uvicorn's
    per-request warnings: an attacker must not be able to fill the log)."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        super().__init__()
        self.every_s = every_s
        self._seen: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.levelno}:{record.msg}"
        now = time.monotonic()
        last, suppressed = self._seen.get(key, (-1e18, 0))
        if now - last < self.every_s:
            self._seen[key] = (last, suppressed + 1)
            return False
        if len(self._seen) > 1000:
            self._seen.clear()
        self._seen[key] = (now, 0)
        if suppressed:
            record.msg = f"{record.msg} (and {suppressed} more like it since the last)"
        return True


def quiet_exhaustion(loop: asyncio.AbstractEventLoop, exhausted: RateLimitedLog) -> None:
    """Accept errors asyncio reports itself (EMFILE, ENFILE, ...) go to `exhausted` (once per
    interval, no traceback), and uvicorn's per-request warnings ("Invalid HTTP request
    received.") are logged once per interval."""
    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = context.get("message", "")
        if "out of system resource" in message:
            exc = context.get("exception")
            exhausted.event(f"{type(exc).__name__}: {exc}" if exc is not None else message)
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    for name in ("uvicorn.error", "uvicorn", "asyncio"):
        logging.getLogger(name).addFilter(_RepeatFilter())


# ---- accepting connections, with the cap ------------------------------------------------------

_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


async def accept_connections(sock: socket.socket, make_protocol: Callable[[], Any],
                             connections: set, cap: int, refused: RateLimitedLog,
                             exhausted: RateLimitedLog) -> None:
    """Accept connections on the listening `sock` one at a time, until cancelled: each becomes
    a transport of `make_protocol()` while fewer than `cap` are open (`connections`, uvicorn's
    set); past the cap it is closed at once (a reset; counted in `refused`). One at a time, so
    at most one descriptor is ever held beyond the cap: with `cap` below the open-file limit,
    accepting never fails for lack of descriptors (asyncio's own server accepts a whole backlog
    in one go, then fails with EMFILE and logs a traceback per attempt). An accept error that
    does happen (EMFILE from elsewhere, ENFILE: the system's limit) is counted in `exhausted`
    and retried after a pause."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    linger_off = struct.pack("ii", 1, 0)
    while True:
        try:
            conn, _ = await loop.sock_accept(sock)
        except OSError as err:
            if err.errno in _EXHAUSTED:
                exhausted.event(f"{err.strerror} ({len(connections)} connections open)")
                await asyncio.sleep(0.2)
                continue
            if err.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                continue
            raise
        if len(connections) >= cap:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_off)   # RST
            except OSError:
                pass
            conn.close()
            refused.event(f"{len(connections)} connections open, the cap is {cap} "
                          f"(--max-connections / the open-file limit)")
            continue
        try:
            await loop.connect_accepted_socket(make_protocol, conn)
        except OSError:
            conn.close()


# ---- uvicorn's protocol with the timers -------------------------------------------------------

_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


def guarded_protocol(header_timeout: float,
                     timeouts: Optional[Callable[[str], None]] = None) -> type:
    """uvicorn's h11 protocol class with two timers (module docstring): idle from the moment a
    connection opens (uvicorn arms its keep-alive timer only after a response), and
    `header_timeout` from a request's first byte to the end of its headers (then 408 and
    close). `timeouts(kind)` is told of each connection a header timer closes ("header")."""
    import json

    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = json.dumps({"error": {"message": f"the request's headers did not arrive within "
                                            f"{header_timeout:g} s (--header-timeout)",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    reply = _REQUEST_TIMEOUT % (len(body), body)

    class GuardedH11Protocol(H11Protocol):
        _header_timer: Optional[asyncio.TimerHandle] = None
        _header_cycle: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # silent from the start: closed after --timeout-keep-alive, as between requests
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and self._header_timer is None:
                self._header_cycle = self.cycle
                self._header_timer = self.loop.call_later(header_timeout, self._header_expired)
            super().data_received(data)
            if self.cycle is not self._header_cycle:
                self._stop_header_timer()       # the headers are in: a request runs

        def on_response_complete(self) -> None:
            self._stop_header_timer()
            super().on_response_complete()

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_expired(self) -> None:
            self._header_timer = None
            if self.cycle is self._header_cycle and not self.transport.is_closing():
                if timeouts is not None:
                    timeouts("header")
                self.transport.write(reply)
                self.transport.close()

    return GuardedH11Protocol


# ---- body size and body time ------------------------------------------------------------------

class BodyTooLarge(Exception):
    pass


class BodyTooSlow(Exception):
    pass


class RequestLimits:
    """ASGI middleware over the app: a request whose Content-Length is over `max_body` gets 413
    at once (nothing of its body read); one without a Content-Length (chunked) is counted as it
    arrives and gets 413 when it passes `max_body`; a body that has not fully arrived
    `body_timeout` seconds after the headers gets 408. `on_reject(status)` counts each."""

    def __init__(self, app: Any, max_body: int, body_timeout: float,
                 on_reject: Callable[[int], None] = lambda status: None) -> None:
        self.app, self.max_body, self.body_timeout = app, max_body, body_timeout
        self.on_reject = on_reject

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        for name, value in scope.get("headers") or ():
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = None
        if length is not None and length > self.max_body:
            await self._reject(send, 413, self._too_large(f"{length} bytes (its Content-Length)"))
            return
        deadline = time.monotonic() + self.body_timeout
        state = {"seen": 0, "done": scope.get("method") in ("GET", "HEAD", "OPTIONS")}
        started = {"response": False}

        async def limited_receive() -> dict:
            if state["done"]:
                return await receive()
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0.001))
            except asyncio.TimeoutError:
                raise BodyTooSlow() from None
            if message["type"] == "http.request":
                state["seen"] += len(message.get("body", b""))
                if state["seen"] > self.max_body:
                    raise BodyTooLarge()
                if not message.get("more_body", False):
                    state["done"] = True
            else:
                state["done"] = True
            return message

        async def tracking_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                started["response"] = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started["response"]:
                await self._reject(send, 413, self._too_large(f"more than {self.max_body} bytes"))
        except BodyTooSlow:
            if not started["response"]:
                await self._reject(send, 408, (
                    f"the request body did not arrive within {self.body_timeout:g} s of its "
                    f"headers (--body-timeout)", "request_timeout"))

    def _too_large(self, what: str) -> tuple[str, str]:
        return (f"the request body is {what}; this server takes at most {self.max_body} bytes "
                f"(--max-body-size)", "request_too_large")

    async def _reject(self, send: Any, status: int, message_code: tuple[str, str]) -> None:
        import json

        self.on_reject(status)
        message, code = message_code
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": code}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
