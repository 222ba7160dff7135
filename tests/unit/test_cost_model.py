"""The cost model's context and prefill terms (`adaptive_dist.cost_tables`, issues 32 and 34):
the interpolation and the fit against synthetic timings of known form, a table file without
them (every older one) loading with both named as not priced, a file with them read back and bad
entries named, the floor at a round's longest row, the start-up measurement
(`workers.worker.round_cost`) producing both on the tiny CPU pair, and the committed GPU check
priced again (`model_shapes --reprice`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptive_dist.config import ConfigError, RoundCost, VerifyCost
from adaptive_dist.cost_tables import (CONTEXT_KEY, PREFILL_KEY, PREFILL_POSITION_KEY, CostModel,
                                       ContextTerm, PrefillTerm, causal_positions, cost_model,
                                       fit_prefill)
from adaptive_dist.policy.budgets import shape_cost
from scripts.bench.model_shapes import TERM_KEYS

RUNGS = (1, 2, 4, 8, 16)
BASE = VerifyCost(RUNGS, tuple(0.004 + 1e-5 * t for t in RUNGS))
SLOPE = 2e-9    # seconds per (token x position)
ROUND = RoundCost((1, 4), (((0, 0.005), (3, 0.006)), ((0, 0.0052), (3, 0.0075))))


def linear_context(contexts=(512,)) -> ContextTerm:
    """Verify timings linear in the positions read: v(t, c) = v(t, 0) + SLOPE t c."""
    return ContextTerm.parse({str(c): VerifyCost(RUNGS, tuple(v + SLOPE * t * c for t, v in
                                                               zip(RUNGS, BASE.costs)))
                              for c in contexts})


def test_the_context_term_is_linear_in_the_positions_read() -> None:
    term = linear_context()
    for tokens in RUNGS:
        assert term.slope(BASE, tokens) == pytest.approx(SLOPE)
        for positions in (0, 100, 5000, 40_000):   # 40k: past the measured 512 per token
            assert term.extra(BASE, tokens, positions) == pytest.approx(SLOPE * positions)
    # padding tokens read nothing: 3 real tokens of the rung of 4 reading 900 positions
    assert term.extra(BASE, 4, 900, real_tokens=3) == pytest.approx(SLOPE * 900)
    with pytest.raises(ConfigError, match="no entry for 3 tokens"):
        term.extra(BASE, 3, 10)


def test_two_contexts_interpolate_piecewise() -> None:
    # a cost that bends: 1 ns per (token x position) up to 512, 3 ns beyond
    def v(t, c):
        return BASE.cost(t) + 1e-9 * t * min(c, 512) + 3e-9 * t * max(c - 512, 0)
    term = ContextTerm.parse({str(c): {str(t): v(t, c) for t in RUNGS} for c in (512, 2048)})
    assert term.contexts == (512, 2048)
    for c in (100, 512, 1000, 2048, 3000):
        assert BASE.cost(8) + term.extra(BASE, 8, 8 * c) == pytest.approx(v(8, c))


def test_a_term_with_its_own_context_0_row_reads_from_it() -> None:
    # measured 0.2 ms above the base table at every context (another process, another day):
    # its differences are what count
    own = {str(c): {str(t): 2e-4 + v + SLOPE * t * c for t, v in zip(RUNGS, BASE.costs)}
           for c in (0, 512)}
    term = ContextTerm.parse(own)
    assert term.contexts == (0, 512)
    assert term.extra(BASE, 8, 3000) == pytest.approx(SLOPE * 3000)
    assert term.slope(BASE, 16) == pytest.approx(SLOPE)


def test_the_rung_holding_the_real_tokens_prices_them() -> None:
    # a floor: every rung up to 4 pays 0.5 ms at 512 positions whatever its tokens (a kernel
    # bound by its rows' length, not its tokens), linear in the tokens beyond
    def v(t, c):
        return BASE.cost(t) + c / 512 * max(5e-4, 1.2e-4 * t)
    term = ContextTerm.parse({"512": {str(t): v(t, 512) for t in RUNGS}})
    assert term.extra(BASE, 2, 2 * 512) == pytest.approx(5e-4)
    # 3 real tokens of the rung of 8: priced at the rung of 4 (the padding reads nothing)
    assert term.extra(BASE, 8, 3 * 512, real_tokens=3) == pytest.approx(5e-4 * 3 / 4)
    # a context measured below none (noise) adds nothing rather than a negative cost
    low = ContextTerm.parse({"512": {str(t): BASE.cost(t) - 1e-4 for t in RUNGS}})
    assert low.extra(BASE, 4, 10**6) == 0.0


def test_a_round_costs_at_least_its_longest_row() -> None:
    """The floor (`ContextTerm.floor`): a kernel whose programs each run over one row's context
    lasts as long as the longest row's. Timed like that (rung 1 pays 0.3 ms at 256 positions,
    0.9 ms at 768; every rung the same at a context: bound by the row, not the tokens), 24 real
    tokens at a mean of 200 positions whose longest row holds 700 cost what 700 costs at rung 1,
    not what 200 does; with every row at the mean the floor is the mean's own price, and with
    the longest row unknown (0) the mean prices the round as before."""
    def extra(c):
        return 3e-4 * min(c, 256) / 256 + 6e-4 * max(c - 256, 0) / 512
    rungs = (1, 2, 4, 8, 16, 32)
    base = VerifyCost(rungs, tuple(0.004 + 1e-5 * t for t in rungs))
    term = ContextTerm.parse({str(c): {str(t): base.cost(t) + extra(c) for t in rungs}
                              for c in (0, 256, 768)})
    assert term.floor(base, 700) == pytest.approx(extra(700))
    assert term.floor(base, 0) == 0.0
    by_mean = term.extra(base, 32, 24 * 200, real_tokens=24)
    assert by_mean == pytest.approx(extra(200) * 24 / 32)
    assert term.extra(base, 32, 24 * 200, real_tokens=24, longest=700) == pytest.approx(
        extra(700))
    # every row at the mean: the floor is no more than the mean's price at a full rung
    assert term.extra(base, 32, 32 * 200, longest=200) == pytest.approx(extra(200))
    # a rung that pays more than the floor (throughput-bound) keeps its own price
    wide = ContextTerm.parse({"256": {str(t): base.cost(t) + 1.6e-4 * t for t in rungs}})
    assert wide.floor(base, 256) == pytest.approx(1.6e-4)
    assert wide.extra(base, 32, 32 * 256, longest=256) == pytest.approx(32 * 1.6e-4)
    model = CostModel(ROUND, base, term, None)
    assert model.round_seconds(0, 32, 4, 24 * 200, 24, longest=700) == pytest.approx(
        shape_cost(ROUND, base, 0, 32, 4) + extra(700))


def test_the_prefill_fit_recovers_known_terms() -> None:
    """Synthetic timings of the form the model assumes, sampled as `prefill_shapes` samples:
    narrow rows at every rows bucket, one row at every wider width, more rows at the widest."""
    from workers.worker.round_cost import padded_positions

    def slot_part(slots):   # bends: weight-bound up to 256 slots, compute-bound beyond
        return 0.005 + 1e-6 * slots + 4e-6 * max(slots - 256, 0)

    def seconds(rows, width):
        return slot_part(rows * width) + 5e-11 * padded_positions(rows, width)
    shapes = [(r, 32) for r in (1, 2, 4, 8, 16, 32, 64)] + [(64, 64)]
    shapes += [(1, w) for w in (64, 128, 256, 512, 1024)] + [(2, 1024), (4, 1024)]
    term = fit_prefill([(r * w, padded_positions(r, w), seconds(r, w)) for r, w in shapes])
    assert term.per_position == pytest.approx(5e-11, rel=1e-6)
    assert term.slots == (32, 64, 128, 256, 512, 1024, 2048, 4096)
    for rows, width in ((1, 1024), (8, 512), (3, 100), (16, 128)):
        pos = padded_positions(rows, width)
        assert term.cost(rows * width, pos) == pytest.approx(seconds(rows, width), rel=1e-6)
    # the ragged path beyond: the slot part extended by its last segment
    assert term.cost(8192, causal_positions([1024] * 8)) == pytest.approx(
        slot_part(8192) + 5e-11 * causal_positions([1024] * 8), rel=1e-6)
    # nothing off the knots: no per-position cost
    assert fit_prefill([(32, 1, 0.01), (64, 1, 0.02)]).per_position is None
    assert causal_positions([1, 2, 3]) == 1 + 3 + 6
    assert padded_positions(2, 3) == 2 * 6


def test_the_model_prices_a_round_at_its_context() -> None:
    model = CostModel(ROUND, BASE, linear_context(), None)
    base = shape_cost(ROUND, BASE, 3, 8, 4)
    assert model.round_seconds(3, 8, 4) == pytest.approx(base)
    assert model.round_seconds(3, 8, 4, positions=6000, real_tokens=7) == pytest.approx(
        base + SLOPE * 6000)
    assert model.prefill_seconds(512, 1000) == 0.0
    assert [u.split(" ")[0] for u in model.unpriced()] == ["prefill", "catch-up"]
    assert CostModel(ROUND, BASE).round_seconds(3, 8, 4, positions=6000) == pytest.approx(base)


def test_an_older_table_loads_with_both_terms_unpriced(tmp_path) -> None:
    # the one-H200 8B table as it was before its terms were copied in (2026-12-03)
    data = json.loads(Path("docs/data/cost_tables/h200_tp1_llama3-8b.json").read_text())
    for key in TERM_KEYS:
        data.pop(key, None)
    older = tmp_path / "older.json"
    older.write_text(json.dumps(data))
    model = cost_model(str(older))
    assert model.context is None and model.prefill is None and model.verify_cost is not None
    assert [u.split(" ")[0] for u in model.unpriced()] == ["context", "prefill", "catch-up"]
    assert model.round_seconds(0, 64, 64, positions=20_000) == pytest.approx(
        model.round_seconds(0, 64, 64))
    assert model.prefill_seconds(4096, 10**6) == 0.0


def test_the_shipped_8b_table_holds_both_terms() -> None:
    """`h200_tp1_llama3-8b.json` with the terms of the first GPU check (model_shapes
    --cost-context 256 768, copied with --copy-terms): contexts 0/256/768 on the verify
    forward's rungs, the prefill by slots from 32 to 16384 with its attention."""
    model = cost_model("docs/data/cost_tables/h200_tp1_llama3-8b.json")
    assert [u.split(" ")[0] for u in model.unpriced()] == ["catch-up"]   # a version-1 file
    assert model.context.contexts == (0, 256, 768)
    assert model.context.tokens == model.verify_cost.tokens
    assert model.prefill.slots[0] == 32 and model.prefill.slots[-1] == 16384
    assert model.prefill.per_position > 0
    # a longer context costs more at every rung; the floor at 768 is rung 1's own extra
    for j, t in enumerate(model.context.tokens):
        assert model.context.extra(model.verify_cost, t, 768 * t) > model.context.extra(
            model.verify_cost, t, 256 * t) > 0
    assert model.context.floor(model.verify_cost, 768) == pytest.approx(
        model.context.costs[2][0] - model.context.costs[0][0])


