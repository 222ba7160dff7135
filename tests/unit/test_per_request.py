"""Per-request budgets (issue 32): each request drafts its own number of tokens inside a round
shape (draft forwards, packed verify tokens) the coordinator agrees.

- lossless: greedy output equals plain greedy token for token, eager and on the (emulated) graph
  path, with and without overlap; sampling keeps the target's joint law (chi-square);
- the budgets really vary inside a round and the shapes across rounds (the round log says so);
- the rule's pure parts: the fill fits its shape and is prefix-closed per request, the value
  curve grows with the tokens, the shape choice maximises expected tokens per second;
- refusals by name (config keys, flags, cost tables).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adaptive_dist.config import AdaptiveConfig, ConfigError, RoundCost, VerifyCost
from adaptive_dist.policy.budgets import (
    CAL_BINS,
    CAL_DECAY,
    CAL_WEIGHT,
    IDLE_DECAY,
    VALUE_SCALE,
    Estimates,
    PerRequestRule,
    SurvivalTracker,
    choose_shape,
    fill_budgets,
    shape_cost,
    value_curve,
)
from adaptive_dist.shape import RoundShape, token_bucket, token_ladder
from engine_fixtures import (
    check_pages_back,
    engine_for,
    lossless_params,
    per_request_config,
    random_prompts,
    synthetic_costs,
    tiny_pair,
)
from workers.round_log import RoundLog, read_round_log


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=1)


@pytest.fixture(scope="module")
def prompts(pair):
    return random_prompts(10, pair[0].config.vocab_size, seed=4)


@pytest.fixture(scope="module")
def reference(pair, prompts):
    engine = engine_for(pair[0], None, "nospec")
    return [r.output_ids for r in engine.generate(prompts, lossless_params(len(prompts)))]


def _logged(engine, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.jsonl"
    engine.round_log = RoundLog(path)
    return path


def _check_log(path: Path) -> list[dict]:
    lines = read_round_log(path)
    for rec in lines:
        if rec["kind"] != "decode":
            continue
        drafts = [q["draft"] for q in rec["requests"]]
        assert rec["verify_tokens"] == sum(d + 1 for d in drafts) <= rec["padded_tokens"]
        assert all(0 <= q["accepted"] <= q["draft"] <= rec["draft_forwards"]
                   for q in rec["requests"])
    return lines


@pytest.mark.parametrize("graphs,overlap", [(False, False), (True, False), (False, True)],
                         ids=["eager", "graph-path", "overlap"])
def test_greedy_per_request_equals_plain_greedy(pair, prompts, reference, tmp_path, graphs,
                                                overlap) -> None:
    engine = engine_for(*pair, "ema", config=per_request_config(per_token=0.05),
                        cuda_graphs=graphs, overlap=overlap)
    log = _logged(engine, tmp_path, "greedy")
    out = engine.generate(prompts, lossless_params(len(prompts)))
    engine.round_log.close()
    assert [r.output_ids for r in out] == reference
    lines = [r for r in _check_log(log) if r["kind"] == "decode"]
    # inside one round requests drafted differently, and the rounds took several shapes
    assert any(len({q["draft"] for q in r["requests"]}) > 1 for r in lines)
    assert len({(r["draft_forwards"], r["padded_tokens"]) for r in lines}) >= 3
    assert any(q["accepted"] > 0 for r in lines for q in r["requests"])
    assert engine.planner.stats.draft_tokens == sum(q["draft"] for r in lines
                                                    for q in r["requests"])
    check_pages_back(engine)


def test_per_request_sampling_keeps_the_target_law() -> None:
    from sampling_reference import VOCAB, check_keeps_target_law
    from engine_fixtures import tiny_config

    target, head = tiny_pair(seed=2, eps=1.0, cfg=tiny_config(vocab=VOCAB, hidden=32))
    engine = engine_for(target, head, "ema", config=per_request_config(per_token=0.05),
                        max_batch=64)
    check_keeps_target_law(engine, target)
    stats = engine.planner.stats
    assert 0 < stats.draft_tokens < 3 * stats.drafts * 7   # budgets below the deepest draft


# ---- the rule's pure parts ---------------------------------------------------------------------

def test_fill_fits_the_shape_and_takes_the_most_likely_positions() -> None:
    survivals = [[0.9, 0.8, 0.7], [0.1, 0.01, 0.001], [0.95, 0.94, 0.93]]
    # 3 requests, 8 tokens: 3 own + position 1 of each (3) + the 2 best others (request 2's
    # positions 2 and 3: 0.94, 0.93 beat request 0's 0.8)
    budgets = fill_budgets(survivals, RoundShape(3, 8))
    assert budgets == (1, 1, 3) and RoundShape(3, 8).fits(budgets)
    assert fill_budgets(survivals, RoundShape(3, 12)) == (3, 3, 3)
    assert fill_budgets(survivals, RoundShape(1, 12)) == (1, 1, 1)
    assert fill_budgets(survivals, RoundShape(3, 4)) == (0, 0, 1)   # the likeliest first
    assert fill_budgets(survivals, RoundShape(0, 4)) == (0, 0, 0)


def test_value_curve_grows_with_tokens_and_depth() -> None:
    survivals = [[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], [0.2] + [0.02] * 6]
    ladder = token_ladder(16)
    curve = value_curve(survivals, (0, 1, 3, 7), ladder)
    rows = [curve[i * len(ladder):(i + 1) * len(ladder)] for i in range(4)]
    for row in rows:
        assert row == sorted(row)
    assert rows[0][-1] == 2 * VALUE_SCALE          # depth 0: the requests' own tokens
    assert rows[3][-1] == round((2 + sum(survivals[0]) + sum(survivals[1])) * VALUE_SCALE)


def test_shape_choice_maximises_tokens_per_second() -> None:
    rounds, verify = synthetic_costs(per_token=0.05)
    table, vc = RoundCost.parse(rounds), VerifyCost.parse(verify)
    ladder = token_ladder(64)
    # one request that accepts everything, one that accepts nothing
    survivals = [[0.99] * 7, [0.01] * 7]
    curve = value_curve(survivals, (0, 1, 3, 7), ladder)
    shape, rate = choose_shape(curve, (0, 1, 3, 7), ladder, 2, 2, table, vc)
    best = max(((s, t) for s in (0, 1, 3, 7) for t in ladder if t >= 2),
               key=lambda st: (curve[(0, 1, 3, 7).index(st[0]) * len(ladder)
                                     + ladder.index(st[1])] / VALUE_SCALE
                               / shape_cost(table, vc, st[0], st[1], 2)))
    assert (shape.draft_forwards, shape.verify_tokens) == best
    assert shape.draft_forwards == 7 and shape.verify_tokens < 16   # not the full chain
    assert rate > 0


def test_tracker_learns_a_request_in_a_round_or_two() -> None:
    tracker = SurvivalTracker(7)
    for _ in range(2):
        tracker.observe([1, 2], [3, 3], [3, 0])
    good, bad = tracker.survival(1), tracker.survival(2)
    assert good[2] > 0.6 and good[6] > 0.3      # past its drafts too: its own rate
    assert bad[0] < 0.3 and bad[6] < 1e-3


def test_only_requests_due_a_check_get_position_1_first() -> None:
    # request 0 rejected its last check and is not due; request 1 is (new, or idle too long)
    survivals = [[0.05, 0.01, 0.001], [0.04, 0.01, 0.001], [0.95, 0.94, 0.93]]
    est = Estimates(survivals, [False, True, False])
    # 3 own tokens + 3 places: request 1's due check, then request 2's positions 1 and 2
    assert fill_budgets(est, RoundShape(3, 6)) == (0, 1, 2)
    # a plain list: every request due, as before
    assert fill_budgets(survivals, RoundShape(3, 6)) == (1, 1, 1)
    # the value curve reads the same order: its first place beyond the own tokens is the check
    ladder = token_ladder(12)
    curve = value_curve(est, (0, 3), ladder)
    four = len(ladder) + ladder.index(4)
    assert curve[four] == round((3 + 0.04) * VALUE_SCALE)
    with pytest.raises(ValueError, match="due flags"):
        Estimates(survivals, [True])


def test_a_request_idle_for_probe_every_rounds_is_due_again() -> None:
    tracker = SurvivalTracker(7)
    assert tracker.due(5, 8)                       # never drafted: due
    tracker.observe([5], [1], [0])                 # checked, rejected
    assert not tracker.due(5, 8)
    for i in range(8):
        assert not tracker.due(5, 8), i
        tracker.observe([5], [0], [0])             # drafts nothing
    assert tracker.due(5, 8)
    tracker.observe_shadow([5], [(1, 2)])          # a shadow check is a check
    assert not tracker.due(5, 8)


def test_a_round_that_drafted_nothing_ages_every_estimate_toward_the_pool() -> None:
    """At 0 draft forwards nothing renews an estimate: each request's counts lose weight by
    IDLE_DECAY per such round (rates kept), so a stretch at 0 does not hold the estimates at their
    low; a round in which the rank drafted keeps an idle request's counts as they were."""
    tracker = SurvivalTracker(7)
    for _ in range(3):
        tracker.observe([1, 2], [3, 3], [0, 3])    # 1 rejects at once, 2 accepts all
    low = tracker.raw_survival(1)[0]
    reached, hits = list(tracker.requests[1].reached), list(tracker.requests[1].hits)
    tracker.observe([1, 2], [0, 3], [0, 3])         # 2 drafted: 1's counts kept
    assert tracker.requests[1].reached == reached and tracker.requests[1].hits == hits
    tracker.observe([1, 2], [0, 0], [0, 0])         # nothing drafted: every count aged
    assert tracker.requests[1].reached == pytest.approx([x * IDLE_DECAY for x in reached])
    assert tracker.requests[1].hits == pytest.approx([x * IDLE_DECAY for x in hits])
    pooled = (sum(tracker.pooled.hits) + 0.5) / (sum(tracker.pooled.reached) + 1.0)
    after_one = tracker.raw_survival(1)[0]
    for _ in range(59):      # IDLE_DECAY ** 60: about 7% of the counts' weight left
        tracker.observe([1, 2], [0, 0], [0, 0])
    assert tracker.requests[1].reached == pytest.approx([x * IDLE_DECAY ** 60 for x in reached])
    now = tracker.raw_survival(1)[0]
    assert low < after_one < now < pooled and pooled - now < 0.3 * (pooled - low)


