"""Recording mode: a per-rank log of every collective, with a rolling hash.

Every collective issued through ``collectives.ops`` on a group that carries a recorder is
appended here (sequence number, op, group, shape, dtype) before it is issued. The rolling hash
lets ranks compare whole histories with one small exchange (see ``guard.LockstepGuard``).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class CollectiveEntry:
    seq: int
    op: str
    group: str
    shape: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        return f"#{self.seq} {self.op}(group={self.group}, shape=[{shape}], dtype={self.dtype})"

    def signature(self) -> tuple:
        """Everything but the sequence number: what must match across ranks."""
        return (self.op, self.group, self.shape, self.dtype)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "CollectiveEntry":
        return CollectiveEntry(d["seq"], d["op"], d["group"], tuple(d["shape"]), d["dtype"])


_new = object.__new__
if (not CollectiveEntry.__dataclass_params__.frozen or hasattr(CollectiveEntry, "__post_init__")
        or [f.name for f in fields(CollectiveEntry)] != ["seq", "op", "group", "shape", "dtype"]):
    raise ImportError("collectives.recorder: CollectiveEntry changed; record() builds it by its "
                      "five fields")


class CollectiveRecorder:
    """Per-rank collective log. ``keep_log=False`` keeps only the hash and the current window.

    ``window`` holds the entries since the last verified lockstep check (they are what a
    diagnosis compares); ``on_failure`` is installed by the guard and turns a failed collective
    into a ``DivergenceError`` or ``CollectiveTimeoutError``.
    """

    WINDOW_LIMIT = 4096

    def __init__(self, rank: int, keep_log: bool = True, strict: bool = False) -> None:
        self.rank = rank
        self.keep_log = keep_log
        self.strict = strict
        self.count = 0
        self.log: list[CollectiveEntry] = []
        self.window: list[CollectiveEntry] = []
        self._digest = hashlib.blake2b(digest_size=16).digest()
        self.on_failure: Optional[Callable[[CollectiveEntry, BaseException], BaseException]] = None
        # strict mode: called before each collective is issued, with (entry, control group);
        # the guard compares the entry across the group's members first (a debug mode that
        # catches a reshaped collective before a backend can crash or hang on it).
        self.before_issue: Optional[Callable[[CollectiveEntry, object], None]] = None
        # per (op, group, shape, dtype): the entry's shape and dtype fields and the signature's
        # bytes the hash reads (a round's collectives repeat theirs every round)
        self._signatures: dict[tuple, tuple[tuple[int, ...], str, bytes]] = {}

    SIGNATURE_CACHE = 4096   # distinct signatures kept (more: the cache starts again)

    def record(self, op: str, group: str, tensor: torch.Tensor) -> CollectiveEntry:
        key = (op, group, tensor.shape, tensor.dtype)
        sig = self._signatures.get(key)
        if sig is None:
            if len(self._signatures) >= self.SIGNATURE_CACHE:
                self._signatures.clear()
            shape, dtype = tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")
            sig = self._signatures[key] = (
                shape, dtype, repr(CollectiveEntry(0, op, group, shape, dtype).signature()).encode())
        # the entry without the frozen __init__'s one object.__setattr__ per field (the same
        # instance: equal, the same repr and hash; CollectiveEntry's __init__ only sets them)
        entry = _new(CollectiveEntry)
        entry.__dict__.update(seq=self.count, op=op, group=group, shape=sig[0], dtype=sig[1])
        self.count += 1
        if self.keep_log:
            self.log.append(entry)
        window = self.window
        window.append(entry)
        if len(window) > self.WINDOW_LIMIT:
            del window[: len(window) - self.WINDOW_LIMIT]
        # the rolling hash: blake2b of the previous digest followed by the signature's repr
        self._digest = hashlib.blake2b(self._digest + sig[2], digest_size=16).digest()
        return entry

    def digest_words(self) -> tuple[int, int]:
        """The rolling hash as two non-negative 62-bit integers (exact in int64 tensors)."""
        hi = int.from_bytes(self._digest[:8], "little") >> 2
        lo = int.from_bytes(self._digest[8:], "little") >> 2
        return hi, lo

    def mark_verified(self) -> None:
        """Every rank agreed up to here: later diagnoses only compare what follows."""
        self.window.clear()

    def json_lines(self) -> list[str]:
        """The full log (recording mode with ``keep_log``), one JSON object per entry."""
        return [json.dumps(e.to_json()) for e in self.log]

    def dump(self, path: str) -> None:
        """Write the full log as JSON lines, whole or not at all: a temporary file in the same
        directory is renamed into place (a full disk or a crash leaves no torn line)."""
        import os
        import tempfile

        d = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=d)
        try:
            with os.fdopen(fd, "w") as f:
                f.writelines(line + "\n" for line in self.json_lines())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