def test_the_first_gpu_check_repriced_with_its_longest_rows(capsys) -> None:
    """The committed one-H200 schedule run (2026-12-03, recorded before `longest_context`): the
    replay of its arrivals gives every depth-0 round's request count exactly and its positions
    within one per request; priced with its own terms and no longest row the replay reproduces
    the run's own prices (decode x1.067), with the floor at the longest row its decode rounds
    come within 2% (x1.015)."""
    from scripts.bench.model_shapes import replay_contexts, reprice

    run = Path("docs/data/runs/schedule_check_h200_8b_costmodel_2026-12-03.json")
    data = json.loads(run.read_text())
    rounds = data["schedule_check"]["rounds"]
    longest = replay_contexts(rounds, 96, data["context"], 128256)
    assert len(longest) == len(rounds)
    for r, c in zip(rounds, longest):   # the longest row: within the round's positions
        assert 16 <= c <= 512 + 256
        if r["steps"] == 0:
            assert c <= r["positions_read"] + r["requests"]
    model = cost_model(str(run))
    again = sum(model.round_seconds(r["steps"], r["tokens"], r["batch"], r["positions_read"],
                                    r["verify_tokens_real"]) for r in rounds
                if r["kind"] == "decode")
    assert again == pytest.approx(data["schedule_check"]["decode"]["predicted_s"])
    kinds = reprice(run)
    assert kinds["decode"]["measured_over_predicted"] == pytest.approx(1.015, abs=0.001)
    assert kinds["mixed"]["measured_over_predicted"] == pytest.approx(0.955, abs=0.001)
    assert kinds["all"]["rounds"] == len(rounds)
    assert "decode" in capsys.readouterr().out
    with pytest.raises(ValueError, match="round 0"):
        replay_contexts(rounds, 96, data["context"], 1000)   # another schedule


