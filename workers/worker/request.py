"""What the worker sees of a request: `SlotRequest`, the few fields of an admitted request its
forwards read (the scheduler's `workers.scheduler.Request` is one; the worker never imports the
scheduler)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

if TYPE_CHECKING:
    from workers.sampling import PendingPromptLogprobs, SamplingParams


class SlotRequest(Protocol):
    """An admitted request: its batch slot and KV page table, its prompt, sampling settings and
    seed, and how many tokens it holds. A prefill that scores the prompt leaves the prompt's
    logprobs, still on their way to the host, in `pending_prompt_logprobs`."""

    slot: Optional[int]
    pages: list[int]
    prompt_ids: list[int]
    params: "SamplingParams"
    seed: int
    pending_prompt_logprobs: Optional["PendingPromptLogprobs"]

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        ...
