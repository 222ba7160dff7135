"""Sampling features under speculation: top-k, min_tokens, presence/frequency/repetition
penalties, logprobs and prompt logprobs (`docs/sampling.md`).

Each is checked where it can break losslessness:
- the device distribution (`probs` with top-k) equals the host reference row by row, and the
  composition order (top-p of the renormalised top-k) is told apart from the other order;
- `process_logits` at every verify position equals the host reference recomputed from that
  position's own prefix (committed tokens + the drafts before it), including repeated drafts and
  the min_tokens boundary inside a window; neutral controls leave logits bit-identical;
- rejection sampling with top-k commits the target's top-k distribution (chi-square; the
  statistic rejects the distribution without top-k); an engine running speculative sampling with
  top-k, min_tokens and all three penalties commits the exact joint of its first three tokens
  computed independently (dense attention, each prefix processed by the host reference), and the
  statistic rejects the joint without the penalties and the one without top-k;
- greedy speculative decoding with the features equals greedy decoding without speculation (and
  through the graph path's bodies, with overlap, adaptive with a depth-0 tier), with logprobs equal
  within 1e-5; the features change the outputs (the test is not vacuous);
- sampled logprobs equal the target's log_softmax recomputed on the output by a dense forward;
  prompt logprobs equal the dense forward's on the prompt (padded, ragged and graph prefills);
- requests that use no feature run exactly as before: alone or beside processed requests they get
  the same tokens, and a run without processed requests never runs the processed variant (the
  per-slot counts it keeps stay zero).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adaptive_dist.config import AdaptiveConfig
from engine_fixtures import (LOSSLESS_STOP, check_pages_back, engine_for, random_prompts,
                             tiny_config, tiny_pair)
from sampling_reference import (
    ALPHA,
    PROMPT,
    VOCAB,
    chi_square_pvalue,
    dense_logits,
    exact_joint,
    processed_logits,
    target_probs,
)
from workers.kv_cache import PageAllocator
from workers.sampling import SamplingParams
from workers.scheduler import Request, Scheduler
from workers.spec_decode import Controls, draft_step, probs, process_logits, verify
from workers.worker.graph_table import GraphPhase

torch.set_num_threads(1)


# ---- parameters ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"top_k": -2}, r"top_k=-2: must be an integer >= 1, or 0 or -1 \(off\)"),
    ({"top_k": 2.5}, "top_k=2.5"),
    ({"min_tokens": -1}, "min_tokens=-1"),
    ({"min_tokens": 9, "max_new_tokens": 8}, r"min_tokens=9: must be an integer in \[0, "
                                             r"max_new_tokens=8\]"),
    ({"presence_penalty": 2.5}, r"presence_penalty=2.5: must be a number in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty=nan"),
    ({"repetition_penalty": 0.0}, "repetition_penalty=0.0: must be a finite number > 0"),
    ({"logprobs": 21}, r"logprobs=21: must be None or an integer in \[0, 20\]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs=-1"),
    ({"logprobs": True}, "logprobs=True"),
])
def test_bad_feature_params_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_which_requests_are_processed() -> None:
    """`processed` selects the round's processed variant and the first token's rewind: only the
    features that change the target's distribution or ask for logprobs."""
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=-1) == SamplingParams()
    assert not SamplingParams().processed
    assert not SamplingParams(top_k=5).processed                    # greedy: top-k is moot
    assert SamplingParams(temperature=0.8, top_k=5).processed
    assert not SamplingParams(min_tokens=3).processed               # no stop id to hold back
    assert SamplingParams(min_tokens=3, stop_token_ids=(2,)).processed
    assert SamplingParams(presence_penalty=-0.5).processed
    assert SamplingParams(frequency_penalty=0.1).processed
    assert SamplingParams(repetition_penalty=1.1).processed
    assert SamplingParams(logprobs=0).processed
    assert not SamplingParams(prompt_logprobs=3).processed          # the prefill's alone


def test_stops_before_min_tokens_are_not_stops() -> None:
    """The host's stop rule agrees with the device's mask: a stop id among the first
    `min_tokens` outputs does not end the request (the device never draws one there)."""
    req = Request(0, [1, 2], SamplingParams(max_new_tokens=8, min_tokens=3,
                                            stop_token_ids=(5,)))
    req.commit([5, 1, 5])
    assert req.output_ids == [5, 1, 5] and req.finish_reason is None
    req.commit([2, 5, 7])
    assert req.output_ids == [5, 1, 5, 2, 5] and req.finish_reason == "stop"
    plain = Request(1, [1, 2], SamplingParams(max_new_tokens=8, stop_token_ids=(5,)))
    plain.commit([5, 1])
    assert plain.output_ids == [5] and plain.finish_reason == "stop"


