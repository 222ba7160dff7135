"""`scripts.bench.production_serving` (issue 34 §2): SGLang's bench_serving against `serve` next
to the engine's round-table prediction. End to end on the CPU at a tiny random shape (the
checkpoint written by make_checkpoint, its tokenizer, the round table measured in a process of its
own, the server, bench_serving, /metrics, JSON and plot); the prediction's arithmetic on its own."""
from __future__ import annotations

import json
import os

import pytest

from scripts.bench import production_serving as ps
from scripts.bench import sglang_client

TABLE = {"1": {"0": 0.005, "3": 0.006}, "16": {"0": 0.005, "3": 0.0065},
         "64": {"0": 0.0057, "3": 0.0102}}


def test_the_prediction_prices_the_bucket_that_holds_the_batch() -> None:
    assert ps.bucket_of(TABLE, 1) == "1" and ps.bucket_of(TABLE, 2) == "16"
    assert ps.bucket_of(TABLE, 64) == "64" and ps.bucket_of(TABLE, 100) == "64"
    plain = ps.predict(TABLE, 64, {0: 10}, 0.0)
    assert plain["bucket"] == 64 and plain["tokens_per_s"] == pytest.approx(64 / 0.0057)
    # a quarter of the rounds at depth 3, 0.5 accepted tokens per request-round on average
    mixed = ps.predict(TABLE, 16, {0: 30, 3: 10}, 0.5)
    t = 0.75 * 0.005 + 0.25 * 0.0065
    assert mixed["tokens_per_s"] == pytest.approx(16 * 1.5 / t)
    assert mixed["depth_share"] == {"0": 0.75, "3": 0.25}


def test_a_level_is_compared_with_what_the_server_ran() -> None:
    before = {"adaptive_dist_rounds_total": 100, "adaptive_dist_round_seconds_total": 1.0,
              "rounds_at_steps_0": 90, "rounds_at_steps_3": 10,
              "adaptive_dist_spec_decode_num_drafts_total": 40,
              "adaptive_dist_spec_decode_num_accepted_tokens_total": 4}
    after = {"adaptive_dist_rounds_total": 300, "adaptive_dist_round_seconds_total": 2.2,
             "rounds_at_steps_0": 240, "rounds_at_steps_3": 60,
             "adaptive_dist_spec_decode_num_drafts_total": 840,
             "adaptive_dist_spec_decode_num_accepted_tokens_total": 404}
    server = ps.metric_delta(before, after, 16)
    assert server["rounds"] == 200 and server["mean_round_ms"] == pytest.approx(6.0)
    assert server["rounds_at_depth"] == {"0": 150, "3": 50}
    row = {"mode": "goodput", "concurrency": 16, "server": server,
           "bench": {"completed": 64, "output_throughput": 1500.0, "mean_tpot_ms": 8.0}}
    ps.compare(row, TABLE)
    # 800 drafts, 400 accepted: 0.5 a drafting request-round, a quarter of the rounds drafting
    assert row["prediction"]["accepted_per_request_round"] == pytest.approx(0.125)
    served = row["served"]
    assert served["decode_tokens_per_s"] == pytest.approx(16 * 1000 / 8.0)
    assert served["decode_over_prediction"] == pytest.approx(
        2000 / row["prediction"]["tokens_per_s"])
    plain = {"mode": "no-spec", "concurrency": 16, "server": ps.metric_delta({}, {}, 16),
             "bench": {"completed": 64, "output_throughput": 1000.0, "mean_tpot_ms": 10.0}}
    ps.compare(plain, TABLE)
    assert plain["prediction"]["tokens_per_s"] == pytest.approx(16 / 0.005)
    ratio = ps.ratios([row, plain])
    assert ratio["16"]["output_tokens_per_s"] == pytest.approx(1.5)