def _stream(seed: int, rounds: int, requests: int, p_accept: float):
    """A rank's rounds: every request drafts 7, each position accepted with ``p_accept`` given
    the one before (the same law for every request: its own history is noise)."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        accepts = []
        for _ in range(requests):
            a = 0
            while a < 7 and rng.random() < p_accept:
                a += 1
            accepts.append(a)
        yield list(range(requests)), [7] * requests, accepts


def test_calibration_scores_drafted_positions_by_their_raw_prediction() -> None:
    tracker = SurvivalTracker(7)
    assert tracker.survival(3) == tracker.raw_survival(3)   # nothing scored yet: raw
    predicted, survived = [0.0] * CAL_BINS, [0.0] * CAL_BINS
    for rids, budgets, accepts in _stream(0, 12, 4, 0.7):
        raws = [tracker.raw_survival(r) for r in rids]      # what the round was filled from
        predicted = [x * CAL_DECAY for x in predicted]
        survived = [x * CAL_DECAY for x in survived]
        for raw, d, a in zip(raws, budgets, accepts):
            for k in range(d):
                b = min(int(raw[k] * CAL_BINS), CAL_BINS - 1)
                predicted[b] += raw[k]
                survived[b] += k < a
        tracker.observe(rids, budgets, accepts)
    assert tracker.cal_predicted == pytest.approx(predicted)
    assert tracker.cal_survived == pytest.approx(survived)
    raw, got = tracker.raw_survival(0), tracker.survival(0)
    want, last = [], 1.0
    for r in raw:
        b = min(int(r * CAL_BINS), CAL_BINS - 1)
        last = min(last, r * (survived[b] + CAL_WEIGHT * r) / (predicted[b] + CAL_WEIGHT * r))
        want.append(last)
    assert got == pytest.approx(want)
    assert all(x >= y for x, y in zip(got, got[1:])) and got[0] <= 1.0
    # a round that drafted nothing scores nothing and decays nothing
    before = list(tracker.cal_predicted)
    tracker.observe([0, 1], [0, 0], [0, 0])
    assert tracker.cal_predicted == before


def test_calibration_brings_predictions_closer_to_what_survives() -> None:
    """Requests of one law whose own histories are noise: the raw estimate follows each
    request's last rounds (over-confident after full accepts, too low after a rejection); the
    calibrated one, scored on rounds it has not seen, errs less (Brier score)."""
    tracker = SurvivalTracker(7)
    raw_err = cal_err = 0.0
    for i, (rids, budgets, accepts) in enumerate(_stream(1, 120, 16, 0.8)):
        if i >= 40:
            for r, a in zip(rids, accepts):
                for k, (x, y) in enumerate(zip(tracker.raw_survival(r), tracker.survival(r))):
                    hit = float(k < a)
                    raw_err += (x - hit) ** 2
                    cal_err += (y - hit) ** 2
        tracker.observe(rids, budgets, accepts)
    assert cal_err < 0.97 * raw_err


def test_a_new_request_reads_what_the_last_new_ones_did_in_their_first_round() -> None:
    """After a change of regime the pool (every drafting round of every request, decayed slowly)
    still holds the old rate; a request never drafted reads the last few requests' first
    drafting rounds (``fresh_rates``), so it no longer drafts deep on the old regime's word."""
    tracker = SurvivalTracker(7)
    for _ in range(40):                               # a regime that accepts everything
        tracker.observe(list(range(8)), [7] * 8, [7] * 8)
    prior = tracker.prior()
    assert prior[0] > 0.9
    assert tracker.raw_survival(100)[0] > 0.9         # a new one expects the same
    for rid in (100, 101, 102):                       # the new regime: rejected at once
        tracker.observe([rid], [7], [0])
    fresh = tracker.raw_survival(103)
    assert fresh[0] < 0.5 * prior[0]
    assert fresh == pytest.approx(list(np.cumprod(tracker.fresh_rates(tracker.prior()))))
    # only a request's first drafting round counts: one that keeps rejecting adds nothing more
    before = list(tracker.fresh.reached)
    tracker.observe([100], [7], [0])
    assert tracker.fresh.reached == before
    # then new requests that accept bring it back within a few
    for rid in (104, 105, 106, 107):
        tracker.observe([rid], [7], [7])
    assert tracker.raw_survival(108)[0] > 0.8


