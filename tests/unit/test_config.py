"""Unit tests for adaptive_dist.config against docs/policy.md ("Defaults", "Configuration errors")."""
from __future__ import annotations

import json
import math

import pytest

from adaptive_dist.config import AdaptiveConfig, ConfigError, load_config


def raises(match_all, **kw) -> str:
    with pytest.raises(ConfigError) as ei:
        AdaptiveConfig(**kw)
    msg = str(ei.value)
    for s in match_all:
        assert s in msg, f"{s!r} not in {msg!r}"
    return msg


# ------------------------------------------------------------------------------------ defaults
def test_defaults_match_design():
    c = AdaptiveConfig()
    assert c.candidate_steps == (1, 3, 7)
    assert c.ema_alpha == 0.2
    assert c.warmup_batches == 10
    assert c.update_interval == 5
    assert c.up_hysteresis == 0.0
    assert c.down_hysteresis == -0.25
    assert c.min_dwell_rounds == 0
    assert c.reducer == "weighted_mean"
    assert c.initial_steps in c.candidate_steps


def test_load_config_without_file_is_defaults():
    assert load_config(None, policy="ema") == AdaptiveConfig()
    assert load_config(None, policy="static") == AdaptiveConfig(policy="static")
    assert AdaptiveConfig(policy="static").tiers == (3,)
    assert AdaptiveConfig().tiers == (1, 3, 7) and AdaptiveConfig().max_steps == 7


def test_policy_is_validated_and_part_of_the_digest(tmp_path):
    with pytest.raises(ConfigError, match="policy='min_vote'"):
        AdaptiveConfig(policy="min_vote")
    assert AdaptiveConfig(policy="static").digest() != AdaptiveConfig().digest()
    p = tmp_path / "cfg.json"
    p.write_text('{"policy": "static"}')
    with pytest.raises(ConfigError, match="sets policy='static'"):
        load_config(str(p), policy="ema")
    p.write_text('{"policy": "ema", "reducer": "min"}')
    assert load_config(str(p), policy="ema").reducer == "min"


def test_candidates_sorted_and_deduplicated():
    c = AdaptiveConfig(candidate_steps=[7, 1, 3, 3])
    assert c.candidate_steps == (1, 3, 7)
    assert c.max_steps == 7
    assert AdaptiveConfig(initial_steps=7).initial_index == 2


def test_boundary_values_accepted():
    AdaptiveConfig(ema_alpha=1.0)
    AdaptiveConfig(ema_alpha=1e-9)
    AdaptiveConfig(warmup_batches=0, update_interval=1, min_dwell_rounds=0)
    AdaptiveConfig(up_hysteresis=-0.75, down_hysteresis=0.5)
    AdaptiveConfig(candidate_steps=[2, 5], initial_steps=2, reducer="min")
    AdaptiveConfig(reducer="max")


# -------------------------------------------------------------------------------- unknown keys
def test_unknown_keys_named():
    with pytest.raises(ConfigError) as ei:
        AdaptiveConfig.from_dict({"ema_alfa": 0.3, "zz_top": 1, "warmup_batches": 2})
    msg = str(ei.value)
    assert "'ema_alfa'" in msg and "'zz_top'" in msg
    assert "unknown" in msg
    assert "ema_alpha" in msg  # the allowed keys are listed


def test_from_dict_not_object():
    with pytest.raises(ConfigError, match="JSON object"):
        AdaptiveConfig.from_dict([1, 3, 7])


def test_from_dict_good():
    c = AdaptiveConfig.from_dict({"candidate_steps": [1, 2, 4], "initial_steps": 2,
                                  "ema_alpha": 0.5, "reducer": "max"})
    assert c.candidate_steps == (1, 2, 4) and c.initial_steps == 2
    assert c.ema_alpha == 0.5 and c.reducer == "max"
    assert c.warmup_batches == 10  # unspecified keys keep their defaults


