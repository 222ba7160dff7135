"""scripts.bench.adaptive's continuous arrivals: at most `batch` requests in flight, every
prompt runs to its budget, and the outputs equal the same prompts run as one closed batch
(greedy decoding does not depend on who shares the batch)."""
import sys
from pathlib import Path

from engine_fixtures import engine_for, random_prompts, tiny_pair
from workers.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _bench_adaptive():
    from scripts.bench import adaptive

    return adaptive


def test_continuous_arrivals_keep_at_most_batch_in_flight_and_match_a_closed_batch():
    bench = _bench_adaptive()
    target, head = tiny_pair()
    prompts = random_prompts(7, target.config.vocab_size, seed=3)
    params = SamplingParams(max_new_tokens=6)
    engine = engine_for(target, head, "static", steps=2, max_batch=8)
    in_flight = []
    step = engine.step

    def counted(*args, **kwargs):
        sched = engine.scheduler
        in_flight.append(len([r for r in sched.running if not r.finished]) + len(sched.waiting))
        return step(*args, **kwargs)
    engine.step = counted
    reqs = bench.run_continuous(engine, prompts, 3, params)
    assert max(in_flight) == 3 and len(reqs) == 7
    assert all(r.finished for r in reqs) and not engine.scheduler.has_work
    closed = engine_for(target, head, "static", steps=2, max_batch=8).generate(prompts, params)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in closed]


def test_budgets_are_seeded_and_within_the_spread():
    bench = _bench_adaptive()
    a = bench.budgets(200, 64, 0.5, seed=1)
    assert a == bench.budgets(200, 64, 0.5, seed=1) and a != bench.budgets(200, 64, 0.5, seed=2)
    assert min(a) >= 32 and max(a) <= 96 and len(set(a)) > 20
    assert bench.budgets(5, 64, 0.0) == [64] * 5


def test_continuous_arrivals_take_one_params_per_prompt():
    bench = _bench_adaptive()
    target, head = tiny_pair()
    prompts = random_prompts(5, target.config.vocab_size, seed=4)
    params = [SamplingParams(max_new_tokens=n) for n in (3, 9, 1, 6, 4)]
    engine = engine_for(target, head, "static", steps=2, max_batch=8)
    reqs = bench.run_continuous(engine, prompts, 2, params)
    assert [len(r.output_ids) for r in reqs] == [3, 9, 1, 6, 4]


def test_depth0_head_holds_the_goodput_engine_at_depth_0():
    """The diagnostic policy: a goodput engine (head kept current) whose depth 7 is priced out of
    reach and whose probes never come: it runs every round at depth 0, lossless."""
    bench = _bench_adaptive()
    spec = bench.spec_of("depth0_head")
    assert spec.policy == "goodput" and spec.candidate_steps == (0, 7) and spec.initial_steps == 0
    assert "depth0_head" not in bench.POLICIES   # not in the default run
    target, head = tiny_pair()
    prompts = random_prompts(6, target.config.vocab_size, seed=8)
    engine = engine_for(target, head, "ema", config=spec, max_batch=4)
    out = bench.run_continuous(engine, prompts, 2, SamplingParams(max_new_tokens=20))
    stats = engine.planner.stats
    assert stats.switches == 0 and set(stats.rounds_at_steps) == {0}
    assert stats.shadow_rounds > 0            # the head was caught up and checked
    plain = engine_for(target, None, "nospec", max_batch=4).generate(
        prompts, SamplingParams(max_new_tokens=20))
    assert [r.output_ids for r in out] == [r.output_ids for r in plain]


