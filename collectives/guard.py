"""The lockstep guard: divergences between ranks become ``DivergenceError`` on every rank, and a
collective that does not complete in time, or a peer that dies, becomes an error instead of a hang.

Host-side mechanisms, over the group's gloo control group and the rendezvous store (which does not
go through a stuck process group):

- ``check(round, decision)``: every ``check_every`` rounds the ranks all-gather their collective
  count, the rolling hash of their collective log and a digest of the round's decision. On a
  mismatch they exchange the logs since the last good check and every rank raises the same
  ``DivergenceError`` naming the first differing entry.
- **Diagnosis** of a collective that raises (gloo reports a timeout, a size mismatch or a dead
  peer's closed connection as an exception) or of a round that overran the watchdog: the rank
  posts its recent log and raises the *alarm*. Every live rank's watchdog thread polls the alarm
  (5 times a second, whatever its main thread is doing) and answers with its own log, so a rank
  that has not answered within ``grace_s`` is dead or frozen. The first rank to judge the logs
  posts the *verdict* (``DivergenceError`` naming the first differing entry, or
  ``CollectiveTimeoutError`` naming the stalled or silent ranks); every rank adopts it, so the
  job ends with the same line everywhere.
- **Watchdog thread**: answers alarms, and when a verdict exists (or its own round overran
  ``watchdog_s``: an NCCL collective never raises on the host) it prints the line and ends the
  process with ``EXIT_DIVERGENCE`` or ``EXIT_TIMEOUT`` without a hung teardown.

A failure ends every surviving rank within the collective timeout plus ``grace_s`` (plus one
watchdog poll), and every rank that can still speak prints one line before any of them exits.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from collectives.errors import (
    EXIT_DIVERGENCE,
    EXIT_TIMEOUT,
    CollectiveTimeoutError,
    DivergenceError,
    JobAborted,
)
from collectives.group import Group
from collectives.ops import gather_into
from collectives.recorder import CollectiveEntry, CollectiveRecorder

__all__ = [
    "EXIT_DIVERGENCE", "EXIT_TIMEOUT", "CollectiveTimeoutError", "DivergenceError", "JobAborted",
    "LockstepGuard", "Verdict", "first_difference", "is_prefix_gap", "grace_seconds", "short_cause",
]

POLL_S = 0.2  # how often the watchdog thread looks at the alarm and its deadline


def grace_seconds(timeout_s: float) -> float:
    """How long a diagnosis waits for peers to answer (and an exit for them to print). A live
    peer answers from its watchdog thread within a poll or two; this only bounds the wait for a
    dead or frozen one."""
    return min(5.0, max(2.0, timeout_s / 2))


def short_cause(exc: BaseException) -> str:
    """``Type: first line`` of an exception, without gloo's source-location prefix and advice."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", lines[0]) if lines else ""
    text = text.split(" This is typically")[0].strip()
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True)
class Verdict:
    """How the job ends, decided by one rank and adopted by every rank (through the store)."""

    label: str          # what the line says: DivergenceError, CollectiveTimeoutError, error, ...
    code: int           # the exit code
    message: str
    by: int             # the global rank that decided
    live: tuple[int, ...]  # ranks known to be alive (they answered); the exit waits for them

    def to_json(self) -> str:
        return json.dumps({"label": self.label, "code": self.code, "message": self.message,
                           "by": self.by, "live": list(self.live)})

    @staticmethod
    def from_json(raw: bytes | str) -> "Verdict":
        d = json.loads(raw)
        return Verdict(d["label"], int(d["code"]), d["message"], int(d["by"]), tuple(d["live"]))

    @staticmethod
    def of(exc: BaseException, by: int, live: tuple[int, ...]) -> "Verdict":
        code = EXIT_DIVERGENCE if isinstance(exc, DivergenceError) else EXIT_TIMEOUT
        return Verdict(type(exc).__name__, code, str(exc), by, live)

    def exception(self) -> BaseException:
        if self.label == "DivergenceError":
            return DivergenceError(self.message)
        if self.label == "CollectiveTimeoutError":
            return CollectiveTimeoutError(self.message)
        return JobAborted(self.label, self.code, self.message)

    def line(self, rank: int) -> str:
        return f"[rank {rank}] {self.label}: {self.message}\n"


