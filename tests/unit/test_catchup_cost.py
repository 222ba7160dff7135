"""The cost model's catch-up term (`adaptive_dist.cost_tables.CatchupTerm`, issues 32 and 34):
a depth-0 round priced without the decode table's share of catch-ups and, when it ran one, with
the term at its context; a file without the term (every version-1 table) pricing as before; the
version rule; bad entries named; the start-up measurement (`workers.worker.round_cost
.measure_catchups`) on the tiny CPU pair; a recorded round log with catch-ups priced again
changing by exactly the term."""
from __future__ import annotations

import json

import pytest

from adaptive_dist.config import ConfigError, RoundCost, VerifyCost
from adaptive_dist.cost_tables import (CATCHUP_BASE_KEY, CATCHUP_KEY, CATCHUP_ROUNDS_KEY,
                                       COST_MODEL_VERSION, VERSION_KEY, CatchupTerm, CostModel,
                                       cost_model, price_round_log)
from adaptive_dist.policy.budgets import shape_cost

RUNGS = (1, 2, 4, 8, 16)
BASE = VerifyCost(RUNGS, tuple(0.004 + 1e-5 * t for t in RUNGS))
ROUND = RoundCost((1, 4), (((0, 0.005), (3, 0.006)), ((0, 0.0052), (3, 0.0075))))
# one catch-up: 1 ms at bucket 1, 2 ms at bucket 4 with no context, + 1 us per cached position
TERM = {"0": {"1": 1.0, "4": 2.0}, "1000": {"1": 2.0, "4": 3.0}}


def _file(tmp_path, **extra) -> str:
    data = {"agreed_round_cost_ms": {"1": {"0": 5.0, "3": 6.0}, "4": {"0": 5.2, "3": 7.5}},
            "agreed_verify_cost_ms": {str(t): 1e3 * c for t, c in zip(RUNGS, BASE.costs)},
            "context": 2048}   # a max context (model_shapes'), not what the rows held
    data.update(extra)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_the_term_prices_a_catchup_by_bucket_and_context(tmp_path) -> None:
    term = CatchupTerm.parse(TERM, 8, 500)
    assert term.cost(1, 0) == pytest.approx(1e-3)
    assert term.cost(3, 0) == pytest.approx(2e-3)          # the bucket holding 3 rows
    assert term.cost(64, 0) == pytest.approx(2e-3)         # past the largest: the largest
    assert term.cost(4, 250) == pytest.approx(2.25e-3)
    assert term.cost(4, 3000) == pytest.approx(5e-3)       # past the last context: its segment
    assert term.share(4) == pytest.approx(2.5e-3 / 8)      # one per 8 rounds at the table's 500
    assert CatchupTerm.parse(TERM, 8, 500).to_json() == {
        CATCHUP_KEY: {c: {b: pytest.approx(v) for b, v in row.items()} for c, row in TERM.items()},
        CATCHUP_ROUNDS_KEY: 8, CATCHUP_BASE_KEY: 500}
    # without the table's context (a start-up table): its rows held none
    assert cost_model(_file(tmp_path, **{VERSION_KEY: 2, CATCHUP_KEY: TERM, CATCHUP_ROUNDS_KEY: 8})
                      ).catchup.base_context == 0


def test_a_round_is_priced_with_the_catchup_it_ran(tmp_path) -> None:
    model = cost_model(_file(tmp_path, **{VERSION_KEY: 2, CATCHUP_KEY: TERM,
                                          CATCHUP_ROUNDS_KEY: 8, CATCHUP_BASE_KEY: 500}))
    assert model.catchup is not None and model.catchup.base_context == 500
    assert "catch-up" not in " ".join(model.unpriced())
    table = shape_cost(ROUND, BASE, 0, 4, 4)
    share = model.catchup.share(4)
    assert model.round_seconds(0, 4, 4) == pytest.approx(table)            # not known: the table
    assert model.round_seconds(0, 4, 4, catchup=False) == pytest.approx(table - share)
    assert model.round_seconds(0, 4, 4, catchup=True, catchup_context=1000) == pytest.approx(
        table - share + 3e-3)
    # the context defaults to the round's longest row
    assert model.round_seconds(0, 4, 4, catchup=True, longest=250) == pytest.approx(
        table - share + 2.25e-3)
    # a catch-up before drafting resumes (depth 3): no share to take out
    deep = shape_cost(ROUND, BASE, 3, 16, 4)
    assert model.round_seconds(3, 16, 4, catchup=False) == pytest.approx(deep)
    assert model.round_seconds(3, 16, 4, catchup=True, catchup_context=0) == pytest.approx(
        deep + 2e-3)
    # over N depth-0 rounds with one catch-up at the table's context: the table's own sum
    rounds = [model.round_seconds(0, 4, 4, catchup=i == 7, catchup_context=500)
              for i in range(8)]
    assert sum(rounds) == pytest.approx(8 * table)


