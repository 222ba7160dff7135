"""The serving job's internal channels: where their sockets live and who may speak on them.

Every zmq message between the frontend and the ranks is sealed with the job's secret::

    HMAC-SHA256(key, sender | counter | payload) (32 bytes) | sender (8) | counter (8) | payload

``key`` is derived from the job's secret, one per direction (``control``: frontend -> ranks,
``output``: ranks -> frontend), so a message of one direction is no message of the other.
``sender`` is random per sending socket and ``counter`` counts that socket's messages, so a
receiver drops a message it has already seen (a replay) by its counter. A message that is too
short, has a wrong MAC, or repeats a counter is dropped and counted (``Verifier.dropped``), never
fatal; so is an authenticated message that does not decode (``malformed``).

The secret: ``ADAPTIVE_DIST_SERVE_SECRET`` when set on every rank (the same value; it then never
crosses the network), else 32 random bytes rank 0 draws at launch and hands to the other ranks in
the start-up address exchange and to the frontend in its environment; never on a command line.

Where the sockets live (``Endpoints``): when the whole job runs on one host, every socket is an
``ipc://`` endpoint in a directory only this user can enter (mode 0700; the socket files 0600),
so no other user's process can even connect. Across hosts they are TCP sockets on the job's
interface, and the MAC is what keeps other processes' messages out (docs/serving.md,
"Security"; docs/multinode.md).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import shutil
import struct
import tempfile
import threading
import time
from typing import Any, Optional

log = logging.getLogger("adaptive_dist.serve")

SECRET_ENV = "ADAPTIVE_DIST_SERVE_SECRET"
"""A secret the user gives every rank (the same on every host); unset: rank 0 draws one."""
MIN_SECRET_CHARS = 16

MAC_BYTES = 32
HEADER = struct.Struct(">8sQ")            # sender, counter
PREFIX_BYTES = MAC_BYTES + HEADER.size
REASONS = ("unauthenticated", "replayed", "malformed")
LOG_EVERY_S = 10.0

INBOX_MAX_MESSAGE = 256 << 20   # a rank's inbox: a Generate holds at most one context of ids
OUTPUT_MAX_MESSAGE = 1 << 30    # the frontend's inbox: prompt logprobs of long prompts


def new_secret() -> str:
    """A fresh per-job secret (hex text of 32 random bytes)."""
    return secrets.token_hex(32)


def user_secret() -> Optional[str]:
    """The secret the user set in the environment (None: none); `ValueError` naming the
    variable when it is too short to be one."""
    value = os.environ.get(SECRET_ENV)
    if value is None or value == "":
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"{SECRET_ENV}: {len(value)} characters; give at least "
                         f"{MIN_SECRET_CHARS} (e.g. the output of `openssl rand -hex 32`)")
    return value


def secret_digest(secret: str) -> str:
    """What ranks compare to check they hold the same secret without showing it."""
    return hashlib.sha256(b"adaptive_dist serve secret check\0" + secret.encode()).hexdigest()


class JobKey:
    """The two direction keys of a job's secret."""

    def __init__(self, secret: str) -> None:
        raw = secret.encode()
        self.control = hmac.new(raw, b"adaptive_dist serve control", hashlib.sha256).digest()
        self.output = hmac.new(raw, b"adaptive_dist serve output", hashlib.sha256).digest()


class Signer:
    """Seals the messages of one sending socket (one thread at a time)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.sender = os.urandom(8)
        self.counter = 0

    def seal(self, payload: bytes) -> bytes:
        self.counter += 1
        header = HEADER.pack(self.sender, self.counter)
        mac = hmac.new(self.key, header + payload, hashlib.sha256).digest()
        return mac + header + payload


class Verifier:
    """Opens the messages of one receiving socket: the payload, or None for a dropped message
    (counted in `dropped` by reason, logged at most once per `LOG_EVERY_S`)."""

    def __init__(self, key: bytes, name: str) -> None:
        self.key, self.name = key, name
        self.dropped = {reason: 0 for reason in REASONS}   # fixed keys: read from other threads
        self._last: dict[bytes, int] = {}
        self._logged_at = 0.0
        self._logged = dict(self.dropped)
        self._lock = threading.Lock()

    def open(self, data: bytes) -> Optional[bytes]:
        if len(data) < PREFIX_BYTES:
            return self.drop("unauthenticated")
        mac, rest = data[:MAC_BYTES], data[MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self.key, rest, hashlib.sha256).digest()):
            return self.drop("unauthenticated")
        sender, counter = HEADER.unpack_from(rest)
        if counter <= self._last.get(sender, 0):
            return self.drop("replayed")
        self._last[sender] = counter
        return rest[HEADER.size:]

    def drop(self, reason: str, detail: str = "") -> None:
        """Count (and maybe log) one dropped message; returns None."""
        with self._lock:
            self.dropped[reason] += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            counts = {r: self.dropped[r] - self._logged[r] for r in REASONS}
            self._logged, self._logged_at = dict(self.dropped), now
            log.warning("%s dropped message(s) (not sealed by this job, replayed, or not "
                        "well-formed): %s%s", self.name,
                        ", ".join(f"{n} {r}" for r, n in counts.items() if n),
                        f" (last: {detail})" if detail else "")
        return None

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.dropped)


class Endpoints:
    """Where one process binds its serving sockets: ``ipc://`` endpoints in a fresh private
    directory (`tcp_host` None: the job is on one host), or TCP on `tcp_host`'s random ports."""

    def __init__(self, tcp_host: Optional[str] = None) -> None:
        self.tcp_host = tcp_host
        self.directory: Optional[str] = None
        if tcp_host is None:
            base = tempfile.gettempdir()
            if len(base) > 60:        # an ipc path must fit a socket address (107 bytes)
                base = "/tmp"
            _remove_stale(base)
            self.directory = tempfile.mkdtemp(prefix=f"adist-{os.getpid()}-", dir=base)  # 0700
            os.chmod(self.directory, 0o700)

    def bind(self, sock: Any, name: str) -> str:
        """Bind `sock`; its address for the peers."""
        if self.directory is None:
            port = sock.bind_to_random_port(f"tcp://{self.tcp_host}")
            return f"tcp://{self.tcp_host}:{port}"
        path = os.path.join(self.directory, name)
        address = f"ipc://{path}"
        sock.bind(address)
        os.chmod(path, 0o600)
        return address

    def address_for(self, name: str) -> str:
        """An address another process of this job binds (the frontend's inbox): a path in this
        directory, or a free TCP port of `tcp_host`."""
        if self.directory is None:
            from collectives import free_port

            return f"tcp://{self.tcp_host}:{free_port()}"
        return f"ipc://{os.path.join(self.directory, name)}"

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def _remove_stale(base: str) -> None:
    """Remove the endpoint directories of this user's serving processes that are gone (a
    process killed with SIGKILL cannot remove its own): ``adist-PID-*``, owned by this user,
    PID no longer running."""
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        parts = entry.name.split("-")
        if len(parts) < 3 or parts[0] != "adist" or not parts[1].isdigit():
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or info.st_uid != os.getuid():
                continue
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue
