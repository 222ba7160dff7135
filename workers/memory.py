"""The memory of one engine: the KV pool sized to what a user budgets, and the split of what
start-up used (weights, KV cache, CUDA graphs, activations, the rest, free).

Sizing the KV pool (`plan_kv_pages`), one rank's pools (the target's and, when speculating, the
head's; every pool has the same number of pages, page 0 the dummy page):

- default: room for `max_batch_size` requests of the full context (`EngineConfig.num_pages`
  None). A larger pool could hold nothing more, since the batch caps the requests running.
- `--kv-cache-memory BYTES` (CPU and CUDA): the pages that fit in BYTES, at most the default.
- `--gpu-memory-utilization F` (CUDA only): this process may use F x the GPU's total memory. What
  is left after the weights, the activations (measured: the largest forwards run once, eagerly,
  on a worker with a two-page pool: `profile_engine`), the CUDA graphs (estimated before they
  are captured, since their bodies hold the pool's addresses: the captures the worker will make,
  counted on that worker without running them, times `GRAPH_BYTES_PER_CAPTURE`) and the memory
  outside torch's allocator that start-up added (cuBLAS, NCCL, kernels) goes to the KV pool, at
  most the default.

A pool that cannot hold one request of the full context is refused, naming the flag. The ranks
take the smallest pool any of them can hold (`agree_pages`), so every rank runs the same
`EngineConfig`. The CUDA context the process created before loading is outside the budget
(about 0.5 GiB on an H200), as in vLLM.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from workers.startup_log import GB, GiB, fmt_bytes

if TYPE_CHECKING:
    from collectives import Group
    from workers.config import EngineConfig

GRAPH_BYTES_PER_CAPTURE = 14 << 20
"""Graph pool per captured graph at a hidden size of 4096 in bfloat16 (scaled by hidden size x
element size): one H200 run at Llama-3.1-8B shape held 4.8 GiB for 342 captures (228 round
graphs and 114 padded prefill graphs at batch 64, context 1024; 2026-12-03, commit 09a80bc).
An estimate: the start-up log prints the measured pool beside it."""

RAGGED_PROFILE_TOKENS = 8192
"""The ragged prefill's activations are measured at this many tokens at most and scaled
linearly to the largest prefill the engine may run (`max_batch_size` full prompts)."""


def parse_bytes(text: str) -> int:
    """`text` in bytes: an integer, or a number with a K, M, G or T suffix (powers of 1024; a
    trailing B or iB is allowed: 16G, 16GB, 16GiB, 1.5G); `ValueError` saying what is wrong."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    if s and s[-1] in "KMGT":
        scale = 1 << (10 * ("KMGT".index(s[-1]) + 1))
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value * scale < 1:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with K, M, G or T "
                         f"(powers of 1024), e.g. 16G")
    return int(value * scale)


def check_utilization(value: float, device: str) -> None:
    """`ValueError` naming `--gpu-memory-utilization` unless `value` is in (0, 1] and the
    device is a GPU."""
    if not (isinstance(value, float) or isinstance(value, int)) or not 0 < value <= 1:
        raise ValueError(f"--gpu-memory-utilization {value}: must be a fraction in (0, 1] of "
                         f"the GPU's total memory")
    if device != "cuda":
        raise ValueError(f"--gpu-memory-utilization {value}: applies to --device cuda only (a "
                         f"CPU has no device memory to budget); size the KV pool with "
                         f"--kv-cache-memory BYTES instead")


def weight_bytes(*modules: Optional[torch.nn.Module]) -> int:
    """Bytes of the parameters and buffers of `modules`, each storage once (a head shares the
    target's embedding and LM head)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        if module is None:
            continue
        for t in list(module.parameters()) + list(module.buffers()):
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def pool_format(model: torch.nn.Module, attention_backend: str) -> tuple[int, torch.dtype]:
    """(channels per KV head, dtype) of `model`'s KV pool: the model's, or the flashinfer
    backend's format (as `workers.worker.models.RankModels` builds it)."""
    head_dim, dtype = model.config.head_dim, next(model.parameters()).dtype
    if attention_backend == "flashinfer":
        from workers.attention.flashinfer_backend import storage_dtype, storage_head_dim

        return storage_head_dim(head_dim), storage_dtype(dtype)
    return head_dim, dtype


def page_bytes(target: torch.nn.Module, head: Optional[torch.nn.Module], page_size: int,
               attention_backend: str) -> int:
    """Bytes one KV page takes over this rank's pools (K and V of every layer; the head's pool
    when `head` is given, i.e. when the engine speculates)."""
    attn_tp = target.par.attn.size
    total = 0
    for model in (target, head):
        if model is None:
            continue
        channels, dtype = pool_format(model, attention_backend)
        kv_heads = model.config.num_key_value_heads // attn_tp
        total += (2 * model.num_layers * page_size * kv_heads * channels
                  * torch.empty((), dtype=dtype).element_size())
    return total


