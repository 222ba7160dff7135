"""`workers.spec_decode`: counter-based uniforms, device-side sampling and speculative acceptance.

Statistical tests use Pearson's chi-square against exact probabilities at ALPHA = 0.001 with fixed
seeds (reproducible); each family also shows that the same statistic rejects a wrong answer, so
none is vacuous:
- uniforms: 1-D bins, mean, variance, every output bit, and 2-D bins / correlation of pairs whose
  inputs differ in one place (adjacent counter, seed, salt, index; the high 32-bit words); a Weyl
  sequence passes the 1-D test but the pair test rejects it;
- acceptance: the first two committed tokens of speculative rounds over a bigram pair follow the
  target's joint exactly and the first round's accept length follows the exact
  prod-min(p, q) law (with temperature and top-p too); two deliberately wrong accept rules (the
  replacement drawn from p instead of the residual; q ignored) are rejected.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from sampling_reference import accept_greedy, target_probs
from spec_decode_fixtures import (
    ALPHA,
    bigram_pair,
    chi_square_pvalue,
    exact_accept_lengths,
    exact_joint,
    joint_counts,
    random_round,
    run_rounds,
    transition,
)
from workers.spec_decode import (
    CHUNK,
    SALT_RESIDUAL,
    draft_step,
    probs,
    sample_from,
    sample_tokens,
    uniforms,
    verify,
)

torch.set_num_threads(1)  # small tensors: more threads only spin on a shared machine


def _i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---- uniforms ----------------------------------------------------------------------------------

def test_uniforms_pinned_values_range_and_determinism() -> None:
    seed, counter = _i64(0, 1, -1, 2 ** 40 + 3), _i64(0, 5, 9, 2 ** 33)
    u = uniforms(seed, counter, 3, 3)
    assert u.dtype == torch.float32 and u.shape == (4, 3)
    # Pinned: a change of the construction (or a device/version that computes it differently)
    # changes every sampled sequence, so it must be deliberate.
    assert (u * 2 ** 24).long().tolist() == [
        [12483336, 13641454, 5820920], [4920879, 399007, 14860238],
        [10275258, 1550748, 6726506], [4190486, 4252392, 4587228]]
    assert torch.equal(u, uniforms(seed, counter, 3, 3))
    assert torch.equal(u[:, :2], uniforms(seed, counter, 3, 2))  # index, not n, decides
    many = uniforms(torch.arange(-5000, 5000), torch.arange(10000) * 7919, 12345, 8)
    assert float(many.min()) >= 0.0 and float(many.max()) < 1.0


def test_uniforms_do_not_depend_on_the_batch() -> None:
    seed, counter = torch.randint(-2 ** 62, 2 ** 62, (32,)), torch.randint(0, 2 ** 40, (32,))
    full = uniforms(seed, counter, 9, 5)
    perm = torch.randperm(32)
    assert torch.equal(uniforms(seed[perm], counter[perm], 9, 5), full[perm])
    for b in (0, 17, 31):
        assert torch.equal(uniforms(seed[b:b + 1], counter[b:b + 1], 9, 5), full[b:b + 1])


def _grid(n_seeds: int = 1024, n_counters: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive seeds x consecutive counters: the hardest input for a weak hash."""
    seed = torch.arange(n_seeds).repeat_interleave(n_counters)
    counter = torch.arange(n_counters).repeat(n_seeds)
    return seed, counter


def _pvalue_1d(u: torch.Tensor, bins: int = 64) -> float:
    counts = torch.bincount((u.flatten() * bins).long(), minlength=bins)
    return chi_square_pvalue(counts, torch.full((bins,), 1.0 / bins))