def test_model_costs_price_each_phase_by_its_rounds():
    """`--model-costs`: a phase's seconds are its rounds priced by the table, the row picked by
    the round's padded batch as the policy picks it (larger batches: the largest row)."""
    from adaptive_dist.config import RoundCost

    bench = _bench_adaptive()
    table = RoundCost.parse({"1": {"0": 1.0, "2": 3.0}, "4": {"0": 2.0, "2": 5.0}})
    # by hand: 3 rounds at depth 2, batch 1 (row "1"): 9; 2 at depth 0, batch 4: 4; 1 at depth
    # 2, batch 8 (past the largest row: "4"): 5
    assert bench.modelled_seconds({(2, 1, 3): 3, (0, 4, 4): 2, (2, 8, 24): 1}, table) == 18.0
    target, head = tiny_pair()
    prompts = random_prompts(6, target.config.vocab_size, seed=5)
    engine = engine_for(target, head, "static", steps=2, max_batch=4)
    res = bench.run_phases(engine, [prompts[:3], prompts[3:]], 5, "cpu", batch=2, model=table)
    shapes = engine.planner.stats.rounds_at_shape
    assert {steps for steps, _, _ in shapes} == {2} and {b for _, b, _ in shapes} <= {1, 2}
    assert all(ph["wall_seconds"] > 0 for ph in res["phases"])
    assert sum(ph["seconds"] for ph in res["phases"]) == bench.modelled_seconds(shapes, table)
    assert sum(shapes.values()) == engine.planner.stats.counted_rounds


def test_phase_windows_keep_the_replica_full_for_a_fixed_number_of_rounds():
    """`--phase-rounds`: every phase is that many rounds with the replica kept full (every round
    starts with `batch` requests in flight or queued); requests in flight at a window's end run
    on into the next; the last window's are aborted; the windows' tokens are every token the
    requests committed."""
    bench = _bench_adaptive()
    target, head = tiny_pair()
    prompts = random_prompts(3, target.config.vocab_size, seed=6)
    for engine in (engine_for(target, None, "nospec", max_batch=4),
                   engine_for(target, head, "static", steps=2, max_batch=4)):
        made, full = [], []
        add, step = engine.add, engine.step

        def counted_add(*args, _add=add, **kwargs):
            made.append(_add(*args, **kwargs))
            return made[-1]

        def counted_step(*args, _engine=engine, _step=step, **kwargs):
            sched = _engine.scheduler
            full.append(len([r for r in sched.running if not r.finished]) + len(sched.waiting))
            return _step(*args, **kwargs)
        engine.add, engine.step = counted_add, counted_step
        res = bench.run_phases(engine, [prompts, prompts[::-1]], 5, "cpu", batch=2, spread=0.5,
                               window=9)
        assert res["phase_rounds"] == [9, 18] and full[:18] == [2] * 18
        assert sum(ph["tokens"] for ph in res["phases"]) == sum(len(r.output_ids) for r in made)
        assert all(ph["tokens"] >= 18 for ph in res["phases"])   # >= 1 token a request a round
        assert len(made) > 6                             # prompts cycled past the three given
        assert [r.finish_reason for r in made].count("abort") >= 1
        assert not engine.scheduler.has_work


def test_policy_names_take_a_catchup_interval():
    bench = _bench_adaptive()
    assert bench.split_policy("goodput") == ("goodput", None, None, {})
    assert bench.split_policy("depth0_head@32") == ("depth0_head", 32, None, {})
    assert bench.split_policy("goodput/nodefer") == ("goodput", None, 0, {})
    assert bench.split_policy("goodput@8/nodefer") == ("goodput", 8, 0, {})
    assert bench.split_policy("goodput@8+reset_nats=0+switch_margin=0.1") == (
        "goodput", 8, None, {"reset_nats": 0, "switch_margin": 0.1})
    for bad, message in (("goodput@0", "integer >= 1"), ("static0@8", "no draft head"),
                         ("greedy@8", "unknown policy"), ("static0/nodefer", "no draft head"),
                         ("goodput+reset_nats", "+KEY=VALUE"), ("static3+ema_alpha=0.5",
                                                                  "no adaptive settings"),
                         ("goodput+reset_nats=-1", "reset_nats=-1.0"),
                         ("goodput+bogus=1", "unknown key")):
        try:
            bench.split_policy(bad)
        except ValueError as err:
            assert message in str(err)
        else:
            raise AssertionError(f"{bad} accepted")