# ---------------------------------------------------------------------------- wrong types
@pytest.mark.parametrize("key,value,shown", [
    ("candidate_steps", "1,3,7", "'1,3,7'"),
    ("candidate_steps", 3, "3"),
    ("candidate_steps", [1, "3"], "'3'"),
    ("candidate_steps", [1, 2.0], "2.0"),
    ("candidate_steps", [True, 3], "True"),
    ("initial_steps", "3", "'3'"),
    ("initial_steps", 3.0, "3.0"),
    ("initial_steps", None, "None"),
    ("ema_alpha", "0.2", "'0.2'"),
    ("ema_alpha", True, "True"),
    ("ema_alpha", None, "None"),
    ("warmup_batches", 1.5, "1.5"),
    ("warmup_batches", "10", "'10'"),
    ("warmup_batches", True, "True"),
    ("update_interval", 2.0, "2.0"),
    ("update_interval", True, "True"),
    ("min_dwell_rounds", "2", "'2'"),
    ("min_dwell_rounds", 0.5, "0.5"),
    ("up_hysteresis", "0", "'0'"),
    ("up_hysteresis", None, "None"),
    ("up_hysteresis", False, "False"),
    ("down_hysteresis", "x", "'x'"),
    ("down_hysteresis", [0.1], "[0.1]"),
    ("reducer", 3, "3"),
    ("reducer", None, "None"),
    ("graph_buckets", "8", "'8'"),
    ("graph_buckets", [1, 2.5], "2.5"),
    ("lockstep_check_every", 1.0, "1.0"),
])
def test_wrong_type(key, value, shown):
    raises([key, shown], **{key: value})


# ------------------------------------------------------------------------- out of range
@pytest.mark.parametrize("key,value,shown", [
    ("candidate_steps", [0, 3], "0"),
    ("candidate_steps", [-1, 3], "-1"),
    ("candidate_steps", [], "[]"),
    ("ema_alpha", 0, "ema_alpha=0"),
    ("ema_alpha", 0.0, "ema_alpha=0.0"),
    ("ema_alpha", -0.1, "-0.1"),
    ("ema_alpha", 1.5, "1.5"),
    ("ema_alpha", 1.0000001, "1.0000001"),
    ("ema_alpha", math.nan, "nan"),
    ("ema_alpha", math.inf, "inf"),
    ("warmup_batches", -1, "warmup_batches=-1"),
    ("update_interval", 0, "update_interval=0"),
    ("update_interval", -3, "update_interval=-3"),
    ("min_dwell_rounds", -2, "min_dwell_rounds=-2"),
    ("up_hysteresis", math.inf, "inf"),
    ("up_hysteresis", math.nan, "nan"),
    ("down_hysteresis", -math.inf, "-inf"),
    ("down_hysteresis", math.nan, "nan"),
    ("reducer", "median", "'median'"),
    ("reducer", "MIN", "'MIN'"),
    ("graph_buckets", [], "[]"),
    ("graph_buckets", [0, 4], "0"),
    ("lockstep_check_every", 0, "lockstep_check_every=0"),
])
def test_out_of_range(key, value, shown):
    raises([key, shown], **{key: value})


def test_allowed_stated_in_messages():
    assert "(0, 1]" in raises(["ema_alpha"], ema_alpha=2)
    assert ">= 0" in raises(["warmup_batches"], warmup_batches=-1)
    assert ">= 1" in raises(["update_interval"], update_interval=0)
    msg = raises(["reducer"], reducer="median")
    assert "weighted_mean" in msg and "min" in msg and "max" in msg


def test_hysteresis_out_of_range_message_states_allowed_range():
    # The code refuses |hysteresis| >= 1000, but says "must be a finite number" for a value that
    # *is* finite, so the message does not state what is allowed (docs/policy.md: messages name the key,
    # the value and what is allowed).
    msg = raises(["up_hysteresis", "5000.0"], up_hysteresis=5000.0)
    assert "1000" in msg, f"message does not state the allowed range: {msg!r}"


