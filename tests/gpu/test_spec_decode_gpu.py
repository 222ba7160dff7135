"""`workers.spec_decode` on CUDA: the same numbers as on the CPU, no host synchronisation, and a
whole draft + verify round captured in one `torch.cuda.CUDAGraph` whose replays equal eager runs.

- uniforms are bit-identical on CPU and CUDA (integer hashing), so a request samples the same
  tokens on either device and on every TP rank;
- probs / sample_from / draft_step / verify give the CPU's results on CUDA (tokens equal; a flip
  would need a float rounding difference to land exactly on a decision boundary);
- `torch.cuda.set_sync_debug_mode("error")` turns any synchronising call (`.item()`, D2H copies,
  `nonzero`, ...) into an exception: the eager functions run under it;
- capture: S draft steps and the verify of a round (mixed greedy, sampled, top-p and padded rows,
  vocab 32000 so the large-sort kernels are the ones captured) in one graph; replays with new
  inputs copied into the static tensors equal eager runs on the same inputs;
- lossless at scale: 400k requests, the first two committed tokens and the accept length follow
  the exact laws (chi-square), as the CPU test does with 20k.
"""
from __future__ import annotations

import pytest
import torch

from spec_decode_fixtures import (
    ALPHA,
    bigram_pair,
    chi_square_pvalue,
    exact_accept_lengths,
    exact_joint,
    joint_counts,
    random_round,
    run_rounds,
)
from workers.spec_decode import draft_step, probs, sample_from, uniforms, verify

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DEV = "cuda"