def test_the_served_prediction_prices_each_wave_s_prefill() -> None:
    from adaptive_dist.cost_tables import PrefillTerm

    prefill = PrefillTerm((1024, 65536), (0.02, 1.0), 2e-11)
    tables = {"table_s": TABLE, **prefill.to_json()}
    row = {"mode": "goodput", "concurrency": 64, "server": ps.metric_delta({}, {}, 64),
           "bench": {"completed": 256, "output_throughput": 4000.0, "mean_tpot_ms": 10.0}}
    ps.compare(row, TABLE, tables, input_len=1024, output_len=256)
    served = row["prediction"]["served"]
    # a wave: 255 decode rounds of 5.7 ms, one prefill of 64 x 1024 slots and 64 x 1024 x 1025 / 2
    # positions
    wave = 255 * 0.0057 + 1.0 + 2e-11 * 64 * 1024 * 1025 / 2
    assert served["tokens_per_s"] == pytest.approx(64 * 256 / wave)
    assert served["prefill_share"] == pytest.approx(1 - 255 * 0.0057 / wave)
    assert row["served"]["output_over_served_prediction"] == pytest.approx(
        4000.0 / served["tokens_per_s"])
    # a table without the prefill term says so
    row2 = {"mode": "no-spec", "concurrency": 1, "server": ps.metric_delta({}, {}, 1)}
    ps.compare(row2, TABLE, {"table_s": TABLE}, input_len=1024, output_len=256)
    assert row2["prediction"]["served"]["tokens_per_s"] is None
    assert "prefill" in row2["prediction"]["served"]["unpriced"]


def test_a_wave_s_catchups_are_priced_at_their_contexts() -> None:
    """Cost model version 2: goodput's depth-0 rounds priced without the table's share of
    catch-ups (one per 32 rounds at the table's context) and with the wave's own at their
    contexts; no-spec (no head) and a table without the term unchanged."""
    from adaptive_dist.cost_tables import (CATCHUP_BASE_KEY, CATCHUP_KEY, CATCHUP_ROUNDS_KEY,
                                           PrefillTerm)

    prefill = PrefillTerm((1024, 65536), (0.02, 1.0), 2e-11)
    # one catch-up at bucket 64: 2 ms at no context, 4 ms at 1000 positions (2 us a position)
    term = {CATCHUP_KEY: {"0": {"16": 1.0, "64": 2.0}, "1000": {"16": 1.5, "64": 4.0}},
            CATCHUP_ROUNDS_KEY: 32, CATCHUP_BASE_KEY: 1152}
    tables = {"table_s": TABLE, "context": 1152, **prefill.to_json(), **term}
    pred = {"round_ms": 5.7, "accepted_per_request_round": 0.0, "depth_share": {"0": 1.0}}
    plain = ps.predict_served({"table_s": TABLE, **prefill.to_json()}, 64, pred, 1024, 256)
    got = ps.predict_served(tables, 64, pred, 1024, 256)
    c = got["catchups"]
    assert c["catchups"] == pytest.approx(255 / 32)
    assert c["table_share_s"] == pytest.approx(255 / 32 * (2e-3 + 2e-6 * 1152))
    # eight equal parts of 1024 .. 1280: their midpoints, 2 ms + 2 us a position
    mids = [1024 + 256 * (i + 0.5) / 8 for i in range(8)]
    assert c["catchup_s"] == pytest.approx(255 / 32 * sum(2e-3 + 2e-6 * m for m in mids) / 8)
    assert got["wave_decode_s"] - plain["wave_decode_s"] == pytest.approx(
        c["catchup_s"] - c["table_share_s"])
    assert "catch-up" in plain["unpriced"]
    nospec = ps.predict_served(tables, 64, pred, 1024, 256, mode="no-spec")
    assert nospec["wave_decode_s"] == plain["wave_decode_s"] and "catchups" not in nospec
    # repriced: the summary's round time was measured at I + O / 2 cached positions
    text = ("| goodput | 64 | 64 | 5.70 | 11228 | 6364 | 0.57 | 3917 | 1938 | 10.06 | 0: 1 |\n"
            "| no-spec | 64 | 64 | 5.70 | 11228 | 6216 | 0.55 | 4110 | 1732 | 10.30 | 0: 1 |")
    rows = {r["mode"]: r for r in ps.reprice(text, {**tables, CATCHUP_BASE_KEY: 0}, 1024, 256)}
    assert rows["goodput"]["served_prediction"]["catchups"]["table_share_s"] == pytest.approx(
        c["table_share_s"])
    assert "catchups" not in rows["no-spec"]["served_prediction"]