def test_fewer_than_two_distinct_candidates():
    for value in ([3], [3, 3], [5, 5, 5]):
        kw = {"candidate_steps": value, "initial_steps": value[0]}
        msg = raises(["candidate_steps", "two distinct"], **kw)
        assert str(value[0]) in msg


def test_initial_steps_not_a_candidate():
    msg = raises(["initial_steps=5", "[1, 3, 7]"], initial_steps=5)
    assert "candidate" in msg
    raises(["initial_steps=2", "[1, 4]"], candidate_steps=[1, 4], initial_steps=2)


# ----------------------------------------------------------------------------------- files
def test_from_file_good(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"candidate_steps": [1, 2, 4, 8], "initial_steps": 4,
                             "min_dwell_rounds": 3}))
    c = load_config(str(p), policy="ema")
    assert c.candidate_steps == (1, 2, 4, 8) and c.initial_steps == 4
    assert c.min_dwell_rounds == 3


def test_bad_json_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"ema_alpha": 0.3,,}\n')
    with pytest.raises(ConfigError) as ei:
        load_config(str(p), policy="ema")
    msg = str(ei.value)
    assert str(p) in msg and "JSON" in msg


def test_json_file_not_object(tmp_path):
    p = tmp_path / "list.json"
    p.write_text("[1, 3, 7]")
    with pytest.raises(ConfigError) as ei:
        AdaptiveConfig.from_file(p)
    assert str(p) in str(ei.value) and "object" in str(ei.value)


def test_missing_file(tmp_path):
    p = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as ei:
        load_config(str(p), policy="ema")
    assert str(p) in str(ei.value)


