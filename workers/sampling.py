"""Sampling parameters: `SamplingParams` (temperature, 0 = greedy; top-p; max_new_tokens; stop
tokens), validated.

The engine samples and accepts on the device (`workers.spec_decode`); the host-side references
its tests compare against (`target_probs`, `accept_greedy`, `accept_rejection`) are in
`tests/sampling_reference.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()

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

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (temperature 0)."""
        return self.temperature == 0