@dataclass
class Profile:
    """What the profiling worker measured (CUDA; bytes)."""

    captures: int = 0               # CUDA graphs the engine will capture
    round_graphs: int = 0           # of which: the round's (the GraphTable)
    prefill_graphs: int = 0         # of which: the padded prefill's
    buffers: int = 0                # the worker's static buffers (every tier's)
    activations: int = 0            # the largest forward's transient peak
    largest: str = ""               # which forward that was
    forwards: list = field(default_factory=list)   # the forwards it ran, by name
    graphs_estimate: int = 0        # the graph pool, estimated
    non_torch: int = 0              # device memory outside torch's allocator start-up added
    seconds: float = 0.0


@dataclass
class KVPlan:
    """The KV pool one rank can hold, and why."""

    pages: int                      # pages per pool, the dummy page included
    need_pages: int                 # what the batch needs (the default pool)
    page_bytes: int                 # bytes of one page over this rank's pools
    source: str                     # "batch", "--kv-cache-memory" or "--gpu-memory-utilization"
    budget: dict[str, int] = field(default_factory=dict)   # the split the size came from

    @property
    def num_pages(self) -> Optional[int]:
        """`EngineConfig.num_pages`: None for the default pool (what the batch needs)."""
        return None if self.pages == self.need_pages else self.pages

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes


def need_pages(config: "EngineConfig") -> int:
    """Pages per pool of the default pool: `max_batch_size` full contexts and the dummy page."""
    return config.max_batch_size * config.pages_per_request + 1


def fit_pages(pages: int, config: "EngineConfig", flag: str, detail: str,
              page_size_bytes: int) -> int:
    """`pages` (what `flag` leaves room for), at most the default pool's; `ValueError` naming
    the flag when they cannot hold one request of the full context (`detail`: how the room was
    found, for the message)."""
    need = need_pages(config)
    one = config.pages_per_request + 1
    if pages < one:
        raise ValueError(
            f"{flag}: {detail}: room for {max(pages - 1, 0) * config.page_size} tokens of KV "
            f"cache; one request of the full context ({config.max_context_len} tokens, "
            f"{config.max_kv_tokens} with the draft's overshoot) needs "
            f"{fmt_bytes(one * page_size_bytes)}: give more memory, or a shorter context "
            f"(--max-model-len, or shorter prompts / --max-new-tokens)")
    return min(pages, need)


def plan_kv_pages(config: "EngineConfig", target: torch.nn.Module,
                  head: Optional[torch.nn.Module], kv_cache_memory: Optional[int] = None,
                  utilization: Optional[float] = None, measured: Optional[dict] = None
                  ) -> KVPlan:
    """This rank's KV pool (see the module's doc). `measured`: with `utilization`, the
    start-up's numbers (`budget_split`)."""
    per_page = page_bytes(target, head if config.speculative else None, config.page_size,
                          config.attention_backend)
    need = need_pages(config)
    unit = f"{fmt_bytes(per_page)} per page of {config.page_size} tokens"
    if kv_cache_memory is not None:
        pages = fit_pages(kv_cache_memory // per_page, config,
                          f"--kv-cache-memory {fmt_bytes(kv_cache_memory)}",
                          f"{kv_cache_memory} bytes at {unit}", per_page)
        return KVPlan(pages, need, per_page, "--kv-cache-memory", {"kv": kv_cache_memory})
    if utilization is not None:
        split = dict(measured or {})
        pages = fit_pages(max(split["kv"], 0) // per_page, config,
                          f"--gpu-memory-utilization {utilization:g}",
                          f"{budget_text(split)} leave {fmt_bytes(split['kv'])} at {unit}",
                          per_page)
        return KVPlan(pages, need, per_page, "--gpu-memory-utilization", split)
    return KVPlan(need, need, per_page, "batch")


def budget_text(split: dict) -> str:
    """How a utilization budget divides, in words."""
    return (f"{fmt_bytes(split['budget'])} ({split['utilization']:g} of "
            f"{fmt_bytes(split['total'])}) less weights {fmt_bytes(split['weights'])}, "
            f"buffers {fmt_bytes(split['buffers'])}, activations "
            f"{fmt_bytes(split['activations'])}, CUDA graphs {fmt_bytes(split['graphs'])} "
            f"(estimate) and other {fmt_bytes(split['non_torch'])}")


