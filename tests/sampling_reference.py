"""Exact references for the sampling tests (single-process and DP): Pearson's chi-square p-value
and the target's exact joint distribution of its first three tokens after a prompt.

Statistical tests compare against exact probabilities, bins with expected count < 5 pooled, at
significance level ALPHA = 0.001 (a correct implementation fails a given seed with probability
0.001; the seeds are fixed, so the outcome is reproducible)."""
from __future__ import annotations

import torch

from workers.model import DenseCausalAttention
from workers.sampling import target_probs

ALPHA = 1e-3


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed `counts` under `probs` (float64), pooling bins expected below 5."""
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].sum().double().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


VOCAB = 6
PROMPT = [1, 4, 2, 5]


@torch.no_grad()
def exact_joint(target, temperature: float, top_p: float) -> torch.Tensor:
    """P(t0, t1, t2 | PROMPT) for every triple, flattened [V^3], from dense attention."""
    def dist(prefix: list[int]) -> torch.Tensor:
        ids = torch.tensor(PROMPT + prefix)
        hidden = target(ids, torch.arange(len(ids)), DenseCausalAttention([len(ids)]))
        return target_probs(target.compute_logits(hidden[-1:]), temperature, top_p)[0].double()
    joint = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    p0 = dist([])
    for t0 in range(VOCAB):
        p1 = dist([t0])
        for t1 in range(VOCAB):
            p2 = dist([t0, t1])
            for t2 in range(VOCAB):
                joint[(t0 * VOCAB + t1) * VOCAB + t2] = p0[t0] * p1[t1] * p2[t2]
    return joint
