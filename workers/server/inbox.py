"""Rank-side sockets: the sequenced inbox, the outbox to the frontend, and the heartbeat.

``Inbox`` binds a PULL socket (``channel.Endpoints``: a private ipc endpoint on one host, TCP
across hosts) and keeps control messages in ``seq`` order. Every message must carry the job's
MAC (``channel``); one that does not, repeats, or does not decode is dropped and counted, never
fatal (the heartbeat reports the counts to the frontend's /metrics).
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
import time
from typing import Any, Optional

import zmq

from workers.server import protocol
from workers.server.channel import (INBOX_MAX_MESSAGE, Endpoints, JobKey, Signer, Verifier)
from workers.server.protocol import ControlMessage, Heartbeat

log = logging.getLogger("adaptive_dist.serve")

LINGER_MS = 2000          # how long a closing socket keeps trying to deliver what is queued


class Inbox:
    """The sequenced PULL inbox of one rank."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, key: JobKey,
                 name: str = "rank") -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, INBOX_MAX_MESSAGE)   # a bigger one: peer cut off
        self.address = endpoints.bind(self.sock, "inbox")
        self.verifier = Verifier(key.control, f"{name}'s inbox")
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
        """Block until a control message or a wake-up arrives (at most `timeout_s`; None: no
        limit), then take in everything available. Returns whether a control message arrived.
        Messages that are dropped (not this job's) do not end the wait."""
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = dict(self.poller.poll(None if left is None else int(left * 1000)))
            woken = self._wake_r.fileno() in ready
            if woken:
                self._drain_wakeups()
            if self.receive() > 0:
                return True
            if woken or not ready or (deadline is not None and time.monotonic() >= deadline):
                return False

    def receive(self) -> int:
        """Take in every message already delivered (no blocking); returns how many control
        messages were kept."""
        count = 0
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return count
            payload = self.verifier.open(data)
            if payload is None:
                continue
            try:
                msg = protocol.decode(payload)
            except protocol.ProtocolError as err:
                self.verifier.drop("malformed", str(err)[:200])
                continue
            if self._store(msg):
                count += 1

    def take_upto(self, seq: int) -> list[ControlMessage]:
        """The messages from the next unapplied seq through `seq`, in order (the agreed point)."""
        if seq > self.received_seq:
            raise ValueError(f"take_upto({seq}): only messages up to seq {self.received_seq} "
                             f"have arrived")
        out = [self._pending.pop(s) for s in range(self._next, seq + 1)]
        self._next = max(self._next, seq + 1)
        return out

    def _store(self, msg: Any) -> bool:
        """Keep `msg` in seq order; False (dropped, counted) for no control message or a seq
        that arrived before (only a broken sender of this job could send either)."""
        if not isinstance(msg, protocol.SEQUENCED):
            self.verifier.drop("malformed", f"{type(msg).__name__} is not a control message")
            return False
        if not isinstance(msg.seq, int) or msg.seq < self._next or msg.seq in self._pending:
            self.verifier.drop("malformed", f"seq {msg.seq!r} arrived twice")
            return False
        self._pending[msg.seq] = msg
        while self.received_seq + 1 in self._pending:
            self.received_seq += 1
        return True

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

    def __init__(self, ctx: zmq.Context, address: str, key: JobKey) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.connect(address)
        self.signer = Signer(key.output)

    def send(self, msg: Any) -> None:
        self.sock.send(self.signer.seal(protocol.encode(msg)))

    def close(self) -> None:
        self.sock.close()


class HeartbeatThread(threading.Thread):
    """Sends `Heartbeat` every `interval_s` from its own socket, so a rank stuck in a long round
    or a collective still shows it is alive, and a dead process stops showing it."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int, interval_s: float,
                 key: JobKey, inbox: Optional[Inbox] = None) -> None:
        super().__init__(name=f"heartbeat-rank{rank}", daemon=True)
        self.ctx, self.address, self.rank, self.interval_s = ctx, address, rank, interval_s
        self.signer, self.inbox = Signer(key.output), inbox
        self._stop_event = threading.Event()

    def run(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 4)    # a beat that cannot be delivered is simply dropped
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            while not self._stop_event.is_set():
                dropped = self.inbox.verifier.snapshot() if self.inbox is not None else {}
                beat = protocol.encode(Heartbeat(rank=self.rank, pid=os.getpid(),
                                                 dropped=dropped))
                try:
                    sock.send(self.signer.seal(beat), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self._stop_event.wait(self.interval_s)
        finally:
            sock.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2.0)
