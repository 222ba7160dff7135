"""Draft trees as goodput candidates (issue 35 §2): a tree's price from the production cost table
(its derivation checked against the table's own chain rounds), the tree's expected accepted
tokens from the chain's rate, the decision over chains and trees, the refusals by name, and the
engine: greedy adaptive trees equal plain greedy decoding token for token while the policy
switches between chains and trees."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from adaptive_dist.config import AdaptiveConfig, ConfigError, RoundCost, VerifyCost, load_config
from adaptive_dist.cost_tables import load_model_costs, restrict_costs
from adaptive_dist.policy.goodput import GoodputEstimate, expected_accepted, goodput_step
from adaptive_dist.policy import depth_policy
from adaptive_dist.policy.tree import (
    candidate_steps_of,
    chain_rate,
    derivation_check,
    draft_forward_cost,
    expected_tree,
    parse_tree_candidates,
    tree_code,
    tree_rate,
    tree_round_cost,
    verify_seconds,
)

ROOT = Path(__file__).resolve().parents[2]
TABLE_8B = ROOT / "docs/data/cost_tables/h200_tp1_llama3-8b.json"


@pytest.fixture(scope="module")
def costs() -> tuple[RoundCost, VerifyCost]:
    table, verify, _ = load_model_costs(str(TABLE_8B))
    return table, verify


def goodput(table: RoundCost, verify: VerifyCost, trees, **kw) -> AdaptiveConfig:
    return load_config(None, "goodput").replace(
        round_cost=restrict_costs(table, (0, 1, 3, 7)), verify_cost=verify,
        tree_candidates=trees, **kw)


# ---- price -------------------------------------------------------------------------------------
def test_the_derivation_reproduces_the_tables_own_chain_rounds(costs) -> None:
    """Depth 3 is not used to fit the line (depths 1 and 7 are): derived within 0.2% of the
    measured round at batch 1..32 and 1.5% at 64."""
    rows = [r for r in derivation_check(*costs) if r["steps"] == 3]
    assert len(rows) == 7
    for r in rows:
        assert abs(r["error"]) < (0.015 if r["batch"] == 64 else 0.002), r
    for r in derivation_check(*costs):   # the fitted ends exactly
        if r["steps"] in (1, 7):
            assert r["error"] == pytest.approx(0.0, abs=1e-12)


def test_a_tree_round_is_priced_by_its_rows_and_tokens(costs) -> None:
    table, verify = costs
    row = {s: c for s, c in table.rows[0]}                       # batch 1
    d1_, d7_ = row[1] - verify.cost(2), row[7] - verify.cost(8)
    h = (d7_ - d1_) / 6
    # (3, 2, 6) at batch 1: two head forwards over 2 rows, verify over 6 tokens (rung 6)
    h2 = draft_forward_cost(table, verify, 2)[0]
    assert tree_round_cost(table, verify, 3, 2, 6, 1) == pytest.approx(
        d1_ + 2 * h2 + verify.cost(6))
    assert draft_forward_cost(table, verify, 1)[0] == pytest.approx(h)
    # top-k 1 with N = S + 1 is the chain's derivation
    assert tree_round_cost(table, verify, 7, 1, 8, 1) == pytest.approx(row[7])
    # 64 x 16 = 1024 verify tokens is past the table's 512: extrapolated, said so
    v, extra = verify_seconds(verify, 1024)
    assert extra and v > verify.cost(512)
    assert not verify_seconds(verify, 5)[1] and verify_seconds(verify, 5)[0] == verify.cost(6)


# ---- expectation ---------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.0, 0.13, 0.5, 0.87, 1.0])
def test_tree_rate_and_chain_rate_invert(p: float) -> None:
    for f in (0.0, 0.35, 0.7):
        c = tree_rate(p, f)
        assert c >= p and chain_rate(c, f) == pytest.approx(p)
        assert expected_tree(p, 4, f) == pytest.approx(expected_accepted(c, 4))
    assert expected_tree(p, 3, 0.0) == pytest.approx(expected_accepted(p, 3))


def test_a_switch_carries_the_rate_to_the_new_shape(costs) -> None:
    cfg = goodput(*costs, [[3, 2, 6, 0.4]])
    policy = depth_policy(cfg)
    est = GoodputEstimate(ema=1.0, ema_fail=1.0)          # rate 0.5
    chain3, tree = cfg.candidate_steps.index(3), len(cfg.candidate_steps)
    to_tree = policy.convert_estimate(est, chain3, tree)
    assert to_tree.ema + to_tree.ema_fail == pytest.approx(2.0)
    assert to_tree.ema / 2.0 == pytest.approx(tree_rate(0.5, 0.4))
    back = policy.convert_estimate(to_tree, tree, chain3)
    assert back.ema == pytest.approx(1.0) and back.ema_fail == pytest.approx(1.0)
    assert policy.convert_estimate(est, 0, tree) == est     # out of depth 0: no rate to carry


# ---- the decision ------------------------------------------------------------------------------
def test_the_decision_is_by_price_wide_trees_at_batch_1_chains_at_64(costs) -> None:
    cfg = goodput(*costs, [[3, 2, 6], [5, 4, 8], [6, 8, 16]], switch_margin=0.0)
    policy = depth_policy(cfg)
    state = policy.initial_state()
    chains = len(cfg.candidate_steps)
    # a head that is often wrong but whose siblings catch it: a tree at batch 1
    idx, _ = goodput_step(cfg, state, 0.3, 1)
    assert idx >= chains, idx
    # at batch 64 the tree's b x N verify tokens cost more than it gains: a chain
    idx64, _ = goodput_step(cfg, state, 0.3, 64)
    assert idx64 < chains, idx64
    # a head that is always right: the deepest chain, at batch 1 too
    idx_sure, _ = goodput_step(cfg, state, 0.99, 1)
    assert candidate_steps_of(cfg, idx_sure) >= 5


def test_tree_candidates_are_parsed_and_refused_by_name(costs) -> None:
    assert parse_tree_candidates(["3x2x6", [5, 4, 8, 0.5]]) == ((3, 2, 6, 0.35),
                                                                (5, 4, 8, 0.5))
    for bad, word in (([[3, 1, 4]], "topk 1"), ([[3, 2, 99]], "verifies 2 .."),
                      ([[3, 2, 6, 1.5]], "coverage"), ([[3, 2]], "must be"),
                      ([[3, 2, 6], "3x2x6"], "twice")):
        with pytest.raises(ConfigError, match="tree_candidates") as err:
            parse_tree_candidates(bad)
        assert word in str(err.value), (bad, str(err.value))
    assert goodput(*costs, [[3, 2, 6]], per_request=True).per_request   # per-request trees
    with pytest.raises(ConfigError, match="mixture"):
        goodput(*costs, [[3, 2, 6]], reducer="mixture")
    with pytest.raises(ConfigError, match="tree_candidates"):
        load_config(None, "ema").replace(tree_candidates=[[3, 2, 6]])
    # the engine measures every tier: a tree's steps may be in the round_cost rows
    table, verify = costs
    cfg = load_config(None, "goodput").replace(round_cost=table, verify_cost=verify,
                                               tree_candidates=[[7, 2, 9]])
    assert cfg.tiers == (0, 1, 3, 7)
    assert load_config(None, "goodput").replace(tree_candidates=[[5, 4, 8]]).start_up_needs \
        == {"round_cost": "round_costs", "verify_cost": "verify_costs"}
    assert tree_code(1, 4) == 0 and tree_code(4, 8) != tree_code(4, 9) != tree_code(2, 9)


# ---- the engine ----------------------------------------------------------------------------
@pytest.mark.parametrize("cycle", [False, True])
def test_greedy_adaptive_trees_equal_plain_greedy(costs, cycle, monkeypatch) -> None:
    """A decision every round, no margin: the policy's own choice (the tiny random pair moves
    from a chain to a tree), and (``cycle``) every candidate in turn, chains, depth 0 and trees,
    one after the other (the pick replaced by the next index: every transition). Every token
    equals plain greedy decoding's, and the run did run trees and chains."""
    if cycle:
        import adaptive_dist.policy.goodput as goodput_module

        monkeypatch.setattr(goodput_module, "goodput_pick",
                            lambda scores, index, margin: (index + 1) % len(scores))
    from engine_fixtures import check_pages_back, engine_for, lossless_params, random_prompts, \
        tiny_pair

    target, head = tiny_pair(seed=0)
    prompts = random_prompts(10, vocab=64, seed=7)
    params = lossless_params(len(prompts))
    ref = [r.output_ids for r in engine_for(target, None, "nospec").generate(prompts, params)]
    cfg = goodput(*costs, [[3, 2, 6], [2, 3, 7, 0.2], [5, 4, 8]], update_interval=1,
                  warmup_batches=0, switch_margin=0.0, reset_nats=2.0)
    for overlap in (False, True):
        engine = engine_for(target, head, "ema", config=cfg, max_batch=3, overlap=overlap)
        out = engine.generate(prompts, params)
        assert [r.output_ids for r in out] == ref, overlap
        shapes = engine.planner.stats.rounds_at_shape
        trees = {k[3:] for k in shapes if len(k) == 5}
        chains = {k[0] for k in shapes if len(k) == 3}
        assert trees and chains, dict(shapes)
        if cycle:
            assert len(trees) == 3 and chains >= {1, 3, 7}, dict(shapes)
            assert engine.planner.stats.switches >= 10
        check_pages_back(engine)


