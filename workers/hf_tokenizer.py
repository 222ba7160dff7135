"""A model directory's `tokenizer.json` through the `tokenizers` library (no torch).

BOS: when `tokenizer_config.json` sets `add_bos_token`, that decides (BOS is the config's
`bos_token_id`, else the id of `tokenizer_config.json`'s `bos_token`); otherwise the tokenizer's
own post-processor decides (Llama-3's template adds `<|begin_of_text|>`, Qwen's adds nothing).
EOS: `generation_config.json`, else `config.json`, else `tokenizer_config.json`'s `eos_token`.
Decoding drops special tokens (unless asked to keep them) and ids the tokenizer does not know (a
model's vocabulary may be padded beyond the tokenizer's).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from workers.model_files import (TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, bos_token_id,
                                  eos_token_ids, read_json)


def _token_text(value: Any) -> Optional[str]:
    """A `tokenizer_config.json` special-token entry: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """Implements `workers.tokenizer.Tokenizer` over a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Any, bos_token_id: Optional[int], eos_token_ids: tuple[int, ...],
                 add_bos: Optional[bool]) -> None:
        self._tok = tokenizer
        self.bos_token_id, self.eos_token_ids, self.add_bos = bos_token_id, eos_token_ids, add_bos
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def from_dir(root: Path) -> "HFTokenizer":
        """Load `root/tokenizer.json` and the BOS/EOS settings of `root` (see the module
        docstring); `ValueError` naming the file when it cannot be used."""
        from tokenizers import Tokenizer

        path = root / TOKENIZER_FILE
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # the library raises a plain Exception for any bad file
            raise ValueError(f"{str(path)!r} is not a usable tokenizer.json: {err}") from None
        config = read_json(root / TOKENIZER_CONFIG_FILE, required=False) or {}
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ValueError(f"{str(root / TOKENIZER_CONFIG_FILE)!r}: key 'add_bos_token' is "
                             f"{add_bos!r}; allowed: true, false or absent")
        bos = bos_token_id(root)
        if bos is None:
            bos = _special_id(tok, config, "bos_token")
        eos = eos_token_ids(root)
        if not eos:
            found = _special_id(tok, config, "eos_token")
            eos = (found,) if found is not None else ()
        if add_bos and bos is None:
            raise ValueError(f"{str(root / TOKENIZER_CONFIG_FILE)!r} sets add_bos_token, but "
                             f"neither config.json nor tokenizer_config.json names a BOS token")
        return HFTokenizer(tok, bos, eos, add_bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        if self.add_bos is None:
            return list(self._tok.encode(text, add_special_tokens=True).ids)
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        return [self.bos_token_id] + ids if self.add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _special_id(tok: Any, config: dict, key: str) -> Optional[int]:
    text = _token_text(config.get(key))
    return tok.token_to_id(text) if text is not None else None
