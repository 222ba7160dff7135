"""Attention backends over the paged KV cache.

`base` holds the `AttentionBackend` protocol and the two kinds of per-forward metadata (ragged
`AttnMetadata` built by `build_metadata`; padded `PaddedBatch`). Ragged forwards (prefill) run
`torch_backend` (the plain-torch reference, CPU and GPU) or `flashinfer_backend` (GPU, imported
only when asked for), chosen by name with `make_backend`; padded forwards (the speculative round,
eager or in CUDA graphs) run `static_backend`.

The names below load on first use (PEP 562, as in `collectives`), so `BACKENDS` (the choices of
`--attention-backend`) comes without torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.attention.base import (
        AttentionBackend,
        AttnMetadata,
        ForwardMode,
        LayerAttention,
        PaddedBatch,
        build_metadata,
    )
    from workers.attention.static_backend import StaticBackend

BACKENDS = ("torch", "flashinfer")
"""The attention backends of the ragged forwards (prefill), by name (`make_backend`,
`EngineConfig.attention_backend`, `--attention-backend`)."""

_LAZY = {
    **dict.fromkeys(("AttentionBackend", "AttnMetadata", "ForwardMode", "LayerAttention",
                     "PaddedBatch", "build_metadata"), "workers.attention.base"),
    "StaticBackend": "workers.attention.static_backend",
}


def make_backend(name: str, device: "object") -> "AttentionBackend":
    """Return the attention backend called `name` for `device`; clear errors for the rest."""
    import torch

    if name not in BACKENDS:
        raise ValueError(f"--attention-backend: unknown attention backend {name!r}; allowed: "
                         f"{', '.join(BACKENDS)}")
    if name == "torch":
        from workers.attention.torch_backend import TorchBackend

        return TorchBackend()
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            "--attention-backend: 'flashinfer' needs a CUDA GPU, and none is available here "
            f"(device {device!s}); use --attention-backend torch")
    try:
        from workers.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)  # imports flashinfer itself
    except ImportError as err:
        raise ValueError(f"--attention-backend: 'flashinfer' is not available ({err}); use "
                         f"--attention-backend torch") from err


__all__ = ["AttentionBackend", "AttnMetadata", "ForwardMode", "LayerAttention", "PaddedBatch",
           "StaticBackend", "build_metadata", "make_backend", "BACKENDS"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'workers.attention' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