def _pvalue_2d(a: torch.Tensor, b: torch.Tensor, bins: int = 16) -> float:
    cell = (a.flatten() * bins).long() * bins + (b.flatten() * bins).long()
    counts = torch.bincount(cell, minlength=bins * bins)
    return chi_square_pvalue(counts, torch.full((bins * bins,), 1.0 / bins ** 2))


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def test_uniforms_are_uniform() -> None:
    seed, counter = _grid()
    u = uniforms(seed, counter, 1, 1)[:, 0]
    n = u.numel()
    assert abs(float(u.double().mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.double().var()) - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / n)
    assert _pvalue_1d(u) > ALPHA
    bits = (u * 2 ** 24).long()
    for bit in range(24):  # every one of the 24 output bits is a fair coin
        ones = float(((bits >> bit) & 1).double().mean())
        assert abs(ones - 0.5) < 5 * math.sqrt(0.25 / n), f"bit {bit}: {ones}"


@pytest.mark.parametrize("what", ["counter", "seed", "salt", "index", "seed_hi", "counter_hi"])
def test_uniforms_of_neighbouring_inputs_are_independent(what: str) -> None:
    seed, counter = _grid()
    base = uniforms(seed, counter, 1, 2)
    other = {
        "counter": lambda: uniforms(seed, counter + 1, 1, 2),
        "seed": lambda: uniforms(seed + 1, counter, 1, 2),
        "salt": lambda: uniforms(seed, counter, 2, 2),
        "index": lambda: base[:, 1:].expand(-1, 2),
        "seed_hi": lambda: uniforms(seed + 2 ** 32, counter, 1, 2),
        "counter_hi": lambda: uniforms(seed, counter + 2 ** 32, 1, 2),
    }[what]()
    a, b = base[:, 0], other[:, 0]
    assert abs(_corr(a, b)) < 5 / math.sqrt(a.numel())
    assert _pvalue_2d(a, b) > ALPHA


def test_uniforms_avalanche() -> None:
    """Flipping any one bit of the seed (64), the counter (64) or the salt (32) flips each of the
    24 output bits of u with probability 1/2 (within 5.5 standard errors)."""
    g = torch.Generator().manual_seed(4)
    n = 8000
    seed = torch.randint(-2 ** 62, 2 ** 62, (n,), generator=g)
    counter = torch.randint(0, 2 ** 40, (n,), generator=g)
    salt = 0x1234
    base = (uniforms(seed, counter, salt, 1)[:, 0] * 2 ** 24).long()
    shifts = torch.arange(24)
    flips = [uniforms(seed ^ (1 << b if b < 63 else -2 ** 63), counter, salt, 1) for b in range(64)]
    flips += [uniforms(seed, counter ^ (1 << b if b < 63 else -2 ** 63), salt, 1) for b in range(64)]
    flips += [uniforms(seed, counter, salt ^ (1 << b), 1) for b in range(32)]
    for i, other in enumerate(flips):
        changed = (base ^ (other[:, 0] * 2 ** 24).long())[:, None] >> shifts & 1
        rate = changed.double().mean(0)
        assert float((rate - 0.5).abs().max()) < 5.5 * 0.5 / math.sqrt(n), f"input bit #{i}"


def test_pair_test_rejects_a_weak_generator() -> None:
    """Negative control: a 2-D Weyl lattice (counter * a + seed * b mod 2^32, no mixing) is even
    more evenly spread than random in 1-D, so the 1-D test passes; the 2-D test of adjacent
    counters must reject it (u(c + 1) - u(c) is a constant)."""
    seed, counter = _grid()

    def weyl(c: torch.Tensor) -> torch.Tensor:
        return (((c * 0x9E3779B9 + seed * 0x6A09E667) & 0xFFFFFFFF) >> 8).float() / 2 ** 24
    assert _pvalue_1d(weyl(counter)) > ALPHA
    assert _pvalue_2d(weyl(counter), weyl(counter + 1)) < 1e-12


def test_uniforms_argument_errors() -> None:
    with pytest.raises(TypeError, match="seed: must be an integer tensor"):
        uniforms(torch.zeros(3), _i64(0, 0, 0), 0, 1)
    with pytest.raises(ValueError, match=r"counter: shape \[2\], expected \[3\]"):
        uniforms(_i64(0, 1, 2), _i64(0, 0), 0, 1)
    with pytest.raises(ValueError, match="n=0"):
        uniforms(_i64(0), _i64(0), 0, 0)