def test_prompt_logprobs_refused_where_replicas_cannot_agree() -> None:
    scheduler = Scheduler(PageAllocator(64, 4), 2, 128, lambda r: 8, prompt_logprobs=False)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with several DP"):
        scheduler.add(Request(0, [1, 2, 3], SamplingParams(prompt_logprobs=1)))
    scheduler.add(Request(1, [1, 2, 3], SamplingParams(logprobs=1)))   # generated ones are fine


# ---- top-k on the device ---------------------------------------------------------------------

def test_top_k_probs_equal_the_reference() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def dev(top_k: int, top_p: float) -> torch.Tensor:
        return probs(logits, torch.ones(1), torch.tensor([top_p]), top_k=torch.tensor([top_k]))
    torch.testing.assert_close(dev(2, 1.0), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    kept3 = torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95
    torch.testing.assert_close(dev(3, 1.0), kept3)
    # top-p of the renormalised top-3 (0.526, 0.842 before the third): 0.82 keeps two; top-p of
    # the full distribution (0.5, 0.8 before the third) would keep three
    torch.testing.assert_close(dev(3, 0.82), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(dev(3, 0.85), kept3)
    torch.testing.assert_close(dev(0, 0.82), kept3)
    torch.testing.assert_close(target_probs(logits, 1.0, 0.82, 3), dev(3, 0.82))

    g = torch.Generator().manual_seed(3)
    n, vocab = 240, 300   # more than one CHUNK: the chunked cumsum
    logits = torch.randn(n, vocab, generator=g) * 3
    temperature = torch.rand(n, generator=g) + 0.3
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.99])[torch.arange(n) % 4]
    top_k = torch.tensor([0, 1, 5, 40, vocab, vocab + 7])[torch.arange(n) % 6]
    got = probs(logits, temperature, top_p, top_k=top_k)
    for r in range(n):
        want = target_probs(logits[r:r + 1], float(temperature[r]), float(top_p[r]),
                            int(top_k[r]))
        torch.testing.assert_close(got[r:r + 1], want, atol=1e-6, rtol=1e-5)
    # rows without top-k are bit-identical to the path without it
    assert torch.equal(probs(logits, temperature, top_p, top_k=torch.zeros(n, dtype=torch.long)),
                       probs(logits, temperature, top_p))


# ---- logits processing per verify position -----------------------------------------------------

def _controls_case(b: int, w: int, vocab: int, seed: int):
    """Random rows: a prompt, committed outputs, drafts (repeats likely: small vocabulary), the
    params, and the `Controls` / counter the device reads for them."""
    g = torch.Generator().manual_seed(seed)
    rows, stop_ids, until, counter = [], [], [], []
    counts = torch.zeros(b, vocab, dtype=torch.int32)
    seen = torch.zeros(b, vocab, dtype=torch.bool)
    for i in range(b):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 6, (1,), generator=g)),),
                               generator=g).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 5, (1,), generator=g)),),
                               generator=g).tolist()
        stops = torch.randperm(vocab, generator=g)[:int(torch.randint(0, 3, (1,),
                                                                      generator=g))].tolist()
        min_tokens = int(torch.randint(0, 8, (1,), generator=g))
        if i % 5 == 0:
            params = SamplingParams(max_new_tokens=16)
        else:
            params = SamplingParams(
                max_new_tokens=16, min_tokens=min_tokens, stop_token_ids=tuple(stops),
                presence_penalty=float(torch.rand(1, generator=g) * 4 - 2),
                frequency_penalty=float(torch.rand(1, generator=g) * 4 - 2),
                repetition_penalty=float(torch.rand(1, generator=g) * 2 + 0.3))
        rows.append((prompt, output, params))
        for t in output:
            counts[i, t] += 1
        seen[i, prompt] = True
        m = list(params.stop_token_ids) or [0]
        stop_ids.append((m * 4)[:4])
        until.append(len(prompt) + params.min_tokens if params.stop_token_ids else 0)
        counter.append(len(prompt) + len(output) - 1)
    f32 = torch.float32
    controls = Controls(
        top_k=torch.zeros(b, dtype=torch.long), stop_ids=torch.tensor(stop_ids),
        stop_until=torch.tensor(until),
        presence=torch.tensor([p.presence_penalty for _, _, p in rows], dtype=f32),
        frequency=torch.tensor([p.frequency_penalty for _, _, p in rows], dtype=f32),
        repetition=torch.tensor([p.repetition_penalty for _, _, p in rows], dtype=f32),
        counts=counts, seen=seen)
    logits = torch.randn(b, w, vocab, generator=g) * 2
    draft = torch.randint(0, vocab, (b, w - 1), generator=g)
    if w > 3:
        draft[::3, 2] = draft[::3, 0]   # a draft token twice in one window
    return rows, controls, torch.tensor(counter), logits, draft


