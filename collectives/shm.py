"""The per-round sum/max reduction of a small int64 vector through shared memory among the ranks
of one host, and one hop per host across hosts (issue 37).

Within a host the members of a group share one segment: a file in ``/dev/shm`` that the host's
first member creates (``O_EXCL``, mode 0600, owned by the job's user; a segment of another user
or with other permissions is refused), whose name travels over the group's gloo control group,
and which is unlinked as soon as every member of the host has mapped it (or on any failure of
the set-up): nothing is left in ``/dev/shm`` even when a rank is killed later.

The segment holds, twice (round parity), one slot per local member: a sequence word and the
vector. A round: write the vector into this rank's slot of parity ``r % 2``, then its sequence
word ``r`` (x86-64 keeps stores in program order and loads in program order, so a reader that
sees ``r`` sees the vector); wait until every local slot shows ``r``; every rank then reads every
slot and computes the same integer sums and maxima itself (integer addition is exact and
independent of order, so every rank holds the same bits, and one wait is the whole latency: no
second hop for a leader to publish). Two parities suffice: a rank writes round ``r + 2`` only
after it saw every slot at ``r + 1``, i.e. after every member finished reading round ``r``.

Across hosts (``hierarchical``) each host's first member (its leader) reduces its host's slots,
exchanges the host's vector with the other leaders by recursive doubling over a gloo group of
the leaders (``ops.all_reduce_sum_max``), and publishes the result in the segment's result slot
(again by parity) for its host's other members, who wait on that slot's sequence word.

Waking: the segment's header holds three 32-bit arrival counters (one per round modulo 3) that
an arriving rank increments in the kernel (Linux ``futex``, ``FUTEX_WAKE_OP``: add 1, and wake
every waiter on the counter only if the old value was "all but me"): only the last arrival of a
round wakes anybody, with one system call, and the waiters that sleep on the counter are woken
once per round (not once per arrival). A counter that shows every local member is a complete
round (the kernel's atomic add is ordered after the member's vector and sequence word), so a
waiter reads one word, not every slot. Each member zeroes the next round's counter before its
own add: nobody uses it then (a member reaches round ``r + 1`` only after every member added to
round ``r``'s), and nobody adds to it before the last zeroing (that comes before the last add of
this round). Whether the futex is used is agreed at set-up (every local member must be able to).

Waiting: a bounded spin, then the futex. A waiter spins (reading the counter, ``sched_yield``
between reads) for at most ``SPIN_S`` when recent waits mostly ended within that bound, else for
``SPIN_MIN_S``: a rank that waits long rounds after round (a lightly loaded DP rank, a peer
that is late) spends a few µs a round on the CPU and then blocks in the kernel, so it uses no
CPU until the last arrival wakes it; a rank whose peers come within tens of µs is not put to
sleep and woken (a wake-up is a scheduler hop, and the woken process runs its Python cold).
``ADAPTIVE_DIST_SHM_SPIN_US`` sets ``SPIN_S`` (0: no spin). ``ADAPTIVE_DIST_SHM_EARLY_WAKE=1`` makes
the last but one arrival wake the sleepers too; a member woken before the round is complete
spins up to ``SPIN_S`` for the last one (its wake-up then overlaps the wait for the last member
instead of following it) before it blocks again. A bad value of either is refused on every
member at set-up, naming the rank. Without a futex
(``ADAPTIVE_DIST_SHM_FUTEX=0``, or not Linux) a waiter reads every slot's sequence word and
sleeps instead, doubling from ``SLEEP0_S`` up to ``SLEEP_MAX_S`` (timer slack 1 µs). A wait is
bounded by the control group's timeout; a local member whose process is gone is seen within
``LIVENESS_S`` (its pid, posted at set-up) and named at once. The error goes through the
recorder's failure path like a failed gloo collective, so the lockstep guard's diagnosis, its
lines and exit codes are the same as on the gloo path.
"""
from __future__ import annotations

import mmap
import os
import platform
import socket
import sys
import time
import uuid
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from collectives import ops
from collectives.errors import CollectiveTimeoutError, DivergenceError, JobAborted, StartupError
from collectives.group import Group
from collectives.guard import short_cause

SHM_DIR = "/dev/shm"
PREFIX = "adaptive_dist-consensus-"
MAGIC = 0x5AD38          # the segment's format (0x5AD37: one futex word, woken by every arrival)
HEAD = 8                 # int64 words before every vector in a slot (word 0: the round)
HDR = 16                 # int64 words of the segment's header: 0-5 the layout and the creator's
                         #   pid, 8-15 (one cache line of their own) the futex words:
