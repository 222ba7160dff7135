"""flashinfer attention backend (CUDA only) for the ragged forwards (prefills beyond
``padded_prefill_tokens``); the padded forwards of the round run the static backend.

- ``ForwardMode.DECODE`` (one new token per request): ``BatchDecodeWithPagedKVCacheWrapper``.
- ``EXTEND``, ``VERIFY``, ``DRAFT_EXTEND``: ``BatchPrefillWithPagedKVCacheWrapper`` with
  ``causal=True``; flashinfer aligns a request's queries with the end of its KV, which is the
  contract of ``workers.attention.base``. ``forward_last``: the same wrapper, one query per request.

Both read ``KVPool``'s cache in place (``NHD``, through the CSR page table). flashinfer takes
float16/bfloat16 only and a head dim of at least 64, so the backend asks for caches of
``max(64, head_dim)`` zero-padded channels (``kv_format``); zero channels change no score, and
``sm_scale`` is the real head dim's. Prefill is pinned to fa2. flashinfer is imported when the
backend is built; its first use JIT-compiles the kernels (about 10 s decode, 80 s prefill on
an H200) into ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention.base import AttnMetadata, ForwardMode, padded_forward, padded_last
from workers.kv_cache import KVPool, pages_for

MIN_HEAD_DIM = 64
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
WORKSPACE_BYTES = 128 * 1024 * 1024


def storage_head_dim(head_dim: int) -> int:
    """Channels per KV head in a flashinfer cache: `head_dim` padded up to a supported size."""
    for size in (64, 128, 256):
        if head_dim <= size:
            return size
    raise ValueError(f"flashinfer backend: head_dim={head_dim} is larger than 256; use --attention-backend torch")


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The KV (and kernel) dtype: the model's when flashinfer takes it, else float16."""
    return dtype if dtype in KERNEL_DTYPES else torch.float16


def pad_heads(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x` [T, H, D] with zero channels appended up to `size`."""
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


class FlashInferBackend:
    """Holds the workspace and one decode and one prefill wrapper, shared by every forward."""

    name = "flashinfer"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        import flashinfer  # lazily: only GPU runs need it

        self.device = torch.device(device)
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                      backend="fa2")
        # what each wrapper is planned for now: (the forward, last tokens only, heads, head dim)
        self.planned: dict[str, tuple] = {}

    @staticmethod
    def kv_format(head_dim: int, dtype: torch.dtype) -> tuple[int, torch.dtype]:
        """(channels per KV head, dtype) the worker must give this backend's caches."""
        return storage_head_dim(head_dim), storage_dtype(dtype)

    def plan(self, meta: AttnMetadata, cache: KVPool) -> "FlashInferAttention":
        """Prepare one forward over `cache` described by `meta` (planned at its first layer)."""
        if cache.head_dim < MIN_HEAD_DIM or cache.dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"flashinfer backend: the KV cache has head_dim={cache.head_dim} and dtype "
                f"{cache.k[0].dtype}; it needs the format of FlashInferBackend.kv_format "
                "(build the worker with this backend)")
        return FlashInferAttention(self, meta, cache)


def _host_i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


class FlashInferAttention:
    """The per-forward attention callable (`attn.forward(layer_id, q, k, v)`)."""

    def __init__(self, backend: FlashInferBackend, meta: AttnMetadata, cache: KVPool) -> None:
        self.backend, self.meta, self.cache = backend, meta, cache
        self.decode = meta.mode is ForwardMode.DECODE
        if self.decode and any(n != 1 for n in meta.host_qo_lens):
            raise ValueError(f"decode forward with {meta.host_qo_lens} new tokens per request")

    def _wrapper(self, last: bool, num_q_heads: int, head_dim: int) -> object:
        """The wrapper for this forward's queries (`last`: each request's last new token only:
        the prefill wrapper with one query per request, aligned with the end of its KV), planned
        unless it already is (host-side indptrs, so no device-to-host sync). The wrappers are the
        backend's: a forward's layers run before the next forward plans (the worker runs them
        in order), and a head's last layer may re-plan the prefill wrapper for its last tokens."""
        backend, meta, cache = self.backend, self.meta, self.cache
        name = "decode" if self.decode and not last else "prefill"
        wrapper = getattr(backend, name)
        key = (self, last, num_q_heads, head_dim)
        if backend.planned.get(name) == key:
            return wrapper
        ps, seq = meta.page_size, meta.host_seq_lens
        kv_indptr = [0]
        for s in seq:
            kv_indptr.append(kv_indptr[-1] + pages_for(s, ps))
        last_page = [(s - 1) % ps + 1 for s in seq]
        indices = meta.kv_page_indices[:kv_indptr[-1]]
        dtype = cache.k[0].dtype
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=head_dim ** -0.5)
        if name == "decode":
            wrapper.plan(_host_i32(kv_indptr), indices, _host_i32(last_page), num_q_heads,
                         cache.num_kv_heads, cache.head_dim, ps, **common)
        else:
            qo_indptr = [0]
            for n in ([1] * len(seq) if last else meta.host_qo_lens):
                qo_indptr.append(qo_indptr[-1] + n)
            wrapper.plan(_host_i32(qo_indptr), _host_i32(kv_indptr), indices,
                         _host_i32(last_page), num_q_heads, cache.num_kv_heads, cache.head_dim,
                         ps, causal=True, **common)
        backend.planned[name] = key
        return wrapper

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Store this layer's new K/V, then attention of `q` [T, Hq, D] -> [T, Hq, D]."""
        return padded_forward(self.meta.num_tokens, q, k, v,
                              lambda q, k, v: self._attend(layer_id, q, k, v, False))

    def forward_last(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        """Store this layer's new K/V, then attention of each request's last new token (`q`
        [R, Hq, D], request order) over its whole sequence -> [R, Hq, D]."""
        return padded_last(self.meta, q, k, v,
                           lambda k, v: self.cache.write(layer_id, self.meta.out_slots, k, v),
                           lambda q: self._attend(layer_id, q, None, None, True))

    def _attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor | None,
                v: torch.Tensor | None, last: bool) -> torch.Tensor:
        cache, size = self.cache, self.cache.head_dim
        head_dim = q.shape[-1]
        if k is not None:
            cache.write(layer_id, self.meta.out_slots, k, v)
        wrapper = self._wrapper(last, q.shape[1], head_dim)
        query = pad_heads(q, size).to(cache.k[layer_id].dtype).contiguous()
        out = wrapper.run(query, (cache.k[layer_id], cache.v[layer_id]))
        return out[..., :head_dim].to(q.dtype)
