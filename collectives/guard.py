"""The lockstep guard: divergences between ranks become ``DivergenceError`` on every rank, and a
collective that does not complete in time becomes an error instead of a hang.

Three mechanisms, all host-side:

- ``check(round, decision)``: every ``check_every`` rounds the ranks all-gather (over the gloo
  control group) their collective count, the rolling hash of their collective log and a digest of
  the round's decision. On a mismatch they exchange the logs since the last good check and every
  rank raises the same ``DivergenceError`` naming the first differing entry.
- A collective that raises (gloo reports timeouts and size mismatches as exceptions) is diagnosed
  through the rendezvous store, which does not go through the stuck process group: every rank
  posts its recent log, reads the others', and raises ``DivergenceError`` naming the first
  differing entry, or ``CollectiveTimeoutError`` when the logs agree (a peer is slow or dead).
- A watchdog thread covers what never raises (an NCCL collective waits on the device): if a round
  is not finished ``timeout_s`` after it began, it diagnoses the same way, prints the error and
  ends the process with exit code ``EXIT_DIVERGENCE`` or ``EXIT_TIMEOUT`` — no hung teardown.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from collectives.group import Group
from collectives.ops import gather_into
from collectives.recorder import CollectiveEntry, CollectiveRecorder

EXIT_DIVERGENCE = 3
EXIT_TIMEOUT = 4


class DivergenceError(RuntimeError):
    """Ranks issued different collectives or made different decisions."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete in time, and the ranks' logs do not show a divergence."""


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
    """Cross-rank lockstep checks over ``group`` (normally ``world``), using its control group."""

    def __init__(
        self,
        group: Group,
        recorder: CollectiveRecorder,
        *,
        check_every: int = 8,
        timeout_s: float = 60.0,
        watchdog_s: Optional[float] = None,
        store: Optional[dist.Store] = None,
        exit_on_watchdog: bool = True,
    ) -> None:
        if check_every < 1:
            raise ValueError(f"lockstep guard: check_every={check_every} must be >= 1")
        self.group = group
        self.recorder = recorder
        self.check_every = check_every
        self.timeout_s = timeout_s
        self.watchdog_s = timeout_s if watchdog_s is None else watchdog_s
        self.store = store
        self.exit_on_watchdog = exit_on_watchdog
        self.checks = 0
        self._published = False  # one diagnosis per job: after a divergence the job ends
        self._deadline: Optional[float] = None
        self._round: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        recorder.on_failure = self._on_collective_failure
        recorder.before_issue = self._verify_entry

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
        windows: list = [None] * self.group.size
        dist.all_gather_object(windows, [e.to_json() for e in self.recorder.window],
                               group=self.group.control_pg)
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
        seen: list = [None] * group.size
        dist.all_gather_object(seen, entry.to_json(), group=group.control_pg)
        logs = {group.ranks[i]: [CollectiveEntry.from_json(d)] for i, d in enumerate(seen)}
        desc = "; ".join(f"rank {r}: {v[0].describe()}" for r, v in logs.items())
        self.publish_log()
        raise DivergenceError(f"strict lockstep: ranks are about to issue different "
                              f"collectives on group {group.name!r}: {desc}")

    # ---- failures of a collective ---------------------------------------------------------
    def _on_collective_failure(self, entry: CollectiveEntry, exc: BaseException) -> BaseException:
        return self._diagnose(entry, exc)

    def _diagnose(self, entry: Optional[CollectiveEntry], exc: Optional[BaseException],
                  where: str = "") -> BaseException:
        """Exchange recent logs through the store (not the stuck group) and name the difference."""
        here = entry.describe() if entry is not None else "the lockstep check (control group)"
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if exc else where
        me = self.group.global_rank
        try:
            logs = self._exchange_logs_via_store()
            if self.store is not None:
                self.store.set(self._prefix() + f"ack/{me}", "1")
        except Exception as store_exc:  # the store's host is gone: still an error, not a hang
            return CollectiveTimeoutError(
                f"rank {me}: {here} failed ({cause}); the rendezvous store is unreachable "
                f"({type(store_exc).__name__}), so the logs could not be compared")
        if logs is None:
            return CollectiveTimeoutError(
                f"rank {me}: {here} failed ({cause}) and no rendezvous store is available to "
                f"compare logs")
        missing = [r for r in self.group.ranks if r not in logs]
        diff = first_difference(logs)
        if diff is not None and not is_prefix_gap(logs):
            return DivergenceError(f"collectives diverged: {diff}")
        if diff is not None:
            counts = {r: (v[-1].seq + 1 if v else "none since the last check") for r, v in logs.items()}
            return CollectiveTimeoutError(
                f"rank {me}: {here} did not complete ({cause}); some ranks stopped issuing "
                f"collectives (stalled, not diverged): {diff}; collectives issued per rank: {counts}")
        if missing:
            return CollectiveTimeoutError(
                f"rank {me}: {here} did not complete ({cause}); ranks {missing} did not report "
                f"within {self._grace_s():.0f} s (stuck or dead)")
        return CollectiveTimeoutError(
            f"rank {me}: {here} did not complete ({cause}); every rank's log agrees, so a peer "
            f"is slow or stuck outside the collectives")

    def _grace_s(self) -> float:
        return min(10.0, max(2.0, self.timeout_s / 2))

    @property
    def published(self) -> bool:
        """This rank posted its log after a failure (see ``linger``)."""
        return self._published

    def _prefix(self) -> str:
        return f"adaptive_dist/guard/{self.group.name}/"

    def publish_log(self) -> None:
        """Post this rank's recent collective log to the store, so that peers stuck in another
        collective can still name the divergence after this rank has raised and left."""
        if self.store is not None and not self._published:
            payload = json.dumps([e.to_json() for e in self.recorder.window])
            self.store.set(self._prefix() + str(self.group.global_rank), payload)
            self._published = True

    def _exchange_logs_via_store(self) -> Optional[dict[int, list[CollectiveEntry]]]:
        store = self.store
        if store is None:
            return None
        self.publish_log()
        prefix = self._prefix()
        logs: dict[int, list[CollectiveEntry]] = {}
        deadline = time.monotonic() + self._grace_s()
        pending = list(self.group.ranks)
        while pending and time.monotonic() < deadline:
            for r in list(pending):
                if store.check([prefix + str(r)]):
                    raw = json.loads(store.get(prefix + str(r)))
                    logs[r] = [CollectiveEntry.from_json(d) for d in raw]
                    pending.remove(r)
            if pending:
                time.sleep(0.05)
        return logs

    # ---- watchdog ---------------------------------------------------------------------------
    @contextmanager
    def round(self, round_idx: int) -> Iterator[None]:
        """Arm the watchdog for one round: it must finish within ``timeout_s``."""
        self._ensure_watchdog()
        self._round = round_idx
        self._deadline = time.monotonic() + self.watchdog_s
        try:
            yield
        finally:
            self._deadline = None

    def _ensure_watchdog(self) -> None:
        if self._thread is None and self.group.size > 1:
            self._thread = threading.Thread(target=self._watch, name="lockstep-watchdog",
                                            daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            deadline = self._deadline
            if deadline is None or time.monotonic() < deadline:
                continue
            where = f"round {self._round} exceeded {self.watchdog_s:.1f} s"
            try:
                err = self._diagnose(None, None, where=where)
            except Exception as exc:  # the store itself is gone: still never hang
                err = CollectiveTimeoutError(
                    f"rank {self.group.global_rank}: {where}; the rendezvous store is unreachable "
                    f"({type(exc).__name__}), so the logs could not be compared")
            code = EXIT_DIVERGENCE if isinstance(err, DivergenceError) else EXIT_TIMEOUT
            sys.stderr.write(f"[rank {self.group.global_rank}] {type(err).__name__}: {err}\n")
            sys.stderr.flush()
            if self.exit_on_watchdog:
                self.linger()
                os._exit(code)
            self._deadline = None

    def linger(self) -> None:
        """After a failure: post this rank's log, then wait (bounded) until every rank has
        diagnosed, so a rank that hosts the store does not take it away from stuck peers."""
        if self.store is None or self.group.size == 1:
            return
        try:
            self.publish_log()
            self.store.set(self._prefix() + f"ack/{self.group.global_rank}", "1")
            keys = [self._prefix() + f"ack/{r}" for r in self.group.ranks]
            # NOTE: a peer stuck in a device collective only diagnoses when its watchdog fires,
            # so wait that long (bounded) before taking the store away from it.
            deadline = time.monotonic() + self.watchdog_s + self._grace_s()
            while time.monotonic() < deadline and not self.store.check(keys):
                time.sleep(0.05)
        except Exception:
            pass  # the store is gone; nothing left to wait for

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