def test_file_unknown_key_names_file_and_key(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text('{"ema_alfa": 0.3}')
    with pytest.raises(ConfigError) as ei:
        load_config(str(p), policy="ema")
    assert str(p) in str(ei.value) and "'ema_alfa'" in str(ei.value)


def test_file_bad_value(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text('{"ema_alpha": 2}')
    with pytest.raises(ConfigError) as ei:
        load_config(str(p), policy="ema")
    assert "ema_alpha=2" in str(ei.value)


def test_config_file_with_adaptive_off(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text("{}")  # even a valid, empty file is refused
    with pytest.raises(ConfigError) as ei:
        load_config(str(p), policy="static")
    msg = str(ei.value)
    assert str(p) in msg and "adaptive" in msg


def test_initial_steps_override():
    assert load_config(None, policy="ema", initial_steps=7).initial_steps == 7
    with pytest.raises(ConfigError) as ei:
        load_config(None, policy="ema", initial_steps=5)
    assert "initial_steps=5" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        load_config(None, policy="ema", initial_steps=0)
    assert "initial_steps=0" in str(ei.value)


def test_initial_steps_override_beats_file(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text('{"initial_steps": 1}')
    assert load_config(str(p), policy="ema", initial_steps=7).initial_steps == 7


# ---------------------------------------------------------------------------------- digest
def test_digest_stable():
    a, b = AdaptiveConfig(), AdaptiveConfig()
    assert a.digest() == b.digest()
    assert a.digest() == a.digest()
    assert len(a.digest()) == 16 and int(a.digest(), 16) >= 0
    # list vs tuple and candidate order do not change the effective config
    assert AdaptiveConfig(candidate_steps=[7, 3, 1]).digest() == a.digest()
    assert AdaptiveConfig.from_dict({"ema_alpha": 0.2}).digest() == a.digest()


@pytest.mark.parametrize("key,value", [
    ("candidate_steps", (1, 3, 8)),
    ("initial_steps", 7),
    ("ema_alpha", 0.25),
    ("warmup_batches", 11),
    ("update_interval", 4),
    ("up_hysteresis", 0.125),
    ("down_hysteresis", -0.5),
    ("min_dwell_rounds", 1),
    ("reducer", "min"),
    ("graph_buckets", (1, 2, 4)),
    ("lockstep_check_every", 8),
])
def test_digest_differs_on_each_key(key, value):
    assert AdaptiveConfig(**{key: value}).digest() != AdaptiveConfig().digest()


def test_digest_same_for_equal_numbers():
    # The same effective configuration written as 0 vs 0.0 (e.g. "up_hysteresis": 0 in one
    # rank's JSON file, the default on another) must hash the same, else ranks refuse to run
    # on a spurious mismatch.
    a = AdaptiveConfig()
    b = AdaptiveConfig(up_hysteresis=0)
    assert a == b  # dataclass equality already says they are the same configuration
    assert b.digest() == a.digest(), (
        f"digest differs for up_hysteresis=0 vs 0.0: {b.digest()} != {a.digest()}")


# ====================================================================================== goodput
from adaptive_dist.config import RoundCost  # noqa: E402

FLAT = {"1": 1.25, "3": 1.5, "7": 2.0}


def gp(**kw) -> AdaptiveConfig:
    return AdaptiveConfig(policy="goodput", **kw)


def test_goodput_defaults_and_round_cost_unset():
    c = load_config(None, policy="goodput")
    assert c.policy == "goodput" and c.adaptive and c.round_cost is None
    assert c.switch_margin == 0.05 and c.probe_every == 8 and c.reset_nats == 8.0
    assert gp(switch_margin=0.1).digest() != gp().digest()
    assert c.needs_round_cost and not gp(round_cost=FLAT).needs_round_cost
    assert not AdaptiveConfig().needs_round_cost
    assert c.tiers == (0, 1, 3, 7)    # goodput's own default ladder (depth 0 included)
    assert load_config(None, policy="ema").tiers == (1, 3, 7)
    assert c.to_dict()["round_cost"] is None


def test_round_cost_flat_and_bucketed_round_trip():
    flat = gp(round_cost={"7": 2, "1": 1.25, "3": 1.5})
    assert flat.round_cost == RoundCost(None, (((1, 1.25), (3, 1.5), (7, 2.0)),))
    assert flat.to_dict()["round_cost"] == {"1": 1.25, "3": 1.5, "7": 2.0}
    table = {"64": {"1": 3.0, "3": 4.0, "7": 6.0}, "8": FLAT}
    nested = gp(round_cost=table)
    assert nested.round_cost.buckets == (8, 64)
    assert nested.to_dict()["round_cost"] == {"8": FLAT, "64": {"1": 3.0, "3": 4.0, "7": 6.0}}
    for c in (flat, nested):
        assert AdaptiveConfig.from_dict(c.to_dict()) == c
        assert c.replace(switch_margin=0.1).round_cost == c.round_cost  # replace re-validates
        hash(c)  # frozen and hashable


def test_round_cost_from_file(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"candidate_steps": [0, 1, 3], "initial_steps": 1,
                             "round_cost": {"0": 1.0, "1": 1.2, "3": 1.6}, "probe_every": 3}))
    c = load_config(str(p), policy="goodput")
    assert c.round_cost.rows == (((0, 1.0), (1, 1.2), (3, 1.6)),) and c.probe_every == 3
    assert load_config(str(p), "goodput", initial_steps=0).initial_steps == 0


@pytest.mark.parametrize("value,shown", [
    ({"1": 1.0, "3": 1.5}, "missing ['7']"),
    ({"1": 1.0, "3": 1.5, "7": 2.0, "5": 1.8}, "['5'], which are not candidates"),
    ({"8": {"1": 1.0, "3": 1.5}}, "round_cost['8']"),
    ({"1": 1.0, "3": 0, "7": 2.0}, "round_cost['3']=0"),
    ({"1": 1.0, "3": -1.5, "7": 2.0}, "round_cost['3']=-1.5"),
    ({"1": 1.0, "3": math.nan, "7": 2.0}, "nan"),
    ({"1": 1.0, "3": math.inf, "7": 2.0}, "inf"),
    ({"1": 1.0, "3": "1.5", "7": 2.0}, "'1.5'"),
    ({"1": 1.0, "3": True, "7": 2.0}, "True"),
    ({"1": 1.0, "3": None, "7": 2.0}, "None"),
    ({1: 1.0, 3: 1.5, 7: 2.0}, "key 1 must be an integer"),
    ({"01": 1.0, "3": 1.5, "7": 2.0}, "key '01'"),
    ({"1.0": 1.0, "3": 1.5, "7": 2.0}, "key '1.0'"),
    ({" 1": 1.0, "3": 1.5, "7": 2.0}, "key ' 1'"),
    ({"-1": 1.0, "3": 1.5, "7": 2.0}, "key '-1'"),
    ({"0": FLAT}, "key '0' must be an integer >= 1"),
    ({"8": FLAT, "1": 1.0}, "mixes"),
    ({"8": {}}, "round_cost['8']={}"),
    ({}, "non-empty"),
    ([1.0, 1.5, 2.0], "non-empty JSON object"),
    ("1.0", "non-empty JSON object"),
])
def test_round_cost_refused(value, shown):
    msg = raises(["round_cost", shown], policy="goodput", round_cost=value)
    assert "round_cost" in msg


def test_round_cost_messages_state_what_is_allowed():
    msg = raises(["round_cost", "missing ['7']"], policy="goodput", round_cost={"1": 1, "3": 2})
    assert "allowed: one cost for every candidate depth ['1', '3', '7']" in msg
    assert "positive finite number" in raises(["round_cost['3']=0"], policy="goodput",
                                              round_cost={"1": 1, "3": 0, "7": 2})


def test_round_cost_only_for_goodput(tmp_path):
    msg = raises(["round_cost", "goodput policy only", "policy='ema'"], round_cost=FLAT)
    assert "1.25" in msg
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"round_cost": FLAT}))
    with pytest.raises(ConfigError, match="goodput policy only"):
        load_config(str(p), policy="ema")


