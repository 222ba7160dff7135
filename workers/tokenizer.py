"""Tokenizers: the one small interface `generate`, `serve`'s frontend and the benchmarks use, the
byte tokenizer of the bundled pair, and streaming decode. No torch here (the frontend imports it).

    tok = load_tokenizer(target_dir)   # tokenizer.json there: `HFTokenizer`; else `ByteTokenizer`
    ids = tok.encode("prompt")         # with BOS where the tokenizer / config say so
    ids = tok.encode("<|bos|>text", add_special_tokens=False)  # no BOS added; special texts: ids
    text = tok.decode(ids)             # special tokens dropped
    text = tok.decode(ids, skip_special_tokens=False)         # ... or written as their texts
    stream = StreamDecoder(tok)        # text of a growing id list, one settled piece at a time
    piece = stream.push(new_ids); rest = stream.finish()

The byte tokenizer: ids 0..255 are the bytes of the UTF-8 encoding; three specials follow:
``BOS_ID = 256``, ``EOS_ID = 257``, ``PAD_ID = 258``. Ids 259..263 are unused padding so that
``VOCAB_SIZE = 264`` is a multiple of 8 (aligned embedding and LM-head rows); a model never needs
to emit them and ``decode`` drops them. Every special id has a text (``SPECIAL_TOKENS``:
``<|bos|>``, ``<|eos|>``, ``<|pad|>``, ``<|unused0|>``...): ``decode(...,
skip_special_tokens=False)`` writes it, and ``ByteTokenizer.encode`` reads it back as the id, as
the `tokenizers` library reads an added token's text in any text (a chat template writes
``bos_token`` as text). The module's ``encode`` is bytes only.

The bundled pair's ``tokenizer.json`` (for clients: ``tokenizers`` / transformers' AutoTokenizer)
encodes and decodes exactly as this tokenizer does (tests/unit/test_serve_chat_parts.py); its
``tokenizer_config.json`` says ``"adaptive_dist_tokenizer": "bytes"``, so ``load_tokenizer``
keeps this implementation for it (no `tokenizers` call per request).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Protocol, Sequence

from workers.model_files import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
NUM_BYTES = 256
VOCAB_SIZE = 264
BYTE_MARKER = ("adaptive_dist_tokenizer", "bytes")
"""The `tokenizer_config.json` entry that keeps the byte tokenizer for a directory whose
`tokenizer.json` is the byte vocabulary (the bundled pair's, written for clients)."""
REPLACEMENT = "\ufffd"
SPECIAL_TOKENS: dict[int, str] = {BOS_ID: "<|bos|>", EOS_ID: "<|eos|>", PAD_ID: "<|pad|>",
                                  **{i: f"<|unused{i - PAD_ID - 1}|>"
                                     for i in range(PAD_ID + 1, VOCAB_SIZE)}}
_SPECIAL_IDS = {text: i for i, text in SPECIAL_TOKENS.items()}
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS.values()))


def encode(text: str, add_bos: bool = False) -> list[int]:
    """UTF-8 bytes of ``text`` as ids, optionally preceded by ``BOS_ID``."""
    ids = list(text.encode("utf-8"))
    return [BOS_ID] + ids if add_bos else ids


def decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of the byte ids in ``ids``, bad UTF-8 replaced; specials are dropped, or written as
    their ``SPECIAL_TOKENS`` text when not `skip_special_tokens` (each run of bytes between them
    decoded on its own). Ids outside the vocabulary are dropped."""
    if skip_special_tokens:
        data = bytes(i for i in ids if 0 <= i < NUM_BYTES)
        return data.decode("utf-8", errors="replace")
    parts: list[str] = []
    run = bytearray()
    for i in ids:
        if 0 <= i < NUM_BYTES:
            run.append(i)
        elif i in SPECIAL_TOKENS:
            parts += [run.decode("utf-8", errors="replace"), SPECIAL_TOKENS[i]]
            run = bytearray()
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)


def encode_with_specials(text: str) -> list[int]:
    """Ids of ``text`` where every ``SPECIAL_TOKENS`` text is its id and the rest is bytes (how
    a tokenizer reads a rendered chat template: the template writes ``bos_token`` as text)."""
    ids: list[int] = []
    start = 0
    for match in _SPECIAL_RE.finditer(text):
        ids += encode(text[start:match.start()])
        ids.append(_SPECIAL_IDS[match.group()])
        start = match.end()
    return ids + encode(text[start:])


class Tokenizer(Protocol):
    """What the commands need from a tokenizer."""

    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    vocab_size: int      # ids the tokenizer can produce are below this

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt ids of `text`, with BOS where the tokenizer says so (none without
        `add_special_tokens`: a rendered chat template brings its own). Special tokens' texts
        in `text` are those tokens."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (special tokens dropped unless not `skip_special_tokens`; an
        incomplete character becomes U+FFFD)."""
        ...


class ByteTokenizer:
    """The bundled pair's byte tokenizer; BOS and EOS ids as the model's `config.json` gives them."""

    vocab_size = VOCAB_SIZE

    def __init__(self, bos_token_id: Optional[int] = BOS_ID,
                 eos_token_ids: tuple[int, ...] = (EOS_ID,)) -> None:
        self.bos_token_id, self.eos_token_ids = bos_token_id, tuple(eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        bos = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        return bos + encode_with_specials(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return decode(ids, skip_special_tokens)


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

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0    # start of the window
        self._read = 0      # end of what has been emitted

    def push(self, ids: Sequence[int]) -> str:
        """Add `ids`; return the newly settled text ('' while a character is incomplete)."""
        self.ids.extend(ids)
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before):]

    def finish(self) -> str:
        """Everything not emitted yet (an incomplete character as U+FFFD)."""
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(before):]

    def _decode(self, ids: Sequence[int]) -> str:
        if self.skip:
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of the target directory `model_dir`: its `tokenizer.json` (through the
    `tokenizers` library), else the byte tokenizer (the bundled pair, whose `tokenizer.json` is
    for clients: `BYTE_MARKER`). BOS and EOS ids from the directory's `config.json` /
    `generation_config.json` / `tokenizer_config.json`."""
    from workers.model_files import bos_token_id, eos_token_ids

    root = Path(model_dir)
    if (root / TOKENIZER_FILE).is_file() and not is_byte_vocabulary(root):
        from workers.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_dir(root)
    return ByteTokenizer(bos_token_id(root), eos_token_ids(root))


def is_byte_vocabulary(model_dir: str | Path) -> bool:
    """Whether `model_dir`'s `tokenizer_config.json` marks its vocabulary as this module's bytes
    (`BYTE_MARKER`)."""
    path = Path(model_dir) / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return False
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get(BYTE_MARKER[0]) == BYTE_MARKER[1]