def test_process_logits_per_position_equals_the_reference() -> None:
    b, w, vocab = 60, 5, 7
    rows, controls, counter, logits, draft = _controls_case(b, w, vocab, seed=4)
    got = process_logits(logits, counter, controls, draft).double()
    masked_any = boundary = 0
    for i, (prompt, output, params) in enumerate(rows):
        for j in range(w):
            prefix = output + draft[i, :j].tolist()   # position j conditions on d_1 .. d_j
            want = processed_logits(logits[i, j], prompt, prefix, params)
            assert torch.equal(torch.isinf(got[i, j]), torch.isinf(want)), (i, j)
            fin = torch.isfinite(want)
            torch.testing.assert_close(got[i, j][fin], want[fin], atol=1e-5, rtol=1e-5)
            masked_any += bool(torch.isinf(want).any())
            boundary += j > 0 and bool(torch.isinf(want).any()) != bool(
                torch.isinf(processed_logits(logits[i, j - 1], prompt, prefix[:-1],
                                             params)).any())
    assert masked_any and boundary, "min_tokens should mask, and end inside some window"
    # neutral controls: bit-identical logits
    neutral = Controls.neutral(b, vocab)
    assert torch.equal(process_logits(logits, counter, neutral, draft), logits)


def test_process_logits_without_drafts_is_plain_decoding() -> None:
    """W = 1 (depth 0, the prefill position): the committed prefix alone."""
    rows, controls, counter, logits, _ = _controls_case(30, 1, 9, seed=8)
    got = process_logits(logits, counter, controls).double()
    for i, (prompt, output, params) in enumerate(rows):
        want = processed_logits(logits[i, 0], prompt, output, params)
        fin = torch.isfinite(want)
        assert torch.equal(torch.isinf(got[i, 0]), ~fin)
        torch.testing.assert_close(got[i, 0][fin], want[fin], atol=1e-5, rtol=1e-5)


# ---- rejection sampling keeps top-k ------------------------------------------------------------

def _rounds_with_top_k(target: torch.Tensor, draft_t: torch.Tensor, start: int, steps: int,
                       temperature: float, top_p: float, top_k: int, n: int,
                       seed0: int) -> torch.Tensor:
    """Counts [V*V] of the first two committed tokens of two speculative rounds over a bigram
    pair, the draft without top-k, the target with it."""
    vocab = target.shape[0]
    t, p, k = torch.full((n,), temperature), torch.full((n,), top_p), torch.full((n,), top_k)
    seed = torch.arange(n) + seed0
    last = torch.full((n,), start)
    counter = torch.full((n,), 5)
    committed = torch.zeros(n, 2 * (steps + 1) + 1, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    cols = torch.arange(steps + 1)
    for _ in range(2):
        prev, toks, qs = last, [], []
        for s in range(steps):
            tok, q = draft_step(draft_t[prev], t, p, seed, counter, s)
            toks.append(tok)
            qs.append(q)
            prev = tok
        d = torch.stack(toks, 1)
        ctx = torch.cat([last[:, None], d], 1)
        accept, out = verify(d, torch.stack(qs, 1), target[ctx], t, p, seed, counter,
                             torch.full((n,), steps), top_k=k)
        idx = torch.where(cols[None] <= accept[:, None], count[:, None] + cols[None],
                          torch.full_like(out, committed.shape[1] - 1))
        committed.scatter_(1, idx, out)
        count += accept + 1
        last = out.gather(1, accept[:, None])[:, 0]
        counter += accept + 1
    return torch.bincount(committed[:, 0] * vocab + committed[:, 1],
                          minlength=vocab * vocab).double()


@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (3, 0.8)])
def test_rejection_sampling_commits_the_top_k_target(top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(2)
    vocab, start = 6, 1
    target = torch.randn(vocab, vocab, generator=g)
    draft_t = target + torch.randn(vocab, vocab, generator=g)
    counts = _rounds_with_top_k(target, draft_t, start, 2, 1.0, top_p, top_k, 20000, 100)

    def joint(k: int) -> torch.Tensor:
        p = target_probs(target, 1.0, top_p, k).double()
        return (p[start][:, None] * p).flatten()
    assert chi_square_pvalue(counts, joint(top_k)) > ALPHA
    assert chi_square_pvalue(counts, joint(0)) < ALPHA, "the test cannot tell top-k from none"


# ---- engines ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(10, vocab=64, seed=7)


def _greedy_params(n: int) -> list[SamplingParams]:
    """Every feature in turn (and plain requests between them); the stop id is one the target
    emits often, so min_tokens holds it back somewhere."""
    stop = (LOSSLESS_STOP,)
    kinds = [
        dict(),
        dict(presence_penalty=0.8, frequency_penalty=0.6, logprobs=3),
        dict(min_tokens=8, stop_token_ids=stop, logprobs=0),
        dict(repetition_penalty=1.6, stop_token_ids=stop),
        dict(frequency_penalty=-0.7, repetition_penalty=0.7, min_tokens=5,
             stop_token_ids=stop, logprobs=5),
    ]
    return [SamplingParams(max_new_tokens=10 + 5 * (i % 3), **kinds[i % len(kinds)])
            for i in range(n)]


def _run(engine, prompts, params):
    out = engine.generate(prompts, params)
    check_pages_back(engine)
    return out


def _same_logprobs(out, ref) -> None:
    for a, b in zip(out, ref):
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is None:
            continue
        assert len(a.logprobs) == len(a.output_ids) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-5
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert max((abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)), default=0) < 1e-5