def test_the_committed_8b_run_repriced_with_the_measured_prefill_term() -> None:
    """`--reprice`: the one-H200 8B run's printed table (2026-12-03, its per-level results.json
    not kept) against the 8B table's prefill term: each level a wave of (O - 1) decode rounds
    at the level's table round time and one prefill of c x 1024 tokens."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs/data/runs/production_serving_h200_8b/summary.log").read_text()
    tables = ps.table_from_file(str(root / "docs/data/cost_tables/h200_tp1_llama3-8b.json"))
    rows = ps.reprice(text, tables, 1024, 256)
    got = {(r["mode"], r["concurrency"]): r for r in rows}
    assert sorted(got) == sorted((m, c) for m in ("no-spec", "goodput") for c in (1, 16, 64))
    r = got[("no-spec", 64)]
    assert r["round_ms"] == 8.24 and r["output_tokens_per_s"] == 4110
    assert r["accepted_per_request_round"] == pytest.approx(0.0, abs=1e-3)
    from adaptive_dist.cost_tables import PrefillTerm, causal_positions

    prefill = PrefillTerm.parse(tables["prefill_cost_ms"],
                                tables["prefill_ms_per_million_positions"])
    wave = 255 * 8.24e-3 + prefill.cost(64 * 1024, causal_positions([1024] * 64))
    assert r["served_prediction"]["tokens_per_s"] == pytest.approx(64 * 256 / wave)
    assert r["output_over_served_prediction"] == pytest.approx(4110 * wave / (64 * 256))
    assert r["output_over_decode_prediction"] == pytest.approx(4110 / 7765)
    assert 0.90 < r["output_over_served_prediction"] < 0.92
    assert 0.87 < got[("goodput", 64)]["output_over_served_prediction"] < 0.88
    with pytest.raises(ValueError, match="no rows"):
        ps.summary_rows("nothing here")


def test_a_cost_table_file_is_read_in_seconds(tmp_path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"context": 1024, "agreed_round_cost_ms": {"1": {"0": 5.0}}}))
    assert ps.table_from_file(str(path))["table_s"] == {"1": {"0": 0.005}}
    assert "prefill_cost_ms" not in ps.table_from_file(str(path))
    path.write_text(json.dumps({"agreed_round_cost_ms": {"1": {"0": 5.0}},
                                "prefill_cost_ms": {"32": 3.0, "4096": 90.0},
                                "prefill_ms_per_million_positions": 0.04}))
    read = ps.table_from_file(str(path))
    assert read["prefill_cost_ms"] == {"32": 3.0, "4096": 90.0}
    assert read["prefill_ms_per_million_positions"] == 0.04


PROBLEM = sglang_client.importable()
if PROBLEM is not None and os.environ.get("ADAPTIVE_DIST_REQUIRE_SGLANG") == "1":
    raise RuntimeError(f"sglang.bench_serving does not import ({PROBLEM}); scripts/setup_env.sh "
                       f"installs it")


@pytest.mark.skipif(PROBLEM is not None, reason=f"sglang.bench_serving does not import here "
                                                f"({PROBLEM})")
def test_end_to_end_on_the_cpu_at_a_tiny_shape(tmp_path) -> None:
    out = tmp_path / "out"
    code = ps.main(["--checkpoint", str(tmp_path / "ckpt"), "--shape", "tiny", "--device", "cpu",
                    "--modes", "no-spec", "--concurrency", "2", "--input-len", "16",
                    "--output-len", "8", "--max-batch-size", "2", "--max-model-len", "64",
                    "--min-prompts", "4", "--prompts-per-level", "2", "--out", str(out)])
    report = json.loads((out / "results.json").read_text())
    assert code == 0, [r.get("error") for r in report["rows"]]
    assert (out / "production_serving.png").is_file()
    assert (tmp_path / "ckpt" / "target" / "tokenizer.json").is_file()
    [row] = report["rows"]
    bench = row["bench"]
    assert bench["completed"] == 4 and bench["total_output_tokens"] == 4 * 8
    assert bench["total_output_tokens_retokenized"] == 4 * 8     # every token came back as text
    assert row["server"]["rounds"] > 0 and set(row["server"]["rounds_at_depth"]) == {"0"}
    assert row["prediction"]["bucket"] == 2 and row["prediction"]["tokens_per_s"] > 0
    assert row["served"]["decode_over_prediction"] > 0
    table = report["modes"]["no-spec"]["table_s"]
    assert set(table) == {"1", "2"} and all(set(r) == {"0"} for r in table.values())
    # the table process measured the prefill term: the output prediction prices each wave's
    assert report["modes"]["no-spec"]["prefill_cost_ms"]
    assert row["prediction"]["served"]["tokens_per_s"] > 0
    assert row["served"]["output_over_served_prediction"] > 0


def test_goodput_s_table_process_measures_the_catchup_term(tmp_path) -> None:
    """The table process (`--tables-only`: the engine built as `serve --adaptive --policy
    goodput` builds it, in a process of its own) writes the catch-up term beside the prefill
    term: every bucket of its round table at its contexts, as cost model version 2, and a
    cost table file of it loads with the term."""
    from adaptive_dist.cost_tables import (CATCHUP_BASE_KEY, CATCHUP_KEY, CATCHUP_ROUNDS_KEY,
                                           VERSION_KEY, cost_model)

    out = tmp_path / "out"
    args = ps.parse_args(["--checkpoint", str(tmp_path / "ckpt"), "--shape", "tiny",
                          "--device", "cpu", "--modes", "goodput", "--concurrency", "2",
                          "--input-len", "16", "--output-len", "8", "--max-batch-size", "2",
                          "--max-model-len", "64", "--tables-only", "--out", str(out)])
    report = ps.run(args)
    tables = report["modes"]["goodput"]
    assert tables[VERSION_KEY] == 2 and tables[CATCHUP_ROUNDS_KEY] == 32
    term = tables[CATCHUP_KEY]
    # contexts 0, 20 and 40: the first two held at the ring's 32 entries (a catch-up writes
    # the 32 positions before its rows' ends), measured once
    assert sorted(map(int, term)) == [32, 40]
    assert all(set(row) == set(tables["table_s"]) for row in term.values())
    assert all(v > 0 for row in term.values() for v in row.values())
    table = tmp_path / "table.json"
    table.write_text(json.dumps({
        "agreed_round_cost_ms": {b: {d: 1e3 * v for d, v in row.items()}
                                 for b, row in tables["table_s"].items()},
        VERSION_KEY: 2, CATCHUP_KEY: term, CATCHUP_ROUNDS_KEY: tables[CATCHUP_ROUNDS_KEY],
        CATCHUP_BASE_KEY: tables[CATCHUP_BASE_KEY]}))
    model = cost_model(str(table))
    assert model.catchup.every == 32 and model.catchup.base_context == 20
    assert model.catchup_seconds(2, 20) > 0


def test_the_head_s_part_of_a_prefill_is_goodput_s_over_no_spec_s() -> None:
    modes = {"goodput": {"prefill_samples": [{"rows": 1, "width": 32, "seconds": 0.0052},
                                             {"rows": 0, "width": 65536, "seconds": 1.55}]},
             "no-spec": {"prefill_samples": [{"rows": 1, "width": 32, "seconds": 0.005},
                                             {"rows": 0, "width": 65536, "seconds": 1.5},
                                             {"rows": 2, "width": 32, "seconds": 0.006}]}}
    got = ps.prefill_ratios(modes)
    assert sorted(got) == ["1 x 32", "ragged 65536"]
    assert got["ragged 65536"]["ratio"] == pytest.approx(1.55 / 1.5)
    assert got["1 x 32"]["no_spec_ms"] == pytest.approx(5.0)
    assert ps.prefill_ratios({"goodput": modes["goodput"]}) == {}
