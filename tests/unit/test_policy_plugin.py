"""A new policy is its own file and one registry call (issue 38 part 4): tests/toy_policy.py
declares `roundrobin` (its section: `stride`) and registers it; nothing else of the product names
it. Here it is checked by `config --policy roundrobin`, refused by name where its key is wrong,
offered by `generate --adaptive --policy`, and run end to end through consensus-only mode on two
ranks under torchrun, against a hand-computed schedule."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import toy_policy
from consensus_reference import phased_traces, write_traces
from adaptive_dist.cli import main
from adaptive_dist.config import ADAPTIVE_POLICIES, POLICIES, AdaptiveConfig, ConfigError
from adaptive_dist.registry import register_policy, unregister_policy
from collectives import free_port

TOY = Path(toy_policy.__file__)


@pytest.fixture
def roundrobin():
    toy_policy.register()
    try:
        yield toy_policy.RoundRobinPolicy
    finally:
        unregister_policy("roundrobin")


def test_registered_policy_is_a_choice_and_has_its_section(roundrobin):
    assert "roundrobin" in POLICIES and "roundrobin" in ADAPTIVE_POLICIES
    cfg = AdaptiveConfig(policy="roundrobin", stride=2)
    assert cfg.stride == 2 and cfg.section("roundrobin") == toy_policy.RoundRobinSection(2)
    assert cfg.to_dict()["stride"] == 2
    nested = AdaptiveConfig.from_dict({"policy": "roundrobin", "roundrobin": {"stride": 2}})
    assert nested == cfg and nested.digest() == cfg.digest()   # the two spellings, one setting
    with pytest.raises(ValueError, match="stride=0: must be an integer >= 1"):
        AdaptiveConfig(policy="roundrobin", stride=0)
    with pytest.raises(ConfigError, match="'roundrobin.strides'"):
        AdaptiveConfig.from_dict({"policy": "roundrobin", "roundrobin": {"strides": 2}})
    with pytest.raises(ConfigError, match="given both"):
        AdaptiveConfig.from_dict({"stride": 1, "roundrobin": {"stride": 2}})


def test_unregistered_policy_leaves_no_trace(roundrobin):
    unregister_policy("roundrobin")
    assert "roundrobin" not in POLICIES and "stride" not in AdaptiveConfig().to_dict()
    with pytest.raises(TypeError, match="'stride'"):
        AdaptiveConfig(stride=2)


def test_registry_refuses_a_taken_name_or_key(roundrobin):
    from adaptive_dist.policy.goodput import GoodputPolicy

    class Again(toy_policy.RoundRobinPolicy):
        pass

    with pytest.raises(ValueError, match="registered already"):
        register_policy(Again)

    class Steals(toy_policy.RoundRobinPolicy):
        name = "steals"
        Section = GoodputPolicy.Section

    with pytest.raises(ValueError, match=r"'round_cost' \(policy 'goodput'\)"):
        register_policy(Steals)


def test_config_command_checks_the_new_policy(roundrobin, tmp_path, capsys):
    path = tmp_path / "rr.json"
    path.write_text(json.dumps({"roundrobin": {"stride": 2}, "warmup_batches": 4}))
    # consensus-only mode measures nothing: the policy's start-up need must be in the file
    assert main(["config", "--policy", "roundrobin", "--config", str(path)]) == 2
    assert "--policy roundrobin in consensus-only mode needs costs" in capsys.readouterr().err
    assert main(["config", "--policy", "roundrobin", "--config", str(path), "--for",
                 "engine"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["policy"] == "roundrobin" and shown["stride"] == 2 and shown["costs"] is None
    assert shown["digest"] == AdaptiveConfig(policy="roundrobin", stride=2,
                                             warmup_batches=4).digest()
    path.write_text(json.dumps({"roundrobin": {"stride": -1}}))
    assert main(["config", "--policy", "roundrobin", "--config", str(path)]) == 2
    assert "stride=-1: must be an integer >= 1" in capsys.readouterr().err


def test_generate_runs_the_new_policy(roundrobin, tmp_path, capsys):
    """The engine's start-up (adaptive_dist.startup.prepare: the round costs the policy asks for)
    and rounds take the new policy as they are: it switches every decision point and the greedy
    text equals plain decoding's."""
    import dataclasses

    from engine_fixtures import save_pair, tiny_config, tiny_pair
    from workers.cli import main as generate

    cfg = dataclasses.replace(tiny_config(vocab=264, max_pos=96, eos=257), bos_token_id=256)
    model = save_pair(*tiny_pair(seed=4, cfg=cfg), tmp_path / "pair")
    path = tmp_path / "rr.json"
    path.write_text(json.dumps({"warmup_batches": 1, "update_interval": 2}))
    runs = {}
    for mode in (["--adaptive", "--policy", "roundrobin", "--config", str(path)], ["--no-spec"]):
        code = generate(["generate", "--prompt", "def fib(n):", "--model", str(model),
                         "--max-new-tokens", "24", "--json", *mode])
        out, err = capsys.readouterr()
        assert code == 0, err
        runs[mode[0]] = json.loads(out.strip().splitlines()[-1])
    spec = runs["--adaptive"]
    assert "roundrobin" in spec["mode"] and spec["switches"] >= 2, spec
    assert spec["outputs"] == runs["--no-spec"]["outputs"]