def _file(tmp_path, **extra) -> str:
    data = {"agreed_round_cost_ms": {"1": {"0": 5.0, "3": 6.0}, "4": {"0": 5.2, "3": 7.5}},
            "agreed_verify_cost_ms": {str(t): 1e3 * c for t, c in zip(RUNGS, BASE.costs)}}
    data.update(extra)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_table_with_both_terms_reads_back(tmp_path) -> None:
    ctx = {c: {t: 1e3 * v for t, v in row.items()}
           for c, row in linear_context((256, 1024)).to_json().items()}
    prefill = PrefillTerm((32, 4096), (0.003, 0.09), 4e-11)
    model = cost_model(_file(tmp_path, **{CONTEXT_KEY: ctx}, **prefill.to_json()))
    assert model.context.contexts == (256, 1024)
    assert [u.split(" ")[0] for u in model.unpriced()] == ["catch-up"]
    assert model.context.extra(model.verify_cost, 16, 9000) == pytest.approx(SLOPE * 9000)
    assert model.prefill.per_position == pytest.approx(4e-11)
    assert model.prefill_seconds(2064, 10**6) == pytest.approx(0.003 + 0.087 / 2 + 4e-5)


@pytest.mark.parametrize("extra,shown", [
    ({CONTEXT_KEY: {"0": {"1": 4.0}}}, "only context 0"),
    ({CONTEXT_KEY: {"x": {"1": 4.0}}}, "must be a context >= 0"),
    ({CONTEXT_KEY: {"64": {"1": 4.0, "2": 4.1}, "128": {"1": 4.2}}}, "differ from context 64"),
    ({CONTEXT_KEY: {"64": {"3": 4.0}}}, "token counts [3] have no context-0 cost"),
    ({CONTEXT_KEY: [1, 2]}, "must be a non-empty object"),
    ({PREFILL_KEY: {"32": -1.0}}, "positive finite"),
    ({PREFILL_KEY: {"32": 1.0}, PREFILL_POSITION_KEY: "x"}, "ms per million positions"),
])
def test_bad_terms_are_named(tmp_path, extra, shown) -> None:
    path = _file(tmp_path, **extra)
    with pytest.raises(ConfigError) as err:
        cost_model(path)
    assert shown in str(err.value) and path in str(err.value)


