"""Sampling: temperature/top-p, and speculative rejection sampling is lossless.

Statistical tests use Pearson's chi-square goodness of fit against exact probabilities, bins with
expected count < 5 pooled, at significance level ALPHA = 0.001 (a correct implementation fails a
given seed with probability 0.001; the seeds are fixed, so the outcome is reproducible). Each test
also shows that the same statistic rejects a nearby wrong distribution, so it is not vacuous.

The engine-level test compares the first three generated tokens of speculative sampling (steps 3,
a random draft head that is often wrong, so draft tokens are rejected and replaced) with the
target's exact distribution, computed independently: dense attention, no KV cache, enumeration
of every prefix.
"""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import engine_for, tiny_config, tiny_pair
from sampling_reference import (
    ALPHA,
    PROMPT,
    VOCAB,
    accept_greedy,
    accept_rejection,
    chi_square_pvalue,
    exact_joint,
    target_probs,
)
from workers.sampling import SamplingParams

# ---- parameters and distributions ----------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.5}, "temperature=-0.5"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": 0.0}, r"top_p=0.0: must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p=1.5: must be in \(0, 1\]"),
    ({"max_new_tokens": 0}, "max_new_tokens=0: must be an integer >= 1"),
    ({"max_new_tokens": -3}, "max_new_tokens=-3"),
])
def test_bad_sampling_params_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_target_probs_temperature_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert target_probs(logits, 0.0, 1.0).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(target_probs(logits, 1.0, 1.0), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.testing.assert_close(target_probs(logits, 2.0, 1.0), torch.softmax(logits / 2, -1))
    torch.testing.assert_close(target_probs(logits, 1.0, 0.8), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    kept3 = torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95
    torch.testing.assert_close(target_probs(logits, 1.0, 0.81), kept3)
    torch.testing.assert_close(target_probs(logits, 1.0, 0.01), torch.tensor([[1.0, 0, 0, 0]]))


def test_greedy_acceptance() -> None:
    assert accept_greedy([4, 5, 6], [4, 5, 9, 1]) == (2, [4, 5, 9])
    assert accept_greedy([4, 5, 6], [4, 5, 6, 1]) == (3, [4, 5, 6, 1])
    assert accept_greedy([4, 5, 6], [3, 5, 6, 1]) == (0, [3])


# ---- rejection sampling on fixed distributions ---------------------------------------------

P = torch.tensor([[0.05, 0.40, 0.25, 0.20, 0.10], [0.30, 0.05, 0.05, 0.10, 0.50]])
Q = torch.tensor([[0.30, 0.10, 0.40, 0.10, 0.10], [0.10, 0.60, 0.10, 0.10, 0.10]])


def _committed(steps: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Counts of the first committed token, of the second given the first draft was accepted,
    and the acceptance rate of the first draft."""
    gen = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(5), torch.zeros(5)
    accepted = 0
    probs = torch.cat([P, P[1:]])[:steps + 1]
    for _ in range(n):
        draft = [int(torch.multinomial(Q[j], 1, generator=gen)) for j in range(steps)]
        a, toks = accept_rejection(draft, Q[:steps], probs, gen)
        first[toks[0]] += 1
        if a >= 1:
            accepted += 1
            second[toks[1]] += 1
    return first, second, accepted / n


@pytest.mark.parametrize("steps", [1, 2])
def test_rejection_sampling_matches_target(steps: int) -> None:
    first, second, rate = _committed(steps, 20000, seed=11)
    expected_rate = torch.minimum(P[0], Q[0]).sum().item()  # P(accept) = sum_x min(p, q)
    assert abs(rate - expected_rate) < 0.02
    assert chi_square_pvalue(first, P[0]) > ALPHA
    assert chi_square_pvalue(second, P[1]) > ALPHA
    assert chi_square_pvalue(first, Q[0]) < 1e-6       # the draft's own distribution is rejected
    assert chi_square_pvalue(first, 0.9 * P[0] + 0.1 * Q[0]) < ALPHA  # and so is a 10% mixture


# ---- engine: speculative sampling vs. the target's exact distribution -----------------------

@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_speculative_sampling_matches_target_distribution(temperature: float, top_p: float) -> None:
    target, head = tiny_pair(seed=2, eps=1.0, cfg=tiny_config(vocab=VOCAB, hidden=32))
    engine = engine_for(target, head, "static", steps=3, max_batch=64)
    n = 8000
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=3)
    out = engine.generate([PROMPT] * n, params, seed=1000)
    counts = torch.zeros(VOCAB ** 3)
    for req in out:
        t0, t1, t2 = req.output_ids
        counts[(t0 * VOCAB + t1) * VOCAB + t2] += 1
    hist = engine.stats.accept_histogram
    assert hist[0] > 0 and hist[1] + hist[2] + hist[3] > 0, f"no rejections or no accepts: {hist}"
    exact = exact_joint(target, temperature, top_p)
    assert chi_square_pvalue(counts, exact) > ALPHA
    hotter = exact_joint(target, temperature * 1.3, top_p)
    assert chi_square_pvalue(counts, hotter) < ALPHA, "the test cannot tell a 30% hotter target"


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    target, head = tiny_pair(seed=2, eps=1.0, cfg=tiny_config(vocab=VOCAB, hidden=32))
    params = SamplingParams(temperature=1.0, max_new_tokens=12)

    def run(seed: int) -> list[list[int]]:
        engine = engine_for(target, head, "static", steps=3)
        return [r.output_ids for r in engine.generate([PROMPT] * 3, params, seed=seed)]
    assert run(5) == run(5)
    assert run(5) != run(6)
    first = run(5)
    assert len({tuple(x) for x in first}) > 1, "requests of one batch share a random stream"


def test_all_triples_enumerated() -> None:
    """Guard for the exact-distribution helper: it sums to one."""
    target, _ = tiny_pair(seed=2, eps=1.0, cfg=tiny_config(vocab=VOCAB, hidden=32))
    assert abs(exact_joint(target, 1.0, 1.0).sum().item() - 1.0) < 1e-6  # float32 probs
