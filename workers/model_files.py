"""Which directories `--model` / `--draft-model` name, and the small JSON files of a model
directory that need no torch (the HTTP frontend reads them too).

* neither flag: the bundled pair (`workers/assets/tiny_pair/target` and `.../eagle`);
* `--model DIR` where `DIR/target` exists: the shorthand pair `DIR/target` + `DIR/eagle`;
* `--model DIR` (a model directory itself): the target; `--draft-model DRAFT_DIR` the draft head
  (without one only `--no-spec` can run).

`generation_config.json` wins over `config.json` for the end-of-sequence ids, as it does in
Hugging Face's `generate`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
BUNDLED = Path(__file__).resolve().parent / "assets" / "tiny_pair"


@dataclass(frozen=True)
class ModelPaths:
    """The target directory and the draft head directory (None: no head available)."""

    target: Path
    draft: Optional[Path]

    @staticmethod
    def resolve(model: Optional[str | Path], draft: Optional[str | Path] = None) -> "ModelPaths":
        """The directories the flags name (see the module docstring); `ValueError` naming the
        flag when a directory does not exist."""
        if model is None:
            if draft is not None:
                raise ValueError("--draft-model needs --model (the target it drafts for)")
            return ModelPaths(BUNDLED / "target", BUNDLED / "eagle")
        root = Path(model)
        if not root.is_dir():
            raise ValueError(f"--model: directory {str(root)!r} does not exist")
        if draft is not None and not Path(draft).is_dir():
            raise ValueError(f"--draft-model: directory {str(draft)!r} does not exist")
        if (root / "target").is_dir():  # the shorthand: DIR/target and DIR/eagle
            eagle = root / "eagle"
            return ModelPaths(root / "target", Path(draft) if draft is not None
                              else eagle if eagle.is_dir() else None)
        return ModelPaths(root, Path(draft) if draft is not None else None)

    def describe(self) -> str:
        """One line naming both directories (for messages)."""
        return f"target {str(self.target)!r}, draft {str(self.draft) if self.draft else 'none'}"


def read_json(path: Path, required: bool = True) -> Optional[dict[str, Any]]:
    """The JSON object in `path` (None when it is absent and not `required`); `ValueError`
    naming the file when it is not a JSON object."""
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{str(path)!r} does not exist")
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{str(path)!r} holds {type(raw).__name__}; expected a JSON object")
    return raw


def token_ids(value: Any, key: str, path: Path) -> tuple[int, ...]:
    """`value` of `key` (None, one id or a list of ids) as a tuple; `ValueError` otherwise."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ValueError(f"{str(path)!r}: key {key!r} is {value!r}; allowed: null, an id >= 0 "
                         f"or a list of ids")
    return tuple(items)


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """End-of-sequence ids: `generation_config.json`'s `eos_token_id` when it gives one, else
    `config.json`'s (either may be one id or a list)."""
    gen = read_json(model_dir / GENERATION_CONFIG_FILE, required=False)
    if gen is not None and gen.get("eos_token_id") is not None:
        return token_ids(gen["eos_token_id"], "eos_token_id", model_dir / GENERATION_CONFIG_FILE)
    cfg = read_json(model_dir / CONFIG_FILE, required=False) or {}
    return token_ids(cfg.get("eos_token_id"), "eos_token_id", model_dir / CONFIG_FILE)


def bos_token_id(model_dir: Path) -> Optional[int]:
    """`config.json`'s `bos_token_id` (None when absent)."""
    cfg = read_json(model_dir / CONFIG_FILE, required=False) or {}
    ids = token_ids(cfg.get("bos_token_id"), "bos_token_id", model_dir / CONFIG_FILE)
    if len(ids) > 1:
        raise ValueError(f"{str(model_dir / CONFIG_FILE)!r}: key 'bos_token_id' is "
                         f"{cfg['bos_token_id']!r}; allowed: null or one id")
    return ids[0] if ids else None