def test_round_cost_follows_the_candidates():
    with pytest.raises(ConfigError, match="missing"):
        gp(round_cost=FLAT).replace(candidate_steps=(1, 3, 7, 9))


@pytest.mark.parametrize("key,value,shown", [
    ("switch_margin", -0.01, "-0.01"),
    ("switch_margin", math.nan, "nan"),
    ("switch_margin", math.inf, "inf"),
    ("switch_margin", 1000.0, "1000.0"),
    ("switch_margin", "0.05", "'0.05'"),
    ("switch_margin", True, "True"),
    ("switch_margin", None, "None"),
    ("probe_every", 0, "probe_every=0"),
    ("probe_every", -2, "-2"),
    ("probe_every", 1.5, "1.5"),
    ("probe_every", True, "True"),
    ("probe_every", "8", "'8'"),
])
def test_goodput_keys_validated(key, value, shown):
    msg = raises([key, shown], policy="goodput", **{key: value})
    assert ("[0, 1000)" in msg) if key == "switch_margin" else (">= 1" in msg)


@pytest.mark.parametrize("key,value", [("probe_backoff", 4), ("zero_via_smallest", True),
                                       ("zero_via_smallest", False)])
def test_removed_goodput_keys_refused_by_name(tmp_path, key, value):
    """Keys removed by issue 26 (they moved no production-priced goal row): a file that still
    sets one is refused, naming the key and what replaced it, never silently ignored."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"policy": "goodput", key: value}))
    with pytest.raises(ConfigError) as err:
        load_config(str(path), policy="goodput")
    msg = str(err.value)
    assert repr(key) in msg and "no longer exist" in msg and str(path) in msg
    assert key not in AdaptiveConfig().to_dict()
    with pytest.raises(TypeError):
        AdaptiveConfig(policy="goodput", **{key: value})


def test_goodput_boundaries_accepted():
    gp(switch_margin=0, probe_every=1)
    gp(switch_margin=999.5)
    assert gp(switch_margin=0).switch_margin == 0.0 and isinstance(gp(switch_margin=0).switch_margin, float)


def test_depth_zero_candidate():
    cost = {"0": 1.0, "1": 1.25, "3": 1.5}
    c = gp(candidate_steps=[0, 1, 3], initial_steps=0, round_cost=cost)
    assert c.tiers == (0, 1, 3) and c.initial_index == 0
    msg = raises(["candidate_steps", "static and goodput policies only"],
                 candidate_steps=[0, 1, 3], initial_steps=1)  # ema still refuses 0
    assert "[0, 1, 3]" in msg
    AdaptiveConfig(policy="static", candidate_steps=[0, 3], initial_steps=0)
    with pytest.raises(ConfigError, match=r"\['7'\], which are not candidates"):
        gp(candidate_steps=[0, 1, 3], initial_steps=1, round_cost={**FLAT, "0": 1.0})


def test_initial_steps_override_goodput():
    with pytest.raises(ConfigError, match=r"initial_steps=2: must be one of candidate_steps"):
        load_config(None, policy="goodput", initial_steps=2)  # 2 is not a default candidate
    assert load_config(None, policy="goodput", initial_steps=0).initial_steps == 0
    with pytest.raises(ConfigError, match=r"initial_steps=-1: must be an integer >= 0"):
        load_config(None, policy="goodput", initial_steps=-1)
    with pytest.raises(ConfigError, match=r"initial_steps=0: must be an integer >= 1"):
        load_config(None, policy="ema", initial_steps=0)  # as before


def test_goodput_file_with_other_policy_flag(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"policy": "goodput", "candidate_steps": [1, 3, 7],
                             "round_cost": FLAT}))
    with pytest.raises(ConfigError, match="sets policy='goodput'"):
        load_config(str(p), policy="ema")
    assert load_config(str(p), policy="goodput").round_cost is not None
    # a file that names no candidates gets goodput's (0, 1, 3, 7): its table must price depth 0
    p.write_text(json.dumps({"round_cost": FLAT}))
    with pytest.raises(ConfigError, match=r"missing \['0'\]"):
        load_config(str(p), policy="goodput")


@pytest.mark.parametrize("key,value", [
    ("round_cost", {"1": 1.25, "3": 1.5, "7": 2.5}),
    ("round_cost", {"8": FLAT}),      # one bucketed row is not the flat table
    ("switch_margin", 0.1),
    ("probe_every", 3),
])
def test_digest_differs_on_goodput_keys(key, value):
    base = gp(round_cost=FLAT)
    assert base.replace(**{key: value}).digest() != base.digest()


def test_digest_same_for_equal_cost_numbers():
    a = gp(round_cost={"1": 1, "3": 1.5, "7": 2}, switch_margin=0)
    b = gp(round_cost={"7": 2.0, "3": 1.5, "1": 1.0}, switch_margin=0.0)
    assert a == b and a.digest() == b.digest()


def test_goodput_keys_in_every_effective_config():
    # the new keys are part of every effective config; ema ignores their values
    d = AdaptiveConfig().to_dict()
    assert d["round_cost"] is None and d["switch_margin"] == 0.05 and d["probe_every"] == 8


def test_reset_nats_default_hash_and_validation():
    assert gp().reset_nats == 8.0 and AdaptiveConfig().reset_nats == 8.0
    assert gp(reset_nats=0).reset_nats == 0.0 and gp(reset_nats=0).digest() == gp(reset_nats=0.0).digest()
    assert gp(reset_nats=0).digest() != gp().digest()
    gp(reset_nats=999999.5)
    for value, shown in ((-1, "-1.0"), (float("inf"), "inf"), (1e6, "1000000.0"), (True, "True"),
                         ("8", "'8'"), (None, "None")):
        msg = raises(["reset_nats", shown], policy="goodput", reset_nats=value)
        assert "[0, 1e+06) (0: off)" in msg
