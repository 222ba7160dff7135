"""The worker of one rank: the target and its EAGLE head run over the batch slots' paged KV.

`EagleWorker` (`eagle_worker`) is what the engine calls: prefill, the speculative round
(`launch` / `collect`), the runtime state per depth, the CUDA graphs, the start-up round costs.
It owns one object per part, each handed the ones below it (no module imports one above it):
- `slots` — `SlotState` (the per-request device state in batch slots, the round's rows) and a
  tier's `StepBuffers`;
- `models` — `RankModels` (the target, the head, their KV pools, the attention backends);
- `draft_lag` — `DraftLag` (depth 0 with a head: the lag ring, deferred prompts, the catch-up);
- `phases` — `RoundPhases` (draft, verify + accept, draft-extend) and `prefill` —
  `PrefillRunner` (padded and ragged, and the padded prefill's graphs);
- `graph_table` — `GraphTable`: every CUDA graph of the worker by `GraphKey` (its `GraphPhase`
  and sizes);
- `staging` — the host memory a round is staged in and read from; `round_cost` — the start-up
  measurement of a round's cost per tier and bucket.
"""
from workers.worker.eagle_worker import EagleWorker, LaunchedRound, RoundResult

__all__ = ["EagleWorker", "LaunchedRound", "RoundResult"]
