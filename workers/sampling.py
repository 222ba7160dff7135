"""Sampling and speculative acceptance.

- `SamplingParams`: temperature (0 = greedy), top-p, max_new_tokens, stop tokens; validated.
- `target_probs`: the distribution a request samples from (temperature, then top-p).
- `accept_greedy`: exact match of the draft against the target's argmax.
- `accept_rejection`: speculative rejection sampling, lossless with respect to `target_probs`:
  draft token x (sampled from the draft's q) is kept with probability min(1, p(x)/q(x)); at the first
  rejection the replacement comes from normalize(max(p - q, 0)); when all are kept the bonus token
  comes from p at the last position.

These are the host-side reference implementations (randomness from an explicit
`torch.Generator`); the engine samples and accepts on the device with `workers.spec_decode`, whose
tests compare against them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[..., V] probabilities (float32) after temperature and top-p; one-hot argmax when greedy."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    # NOTE: keep the smallest prefix whose mass reaches top_p; the first token always stays.
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [N, V] -> [N] int64, drawn with `generator`."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def accept_greedy(draft: list[int], target_argmax: list[int]) -> tuple[int, list[int]]:
    """(accepted draft tokens, tokens to commit = accepted + bonus) for one request."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target_argmax[accepted]:
        accepted += 1
    return accepted, list(draft[:accepted]) + [target_argmax[accepted]]


def accept_rejection(draft: list[int], draft_probs: torch.Tensor, probs: torch.Tensor,
                     generator: torch.Generator) -> tuple[int, list[int]]:
    """Speculative rejection sampling for one request.

    `draft` [s] was sampled from `draft_probs` [s, V]; `probs` [s+1, V] is the target's
    distribution at each verify position. Returns (accepted draft tokens, tokens to commit).
    """
    uniforms = torch.rand(len(draft), generator=generator, device=generator.device)
    for j, token in enumerate(draft):
        p, q = probs[j, token], draft_probs[j, token]
        if bool(uniforms[j] * q < p):  # u < p/q, with q > 0 since token was drawn from q
            continue
        residual = (probs[j] - draft_probs[j]).clamp_min(0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else probs[j]
        return j, list(draft[:j]) + [int(sample(residual[None], generator))]
    bonus = int(sample(probs[len(draft)][None], generator))
    return len(draft), list(draft) + [bonus]
