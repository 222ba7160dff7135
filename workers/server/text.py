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

from typing import Any, Optional, Sequence

from workers.tokenizer import ByteTokenizer, StreamDecoder, Tokenizer, load_tokenizer


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


class ByteCodec(Codec):
    """The bundled pair's byte tokenizer with the model's BOS id."""

    def __init__(self, bos_token_id: Optional[int]) -> None:
        super().__init__(ByteTokenizer(bos_token_id, ()))


def codec_for(model: Any) -> Codec:
    """The codec of the model the ranks serve (a ``ModelInfo``): its target directory's
    tokenizer, or the byte tokenizer when the ranks name no directory."""
    directory = getattr(model, "tokenizer_dir", None)
    if directory:
        return Codec(load_tokenizer(directory))
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
    tokens as their text."""

    def __init__(self, codec: Codec, stops: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.codec = codec
        self.decoder = codec.stream(skip_special_tokens)
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
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
        """Append settled text; where the text ends at the earliest stop string now in it
        (its start, or its end with `include_stop`; None: none)."""
        # the text before `piece` held no stop string, so a match ends inside `piece`
        start = max(0, len(self.decoded) - self.hold)
        self.decoded += piece
        if not piece or not self.stops:
            return None
        hits = [(i, len(s)) for s in self.stops for i in (self.decoded.find(s, start),) if i >= 0]
        if not hits:
            return None
        at, length = min(hits)
        return at + length if self.include_stop else at
