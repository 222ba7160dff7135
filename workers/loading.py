"""Library helpers shared by the commands (`generate`, `serve`) and the scripts: the bundled model
pair, loading a pair split over a cluster (`--model` / `--draft-model`, see
`workers.model_files.ModelPaths`), its tokenizer, prompt files and prompt encoding.

A prompts file is JSON lines, one object per prompt: `{"prompt": "<text>"}`, optionally with
`"dp_rank": k` to pin it to DP replica `k`. Unpinned prompts are spread round-robin: prompt `i`
(counting every prompt of the file) goes to replica `i % dp`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from workers.model_files import BUNDLED as DEFAULT_MODEL  # the bundled tiny pair (its one name)

if TYPE_CHECKING:
    from workers.model_files import ModelPaths
    from workers.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL", "DTYPES", "Prompt", "read_prompts", "assign_replicas",
           "encode_prompt", "model_digest", "pair_digest", "model_paths", "load_pair",
           "load_models", "load_tokenizer_for", "check_tokenizer", "resolve_dtype"]


DTYPES = ("auto", "bfloat16", "float16", "float32")
"""The weights' (and so the KV cache's) dtype a pair loads in (`resolve_dtype`, `--dtype`)."""


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
    """Byte ids of `text`, preceded by the model's BOS id when it has one (the bundled pair's
    tokenizer; `load_tokenizer(...).encode` is the general way)."""
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


def pair_digest(paths: "ModelPaths") -> str:
    """`model_digest` of the target and the draft directory together."""
    parts = [model_digest(paths.target), model_digest(paths.draft) if paths.draft else "-"]
    return hashlib.sha256(":".join(parts).encode()).hexdigest()[:16]


def model_paths(model: Optional[str | Path], draft: Optional[str | Path] = None) -> "ModelPaths":
    """The target and draft directories `--model` / `--draft-model` name (see
    `workers.model_files.ModelPaths`)."""
    from workers.model_files import ModelPaths

    return ModelPaths.resolve(model, draft)


def load_pair(root: Optional[str | Path], par: Any = None, device: str = "cpu",
              with_head: bool = True, draft: Optional[str | Path] = None,
              dtype: Any = None) -> tuple[Any, Optional[Any]]:
    """Load the target (and its draft head) that `root` (`--model`) and `draft`
    (`--draft-model`) name, this rank's shards of them (`par`: a `ModelParallel`, default one
    process; `dtype`: default float32); errors name the missing or broken file."""
    return load_models(model_paths(root, draft), par, device, with_head, dtype, model_flag=root)


def load_models(paths: "ModelPaths", par: Any = None, device: str = "cpu", with_head: bool = True,
                dtype: Any = None, model_flag: Optional[str | Path] = None
                ) -> tuple[Any, Optional[Any]]:
    """`load_pair` of directories already resolved (`model_flag`: the `--model` value, named
    when the pair has no draft head)."""
    import torch

    from workers.model import load_eagle, load_llama

    target = load_llama(paths.target, par=par, device=device, dtype=dtype or torch.float32)
    if not with_head:
        return target, None
    if paths.draft is None:
        raise ValueError(f"--model {str(model_flag)!r} has no draft head (no eagle/ beside "
                         f"target/); give --draft-model DRAFT_DIR, or run --no-spec")
    return target, load_eagle(paths.draft, target)


def resolve_dtype(flag: str, device: str, paths: "ModelPaths") -> tuple[Any, str]:
    """(torch dtype, why) of `--dtype flag` on `device` for the pair `paths` names: auto is the
    checkpoint's own dtype (config.json's `torch_dtype`; float32 when it names none) on CUDA, as
    vLLM's and SGLang's `--dtype auto`, and float32 on the CPU (the bundled pair and the CPU
    tests run float32). `ValueError` naming the flag for a dtype this GPU lacks."""
    import torch

    from workers.model.loader import checkpoint_dtype

    if flag not in DTYPES:
        raise ValueError(f"--dtype {flag}: allowed: {', '.join(DTYPES)}")
    if flag != "auto":
        dtype, why = getattr(torch, flag), f"--dtype {flag}"
    elif device != "cuda":
        dtype, why = torch.float32, "--dtype auto on the CPU"
    else:
        stored = checkpoint_dtype(paths.target)
        dtype, why = ((stored, "--dtype auto: the checkpoint's torch_dtype") if stored is not None
                      else (torch.float32, "--dtype auto: the checkpoint names no torch_dtype"))
    if device == "cuda" and dtype == torch.bfloat16 and torch.cuda.is_available() \
            and not torch.cuda.is_bf16_supported():
        raise ValueError(f"--dtype {flag}: bfloat16 ({why.split(': ')[-1]}) is not supported by "
                         f"this GPU; give --dtype float16 or float32")
    return dtype, why


def load_tokenizer_for(paths: "ModelPaths", vocab_size: Optional[int] = None) -> "Tokenizer":
    """The target's tokenizer (`workers.tokenizer.load_tokenizer`), checked against the model's
    vocabulary when `vocab_size` is given (`check_tokenizer`)."""
    from workers.tokenizer import load_tokenizer

    tok = load_tokenizer(paths.target)
    if vocab_size is not None:
        check_tokenizer(tok, paths, vocab_size)
    return tok


def check_tokenizer(tok: "Tokenizer", paths: "ModelPaths", vocab_size: int) -> None:
    """`ValueError` naming the file when the target's tokenizer `tok` produces ids the model
    (`vocab_size`) does not have."""
    from workers.model_files import CONFIG_FILE
    from workers.model_files import TOKENIZER_FILE

    where = paths.target / (TOKENIZER_FILE if (paths.target / TOKENIZER_FILE).is_file()
                            else CONFIG_FILE)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"{str(where)!r}: the tokenizer has {tok.vocab_size} tokens, the "
                         f"model's vocab_size is {vocab_size}")
    special = [i for i in (tok.bos_token_id, *tok.eos_token_ids) if i is not None]
    if any(i >= vocab_size for i in special):
        raise ValueError(f"{str(where)!r}: BOS/EOS ids {special} reach beyond the model's "
                         f"vocab_size {vocab_size}")
