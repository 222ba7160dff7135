"""Load and save models in the Hugging Face layout.

A model directory holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``) with its shards.
Each rank reads only its slice of every split tensor (``safetensors`` slices, no full copy): the
attention projections' slice of its attention-TP group, the MLP's and the vocabulary's slice of
the world (see ``workers.model.parallel``); a vocabulary that does not split evenly is padded with
zero rows.
Weights are converted to ``dtype`` (float32 by default) on load; ``save_pretrained`` writes
bfloat16 by default.

Errors name what is wrong: ``FileNotFoundError`` for a missing directory, ``config.json`` or
weights file; ``CheckpointError`` (a ``ValueError``) for unreadable JSON, a corrupt safetensors
file, a missing tensor or a shape mismatch; ``ValueError`` for an unsupported architecture.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from workers.model.config import EagleConfig, LlamaConfig
from workers.model.eagle import EagleHead
from workers.model.layers import Shard, shard_specs
from workers.model.llama import LlamaForCausalLM
from workers.model.parallel import ModelParallel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint directory exists but its contents cannot be used."""


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of the model directory ``path``."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(root)!r} does not exist (or is not a directory)")
    cfg_path = root / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"model directory {str(root)!r} has no {CONFIG_FILE}")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{str(cfg_path)!r} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(cfg_path)!r} holds {type(raw).__name__}; expected a JSON object")
    return raw


class _Checkpoint:
    """The tensors of one model directory, by name, across one or several safetensors files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = self._weight_map(root)
        self._handles: dict[str, Any] = {}

    @staticmethod
    def _weight_map(root: Path) -> dict[str, str]:
        index = root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"{str(index)!r} is not a valid index (need 'weight_map'): {err!r}") from None
            return dict(weight_map)
        single = root / SINGLE_FILE
        if not single.is_file():
            raise FileNotFoundError(f"model directory {str(root)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        return {name: SINGLE_FILE for name in _open(single).keys()}

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            path = self.root / file
            if not path.is_file():
                raise FileNotFoundError(f"safetensors shard {str(path)!r} (named in {INDEX_FILE}) is missing")
            self._handles[file] = _open(path)
        return self._handles[file]

    def read(self, name: str, shape: tuple[int, ...], shard: Shard | None) -> torch.Tensor:
        """Tensor ``name`` of full shape ``shape``: this rank's part when it is split."""
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} is missing from checkpoint {str(self.root)!r}")
        file = self.files[name]
        try:
            view = self._handle(file).get_slice(name)
            found = tuple(view.get_shape())
        except SafetensorError as err:
            raise CheckpointError(f"cannot read tensor {name!r} from {str(self.root / file)!r}: {err}") from None
        if found != shape:
            raise CheckpointError(
                f"tensor {name!r} in {str(self.root / file)!r} has shape {list(found)}; expected {list(shape)}")
        return _read_slice(view, shard, f"{name!r} in {str(self.root / file)!r}")


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{str(path)!r} is not a readable safetensors file: {err}") from None


def _read_slice(view: Any, shard: Shard | None, what: str) -> torch.Tensor:
    try:
        if shard is None or shard.group.size == 1:
            return view[:]
        lo = shard.group.rank * shard.part
        hi = min(lo + shard.part, shard.full)
        part = view[lo:hi] if shard.dim == 0 else view[:, lo:hi]
    except SafetensorError as err:
        raise CheckpointError(f"cannot read tensor {what}: {err}") from None
    missing = shard.part - part.shape[shard.dim]
    if missing:  # the last parts of a vocabulary that does not split evenly: zero rows
        pad = [0, 0] * (part.dim() - 1 - shard.dim) + [0, missing]
        part = torch.nn.functional.pad(part, pad)
    return part


def _load_into(module: nn.Module, ckpt: _Checkpoint) -> None:
    specs = shard_specs(module)
    with torch.no_grad():
        for name, param in module.named_parameters():
            shard = specs.get(name)
            shape = list(param.shape)
            if shard is not None:
                shape[shard.dim] = shard.full
            param.copy_(ckpt.read(name, tuple(shape), shard))


def _materialize(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    module.to_empty(device=device)
    module.to(dtype)


def load_llama(path: str | Path, par: ModelParallel | None = None,
               dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Load a Hugging Face Llama directory; this rank keeps its shards only (``par``)."""
    cfg = LlamaConfig.from_hf(read_config(path))
    ckpt = _Checkpoint(Path(path))
    par = par if par is not None else ModelParallel.single(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, par)
    _materialize(model, device, dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _load_into(model, ckpt)
    model.reset_buffers()
    return model.eval()


def load_eagle(path: str | Path, target: LlamaForCausalLM, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> EagleHead:
    """Load an EAGLE head directory for ``target`` (split like the target; dtype/device default to
    the target's)."""
    cfg = EagleConfig.from_hf(read_config(path))
    ckpt = _Checkpoint(Path(path))
    ref = target.lm_head.weight
    with torch.device("meta"):
        head = EagleHead(cfg, target)
    _materialize(head, device or ref.device, dtype or ref.dtype)
    _load_into(head, ckpt)
    head.reset_buffers()
    return head.eval()


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shard and max_bytes is not None and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    if shard:
        yield shard


def save_pretrained(model: LlamaForCausalLM | EagleHead, path: str | Path,
                    dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the weights (one file, or shards of at most ``max_shard_bytes``
    with an index). Only a tp=1 model can be saved (every tensor is whole)."""
    par = model.target.par if isinstance(model, EagleHead) else model.par
    if par.mlp.size != 1:
        raise ValueError(f"save_pretrained needs a one-rank model; this one is split over "
                         f"{par.mlp.size} ranks")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [root / SINGLE_FILE, root / INDEX_FILE, *root.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    tensors = {n: p.detach().to("cpu", dtype).contiguous() for n, p in model.named_parameters()}
    cfg = model.config.to_hf()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (root / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    shards = list(_shards(tensors, max_shard_bytes))
    if len(shards) == 1:
        save_file(shards[0], str(root / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