def test_bench_depth0_prices_every_part_per_interval(tmp_path):
    """The depth-0 pricing script end to end on a small random pair: a headless engine and one
    speculating engine per interval, each with its round, catch-up (speculating only) and
    prefill samples, the ratios against the headless engine, the JSON and the plot."""
    import json
    import subprocess

    out = tmp_path / "d0"
    subprocess.run([sys.executable, "-m", "scripts.bench.depth0", "--shape", "tiny",
                    "--batches", "1", "2", "--catchup", "2", "5", "--iters", "1", "--repeats", "2",
                    "--context", "8", "--out", str(out)], check=True, capture_output=True,
                   timeout=600, cwd=ROOT)
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["catchup"] == [2, 5] and (out / "depth0.png").stat().st_size > 0
    for key in ("b=1", "b=2"):
        row = data["results"][key]
        assert list(row) == ["nohead", "head@2", "head@5"]
        assert row["nohead"]["device_vs_headless"] == 1.0 and "catchup" not in row["nohead"]
        for name in ("head@2", "head@5"):
            assert {"round", "catchup", "prefill", "prefill_deferred", "pending",
                    "engine"} <= set(row[name])
            want = row[name]["prefill_deferred"]["median"] / row["nohead"]["prefill"]["median"]
            assert abs(row[name]["prefill_deferred_vs_headless"] - want) < 1e-6 * want
            every = int(name.split("@")[1])
            want = (row[name]["round"]["median"] + row[name]["catchup"]["median"] / every) / \
                row["nohead"]["round"]["median"]
            assert abs(row[name]["device_vs_headless"] - want) < 1e-6 * want
    # parts per engine and bucket: round, prefill, engine; catch-up, deferred prefill, waiting
    # prompts with a head
    assert len(data["samples"]) == 2 * 3 * 3 + 2 * 2 * 3


def test_bench_sampling_runs_both_uniforms_and_compares_tokens(tmp_path):
    """The sampled-round script end to end on a small random pair (on a CPU: generation only, no
    graphs): both engines' samples, the same sampled tokens with either, the JSON and the plot."""
    import json
    import subprocess

    out = tmp_path / "s"
    subprocess.run([sys.executable, "-m", "scripts.bench.sampling", "--shape", "tiny",
                    "--batches", "1", "--requests", "2", "3", "--new-tokens", "5", "--repeats",
                    "2", "--iters", "1", "--context", "8", "--out", str(out)], check=True,
                   capture_output=True, timeout=600, cwd=ROOT)
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["same_tokens"] is True and (out / "sampling.png").stat().st_size > 0
    assert set(data["samples"]) == {f"{e}/generate x{n}" for e in ("torch_uniforms", "fused_uniforms")
                                    for n in (2, 3)}
    assert all(len(v) == 2 and min(v) > 0 for v in data["samples"].values())


def test_host_probe_writes_the_speed_timeline(tmp_path):
    """The host-speed probe end to end, briefly: one rate per window against the median, the
    summary shares, the JSON and the plot; a bad window is refused by name."""
    import json
    import subprocess

    out = tmp_path / "hp"
    subprocess.run([sys.executable, "-m", "scripts.diag.host_probe", "--seconds", "1",
                    "--window", "0.1", "--out", str(out)], check=True, capture_output=True,
                   timeout=120, cwd=ROOT)
    data = json.loads((out / "host_probe.json").read_text())
    assert data["windows"] == len(data["timeline_rel"]) == 10
    assert data["min_rel"] <= 1.0 <= data["max_rel"]
    assert 0 <= data["share_below_0.8"] <= 1 and (out / "host_probe.png").stat().st_size > 0
    bad = subprocess.run([sys.executable, "-m", "scripts.diag.host_probe", "--window", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--window 0.0: must be > 0" in bad.stderr


def test_model_costs_read_a_cost_table_file_in_seconds(tmp_path):
    """`--model-costs FILE`: a start-up cost table file's `agreed_round_cost_ms`, as seconds, and
    the file's name; a bare JSON table as before."""
    import json

    bench = _bench_adaptive()
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"gpu": "x", "agreed_round_cost_ms": {
        "1": {"0": 5.0, "7": 7.0}, "64": {"0": 6.0, "7": 18.0}}}))
    table, name = bench.load_model_costs(str(path))
    assert name == str(path) and table.buckets == (1, 64)
    assert dict(table.rows[1]) == {0: 0.006, 7: 0.018}
    table, name = bench.load_model_costs('{"0": 1.0, "3": 2.0}')
    assert name is None and dict(table.rows[0]) == {0: 1.0, 3: 2.0}
    shipped = ROOT / "docs/data/cost_tables/h200_tp1_llama3-8b.json"
    table, _ = bench.load_model_costs(str(shipped))
    assert table.steps == (0, 1, 3, 7) and 64 in table.buckets