def test_a_file_without_the_term_prices_as_before(tmp_path) -> None:
    """Every version-1 table: it loads, `catchup` changes nothing, `unpriced` names the term."""
    model = cost_model(_file(tmp_path))
    assert model.catchup is None
    assert [u.split(" ")[0] for u in model.unpriced()] == ["context", "prefill", "catch-up"]
    table = shape_cost(ROUND, BASE, 0, 4, 4)
    for catchup in (None, False, True):
        assert model.round_seconds(0, 4, 4, catchup=catchup) == pytest.approx(table)
    assert model.catchup_seconds(4, 1000) == 0.0
    shipped = cost_model("docs/data/cost_tables/h200_tp1_llama3-8b.json")
    assert shipped.round_seconds(0, 64, 64, catchup=True) == pytest.approx(
        shipped.round_seconds(0, 64, 64))


@pytest.mark.parametrize("extra,shown", [
    ({VERSION_KEY: COST_MODEL_VERSION + 1}, f"up to version {COST_MODEL_VERSION}"),
    ({VERSION_KEY: "2"}, "must be an integer >= 1"),
    ({CATCHUP_KEY: TERM, CATCHUP_ROUNDS_KEY: 8}, "version-2 term"),
    ({VERSION_KEY: 2, CATCHUP_KEY: TERM}, "catchup_rounds=None"),
    ({VERSION_KEY: 2, CATCHUP_KEY: {"x": {"1": 1.0}}, CATCHUP_ROUNDS_KEY: 8},
     "must be a context >= 0"),
    ({VERSION_KEY: 2, CATCHUP_KEY: {"0": {"1": 1.0}, "64": {"2": 1.0}}, CATCHUP_ROUNDS_KEY: 8},
     "differ from context 0"),
    ({VERSION_KEY: 2, CATCHUP_KEY: {"0": {"1": -1.0}}, CATCHUP_ROUNDS_KEY: 8}, "positive"),
    ({VERSION_KEY: 2, CATCHUP_KEY: [], CATCHUP_ROUNDS_KEY: 8}, "non-empty object"),
    ({VERSION_KEY: 2, CATCHUP_KEY: TERM, CATCHUP_ROUNDS_KEY: 8, CATCHUP_BASE_KEY: -1},
     "catchup_table_context=-1"),
])
def test_bad_catchup_entries_are_named(tmp_path, extra, shown) -> None:
    path = _file(tmp_path, **extra)
    with pytest.raises(ConfigError) as err:
        cost_model(path)
    assert shown in str(err.value) and path in str(err.value)


def _tiny_engine(every: int):
    """The tiny pair with tiers 0 and 3, every round planned at depth 0 (eager, unpadded)."""
    import torch

    from engine_fixtures import ScriptPlanner, engine_for, tiny_pair
    from workers.runtime_state import RuntimeStatePool

    torch.set_num_threads(1)
    engine = engine_for(*tiny_pair(seed=0), "static", steps=3, catchup_rounds=every,
                        max_batch=4)
    engine.pool = RuntimeStatePool(engine.worker, (0, 3))
    engine.planner = ScriptPlanner([0], False, None)
    return engine


def test_the_startup_measurement_produces_the_term_on_the_cpu() -> None:
    """The tiny pair with a depth-0 tier, eager: one catch-up per bucket at two contexts (one
    beyond a slot's pages, held at what fits), written as a table file's keys and read back;
    the slots as the measurement found them (the engine still generates, and equals a run
    that never measured)."""
    from workers.sampling import SamplingParams
    from workers.worker.round_cost import measure_catchups, room

    engine = _tiny_engine(4)
    worker = engine.worker
    assert worker.lag.built
    at = measure_catchups(worker, engine.pool, (1, 2, 4), [16, 10**6], graphs=False, repeats=1)
    engine.pool.apply(0)
    assert list(at) == [16, room(worker, 10**6, 1)]
    assert all(list(row) == [1, 2, 4] and min(row.values()) > 0 for row in at.values())
    term = CatchupTerm.parse({str(c): {str(b): 1e3 * v for b, v in row.items()}
                              for c, row in at.items()}, 4)
    assert term.contexts == tuple(at) and term.buckets == (1, 2, 4)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = SamplingParams(max_new_tokens=11)
    got = [r.output_ids for r in engine.generate(prompts, params)]
    fresh = _tiny_engine(4)
    assert got == [r.output_ids for r in fresh.generate(prompts, params)]
    # without a lag ring (no depth-0 tier): nothing to measure
    from engine_fixtures import engine_for, tiny_pair
    plain = engine_for(*tiny_pair(seed=0), "static", steps=2)
    assert measure_catchups(plain.worker, plain.pool, (1,), [16], graphs=False) == {}


