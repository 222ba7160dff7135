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

Waiting spins (with ``sched_yield``) for ``SPIN_S``, then blocks in the kernel on a futex word
of the segment (``_Futex``): every arrival (and a leader's publication) adds 1 to it and wakes
the waiters in one atomic ``FUTEX_WAKE_OP``, so a rank that waits for a slow peer uses no CPU
until the peer arrives. Without a futex (``ADAPTIVE_DIST_SHM_FUTEX=0``) it sleeps instead,
doubling from ``SLEEP0_S`` up to ``SLEEP_MAX_S`` (timer slack 1 µs). A wait is
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
MAGIC = 0x5AD37
HEAD = 8                 # int64 words before every vector in a slot (word 0: the round)
SPIN_S = 50e-6           # spin (yielding) this long before blocking
SLEEP0_S = 10e-6         # without a futex: the first sleep, doubled up to SLEEP_MAX_S (a late
SLEEP_MAX_S = 100e-6     #   peer is seen at most this late; each wake-up costs a few µs of CPU)
EPOCH_BYTE = 48          # the futex word: header word 6
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
    return HEAD + _pad(n_local) + 2 * n_local * width + 2 * width


def _pad(n: int) -> int:
    return (n + 7) // 8 * 8


class _Futex:
    """A 32-bit word of the segment that waiters block on (Linux ``futex``, shared between the
    processes that map the segment): an arriving rank adds 1 to it and wakes every waiter in one
    atomic kernel operation (``FUTEX_WAKE_OP``), so a waiter that read the word before checking
    the slots either sees the change or is woken: no lost wake-up, no polling."""

    SYS_FUTEX = 202                                   # x86-64
    WAIT, WAKE_OP = 0, 5
    ADD_ONE = (1 << 28) | (0 << 24) | (1 << 12) | 0   # FUTEX_OP(ADD, 1, CMP_EQ, 0)

    def __init__(self, mm: mmap.mmap, offset: int) -> None:
        import ctypes

        self._ct = ctypes
        self._cell = ctypes.c_uint32.from_buffer(mm, offset)
        self.addr = ctypes.addressof(self._cell)
        libc = ctypes.CDLL(None, use_errno=True)
        self._sys = libc.syscall
        self._sys.restype = ctypes.c_long
        self._sys.argtypes = [ctypes.c_long] * 7
        self._ts = (ctypes.c_long * 2)()
        self._ts_addr = ctypes.addressof(self._ts)

    def value(self) -> int:
        return self._cell.value

    def wake_all(self) -> bool:
        return self._sys(self.SYS_FUTEX, self.addr, self.WAKE_OP, 0x7FFFFFFF, 0, self.addr,
                         self.ADD_ONE) >= 0

    def wait(self, seen: int, timeout_s: float) -> None:
        """Block while the word is ``seen``, at most ``timeout_s`` (returns early on a wake-up,
        a change, or a signal)."""
        ns = max(int(timeout_s * 1e9), 1000)
        self._ts[0], self._ts[1] = divmod(ns, 1_000_000_000)
        self._sys(self.SYS_FUTEX, self.addr, self.WAIT, seen, self._ts_addr, 0, 0)

    def release(self) -> None:
        self._cell = None


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
        self.waited_cpu_s = 0.0     # host CPU time spent waiting (process time), and its wall
        self.waited_s = 0.0
        self.waits = 0
        self.leaders: Optional[Group] = None
        self.path: Optional[str] = None   # the segment's file (unlinked once set up)
        self._mm: Optional[mmap.mmap] = None
        self.slots = self.result = None
        self._seqs: list = []
        self._pids: list[int] = []
        self._check_pids = False
        self._slack_set = False
        self._futex: Optional[_Futex] = None
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
            states = self._gather((err, os.getpid()))
        finally:
            if path is not None:
                self._unlink(path)   # every local member has it mapped (or gave up): no file left
        bad = {self.group.ranks[i]: e for i, (e, _) in enumerate(states) if e is not None}
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
        base = HEAD + _pad(n_local)
        self.slots = arr[base:base + 2 * n_local * w].reshape(2, n_local, w)
        base += 2 * n_local * w
        self.result = arr[base:base + 2 * w].reshape(2, w)
        n, ns = self.n, self.n_sum
        self._seqs = [self.slots[q, :, 0] for q in (0, 1)]
        self._mine = [self.slots[q, self.li] for q in (0, 1)]
        self._sums = [self.slots[q, :, HEAD:HEAD + ns] for q in (0, 1)]
        self._maxs = [self.slots[q, :, HEAD + ns:HEAD + n] for q in (0, 1)]
        # a dead local member is seen by its pid, if every local pid is visible from here (one
        # pid namespace); otherwise only the timeout names it
        self._check_pids = all(self._alive(p) for p in self._pids)
        if os.environ.get("ADAPTIVE_DIST_SHM_FUTEX", "1") != "0":
            try:
                futex = _Futex(self._mm, EPOCH_BYTE)
                if futex.wake_all():
                    self._futex = futex
                else:
                    futex.release()
            except (OSError, AttributeError, TypeError, ValueError):
                self._futex = None   # no futex here: sleep-polling instead

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
        self._seqs = self._mine = self._sums = self._maxs = []
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
        if tensor.dtype != torch.int64 or tensor.dim() != 1 or tensor.numel() != self.n:
            raise ValueError(f"shared-memory reduction: a 1-D int64 host tensor of {self.n}")
        ops._run("all_reduce.sum_max.shm.control", self.group, tensor,
                 lambda: self._round(tensor.numpy()))
        return tensor

    def _round(self, vec: np.ndarray) -> None:
        self.round += 1
        r, p, n, ns = self.round, self.round & 1, self.n, self.n_sum
        if len(self.local) > 1:
            slot = self._mine[p]
            slot[HEAD:HEAD + n] = vec
            slot[0] = r                                    # publish (after the vector)
            if self._futex is not None:
                self._futex.wake_all()
            if self.leader or self.leaders is None:
                self._wait(self._seqs[p], r, self.local)
                np.sum(self._sums[p], axis=0, out=vec[:ns])
                np.max(self._maxs[p], axis=0, out=vec[ns:])
        if self.leaders is not None:                      # this host's leader: one hop out
            ops.all_reduce_sum_max(torch.from_numpy(vec), self.leaders, ns, "doubling")
            if len(self.local) > 1:
                res = self.result[p]
                res[HEAD:HEAD + n] = vec
                res[0] = r
                if self._futex is not None:
                    self._futex.wake_all()
        elif self.n_hosts > 1 and not self.leader:
            res = self.result[p]
            self._wait(res[:1], r, self.local[:1])
            vec[:] = res[HEAD:HEAD + n]

    def _wait(self, seqs: np.ndarray, r: int, members: list[int]) -> None:
        """Until every word of ``seqs`` (those of ``members``, group indices) is >= ``r``."""
        if seqs.min() >= r:
            return
        t0, c0 = time.perf_counter(), time.process_time()
        spin_end = t0 + SPIN_S
        while seqs.min() < r and time.perf_counter() < spin_end:
            os.sched_yield()
        futex = self._futex
        if futex is not None and seqs.min() < r:
            deadline = t0 + self.timeout_s
            check = t0 + LIVENESS_S
            while True:
                seen = futex.value()     # before the check: a later arrival changes it
                if seqs.min() >= r:
                    break
                now = time.perf_counter()
                if now >= check:
                    check = now + LIVENESS_S
                    self._raise_if_gone(seqs, r, members, now >= deadline)
                futex.wait(seen, check - now)
        elif seqs.min() < r:
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
        self.waits += 1
        self.waited_s += time.perf_counter() - t0
        self.waited_cpu_s += time.process_time() - c0

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
    out = gather(group, (requested, host_key(), why), "consensus_transport")
    asked: dict[str, list[int]] = {}
    for i, (req, _, _) in enumerate(out):
        asked.setdefault(req, []).append(group.ranks[i])
    if len(asked) > 1:
        shown = ", ".join(f"ranks {rs} have {req!r}" for req, rs in asked.items())
        raise StartupError(f"consensus transport on group {group.name!r}: ranks disagree on "
                           f"the algorithm ({shown}); start every rank with the same one")
    hosts = [h for _, h, _ in out]
    cannot = {group.ranks[i]: w for i, (_, _, w) in enumerate(out) if w is not None}
    one_host = len(set(hosts)) == 1
    if requested == "auto":
        requested = "shm" if one_host and not cannot else "doubling"
    if requested != "shm":
        return requested, None
    if cannot:
        detail = "; ".join(f"rank {r}: {w}" for r, w in cannot.items())
        raise StartupError(f"consensus transport 'shm' on group {group.name!r} refused: {detail}")
    if timeout_s is None:
        timeout_s = control_timeout(group)
    return "shm", HostReducer(group, n, n_sum, hosts, True, timeout_s)
