"""Rank-side sockets: the sequenced inbox, the outbox to the frontend, and the heartbeat.

``Inbox`` binds a PULL socket on a free port and keeps control messages in ``seq`` order.
Messages may arrive in any order; ``received_seq`` is the highest ``seq`` up to which every
message has arrived, and ``take_upto(seq)`` hands out the next messages up to an agreed ``seq``
(a single rank agrees with itself; in the DP-attention cluster the ranks agree in the round's
consensus on the smallest ``received_seq``, so every rank of a DP group admits the same requests
in the same round). ``wait`` blocks in ``zmq.Poller.poll`` until a message (or a signal, through
``wakeup_fd``) arrives.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Optional

import zmq

from workers.server import protocol
from workers.server.protocol import ControlMessage, Heartbeat

log = logging.getLogger("adaptive_dist.serve")

LINGER_MS = 2000          # how long a closing socket keeps trying to deliver what is queued


class Inbox:
    """The sequenced PULL inbox of one rank."""

    def __init__(self, ctx: zmq.Context, host: str = "127.0.0.1") -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._pending: dict[int, ControlMessage] = {}
        self._next = 1              # the next seq to hand out
        self.received_seq = 0       # every message up to this seq has arrived

    @property
    def wakeup_fd(self) -> int:
        """A file descriptor whose write wakes `wait` (for `signal.set_wakeup_fd`)."""
        return self._wake_w.fileno()

    @property
    def has_unapplied(self) -> bool:
        """Whether messages up to `received_seq` were not handed out yet."""
        return self.received_seq >= self._next

    def wait(self, timeout_s: Optional[float]) -> bool:
        """Block until a message or a wake-up arrives (at most `timeout_s`; None: no limit),
        then take in everything available. Returns whether a control message arrived."""
        timeout = None if timeout_s is None else max(0, int(timeout_s * 1000))
        ready = dict(self.poller.poll(timeout))
        if self._wake_r.fileno() in ready:
            self._drain_wakeups()
        return self.receive() > 0

    def receive(self) -> int:
        """Take in every message already delivered (no blocking); returns how many."""
        count = 0
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return count
            self._store(protocol.decode(data))
            count += 1

    def take_upto(self, seq: int) -> list[ControlMessage]:
        """The messages from the next unapplied seq through `seq`, in order (the agreed point)."""
        if seq > self.received_seq:
            raise ValueError(f"take_upto({seq}): only messages up to seq {self.received_seq} "
                             f"have arrived")
        out = [self._pending.pop(s) for s in range(self._next, seq + 1)]
        self._next = max(self._next, seq + 1)
        return out

    def _store(self, msg: Any) -> None:
        if not isinstance(msg, protocol.SEQUENCED):
            raise protocol.ProtocolError(f"{type(msg).__name__} is not a control message")
        if msg.seq < self._next or msg.seq in self._pending:
            raise protocol.ProtocolError(f"seq {msg.seq} arrived twice")
        self._pending[msg.seq] = msg
        while self.received_seq + 1 in self._pending:
            self.received_seq += 1

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        self.poller.unregister(self.sock)
        self.sock.close()
        self._wake_r.close()
        self._wake_w.close()


class Outbox:
    """A PUSH socket to the frontend's PULL socket. Sends never block (no high-water mark):
    a frontend that stopped reading is noticed by the launch, not by a stuck engine."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.connect(address)

    def send(self, msg: Any) -> None:
        self.sock.send(protocol.encode(msg))

    def close(self) -> None:
        self.sock.close()


class HeartbeatThread(threading.Thread):
    """Sends `Heartbeat` every `interval_s` from its own socket, so a rank stuck in a long round
    or a collective still shows it is alive, and a dead process stops showing it."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int, interval_s: float) -> None:
        super().__init__(name=f"heartbeat-rank{rank}", daemon=True)
        self.ctx, self.address, self.rank, self.interval_s = ctx, address, rank, interval_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 4)    # a beat that cannot be delivered is simply dropped
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        beat = protocol.encode(Heartbeat(rank=self.rank, pid=os.getpid()))
        try:
            while not self._stop_event.is_set():
                try:
                    sock.send(beat, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self._stop_event.wait(self.interval_s)
        finally:
            sock.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2.0)
