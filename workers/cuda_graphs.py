"""CUDA graphs: capture a forward once, replay it every round.

`CudaGraphRunner` knows nothing about models: it is handed a body (a closure over static input
buffers that runs one forward and returns its outputs), warms it up and captures it on one side
stream into one memory pool shared by every capture, and replays it. The worker decides what the
bodies are (the round's phases, the catch-up, the padded prefill: see `workers.worker.phases`)
and keeps the entries in one `GraphTable` (`workers.worker.graph_table`) by phase and shape, so a
tier switch replays other keys and `num_captures` never moves after start-up.

Rules a body must follow to be capturable: fixed shapes (static buffers sliced by the bucket), no
host synchronisation, no allocation whose size depends on values; collectives inside (NCCL) are
captured too, so every rank must capture the same bodies in the same order (the warm-up runs
execute them).

Without CUDA (`capture=False`) `replay` runs the body eagerly: the CPU tests exercise exactly the
padded static forwards that the GPU replays.

# NOTE: close() must run before the process group is destroyed (graphs holding NCCL collectives
# keep NCCL resources); the engine calls it before the distributed context shuts down.
# NOTE: a replay issues its captured collectives without passing through `collectives.ops`, so the
# recording lockstep guard logs them at capture only; the graph path itself is agreed every round
# (plan.use_graph) and checked in the pre-flight.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class GraphEntry:
    """One captured forward (or, without CUDA, one emulated: `graph` is None)."""

    name: str
    body: Callable[[], Any]
    graph: Any = None
    output: Any = None
    closed: bool = False

    def replay(self) -> Any:
        """Run the forward on the current contents of its static inputs; return its outputs."""
        if self.closed:
            raise RuntimeError(f"CUDA graph {self.name} used after close()")
        if self.graph is None:
            return self.body()
        self.graph.replay()
        return self.output


class CudaGraphRunner:
    """Captures bodies into CUDA graphs that share one memory pool; replays them."""

    def __init__(self, device: torch.device, capture: bool | None = None) -> None:
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"capturing CUDA graphs needs a CUDA device, not {self.device}")
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # NOTE: one side stream for every warm-up and capture: each new stream would get its own
        # cuBLAS workspace (tens of MiB apiece).
        self.stream = torch.cuda.Stream(device=self.device) if self.capture else None
        self.num_captures = 0
        self.entries: list[GraphEntry] = []
        self.closed = False

    @torch.inference_mode()
    def capture_body(self, name: str, body: Callable[[], Any], warmups: int = 2) -> GraphEntry:
        """Warm up `body` and capture it (emulated on a CPU). Start-up only."""
        if self.closed:
            raise RuntimeError("CUDA graph runner is closed")
        entry = GraphEntry(name, body)
        self.entries.append(entry)
        if not self.capture:
            return entry
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(warmups):
                body()
        current.wait_stream(self.stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            entry.output = body()
        entry.graph = graph
        self.num_captures += 1
        return entry

    def pool_bytes(self) -> int:
        """Device bytes held by the shared graph memory pool (its cudaMalloc'd segments)."""
        if not self.capture or self.pool is None:
            return 0
        torch.cuda.synchronize(self.device)
        pool = tuple(self.pool)
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == pool)

    def close(self, wait_s: float = 5.0) -> None:
        """Release every graph and the pool (idempotent). Before the process group goes.

        Waits at most `wait_s` for the device's queued work: on a failure path a replayed graph
        may still wait in a collective for a peer that is gone (with overlapped rounds one is
        always queued), and a plain synchronisation would hang. Graphs still in use are then
        left to the process's exit."""
        if self.closed:
            return
        if self.capture and not device_idle(self.device, wait_s):
            self.closed = True
            return
        for entry in self.entries:
            if entry.graph is not None:
                entry.graph.reset()
            entry.graph, entry.output, entry.closed = None, None, True
        self.entries.clear()
        self.pool, self.stream = None, None
        self.closed = True


def device_idle(device: torch.device, wait_s: float) -> bool:
    """Whether `device`'s current stream finishes its queued work within `wait_s` seconds
    (polled, so a stuck kernel cannot hang the caller)."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + wait_s
    while not done.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True