def test_adaptive_trees_refuse_a_static_tree_and_processed_requests(costs) -> None:
    from engine_fixtures import engine_for, tiny_pair
    from workers.sampling import SamplingParams

    target, head = tiny_pair(seed=0)
    cfg = goodput(*costs, [[3, 2, 6]])
    with pytest.raises(ValueError, match="tree_candidates"):
        engine_for(target, head, "ema", config=cfg, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=6)
    engine = engine_for(target, head, "ema", config=cfg)
    with pytest.raises(ValueError, match="tree_candidates"):
        engine.add([1, 2, 3], SamplingParams(max_new_tokens=4, top_k=5, temperature=1.0))


def test_the_tree_candidates_flag() -> None:
    """`--tree-candidates` implies goodput, prices the trees with the file's verify table under
    `--model-costs`, and is refused by name outside --adaptive, with --policy ema, for a bad
    entry."""
    from workers.settings import SpecChoice

    spec = SpecChoice(adaptive=True, tree_candidates="3x2x6, 5x4x8",
                      model_costs=str(TABLE_8B)).build()
    assert spec.policy == "goodput" and [t[:3] for t in spec.tree_candidates] == [(3, 2, 6),
                                                                                  (5, 4, 8)]
    assert spec.verify_cost is not None and spec.tiers == (0, 1, 3, 5, 7)
    for kw, word in (({"steps": 3}, "--adaptive"), ({"adaptive": True, "policy": "ema"},
                                                     "--policy goodput"),
                     ({"adaptive": True}, "topk 1")):
        bad = "3x1x4" if word == "topk 1" else "3x2x6"
        with pytest.raises(ValueError, match="--tree-candidates") as err:
            SpecChoice(tree_candidates=bad, **kw).build()
        assert word in str(err.value)


def test_consensus_only_mode_refuses_trees(costs) -> None:
    from adaptive_dist.replay import require_round_cost

    with pytest.raises(ConfigError, match="tree_candidates.*consensus-only"):
        require_round_cost(goodput(*costs, [[3, 2, 6]]))
    chains = load_config(None, "goodput").replace(round_cost=restrict_costs(costs[0],
                                                                            (0, 1, 3, 7)))
    assert require_round_cost(chains) is chains
