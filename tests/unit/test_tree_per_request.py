"""Per-request draft trees (issue 35 §2, ``--per-request --tree-candidates``): in one round a
request whose drafts are rarely accepted verifies a small tree or none while another verifies a
wide one; the round's shape (S, K, T) is agreed as the per-request chain's, the verify forward
runs T packed tokens (each request its root and its N_i best nodes). The rule
(``policy.tree.TreeBudgetRule``) on its own, then the engine: greedy per-request trees equal
plain greedy decoding token for token (the tiny random pair with every transition between
chains and trees, the bundled pair in float32), and sampled per-request trees keep the target's
law (chi-square against the exact joint distribution)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaptive_dist.config import load_config
from adaptive_dist.cost_tables import load_model_costs, restrict_costs
from adaptive_dist.policy.base import PolicyState
from adaptive_dist.policy.tree import (
    PER_REQUEST_TREE_CODE,
    TreeBudgetRule,
    chain_rate,
    expected_tree,
    tree_code,
    tree_node_values,
    tree_rate,
)
from adaptive_dist.shape import token_ladder
from engine_fixtures import check_pages_back, engine_for, lossless_params, random_prompts, \
    tiny_config, tiny_pair
from workers.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TABLE_8B = ROOT / "docs/data/cost_tables/h200_tp1_llama3-8b.json"
BUNDLED = ROOT / "workers" / "assets" / "tiny_pair"
TREES = [[3, 2, 6], [5, 4, 8], [7, 4, 16]]


@pytest.fixture(scope="module")
def costs():
    table, verify, _ = load_model_costs(str(TABLE_8B))
    return table, verify


def config(costs, trees=TREES, **kw):
    table, verify = costs
    return load_config(None, "goodput").replace(
        round_cost=restrict_costs(table, (0, 1, 3, 7)), verify_cost=verify,
        tree_candidates=trees, per_request=True, **kw)


# ---- the rule ----------------------------------------------------------------------------------
def test_node_values_add_up_to_the_per_batch_estimator_and_start_as_the_chain() -> None:
    """A request's whole tree is worth the per-batch trees' E(c, S) (c = p + (1 - p) f); a
    sure head's small budget is the chain's first positions, an unsure head's goes to the
    shallow siblings first; the values come largest first; a request observed on trees of the
    same coverage is taken at its observed rate."""
    for p, (steps, k, n, f) in ((0.88, (7, 4, 16, 0.55)), (0.3, (5, 4, 8, 0.55)),
                                (0.6, (3, 2, 6, 0.35)), (0.9, (5, 2, 4, 0.35))):
        surv = [p ** j for j in range(1, 8)]
        vals = tree_node_values(surv, steps, k, f, n)
        assert len(vals) == n - 1 and vals == sorted(vals, reverse=True)
        if n - 1 >= steps:
            assert sum(vals) == pytest.approx(expected_tree(p, steps, f))
        else:   # a budget smaller than the steps: the chain's first N - 1 positions
            assert sum(vals) == pytest.approx(sum(surv[:n - 1]))
    unsure = tree_node_values([0.2, 0.04, 0.008], 3, 4, 0.55, 8)
    assert min(unsure[:4]) >= 0.2 - 1e-9 > unsure[4]   # depth 1's four nodes before depth 2
    # f = 0: the siblings are worth nothing, the chain's positions alone
    assert tree_node_values([0.8, 0.48, 0.24], 3, 4, 0.0, 13)[:3] == pytest.approx(
        [0.8, 0.48, 0.24])
    # observed on trees of the same coverage: the tree's rate is the observed one
    seen = tree_node_values([0.5, 0.25], 2, 2, 0.55, 5, share=1.0, ran=0.55)
    assert sum(seen) == pytest.approx(0.5 + 0.25)
    assert chain_rate(tree_rate(0.3, 0.4), 0.4) == pytest.approx(0.3)


def _run(rule, batch, good, rounds=12):
    """``rounds`` rounds of the rule at ``batch`` requests, request i accepting every drafted
    level when ``good(i)``, nothing otherwise -> (shape, budgets) of the last."""
    rids = list(range(batch))
    state = PolicyState(index=0)
    for _ in range(rounds):
        surv = rule.survivals(rids)
        state, _ = rule.decide(state, rule.curve(surv), batch, batch, batch)
        shape = rule.shape(state, batch)
        budgets = rule.budgets(surv, shape)
        depth = rule.drafted(rids, budgets, shape)
        rule.tracker.observe(rids, depth, [d if good(i) else 0 for i, d in enumerate(depth)])
    return shape, budgets


@pytest.mark.parametrize("batch", [4, 16, 64])
def test_a_rarely_accepting_request_gets_a_small_tree_in_the_same_round_as_a_wide_one(
        costs, batch) -> None:
    rule = TreeBudgetRule(config(costs), token_ladder(64 * 8))
    shape, budgets = _run(rule, batch, lambda i: i % 2 == 0)
    good, bad = budgets[0::2], budgets[1::2]
    # the places a paid rung has left over are filled whatever their value: at a small batch
    # the rarely accepting requests take some; at 64 there are none left over
    assert sum(good) >= 3 * len(good) and (batch < 64 or max(bad) <= 1), (shape, budgets)
    assert max(good) >= shape.draft_forwards
    assert sum(budgets) + len(budgets) <= shape.verify_tokens, (shape, budgets)
    if batch <= 16:   # verify tokens are cheap: a tree (at 64 the chain of 7, priced)
        assert shape.tree is not None and min(good) > max(bad), (shape, budgets)
        assert all(0 <= b < shape.tree_tokens for b in budgets)
        assert shape.verify_tokens < batch * shape.tree_tokens   # ragged: not every whole tree


def test_the_rule_is_priced_nobody_accepting_drafts_nothing(costs) -> None:
    """Requests that never accept: after a few rounds the shape drafts nothing (a chain of
    depth 0) at a large batch, and the must-agree code names the tree when one runs."""
    rule = TreeBudgetRule(config(costs), token_ladder(64 * 8))
    shape, budgets = _run(rule, 64, lambda i: False, rounds=20)
    assert shape.draft_forwards == 0 or not any(budgets), (shape, budgets)
    state = PolicyState(index=len(rule.candidates) + 1, tokens=48)
    assert rule.code(state) == 48 + tree_code(4, 8) * PER_REQUEST_TREE_CODE
    assert rule.code(PolicyState(index=1, tokens=48)) == 48
    # a tree's T never passes the rung holding every request's whole tree
    assert rule.shape(PolicyState(index=len(rule.candidates), tokens=512), 2).verify_tokens == 12


def test_the_refusal_is_gone_and_the_coordinator_takes_the_tree_rule(costs) -> None:
    from adaptive_dist.coordinator import RoundCoordinator
    from collectives import Group

    cfg = config(costs)
    assert cfg.per_request and cfg.tree_candidates
    coord = RoundCoordinator(cfg, Group.single(), verify_ladder=token_ladder(64))
    assert isinstance(coord.rule, TreeBudgetRule)
    assert coord.rule.n_values == (4 + 3) * len(token_ladder(64))


# ---- the engine --------------------------------------------------------------------------------
@pytest.mark.parametrize("cycle", [False, True], ids=["policy", "every-candidate"])
def test_greedy_per_request_trees_equal_plain_greedy(costs, cycle, monkeypatch) -> None:
    """The rule's own shapes, and (``cycle``) every candidate in turn (chains, depth 0, trees:
    every transition) at every rung in turn (held to what the round's batch allows: rounds
    verify fewer tokens than every row's whole tree); every token equals plain greedy
    decoding's, eager and with overlap."""
    if cycle:
        orig = TreeBudgetRule.decide

        def every(self, state, summed, n_sum, n_max, batch):
            new, dec = orig(self, state, summed, n_sum, n_max, batch)
            index = (state.index + 1) % (len(self.candidates) + len(self.trees))
            tokens = self.ladder[new.counted % len(self.ladder)]
            return type(new)(index=index, counted=new.counted, last_switch=new.counted,
                             tokens=tokens), dec
        monkeypatch.setattr(TreeBudgetRule, "decide", every)
    target, head = tiny_pair(seed=0)
    prompts = random_prompts(10, vocab=64, seed=7)
    params = lossless_params(len(prompts))
    ref = [r.output_ids for r in engine_for(target, None, "nospec").generate(prompts, params)]
    cfg = config(costs, [[3, 2, 6], [2, 3, 7], [5, 4, 8]])
    for overlap in (False, True):
        engine = engine_for(target, head, "ema", config=cfg, max_batch=3, overlap=overlap)
        out = engine.generate(prompts, params)
        assert [r.output_ids for r in out] == ref, overlap
        shapes = engine.planner.stats.rounds_at_shape
        trees = [k for k in shapes if len(k) == 5]
        assert trees, dict(shapes)
        if cycle:
            assert any(k[2] < k[1] * k[4] for k in trees), dict(shapes)
            assert {k[3:] for k in trees} == {(2, 6), (3, 7), (4, 8)}, dict(shapes)
            assert {k[0] for k in shapes if len(k) == 3} >= {0, 1, 3, 7}, dict(shapes)
        check_pages_back(engine)


def test_bundled_pair_float32_per_request_trees_equal_no_spec(costs) -> None:
    from workers.loading import encode_prompt, load_pair

    target, head = load_pair(BUNDLED)
    texts = ["def merge_intervals(spans):\n    ",
             "The lighthouse keeper wrote in her log that the storm",
             "for idx, (name, val) in enumerate(sorted(table.items())):\n"]
    prompts = [encode_prompt(p, target.config) for p in texts]
    params = SamplingParams(max_new_tokens=40, stop_token_ids=target.config.eos_token_ids)
    reference = [r.output_ids for r in engine_for(target, None, "nospec").generate(prompts, params)]
    engine = engine_for(target, head, "ema", config=config(costs, [[3, 2, 6], [5, 4, 8]]))
    out = engine.generate(prompts, params)
    assert [r.output_ids for r in out] == reference
    assert any(len(k) == 5 for k in engine.planner.stats.rounds_at_shape)


def test_per_request_tree_sampling_matches_target_distribution(costs) -> None:
    """The first three tokens of 8000 sampled requests, per-request trees (every candidate a
    tree of 3 steps, so each round is one; the requests' node budgets differ) against the
    target's exact joint law."""
    from sampling_reference import ALPHA, PROMPT, VOCAB, chi_square_pvalue, exact_joint

    target, head = tiny_pair(seed=2, eps=1.0, cfg=tiny_config(vocab=VOCAB, hidden=32))
    cfg = config(costs, [[3, 2, 6]], update_interval=1, warmup_batches=0)
    engine = engine_for(target, head, "ema", config=cfg, max_batch=64)
    params = SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=3)
    out = engine.generate([PROMPT] * 8000, params, seed=1000)
    counts = torch.zeros(VOCAB ** 3)
    for req in out:
        t0, t1, t2 = req.output_ids
        counts[(t0 * VOCAB + t1) * VOCAB + t2] += 1
    shapes = engine.planner.stats.rounds_at_shape
    assert any(len(k) == 5 and k[2] < k[1] * k[4] for k in shapes), dict(shapes)
    assert chi_square_pvalue(counts, exact_joint(target, 0.7, 0.8)) > ALPHA