# ---- probs -------------------------------------------------------------------------------------

def test_probs_equal_target_probs_row_by_row() -> None:
    g = torch.Generator().manual_seed(0)
    temps = [0.0, 1.0, 0.7, 2.0, 0.3, 1.0, 1.3, 0.0]
    top_ps = [1.0, 1.0, 0.8, 0.5, 0.95, 0.05, 0.9, 0.3]
    logits = 3 * torch.randn(len(temps), 50, generator=g)
    got = probs(logits, torch.tensor(temps), torch.tensor(top_ps))
    assert got.dtype == torch.float32
    for i, (t, p) in enumerate(zip(temps, top_ps)):
        torch.testing.assert_close(got[i], target_probs(logits[i:i + 1], t, p)[0])
    # the documented example of test_sampling, batched
    lg = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(4, 4)
    got = probs(lg, torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([1.0, 0.8, 0.81, 0.01]))
    torch.testing.assert_close(got, torch.tensor([
        [1.0, 0, 0, 0], [0.625, 0.375, 0, 0], [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
        [1.0, 0, 0, 0]]))


def test_probs_over_several_chunks_and_ties() -> None:
    g = torch.Generator().manual_seed(9)
    vocab = 3000                                          # > CHUNK: the chunked cumsum
    logits = 2 * torch.randn(6, vocab, generator=g)
    temps, top_ps = [1.0, 0.6, 1.4, 1.0, 0.9, 2.0], [0.9, 0.5, 0.97, 0.2, 1.0, 0.6]
    got = probs(logits, torch.tensor(temps), torch.tensor(top_ps))
    for i, (t, p) in enumerate(zip(temps, top_ps)):
        torch.testing.assert_close(got[i], target_probs(logits[i:i + 1], t, p)[0])
    # tokens tied at the cut are all kept (the reference would keep an arbitrary one of them)
    tied = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2], [0.4, 0.3, 0.15, 0.15]]))
    got = probs(tied, torch.ones(2), torch.full((2,), 0.5))
    torch.testing.assert_close(got, torch.tensor([[0.4, 0.2, 0.2, 0.2], [0.4 / 0.7, 0.3 / 0.7, 0, 0]]))


def test_probs_padded_rows_are_finite() -> None:
    zeros = torch.zeros(3, 8)
    got = probs(zeros, torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, 1.0]))
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.sum(-1), torch.ones(3))
    with pytest.raises(ValueError, match=r"top_p: shape \[2\], expected \[3\]"):
        probs(zeros, torch.ones(3), torch.ones(2))


# ---- sample_from -------------------------------------------------------------------------------

