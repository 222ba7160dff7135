"""The worker of one rank: the target and its EAGLE head run over the batch slots' paged KV.

`EagleWorker` (`eagle_worker`) is what the engine calls: prefill, the speculative round
(`launch` / `collect`), the runtime state per depth, the CUDA graphs.
"""
from workers.worker.eagle_worker import EagleWorker, LaunchedRound, RoundResult

__all__ = ["EagleWorker", "LaunchedRound", "RoundResult"]
