"""Depth 0 with a draft head is a plain decode round: the head's cache lags and is caught up in one
forward every `catchup_every` depth-0 rounds and before drafting resumes. The caught-up draft cache
and head feature must be the ones a prefill of the same tokens gives (what running the head every
round gave), and the catch-up must run exactly where the rule says, eager and on the graph path."""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import ScriptPlanner, check_pages_back, engine_for, random_prompts, tiny_pair
from workers.runtime_state import RuntimeStatePool
from workers.sampling import SamplingParams
from workers.worker.graph_table import GraphPhase


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


def _engine(pair, script: list[int], graphs: bool, tiers=(0, 3), every: int = 8,
            defer: int = 128, max_batch: int = 4):
    engine = engine_for(*pair, "static", steps=3, cuda_graphs=graphs, catchup_rounds=every,
                        defer_prefill_width=defer, max_batch=max_batch)
    engine.pool = RuntimeStatePool(engine.worker, tiers)
    engine.planner = ScriptPlanner(script, graphs, 4)
    return engine


def _draft_state(engine, req) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(draft K and V of KV indices 0..n-1 for every layer, the head feature g_n, n)."""
    worker = engine.worker
    n = int(worker.slots.cache_len[req.slot])
    pool = worker.models.draft_kv
    ps = pool.page_size
    flat = torch.tensor([req.pages[j // ps] * ps + j % ps for j in range(n)])
    kv = [t.view(-1, *t.shape[2:])[flat] for t in pool.k + pool.v]
    return torch.stack(kv), worker.slots.feature[req.slot].clone(), n


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
@pytest.mark.parametrize("defer", [0, 128], ids=["head-in-prefill", "deferred"])
@pytest.mark.parametrize("rounds,every", [(3, 8), (8, 8), (13, 8), (13, 5), (4, 1)])
def test_caught_up_draft_cache_equals_a_prefill_of_the_same_tokens(pair, rounds, every,
                                                                   graphs, defer) -> None:
    """With the prompts' head forward in the prefill or deferred to the first catch-up (the
    prefill runs at depth 0): the same draft cache and head feature in the end."""
    prompts = random_prompts(3, vocab=64, seed=11, lo=3, hi=14)
    engine = _engine(pair, [0], graphs, every=every, defer=defer)
    reqs = [engine.add(p, SamplingParams(max_new_tokens=rounds + 5)) for p in prompts]
    for _ in range(rounds):
        engine.step()
    worker = engine.worker
    assert all(len(r.output_ids) == rounds + 1 for r in reqs)
    assert worker.lag.catchup_every == every and worker.lag.ring_tokens.shape[1] == every
    lag = rounds % every
    assert worker.lag.rounds_behind == lag
    assert [int(worker.lag.ring_len[r.slot]) for r in reqs] == [lag] * len(reqs)
    waiting = [len(r.prompt_ids) for r in reqs] if defer and rounds < every else [0] * len(reqs)
    if defer:   # the prompts wait until the first catch-up (a 32-slot prefill: width 32)
        assert [int(worker.lag.deferred_len[r.slot]) for r in reqs] == waiting
        assert worker.lag.deferred_width == (32 if rounds < every else 0)
    else:
        assert worker.lag.deferred_len is None and worker.lag.deferred_width == 0
    plan = engine.last_plan
    reach = worker.slots.reach
    worker.lag.catch_up(worker.state.payload, plan.batch_bucket or len(reqs), reach,
                        plan.batch_bucket)
    assert worker.lag.rounds_behind == 0 and all(int(worker.lag.ring_len[r.slot]) == 0
                                                 for r in reqs)
    assert worker.lag.deferred_width == 0
    assert defer == 0 or all(int(worker.lag.deferred_len[r.slot]) == 0 for r in reqs)

    # reference: a fresh worker prefilling prompt + outputs but the last (greedy: it redraws it)
    fresh = engine_for(*pair, "static", steps=3)
    refs = [fresh.add(p + r.output_ids[:-1], SamplingParams(max_new_tokens=4))
            for p, r in zip(prompts, reqs)]
    admitted = fresh.scheduler.admit()
    fresh.worker.prefill(admitted, sum(len(r.prompt_ids) for r in admitted), len(admitted))
    for req, ref in zip(reqs, refs):
        assert int(fresh.worker.slots.last_token[ref.slot]) == req.output_ids[-1]
        kv, g, n = _draft_state(engine, req)
        kv_ref, g_ref, n_ref = _draft_state(fresh, ref)
        assert n == n_ref == len(req.prompt_ids) + rounds
        torch.testing.assert_close(kv, kv_ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)
    engine.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_draft_extend_leaves_the_draft_cache_of_a_prefill_of_the_same_tokens(pair,
                                                                             graphs) -> None:
    """Speculating rounds (draft-extend runs the head's last layer for each row's last committed
    token only, and the prefill for each prompt's last token): the draft cache and head feature
    are still those of a prefill of the committed tokens."""
    target, head = tiny_pair(seed=0)
    with torch.no_grad():  # the bigram-copy head's attention and MLP count (they are zero there)
        gen = torch.Generator().manual_seed(1)
        for w in (head.layers[0].self_attn.o_proj.weight, head.layers[0].mlp.down_proj.weight):
            w.copy_(0.05 * torch.randn(w.shape, generator=gen, dtype=w.dtype))
    prompts = random_prompts(3, vocab=64, seed=13, lo=3, hi=20)
    engine = _engine((target, head), [3, 1, 3, 3, 1, 3], graphs, tiers=(1, 3))
    reqs = [engine.add(p, SamplingParams(max_new_tokens=40)) for p in prompts]
    for _ in range(6):
        engine.step()
    fresh = engine_for(target, head, "static", steps=3)
    refs = [fresh.add(p + r.output_ids[:-1], SamplingParams(max_new_tokens=4))
            for p, r in zip(prompts, reqs)]
    admitted = fresh.scheduler.admit()
    fresh.worker.prefill(admitted, sum(len(r.prompt_ids) for r in admitted), len(admitted))
    hist = engine.stats.accept_histogram   # rows a > 0 were read: some drafts accepted
    assert sum(v for a, v in hist.items() if a > 0) > 0, hist
    for req, ref in zip(reqs, refs):
        kv, g, n = _draft_state(engine, req)
        kv_ref, g_ref, n_ref = _draft_state(fresh, ref)
        assert n == n_ref == len(req.prompt_ids) + len(req.output_ids) - 1
        torch.testing.assert_close(kv, kv_ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)
    engine.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_catch_up_runs_every_catchup_every_rounds_and_before_drafting(pair, graphs) -> None:
    every = 8
    script = [0] * 20 + [3, 3] + [0] * 3 + [1] + [0] * 2 + [3]
    engine = _engine(pair, script, graphs, tiers=(0, 1, 3))
    worker = engine.worker
    assert worker.lag.catchup_every == every
    calls: list[int] = []
    real = worker.lag.catch_up

    def counted(*args):
        calls.append(engine.planner.i)
        return real(*args)

    worker.lag.catch_up = counted
    prompts = random_prompts(2, vocab=64, seed=3)
    reqs = [engine.add(p, SamplingParams(max_new_tokens=60)) for p in prompts]
    for _ in range(len(script)):
        engine.step()
    # rounds 8 and 16 (full rings), 21 (the first depth-3 round, after 4 depth-0 rounds), 26 (the
    # depth-1 round after 3 depth-0 rounds), 29 (the depth-3 round after 2)
    assert calls == [8, 16, 21, 26, 29]
    assert (worker.table is not None and len(worker.table.of(GraphPhase.CATCHUP)) > 0) == graphs
    while engine.scheduler.has_work:
        engine.step()
    engine.drain()
    plain = engine_for(pair[0], None, "nospec")
    ref = plain.generate(prompts, SamplingParams(max_new_tokens=60))
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    engine.close()
    check_pages_back(engine)


def test_a_head_without_a_depth_0_tier_keeps_no_lag_state(pair) -> None:
    engine = engine_for(*pair, "static", steps=3)
    assert engine.worker.lag.ring_len is None and engine.worker.lag.ring_features is None


class _Recording(ScriptPlanner):
    """A ScriptPlanner that keeps every round's shadow report."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.shadows: list = []

    def end_round(self, accepts, executed=None, plan=None, shadow=None, requests=None,
                  shadow_rows=None) -> None:
        self.shadows.append(shadow)
        super().end_round(accepts, executed, plan, shadow)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_catch_up_reports_the_heads_greedy_guesses_checked_against_the_ring(pair, graphs) -> None:
    """After 8 depth-0 rounds the catch-up reports, per row, how many of the head's greedy
    guesses over the ring matched the next committed token (7 checks for a full ring of 8):
    equal to the guesses of the head run over the whole sequence (a prefill), counted by hand.
    Rounds without a catch-up report nothing."""
    prompts = random_prompts(3, vocab=64, seed=21, lo=3, hi=14)
    engine = _engine(pair, [0], graphs)
    engine.planner = _Recording([0], graphs, 4)
    reqs = [engine.add(p, SamplingParams(max_new_tokens=20)) for p in prompts]
    for _ in range(8):
        engine.step()
    engine.drain()
    shadows = engine.planner.shadows
    assert shadows[:7] == [None] * 7 and shadows[7] is not None
    worker = engine.worker
    # reference: the head over prompt + the first 9 outputs, every position's output kept
    fresh = engine_for(*pair, "static", steps=3)
    outs: list = []
    head = fresh.worker.models.head

    def recording(*args, **kw):  # every position's output kept; the prefill gets what it asks
        outs.append(head(*args))
        return head(*args, **kw)

    fresh.worker.models.head = recording
    refs = [fresh.add(p + r.output_ids[:9], SamplingParams(max_new_tokens=2))
            for p, r in zip(prompts, reqs)]
    admitted = fresh.scheduler.admit()
    fresh.worker.prefill(admitted, sum(len(r.prompt_ids) for r in admitted), len(admitted))
    out, start, hits = outs[0], 0, 0
    for req, ref in zip(reqs, refs):
        p, o = len(req.prompt_ids), req.output_ids
        ring = worker.lag.ring_tokens[req.slot].tolist()
        assert ring == o[1:9]                         # the 8 tokens of the depth-0 rounds
        # the head's output after the ring token at position p+1+j is row p+j of its prefill
        with torch.inference_mode():
            logits = head.compute_logits(out[start + p:start + p + 7])
        guess = logits.argmax(-1).tolist()
        hits += sum(g == t for g, t in zip(guess, o[2:9]))
        start += len(ref.prompt_ids)
    assert shadows[7] == (hits, 7 * len(reqs), len(reqs))
    assert 0 < hits < 7 * len(reqs)                   # the check can tell hits from misses
    engine.close()


def test_round_cost_chains_hold_one_catch_up_at_depth_0(pair) -> None:
    """`measure_round_costs` times depth 0 with a head over chains of `catchup_rounds` rounds,
    each holding exactly one catch-up (its share is in the cost), and the other tiers over
    chains of `COST_CHAIN` rounds, which start with an empty lag ring (no catch-up)."""
    from workers.worker.round_cost import COST_CHAIN

    every, repeats = 5, 2
    engine = _engine(pair, [0], False, tiers=(0, 1, 3), every=every)
    worker = engine.worker
    launched: list[int] = []
    catch_ups: list[int] = []
    launch, catch_up = worker.launch, worker.lag.catch_up
    worker.launch = lambda *a: launched.append(worker.steps) or launch(*a)
    worker.lag.catch_up = lambda *a: catch_ups.append(worker.steps) or catch_up(*a)
    table = engine.measure_round_costs(repeats=repeats)
    buckets = sorted(table)
    assert buckets and all(sorted(row) == [0, 1, 3] for row in table.values())
    chains = (repeats + 1) * len(buckets)   # a warm-up chain and `repeats` per tier and bucket
    assert launched.count(0) == chains * every
    assert launched.count(1) == launched.count(3) == chains * COST_CHAIN
    assert catch_ups == [0] * chains        # one per depth-0 chain, none before a deeper one
    engine.close()


class _Accepts(ScriptPlanner):
    """A ScriptPlanner that keeps every round's accept lengths."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.accepts: list[list[int]] = []

    def end_round(self, accepts, executed=None, plan=None, shadow=None, requests=None,
                  shadow_rows=None) -> None:
        self.accepts.append([int(a) for a in accepts])
        super().end_round(accepts, executed, plan, shadow)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_deferred_prompts_draft_as_prompts_run_through_the_head_in_the_prefill(pair,
                                                                               graphs) -> None:
    """Admissions at depth 0 (deferred) and above it (not), slots reused — a request whose
    prompt was still waiting finishes and a request prefilled above depth 0 takes its slot —
    then drafting: every round accepts what it accepts with the head run in each prefill, and
    the outputs are the plain engine's. A waiting prompt left in a reused slot would overwrite
    the new request's draft cache at the next catch-up (its accepts would change)."""
    every = 6
    script = [0] * 3 + [3] * 4 + [0] * 9 + [1, 3] + [0] * 2 + [3] * 40
    prompts = random_prompts(7, vocab=64, seed=5, lo=3, hi=30)
    budgets = [4, 9, 4, 25, 12, 3, 20]   # the first ends in round 3, its slot refilled at depth 3
    runs = []
    for defer in (0, 128):
        engine = _engine(pair, script, graphs, tiers=(0, 1, 3), every=every, defer=defer,
                         max_batch=2)
        engine.planner = _Accepts(script, graphs, 2)
        deferred = []
        prefill = engine.worker.prefill

        def counted(reqs, *args, _prefill=prefill, _worker=engine.worker, _out=deferred):
            before = _worker.lag.deferred_width
            _prefill(reqs, *args)
            _out.append(_worker.lag.deferred_width > before)
        engine.worker.prefill = counted
        reqs = [engine.add(p, SamplingParams(max_new_tokens=b)) for p, b in zip(prompts, budgets)]
        while engine.scheduler.has_work:
            engine.step()
        engine.drain()
        runs.append(([r.output_ids for r in reqs], engine.planner.accepts, deferred))
        check_pages_back(engine)
        engine.close()
    (outs0, accepts0, deferred0), (outs1, accepts1, deferred1) = runs
    assert not any(deferred0) and 0 < sum(deferred1) < len(deferred1)
    assert accepts1 == accepts0 and any(a > 0 for row in accepts0 for a in row)
    plain = engine_for(pair[0], None, "nospec")
    ref = plain.generate(prompts, [SamplingParams(max_new_tokens=b) for b in budgets])
    assert outs1 == outs0 == [r.output_ids for r in ref]


def test_defer_prefill_width_picks_the_widths_whose_head_waits(pair) -> None:
    worker = _engine(pair, [0], False, defer=100).worker
    assert worker.lag.defer_widths == (32, 64) and worker.lag.deferred_tokens.shape[1] == 64
    assert _engine(pair, [0], False, defer=31).worker.lag.deferred_len is None
    with pytest.raises(ValueError, match="defer_prefill_width=-1"):
        _engine(pair, [0], False, defer=-1)


def test_a_deferred_prompt_caught_up_alone_equals_the_prefills_head(pair) -> None:
    """A prefill at depth 0 keeps the head's inputs; a catch-up before any round (no ring: the
    prompts alone) writes the draft cache and head feature the head in the prefill writes."""
    prompts = random_prompts(3, vocab=64, seed=13, lo=3, hi=40)
    states = []
    for defer in (0, 128):
        engine = _engine(pair, [0], False, defer=defer)
        engine.pool.apply(0)
        worker = engine.worker
        reqs = [engine.add(p, SamplingParams(max_new_tokens=4)) for p in prompts]
        admitted = engine.scheduler.admit()
        longest = max(len(p) for p in prompts)
        worker.prefill(admitted, sum(len(r.prompt_ids) for r in admitted), len(admitted), longest)
        assert worker.lag.deferred_width == (64 if defer else 0)
        worker.slots.round_rows[:len(reqs)] = torch.tensor([r.slot for r in reqs])
        worker.lag.catch_up(worker.state.payload, len(reqs), worker.slots.reach, None)
        assert worker.lag.deferred_width == 0 and worker.lag.rounds_behind == 0
        states.append([_draft_state(engine, r) for r in reqs])
        engine.close()
    for (kv, g, n), (kv_ref, g_ref, n_ref) in zip(states[1], states[0]):
        assert n == n_ref
        torch.testing.assert_close(kv, kv_ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)
