"""The shared-memory transport's settings and kernel words (issue 37, ``collectives.shm``); the
transport itself runs in tests/multirank/test_consensus_shm.py."""
from __future__ import annotations

import pytest

from collectives import shm


def test_the_spin_bound_is_read_and_checked_by_name(monkeypatch):
    monkeypatch.delenv(shm.SPIN_ENV, raising=False)
    assert shm.spin_s() == shm.SPIN_S
    monkeypatch.setenv(shm.SPIN_ENV, "0")
    assert shm.spin_s() == 0.0
    monkeypatch.setenv(shm.SPIN_ENV, "125")
    assert shm.spin_s() == pytest.approx(125e-6)
    for bad in ("-1", "nan", "fast", "20000"):
        monkeypatch.setenv(shm.SPIN_ENV, bad)
        with pytest.raises(ValueError, match=rf"ADAPTIVE_DIST_SHM_SPIN_US='{bad}': "
                                             r"microseconds from 0 to 10000"):
            shm.spin_s()


def test_futex_op_words_as_the_kernel_decodes_them():
    """``FUTEX_OP(op, oparg, cmp, cmparg)``: op in bits 28-31, cmp 24-27, oparg 12-23 and cmparg
    0-11, both 12-bit two's complement (the kernel sign-extends them)."""
    def decode(word):
        ext = lambda x: x - 0x1000 if x & 0x800 else x
        return word >> 28, ext((word >> 12) & 0xFFF), (word >> 24) & 0xF, ext(word & 0xFFF)

    assert decode(shm._futex_op(1, 1, 0, 7)) == (1, 1, 0, 7)       # add 1; wake if old == 7
    assert decode(shm._futex_op(1, 1, 0, -1)) == (1, 1, 0, -1)
    assert decode(shm._futex_op(1, 1, 0, 15)) == (1, 1, 0, 15)      # 16 members on a host


def test_the_futex_words_sit_in_the_header_on_their_own_line():
    words = {shm.COUNT_BYTE + 4 * k for k in range(3)} | {shm.PUB_BYTE, shm.NOBODY_BYTE}
    assert len(words) == 5 and all(w % 4 == 0 for w in words)
    assert all(64 <= w and w + 4 <= 128 for w in words)        # bytes 64-127: one cache line
    assert shm.HDR * 8 == 128                                    # the slots start after it


def test_the_early_wake_is_read_and_checked_by_name(monkeypatch):
    monkeypatch.delenv(shm.EARLY_WAKE_ENV, raising=False)
    assert shm.early_wake() is False
    monkeypatch.setenv(shm.EARLY_WAKE_ENV, "1")
    assert shm.early_wake() is True
    monkeypatch.setenv(shm.EARLY_WAKE_ENV, "yes")
    with pytest.raises(ValueError, match=r"ADAPTIVE_DIST_SHM_EARLY_WAKE='yes': 0 or 1"):
        shm.early_wake()
