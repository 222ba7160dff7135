"""``adaptive_dist.startup.agree_round_cost`` on one process (the multi-rank agreement is in
tests/multirank/test_multirank_consensus.py): what the engine calls after measuring."""
from __future__ import annotations

import pytest

from adaptive_dist.config import AdaptiveConfig, ConfigError
from adaptive_dist.coordinator import RoundCoordinator, RoundReport
from adaptive_dist.startup import agree_round_cost, measured_as_json, probe_after_catchup
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
    # the controller accepts it
    RoundCoordinator(agreed, Group.single()).begin_round(RoundReport(1))


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


# ---- timed rounds move the live cost table (cost_alpha) ---------------------------------------

def test_a_timed_round_moves_its_rows_offset() -> None:
    from adaptive_dist.config import RoundCost
    from adaptive_dist.policy import shifted_costs, update_offsets

    base = RoundCost.parse({"1": {"0": 1.0, "1": 2.0}, "16": {"0": 3.0, "1": 5.0}})
    # batch 4 uses row 16; depth 1 took 9 s against 5: offset 0.75 * 0 + 0.25 * (9 - 5) = 1
    offsets = update_offsets(base, (0.0, 0.0), batch=4, steps=1, seconds=9.0, alpha=0.25)
    assert offsets == (0.0, 1.0)
    assert shifted_costs(base, offsets).to_json() == {"1": {"0": 1.0, "1": 2.0},
                                                      "16": {"0": 4.0, "1": 6.0}}
    # a faster round than the table says: the offset goes negative, at most half the row's min
    assert update_offsets(base, (0.0, 1.0), batch=1, steps=0, seconds=0.5, alpha=0.5) == (-0.25, 1.0)
    assert update_offsets(base, (0.0, 1.0), batch=1, steps=1, seconds=0.0, alpha=1.0) == (-0.5, 1.0)
    flat = RoundCost.parse({"0": 1.0, "3": 2.0})
    assert update_offsets(flat, (0.0,), batch=64, steps=3, seconds=4.0, alpha=0.5) == (1.0,)


class Clock:
    def __init__(self, times) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def _timed_controller(times, cost=None, **kw) -> RoundCoordinator:
    cfg = AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3), initial_steps=1,
                         round_cost=cost or {"0": 1.0, "1": 2.0, "3": 4.0}, **kw)
    return RoundCoordinator(cfg, Group.single(), clock=Clock(times))


def test_only_steady_decode_rounds_are_timed() -> None:
    ctl = _timed_controller([0.0, 1.0, 1.5, 2.0, 2.2, 2.4, 2.5], cost_alpha=0.5,
                            warmup_batches=100)
    ctl.begin_round(RoundReport(2, num_tokens=8, num_extend=2))   # prefills
    ctl.end_round([1, 1])
    ctl.begin_round(RoundReport(2))            # the round before prefilled: not timed
    ctl.end_round([1, 1])
    ctl.begin_round(RoundReport(2))  # steady: depth 1 took 0.5 s, cost 2: offset 0.5 * (0.5 - 2)
    assert ctl.cost_offsets == (-0.5,)  # kept at -min / 2
    assert ctl.round_cost.to_json() == {"0": 0.5, "1": 1.5, "3": 3.5}
    ctl.end_round([0, 1])
    ctl.begin_round(RoundReport(2, num_tokens=5, num_extend=1))   # this round prefills: not timed
    ctl.end_round([1, 0])
    ctl.begin_round(RoundReport(2))            # the round before prefilled: not timed
    ctl.end_round([1, 1])
    ctl.begin_round(RoundReport(0))            # no requests now: not timed
    ctl.end_round([])
    ctl.begin_round(RoundReport(2))            # the round before ran none: not timed
    assert ctl.round_cost.to_json() == {"0": 0.5, "1": 1.5, "3": 3.5}
    assert ctl.stats.timed_rounds == 1
    assert ctl.config.round_cost.to_json() == {"0": 1.0, "1": 2.0, "3": 4.0}  # the agreed table


@pytest.mark.parametrize("alpha, final", [(0.0, 0), (1.0, 1)])
def test_timed_costs_change_the_decision(alpha: float, final: int) -> None:
    """Start-up says depth 1 costs 3x depth 0 (1 vs 3); every round takes 9 s, so (alpha 1) the
    offset is 9 - 3 = 6 and the live costs are 7 vs 9: with every draft accepted depth 1 scores
    2/9 against 1/7. Untimed, it scores 2/3 against 1 and the controller leaves it."""
    ctl = _timed_controller([9.0 * i for i in range(40)], {"0": 1.0, "1": 3.0, "3": 40.0},
                            cost_alpha=alpha, ema_alpha=0.5,
                            warmup_batches=4, update_interval=1, probe_every=100)
    ctl.begin_round(RoundReport(2, num_tokens=8, num_extend=2))
    ctl.end_round([1, 1])
    for _ in range(12):
        plan = ctl.begin_round(RoundReport(2))
        ctl.end_round([1, 1] if plan.steps else [0, 0])
    assert ctl.steps == final
    assert (ctl.stats.timed_rounds > 0) == bool(alpha)


def test_an_untimed_controller_never_moves_the_table() -> None:
    cfg = AdaptiveConfig(policy="goodput", candidate_steps=(0, 1), initial_steps=1,
                         round_cost={"0": 1.0, "1": 2.0}, cost_alpha=1.0)
    ctl = RoundCoordinator(cfg, Group.single(), clock=None)   # as consensus-only replay
    for _ in range(5):
        ctl.begin_round(RoundReport(1))
        ctl.end_round([1])
    assert ctl.stats.timed_rounds == 0 and ctl.round_cost == cfg.round_cost


def test_cost_alpha_is_validated() -> None:
    from adaptive_dist.config import ConfigError

    with pytest.raises(ConfigError, match="cost_alpha"):
        AdaptiveConfig(policy="goodput", cost_alpha=1.5)
    with pytest.raises(ConfigError, match="goodput policy only"):
        AdaptiveConfig(policy="ema", cost_alpha=0.2)


def test_probe_waits_for_the_first_shadow_report():
    """goodput with depth 0 in an engine that catches up every N depth-0 rounds: probe_every is
    raised to ceil((N + 2) / update_interval) decision points where it is below."""
    cfg = AdaptiveConfig(policy="goodput", candidate_steps=[0, 1, 3, 7], initial_steps=1,
                         update_interval=2)
    lifted = probe_after_catchup(cfg, 32)
    assert lifted.probe_every == 17 and lifted.digest() != cfg.digest()      # ceil(34 / 2)
    assert probe_after_catchup(cfg, 31).probe_every == 17                    # ceil(33 / 2)
    assert probe_after_catchup(cfg, 4).probe_every == 8                      # 3 < 8: kept
    assert probe_after_catchup(cfg.replace(update_interval=5), 32).probe_every == 8   # 7 < 8
    no_zero = AdaptiveConfig(policy="goodput", candidate_steps=[1, 3, 7], update_interval=1)
    assert probe_after_catchup(no_zero, 32) == no_zero
    assert probe_after_catchup(AdaptiveConfig(update_interval=1), 32) == AdaptiveConfig(
        update_interval=1)
    with pytest.raises(ConfigError, match="catchup_rounds=0"):
        probe_after_catchup(cfg, 0)