def _aligned(logs: dict[int, list[CollectiveEntry]]) -> tuple[int, int]:
    """The range of sequence numbers every log can be compared over: from the latest first
    entry (windows are truncated) to the end of the longest log."""
    starts = [v[0].seq for v in logs.values() if v]
    ends = [v[-1].seq + 1 for v in logs.values() if v]
    return (max(starts) if starts else 0), (max(ends) if ends else 0)


def _by_seq(logs: dict[int, list[CollectiveEntry]]) -> dict[int, dict[int, CollectiveEntry]]:
    return {r: {e.seq: e for e in v} for r, v in logs.items()}


def is_prefix_gap(logs: dict[int, list[CollectiveEntry]]) -> bool:
    """True if the logs differ only in length (some ranks are behind, none issued a different
    collective at the same sequence number): a stalled rank, not a divergence."""
    start, end = _aligned(logs)
    table = _by_seq(logs)
    for seq in range(start, end):
        sigs = {t[seq].signature() for t in table.values() if seq in t}
        if len(sigs) > 1:
            return False
    return True


def first_difference(logs: dict[int, list[CollectiveEntry]]) -> Optional[str]:
    """Describe the first sequence number at which the ranks' logs differ (a different
    collective, or none at all), or None if they agree. Logs are aligned by sequence number."""
    ranks = sorted(logs)
    start, end = _aligned(logs)
    table = _by_seq(logs)
    for seq in range(start, end):
        at = {r: table[r].get(seq) for r in ranks}
        sigs = {r: (e.signature() if e is not None else None) for r, e in at.items()}
        if len(set(sigs.values())) > 1:
            parts = [
                f"rank {r}: " + (at[r].describe() if at[r] is not None
                                 else "nothing (issued no collective here)")
                for r in ranks
            ]
            return f"first differing collective is #{seq}: " + "; ".join(parts)
    return None