def test_sample_from_is_the_exact_inverse_cdf() -> None:
    """Dyadic probabilities and a grid of u: each token gets exactly its share of the grid."""
    p = torch.tensor([[0.25, 0.0, 0.5, 0.0, 0.25, 0.0],     # zeros in the middle and last
                      [0.0, 0.0, 0.125, 0.375, 0.0, 0.5],   # zeros first, last bin used
                      [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])      # everything in the last bin
    m = 1024
    u = (torch.arange(m) + 0.5) / m
    tok = sample_from(p.repeat_interleave(m, 0), u.repeat(3))
    counts = torch.stack([torch.bincount(tok[i * m:(i + 1) * m], minlength=6) for i in range(3)])
    assert torch.equal(counts.double(), p.double() * m)


def test_sample_from_is_exact_across_chunks() -> None:
    """V = 1000 spans four chunks of CHUNK = 256 (the last one zero-padded): weights in units of
    1/1024 placed across chunk edges, some chunks empty, and a grid of u: exact counts again."""
    vocab, m = 1000, 1024
    assert vocab > 3 * CHUNK
    w = torch.zeros(2, vocab)
    w[0, [0, 255, 256, 511, 700, 999]] = torch.tensor([100.0, 200, 124, 300, 50, 250])
    w[1, [3, 768, 769, 998]] = torch.tensor([1.0, 511, 500, 12])     # chunks 1 and 2 empty
    u = (torch.arange(m) + 0.5) / m
    tok = sample_from(w.repeat_interleave(m, 0), u.repeat(2))
    for r in range(2):
        counts = torch.bincount(tok[r * m:(r + 1) * m], minlength=vocab).double()
        assert torch.equal(counts, w[r].double()), f"row {r}"


def test_sample_from_never_picks_a_zero_weight_token() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.rand(4000, 16, generator=g) * (torch.rand(4000, 16, generator=g) < 0.3)
    w[:, -1] = 0.0                                     # the last bin is empty in every row
    w[torch.arange(4000), torch.randint(0, 15, (4000,), generator=g)] += 1e-3  # no empty row
    edges = torch.tensor([0.0, 1 - 2 ** -24, 0.5, 1e-9])  # both ends of [0, 1) included
    u = torch.cat([edges.repeat(1000), torch.rand(4000, generator=g)])
    tok = sample_from(w.repeat(2, 1) * 7.0, u)          # unnormalised weights are fine
    assert bool((w.repeat(2, 1).gather(1, tok[:, None]) > 0).all())
    wide = torch.nn.functional.pad(w, (300, 300)).repeat(2, 1)  # the same across chunk edges
    tok = sample_from(wide, u)
    assert bool((wide.gather(1, tok[:, None]) > 0).all())
    # u at the top of [0, 1) takes the last token with weight; an all-zero row gives V - 1
    assert sample_from(torch.tensor([[0.2, 0.8, 0.0, 0.0]]), torch.tensor([1 - 2 ** -24])).item() == 1
    assert sample_from(torch.zeros(1, 4), torch.tensor([0.3])).item() == 3


def test_sampling_matches_the_distribution() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, generator=g) * 2
    n = 20000
    expected = target_probs(logits[None], 0.9, 0.9)[0]
    tok = sample_tokens(logits.expand(n, 12), torch.full((n,), 0.9), torch.full((n,), 0.9),
                        torch.arange(n), torch.full((n,), 3))
    counts = torch.bincount(tok, minlength=12)
    assert chi_square_pvalue(counts, expected) > ALPHA
    assert chi_square_pvalue(counts, target_probs(logits[None], 1.1, 0.9)[0]) < ALPHA


# ---- draft_step --------------------------------------------------------------------------------