def test_the_measurement_produces_both_terms_on_the_cpu() -> None:
    """The tiny pair, eager: the verify forward at two contexts (one beyond a slot's pages, held
    at what fits) on two rungs, and every prefill shape, fitted."""
    import torch

    from engine_fixtures import engine_for, tiny_pair
    from adaptive_dist.config import AdaptiveConfig
    from workers.worker.round_cost import (measure_prefills, measure_target_contexts,
                                           prefill_shapes, room)

    torch.set_num_threads(1)
    target, head = tiny_pair()
    config = AdaptiveConfig(policy="goodput", candidate_steps=(0, 1), initial_steps=1,
                            round_cost={"0": 1.0, "1": 1.5})
    engine = engine_for(target, head, "ema", config=config, max_batch=2)
    worker = engine.worker
    ladder = worker.ladder[:2]
    at = measure_target_contexts(worker, ladder, [8, 10**6], repeats=1)
    assert list(at) == [8, room(worker, 10**6)] and room(worker, 10**6) > 8
    assert all(list(row) == list(ladder) and min(row.values()) > 0 for row in at.values())
    term = ContextTerm.parse({str(c): {str(t): v for t, v in row.items()}
                              for c, row in at.items()})
    assert term.tokens == tuple(ladder)
    cap = worker.prefill_runner.cap
    samples = measure_prefills(worker, repeats=1, ragged=[2 * cap])
    shapes = prefill_shapes(worker, [2 * cap])
    assert [(s.rows, s.width) for s in samples] == shapes
    assert shapes[0] == (1, 32) and shapes[-1] == (0, 2 * cap)
    assert (2, 32) in shapes and (1, 64) in shapes          # little and more attention
    assert all(s.seconds > 0 for s in samples)
    fitted = fit_prefill([(s.slots, s.positions, s.seconds) for s in samples])
    assert fitted.slots[0] == 32 and fitted.slots[-1] == 2 * cap and fitted.per_position is not None
    # the slots are as the measurement found them: the engine still generates
    from workers.sampling import SamplingParams
    done = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    assert len(done[0].output_ids) == 4