def agree_pages(pages: int, group: "Group") -> int:
    """The smallest of the ranks' pools (every rank holds it; one exchange over the group's
    control group)."""
    if group.size == 1:
        return pages
    from adaptive_dist.startup import exchange

    return min(int(p) for p in exchange(pages, group, "sizing the KV cache"))


# ---- CUDA: the baseline, the profile, the split ---------------------------------------------------

@dataclass
class Baseline:
    """The device before the model loads (CUDA; bytes)."""

    device: torch.device
    total: int
    free: int
    reserved: int
    allocated: int

    @staticmethod
    def take(device: torch.device) -> "Baseline":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return Baseline(device, int(total), int(free), int(torch.cuda.memory_reserved(device)),
                        int(torch.cuda.memory_allocated(device)))

    def non_torch_growth(self) -> int:
        """Device memory outside torch's allocator added since the baseline (cuBLAS, NCCL,
        loaded kernels; another process's allocation meanwhile counts too)."""
        free, total = torch.cuda.mem_get_info(self.device)
        outside = (total - free) - torch.cuda.memory_reserved(self.device)
        return max(0, int(outside - ((self.total - self.free) - self.reserved)))


def graphs_estimate(captures: int, target: torch.nn.Module) -> int:
    """The graph pool `captures` graphs of `target` will hold, by `GRAPH_BYTES_PER_CAPTURE`."""
    dtype = next(target.parameters()).dtype
    scale = target.config.hidden_size * torch.empty((), dtype=dtype).element_size() / (4096 * 2)
    return int(captures * GRAPH_BYTES_PER_CAPTURE * scale)


def largest_padded_prefill(config: "EngineConfig", row_buckets: tuple[int, ...]
                           ) -> Optional[tuple[int, int]]:
    """(rows, width) of the padded prefill with the most token slots (None: none is padded)."""
    cap = config.padded_prefill_tokens
    longest = max(32, 1 << (config.max_context_len - 1).bit_length())
    best = None
    for rows in row_buckets:
        width = 32
        while rows * width * 2 <= cap and width * 2 <= longest:
            width *= 2
        if rows * width <= cap and (best is None or rows * width > best[0] * best[1]):
            best = (rows, width)
    return best


