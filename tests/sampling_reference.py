"""Exact references for the sampling tests (single-process and DP): the host-side sampling and
speculative acceptance the engine's device path (`workers.spec_decode`) is checked against,
Pearson's chi-square p-value and the target's exact joint distribution of its first three tokens
after a prompt.

- `target_probs`: the distribution a request samples from (temperature, then top-k, then top-p).
- `processed_logits`: the logits after min_tokens and the penalties, for one prefix.
- `accept_greedy`: exact match of the draft against the target's argmax.
- `accept_rejection`: speculative rejection sampling, lossless with respect to `target_probs`:
  draft token x (sampled from the draft's q) is kept with probability min(1, p(x)/q(x)); at the
  first rejection the replacement comes from normalize(max(p - q, 0)); when all are kept the bonus
  token comes from p at the last position. Randomness from an explicit `torch.Generator`.

Statistical tests compare against exact probabilities, bins with expected count < 5 pooled, at
significance level ALPHA = 0.001 (a correct implementation fails a given seed with probability
0.001; the seeds are fixed, so the outcome is reproducible)."""
from __future__ import annotations

import torch

from workers.model import DenseCausalAttention
from workers.sampling import SamplingParams

ALPHA = 1e-3


def target_probs(logits: torch.Tensor, temperature: float, top_p: float,
                 top_k: int = 0) -> torch.Tensor:
    """[..., V] probabilities (float32) after temperature, top-k (k >= 1: the k most likely
    tokens, renormalised; 0: off) and then top-p of that; one-hot argmax when greedy."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
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


def processed_logits(logits: torch.Tensor, prompt: list[int], output: list[int],
                     params: SamplingParams) -> torch.Tensor:
    """[V] float64: the logits of the token after `prompt + output` as `params` process them,
    token by token: min_tokens (fewer than `min_tokens` tokens generated: the stop ids are
    -inf), then the repetition penalty on every token of the prompt or the output (a positive
    logit divided by it, any other multiplied), then `- frequency * count - presence` on every
    token the output holds `count > 0` times."""
    out = logits.double().clone()
    if len(output) < params.min_tokens:
        for t in params.stop_token_ids:
            out[t] = float("-inf")
    rep = params.repetition_penalty
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        count = output.count(t)
        out[t] = out[t] - params.frequency_penalty * count - params.presence_penalty
    return out


@torch.no_grad()
def dense_logits(target, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] the target's logits at every position of `ids` (dense attention, no KV
    cache)."""
    t = torch.tensor(ids)
    hidden = target(t, torch.arange(len(ids)), DenseCausalAttention([len(ids)]))
    return target.compute_logits(hidden)


@torch.no_grad()
def exact_joint(target, temperature: float, top_p: float, top_k: int = 0,
                params: SamplingParams | None = None) -> torch.Tensor:
    """P(t0, t1, t2 | PROMPT) for every triple, flattened [V^3], from dense attention; with
    `params`, the logits of each prefix processed (`processed_logits`: min_tokens, penalties)."""
    def dist(prefix: list[int]) -> torch.Tensor:
        logits = dense_logits(target, PROMPT + prefix)[-1]
        if params is not None:
            logits = processed_logits(logits, PROMPT, prefix, params)
        return target_probs(logits[None], temperature, top_p, top_k)[0].double()
    joint = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    p0 = dist([])
    for t0 in range(VOCAB):
        p1 = dist([t0])
        for t1 in range(VOCAB):
            p2 = dist([t0, t1])
            for t2 in range(VOCAB):
                joint[(t0 * VOCAB + t1) * VOCAB + t2] = p0[t0] * p1[t1] * p2[t2]
    return joint


def check_keeps_target_law(engine, target, n: int = 3000, seed: int = 77) -> None:
    """Sample 3 tokens after PROMPT `n` times at temperature 1 with `engine` (speculative): some
    drafts rejected, some accepted, and the joint law of the 3 tokens is the target's (and
    distinguishably not the law at temperature 1.3)."""
    from workers.sampling import SamplingParams

    out = engine.generate([PROMPT] * n, SamplingParams(temperature=1.0, max_new_tokens=3),
                          seed=seed)
    counts = torch.zeros(VOCAB ** 3)
    for req in out:
        t0, t1, t2 = req.output_ids
        counts[(t0 * VOCAB + t1) * VOCAB + t2] += 1
    hist = engine.stats.accept_histogram
    assert hist.get(0, 0) > 0 and sum(v for k, v in hist.items() if k > 0) > 0, hist
    assert chi_square_pvalue(counts, exact_joint(target, 1.0, 1.0)) > ALPHA
    assert chi_square_pvalue(counts, exact_joint(target, 1.3, 1.0)) < ALPHA