def test_a_round_log_with_catchups_repriced_changes_by_exactly_the_term(tmp_path) -> None:
    """`generate`'s round log at depth 0 with a head (catch-up every 4 rounds): the lines say
    which rounds ran the catch-up; priced with a version-2 table, the log's total is the
    version-1 table's total less every depth-0 round's share plus the term at every catch-up
    round's context, line by line."""
    from workers.round_log import RoundLog, read_round_log
    from workers.sampling import SamplingParams

    engine = _tiny_engine(4)
    path = tmp_path / "log.jsonl"
    engine.round_log = RoundLog(path)
    engine.generate([[1, 2, 3, 4, 5], [7, 8, 9], [3, 3]], SamplingParams(max_new_tokens=14))
    engine.round_log.close()
    lines = read_round_log(path)
    decode = [r for r in lines if r["kind"] == "decode"]
    caught = [r for r in decode if r["catchup"]]
    assert len(caught) == 13 // 4 and all(r["draft_forwards"] == 0 for r in decode)
    assert all(r["longest"] > 0 for r in decode)
    # the prompts' head part was deferred (a 32-slot prefill at depth 0): the first catch-up
    assert [r["pending"] for r in decode if r["pending"]] == [32] and caught[0]["pending"] == 32
    v1 = _file(tmp_path)
    old = cost_model(v1)
    data = json.loads(open(v1).read())
    data.update({VERSION_KEY: 2, CATCHUP_KEY: TERM, CATCHUP_ROUNDS_KEY: 4})
    v2 = tmp_path / "v2.json"
    v2.write_text(json.dumps(data))
    new = cost_model(str(v2))
    before, after = price_round_log(lines, old), price_round_log(lines, new)
    assert len(before) == len(after) == len(lines)
    term = new.catchup
    for rec, a, b in zip(lines, before, after):
        if rec["kind"] != "decode":
            assert a == b
            continue
        batch = len(rec["requests"])
        delta = -term.share(batch) + (term.cost(batch, rec["longest"]) if rec["catchup"] else 0)
        assert b - a == pytest.approx(delta)
    # a line written before the keys existed prices at the table's price
    bare = {k: v for k, v in caught[0].items() if k not in ("catchup", "pending", "longest")}
    assert price_round_log([bare], new) == pytest.approx(price_round_log([bare], old))


def test_the_schedule_check_prices_the_catchups_it_ran(tmp_path) -> None:
    """`scripts.bench.model_shapes.check_schedule` on the tiny pair held at depth 0 (catch-up
    every 4 rounds): each round records whether it ran the catch-up; with a catch-up term every
    decode price is the term-less one less the share plus the term where one ran, and
    `--reprice` of the recorded run with and without the term differs by exactly that."""
    import torch

    from engine_fixtures import engine_for, tiny_pair
    from scripts.bench.common import held_at_zero
    from scripts.bench.model_shapes import check_schedule, reprice

    torch.set_num_threads(1)
    target, head = tiny_pair(seed=0)
    engine = engine_for(target, head, "ema", config=held_at_zero(1), max_batch=4,
                        catchup_rounds=4)
    spec = engine.config.spec
    term = CatchupTerm.parse({"0": {"1": 1.0, "4": 2.0}, "64": {"1": 1.5, "4": 3.0}}, 4)
    model = CostModel(spec.round_cost, spec.verify_cost, catchup=term)
    out = check_schedule(engine, 6, 288, target.config.vocab_size, model)
    rounds = out["rounds"]
    ran = [r for r in rounds if r["catchup"]]
    assert ran and all(r["steps"] == 0 for r in rounds)
    plain = CostModel(spec.round_cost, spec.verify_cost)
    for r in rounds:
        without = plain.round_seconds(r["steps"], r["tokens"], r["batch"], r["positions_read"],
                                      r["verify_tokens_real"], r["longest_context"])
        delta = -term.share(r["batch"]) + (term.cost(r["batch"], r["longest_context"])
                                          if r["catchup"] else 0.0)
        assert r["predicted_decode"] == pytest.approx(without + delta)
    # the recorded run priced again: with the term and without it
    run = tmp_path / "run.json"
    base = {"agreed_round_cost": spec.round_cost.to_json(), "schedule_check": out}
    run.write_text(json.dumps(base))
    with_term = tmp_path / "with.json"
    with_term.write_text(json.dumps({**base, VERSION_KEY: 2, **{
        k: v for k, v in term.to_json().items()}}))
    a, b = reprice(run), reprice(run, str(with_term))
    total = sum(-term.share(r["batch"]) + (term.cost(r["batch"], r["longest_context"])
                                           if r["catchup"] else 0.0) for r in rounds)
    assert b["all"]["predicted_s"] - a["all"]["predicted_s"] == pytest.approx(total)
