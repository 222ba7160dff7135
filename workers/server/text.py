"""Text of the frontend: prompt encoding, and a completion's text emitted in stable pieces and cut
at the first stop string.

``Codec`` is the one place that knows the tokenizer: the model's own (``workers.tokenizer.
load_tokenizer`` over the target directory the ranks announce in ``ModelInfo.tokenizer_dir``: its
``tokenizer.json``, or the bundled pair's byte tokenizer). ``TextStream`` turns a growing list of
token ids into text through a ``workers.tokenizer.StreamDecoder`` (a trailing incomplete
character is held back until it is whole) and holds back the last ``len(longest stop) - 1``
characters (which may be the start of a stop string) until they are settled, so every emitted
piece is final and the concatenation equals the non-streamed text. No torch here.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from workers.tokenizer import ByteTokenizer, StreamDecoder, Tokenizer, load_tokenizer


class Codec:
    """Prompt text -> ids (with BOS where the tokenizer says so) and ids -> text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def stream(self) -> StreamDecoder:
        """A fresh streaming decoder (one per completion)."""
        return StreamDecoder(self.tokenizer)


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
    """One completion's text as tokens arrive; see the module docstring."""

    def __init__(self, codec: Codec, stops: Sequence[str] = ()) -> None:
        self.codec = codec
        self.decoder = codec.stream()
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.decoded = ""           # settled text (emitted, or held for a stop string)
        self.text = ""              # emitted so far
        self.stopped = False        # a stop string was found (the text is cut before it)

    @property
    def token_ids(self) -> list[int]:
        """Every token id fed so far (until a stop string was found)."""
        return self.decoder.ids

    def feed(self, token_ids: Sequence[int], final: bool) -> str:
        """Add tokens; return the newly settled text (everything left when `final`)."""
        if self.stopped:
            return ""
        self.decoded += self.decoder.push(token_ids)
        if final:
            self.decoded += self.decoder.finish()
        full = self.decoded
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            end = cut
        else:
            end = len(full) if final else max(len(self.text), len(full) - self.hold)
        delta = full[len(self.text):end]
        self.text += delta
        return delta

    def _first_stop(self, full: str) -> Optional[int]:
        # emitted text never holds a whole stop string, so a match starts at most `hold` before
        start = max(0, len(self.text) - self.hold)
        hits = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None