def test_per_request_trees_through_graphs_equal_plain_greedy(costs) -> None:
    """The ragged tree round captured per tree, bucket and rung at start-up (emulated on the
    CPU: the replay runs the captured body): greedy output equals plain greedy, graph rounds ran
    trees at fewer tokens than every row's whole tree, nothing was captured after start-up; the
    sampling graphs give the eager round's seeded tokens."""
    target, head = tiny_pair(seed=0)
    prompts = random_prompts(10, vocab=64, seed=7)
    params = lossless_params(len(prompts))
    ref = [r.output_ids for r in engine_for(target, None, "nospec").generate(prompts, params)]
    cfg = config(costs, [[3, 2, 6], [5, 4, 8]], graph_buckets=(1, 2, 4))
    engine = engine_for(target, head, "ema", config=cfg, max_batch=4, cuda_graphs=True)
    table = engine.worker.table
    keys = [k for k in table if k.nodes]
    assert {(k.topk, k.nodes) for k in keys} == {(2, 6), (4, 8)}
    assert {k.tokens for k in keys if k.batch == 4 and k.nodes == 8} == {3, 4, 6, 8, 12, 16, 24, 32}
    captured = len(table)
    out = engine.generate(prompts, params)
    assert [r.output_ids for r in out] == ref
    assert engine.stats.graph_rounds > 0 and len(table) == captured
    shapes = engine.planner.stats.rounds_at_shape
    assert any(len(k) == 5 and k[2] < k[1] * k[4] for k in shapes), dict(shapes)
    check_pages_back(engine)
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=p.max_new_tokens)
               for p in params]
    seeds = list(range(len(prompts)))
    eager = engine_for(target, head, "ema", config=cfg, max_batch=4).generate(
        prompts, sampled, seeds=seeds)
    graphs = engine_for(target, head, "ema", config=cfg, max_batch=4, cuda_graphs=True)
    assert [r.output_ids for r in graphs.generate(prompts, sampled, seeds=seeds)] == \
        [r.output_ids for r in eager]