@pytest.fixture(scope="module")
def greedy_reference(pair, prompts):
    return _run(engine_for(pair[0], None, "nospec"), prompts, _greedy_params(len(prompts)))


def test_greedy_reference_is_the_processed_target(pair, prompts, greedy_reference) -> None:
    """The reference itself, token by token: the argmax of the target's logits (dense forward
    over prompt + output so far) processed by the host reference, and their raw logprobs; a
    stop token ends it at or past min_tokens, else max_new_tokens does."""
    params = _greedy_params(len(prompts))
    for req, p in zip(greedy_reference, params):
        logits = dense_logits(pair[0], req.prompt_ids + req.output_ids).double()
        raw = torch.log_softmax(logits, -1)[len(req.prompt_ids) - 1:]
        for j, token in enumerate(req.output_ids):
            row = logits[len(req.prompt_ids) - 1 + j]
            assert int(processed_logits(row, req.prompt_ids, req.output_ids[:j], p).argmax()) \
                == token, (req.rid, j)
            if req.logprobs is not None:
                assert abs(req.logprobs[j].logprob - float(raw[j, token])) < 1e-5
                assert [t for t, _ in req.logprobs[j].top] == raw[j].topk(p.logprobs).indices.tolist()
        ended = req.output_ids[-1] in p.stop_token_ids and len(req.output_ids) > p.min_tokens
        assert ended or len(req.output_ids) == p.max_new_tokens


def test_greedy_reference_exercises_every_feature(pair, prompts, greedy_reference) -> None:
    """Without the features the outputs differ (penalties and min_tokens bite), the stop is
    held back by min_tokens and then taken, and logprobs come for every token."""
    params = _greedy_params(len(prompts))
    plain = [SamplingParams(max_new_tokens=p.max_new_tokens, stop_token_ids=p.stop_token_ids)
             for p in params]
    bare = _run(engine_for(pair[0], None, "nospec"), prompts, plain)
    changed = [a.output_ids != b.output_ids for a, b in zip(greedy_reference, bare)]
    assert not any(changed[0::5]) and all(any(changed[k::5]) for k in (1, 2, 3, 4))
    held = [i for i, p in enumerate(params) if p.min_tokens
            and LOSSLESS_STOP in bare[i].output_ids[:p.min_tokens]]
    assert held, "some request would stop before its min_tokens"
    for i in held:
        assert LOSSLESS_STOP not in greedy_reference[i].output_ids[:params[i].min_tokens]
    for r, p in zip(greedy_reference, params):
        assert (r.logprobs is not None) == (p.logprobs is not None)
        if r.logprobs:
            assert all(len(x.top) == p.logprobs for x in r.logprobs)
            assert all(x.token_id == t for x, t in zip(r.logprobs, r.output_ids))