COUNT_BYTE = 64          #   the arrival counters of rounds r % 3 == 0, 1, 2 (uint32 each)
PUB_BYTE = 76            #   the leader's publications (hierarchical)
NOBODY_BYTE = 80         #   a word nobody waits on (FUTEX_WAKE_OP's first address)
SPIN_S = 50e-6           # the longest spin before blocking (ADAPTIVE_DIST_SHM_SPIN_US) ...
SPIN_MIN_S = 3e-6        # ... and the spin when recent waits mostly outlasted SPIN_S
SPIN_ENV = "ADAPTIVE_DIST_SHM_SPIN_US"
EARLY_WAKE_ENV = "ADAPTIVE_DIST_SHM_EARLY_WAKE"
SLEEP0_S = 10e-6         # without a futex: the first sleep, doubled up to SLEEP_MAX_S (a late
SLEEP_MAX_S = 100e-6     #   peer is seen at most this late; each wake-up costs a few µs of CPU)
TIMER_SLACK_NS = 1000    # the waiting thread's timer slack (Linux's default, 50 µs, would
                         #   stretch every short sleep by that much)
LIVENESS_S = 0.05        # how often a long wait checks that the local members it waits for live
STORE_ORDERED = ("x86_64", "amd64", "i686", "i386")


def host_key() -> str:
    """Which host this process is on, as the group sees it: the host name and the launcher's node
    (``GROUP_RANK``, set by torchrun; else ``RANK - LOCAL_RANK``), so two torchrun "nodes" on
    one machine count as two hosts, as on two machines."""
    node = os.environ.get("GROUP_RANK")
    if node is None or node == "":
        node = str(int(os.environ.get("RANK", "0") or 0) - int(os.environ.get("LOCAL_RANK", "0") or 0))
    return f"{socket.gethostname()}/node{node}"


def unavailable() -> Optional[str]:
    """Why this process cannot use the shared-memory transport (None: it can)."""
    if platform.machine().lower() not in STORE_ORDERED:
        return (f"the shared-memory consensus needs x86-64's store ordering; this machine is "
                f"{platform.machine()!r}")
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not a writable directory"
    return None


def control_timeout(group: Group, default: float = 60.0) -> float:
    """The timeout of ``group``'s gloo control group, in seconds (``default`` if unreadable)."""
    try:
        return group.control_pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:
        return default


_MARK = torch.zeros(1, dtype=torch.int64)


def gather(group: Group, obj: object, what: str) -> list:
    """Every member's ``obj`` (``all_gather_object`` over the control group), recorded as one
    collective (``all_gather_object.<what>.control``), so that a peer that stops during the
    set-up is diagnosed by the lockstep guard like one that stops in a round."""
    out: list = [None] * group.size
    try:
        ops._run(f"all_gather_object.{what}.control", group, _MARK,
                 lambda: dist.all_gather_object(out, obj, group=group.control_pg))
    except (CollectiveTimeoutError, DivergenceError, JobAborted):
        raise
    except Exception as exc:   # no guard: name what failed
        raise CollectiveTimeoutError(
            f"rank {group.global_rank}: setting up the consensus transport on group "
            f"{group.name!r} failed ({short_cause(exc)}); a peer stopped or is unreachable"
        ) from None
    return out