def profile_engine(config: "EngineConfig", target: torch.nn.Module,
                   head: Optional[torch.nn.Module]) -> Profile:
    """Count the CUDA graphs an engine of `config` will capture and measure its buffers and the
    transient peak of its largest forwards (the largest padded prefill, the largest ragged one
    scaled, the deepest tier's round over the largest batch), on a worker of `config` with a
    two-page pool whose captures are counted, not run. Collective: every rank runs the same
    forwards (they hold the model's collectives). Everything it built is freed again."""
    from workers.attention import make_backend
    from workers.cuda_graphs import CudaGraphRunner
    from workers.runtime_state import RuntimeStatePool
    from workers.worker import EagleWorker
    from workers.worker.graph_table import GraphPhase, GraphTable
    from workers import startup_log

    start = time.perf_counter()
    device = torch.device(config.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out = Profile()
    small = config.replace(num_pages=2)
    sync()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with startup_log.active(startup_log.Timeline(printing=False)), torch.inference_mode():
        worker = EagleWorker(target, head if config.speculative else None, small,
                             make_backend(config.attention_backend, config.device))
        if worker.graphs is not None:   # count the captures, run none
            worker.graphs = CudaGraphRunner(device, capture=False)
            worker.table = GraphTable(worker.graphs)
        pool = RuntimeStatePool(worker, config.spec.tiers)
        pool.apply(config.spec.max_steps)
        worker.capture_prefill()
        runner = worker.prefill_runner
        table = worker.table
        out.prefill_graphs = len(table.of(GraphPhase.PREFILL)) if table is not None else 0
        out.round_graphs = len(table) - out.prefill_graphs if table is not None else 0
        out.captures = out.round_graphs + out.prefill_graphs
        sync()
        if device.type == "cuda":
            out.buffers = torch.cuda.memory_allocated(device) - base
        forwards = []
        shape = largest_padded_prefill(config, runner.row_buckets)
        if shape is not None:
            rows, width = shape
            forwards.append((f"padded prefill {rows} x {width}",
                             lambda: worker.prefill([], rows * width, rows, width), 1.0))
        longest_prefill = config.max_batch_size * max(config.max_context_len - 1, 1)
        padded_slots = shape[0] * shape[1] if shape is not None else 0
        if longest_prefill > padded_slots:
            tokens = min(longest_prefill, RAGGED_PROFILE_TOKENS)
            forwards.append((f"ragged prefill of {longest_prefill} tokens (measured at "
                             f"{tokens})",
                             lambda: worker.prefill([], tokens, config.max_batch_size, 0),
                             longest_prefill / tokens))
        batch = max((config.max_batch_size, *config.graph_buckets))
        forwards.append((f"round at depth {config.max_steps} x {batch} rows",
                         lambda: worker.spec_round([], batch, None), 1.0))
        for name, run, scale in forwards:
            out.forwards.append(name)
            sync()
            if device.type == "cuda":
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            run()
            sync()
            if device.type == "cuda":
                peak = int((torch.cuda.max_memory_allocated(device) - before) * scale)
                if peak > out.activations:
                    out.activations, out.largest = peak, name
        worker.close()
        del worker, pool, forwards, runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out.graphs_estimate = graphs_estimate(out.captures, target) if config.cuda_graphs else 0
    out.seconds = time.perf_counter() - start
    return out


def budget_split(utilization: float, baseline: Baseline, weights: int, profile: Profile
                 ) -> dict[str, Any]:
    """How `utilization` x the GPU's memory divides before the KV pool: what is left (`kv`).
    `ValueError` naming the flag when the budget exceeds what is free on the device."""
    budget = int(utilization * baseline.total)
    if budget > baseline.free + baseline.reserved:
        raise ValueError(f"--gpu-memory-utilization {utilization}: asks for {fmt_bytes(budget)} "
                         f"of the GPU's {fmt_bytes(baseline.total)}, but only "
                         f"{fmt_bytes(baseline.free)} are free (other processes hold the rest); "
                         f"give a smaller fraction")
    profile.non_torch = baseline.non_torch_growth()
    kv = (budget - weights - profile.buffers - profile.activations - profile.graphs_estimate
          - profile.non_torch)
    return {"utilization": utilization, "total": baseline.total, "budget": budget,
            "weights": weights, "buffers": profile.buffers, "activations": profile.activations,
            "graphs": profile.graphs_estimate, "non_torch": profile.non_torch, "kv": kv}


def memory_split(device: torch.device, weights: int, kv: int, graphs: int,
                 baseline: Optional[Baseline]) -> dict[str, int]:
    """What the process holds once the engine is built (bytes): weights, KV pools, the graph
    pool (measured), the rest of torch's allocator (buffers and cached activation blocks), the
    peak allocated since the baseline, memory outside torch's allocator added since it, free."""
    out = {"weights": weights, "kv": kv, "graphs": graphs}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        reserved = int(torch.cuda.memory_reserved(device))
        free, total = torch.cuda.mem_get_info(device)
        base_reserved = baseline.reserved if baseline is not None else 0
        out.update(
            other_torch=max(0, reserved - base_reserved - weights - kv - graphs),
            peak_allocated=int(torch.cuda.max_memory_allocated(device)),
            activations=int(torch.cuda.max_memory_allocated(device)
                            - torch.cuda.memory_allocated(device)),
            non_torch=baseline.non_torch_growth() if baseline is not None else 0,
            free=int(free), total=int(total))
        out["process"] = reserved - base_reserved + out["non_torch"]
    else:
        from workers.startup_log import rss_bytes

        out["rss"] = rss_bytes()
    return out


def split_text(split: dict[str, int], budget: Optional[int] = None) -> str:
    """The split as the start-up line prints it."""
    parts = [f"weights {fmt_bytes(split['weights'])}", f"KV {fmt_bytes(split['kv'])}",
             f"CUDA graphs {fmt_bytes(split['graphs'])}"]
    if "other_torch" in split:
        parts += [f"buffers and cached blocks {fmt_bytes(split['other_torch'])} (start-up's "
                  f"activation peak {fmt_bytes(split['activations'])})",
                  f"outside torch {fmt_bytes(split['non_torch'])}",
                  f"= this process {fmt_bytes(split['process'])}"
                  + (f" of a budget of {fmt_bytes(budget)}" if budget else ""),
                  f"free on the GPU {fmt_bytes(split['free'])} of {fmt_bytes(split['total'])}"]
    else:
        parts.append(f"process resident {fmt_bytes(split['rss'])}")
    return ", ".join(parts)


__all__ = ["GRAPH_BYTES_PER_CAPTURE", "RAGGED_PROFILE_TOKENS", "parse_bytes",
           "check_utilization", "weight_bytes", "page_bytes", "pool_format", "Profile", "KVPlan",
           "need_pages", "fit_pages", "plan_kv_pages", "agree_pages", "Baseline",
           "graphs_estimate", "largest_padded_prefill", "profile_engine", "budget_split",
           "memory_split", "split_text", "GB", "GiB"]