def test_the_schedule_check_prices_every_kind_on_the_cpu() -> None:
    """`scripts.bench.model_shapes.check_schedule` on the tiny pair with per-request budgets
    (eager, overlap on): every plan is charged the step after it, every kind is priced with the
    terms of the model, and the served prediction is the tokens over the summed prices."""
    import torch

    from engine_fixtures import engine_for, per_request_config, tiny_pair
    from scripts.bench.model_shapes import KINDS, check_schedule

    torch.set_num_threads(1)
    target, head = tiny_pair()
    engine = engine_for(target, head, "ema", config=per_request_config(top_tokens=64),
                        max_batch=4, overlap=True)
    spec = engine.config.spec
    ladder = spec.verify_cost.tokens
    context = ContextTerm.parse({"256": {str(t): spec.verify_cost.cost(t) + 1e-3 * t
                                         for t in ladder}})
    prefill = PrefillTerm((32, 1024), (0.5, 2.0), 1e-6)
    model = CostModel(spec.round_cost, spec.verify_cost, context, prefill)
    out = check_schedule(engine, 10, 288, target.config.vocab_size, model)
    rounds = out["rounds"]
    assert {r["kind"] for r in rounds} <= set(KINDS) and out["decode"]["rounds"] > 0
    assert out["prefill"]["rounds"] + out["mixed"]["rounds"] > 0
    for r in rounds:
        assert r["seconds"] > 0 and r["predicted"] >= r["base"] > 0
        if r["prefill_slots"]:
            assert r["predicted_prefill"] == pytest.approx(
                prefill.cost(r["prefill_slots"], r["prefill_positions"]))
        assert 0 < r["longest_context"] <= r["positions_read"]
        assert r["predicted_decode"] == pytest.approx(model.round_seconds(
            r["steps"], r["tokens"], r["batch"], r["positions_read"], r["verify_tokens_real"],
            r["longest_context"]))
    every = out["all"]
    assert every["rounds"] == len(rounds)
    assert every["predicted_s"] == pytest.approx(sum(r["predicted"] for r in rounds))
    served = out["served"]
    assert served["predicted_tokens_per_s"] == pytest.approx(
        served["output_tokens"] / every["predicted_s"])
    assert [u.split(" ")[0] for u in out["unpriced"]] == ["catch-up"]
    assert engine.scheduler.has_work is False


def test_copy_terms_into_a_table_file(tmp_path) -> None:
    from scripts.bench.model_shapes import copy_terms

    run = tmp_path / "run.json"
    run.write_text(json.dumps({CONTEXT_KEY: {"0": {"1": 4.0}, "512": {"1": 4.6}},
                               **PrefillTerm((32, 4096), (3.0e-3, 9e-2), 4e-11).to_json(),
                               "command": "model_shapes --cost-context 512"}))
    table = _file(tmp_path)
    copy_terms(run, tmp_path / "table.json")
    model = cost_model(table)
    assert model.context.contexts == (0, 512)
    assert [u.split(" ")[0] for u in model.unpriced()] == ["catch-up"]
    assert json.loads(open(table).read())["cost_terms_command"] == "model_shapes --cost-context 512"
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(run.read_text()), "shape": "qwen3-30b-a3b"}))
    shaped = tmp_path / "shaped.json"
    shaped.write_text(json.dumps({**json.loads(open(table).read()), "shape": "llama3-8b"}))
    with pytest.raises(SystemExit, match="other shape"):
        copy_terms(other, shaped)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"command": "model_shapes"}))
    with pytest.raises(SystemExit, match="no cost model terms"):
        copy_terms(bare, tmp_path / "table.json")