def _verify(case: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return verify(case["draft"], case["q"], case["target_logits"], case["temperature"],
                  case["top_p"], case["seed"], case["counter"], case["num_draft"])


def test_uniforms_are_bit_identical_on_cpu_and_cuda() -> None:
    g = torch.Generator().manual_seed(0)
    seed = torch.randint(-2 ** 63, 2 ** 63 - 1, (4096,), generator=g)
    counter = torch.randint(0, 2 ** 62, (4096,), generator=g)
    for salt in (0, 1, 0x10003, 2 ** 32 - 1):
        cpu = uniforms(seed, counter, salt, 7)
        gpu = uniforms(seed.to(DEV), counter.to(DEV), salt, 7)
        assert torch.equal(cpu, gpu.cpu()), f"salt {salt}"


def test_probs_and_sampling_match_the_cpu() -> None:
    g = torch.Generator().manual_seed(1)
    n, vocab = 512, 32000
    logits = 4 * torch.randn(n, vocab, generator=g)
    temperature = torch.where(torch.arange(n) % 4 == 0, 0.0, 0.5 + torch.rand(n, generator=g))
    top_p = torch.where(torch.arange(n) % 2 == 0, 1.0, 0.9)
    cpu = probs(logits, temperature, top_p)
    gpu = probs(logits.to(DEV), temperature.to(DEV), top_p.to(DEV)).cpu()
    # The devices sum in different orders, so a token whose preceding mass is within rounding of
    # top_p can be kept on one and cut on the other: such rows differ in one boundary token.
    same = ((gpu > 0) == (cpu > 0)).all(-1)
    assert int((~same).sum()) <= n // 50, f"{int((~same).sum())} rows differ in their top-p set"
    flips = ((gpu > 0) != (cpu > 0)).sum(-1)
    assert int(flips.max()) <= 2
    torch.testing.assert_close(gpu[same], cpu[same], atol=1e-6, rtol=1e-4)
    u = torch.rand(n, generator=g)
    assert torch.equal(sample_from(cpu.to(DEV), u.to(DEV)).cpu(), sample_from(cpu, u))


@pytest.mark.parametrize("s,vocab", [(1, 64), (4, 4096)])
def test_draft_and_verify_match_the_cpu(s: int, vocab: int) -> None:
    case = random_round(96, s, vocab, seed=s)
    gpu_case = {k: v.to(DEV) for k, v in case.items()}
    a_cpu, t_cpu = _verify(case)
    a_gpu, t_gpu = _verify(gpu_case)
    assert torch.equal(a_gpu.cpu(), a_cpu) and torch.equal(t_gpu.cpu(), t_cpu)
    logits = torch.randn(96, vocab)
    tok_cpu, q_cpu = draft_step(logits, case["temperature"], case["top_p"], case["seed"],
                                case["counter"], 2)
    tok_gpu, q_gpu = draft_step(logits.to(DEV), gpu_case["temperature"], gpu_case["top_p"],
                                gpu_case["seed"], gpu_case["counter"], 2)
    assert torch.equal(tok_gpu.cpu(), tok_cpu)
    torch.testing.assert_close(q_gpu.cpu(), q_cpu, atol=1e-6, rtol=1e-4)


def test_no_host_synchronisation() -> None:
    case = random_round(32, 4, 4096, seed=3, device=DEV)
    logits = torch.randn(32, 4096, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        uniforms(case["seed"], case["counter"], 5, 4)
        p = probs(logits, case["temperature"], case["top_p"])
        sample_from(p, torch.rand(32, device=DEV))
        draft_step(logits, case["temperature"], case["top_p"], case["seed"], case["counter"], 0)
        _verify(case)
        draft_step(logits, case["temperature"], case["top_p"], case["seed"], case["counter"], 0,
                   use_top_p=False)
        draft_step(logits, case["temperature"], case["top_p"], case["seed"], case["counter"], 0,
                   all_greedy=True)
        verify(*case.values(), use_top_p=False)
        verify(*case.values(), all_greedy=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


class _StaticRound:
    """Static inputs of one round (S draft steps then verify) and the function a graph captures."""

    def __init__(self, b: int, s: int, vocab: int, flags: dict[str, bool]) -> None:
        self.s, self.flags = s, flags
        self.draft_logits = torch.zeros(s, b, vocab, device=DEV)
        self.target_logits = torch.zeros(b, s + 1, vocab, device=DEV)
        self.temperature = torch.zeros(b, device=DEV)
        self.top_p = torch.ones(b, device=DEV)
        self.seed = torch.zeros(b, dtype=torch.int64, device=DEV)
        self.counter = torch.zeros(b, dtype=torch.int64, device=DEV)
        self.num_draft = torch.zeros(b, dtype=torch.int64, device=DEV)

    def fill(self, gen: torch.Generator) -> None:
        """New inputs, copied in place: mixed greedy / sampled / top-p rows, the last two padded."""
        b = self.seed.shape[0]
        self.draft_logits.copy_(3 * torch.randn(self.draft_logits.shape, generator=gen))
        target = self.draft_logits.permute(1, 0, 2).cpu() + torch.randn(b, self.s, self.draft_logits.shape[2], generator=gen)
        self.target_logits[:, :self.s].copy_(target)
        self.target_logits[:, self.s].copy_(3 * torch.randn(b, self.draft_logits.shape[2], generator=gen))
        temperature = torch.rand(b, generator=gen) + 0.2
        temperature[::3] = 0.0
        if self.flags.get("all_greedy"):
            temperature.zero_()
        self.temperature.copy_(temperature)
        top_p = torch.where(torch.rand(b, generator=gen) < 0.5, 1.0, 0.8)
        self.top_p.copy_(top_p if self.flags.get("use_top_p", True) else torch.ones(b))
        self.seed.copy_(torch.randint(0, 2 ** 40, (b,), generator=gen))
        self.counter.copy_(torch.randint(0, 2 ** 20, (b,), generator=gen))
        self.num_draft.copy_(torch.randint(0, self.s + 1, (b,), generator=gen))
        self.draft_logits[:, -2:].zero_()                    # padded rows
        self.target_logits[-2:].zero_()
        self.num_draft[-2:] = 0

    def run(self) -> tuple[torch.Tensor, ...]:
        toks, qs = [], []
        for k in range(self.s):
            tok, q = draft_step(self.draft_logits[k], self.temperature, self.top_p, self.seed,
                                self.counter, k, **self.flags)
            toks.append(tok)
            qs.append(q)
        draft = torch.stack(toks, 1)
        accept, tokens = verify(draft, torch.stack(qs, 1), self.target_logits, self.temperature,
                                self.top_p, self.seed, self.counter, self.num_draft, **self.flags)
        return draft, accept, tokens


@pytest.mark.parametrize("b,s,vocab,flags", [
    (8, 4, 32000, {}), (33, 1, 1000, {}),
    (8, 4, 32000, {"use_top_p": False}), (8, 4, 32000, {"all_greedy": True})])
def test_round_captured_in_a_cuda_graph_equals_eager(b: int, s: int, vocab: int,
                                                     flags: dict[str, bool]) -> None:
    gen = torch.Generator().manual_seed(b * 10 + s)
    rnd = _StaticRound(b, s, vocab, flags)
    rnd.fill(gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                            # warm-up off the default stream
        for _ in range(2):
            rnd.run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = rnd.run()
    accepts = set()
    for _ in range(4):
        rnd.fill(gen)
        graph.replay()
        eager = rnd.run()
        for got, want in zip(static_out, eager):
            assert torch.equal(got, want)
        accept = static_out[1]
        assert bool((accept[-2:] == 0).all())               # padded rows: nothing accepted
        assert bool(((static_out[2] >= 0) & (static_out[2] < vocab)).all())
        accepts.update(accept.tolist())
    assert len(accepts) > 1, "the replays should see different accept lengths"


def test_lossless_at_scale_on_cuda() -> None:
    vocab, start, steps, temperature, top_p = 6, 1, 3, 0.7, 0.8
    target, draft = bigram_pair(vocab, seed=2)
    n = 400_000
    r = run_rounds(target, draft, start, steps, torch.full((n,), temperature, device=DEV),
                   torch.full((n,), top_p, device=DEV), torch.arange(n, device=DEV) + 77)
    counts = joint_counts(r, vocab)
    assert chi_square_pvalue(counts, exact_joint(target, start, temperature, top_p)) > ALPHA
    law = exact_accept_lengths(target, draft, start, steps, temperature, top_p)
    hist = torch.bincount(r.first_accept.cpu(), minlength=steps + 1)
    assert chi_square_pvalue(hist, law) > ALPHA
    assert chi_square_pvalue(counts, exact_joint(target, start, 1.1 * temperature, top_p)) < ALPHA
