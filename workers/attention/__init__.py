"""Attention backends over the paged KV cache.

`base` holds the backend-neutral per-forward metadata (`AttnMetadata`, built by `build_metadata`)
and the `AttentionBackend` protocol; `torch_backend` is the plain-torch reference (CPU and GPU),
`flashinfer_backend` the GPU one (imported only when asked for).
"""
from workers.attention.base import (
    AttentionBackend,
    AttnMetadata,
    ForwardMode,
    MetadataBuffers,
    build_metadata,
)

BACKENDS = ("torch", "flashinfer")


def make_backend(name: str, device: "object") -> AttentionBackend:
    """Return the attention backend called `name` for `device`; clear errors for the rest."""
    import torch

    if name not in BACKENDS:
        raise ValueError(f"backend: unknown attention backend {name!r}; allowed: {', '.join(BACKENDS)}")
    if name == "torch":
        from workers.attention.torch_backend import TorchBackend

        return TorchBackend()
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            "backend: 'flashinfer' needs a CUDA GPU, and none is available here "
            f"(device {device!s}); use --backend torch")
    try:
        from workers.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)  # imports flashinfer itself
    except ImportError as err:
        raise ValueError(f"backend: 'flashinfer' is not available ({err}); use --backend torch") from err


__all__ = ["AttentionBackend", "AttnMetadata", "ForwardMode", "MetadataBuffers", "build_metadata",
           "make_backend", "BACKENDS"]
