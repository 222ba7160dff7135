"""Text of the frontend: prompt encoding, and a completion's text emitted in stable pieces and cut
at the first stop string.

``Codec`` is the one place that knows the tokenizer: the model's own (``workers.tokenizer.
load_tokenizer`` over the target directory the ranks announce in ``ModelInfo.tokenizer_dir``: its
``tokenizer.json``, or the bundled pair's byte tokenizer). ``TextStream`` turns a growing list of
token ids into text through a ``workers.tokenizer.StreamDecoder`` (a trailing incomplete
character is held back until it is whole) and holds back the last ``len(longest stop) - 1``
characters (which may be the start of a stop string) until they are settled, so every emitted
piece is final and the concatenation equals the non-streamed text. A completion that meets a stop
string keeps its tokens through the one that completed it (``TextStream``; docs/serving.md).
No torch here.
"""
from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any, Optional, Sequence

from workers.tokenizer import (NUM_BYTES, SPECIAL_TOKENS, ByteTokenizer, StreamDecoder,
                               Tokenizer, load_tokenizer)

if TYPE_CHECKING:
    from workers.server.protocol import ModelInfo

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_level_inverse() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE vocabulary writes
    for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Codec:
    """Prompt text -> ids (with BOS where the tokenizer says so; special tokens' texts are those
    tokens) and ids -> text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens:
            return self.tokenizer.encode(text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh streaming decoder (one per completion)."""
        return StreamDecoder(self.tokenizer, skip_special_tokens)

    @functools.lru_cache(maxsize=65536)
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (logprobs' ``bytes``; a special token: its
        text). A byte tokenizer's id is its byte; a `tokenizers` vocabulary's piece is read as
        byte-level BPE or a ``<0xNN>`` byte fallback when its text alone is no whole character."""
        tok = self.tokenizer
        if isinstance(tok, ByteTokenizer):
            if 0 <= token_id < NUM_BYTES:
                return bytes([token_id])
            return SPECIAL_TOKENS.get(token_id, "").encode()
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        inner = getattr(tok, "_tok", None)
        piece = inner.id_to_token(token_id) if inner is not None else None
        if piece:
            found = _BYTE_PIECE.fullmatch(piece)
            if found:
                return bytes([int(found.group(1), 16)])
            table = _byte_level_inverse()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return text.encode()


class Offsets:
    """Character offsets of tokens in a text decoded token by token (logprobs' text_offset):
    a token's offset is the length of the text settled before it."""

    def __init__(self, codec: "Codec", skip_special_tokens: bool = True) -> None:
        self.decoder = codec.stream(skip_special_tokens)
        self.chars = 0
        self.offsets: list[int] = []

    def push(self, ids: Sequence[int]) -> list[int]:
        """The offsets of `ids` (appended to `offsets`)."""
        out = []
        for t in ids:
            out.append(self.chars)
            self.chars += len(self.decoder.push([t]))
        self.offsets += out
        return out


class ByteCodec(Codec):
    """The bundled pair's byte tokenizer with the model's BOS id."""

    def __init__(self, bos_token_id: Optional[int]) -> None:
        super().__init__(ByteTokenizer(bos_token_id, ()))


def codec_for(model: ModelInfo) -> Codec:
    """The codec of the model the ranks serve: its target directory's tokenizer, or the byte
    tokenizer when the ranks name no directory."""
    if model.tokenizer_dir:
        return Codec(load_tokenizer(model.tokenizer_dir))
    return ByteCodec(model.bos_token_id)


class TextStream:
    """One completion's text as tokens arrive; see the module docstring.

    With stop strings, tokens are decoded one at a time, so where the completion stops does not
    depend on how its tokens were grouped into rounds and deltas: ``token_ids`` (what the
    response returns and counts as ``completion_tokens``) ends with the token after which the
    decoded text first contains a stop string, that token included; every later token is
    dropped. The text is cut before the earliest stop string in that text (after it with
    `include_stop`). A completion the engine ended with a stop token (its EOS, or one of
    `stop_token_ids`) keeps that token in ``token_ids`` but not its text, unless
    `include_stop` (``feed(..., stop_token=True)``). `skip_special_tokens` False writes special
    tokens as their text. With `min_tokens`, a stop string completed by a token before the
    `min_tokens`-th does not count (as the engine's stop tokens cannot be drawn there)."""

    def __init__(self, codec: Codec, stops: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self.codec = codec
        self.decoder = codec.stream(skip_special_tokens)
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.decoded = ""           # settled text (emitted, or held for a stop string)
        self.text = ""              # emitted so far
        self.stopped = False        # a stop string was found (the text is cut there)
        self.token_ids: list[int] = []   # the completion's tokens (through the stop, if any)

    def feed(self, token_ids: Sequence[int], final: bool, stop_token: bool = False) -> str:
        """Add tokens; return the newly settled text (everything left when `final`).
        `stop_token`: the last of `token_ids` is the stop token that ended the completion."""
        if self.stopped:
            return ""
        quiet = stop_token and final and bool(token_ids) and not self.include_stop
        cut = self._push(token_ids[:-1] if quiet else token_ids)
        if quiet and cut is None:
            self.token_ids.append(token_ids[-1])     # counted, its text not returned
        if cut is None and final:
            cut = self._grow(self.decoder.finish())
        full = self.decoded
        if cut is not None:
            self.stopped = True
            end = cut
        else:
            end = len(full) if final else max(len(self.text), len(full) - self.hold)
        delta = full[len(self.text):end]
        self.text += delta
        return delta

    def _push(self, token_ids: Sequence[int]) -> Optional[int]:
        """Decode `token_ids` up to the first stop string; where the text ends then (None:
        no stop string)."""
        if not self.stops:
            self.token_ids.extend(token_ids)
            self.decoded += self.decoder.push(token_ids)
            return None
        for token in token_ids:
            self.token_ids.append(token)
            cut = self._grow(self.decoder.push([token]))
            if cut is not None:
                return cut
        return None

    def _grow(self, piece: str) -> Optional[int]:
        """Append settled text; where the text ends at the earliest stop string that ends in
        `piece` (its start, or its end with `include_stop`; None: none, or fewer than
        `min_tokens` tokens so far)."""
        # a match counts when it ends inside `piece` (the text before held none, or held only
        # ones before min_tokens, which do not count)
        before = len(self.decoded)
        self.decoded += piece
        if not piece or not self.stops or len(self.token_ids) < self.min_tokens:
            return None
        hits = [(i, len(s)) for s in self.stops
                for i in (self.decoded.find(s, max(0, before - len(s) + 1)),) if i >= 0]
        if not hits:
            return None
        at, length = min(hits)
        return at + length if self.include_stop else at