def test_interpolated_depths_are_linear_in_verified_tokens_and_marked():
    """`--interpolate-depths`: a depth between two measured ones is priced linearly (in verified
    tokens, steps + 1), one past the deepest by the last segment extended; measured depths keep
    their cost; a goodput engine's table is cut to its candidates; the goals table names the
    interpolated depths; `staticN` runs any depth."""
    from adaptive_dist.config import RoundCost

    bench = _bench_adaptive()
    table = RoundCost.parse({"1": {"0": 4.0, "1": 5.0, "3": 6.0, "7": 10.0},
                             "64": {"0": 6.0, "1": 7.0, "3": 10.0, "7": 18.0}})
    wide = bench.interpolate_costs(table, [2, 3, 5, 10])
    assert wide.steps == (0, 1, 2, 3, 5, 7, 10)
    assert dict(wide.rows[0]) == {0: 4.0, 1: 5.0, 2: 5.5, 3: 6.0, 5: 8.0, 7: 10.0, 10: 13.0}
    assert dict(wide.rows[1])[5] == 14.0 and dict(wide.rows[1])[10] == 24.0
    cut = bench.restrict_costs(wide, (0, 1, 3, 7))
    assert cut.to_json() == table.to_json()
    assert "depths 2, 5" in bench.goals_markdown([], "cmd", [2, 5])
    assert "Interpolated" not in bench.goals_markdown([], "cmd", [])
    assert bench.split_policy("static10") == ("static10", None, None, {})
    assert bench.is_static("static5") and not bench.is_static("static05")
    assert bench.split_policy("goodput+candidate_steps=[0,1,2,3,5,7]")[3] == {
        "candidate_steps": [0, 1, 2, 3, 5, 7]}
    try:   # a removed key (issue 26) is refused by name, not ignored
        bench.split_policy("goodput+zero_via_smallest=false")
    except ValueError as err:
        assert "zero_via_smallest" in str(err) and "no longer exist" in str(err)
    else:
        raise AssertionError("a removed key was accepted")


def test_mixed_stream_drifts_and_its_budgets_are_lognormal():
    """The mixed workload: regimes drawn from shares that drift over the segments (seeded, the
    same for every policy); budgets log-normal around the median, held to the cap."""
    import statistics

    bench = _bench_adaptive()
    enc = {k: [[i, j] for j in range(5)] for i, k in enumerate(("code", "high_entropy",
                                                               "repetitive"))}
    a, ra = bench.mixed_stream(enc, 4000, 0, 4)
    assert (a, ra) == bench.mixed_stream(enc, 4000, 0, 4) and len(a) == 4000
    assert all(p[0] == ("code", "high_entropy", "repetitive").index(r) for p, r in zip(a, ra))
    _, rc = bench.mixed_stream(enc, 4000, 2, 4)
    # segment 0 starts code-heavy, segment 2 ends repetitive-heavy
    assert ra[:1000].count("code") > 400 and rc[-1000:].count("repetitive") > 400
    b = bench.lognormal_budgets(3000, 200, 0.8, 1200, seed=1)
    assert b == bench.lognormal_budgets(3000, 200, 0.8, 1200, seed=1)
    assert 180 <= statistics.median(b) <= 220 and max(b) == 1200 and min(b) >= 1
    assert sum(x > 1000 for x in b) > 10


