"""Tokenizers: the one small interface `generate`, `serve`'s frontend and the benchmarks use, the
byte tokenizer of the bundled pair, and streaming decode. No torch here (the frontend imports it).

    tok = load_tokenizer(target_dir)   # tokenizer.json there: `HFTokenizer`; else `ByteTokenizer`
    ids = tok.encode("prompt")         # with BOS where the tokenizer / config say so
    text = tok.decode(ids)             # special tokens dropped
    stream = StreamDecoder(tok)        # text of a growing id list, one settled piece at a time
    piece = stream.push(new_ids); rest = stream.finish()

The byte tokenizer: ids 0..255 are the bytes of the UTF-8 encoding; three specials follow:
``BOS_ID = 256``, ``EOS_ID = 257``, ``PAD_ID = 258``. Ids 259..263 are unused padding so that
``VOCAB_SIZE = 264`` is a multiple of 8 (aligned embedding and LM-head rows); a model never needs
to emit them and ``decode`` drops them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol, Sequence

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
NUM_BYTES = 256
VOCAB_SIZE = 264
TOKENIZER_FILE = "tokenizer.json"
REPLACEMENT = "\ufffd"


def encode(text: str, add_bos: bool = False) -> list[int]:
    """UTF-8 bytes of ``text`` as ids, optionally preceded by ``BOS_ID``."""
    ids = list(text.encode("utf-8"))
    return [BOS_ID] + ids if add_bos else ids


def decode(ids: Sequence[int]) -> str:
    """Text of the byte ids in ``ids``; specials are dropped, bad UTF-8 is replaced."""
    data = bytes(i for i in ids if 0 <= i < NUM_BYTES)
    return data.decode("utf-8", errors="replace")


def is_special(token_id: int) -> bool:
    """Whether ``token_id`` is not a byte."""
    return token_id >= NUM_BYTES


class Tokenizer(Protocol):
    """What the commands need from a tokenizer."""

    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    vocab_size: int      # ids the tokenizer can produce are below this

    def encode(self, text: str) -> list[int]:
        """Prompt ids of `text`, with BOS where the tokenizer says so."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens dropped; an incomplete character becomes U+FFFD)."""
        ...


class ByteTokenizer:
    """The bundled pair's byte tokenizer; BOS and EOS ids as the model's `config.json` gives them."""

    vocab_size = VOCAB_SIZE

    def __init__(self, bos_token_id: Optional[int] = BOS_ID,
                 eos_token_ids: tuple[int, ...] = (EOS_ID,)) -> None:
        self.bos_token_id, self.eos_token_ids = bos_token_id, tuple(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return ([self.bos_token_id] if self.bos_token_id is not None else []) + encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return decode(ids)


class StreamDecoder:
    """The text of a growing list of ids, emitted in pieces that never end inside a character.

    Each `push` decodes a short window: the ids from the start of the previous settled piece on.
    The new piece is the window's text beyond the previous piece's, emitted only when it does not
    end in U+FFFD (an incomplete UTF-8 sequence, or a byte-fallback token waiting for the rest of
    its character); otherwise it waits for more ids. Decoding a window rather than the whole list
    keeps each push cheap and keeps tokenizers that strip a leading space from a text's first
    token right (both decodes of a window strip the same space). `finish` returns what is left,
    replacement characters included; the pieces then join to `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0    # start of the window
        self._read = 0      # end of what has been emitted

    def push(self, ids: Sequence[int]) -> str:
        """Add `ids`; return the newly settled text ('' while a character is incomplete)."""
        self.ids.extend(ids)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before):]

    def finish(self) -> str:
        """Everything not emitted yet (an incomplete character as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(before):]


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of the target directory `model_dir`: its `tokenizer.json` (through the
    `tokenizers` library), else the byte tokenizer (the bundled pair). BOS and EOS ids from the
    directory's `config.json` / `generation_config.json` / `tokenizer_config.json`."""
    from workers.model_files import bos_token_id, eos_token_ids

    root = Path(model_dir)
    if (root / TOKENIZER_FILE).is_file():
        from workers.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_dir(root)
    return ByteTokenizer(bos_token_id(root), eos_token_ids(root))