@pytest.mark.parametrize("steps,graphs,overlap", [(1, False, False), (3, False, True),
                                                   (7, False, False), (3, True, False)],
                         ids=["1", "3-overlap", "7", "3-graphs"])
def test_greedy_speculation_with_features_equals_plain_greedy(pair, prompts, greedy_reference,
                                                              steps, graphs, overlap) -> None:
    engine = engine_for(*pair, "static", steps, cuda_graphs=graphs, overlap=overlap)
    out = _run(engine, prompts, _greedy_params(len(prompts)))
    assert [r.output_ids for r in out] == [r.output_ids for r in greedy_reference]
    _same_logprobs(out, greedy_reference)
    hist = engine.stats.accept_histogram
    assert hist[0] > 0 and sum(v for k, v in hist.items() if k > 0) > 0, hist
    if graphs:
        assert engine.stats.graph_rounds == engine.stats.rounds > 0
        accepts = engine.worker.table.of(GraphPhase.ACCEPT)
        assert {(k.batch, k.greedy) for k in accepts if k.steps == steps and k.processed} == {
            (b, g) for b in engine.worker.buckets for g in (False, True)}
    engine.close()


@pytest.mark.parametrize("policy", ["ema", "goodput"])
def test_adaptive_with_features_equals_plain_greedy(pair, prompts, greedy_reference,
                                                    policy) -> None:
    """Switching depths (and, with goodput, depth 0 with the draft cache lagging and deferred
    prefills) keeps every feature's tokens and logprobs."""
    if policy == "ema":
        config = AdaptiveConfig(warmup_batches=1, update_interval=1, ema_alpha=0.6,
                                initial_steps=7)
    else:
        config = AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3, 7), initial_steps=1,
                                warmup_batches=1, update_interval=1, probe_every=2,
                                round_cost={"0": 1.0, "1": 1.9, "3": 3.5, "7": 7.5})
    engine = engine_for(*pair, "ema", config=config, overlap=policy == "goodput")
    out = _run(engine, prompts, _greedy_params(len(prompts)))
    assert [r.output_ids for r in out] == [r.output_ids for r in greedy_reference]
    _same_logprobs(out, greedy_reference)
    assert engine.stats.switches >= 1
    if policy == "goodput":
        assert any(steps == 0 for _, steps in engine.stats.steps_timeline)


def test_plain_requests_are_unchanged_beside_processed_ones(pair, prompts) -> None:
    """Plain requests (greedy and sampled) get the same tokens alone and in batches with
    processed requests, whose slots they reuse (stale controls would leak into them); a run
    without processed requests never runs the processed variant (its counts stay zero)."""
    plain = [SamplingParams(max_new_tokens=12, temperature=0.9 if i % 2 else 0.0,
                            top_p=0.8 if i % 4 == 1 else 1.0) for i in range(len(prompts))]
    engine = engine_for(*pair, "static", 3)
    alone = [r.output_ids for r in _run(engine, prompts, plain)]
    assert int(engine.worker.slots.counts.sum()) == 0
    mixed = [p if i % 2 else
             SamplingParams(max_new_tokens=9, temperature=1.0, top_k=3, presence_penalty=1.0,
                            repetition_penalty=1.5, min_tokens=4,
                            stop_token_ids=(LOSSLESS_STOP,), logprobs=2)
             for i, p in enumerate(plain)]
    engine = engine_for(*pair, "static", 3, max_batch=3)
    n = len(prompts)
    out = engine.generate(prompts + prompts, mixed + plain, seeds=list(range(n)) * 2)
    check_pages_back(engine)   # the second half reuses the slots processed requests held
    assert int(engine.worker.slots.counts.sum()) > 0
    for i in range(n):
        if i % 2:
            assert out[i].output_ids == alone[i]
        assert out[n + i].output_ids == alone[i], i


# ---- sampled: distributions and logprobs -------------------------------------------------------