def test_engine_measures_what_the_new_policy_needs(roundrobin):
    """build_engine gives the policy the round costs it asks for (start_up_needs: its own key
    `costs`, the engine's `round_costs`), measured on the built tiers and agreed: every
    candidate depth priced in every bucket."""
    from engine_fixtures import engine_for, tiny_pair

    target, head = tiny_pair(seed=3)
    cfg = AdaptiveConfig(policy="roundrobin", graph_buckets=(1, 2, 4))
    engine = engine_for(target, head, "ema", config=cfg, max_batch=4)
    costs = engine.config.spec.costs
    assert costs is not None and costs.buckets == (1, 2, 4) and costs.steps == (1, 3, 7)
    assert all(c > 0 for row in costs.rows for _, c in row)
    assert engine.planner.config.digest() == engine.config.spec.digest() != cfg.digest()


def expected_schedule(records: list[dict], candidates: list[int], stride: int, warmup: int,
                      interval: int) -> list[tuple[int, bool]]:
    """(steps, switched) of each of one rank's counted rounds, by hand: counted round c (from 1)
    is a decision point when c > warmup and (c - warmup) is a multiple of interval; there the
    index moves stride candidates up, wrapping, and the next counted round runs it."""
    index, out = candidates.index(3), []
    for c in range(1, len(records) + 1):
        point = c > warmup and (c - warmup) % interval == 0
        out.append((candidates[index], point))
        if point:
            index = (index + stride) % len(candidates)
    return out


@pytest.mark.multirank
def test_consensus_runs_the_new_policy_on_two_ranks(tmp_path):
    traces = phased_traces(2, rounds=80, seed=5)
    write_traces(traces, tmp_path / "tr")
    cfg = tmp_path / "rr.json"
    cfg.write_text(json.dumps({"roundrobin": {"stride": 2, "costs": {"1": 1.0, "3": 0.9,
                                                                      "7": 2.0}},
                               "warmup_batches": 4, "update_interval": 3}))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(TOY), "consensus", "--trace",
           str(tmp_path / "tr"), "--policy", "roundrobin", "--config", str(cfg), "--out",
           str(out), "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert [ln for ln in res.stdout.splitlines() if ln.strip()][-1].startswith("lockstep OK")
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    for rank in (0, 1):
        mine = [ln for ln in lines if ln["rank"] == rank]
        assert mine and all(ln["stride"] == 2 and ln["cheapest"] == 3 for ln in mine)
        got = [(ln["steps"], ln["switched"]) for ln in mine]
        assert got == expected_schedule(mine, [1, 3, 7], 2, 4, 3)
    assert len({ln["steps"] for ln in lines}) == 3   # every candidate ran


def test_builtin_sections_in_both_spellings():
    """goodput's keys in their section or flat (the older spelling, still in docs/ and the bench
    data): one setting, one digest. The digest is pinned: it was the digest of before the
    sections, and it moves only when the effective configuration gains a key (last:
    goodput's `tree_candidates` and `tree_overhead`, issue 35)."""
    flat = AdaptiveConfig.from_dict({"policy": "goodput", "switch_margin": 0.1, "up_hysteresis": 1})
    nested = AdaptiveConfig.from_dict({"policy": "goodput", "goodput": {"switch_margin": 0.1},
                                       "ema": {"up_hysteresis": 1}})
    assert flat == nested and flat.digest() == nested.digest() == "4ccc573228acd384"
    with pytest.raises(ConfigError, match="'goodput.swich_margin'"):
        AdaptiveConfig.from_dict({"goodput": {"swich_margin": 0.1}})
    with pytest.raises(ConfigError, match="'probe_backoff'.*no longer exist"):
        AdaptiveConfig.from_dict({"goodput": {"probe_backoff": 2}})
