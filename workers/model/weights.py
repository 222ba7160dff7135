"""The weight tensors of one model directory, by name, whatever files hold them.

Formats, in the order they are looked for (the first present wins, as Hugging Face does):
``model.safetensors.index.json`` (``{"weight_map": {tensor: shard file}}``) with its shards,
``model.safetensors``, ``pytorch_model.bin.index.json`` with its shards, ``pytorch_model.bin``.
Safetensors files are read lazily, slice by slice (no full copy); ``.bin`` files are loaded with
``torch.load(weights_only=True)`` (memory-mapped when the file allows it), never unpickling code.

``read(name, shape, shard)`` returns this rank's part of a tensor split by a ``Shard`` (rows or
columns of its group's slice; a vocabulary that does not split evenly is padded with zero rows).
Every error names the file and the tensor: ``FileNotFoundError`` for a missing weights file or
shard, ``CheckpointError`` (a ``ValueError``) for an unreadable file, a missing tensor or a shape
that is not the expected one.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open

from workers.model.layers import Shard

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
FORMATS = (INDEX_FILE, SINGLE_FILE, BIN_INDEX_FILE, BIN_FILE)


class CheckpointError(ValueError):
    """A checkpoint directory exists but its contents cannot be used."""


class _SafetensorsFile:
    """One safetensors file, read slice by slice."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{str(path)!r} is not a readable safetensors file: {err}") from None

    def names(self) -> list[str]:
        return list(self.handle.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        try:
            return tuple(self.handle.get_slice(name).get_shape())
        except SafetensorError as err:
            raise CheckpointError(f"cannot read tensor {name!r} from {str(self.path)!r}: {err}") from None

    def part(self, name: str, dim: int, lo: Optional[int], hi: Optional[int]) -> torch.Tensor:
        try:
            view = self.handle.get_slice(name)
            if lo is None:
                return view[:]
            return view[lo:hi] if dim == 0 else view[:, lo:hi]
        except SafetensorError as err:
            raise CheckpointError(f"cannot read tensor {name!r} from {str(self.path)!r}: {err}") from None


class _TorchFile:
    """One ``pytorch_model.bin`` (a state dict), loaded without unpickling code."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors = _torch_load(path)

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def part(self, name: str, dim: int, lo: Optional[int], hi: Optional[int]) -> torch.Tensor:
        t = self.tensors[name]
        if lo is None:
            return t
        return t[lo:hi] if dim == 0 else t[:, lo:hi]


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        try:
            raw = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:  # a legacy (non-zip) file cannot be memory-mapped
            if "mmap" not in str(err):
                raise
            raw = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds (UnpicklingError, EOFError, RuntimeError)
        raise CheckpointError(f"{str(path)!r} is not a readable PyTorch weights file (loaded "
                              f"with weights_only=True): {type(err).__name__}: {err}") from None
    if not isinstance(raw, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in raw.items()):
        raise CheckpointError(f"{str(path)!r} does not hold a state dict (tensor names to tensors)")
    return raw


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("'weight_map' must map tensor names to file names")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{str(path)!r} is not a valid index (need 'weight_map'): {err!r}") from None
    return dict(weight_map)


class WeightFiles:
    """The tensors of the model directory ``root`` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._files: dict[str, Any] = {}
        self.format, self.weight_map = self._discover()

    def _discover(self) -> tuple[str, dict[str, str]]:
        for fmt in FORMATS:
            path = self.root / fmt
            if not path.is_file():
                continue
            if fmt in (INDEX_FILE, BIN_INDEX_FILE):
                return fmt, _read_index(path)
            return fmt, {name: fmt for name in self._file(fmt).names()}
        raise FileNotFoundError(f"model directory {str(self.root)!r} has neither "
                                f"{' nor '.join(FORMATS[1::-1] + FORMATS[:1:-1])}")

    def _file(self, name: str) -> Any:
        if name not in self._files:
            path = self.root / name
            if not path.is_file():
                raise FileNotFoundError(f"weights shard {str(path)!r} (named in {self.format}) "
                                        f"is missing")
            kind = _SafetensorsFile if name.endswith(".safetensors") else _TorchFile
            self._files[name] = kind(path)
        return self._files[name]

    @property
    def names(self) -> set[str]:
        """Every tensor name the checkpoint holds."""
        return set(self.weight_map)

    def where(self, name: str) -> str:
        """The file holding tensor ``name`` (for messages)."""
        return str(self.root / self.weight_map.get(name, self.format))

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor ``name``."""
        self._require(name)
        return self._file(self.weight_map[name]).shape(name)

    def _require(self, name: str) -> None:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is missing from checkpoint {str(self.root)!r} "
                                  f"({self.format})")

    def read(self, name: str, shape: tuple[int, ...], shard: Optional[Shard]) -> torch.Tensor:
        """Tensor ``name``, whose full shape must be ``shape``: this rank's part when it is split."""
        found = self.shape(name)
        if found != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {self.where(name)!r} has shape "
                                  f"{list(found)}; expected {list(shape)}")
        file = self._file(self.weight_map[name])
        if shard is None or shard.group.size == 1:
            return file.part(name, 0, None, None)
        lo = shard.group.rank * shard.part
        part = file.part(name, shard.dim, lo, min(lo + shard.part, shard.full))
        missing = shard.part - part.shape[shard.dim]
        if missing:  # the last parts of a vocabulary that does not split evenly: zero rows
            pad = [0, 0] * (part.dim() - 1 - shard.dim) + [0, missing]
            part = torch.nn.functional.pad(part, pad)
        return part
