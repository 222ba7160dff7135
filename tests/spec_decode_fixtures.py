"""Helpers for the `workers.spec_decode` tests (CPU and GPU): a bigram "language model" pair that
runs whole speculative rounds through `draft_step` and `verify`, batched over many independent
requests, and the exact distributions those rounds must produce.

The target and the draft are bigram tables `[V, V]` of logits (row = previous token): the target's
logits at verify position j are `T[ctx_j]` with `ctx = [x_n, d_1 .. d_S]`, exactly as a real
target conditions position j on the drafts before it; draft step k reads `D[previous token]`.
So the committed sequence must be a Markov chain with transition `probs(T[prev])` whatever D is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sampling_reference import target_probs
from workers.spec_decode import draft_step, verify

ALPHA = 1e-3


def chi_square_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of observed `counts` under `expected_probs` (Pearson; bins expected < 5 pooled)."""
    counts = counts.double().flatten()
    n = counts.sum()
    expected = expected_probs.double().flatten() * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):
        return 0.0  # something observed where nothing may happen
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    if dof == 0:
        return 1.0  # one possible outcome, and only it was observed
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def bigram_pair(vocab: int, seed: int, noise: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits T [V, V], draft logits D [V, V]): D is T plus noise, so drafts are often but
    not always right (every accept length occurs)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(vocab, vocab, generator=g)
    draft = target + noise * torch.randn(vocab, vocab, generator=g)
    return target, draft


def transition(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[V, V] float64 next-token distributions from the reference `target_probs`."""
    return target_probs(logits, temperature, top_p).double()


def exact_joint(target: torch.Tensor, start: int, temperature: float, top_p: float) -> torch.Tensor:
    """P(first two committed tokens = (x, y)) = p(x | start) p(y | x), flattened [V*V]."""
    p = transition(target, temperature, top_p)
    return (p[start][:, None] * p).flatten()


def exact_accept_lengths(target: torch.Tensor, draft: torch.Tensor, start: int, steps: int,
                         temperature: float, top_p: float, draft_top_p: bool = True) -> torch.Tensor:
    """P(accept_len = k), k = 0..steps, of the first round: a draft path x_1..x_k is drawn and kept
    with probability prod_j min(p(x_j | x_{j-1}), q(x_j | x_{j-1}))."""
    q = transition(draft, temperature, top_p if draft_top_p else 1.0)
    m = torch.minimum(transition(target, temperature, top_p), q)
    v = m[start]
    at_least = [torch.tensor(1.0, dtype=torch.float64)]
    for _ in range(steps):
        at_least.append(v.sum())
        v = v @ m
    at_least.append(torch.tensor(0.0, dtype=torch.float64))
    return torch.stack([at_least[k] - at_least[k + 1] for k in range(steps + 1)])


VerifyFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Rounds:
    committed: torch.Tensor     # [N, rounds * (S + 1)] committed tokens, left-aligned per request
    count: torch.Tensor         # [N] how many are valid
    first_accept: torch.Tensor  # [N] accept_len of the first round


def run_rounds(target: torch.Tensor, draft: torch.Tensor, start: int, steps: int,
               temperature: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
               rounds: int = 2, verify_fn: VerifyFn = verify, counter0: int = 7,
               draft_top_p: bool = True) -> Rounds:
    """`rounds` speculative rounds for N = len(seed) requests all at context `[.., start]`
    (`draft_top_p=False`: the draft samples without top-p, the target keeps it)."""
    n, device = seed.shape[0], seed.device
    target, draft = target.to(device), draft.to(device)
    width = rounds * (steps + 1)
    committed = torch.zeros(n, width + 1, dtype=torch.int64, device=device)  # last col: dump
    count = torch.zeros(n, dtype=torch.int64, device=device)
    last = torch.full((n,), start, dtype=torch.int64, device=device)
    counter = torch.full((n,), counter0, dtype=torch.int64, device=device)
    num_draft = torch.full((n,), steps, dtype=torch.int64, device=device)
    cols = torch.arange(steps + 1, device=device)
    first_accept = None
    for _ in range(rounds):
        prev, toks, qs = last, [], []
        for k in range(steps):
            tok, q = draft_step(draft[prev], temperature, top_p, seed, counter, k,
                                use_top_p=draft_top_p)
            toks.append(tok)
            qs.append(q)
            prev = tok
        d = torch.stack(toks, 1)
        ctx = torch.cat([last[:, None], d], 1)
        accept, out = verify_fn(d, torch.stack(qs, 1), target[ctx], temperature, top_p, seed,
                                counter, num_draft)
        if first_accept is None:
            first_accept = accept
        idx = torch.where(cols[None, :] <= accept[:, None], count[:, None] + cols[None, :],
                          torch.full_like(out, width))
        committed.scatter_(1, idx, out)
        count = count + accept + 1
        last = out.gather(1, accept[:, None])[:, 0]
        counter = counter + accept + 1
    return Rounds(committed[:, :width], count, first_accept)


def joint_counts(r: Rounds, vocab: int) -> torch.Tensor:
    """Counts [V*V] of the first two committed tokens."""
    pair = r.committed[:, 0] * vocab + r.committed[:, 1]
    return torch.bincount(pair.cpu(), minlength=vocab * vocab).double()


def random_round(b: int, s: int, vocab: int, seed: int,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """One round's inputs for `b` requests: drafts really drawn by `draft_step` (every third row
    greedy, half the rows with top-p 0.7), target logits near the draft's, random `num_draft`.
    Built on the CPU, then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    draft_logits = torch.randn(b, s, vocab, generator=g)
    temperature = torch.rand(b, generator=g) + 0.3
    temperature[::3] = 0.0                                   # every third row greedy
    top_p = torch.where(torch.rand(b, generator=g) < 0.5, 1.0, 0.7)
    req_seed = torch.randint(0, 2 ** 40, (b,), generator=g)
    counter = torch.randint(0, 4096, (b,), generator=g)
    toks, qs = [], []
    for k in range(s):
        t, q = draft_step(draft_logits[:, k], temperature, top_p, req_seed, counter, k)
        toks.append(t)
        qs.append(q)
    draft, q = torch.stack(toks, 1), torch.stack(qs, 1)
    target_logits = draft_logits.new_zeros(b, s + 1, vocab)
    target_logits[:, :s] = draft_logits + 0.7 * torch.randn(b, s, vocab, generator=g)
    target_logits[:, s] = torch.randn(b, vocab, generator=g)
    num_draft = torch.randint(0, s + 1, (b,), generator=g)
    case = dict(draft=draft, q=q, target_logits=target_logits, temperature=temperature,
                top_p=top_p, seed=req_seed, counter=counter, num_draft=num_draft)
    return {k: v.to(device) for k, v in case.items()}
