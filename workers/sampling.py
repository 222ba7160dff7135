"""Sampling parameters: `SamplingParams` (temperature, 0 = greedy; top-p; top-k; max_new_tokens;
min_tokens; stop tokens; presence, frequency and repetition penalties; logprobs and prompt
logprobs), validated; `TokenLogprob`, what a request's logprobs are made of.

The engine samples and accepts on the device (`workers.spec_decode`); the host-side references
its tests compare against (`target_probs`, `processed_logits`, `accept_greedy`,
`accept_rejection`) are in `tests/sampling_reference.py`. The semantics, and how each stays
lossless under speculation, are in `docs/sampling.md`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


MAX_LOGPROBS = 20
"""The most alternatives `logprobs` / `prompt_logprobs` may ask for (OpenAI's limit)."""
MAX_STOP_IDS = 8
"""Stop token ids a request may have (end-of-sequence ids of real tokenizers are 1-3): the
scheduler's output buffer and the worker's slots hold that many per request."""


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target's raw distribution (log_softmax of its
    logits, before min_tokens, penalties, temperature, top-k and top-p) and the `k` most likely
    tokens there, most likely first (`(token_id, logprob)`; the token itself may or may not be
    among them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class PendingPromptLogprobs(NamedTuple):
    """A prefill's prompt logprobs on their way to the host (filled by a copy the device runs
    before the next round's results; `Scheduler.commit_round` reads them with those): rows
    `offset .. offset + count` of the prefill's token logprobs [R], top logprobs [R, K] and their
    ids [R, K] are this request's prompt tokens 1 .. P-1."""

    token_lp: torch.Tensor
    top_lp: torch.Tensor
    top_ids: torch.Tensor
    offset: int
    count: int


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (semantics: `docs/sampling.md`).

    - `temperature` (0: greedy), `top_p` in (0, 1], `top_k` (k >= 1 keeps the k most likely
      tokens; 0 or -1: off, kept as 0): the target's distribution is softmax(logits /
      temperature), restricted to its top-k, renormalised, then to its top-p nucleus;
    - `max_new_tokens` >= 1; `min_tokens` in [0, max_new_tokens]: `stop_token_ids` (the ids that
      stop the request: the model's EOS unless the caller ignores it, and its own) cannot be
      drawn before `min_tokens` tokens were generated (their logits are -inf there);
    - `presence_penalty`, `frequency_penalty` in [-2, 2] (OpenAI): the logits of tokens generated
      so far lose `presence + frequency * count`; `repetition_penalty` > 0 (vLLM / HF; 1: off):
      the logits of tokens in the prompt or generated so far are divided by it when positive,
      multiplied by it otherwise; applied before the other two;
    - `logprobs` (None, or 0 .. MAX_LOGPROBS alternatives): for every generated token its
      `TokenLogprob` (`Request.logprobs`); `prompt_logprobs` (None or 0 .. MAX_LOGPROBS): the
      same for every prompt token given the tokens before it, the first one None
      (`Request.prompt_logprobs`). Both are the target's raw log-probabilities.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number >= 0 "
                             "(0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be an integer >= 1")
        if not _count(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 1, or 0 or -1 (off)")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not _count(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens={self.min_tokens!r}: must be an integer in [0, "
                             f"max_new_tokens={self.max_new_tokens}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}={value!r}: must be a number in [-2, 2]")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r}: must be a finite "
                             "number > 0 (1 means none)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _count(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}={value!r}: must be None or an integer in "
                                 f"[0, {MAX_LOGPROBS}] (the alternatives per token)")

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (temperature 0)."""
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the distribution."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def processed(self) -> bool:
        """Whether the round processes this request's logits (top-k of a sampled request,
        min_tokens with stop ids, a penalty, logprobs): its rounds run the verify variant with
        the processing, and its first token is drawn by its first round, not by the prefill (see
        `docs/sampling.md`). False for a request that uses none of them: today's path."""
        return ((self.top_k > 0 and not self.greedy)
                or (self.min_tokens > 0 and bool(self.stop_token_ids))
                or self.penalised or self.logprobs is not None)
