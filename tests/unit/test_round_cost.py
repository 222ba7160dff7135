"""``adaptive_dist.startup.agree_round_cost`` on one process (the multi-rank agreement is in
tests/multirank/test_multirank_consensus.py): what the engine calls after measuring."""
from __future__ import annotations

import pytest

from adaptive_dist.config import AdaptiveConfig, ConfigError
from adaptive_dist.controller import AdaptiveController
from adaptive_dist.startup import agree_round_cost, measured_as_json
from collectives import Group

MEASURED = {8: {1: 0.012, 3: 0.015, 7: 0.021}, 1: {7: 0.02, 3: 0.014, 1: 0.011}}


def test_single_rank_sets_the_table():
    cfg = AdaptiveConfig(policy="goodput")
    agreed = agree_round_cost(cfg, MEASURED, Group.single())
    assert cfg.round_cost is None and cfg.needs_round_cost          # the input is unchanged
    assert agreed.round_cost.buckets == (1, 8) and not agreed.needs_round_cost
    assert agreed.to_dict()["round_cost"] == {"1": {"1": 0.011, "3": 0.014, "7": 0.02},
                                              "8": {"1": 0.012, "3": 0.015, "7": 0.021}}
    assert agreed.digest() != cfg.digest()
    AdaptiveController(agreed, Group.single()).begin_round(1)   # the controller accepts it


def test_replaces_a_table_from_the_config():
    cfg = AdaptiveConfig(policy="goodput", round_cost={"1": 1.0, "3": 1.5, "7": 2.0})
    assert agree_round_cost(cfg, MEASURED, Group.single()).round_cost.buckets == (1, 8)


def test_other_policies_refused():
    with pytest.raises(ConfigError, match="goodput policy only"):
        agree_round_cost(AdaptiveConfig(), MEASURED, Group.single())


@pytest.mark.parametrize("measured,shown", [
    ({}, "non-empty"),
    ({True: {1: 0.1, 3: 0.1, 7: 0.1}}, "bucket True must be an integer"),
    ({8: {1.0: 0.1, 3: 0.1, 7: 0.1}}, "steps 1.0 must be an integer"),
    ({8: {1: "0.1", 3: 0.1, 7: 0.1}}, "must be a number of seconds"),
    ({8: []}, "non-empty mapping steps -> seconds"),
    ({0: {1: 0.1, 3: 0.1, 7: 0.1}}, "key '0' must be an integer >= 1"),
    ({8: {1: 0.0, 3: 0.1, 7: 0.1}}, "positive finite"),
    ({8: {1: 0.1, 3: 0.1}}, "missing ['7']"),
])
def test_bad_measurements_named(measured, shown):
    with pytest.raises(ConfigError) as ei:
        agree_round_cost(AdaptiveConfig(policy="goodput"), measured, Group.single())
    assert shown in str(ei.value) and "round cost" in str(ei.value)


def test_measured_as_json():
    assert measured_as_json({4: {0: 1, 2: 2.5}}) == {"4": {"0": 1.0, "2": 2.5}}