def test_draft_step_greedy_rows_and_sampled_rows() -> None:
    g = torch.Generator().manual_seed(3)
    n, vocab = 20000, 10
    logits = torch.randn(vocab, generator=g).expand(n, vocab).clone()
    temperature = torch.where(torch.arange(n) % 2 == 0, 0.0, 0.8)
    top_p = torch.full((n,), 0.9)
    tok, q = draft_step(logits, temperature, top_p, torch.arange(n), torch.zeros(n, dtype=torch.int64), 0)
    greedy = torch.arange(n) % 2 == 0
    assert bool((tok[greedy] == logits[0].argmax()).all())
    assert torch.equal(q[greedy], torch.nn.functional.one_hot(tok[greedy], vocab).float())
    expected = target_probs(logits[:1], 0.8, 0.9)[0]
    torch.testing.assert_close(q[~greedy], expected.expand(n // 2, vocab))
    counts = torch.bincount(tok[~greedy], minlength=vocab)
    assert chi_square_pvalue(counts, expected) > ALPHA
    assert chi_square_pvalue(counts, target_probs(logits[:1], 0.8, 1.0)[0]) < ALPHA
    # another step is another draw (its own salt), same distribution
    tok1, _ = draft_step(logits, temperature, top_p, torch.arange(n), torch.zeros(n, dtype=torch.int64), 1)
    assert bool((tok1[~greedy] != tok[~greedy]).any())
    assert chi_square_pvalue(torch.bincount(tok1[~greedy], minlength=vocab), expected) > ALPHA


# ---- verify: greedy ----------------------------------------------------------------------------

def _greedy_case(b: int, s: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s + 1, vocab, generator=g)
    arg = logits.argmax(-1)
    draft = torch.randint(0, vocab, (b, s), generator=g)
    # a quarter of the rows copy the target's argmax (all accepted), a quarter miss at once
    draft[: b // 4] = arg[: b // 4, :s]
    draft[b // 4: b // 2, 0] = (arg[b // 4: b // 2, 0] + 1) % vocab
    num_draft = torch.randint(0, s + 1, (b,), generator=g)
    num_draft[: b // 8] = s
    return draft, logits, num_draft


def _check_against_accept_greedy(draft: torch.Tensor, logits: torch.Tensor, num_draft: torch.Tensor,
                                 accept: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
                                 fill: int) -> None:
    arg = logits.argmax(-1)
    for b in rows.tolist():
        nd = int(num_draft[b])
        a, toks = accept_greedy(draft[b, :nd].tolist(), arg[b, :nd + 1].tolist())
        assert int(accept[b]) == a, f"row {b}"
        assert tokens[b, :a + 1].tolist() == toks, f"row {b}"
        assert bool((tokens[b, a + 1:] == fill).all()), f"row {b}: filler"


@pytest.mark.parametrize("s,vocab", [(1, 3), (4, 3), (5, 2), (3, 50)])
def test_verify_greedy_equals_accept_greedy(s: int, vocab: int) -> None:
    b = 256
    draft, logits, num_draft = _greedy_case(b, s, vocab, seed=s * 100 + vocab)
    q = torch.rand(b, s, vocab)  # greedy rows ignore q
    accept, tokens = verify(draft, q, logits, torch.zeros(b), torch.full((b,), 0.5),
                            torch.arange(b), torch.zeros(b, dtype=torch.int64), num_draft, fill=-7)
    assert accept.dtype == torch.int64 and tokens.shape == (b, s + 1)
    _check_against_accept_greedy(draft, logits, num_draft, accept, tokens, torch.arange(b), -7)
    hist = torch.bincount(accept, minlength=s + 1)
    assert bool((hist > 0).all()), f"every accept length occurs: {hist.tolist()}"
    # num_draft < S: drafts beyond num_draft never count, even if they would match
    assert int(accept[:b // 8].min()) == s
    def accept_with(nd: torch.Tensor) -> torch.Tensor:
        return verify(draft, q, logits, torch.zeros(b), torch.ones(b), torch.arange(b),
                      torch.zeros(b, dtype=torch.int64), nd)[0]
    short = torch.full((b,), s - 1)
    assert torch.equal(accept_with(short), torch.minimum(accept_with(torch.full((b,), s)), short))


# ---- verify: lossless --------------------------------------------------------------------------

VOCAB = 6
START = 1      # with bigram_pair(6, seed=2): P(first draft kept) is 0.48, 0.23, 0.61 below


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8), (1.6, 0.9)])
def test_rounds_commit_the_target_distribution(steps: int, temperature: float, top_p: float) -> None:
    target, draft = bigram_pair(VOCAB, seed=2)
    n = 20000
    r = run_rounds(target, draft, START, steps, torch.full((n,), temperature),
                   torch.full((n,), top_p), torch.arange(n) + 1000 * steps)
    counts = joint_counts(r, VOCAB)
    assert chi_square_pvalue(counts, exact_joint(target, START, temperature, top_p)) > ALPHA
    first = counts.view(VOCAB, VOCAB).sum(1)
    assert chi_square_pvalue(first, transition(target, temperature, top_p)[START]) > ALPHA
    accept_law = exact_accept_lengths(target, draft, START, steps, temperature, top_p)
    hist = torch.bincount(r.first_accept, minlength=steps + 1)
    assert chi_square_pvalue(hist, accept_law) > ALPHA
    # P(first draft kept) = sum_x min(p(x), q(x)), within 5 standard errors
    rate, expect = float((r.first_accept >= 1).double().mean()), float(1 - accept_law[0])
    assert abs(rate - expect) < 5 * math.sqrt(expect * (1 - expect) / n)
    assert 0.1 < expect < 0.95, "the pair should both accept and reject"
    # the statistic tells the target from the draft and from a 30% hotter target
    assert chi_square_pvalue(first, transition(draft, temperature, top_p)[START]) < ALPHA
    assert chi_square_pvalue(counts, exact_joint(target, START, 1.3 * temperature, top_p)) < ALPHA


def test_drafting_without_top_p_is_still_lossless() -> None:
    """Any q is lossless if the drafts are drawn from it: a draft without top-p (no sort) against
    a top-p target commits the target's top-p distribution; the accept law uses the plain q."""
    target, draft = bigram_pair(VOCAB, seed=2)
    n, steps, temperature, top_p = 20000, 2, 0.8, 0.7
    r = run_rounds(target, draft, START, steps, torch.full((n,), temperature),
                   torch.full((n,), top_p), torch.arange(n) + 5000, draft_top_p=False)
    counts = joint_counts(r, VOCAB)
    assert chi_square_pvalue(counts, exact_joint(target, START, temperature, top_p)) > ALPHA
    law = exact_accept_lengths(target, draft, START, steps, temperature, top_p, draft_top_p=False)
    assert chi_square_pvalue(torch.bincount(r.first_accept, minlength=steps + 1), law) > ALPHA
    assert chi_square_pvalue(counts, exact_joint(target, START, temperature, 1.0)) < ALPHA


def _replacement_from_p(draft, q, target_logits, temperature, top_p, seed, counter, num_draft):
    """A deliberately wrong rule: at a rejection the replacement comes from p, not max(p - q, 0)."""
    accept, tokens = verify(draft, q, target_logits, temperature, top_p, seed, counter, num_draft)
    b, s1, vocab = target_logits.shape
    p = probs(target_logits.reshape(-1, vocab), temperature.repeat_interleave(s1),
              top_p.repeat_interleave(s1)).view(b, s1, vocab)
    p_a = p[torch.arange(b), accept]
    wrong = sample_from(p_a, uniforms(seed, counter, SALT_RESIDUAL, 1)[:, 0])
    rejected = accept < num_draft
    tokens[torch.arange(b), accept] = torch.where(rejected, wrong, tokens[torch.arange(b), accept])
    return accept, tokens


def _ignores_q(draft, q, *rest):
    """A deliberately wrong rule: q taken as uniform (the acceptance ratio ignores the draft)."""
    return verify(draft, torch.full_like(q, 1.0 / q.shape[-1]), *rest)


@pytest.mark.parametrize("wrong", [_replacement_from_p, _ignores_q])
def test_biased_acceptance_is_detected(wrong) -> None:
    """Negative control: the same test statistic rejects plausible bugs of the accept rule."""
    target, draft = bigram_pair(VOCAB, seed=2)
    n = 20000
    r = run_rounds(target, draft, START, 2, torch.ones(n), torch.ones(n), torch.arange(n) + 2000,
                   verify_fn=wrong)
    counts = joint_counts(r, VOCAB)
    assert chi_square_pvalue(counts, exact_joint(target, START, 1.0, 1.0)) < ALPHA


def test_sampled_verify_with_greedy_draft_limits() -> None:
    """The two corner cases of the accept rule: q == p accepts every draft; drafts that the target
    gives zero probability (top-p cut) are always rejected and never committed."""
    b, s, vocab = 2000, 3, 8
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(b, s + 1, vocab, generator=g).expand(b, s + 1, vocab).clone()
    temperature, top_p = torch.ones(b), torch.full((b,), 0.6)
    p = probs(logits.reshape(-1, vocab), temperature.repeat_interleave(s + 1),
              top_p.repeat_interleave(s + 1)).view(b, s + 1, vocab)
    seed, counter, nd = torch.arange(b), torch.zeros(b, dtype=torch.int64), torch.full((b,), s)
    draft = torch.stack([sample_from(p[:, j], uniforms(seed, counter, 50 + j, 1)[:, 0])
                         for j in range(s)], 1)
    accept, _ = verify(draft, p[:, :s], logits, temperature, top_p, seed, counter, nd)
    assert bool((accept == s).all())
    outside = p[:, :s].argmin(-1)                      # probability zero under top-p 0.6
    assert bool((p[:, :s].gather(2, outside[..., None]) == 0).all())
    accept, tokens = verify(outside, torch.full((b, s, vocab), 1.0 / vocab), logits, temperature,
                            top_p, seed, counter, nd)
    assert bool((accept == 0).all())
    assert bool((p[:, 0].gather(1, tokens[:, :1]) > 0).all())


# ---- batches: independence, mixing, padding ----------------------------------------------------

def _verify(case: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return verify(case["draft"], case["q"], case["target_logits"], case["temperature"],
                  case["top_p"], case["seed"], case["counter"], case["num_draft"])


def _rows(case: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[index] for k, v in case.items()}


def _padded(b: int, s: int, vocab: int, temperature: float, top_p: float) -> dict[str, torch.Tensor]:
    return dict(draft=torch.zeros(b, s, dtype=torch.int64), q=torch.zeros(b, s, vocab),
                target_logits=torch.zeros(b, s + 1, vocab), temperature=torch.full((b,), temperature),
                top_p=torch.full((b,), top_p), seed=torch.zeros(b, dtype=torch.int64),
                counter=torch.zeros(b, dtype=torch.int64), num_draft=torch.zeros(b, dtype=torch.int64))


def test_a_request_does_not_depend_on_the_batch() -> None:
    b, s, vocab = 48, 4, 16
    case = random_round(b, s, vocab, seed=7)
    accept, tokens = _verify(case)
    assert len(set(accept.tolist())) > 2
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(0))
    a2, t2 = _verify(_rows(case, perm))
    assert torch.equal(a2, accept[perm]) and torch.equal(t2, tokens[perm])
    for row in (0, 1, 29):   # alone, and among other rows / padded rows at another index
        a1, t1 = _verify(_rows(case, torch.tensor([row])))
        assert torch.equal(a1, accept[row:row + 1]) and torch.equal(t1, tokens[row:row + 1])
        other = random_round(5, s, vocab, seed=100 + row)
        mixed = {k: torch.cat([other[k], case[k][row:row + 1], _padded(3, s, vocab, 1.0, 0.0)[k]])
                 for k in case}
        am, tm = _verify(mixed)
        assert int(am[5]) == int(accept[row]) and torch.equal(tm[5], tokens[row])


def test_mixed_greedy_sampled_and_padded_rows() -> None:
    b, s, vocab = 60, 3, 8
    case = random_round(b, s, vocab, seed=11)
    greedy = case["temperature"] <= 0
    pads = [_padded(2, s, vocab, t, p) for t, p in [(0.0, 1.0), (1.0, 1.0), (1.0, 0.0), (0.7, 0.5)]]
    batch = {k: torch.cat([case[k]] + [pad[k] for pad in pads]) for k in case}
    accept, tokens = _verify(batch)
    # greedy rows follow accept_greedy, sampled rows are what they are alone
    _check_against_accept_greedy(case["draft"], case["target_logits"], case["num_draft"],
                                 accept, tokens, torch.nonzero(greedy)[:, 0], fill=0)
    alone_a, alone_t = _verify(_rows(case, ~greedy))
    assert torch.equal(accept[:b][~greedy], alone_a) and torch.equal(tokens[:b][~greedy], alone_t)
    # padded rows: nothing accepted, one in-range token
    assert bool((accept[b:] == 0).all())
    assert bool(((tokens[b:] >= 0) & (tokens[b:] < vocab)).all())
    # fully sampled rows commit only tokens the target allows
    p = probs(case["target_logits"].reshape(-1, vocab), case["temperature"].repeat_interleave(s + 1),
              case["top_p"].repeat_interleave(s + 1)).view(b, s + 1, vocab)
    committed_p = p.gather(2, tokens[:b, :, None])[..., 0]
    in_commit = torch.arange(s + 1)[None, :] <= accept[:b, None]
    assert bool((committed_p[in_commit] > 0).all())


def test_padded_rows_with_nan_free_garbage() -> None:
    """Out-of-range draft ids and zero q never break a row: nothing invalid is committed."""
    b, s, vocab = 4, 3, 8
    draft = torch.tensor([[-1, 3, 9], [8, 8, 8], [0, 0, 0], [7, -5, 2]])
    accept, tokens = verify(draft, torch.zeros(b, s, vocab), torch.zeros(b, s + 1, vocab),
                            torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.ones(b),
                            torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64),
                            torch.full((b,), s))
    assert accept[:2].tolist() == [0, 0]
    assert bool(((tokens >= 0) & (tokens < vocab)).all())


def test_static_shortcuts_equal_the_general_path() -> None:
    """`use_top_p=False` and `all_greedy=True` are promises about the batch; when they hold, the
    results are those of the general path (bit for bit)."""
    b, s, vocab = 40, 3, 32
    case = random_round(b, s, vocab, seed=21)
    case["top_p"] = torch.ones(b)
    a, t = _verify(case)
    a2, t2 = verify(*case.values(), use_top_p=False)
    assert torch.equal(a, a2) and torch.equal(t, t2)
    logits = torch.randn(b, vocab)
    args = (case["temperature"], case["top_p"], case["seed"], case["counter"])
    assert torch.equal(probs(logits, *args[:2]), probs(logits, *args[:2], use_top_p=False))
    tok, q = draft_step(logits, *args, 1)
    tok2, q2 = draft_step(logits, *args, 1, use_top_p=False)
    assert torch.equal(tok, tok2) and torch.equal(q, q2)
    # all greedy: q, top_p, seed and counter are not read
    case["temperature"] = torch.zeros(b)
    a, t = _verify(case)
    junk = {**case, "q": torch.full_like(case["q"], float("nan")), "top_p": torch.zeros(b),
            "seed": torch.full((b,), -1)}
    a2, t2 = verify(*junk.values(), all_greedy=True)
    assert torch.equal(a, a2) and torch.equal(t, t2)
    _check_against_accept_greedy(case["draft"], case["target_logits"], case["num_draft"],
                                 a2, t2, torch.arange(b), fill=0)
    zeros = torch.zeros(b)
    tok, q = draft_step(logits, zeros, *args[1:], 0)
    tok2, q2 = draft_step(logits, zeros, *args[1:], 0, all_greedy=True)
    assert torch.equal(tok, tok2) and torch.equal(q, q2)
    assert torch.equal(sample_tokens(logits, zeros, *args[1:], all_greedy=True), logits.argmax(-1))
    assert torch.equal(sample_tokens(logits, zeros, *args[1:]), logits.argmax(-1))


def test_verify_shape_errors_name_the_argument() -> None:
    case = random_round(4, 2, 8, seed=0)
    bad = [("q", torch.zeros(4, 3, 8), r"q: shape \[4, 3, 8\], expected \[4, 2, 8\]"),
           ("target_logits", torch.zeros(4, 2, 8), r"target_logits: shape \[4, 2, 8\], expected \[4, 3, V\]"),
           ("num_draft", torch.zeros(3, dtype=torch.int64), r"num_draft: shape \[3\], expected \[4\]"),
           ("draft", torch.zeros(4, dtype=torch.int64), r"draft: shape \[4\], expected \[B, S\]")]
    for name, value, match in bad:
        with pytest.raises(ValueError, match=match):
            _verify({**case, name: value})


def test_verify_timing_is_reported(capsys: pytest.CaptureFixture) -> None:
    """Not a benchmark: prints the CPU time of draft+verify at a realistic shape (B=16, S=4,
    V=32000) so regressions are visible in -s output; bounded generously."""
    b, s, vocab = 16, 4, 32000
    case = random_round(b, s, vocab, seed=3)
    _verify(case)
    t0 = time.perf_counter()
    for _ in range(3):
        _verify(case)
    dt = (time.perf_counter() - t0) / 3
    with capsys.disabled():
        print(f"\nverify B={b} S={s} V={vocab}: {dt * 1e3:.1f} ms/call (CPU, 1 thread)")
    assert dt < 5.0