def hash_signature(entry: CollectiveEntry) -> int:
    """A 62-bit hash of an entry's signature, equal on every rank for equal signatures."""
    h = hashlib.blake2b(repr(entry.signature()).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


class LockstepGuard:
    """Cross-rank lockstep checks over ``group`` (normally ``world``), using its control group.

    ``store`` is the rendezvous store used by the thread that issues collectives;
    ``watch_store`` a separate client of the same store for the watchdog thread (a store client
    is not shared between threads; default: ``store.clone()``).
    """

    def __init__(
        self,
        group: Group,
        recorder: CollectiveRecorder,
        *,
        check_every: int = 8,
        timeout_s: float = 60.0,
        watchdog_s: Optional[float] = None,
        store: Optional[dist.Store] = None,
        watch_store: Optional[dist.Store] = None,
        exit_on_watchdog: bool = True,
        grace_s: Optional[float] = None,
    ) -> None:
        if check_every < 1:
            raise ValueError(f"lockstep guard: check_every={check_every} must be >= 1")
        self.group = group
        self.recorder = recorder
        self.check_every = check_every
        self.timeout_s = timeout_s
        self.watchdog_s = timeout_s if watchdog_s is None else watchdog_s
        self.grace_s = grace_seconds(timeout_s) if grace_s is None else grace_s
        self.store = store
        self.watch_store = watch_store if watch_store is not None or store is None else store.clone()
        self.exit_on_watchdog = exit_on_watchdog
        self.checks = 0
        self.verdict: Optional[Verdict] = None  # how this job ends, once known on this rank
        self._published = False
        self._publish_lock = threading.Lock()
        self._claim = threading.Lock()          # held by whoever reports this rank's failure
        self._main_diagnosing = False
        self._deadline: Optional[float] = None
        self._round: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        recorder.on_failure = self._on_collective_failure
        recorder.before_issue = self._verify_entry
        if group.size > 1:
            self._thread = threading.Thread(target=self._watch, name="lockstep-watchdog",
                                            daemon=True)
            self._thread.start()

    # ---- periodic check -------------------------------------------------------------------
    def maybe_check(self, round_idx: int, decision_digest: int) -> None:
        """Run ``check`` on every ``check_every``-th round (a collective on the control group)."""
        if (round_idx + 1) % self.check_every == 0:
            self.check(round_idx, decision_digest)

    def check(self, round_idx: int, decision_digest: int) -> None:
        """Compare collective logs and the round's decision across ranks; raise on mismatch."""
        if self.group.size == 1:
            return
        hi, lo = self.recorder.digest_words()
        mine = torch.tensor(
            [round_idx, self.recorder.count, hi, lo, decision_digest & ((1 << 62) - 1)],
            dtype=torch.int64,
        )
        rows = self._gather_control(mine)
        self.checks += 1
        if all(torch.equal(rows[0], rows[i]) for i in range(1, rows.shape[0])):
            self.recorder.mark_verified()
            return
        windows = self._control_objects([e.to_json() for e in self.recorder.window], self.group)
        logs = {self.group.ranks[i]: [CollectiveEntry.from_json(d) for d in w]
                for i, w in enumerate(windows)}
        self.publish_log()
        raise DivergenceError(self._mismatch_message(rows, logs))

    def _gather_control(self, mine: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.group.size * mine.numel(), dtype=mine.dtype)
        try:
            gather_into(out, mine, group=self.group.control_pg)
        except Exception as exc:
            raise self._diagnose(None, exc) from exc
        return out.view(self.group.size, mine.numel())

    def _mismatch_message(self, rows: torch.Tensor, logs: dict[int, list[CollectiveEntry]]) -> str:
        ranks = self.group.ranks
        round_idx = int(rows[0, 0])
        diff = first_difference(logs)
        if diff is not None:
            return f"lockstep check at round {round_idx}: {diff}"
        decisions = {ranks[i]: int(rows[i, 4]) for i in range(len(ranks))}
        if len(set(decisions.values())) > 1:
            groups: dict[int, list[int]] = {}
            for r, d in decisions.items():
                groups.setdefault(d, []).append(r)
            desc = " vs ".join(f"ranks {v} -> {k:#x}" for k, v in groups.items())
            return f"lockstep check at round {round_idx}: decisions differ: {desc}"
        counts = {ranks[i]: int(rows[i, 1]) for i in range(len(ranks))}
        return (f"lockstep check at round {round_idx}: collective histories differ before the "
                f"last verified check (counts {counts})")

    def _verify_entry(self, entry: CollectiveEntry, group: Group) -> None:
        """Strict mode: the members of ``group`` compare this collective before issuing it."""
        sig = hash_signature(entry)
        mine = torch.tensor([entry.seq, sig], dtype=torch.int64)
        out = torch.empty(group.size * 2, dtype=torch.int64)
        try:
            gather_into(out, mine, group=group.control_pg)
        except Exception as exc:
            raise self._diagnose(entry, exc) from exc
        rows = out.view(group.size, 2)
        if all(torch.equal(rows[0], rows[i]) for i in range(1, group.size)):
            return
        seen = self._control_objects(entry.to_json(), group)
        logs = {group.ranks[i]: [CollectiveEntry.from_json(d)] for i, d in enumerate(seen)}
        desc = "; ".join(f"rank {r}: {v[0].describe()}" for r, v in logs.items())
        self.publish_log()
        raise DivergenceError(f"strict lockstep: ranks are about to issue different "
                              f"collectives on group {group.name!r}: {desc}")

    # ---- failures of a collective ---------------------------------------------------------
    def _on_collective_failure(self, entry: CollectiveEntry, exc: BaseException) -> BaseException:
        return self._diagnose(entry, exc)

    def _control_objects(self, obj: object, group: Group) -> list:
        """all_gather_object over ``group``'s control group; a failure is diagnosed."""
        out: list = [None] * group.size
        try:
            dist.all_gather_object(out, obj, group=group.control_pg)
        except Exception as exc:
            raise self._diagnose(None, exc) from exc
        return out

    def _prefix(self) -> str:
        return f"guard/{self.group.name}/"

    def _diagnose(self, entry: Optional[CollectiveEntry], exc: Optional[BaseException],
                  where: str = "", store: Optional[dist.Store] = None,
                  main: bool = True) -> BaseException:
        """Raise the alarm, gather the live ranks' logs through the store (not the stuck group)
        and return the job's verdict as an exception: this rank's judgement, or the one another
        rank posted first. ``main``: called from the thread that issues collectives."""
        here = entry.describe() if entry is not None else "the lockstep check (control group)"
        cause = short_cause(exc) if exc is not None else where
        me = self.group.global_rank
        store = self.store if main else store
        if main:
            self._main_diagnosing = True
        if store is None:
            return CollectiveTimeoutError(f"rank {me}: {here} failed ({cause}) and no rendezvous "
                                          f"store is available to compare logs")
        p = self._prefix()
        try:
            self.publish_log(store)
            store.add(p + "alarm", 1)
            logs, verdict = self._collect_logs(store)
            if verdict is None:
                verdict = self._post_verdict(store, Verdict.of(
                    self._judge(logs, here, cause), me, tuple(sorted(logs))))
        except Exception as store_exc:  # the store's host is gone: still an error, not a hang
            verdict = Verdict("CollectiveTimeoutError", EXIT_TIMEOUT,
                              f"rank {me}: {here} failed ({cause}); the rendezvous store is "
                              f"unreachable ({short_cause(store_exc)}): its host (rank 0, or "
                              f"torchrun's agent) has stopped", me, (me,))
        self.verdict = verdict
        return verdict.exception()

    def _judge(self, logs: dict[int, list[CollectiveEntry]], here: str, cause: str) -> BaseException:
        """This rank's reading of the logs the live ranks posted."""
        me = self.group.global_rank
        missing = [r for r in self.group.ranks if r not in logs]
        diff = first_difference(logs)
        if diff is not None and not is_prefix_gap(logs):
            return DivergenceError(f"collectives diverged: {diff}")
        if missing:
            return CollectiveTimeoutError(
                f"rank {me}: {here} did not complete ({cause}); rank(s) {missing} did not answer "
                f"within {self.grace_s:g} s: dead, or frozen")
        if diff is not None:
            counts = {r: (v[-1].seq + 1 if v else "none since the last check")
                      for r, v in logs.items()}
            return CollectiveTimeoutError(
                f"rank {me}: {here} did not complete ({cause}); some ranks stopped issuing "
                f"collectives (stalled, not diverged): {diff}; collectives issued per rank: {counts}")
        return CollectiveTimeoutError(
            f"rank {me}: {here} did not complete ({cause}); every rank's log agrees, so a peer "
            f"is slow or stuck outside the collectives")

    def _collect_logs(self, store: dist.Store) -> tuple[dict[int, list[CollectiveEntry]],
                                                        Optional[Verdict]]:
        """Every rank's posted log, waiting at most ``grace_s`` for the silent ones; stops
        early when another rank has already posted the verdict."""
        p = self._prefix()
        logs: dict[int, list[CollectiveEntry]] = {}
        deadline = time.monotonic() + self.grace_s
        while True:
            for r in self.group.ranks:
                if r not in logs and store.check([f"{p}log/{r}"]):
                    logs[r] = [CollectiveEntry.from_json(d)
                               for d in json.loads(store.get(f"{p}log/{r}"))]
            if len(logs) == self.group.size or time.monotonic() > deadline:
                return logs, None
            if store.check([p + "verdict"]):
                return logs, Verdict.from_json(store.get(p + "verdict"))
            time.sleep(0.05)

    def _post_verdict(self, store: dist.Store, mine: Verdict) -> Verdict:
        """Post ``mine`` unless a rank got there first; return the verdict that stands."""
        p = self._prefix()
        if store.add(p + "verdict/claim", 1) == 1:
            store.set(p + "verdict", mine.to_json())
            return mine
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:  # the first poster is writing it
            if store.check([p + "verdict"]):
                return Verdict.from_json(store.get(p + "verdict"))
            time.sleep(0.02)
        return mine

    def publish_log(self, store: Optional[dist.Store] = None) -> None:
        """Post this rank's recent collective log to the store (once), so peers stuck in another
        collective can still name the divergence after this rank has raised and left."""
        store = self.store if store is None else store
        with self._publish_lock:
            if store is None or self._published:
                return
            payload = json.dumps([e.to_json() for e in list(self.recorder.window)])
            store.set(f"{self._prefix()}log/{self.group.global_rank}", payload)
            self._published = True

    # ---- the end of a failed job -----------------------------------------------------------
    def try_claim(self) -> bool:
        """The right to print this rank's failure and end the process (first caller wins)."""
        return self._claim.acquire(blocking=False)

    def abandon(self, label: str, code: int, message: str) -> None:
        """This rank failed with ``label: message`` (already printed): unless a verdict stands,
        post this one so that every peer stops at once with the same line; then ``finish``."""
        if self.store is None or self.group.size == 1:
            return
        me = self.group.global_rank
        # a divergence is the same on every rank; anything else happened on this one: say so
        own = code == EXIT_DIVERGENCE or message.startswith(f"rank {me}")
        text = message if own else f"rank {me}: {message}"
        try:
            self.publish_log()
            if self.verdict is None:
                self.verdict = self._post_verdict(
                    self.store, Verdict(label, code, text, me, self.group.ranks))
            self.store.add(self._prefix() + "alarm", 1)
        except Exception:
            pass  # the store is gone: the peers find out through their own collectives
        self.finish()

    def finish(self, store: Optional[dist.Store] = None) -> None:
        """Mark this rank done and wait (at most ``grace_s``) until every live rank is: every
        rank prints its line before any leaves (a launcher kills the job at the first exit, and
        rank 0 hosts the store)."""
        store = self.store if store is None else store
        if store is None or self.group.size == 1:
            return
        p = self._prefix()
        live = self.verdict.live if self.verdict is not None else self.group.ranks
        try:
            store.set(f"{p}done/{self.group.global_rank}", "1")
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and not store.check([f"{p}done/{r}" for r in live]):
                time.sleep(0.05)
        except Exception:
            pass  # the store is gone: nothing left to wait for

    # ---- watchdog ---------------------------------------------------------------------------
    @contextmanager
    def round(self, round_idx: int) -> Iterator[None]:
        """Arm the watchdog for one round: it must finish within ``watchdog_s``."""
        self._round = round_idx
        self._deadline = time.monotonic() + self.watchdog_s
        try:
            yield
        finally:
            self._deadline = None

    def _watch(self) -> None:
        store = self.watch_store
        polling = store is not None
        while not self._stop.wait(POLL_S):
            if polling:
                try:
                    if self._answer_alarm(store):
                        return
                except Exception:
                    polling = False  # the store is gone; the main thread's collectives say so
            deadline = self._deadline
            if deadline is not None and time.monotonic() >= deadline and not self._main_diagnosing:
                self._overran(store)

    def _answer_alarm(self, store: dist.Store) -> bool:
        """Post this rank's log when a peer raised the alarm; end the process when a verdict
        stands and the main thread is not already reporting. True: stop watching."""
        p = self._prefix()
        if store.add(p + "alarm", 0) == 0:
            return False
        self.publish_log(store)
        if not self.exit_on_watchdog or self._main_diagnosing or not store.check([p + "verdict"]):
            return False
        verdict = Verdict.from_json(store.get(p + "verdict"))
        if not self.try_claim():
            return True  # the main thread reports
        self._exit(verdict, store)
        return True

    def _overran(self, store: Optional[dist.Store]) -> None:
        """This rank's round exceeded ``watchdog_s``: diagnose from this thread (the main one
        may be stuck where it cannot raise), report, and end the process."""
        where = f"round {self._round} exceeded {self.watchdog_s:.1f} s"
        self._deadline = None
        err = self._diagnose(None, None, where=where, store=store, main=False)
        if not self.exit_on_watchdog:
            sys.stderr.write(f"[rank {self.group.global_rank}] {type(err).__name__}: {err}\n")
            sys.stderr.flush()
            return
        if self.try_claim():
            self._exit(self.verdict, store)

    def _exit(self, verdict: Verdict, store: Optional[dist.Store]) -> None:
        self.verdict = verdict
        sys.stderr.write(verdict.line(self.group.global_rank))
        sys.stderr.flush()
        if store is not None:
            self.finish(store)
        os._exit(verdict.code)

    def close(self) -> None:
        """Stop the watchdog thread (this rank no longer answers alarms: post the log first)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self._thread = None