def test_replica_ranks_with_different_local_state_pick_the_same_budgets() -> None:
    """Two ranks of one replica (attention TP) fed the same requests, budgets and accepted
    lengths (what both have); rank 1 also reads estimates of requests that are not the
    replica's between rounds (rank-local reads). Every round both compute the same estimates,
    due flags, budgets and value curves: the rule's state moves only with the replica-shared
    stream (the coordinator-level case, with different EMAs and clocks, is
    tests/multirank/test_engine_dp.py::test_attn_tp_ranks_of_a_replica_pick_the_same_budgets)."""
    config = per_request_config()
    rules = [PerRequestRule(config, token_ladder(64)) for _ in range(2)]
    rng = np.random.default_rng(3)
    rids = list(range(6))
    shape = RoundShape(3, 16)
    for round_ in range(60):
        if round_ % 9 == 8:                           # one finishes, another arrives
            rids = rids[1:] + [max(rids) + 1]
        est = [rule.survivals(rids) for rule in rules]
        assert est[0] == est[1] and est[0].due == est[1].due
        budgets = [rule.budgets(e, shape) for rule, e in zip(rules, est)]
        assert budgets[0] == budgets[1]
        assert rules[0].curve(est[0]) == rules[1].curve(est[1])
        # rank-local reads that must change nothing: rank 1 asks about other requests
        rules[1].survivals([999, 1000])
        accepts = [int(min(b, rng.integers(0, 4))) for b in budgets[0]]
        for rule in rules:
            rule.tracker.observe(rids, list(budgets[0]), accepts)
    assert any(b > 0 for b in budgets[0])


