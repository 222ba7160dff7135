"""Byte-level tokenizer of the bundled model pair.

Ids 0..255 are the bytes of the UTF-8 encoding; three specials follow:
``BOS_ID = 256``, ``EOS_ID = 257``, ``PAD_ID = 258``. Ids 259..263 are unused
padding so that ``VOCAB_SIZE = 264`` is a multiple of 8 (aligned embedding and
LM-head rows); a model never needs to emit them and ``decode`` drops them.
"""
from __future__ import annotations

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
NUM_BYTES = 256
VOCAB_SIZE = 264


def encode(text: str, add_bos: bool = False) -> list[int]:
    """UTF-8 bytes of ``text`` as ids, optionally preceded by ``BOS_ID``."""
    ids = list(text.encode("utf-8"))
    return [BOS_ID] + ids if add_bos else ids


def decode(ids: list[int]) -> str:
    """Text of the byte ids in ``ids``; specials are dropped, bad UTF-8 is replaced."""
    data = bytes(i for i in ids if 0 <= i < NUM_BYTES)
    return data.decode("utf-8", errors="replace")


def is_special(token_id: int) -> bool:
    """Whether ``token_id`` is not a byte."""
    return token_id >= NUM_BYTES
