"""Library helpers shared by the commands (`generate`, `serve`) and the scripts: the bundled model
pair, loading a pair split over a cluster, prompt files and prompt encoding.

A prompts file is JSON lines, one object per prompt: `{"prompt": "<text>"}`, optionally with
`"dp_rank": k` to pin it to DP replica `k`. Unpinned prompts are spread round-robin: prompt `i`
(counting every prompt of the file) goes to replica `i % dp`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "tiny_pair"


@dataclass(frozen=True)
class Prompt:
    """One prompt of a prompts file (`dp_rank` None: spread round-robin)."""

    text: str
    dp_rank: Optional[int] = None


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of a JSON-lines file, in order; `ValueError` naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts: file {str(path)!r} does not exist")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f'{path}:{n}: expected an object {{"prompt": "<text>"}}')
        unknown = sorted(set(obj) - {"prompt", "dp_rank"})
        if unknown:
            raise ValueError(f"{path}:{n}: unknown key(s) {unknown}; allowed: prompt, dp_rank")
        rank = obj.get("dp_rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"{path}:{n}: 'dp_rank'={rank!r} must be an integer >= 0")
        if obj["prompt"] == "":
            raise ValueError(f"{path}:{n}: the prompt is empty; give at least one character")
        out.append(Prompt(obj["prompt"], rank))
    if not out:
        raise ValueError(f"{path}: no prompts in the file")
    return out


def assign_replicas(prompts: list[Prompt], dp: int) -> list[int]:
    """The DP replica of every prompt: its `dp_rank`, else `index % dp`."""
    out = []
    for i, p in enumerate(prompts):
        if p.dp_rank is not None and p.dp_rank >= dp:
            raise ValueError(f"prompt {i}: dp_rank {p.dp_rank} is outside the {dp} DP replicas "
                             f"(0..{dp - 1})")
        out.append(p.dp_rank if p.dp_rank is not None else i % dp)
    return out


def encode_prompt(text: str, config: Any) -> list[int]:
    """Byte ids of `text`, preceded by the model's BOS id when it has one."""
    from workers import tokenizer

    ids = tokenizer.encode(text)
    return ([config.bos_token_id] if config.bos_token_id is not None else []) + ids


def model_digest(root: str | Path) -> str:
    """A short fingerprint of a model directory (its config files and weight file names and
    sizes): ranks compare it at start-up to make sure they load the same model."""
    root = Path(root)
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = str(path.relative_to(root))
        h.update(rel.encode())
        h.update(path.read_bytes() if path.suffix == ".json" else str(path.stat().st_size).encode())
    return h.hexdigest()[:16]


def load_pair(root: str | Path, par: Any = None, device: str = "cpu",
              with_head: bool = True) -> tuple[Any, Optional[Any]]:
    """Load `root/target` (and `root/eagle`), this rank's shards of them (`par`: a
    `ModelParallel`, default one process); errors name the missing or broken file."""
    from workers.model import load_eagle, load_llama

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--model: directory {str(root)!r} does not exist")
    target = load_llama(root / "target", par=par, device=device)
    head = load_eagle(root / "eagle", target) if with_head else None
    return target, head