# ---- refusals ------------------------------------------------------------------------------------

def test_per_request_keys_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="per_request"):
        AdaptiveConfig(policy="ema", per_request=True)
    with pytest.raises(ConfigError, match="verify_cost"):
        AdaptiveConfig(policy="goodput", candidate_steps=(0, 1), initial_steps=1,
                       verify_cost={"1": 1.0})
    with pytest.raises(ConfigError, match="per_request"):
        AdaptiveConfig(policy="goodput", per_request="yes")


def test_a_verify_table_without_the_engines_rungs_is_refused(pair) -> None:
    rounds, verify = synthetic_costs(top_tokens=8)
    cfg = AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3, 7), initial_steps=3,
                         per_request=True, round_cost=rounds, verify_cost=verify)
    with pytest.raises(ConfigError, match="verify_cost: no cost for"):
        engine_for(*pair, "ema", config=cfg)


def test_flags_refused_by_name(tmp_path) -> None:
    from workers.settings import SpecChoice

    with pytest.raises(ValueError, match="--per-request needs --policy goodput"):
        SpecChoice(adaptive=True, policy="ema", per_request=True).build()
    with pytest.raises(ValueError, match="--per-request applies to --adaptive"):
        SpecChoice(per_request=True).build()
    chain_only = tmp_path / "chain.json"
    chain_only.write_text(json.dumps({"agreed_round_cost_ms": {"1": {
        "0": 5.0, "1": 5.5, "3": 6.0, "7": 7.0}}}))
    with pytest.raises(ConfigError, match="agreed_verify_cost_ms"):
        SpecChoice(adaptive=True, per_request=True, model_costs=str(chain_only)).build()
    with pytest.raises(ConfigError, match="--model-costs applies to --adaptive --policy goodput"):
        SpecChoice(adaptive=True, policy="ema", model_costs=str(chain_only)).build()
    spec = SpecChoice(adaptive=True, policy="goodput", model_costs=str(chain_only)).build()
    assert spec.round_cost.rows[0][-1] == (7, 0.007) and not spec.needs_round_cost


def test_token_ladder_holds_every_full_chain() -> None:
    ladder = token_ladder(64 * 8)
    for bucket in (1, 2, 4, 8, 16, 32, 64):
        for steps in (0, 1, 3, 7):
            assert bucket * (steps + 1) in ladder
    assert all(b / a <= 1.5 for a, b in zip(ladder[1:], ladder[2:]))
    assert token_bucket(65, ladder) == 96