def _tight_timer_slack() -> None:
    """Set the calling thread's timer slack to ``TIMER_SLACK_NS`` (Linux ``prctl``; elsewhere, or
    if refused, sleeps are just longer)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, TIMER_SLACK_NS, 0, 0, 0)  # PR_SET_TIMERSLACK
    except Exception:
        pass


def _words(n_local: int, width: int) -> int:
    return HDR + _pad(n_local) + 2 * n_local * width + 2 * width


def _pad(n: int) -> int:
    return (n + 7) // 8 * 8


def spin_s() -> float:
    """The longest spin of a wait, in seconds: ``ADAPTIVE_DIST_SHM_SPIN_US`` (µs, 0 to 10000)
    if set, else ``SPIN_S``."""
    raw = os.environ.get(SPIN_ENV)
    if raw is None or raw == "":
        return SPIN_S
    try:
        us = float(raw)
    except ValueError:
        us = float("nan")
    if not 0.0 <= us <= 10_000.0:
        raise ValueError(f"{SPIN_ENV}={raw!r}: microseconds from 0 to 10000")
    return us * 1e-6


_add_reduce, _max_reduce = np.add.reduce, np.maximum.reduce


def early_wake() -> bool:
    """Whether the last but one arrival of a round wakes the sleepers too
    (``ADAPTIVE_DIST_SHM_EARLY_WAKE=1``; default 0): a woken member spins for the last arrival,
    so its wake-up overlaps the wait for the last member instead of following it; it costs a
    second wake-up and spin when the last member comes later than the spin."""
    raw = os.environ.get(EARLY_WAKE_ENV, "0")
    if raw not in ("0", "1"):
        raise ValueError(f"{EARLY_WAKE_ENV}={raw!r}: 0 or 1")
    return raw == "1"


def _futex_op(op: int, oparg: int, cmp: int, cmparg: int) -> int:
    """``FUTEX_OP(op, oparg, cmp, cmparg)`` (both arguments 12-bit, two's complement)."""
    return (op << 28) | (cmp << 24) | ((oparg & 0xFFF) << 12) | (cmparg & 0xFFF)


class _Futex:
    """The segment's futex words (Linux ``futex``, shared between the processes that map the
    segment). ``arrive(k)``: add 1 to arrival counter ``k`` and, if this made it ``n_local``,
    wake every waiter on it, in one atomic kernel operation (``FUTEX_WAKE_OP``; its first
    address is a word nobody waits on). ``publish()``: add 1 to the publication word and wake
    every waiter on it. A waiter reads the word, checks its condition, and blocks only while
    the word still holds what it read: no lost wake-up."""

    SYS_FUTEX = 202                                   # x86-64
    WAIT, WAKE_OP = 0, 5
    OP_ADD, CMP_EQ, CMP_GE = 1, 0, 5
    ALL = 0x7FFFFFFF

    def __init__(self, mm: mmap.mmap, n_local: int, early: bool = False) -> None:
        import ctypes

        self.counts = [ctypes.c_uint32.from_buffer(mm, COUNT_BYTE + 4 * k) for k in range(3)]
        self.pub = ctypes.c_uint32.from_buffer(mm, PUB_BYTE)
        self._nobody = ctypes.c_uint32.from_buffer(mm, NOBODY_BYTE)
        self.count_addr = [ctypes.addressof(c) for c in self.counts]
        self.pub_addr = ctypes.addressof(self.pub)
        self._nobody_addr = ctypes.addressof(self._nobody)
        libc = ctypes.CDLL(None, use_errno=True)
        self._sys = libc.syscall
        self._sys.restype = ctypes.c_long
        self._sys.argtypes = [ctypes.c_long] * 7
        self._ts = (ctypes.c_long * 2)()
        self._ts_addr = ctypes.addressof(self._ts)
        # add 1; the old value n_local - 1 (this arrival completes the round): wake them all;
        # early: already at n_local - 2 (the last but one arrival wakes them too)
        self.early = early and n_local > 2
        self._last = (_futex_op(self.OP_ADD, 1, self.CMP_GE, n_local - 2) if self.early else
                      _futex_op(self.OP_ADD, 1, self.CMP_EQ, n_local - 1))
        self._add = _futex_op(self.OP_ADD, 1, self.CMP_EQ, -1)   # (never 2^32 - 1: no 2nd wake)
        # a round's calls take only these arguments: built once as C longs and passed to a
        # second handle of syscall() without argtypes (ctypes then converts nothing per call)
        raw = ctypes.CDLL(None, use_errno=True).syscall
        raw.restype = ctypes.c_long
        self._raw = raw
        c = ctypes.c_long
        self._arrive_args = [
            tuple(c(x) for x in (self.SYS_FUTEX, self._nobody_addr, self.WAKE_OP, 1, self.ALL,
                                 self.count_addr[k], self._last)) for k in range(3)]
        self._publish_args = tuple(c(x) for x in (self.SYS_FUTEX, self.pub_addr, self.WAKE_OP,
                                                  self.ALL, 0, self.pub_addr, self._add))

    def arrive(self, k: int) -> bool:
        """Add 1 to arrival counter ``k``; wake its waiters if this completed the round."""
        return self._raw(*self._arrive_args[k]) >= 0

    def publish(self) -> bool:
        return self._raw(*self._publish_args) >= 0

    def wait(self, addr: int, seen: int, timeout_s: float) -> None:
        """Block while the word at ``addr`` is ``seen``, at most ``timeout_s`` (returns early on
        a wake-up, a change, or a signal)."""
        ns = max(int(timeout_s * 1e9), 1000)
        self._ts[0], self._ts[1] = divmod(ns, 1_000_000_000)
        self._sys(self.SYS_FUTEX, addr, self.WAIT, seen, self._ts_addr, 0, 0)

    def release(self) -> None:
        self.counts, self.pub, self._nobody = [], None, None
        self._arrive_args, self._publish_args = [], ()


class HostReducer:
    """One group's shared-memory reduction (``all_reduce_sum_max``). Built collectively on every
    member of ``group`` (``setup``); ``hosts[i]`` is member ``i``'s host key."""

    def __init__(self, group: Group, n: int, n_sum: int, hosts: list[str], hierarchical: bool,
                 timeout_s: float) -> None:
        self.group, self.n, self.n_sum, self.timeout_s = group, n, n_sum, timeout_s
        mine = hosts[group.rank]
        self.local = [i for i, h in enumerate(hosts) if h == mine]   # group indices, this host
        self.li = self.local.index(group.rank)
        order: list[str] = []
        for h in hosts:
            if h not in order:
                order.append(h)
        self.n_hosts = len(order)
        if self.n_hosts > 1 and not hierarchical:
            raise ValueError(f"group {group.name!r} spans {self.n_hosts} hosts: the "
                             f"shared-memory reduction alone cannot reach them")
        self.leader = self.li == 0
        self.width = HEAD + _pad(n)
        self.round = 0
        self.waits = 0              # rounds this rank waited in (a peer was not there yet),
        self.waited_s = 0.0         #   their wall time, and how many of them blocked in the
        self.slept = 0              #   kernel (the others ended within the spin)
        self.blocks = 0             # futex waits entered (a sleeper woken by every arrival, not
                                    #   only the last, would count one per arrival)
        self.spin_max_s = spin_s()
        self._spin = self.spin_max_s
        self._spin_hits = 1.0       # recent waits that ended within spin_max_s (an average)
        self.leaders: Optional[Group] = None
        self.path: Optional[str] = None   # the segment's file (unlinked once set up)
        self._mm: Optional[mmap.mmap] = None
        self.slots = self.result = None
        self._seqs: list = []
        self._pids: list[int] = []
        self._check_pids = False
        self._slack_set = False
        self._futex: Optional[_Futex] = None
        self._last_tensor: Optional[torch.Tensor] = None
        self._views: tuple = ()
        leader_idx = [hosts.index(h) for h in order]
        if self.n_hosts > 1 and self.leader:
            ranks = [group.ranks[i] for i in leader_idx]
            pg = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s),
                                use_local_synchronization=True)
            self.leaders = Group(name=f"{group.name}.leaders", ranks=tuple(ranks),
                                 rank=ranks.index(group.global_rank), device=torch.device("cpu"),
                                 device_pg=pg, control_pg=pg, recorder=None)
        self._map()

    # ---- the segment ------------------------------------------------------------------------
    def _gather(self, obj: object) -> list:
        return gather(self.group, obj, "consensus_segment")

    def _map(self) -> None:
        """Create (host leader) or open the segment; unlink it once every local member mapped it.
        Collective over the group (every member, even one alone on its host)."""
        need = len(self.local) > 1
        words = _words(len(self.local), self.width)
        path, err, mine = None, None, None
        try:
            if self.leader and need:
                path = os.path.join(SHM_DIR, PREFIX + uuid.uuid4().hex)
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    try:
                        os.fchmod(fd, 0o600)
                        os.ftruncate(fd, 8 * words)
                        self._mm = mmap.mmap(fd, 8 * words)
                    finally:
                        os.close(fd)
                    mine = path
                    np.frombuffer(self._mm, dtype=np.int64)[:HEAD] = (
                        MAGIC, len(self.local), self.width, self.n, self.n_sum, os.getpid(), 0, 0)
                except OSError as exc:
                    err = f"cannot create {path}: {exc}"
            names = self._gather(mine)           # every member: its host leader's segment
            if need:
                self.path = names[self.local[0]]
            if need and not self.leader:
                there = names[self.local[0]]
                if there is None:
                    err = "its host's first member could not create the segment"
                else:
                    try:
                        self._open(there, words)
                    except (OSError, ValueError) as exc:
                        err = str(exc)
            can_futex = err is None and need and self._futex_usable()
            states = self._gather((err, os.getpid(), can_futex))
        finally:
            if path is not None:
                self._unlink(path)   # every local member has it mapped (or gave up): no file left
        bad = {self.group.ranks[i]: e for i, (e, _, _) in enumerate(states) if e is not None}
        if bad:
            self.close()
            detail = "; ".join(f"rank {r}: {e}" for r, e in bad.items())
            raise StartupError(f"shared-memory consensus on group {self.group.name!r} refused on "
                               f"every rank: {detail} (choose the gloo transport: algorithm "
                               f"'doubling')")
        if not need:
            return
        arr = np.frombuffer(self._mm, dtype=np.int64)
        n_local, w = len(self.local), self.width
        if tuple(arr[:5]) != (MAGIC, n_local, w, self.n, self.n_sum):
            self.close()
            raise StartupError(f"shared-memory consensus on group {self.group.name!r}: the "
                               f"segment's header {tuple(int(x) for x in arr[:5])} does not match "
                               f"this rank's layout")
        self._pids = [states[i][1] for i in self.local]
        base = HDR + _pad(n_local)
        self.slots = arr[base:base + 2 * n_local * w].reshape(2, n_local, w)
        base += 2 * n_local * w
        self.result = arr[base:base + 2 * w].reshape(2, w)
        n, ns = self.n, self.n_sum
        self._seqs = [self.slots[q, :, 0] for q in (0, 1)]
        self._mine = [self.slots[q, self.li] for q in (0, 1)]
        self._mine_vec = [self.slots[q, self.li, HEAD:HEAD + n] for q in (0, 1)]
        self._sums = [self.slots[q, :, HEAD:HEAD + ns] for q in (0, 1)]
        self._maxs = [self.slots[q, :, HEAD + ns:HEAD + n] for q in (0, 1)]
        # a dead local member is seen by its pid, if every local pid is visible from here (one
        # pid namespace); otherwise only the timeout names it
        self._check_pids = all(self._alive(p) for p in self._pids)
        # the futex only if every local member can use it (a member that cannot would not
        # count its arrivals); else every member polls the slots and sleeps
        if all(states[i][2] for i in self.local):
            self._futex = _Futex(self._mm, n_local, early_wake())

    def _futex_usable(self) -> bool:
        """Whether this process can wait on the segment's futex words (Linux x86-64, not
        turned off by ``ADAPTIVE_DIST_SHM_FUTEX=0``): one harmless wake of a word nobody
        waits on."""
        if os.environ.get("ADAPTIVE_DIST_SHM_FUTEX", "1") == "0" or \
                not sys.platform.startswith("linux") or len(self.local) > 2048:
            return False    # (FUTEX_OP's compared value has 12 bits: "all but me" < 2048)
        try:
            import ctypes

            cell = ctypes.c_uint32.from_buffer(self._mm, NOBODY_BYTE)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long
            ok = libc.syscall(ctypes.c_long(_Futex.SYS_FUTEX),
                              ctypes.c_long(ctypes.addressof(cell)), ctypes.c_long(1),
                              ctypes.c_long(1), ctypes.c_long(0), ctypes.c_long(0),
                              ctypes.c_long(0)) >= 0
            del cell
            return ok
        except (OSError, AttributeError, TypeError, ValueError):
            return False

    def _open(self, path: str, words: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ValueError(f"{path} belongs to uid {st.st_uid} with mode "
                                 f"{st.st_mode & 0o777:o}: not this job's segment")
            if st.st_size != 8 * words:
                raise ValueError(f"{path} has {st.st_size} bytes, expected {8 * words}")
            self._mm = mmap.mmap(fd, 8 * words)
        finally:
            os.close(fd)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def close(self) -> None:
        self.slots = self.result = None
        self._seqs = self._mine = self._mine_vec = self._sums = self._maxs = []
        if self._futex is not None:
            self._futex.release()
            self._futex = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass   # a view is still alive; the mapping goes with the process
            self._mm = None

    # ---- one round ----------------------------------------------------------------------------
    def all_reduce_sum_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """``ops.all_reduce_sum_max`` through the segment (one recorded collective on every
        member: ``all_reduce.sum_max.shm.control``)."""
        if tensor is not self._last_tensor:   # the channel passes the same buffer every round
            if tensor.dtype != torch.int64 or tensor.dim() != 1 or tensor.numel() != self.n:
                raise ValueError(f"shared-memory reduction: a 1-D int64 host tensor of {self.n}")
            v = tensor.numpy()
            self._last_tensor, self._views = tensor, (v, v[:self.n_sum], v[self.n_sum:])
        ops._run("all_reduce.sum_max.shm.control", self.group, tensor, self._round)
        return tensor

    def _round(self) -> None:
        """One round over ``self._views`` (the tensor's memory: whole, sum part, max part)."""
        self.round += 1
        r, p, n, ns = self.round, self.round & 1, self.n, self.n_sum
        vec, vec_sum, vec_max = self._views
        futex = self._futex
        if len(self.local) > 1:
            slot = self._mine[p]
            self._mine_vec[p][:] = vec
            slot[0] = r                                    # publish (after the vector)
            if futex is not None:
                k = r % 3
                futex.counts[(k + 1) % 3].value = 0        # the next round's counter (see above)
                futex.arrive(k)                            # the last arrival wakes the waiters
            if self.leader or self.leaders is None:
                if futex is not None:
                    cell, need = futex.counts[k], len(self.local)
                    if cell.value < need:
                        self._wait(lambda: cell.value >= need, futex.count_addr[k], cell, r,
                                   self.local, None, futex.early)
                else:
                    self._poll(self._seqs[p], r, self.local)
                # the ufuncs' own reductions (np.sum / np.max add a few µs of Python a call)
                _add_reduce(self._sums[p], 0, None, vec_sum)
                _max_reduce(self._maxs[p], 0, None, vec_max)
        if self.leaders is not None:                      # this host's leader: one hop out
            ops.all_reduce_sum_max(self._last_tensor, self.leaders, ns, "doubling")
            if len(self.local) > 1:
                res = self.result[p]
                res[HEAD:HEAD + n] = vec
                res[0] = r
                if futex is not None:
                    futex.publish()
        elif self.n_hosts > 1 and not self.leader:
            res = self.result[p]
            if res[0] < r:
                if futex is not None:
                    self._wait(lambda: res[0] >= r, futex.pub_addr, futex.pub, r,
                               self.local[:1], res[:1])
                else:
                    self._poll(res[:1], r, self.local[:1])
            vec[:] = res[HEAD:HEAD + n]

    def _wait(self, ready, addr: int, cell, r: int, members: list[int],
              seqs: Optional[np.ndarray] = None, early: bool = False) -> None:
        """Until ``ready()``: a bounded spin, then blocking on the futex word ``cell`` (at
        ``addr``), which changes when ``ready()`` may have become true. ``members``: whom this
        waits for (group indices; their sequence words ``seqs``, by default this parity's
        slots), named if they are gone or late. ``early``: the last but one arrival wakes the
        sleepers too (``EARLY_WAKE_ENV``), so a member woken before the round is complete spins
        again, up to ``spin_max_s``, before it blocks again."""
        t0 = time.perf_counter()
        end = t0 + self._spin
        while not ready():
            if time.perf_counter() >= end:
                break
            os.sched_yield()
        else:
            self._waited(t0, time.perf_counter(), False)
            return
        futex = self._futex
        deadline = t0 + self.timeout_s
        check = t0 + LIVENESS_S
        while True:
            seen = cell.value            # before the check: a later change makes the wait return
            if ready():
                break
            now = time.perf_counter()
            if now >= check:
                check = now + LIVENESS_S
                self._raise_if_gone(self._seqs[r & 1] if seqs is None else seqs, r, members,
                                    now >= deadline)
            self.blocks += 1
            futex.wait(addr, seen, check - now)
            if early:      # woken by the last but one arrival, maybe: the last is near
                end = time.perf_counter() + self.spin_max_s
                while not ready() and time.perf_counter() < end:
                    os.sched_yield()
        self._waited(t0, time.perf_counter(), True)

    def _waited(self, t0: float, t1: float, slept: bool) -> None:
        """Count a wait, and adapt the spin: the full ``spin_max_s`` while most recent waits
        ended within it (a spin then saves a sleep and a wake-up), else ``SPIN_MIN_S`` (a spin
        would mostly burn the CPU and then sleep anyway)."""
        self.waits += 1
        self.waited_s += t1 - t0
        self.slept += slept
        self._spin_hits += 0.125 * ((t1 - t0 <= self.spin_max_s) - self._spin_hits)
        self._spin = self.spin_max_s if self._spin_hits >= 0.5 else min(SPIN_MIN_S,
                                                                        self.spin_max_s)

    def _poll(self, seqs: np.ndarray, r: int, members: list[int]) -> None:
        """Without a futex: until every word of ``seqs`` (those of ``members``, group indices)
        is >= ``r``, spinning as ``_wait`` does, then sleeping."""
        if seqs.min() >= r:
            return
        t0 = time.perf_counter()
        end = t0 + self._spin
        while seqs.min() < r and time.perf_counter() < end:
            os.sched_yield()
        slept = bool(seqs.min() < r)
        if slept:
            if not self._slack_set:
                self._slack_set = True
                _tight_timer_slack()
            deadline = t0 + self.timeout_s
            nap, check = SLEEP0_S, t0 + LIVENESS_S
            while seqs.min() < r:
                now = time.perf_counter()
                if now >= check:
                    check = now + LIVENESS_S
                    self._raise_if_gone(seqs, r, members, now >= deadline)
                time.sleep(nap)
                nap = min(2 * nap, SLEEP_MAX_S)
        self._waited(t0, time.perf_counter(), slept)

    def _raise_if_gone(self, seqs: np.ndarray, r: int, members: list[int], late: bool) -> None:
        missing = [members[j] for j in range(len(members)) if seqs[j] < r]
        ranks = [self.group.ranks[i] for i in missing]
        if self._check_pids:
            gone = [self.group.ranks[i] for i in missing
                    if not self._alive(self._pids[self.local.index(i)])]
            if gone:
                raise CollectiveTimeoutError(
                    f"shared-memory consensus on group {self.group.name!r}: rank(s) {gone} "
                    f"exited (process gone) before round {r} of the exchange")
        if late:
            raise CollectiveTimeoutError(
                f"shared-memory consensus on group {self.group.name!r}: rank(s) {ranks} did not "
                f"arrive within {self.timeout_s:g} s (round {r} of the exchange)")


def setup(group: Group, n: int, n_sum: int, requested: str,
          timeout_s: Optional[float] = None) -> tuple[str, Optional[HostReducer]]:
    """Agree the transport of ``group``'s reduction on every member (a collective over its
    control group) and build it. ``requested``: ``auto`` (shared memory when every member is on
    this host, else gloo's recursive doubling), ``shm`` (shared memory within each host, one
    leader per host across hosts), ``doubling`` or ``gloo``. Members that asked for different
    transports are refused by name (``StartupError``, the same on every rank) before any
    exchange. Returns the transport chosen and its reducer (None: a gloo one)."""
    if group.size == 1:
        return requested if requested != "auto" else "doubling", None
    why = unavailable()
    try:                      # the wait's settings, checked here so every member hears of it
        spin_s()
        early_wake()
        bad_env = None
    except ValueError as exc:
        bad_env = str(exc)
    out = gather(group, (requested, host_key(), why, bad_env), "consensus_transport")
    asked: dict[str, list[int]] = {}
    for i, (req, _, _, _) in enumerate(out):
        asked.setdefault(req, []).append(group.ranks[i])
    if len(asked) > 1:
        shown = ", ".join(f"ranks {rs} have {req!r}" for req, rs in asked.items())
        raise StartupError(f"consensus transport on group {group.name!r}: ranks disagree on "
                           f"the algorithm ({shown}); start every rank with the same one")
    hosts = [h for _, h, _, _ in out]
    cannot = {group.ranks[i]: w for i, (_, _, w, _) in enumerate(out) if w is not None}
    bad = {group.ranks[i]: e for i, (_, _, _, e) in enumerate(out) if e is not None}
    one_host = len(set(hosts)) == 1
    if requested == "auto":
        requested = "shm" if one_host and not cannot else "doubling"
    if requested != "shm":
        return requested, None
    if cannot:
        detail = "; ".join(f"rank {r}: {w}" for r, w in cannot.items())
        raise StartupError(f"consensus transport 'shm' on group {group.name!r} refused: {detail}")
    if bad:
        detail = "; ".join(f"rank {r}: {e}" for r, e in bad.items())
        raise StartupError(f"consensus transport 'shm' on group {group.name!r}: {detail}")
    if timeout_s is None:
        timeout_s = control_timeout(group)
    return "shm", HostReducer(group, n, n_sum, hosts, True, timeout_s)
