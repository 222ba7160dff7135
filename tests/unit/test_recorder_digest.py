"""The recorder's rolling hash and entries against the definition written out here: blake2b
(16 bytes) of the previous digest updated with ``repr((op, group, shape, dtype)).encode()``,
one entry per collective with its sequence number (issue 37: the signature is cached per
(op, group, shape, dtype), which must change neither the entries nor the hash)."""
from __future__ import annotations

import hashlib
import random

import torch

from collectives.recorder import CollectiveEntry, CollectiveRecorder


def reference(calls: list[tuple[str, str, torch.Tensor]]) -> tuple[bytes, list[CollectiveEntry]]:
    digest = hashlib.blake2b(digest_size=16).digest()
    entries = []
    for seq, (op, group, t) in enumerate(calls):
        shape, dtype = tuple(t.shape), str(t.dtype).replace("torch.", "")
        entries.append(CollectiveEntry(seq, op, group, shape, dtype))
        h = hashlib.blake2b(digest, digest_size=16)
        h.update(repr((op, group, shape, dtype)).encode())
        digest = h.digest()
    return digest, entries


def test_cached_signatures_give_the_defined_entries_and_hash():
    rng = random.Random(37)
    ops = ["all_reduce.sum", "all_reduce.sum_max.shm.control", "all_gather", "broadcast"]
    groups = ["dp", "tp", "world"]
    dtypes = [torch.int64, torch.float32, torch.bfloat16, torch.float64]
    shapes = [(), (93,), (4, 7), (1,), (2, 3, 5)]
    calls = [(rng.choice(ops), rng.choice(groups),
              torch.zeros(rng.choice(shapes), dtype=rng.choice(dtypes))) for _ in range(500)]
    rec = CollectiveRecorder(0)
    rec.SIGNATURE_CACHE = 7          # the cache also starts again along the way
    got = [rec.record(op, g, t) for op, g, t in calls]
    digest, entries = reference(calls)
    assert got == entries and rec.log == entries
    assert [repr(e) for e in got] == [repr(e) for e in entries]
    assert [hash(e) for e in got] == [hash(e) for e in entries]
    assert rec._digest == digest
    assert len(rec._signatures) <= 7