def test_warm_workloads_leave_their_warmup_phase_out_and_goals_are_judged():
    """A warm steady workload's first phase is run but not counted; the goal rows say met or
    not by `GOALS`."""
    bench = _bench_adaptive()
    part = {"phases": [{"tokens": 100, "seconds": 1.0}, {"tokens": 300, "seconds": 1.0}],
            "switches": 1, "probes": 0, "rounds_at_steps": {"3": 10}, "timeline": [[0, 3]],
            "phase_rounds": [5, 10]}
    rec = bench.summarise("code_warm", 4, "goodput", 0, [part], 1, warm=1)
    assert rec["tokens_per_second"] == 300 and len(rec["phases"]) == 1
    assert rec["warmup_phases"][0]["tokens"] == 100
    static = bench.summarise("code_warm", 4, "static3", 0, [
        {**part, "phases": [part["phases"][0], {"tokens": 290, "seconds": 1.0}]}], 1, warm=1)
    rows = bench.goal_rows(bench.analyse([rec, static]))
    assert [(r["policy"], r["met"]) for r in rows] == [("goodput", True)]
    assert abs(rows[0]["vs_best_static"] - 300 / 290) < 1e-12
    assert "| code_warm | 4 | goodput |" in bench.goals_markdown(rows, "cmd")


def test_server_shaped_workloads_run_end_to_end(tmp_path):
    """The new workloads through the benchmark on the tiny pair, priced by the shipped table
    file: its name recorded, the goal rows written."""
    import json
    import subprocess

    out = tmp_path / "pp"
    subprocess.run([sys.executable, "-m", "scripts.bench.adaptive", "--device", "cpu",
                    "--batches", "2", "--repeats", "1", "--warmup-runs", "0", "--workloads",
                    "mixed", "code_warm", "transition_long", "--phase-rounds", "4",
                    "--long-phase-rounds", "5", "--mixed-rounds", "4", "--mixed-median", "8",
                    "--mixed-cap", "20", "--policies", "static0", "static3", "goodput",
                    "--model-costs", "docs/data/cost_tables/h200_tp1_llama3-8b.json",
                    "--out", str(out)], check=True, capture_output=True, timeout=600, cwd=ROOT)
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["model_costs_file"].endswith("h200_tp1_llama3-8b.json")
    runs = {(r["workload"], r["policy"]): r for r in data["runs"]}
    assert runs[("transition_long", "goodput")]["phase_rounds"] == [5, 10, 15, 20]
    assert runs[("mixed", "goodput")]["phase_rounds"] == [4, 8, 12, 16]
    assert len(runs[("code_warm", "static3")]["phases"]) == 1
    assert {r["workload"] for r in data["goals"]} == {"mixed", "code_warm", "transition_long"}
    assert (out / "goals.md").is_file() and (out / "mixed_b2.png").stat().st_size > 0


def test_mixed_seed_changes_only_the_mixed_stream():
    """`--mixed-seed`: another seed draws another request stream (regimes and budgets), the
    same seed the same one; seed 0 is the stream every record before the option used."""
    from types import SimpleNamespace

    bench = _bench_adaptive()
    enc = {k: [[i, j] for j in range(50)] for i, k in enumerate(("code", "high_entropy",
                                                                "repetitive"))}

    def stream(seed, replica=0):
        args = SimpleNamespace(mixed_rounds=6, phase_rounds=None, mixed_median=64.0,
                               mixed_sigma=0.8, mixed_cap=400, mixed_seed=seed)
        return bench.workload_phases(args, "mixed", 4, enc, replica)

    assert stream(0) == stream(0) and stream(3) == stream(3)
    phases0, lengths0, window = stream(0)
    phases1, lengths1, _ = stream(1)
    assert window == 6 and len(phases1) == len(phases0) == 4
    assert [len(p) for p in phases1] == [len(p) for p in phases0] == [24] * 4
    assert phases1 != phases0 and lengths1 != lengths0
    # seed 0 is the stream of the records made before the option
    assert phases0 == [bench.mixed_stream(enc, 24, s, 4, seed=0)[0] for s in range(4)]
    assert lengths0 == [bench.lognormal_budgets(24, 64.0, 0.8, 400, seed=100 + s)
                        for s in range(4)]
    # another seed is not another replica's stream
    assert stream(1)[0] != stream(0, replica=1)[0]
    bad = subprocess_run_parse(["--mixed-seed", "-1"])
    assert bad.returncode != 0 and "--mixed-seed -1: must be >= 0" in bad.stderr


def subprocess_run_parse(extra):
    import subprocess

    return subprocess.run([sys.executable, "-c", "import sys; from scripts.bench import adaptive;"
                           " sys.argv = ['adaptive'] + sys.argv[1:]; adaptive.parse_args()",
                           *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)
