"""Text of the frontend: prompt encoding, and a completion's text emitted in stable pieces and cut
at the first stop string.

``ByteCodec`` is the one place that knows the tokenizer (the bundled pair's byte tokenizer through
``workers.loading.encode_prompt`` and ``workers.tokenizer``). ``TextStream`` decodes a growing
list of token ids: a trailing incomplete UTF-8 sequence, and the last ``len(longest stop) - 1``
characters (which may be the start of a stop string), are held back until they are settled, so
every emitted piece is final and the concatenation equals the non-streamed text.
"""
from __future__ import annotations

import codecs
from types import SimpleNamespace
from typing import Optional, Sequence


class ByteCodec:
    """Prompt text -> ids (with the model's BOS) and ids -> text, for the byte tokenizer."""

    def __init__(self, bos_token_id: Optional[int]) -> None:
        from workers.loading import encode_prompt
        from workers import tokenizer

        self._encode_prompt, self._tok = encode_prompt, tokenizer
        self._config = SimpleNamespace(bos_token_id=bos_token_id)

    def encode(self, text: str) -> list[int]:
        return self._encode_prompt(text, self._config)

    def decode(self, ids: Sequence[int], final: bool = True) -> str:
        """The text of `ids`; with `final` False an incomplete trailing character is left out."""
        if final:
            return self._tok.decode(list(ids))
        data = bytes(i for i in ids if not self._tok.is_special(i))
        return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)


class TextStream:
    """One completion's text as tokens arrive; see the module docstring."""

    def __init__(self, codec: ByteCodec, stops: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""              # emitted so far
        self.stopped = False        # a stop string was found (the text is cut before it)

    def feed(self, token_ids: Sequence[int], final: bool) -> str:
        """Add tokens; return the newly settled text (everything left when `final`)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        full = self.codec.decode(self.token_ids, final=final)
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