def test_speculative_sampling_with_features_matches_the_exact_distribution() -> None:
    target, head = tiny_pair(seed=2, eps=1.0, cfg=tiny_config(vocab=VOCAB, hidden=32))
    engine = engine_for(target, head, "static", steps=3, max_batch=64)
    n = 8000
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=4, max_new_tokens=3,
                            min_tokens=2, stop_token_ids=(3,), presence_penalty=0.7,
                            frequency_penalty=0.5, repetition_penalty=1.8)
    out = engine.generate([PROMPT] * n, params, seed=77)
    counts = torch.zeros(VOCAB ** 3)
    for req in out:
        assert 3 not in req.output_ids[:2]           # min_tokens holds the stop id back
        t0, t1, t2 = req.output_ids
        counts[(t0 * VOCAB + t1) * VOCAB + t2] += 1
    hist = engine.stats.accept_histogram
    assert hist[0] > 0 and hist[1] + hist[2] + hist[3] > 0, f"no rejections or no accepts: {hist}"
    exact = exact_joint(target, 1.0, 0.95, 4, params)
    assert abs(float(exact.sum()) - 1.0) < 1e-5
    assert chi_square_pvalue(counts, exact) > ALPHA
    unpenalised = SamplingParams(max_new_tokens=3, min_tokens=2, stop_token_ids=(3,))
    assert chi_square_pvalue(counts, exact_joint(target, 1.0, 0.95, 4, unpenalised)) < ALPHA
    assert chi_square_pvalue(counts, exact_joint(target, 1.0, 0.95, 0, params)) < ALPHA


def test_sampled_logprobs_are_the_targets_on_the_output(pair, prompts) -> None:
    """Each emitted token's logprob and its top alternatives equal the target's raw
    log_softmax at that prefix, recomputed by a dense forward over prompt + output."""
    target, head = pair
    params = [SamplingParams(temperature=1.1, top_k=6 if i % 2 else 0, max_new_tokens=9,
                             presence_penalty=0.5 * (i % 3), logprobs=4)
              for i in range(len(prompts))]
    out = _run(engine_for(target, head, "static", 3, overlap=True), prompts, params)
    hist_ok = False
    for req in out:
        ids = req.prompt_ids + req.output_ids
        lp = torch.log_softmax(dense_logits(target, ids).double(), -1)
        assert len(req.logprobs) == len(req.output_ids)
        for j, entry in enumerate(req.logprobs):
            row = lp[len(req.prompt_ids) - 1 + j]
            assert entry.token_id == req.output_ids[j]
            assert abs(entry.logprob - float(row[entry.token_id])) < 1e-5
            top = row.topk(4)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert np.allclose([v for _, v in entry.top], top.values.tolist(), atol=1e-5)
            hist_ok |= entry.token_id != entry.top[0][0]
    assert hist_ok, "sampling should emit a token other than the most likely one somewhere"


@pytest.mark.parametrize("prefill", ["padded", "ragged", "graphs"])
def test_prompt_logprobs_are_the_dense_forwards(pair, prompts, prefill: str) -> None:
    target, head = pair
    kw = {"padded": {}, "ragged": {"padded_prefill_tokens": 0},
          "graphs": {"cuda_graphs": True}}[prefill]
    params = [SamplingParams(max_new_tokens=4, prompt_logprobs=(i % 3) * 2 if i % 4 else None,
                             logprobs=1 if i % 5 == 0 else None) for i in range(len(prompts))]
    engine = engine_for(target, head, "static", 3, **kw)
    out = _run(engine, prompts, params)
    plain = _run(engine_for(target, head, "static", 3), prompts,
                 [SamplingParams(max_new_tokens=4) for _ in prompts])
    for req, p, ref in zip(out, params, plain):
        assert req.output_ids == ref.output_ids     # scoring does not change the tokens
        if p.prompt_logprobs is None:
            assert req.prompt_logprobs is None
            continue
        assert len(req.prompt_logprobs) == len(req.prompt_ids) and req.prompt_logprobs[0] is None
        lp = torch.log_softmax(dense_logits(target, req.prompt_ids).double(), -1)
        for i, entry in enumerate(req.prompt_logprobs[1:], start=1):
            assert entry.token_id == req.prompt_ids[i]
            assert abs(entry.logprob - float(lp[i - 1, entry.token_id])) < 1e-5
            top = lp[i - 1].topk(p.prompt_logprobs) if p.prompt_logprobs else None
            assert [t for t, _ in entry.top] == ([] if top is None else top.indices.tolist())
            if top is not None:
                assert max(abs(v - w) for (_, v), w in zip(entry.top, top.values.tolist())) < 1e-5
    assert any(len(r.prompt_ids) > 1 and r.prompt_logprobs for r in out)
    if prefill == "graphs":
        engine.close()
    assert math.isfinite(sum(e.logprob for r in out if r.prompt_logprobs
                             for e in r.prompt_logprobs[1:]))
