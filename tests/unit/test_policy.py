"""Unit tests for the pure policy functions (adaptive_dist.policy) against docs/policy.md,
"The adaptive layer". Every expected value is worked out by hand in the test."""
from __future__ import annotations

import math

import pytest

from adaptive_dist.config import AdaptiveConfig
from adaptive_dist.policy import PolicyState, depth_policy
from adaptive_dist.policy.reducers import reduce_emas
from adaptive_dist.policy.rules import ema_update, is_decision_point, ladder_walk, pick_bucket


def decide(cfg, *args, **kw):
    """One round's decision under ``cfg``'s policy (the policy object applied once)."""
    return depth_policy(cfg).decide(*args, **kw)


def initial_ema(cfg):
    return depth_policy(cfg).initial_ema()


def measures_acceptance(cfg, steps):
    return depth_policy(cfg).measures_acceptance(steps)


def round_update(cfg, *args):
    return depth_policy(cfg).round_update(*args)

C137 = (1, 3, 7)
C12358 = (1, 2, 3, 5, 8)


def cfg(**kw) -> AdaptiveConfig:
    return AdaptiveConfig(**kw)


# ---------------------------------------------------------------------------------------- EMA
class TestEma:
    def test_formula_exact_dyadic(self):
        # (1-0.25)*4 + 0.25*mean([1, 3]) = 3.0 + 0.5 = 3.5
        assert ema_update(4.0, [1, 3], 0.25) == 3.5

    def test_formula_non_dyadic(self):
        # (1-0.2)*2 + 0.2*mean([1, 2, 4]) = 1.6 + 0.2*7/3 = 2.0666...
        assert ema_update(2.0, [1, 2, 4], 0.2) == pytest.approx(1.6 + 0.2 * (7 / 3), abs=1e-12)
        assert ema_update(2.0, [1, 2, 4], 0.2) == pytest.approx(2.0666666666666667, abs=1e-12)

    def test_alpha_one_replaces(self):
        assert ema_update(6.0, [0, 0, 3], 1.0) == 1.0

    def test_uses_mean_not_sum(self):
        # mean([7, 7, 7, 7]) = 7; (0.5)*1 + 0.5*7 = 4
        assert ema_update(1.0, [7, 7, 7, 7], 0.5) == 4.0

    def test_empty_round_leaves_unchanged(self):
        assert ema_update(2.375, [], 0.2) == 2.375
        assert ema_update(0.0, (), 1.0) == 0.0

    def test_sequence(self):
        e = 2.0  # initial_steps 3 -> 2
        e = ema_update(e, [3], 0.5)   # 2.5
        e = ema_update(e, [], 0.5)    # 2.5
        e = ema_update(e, [0, 1], 0.5)  # 1.25 + 0.25 = 1.5
        assert e == 1.5


# ----------------------------------------------------------------------------------- reducers
class TestReducers:
    def test_weighted_mean(self):
        # (1*1 + 3*3) / (1 + 3) = 10/4 = 2.5 ; the third rank has w=0 and is ignored
        assert reduce_emas([1.0, 3.0, 100.0], [1, 3, 0], "weighted_mean") == 2.5

    def test_weighted_mean_ignores_zero_weight_low_value(self):
        # (2*4 + 2*6)/(2+2) = 5 ; rank with e=0, w=0 ignored (would pull to 10/3 as a plain mean)
        assert reduce_emas([4.0, 0.0, 6.0], [2, 0, 2], "weighted_mean") == 5.0

    def test_weighted_mean_non_dyadic(self):
        # (1*1 + 2*2) / 3 = 5/3
        assert reduce_emas([1.0, 2.0], [1, 2], "weighted_mean") == pytest.approx(5 / 3, abs=1e-12)

    def test_min_ignores_zero_weight(self):
        assert reduce_emas([2.0, 5.0, 0.0, 9.0], [1, 1, 0, 0], "min") == 2.0

    def test_max_ignores_zero_weight(self):
        assert reduce_emas([2.0, 5.0, 0.0, 9.0], [1, 1, 0, 0], "max") == 5.0

    def test_min_max_not_weighted(self):
        assert reduce_emas([1.0, 6.0], [100, 1], "min") == 1.0
        assert reduce_emas([1.0, 6.0], [100, 1], "max") == 6.0

    @pytest.mark.parametrize("reducer", ["weighted_mean", "min", "max"])
    def test_all_zero_weight_is_none(self, reducer):
        assert reduce_emas([3.0, 4.0], [0, 0], reducer) is None

    @pytest.mark.parametrize("reducer", ["weighted_mean", "min", "max"])
    def test_single_live_rank(self, reducer):
        assert reduce_emas([0.5, 4.0, 7.0], [0, 3, 0], reducer) == 4.0

    @pytest.mark.parametrize("reducer,expected_ema,expected_index", [
        ("weighted_mean", 3.0, 2),  # (0+6)/2 = 3.0 > 3-0.5 -> up to steps 7
        ("min", 0.0, 0),            # 0.0 <= 1-0.5-0.25 -> down to steps 1
        ("max", 6.0, 2),            # 6.0 > 2.5 -> up to steps 7
    ])
    def test_reducer_drives_decision(self, reducer, expected_ema, expected_index):
        c = cfg(warmup_batches=0, update_interval=1, reducer=reducer)
        st, d = decide(c, PolicyState(index=1), 2, [0.0, 6.0], [1, 1])
        assert d.global_ema == expected_ema
        assert st.index == expected_index


# --------------------------------------------------------------------------------- counting
class TestDecisionPoints:
    @pytest.mark.parametrize("warmup,interval,points", [
        (0, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]),
        (0, 3, [3, 6, 9, 12, 15, 18]),
        (2, 1, [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]),
        (3, 2, [5, 7, 9, 11, 13, 15, 17, 19]),
        (10, 5, [15, 20]),
        (4, 4, [8, 12, 16, 20]),
        (20, 1, []),
    ])
    def test_points(self, warmup, interval, points):
        got = [c for c in range(1, 21) if is_decision_point(c, warmup, interval)]
        assert got == points

    def test_zero_request_round_not_counted(self):
        c = cfg(warmup_batches=0, update_interval=1)
        st0 = PolicyState(index=1, counted=4, last_switch=-1)
        st, d = decide(c, st0, 0, [100.0], [5])
        assert st == st0
        assert d.counted is False and d.decision_point is False
        assert d.global_ema is None
        assert d.old_index == d.new_index == 1
        assert not d.switched

    def test_counting_sequence_with_idle_rounds(self):
        # warmup 2, interval 3: decision points at counted 5, 8, 11.
        c = cfg(warmup_batches=2, update_interval=3)
        reqs = [1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 2]
        # counted:  1  -  2  3  -  4  5  6  7  8  9 10  - 11
        expected_counted = [1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 10, 11]
        expected_points = [6, 9, 13]  # round indices where counted hits 5, 8, 11
        st = PolicyState(index=1)
        counted, points = [], []
        for r, n in enumerate(reqs):
            # EMA 2.0 with weight 1 never moves [1,3,7] from index 1 (0.25 < 2.0 <= 2.5)
            st, d = decide(c, st, n, [2.0], [1])
            counted.append(st.counted)
            if d.decision_point:
                points.append(r)
            assert d.counted == (n > 0)
        assert counted == expected_counted
        assert points == expected_points
        assert st.index == 1

    def test_warmup_zero_interval_one_first_counted_round_decides(self):
        c = cfg(warmup_batches=0, update_interval=1)
        st, d = decide(c, PolicyState(index=1), 1, [6.0], [1])
        assert d.decision_point and st.counted == 1
        assert st.index == 2 and d.switched and st.last_switch == 1

    def test_no_decision_before_warmup(self):
        c = cfg(warmup_batches=2, update_interval=1)
        st = PolicyState(index=1)
        st, d1 = decide(c, st, 1, [6.0], [1])
        st, d2 = decide(c, st, 1, [6.0], [1])
        assert not d1.decision_point and not d2.decision_point and st.index == 1
        assert d1.global_ema == 6.0  # computed (for the trace) but not acted on
        st, d3 = decide(c, st, 1, [6.0], [1])
        assert d3.decision_point and st.index == 2 and st.counted == 3 and st.last_switch == 3

    def test_round_own_statistics_included(self):
        # The emas/weights passed in for a round are the ones the decision of that round uses:
        # a rank whose only contribution is this round (w=1) drives the switch at once.
        c = cfg(warmup_batches=0, update_interval=1)
        st, d = decide(c, PolicyState(index=1), 3, [0.0], [3])
        assert d.global_ema == 0.0 and st.index == 0


# ------------------------------------------------------------------------------------ ladder
class TestLadder:
    # candidates [1,3,7], index 1: rise threshold 3-0.5+up, drop threshold 1-0.5+down
    def test_exact_rise_threshold_stays(self):
        assert ladder_walk(C137, 1, 2.5, 0.0, -0.25) == 1

    def test_just_above_rise_threshold_moves_up(self):
        assert ladder_walk(C137, 1, 2.5000001, 0.0, -0.25) == 2

    def test_exact_drop_threshold_moves_down(self):
        assert ladder_walk(C137, 1, 0.25, 0.0, -0.25) == 0

    def test_just_above_drop_threshold_stays(self):
        assert ladder_walk(C137, 1, 0.2500001, 0.0, -0.25) == 1

    def test_top_tier_drop_threshold(self):
        # index 2: drop when E <= 3 - 0.5 - 0.25 = 2.25
        assert ladder_walk(C137, 2, 2.25, 0.0, -0.25) == 1
        assert ladder_walk(C137, 2, 2.2500001, 0.0, -0.25) == 2
        assert ladder_walk(C137, 2, 1000.0, 0.0, -0.25) == 2  # no tier above the top

    def test_bottom_tier(self):
        # index 0: rise when E > 1 - 0.5 = 0.5; nothing below
        assert ladder_walk(C137, 0, 0.5, 0.0, -0.25) == 0
        assert ladder_walk(C137, 0, 0.5000001, 0.0, -0.25) == 1
        assert ladder_walk(C137, 0, -5.0, 0.0, -0.25) == 0

    def test_several_tiers_down(self):
        # [1,2,3,5,8] from the top; drop thresholds: 4.25, 2.25, 1.25, 0.25
        assert ladder_walk(C12358, 4, 0.0, 0.0, -0.25) == 0
        assert ladder_walk(C12358, 4, 2.0, 0.0, -0.25) == 2
        assert ladder_walk(C12358, 4, 1.25, 0.0, -0.25) == 1
        assert ladder_walk(C12358, 4, 4.25, 0.0, -0.25) == 3
        assert ladder_walk(C12358, 4, 4.3, 0.0, -0.25) == 4

    def test_several_tiers_up(self):
        # [1,2,3,5,8] from the bottom; rise thresholds: 0.5, 1.5, 2.5, 4.5
        assert ladder_walk(C12358, 0, 10.0, 0.0, -0.25) == 4
        assert ladder_walk(C12358, 0, 3.0, 0.0, -0.25) == 3
        assert ladder_walk(C12358, 0, 2.5, 0.0, -0.25) == 2
        assert ladder_walk(C12358, 0, 4.5, 0.0, -0.25) == 3

    def test_down_has_priority_over_up(self):
        # up=-3 makes the rise threshold at index 1: 3-0.5-3 = -0.5; down=0: drop threshold 0.5.
        # E=0: both hold -> down wins, and no rise is attempted after the drop (at index 0 the
        # rise threshold 1-0.5-3 = -2.5 < 0 would otherwise move it back up).
        assert ladder_walk(C137, 1, 0.0, -3.0, 0.0) == 0

    def test_up_hysteresis_positive(self):
        # up=+0.5: rise threshold at index 1 = 3.0
        assert ladder_walk(C137, 1, 2.9, 0.5, -0.25) == 1
        assert ladder_walk(C137, 1, 3.0, 0.5, -0.25) == 1
        assert ladder_walk(C137, 1, 3.0000001, 0.5, -0.25) == 2

    def test_up_hysteresis_negative(self):
        # up=-0.5: rise threshold at index 1 = 2.0
        assert ladder_walk(C137, 1, 2.0, -0.5, -0.25) == 1
        assert ladder_walk(C137, 1, 2.125, -0.5, -0.25) == 2

    def test_down_hysteresis_positive(self):
        # down=+0.25: drop threshold at index 1 = 0.75
        assert ladder_walk(C137, 1, 0.75, 0.0, 0.25) == 0
        assert ladder_walk(C137, 1, 0.875, 0.0, 0.25) == 1

    def test_down_hysteresis_negative(self):
        # down=-0.5: drop threshold at index 1 = 0.0
        assert ladder_walk(C137, 1, 0.125, 0.0, -0.5) == 1
        assert ladder_walk(C137, 1, 0.0, 0.0, -0.5) == 0

    def test_down_hysteresis_zero(self):
        assert ladder_walk(C137, 1, 0.5, 0.0, 0.0) == 0
        assert ladder_walk(C137, 1, 0.5000001, 0.0, 0.0) == 1

    def test_decide_uses_config_hysteresis(self):
        c = cfg(warmup_batches=0, update_interval=1, up_hysteresis=0.5, down_hysteresis=0.25)
        st, _ = decide(c, PolicyState(index=1), 1, [3.0], [1])
        assert st.index == 1  # 3.0 not > 3.0
        st, _ = decide(c, PolicyState(index=1), 1, [0.75], [1])
        assert st.index == 0  # 0.75 <= 0.75

    def test_decide_several_tiers(self):
        c = cfg(candidate_steps=[1, 2, 3, 5, 8], initial_steps=8, warmup_batches=0,
                update_interval=1)
        st, d = decide(c, depth_policy(c).initial_state(), 1, [0.0], [1])
        assert d.old_index == 4 and d.new_index == 0 and st.index == 0 and d.switched


# ------------------------------------------------------------------------------------- dwell
class TestDwell:
    def test_dwell_blocks_then_allows(self):
        c = cfg(warmup_batches=0, update_interval=1, min_dwell_rounds=3)
        st = PolicyState(index=1)
        st, d = decide(c, st, 1, [6.0], [1])          # counted 1: up to 7
        assert st.index == 2 and st.last_switch == 1 and d.switched
        st, d = decide(c, st, 1, [0.0], [1])          # counted 2: 1 round since -> blocked
        assert d.decision_point and not d.switched and st.index == 2
        st, d = decide(c, st, 1, [0.0], [1])          # counted 3: 2 rounds -> blocked
        assert d.decision_point and not d.switched and st.index == 2
        st, d = decide(c, st, 0, [0.0], [1])          # idle: not counted, nothing
        assert not d.counted and st.index == 2 and st.counted == 3
        st, d = decide(c, st, 1, [0.0], [1])          # counted 4: 3 rounds -> allowed
        assert d.switched and st.index == 0 and st.last_switch == 4

    def test_dwell_one_is_like_zero_for_consecutive_points(self):
        c = cfg(warmup_batches=0, update_interval=1, min_dwell_rounds=1)
        st = PolicyState(index=1)
        st, _ = decide(c, st, 1, [6.0], [1])
        st, d = decide(c, st, 1, [0.0], [1])
        assert st.index == 0 and d.switched

    def test_dwell_zero(self):
        c = cfg(warmup_batches=0, update_interval=1, min_dwell_rounds=0)
        st = PolicyState(index=1)
        seq = [6.0, 0.0, 6.0, 0.0]
        got = []
        for e in seq:
            st, _ = decide(c, st, 1, [e], [1])
            got.append(st.index)
        # 6 -> up (2); 0 from 2: drops 2.25, 0.25 -> 0; 6 from 0: rises 0.5, 2.5 -> 2; 0 -> 0
        assert got == [2, 0, 2, 0]

    def test_dwell_counts_counted_rounds_between_decision_points(self):
        # interval 2, warmup 0: points at counted 2, 4, 6. dwell 3: switch at 2; point 4 is
        # 2 counted rounds later -> blocked; point 6 is 4 later -> allowed.
        c = cfg(warmup_batches=0, update_interval=2, min_dwell_rounds=3)
        st = PolicyState(index=1)
        emas = [6.0, 6.0, 0.0, 0.0, 0.0, 0.0]
        idx, pts = [], []
        for e in emas:
            st, d = decide(c, st, 1, [e], [1])
            idx.append(st.index)
            pts.append(d.decision_point)
        assert pts == [False, True, False, True, False, True]
        assert idx == [1, 2, 2, 2, 2, 0]
        assert st.last_switch == 6


# ------------------------------------------------------------------------------- no weights
class TestZeroWeight:
    @pytest.mark.parametrize("reducer", ["weighted_mean", "min", "max"])
    def test_sum_w_zero_no_change(self, reducer):
        c = cfg(warmup_batches=0, update_interval=1, reducer=reducer)
        st, d = decide(c, PolicyState(index=1), 2, [100.0, 0.0], [0, 0])
        assert d.counted and d.decision_point
        assert d.global_ema is None
        assert d.new_index == d.old_index == 1 and st.index == 1 and not d.switched
        assert st.last_switch == -1


# ------------------------------------------------------------------------------------ static
class TestStatic:
    def test_static_never_switches(self):
        c = cfg(warmup_batches=0, update_interval=1)
        st = PolicyState(index=1)
        for e in [6.0, 0.0, 100.0, -1.0, 0.0]:
            st, d = decide(c.replace(policy="static"), st, 1, [e], [1])
            assert d.decision_point and not d.switched and st.index == 1
            assert d.global_ema == e
        assert st.counted == 5 and st.last_switch == -1

    def test_ema_would_have_switched(self):
        c = cfg(warmup_batches=0, update_interval=1)
        st, d = decide(c, PolicyState(index=1), 1, [6.0], [1])
        assert d.switched  # same input as above: only the policy name differs


# ------------------------------------------------------------------------------------ bucket
class TestPickBucket:
    @pytest.mark.parametrize("batch,expected", [
        (0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (33, 64), (64, 64),
        (65, None), (1000, None),
    ])
    def test_default_buckets(self, batch, expected):
        assert pick_bucket(batch, (1, 2, 4, 8, 16, 32, 64)) == expected

    def test_custom_buckets(self):
        assert pick_bucket(5, (4, 12)) == 12
        assert pick_bucket(4, (4, 12)) == 4
        assert pick_bucket(13, (4, 12)) is None


# ====================================================================================== goodput
# docs/policy.md, "goodput". Costs are dyadic where possible so expected values are exact.
from adaptive_dist.config import RoundCost  # noqa: E402
from adaptive_dist.policy.goodput import (  # noqa: E402
    GoodputState,
    cost_row,
    expected_accepted,
    goodput_pick,
    goodput_score,
    goodput_scores,
    mixture_expected,
    probe_due,
    shadow_update,
    surprise,
)
from adaptive_dist.policy.reducers import cluster_rate, live_rates  # noqa: E402
from adaptive_dist.policy.rules import (  # noqa: E402
    acceptance_rate,
    decision_points_upto,
    ema_fail_update,
)

FLAT = {"1": 1.25, "3": 1.5, "7": 2.0}
ZERO_FLAT = {"0": 1.0, "1": 1.25, "3": 1.5}


def gp(**kw) -> AdaptiveConfig:
    kw.setdefault("round_cost", FLAT)
    kw.setdefault("warmup_batches", 0)
    kw.setdefault("update_interval", 1)
    return AdaptiveConfig(policy="goodput", **kw)


class TestEmaFail:
    def test_share_of_requests_that_rejected(self):
        # steps 3: [0, 3, 1, 3] -> rejected 0 and 1 -> share 2/4; 0.5*1.0 + 0.5*0.5 = 0.75
        assert ema_fail_update(1.0, [0, 3, 1, 3], 3, 0.5) == 0.75

    def test_all_accepted_and_all_rejected(self):
        assert ema_fail_update(0.5, [7, 7], 7, 0.25) == 0.375   # 0.75*0.5 + 0
        assert ema_fail_update(0.5, [0, 6], 7, 0.25) == 0.625   # 0.75*0.5 + 0.25*1

    def test_non_dyadic_share(self):
        # steps 1: [1, 1, 0] -> share 1/3; 0.8*1.0 + 0.2/3
        assert ema_fail_update(1.0, [1, 1, 0], 1, 0.2) == pytest.approx(0.8 + 0.2 / 3, abs=1e-15)

    def test_idle_round_leaves_unchanged(self):
        assert ema_fail_update(0.3125, [], 3, 0.5) == 0.3125

    def test_sequence_with_idle(self):
        f = 1.0
        f = ema_fail_update(f, [3, 3], 3, 0.5)   # 0.5
        f = ema_fail_update(f, [], 3, 0.5)       # 0.5 (idle)
        f = ema_fail_update(f, [1, 3], 3, 0.5)   # 0.25 + 0.25 = 0.5
        f = ema_fail_update(f, [0], 1, 0.5)      # 0.25 + 0.5 = 0.75
        assert f == 0.75

    def test_start_values(self):
        assert initial_ema(gp(initial_steps=3)) == 2.0
        assert initial_ema(gp(candidate_steps=[0, 1, 3], initial_steps=0,
                              round_cost=ZERO_FLAT)) == 0.0  # goodput: never below 0
        assert initial_ema(AdaptiveConfig(policy="static", candidate_steps=[0, 3],
                                          initial_steps=0)) == -1.0  # static: as before

    def test_depth_zero_measures_nothing_under_goodput_only(self):
        assert not measures_acceptance(gp(), 0)
        assert measures_acceptance(gp(), 1)
        assert measures_acceptance(AdaptiveConfig(policy="static"), 0)
        assert measures_acceptance(AdaptiveConfig(), 3)


class TestAcceptanceRate:
    def test_per_rank(self):
        assert acceptance_rate(1.5, 0.5) == 0.75
        assert acceptance_rate(0.0, 1.0) == 0.0
        assert acceptance_rate(2.0, 0.0) == 1.0
        assert acceptance_rate(0.0, 0.0) == 1.0  # both 0: defined as 1.0

    def test_weighted_mean_pools(self):
        # A = 1*1.0 + 3*3.0 = 10, F = 1*1.0 + 3*0.5 = 2.5 -> 10/12.5 = 0.8 (rank 2: w=0, out).
        # Not the weighted mean of the rates: (0.5 + 3*6/7)/4 = 0.767...
        assert cluster_rate([1.0, 3.0, 100.0], [1.0, 0.5, 0.0], [1, 3, 0], "weighted_mean") == 0.8

    def test_min_max_of_rates(self):
        # rates: 1/(1+1) = 0.5, 3/(3+0.5) = 6/7; the w=0 rank (rate 1.0) is ignored
        emas, fails, w = [1.0, 3.0, 100.0], [1.0, 0.5, 0.0], [100, 1, 0]
        assert cluster_rate(emas, fails, w, "min") == 0.5
        assert cluster_rate(emas, fails, w, "max") == 3.0 / 3.5

    def test_pooled_both_sums_zero(self):
        assert cluster_rate([0.0, 0.0], [0.0, 0.0], [2, 1], "weighted_mean") == 1.0

    @pytest.mark.parametrize("reducer", ["weighted_mean", "min", "max"])
    def test_no_weight_is_none(self, reducer):
        assert cluster_rate([1.0, 2.0], [0.5, 0.5], [0, 0], reducer) is None


class TestExpectedAndScore:
    @pytest.mark.parametrize("p,steps,expected", [
        (0.5, 0, 0.0), (0.5, 1, 0.5), (0.5, 3, 0.875), (0.5, 7, 0.9921875),  # 1 - 2^-S
        (1.0, 7, 7.0), (0.0, 7, 0.0), (0.75, 3, 1.734375),                  # .75+.5625+.421875
        (0.25, 2, 0.3125),
    ])
    def test_expected_accepted(self, p, steps, expected):
        assert expected_accepted(p, steps) == expected

    def test_expected_order_of_terms(self):
        # t1 = p, t_k = t_{k-1}*p, added left to right (docs/policy.md)
        p = 0.7
        t1 = p
        t2 = t1 * p
        t3 = t2 * p
        assert expected_accepted(p, 3) == (0.0 + t1) + t2 + t3

    def test_scores(self):
        # p = 0.5, costs 1.25 / 1.5 / 2.0: (1+0.5)/1.25 = 1.2, (1+0.875)/1.5 = 1.25,
        # (1+0.9921875)/2 = 0.99609375
        assert goodput_score(0.5, 1, 1.25) == 1.2
        assert goodput_score(0.5, 3, 1.5) == 1.25
        assert goodput_score(0.5, 7, 2.0) == 0.99609375
        assert goodput_score(0.3, 0, 0.8) == 1.25  # E(0) = 0: 1/cost
        assert goodput_scores(gp(), 0.5, 4) == [1.2, 1.25, 0.99609375]


class TestCostRow:
    TABLE = RoundCost.parse({"32": {"1": 3.0}, "1": {"1": 1.0}, "8": {"1": 2.0}})

    @pytest.mark.parametrize("batch,row", [(0, 0), (1, 0), (2, 1), (8, 1), (9, 2), (32, 2),
                                           (33, 2), (1000, 2)])
    def test_smallest_row_at_least_batch_else_largest(self, batch, row):
        assert self.TABLE.buckets == (1, 8, 32)
        assert cost_row(self.TABLE, batch) == row

    def test_flat_table_one_row(self):
        t = RoundCost.parse(FLAT)
        assert t.buckets is None and cost_row(t, 1) == 0 and cost_row(t, 10_000) == 0

    def test_row_picks_the_costs(self):
        # batch 4 -> row "8": 1: 2.0, 3: 2.0, 7: 4.0. p 0.5: 1.5/2 = 0.75, 1.875/2 = 0.9375,
        # 1.9921875/4 = 0.498046875 ; batch 1 -> row "1": FLAT scores above
        c = gp(round_cost={"1": FLAT, "8": {"1": 2.0, "3": 2.0, "7": 4.0}})
        assert goodput_scores(c, 0.5, 4) == [0.75, 0.9375, 0.498046875]
        assert goodput_scores(c, 0.5, 1) == [1.2, 1.25, 0.99609375]
        assert goodput_scores(c, 0.5, 64) == [0.75, 0.9375, 0.498046875]  # past the largest


class TestGoodputPick:
    def test_best_beats_margin(self):
        assert goodput_pick([1.0, 1.5, 1.25], 0, 0.25) == 1  # 1.5 > 1.25*1.0

    def test_exactly_at_margin_stays(self):
        assert goodput_pick([1.0, 1.25], 0, 0.25) == 0          # 1.25 is not > 1.25
        assert goodput_pick([1.0, 1.2500001], 0, 0.25) == 1

    def test_ties_go_to_smaller_depth(self):
        assert goodput_pick([1.0, 2.0, 2.0], 0, 0.0) == 1
        assert goodput_pick([2.0, 2.0, 1.0], 2, 0.0) == 0

    def test_tie_with_current_stays(self):
        # best is index 0 (tie, smaller), but 2.0 > 2.0 is false
        assert goodput_pick([2.0, 2.0], 1, 0.0) == 1

    def test_current_is_best(self):
        assert goodput_pick([1.0, 3.0, 2.0], 1, 0.0) == 1

    def test_several_tiers_at_once(self):
        assert goodput_pick([5.0, 1.0, 0.5, 0.1], 3, 0.05) == 0


class TestGoodputDecide:
    # p = 0.75 (ema 1.5, fail 0.5), flat costs 1.25 / 1.5 / 2.0:
    #   s1 = 1.75/1.25 = 1.4; s3 = 2.734375/1.5 = 1.822916..; s7 = (1 + 3(1 - .75^7))/2 = 1.79977..
    def test_moves_to_best(self):
        st, d = decide(gp(), GoodputState(index=0), 1, [1.5], [1], ema_fails=[0.5], batch=1)
        assert d.accept_rate == 0.75 and d.decision_point
        assert st.index == 1 and d.switched and not d.probe and st.last_switch == 1

    def test_margin_blocks_a_small_gain(self):
        # from 7: best 3 by 1.2% < 5% -> stays; with margin 0 it moves
        st, d = decide(gp(), GoodputState(index=2), 1, [1.5], [1], ema_fails=[0.5], batch=1)
        assert st.index == 2 and not d.switched
        st, d = decide(gp(switch_margin=0.0), GoodputState(index=2), 1, [1.5], [1],
                       ema_fails=[0.5], batch=1)
        assert st.index == 1 and d.switched

    def test_high_acceptance_goes_deep(self):
        # p = 0.9: s7 = (1 + 9(1 - .9^7))/2 = 2.8477 > 1.05 * s3 = 1.05 * 3.439/1.5 = 2.4073
        st, _ = decide(gp(), GoodputState(index=1), 1, [0.9], [0.1], ema_fails=[0.1], batch=1)
        assert st.index == 2

    def test_no_decision_without_point_or_weight(self):
        c = gp(warmup_batches=3)
        st, d = decide(c, GoodputState(index=0), 1, [1.5], [1], ema_fails=[0.5], batch=1)
        assert not d.decision_point and st.index == 0 and d.accept_rate == 0.75
        st, d = decide(gp(), GoodputState(index=0), 1, [1.5], [0], ema_fails=[0.5], batch=1)
        assert d.decision_point and d.accept_rate is None and st.index == 0

    def test_idle_round_not_counted(self):
        st0 = GoodputState(index=0, counted=2)
        st, d = decide(gp(), st0, 0, [1.5], [1], ema_fails=[0.5], batch=1)
        assert st == st0 and not d.counted and d.accept_rate is None

    @pytest.mark.parametrize("reducer,rate,index", [
        # rank rates 0.25 (ema 0.25, fail 0.75) and 0.9 (0.9, 0.1), w 1 and 1:
        # pooled (0.25+0.9)/(0.25+0.9+0.75+0.1) = 1.15/2.0 = 0.575
        ("weighted_mean", 0.575, 1),  # s1 = 1.26, s3 = (1+.575+.330625+.190109375)/1.5 = 1.397
        ("min", 0.25, 0),             # s1 = 1.0, s3 = 1.328125/1.5 = 0.885, s7 = 0.666
        ("max", 0.9, 2),
    ])
    def test_reducer_drives_decision(self, reducer, rate, index):
        st, d = decide(gp(reducer=reducer), GoodputState(index=1), 2, [0.25, 0.9], [1, 1],
                       ema_fails=[0.75, 0.1], batch=1)
        assert d.accept_rate == rate and st.index == index

    def test_bucket_row_drives_decision(self):
        # p = 0.5. Row "1" (FLAT): best is 3 (1.25 vs 1.2). Row "8": costs 1: 1.0, 3: 2.0, 7: 4.0
        # -> 1.5, 0.9375, 0.498.. best is 1. Batch 2 uses row "8".
        c = gp(round_cost={"1": FLAT, "8": {"1": 1.0, "3": 2.0, "7": 4.0}}, switch_margin=0.0)
        st, d = decide(c, GoodputState(index=2), 1, [1.0], [1], ema_fails=[1.0], batch=1)
        assert d.cost_row == 1 and st.index == 1
        st, d = decide(c, GoodputState(index=2), 1, [1.0], [1], ema_fails=[1.0], batch=2)
        assert d.cost_row == 8 and st.index == 0
        st, d = decide(c, GoodputState(index=2), 1, [1.0], [1], ema_fails=[1.0], batch=65)
        assert d.cost_row == 8 and st.index == 0
        _, d = decide(gp(), GoodputState(index=2), 1, [1.0], [1], ema_fails=[1.0], batch=2)
        assert d.cost_row is None  # flat table

    def test_dwell(self):
        c = gp(min_dwell_rounds=3, switch_margin=0.0)
        st = GoodputState(index=1)
        hi, lo = ([0.9], [0.1]), ([0.0], [1.0])
        st, d = decide(c, st, 1, hi[0], [1], ema_fails=hi[1], batch=1)   # c1: up to 7
        assert st.index == 2 and st.last_switch == 1
        st, d = decide(c, st, 1, lo[0], [1], ema_fails=lo[1], batch=1)   # c2: blocked
        assert d.decision_point and st.index == 2
        st, d = decide(c, st, 1, lo[0], [1], ema_fails=lo[1], batch=1)   # c3: blocked
        assert st.index == 2
        st, d = decide(c, st, 1, lo[0], [1], ema_fails=lo[1], batch=1)   # c4: 3 rounds since
        assert st.index == 0 and d.switched and st.last_switch == 4

    def test_needs_ema_fails_and_round_cost(self):
        with pytest.raises(ValueError, match="ema_fail"):
            decide(gp(), GoodputState(index=0), 1, [1.5], [1])
        with pytest.raises(ValueError, match="round_cost"):
            decide(gp(round_cost=None), GoodputState(index=0), 1, [1.5], [1], ema_fails=[0.5])

    def test_ema_ignores_the_goodput_inputs(self):
        c = cfg(warmup_batches=0, update_interval=1)
        a = decide(c, PolicyState(index=1), 1, [6.0], [1])
        b = decide(c, PolicyState(index=1), 1, [6.0], [1], ema_fails=[0.0], batch=64)
        assert a == b and a[1].accept_rate is None and a[1].cost_row is None


class TestProbe:
    def cfg0(self, **kw) -> AdaptiveConfig:
        return gp(candidate_steps=[0, 1, 3], initial_steps=0, round_cost=ZERO_FLAT, **kw)

    def test_points_upto(self):
        assert [decision_points_upto(c, 2, 3) for c in (-1, 0, 2, 4, 5, 7, 8, 11)] == \
            [0, 0, 0, 0, 1, 1, 2, 3]

    def test_probe_from_the_start(self):
        # interval 1, probe_every 3, start at 0 with no switch: points c1, c2, c3 -> probe at c3
        c = self.cfg0(probe_every=3)
        st = depth_policy(c).initial_state()
        got = []
        for _ in range(3):
            st, d = decide(c, st, 2, [0.0], [0], ema_fails=[1.0], batch=2)
            got.append((st.index, d.probe))
        assert got == [(0, False), (0, False), (1, True)]
        assert st.last_switch == 3

    def test_probe_counts_points_since_the_switch_into_zero(self):
        # warmup 0, interval 2: points at 2, 4, 6, 8. Switched to 0 at counted 5 (say, a point
        # of another schedule); probe_every 2: points 6 and 8 are after it -> probe at 8.
        c = self.cfg0(update_interval=2, probe_every=2)
        assert not probe_due(c, 0, 6, 5)
        assert probe_due(c, 0, 8, 5)
        st = GoodputState(index=0, counted=5, last_switch=5)
        idx = []
        for _ in range(3):  # counted 6, 7, 8
            st, d = decide(c, st, 1, [0.0], [0], ema_fails=[1.0], batch=1)
            idx.append(st.index)
        assert idx == [0, 0, 1] and d.probe and st.last_switch == 8

    def test_probe_waits_for_dwell(self):
        # probe_every 1, dwell 4, switched into 0 at counted 2: points 3, 4, 5 blocked; 6 probes
        c = self.cfg0(probe_every=1, min_dwell_rounds=4)
        st = GoodputState(index=0, counted=2, last_switch=2)
        idx = []
        for _ in range(4):
            st, _ = decide(c, st, 1, [0.0], [0], ema_fails=[1.0], batch=1)
            idx.append(st.index)
        assert idx == [0, 0, 0, 1]

    def test_at_zero_shadow_checks_move_without_a_probe(self):
        # live weight at depth 0 (shadow checks since the last point): the best score moves now,
        # not as a probe; p = 1: s0 = 1, s1 = 2/1.25 = 1.6, s3 = 4/1.5 = 2.67 -> depth 3
        c = self.cfg0(probe_every=2)
        st, d = decide(c, GoodputState(index=0), 1, [6.0], [5], ema_fails=[0.0], batch=1)
        assert st.index == 2 and d.accept_rate == 1.0 and d.switched and not d.probe
        # p = 0.1: s1 = 1.1/1.25 = 0.88, s3 = 1.111/1.5 = 0.74 < s0 = 1 -> stays, no probe
        st, d = decide(c, GoodputState(index=0), 1, [0.1], [5], ema_fails=[0.9], batch=1)
        assert st.index == 0 and not d.switched and d.accept_rate == pytest.approx(0.1)
        # without live weight only the probe moves (not due yet: 1 decision point of 2)
        st, d = decide(c, GoodputState(index=0), 1, [6.0], [0], ema_fails=[0.0], batch=1)
        assert st.index == 0 and d.accept_rate is None

    def test_a_signal_at_zero_restarts_the_probe_wait(self):
        c = self.cfg0(probe_every=2)   # interval 1, warm-up 0: every counted round is a point
        # 3 points since the switch, but the point at counted 2 had a rate: 1 point since it
        st = GoodputState(index=0, counted=2, last_switch=0, last_signal=2)
        st, d = decide(c, st, 1, [0.0], [0], ema_fails=[1.0], batch=1)
        assert st.index == 0 and not d.probe
        st, d = decide(c, st, 1, [0.0], [0], ema_fails=[1.0], batch=1)   # 2 points: the probe
        assert st.index == 1 and d.probe and st.last_signal == 2
        # a point at depth 0 with a rate is a signal (p = 0.1: it stays at 0)
        st, d = decide(c, GoodputState(index=0, counted=5, last_switch=0), 1, [0.1], [3],
                       ema_fails=[0.9], batch=1)
        assert st.index == 0 and st.last_signal == 6 and not d.switched

    def test_shadow_update_by_hand(self):
        # 3 of 4 guesses right, alpha 0.5: ema 0 -> 0.375, ema_fail 1 -> 0.625
        assert shadow_update(0.0, 1.0, 3, 4, 0.5) == (0.375, 0.625)
        assert shadow_update(2.0, 0.5, 0, 0, 0.5) == (2.0, 0.5)     # no checks: unchanged
        assert shadow_update(1.0, 0.0, 0, 5, 0.25) == (0.75, 0.25)
        # three rounds' worth: three updates with the same share
        assert shadow_update(0.0, 1.0, 3, 4, 0.5, rounds=3) == (0.65625, 0.34375)
        with pytest.raises(ValueError, match="rounds=0"):
            shadow_update(0.0, 1.0, 3, 4, 0.5, rounds=0)

    def test_probe_only_at_zero(self):
        c = self.cfg0(probe_every=1)
        assert not probe_due(c, 1, 10, -1)

    def test_low_acceptance_goes_to_zero(self):
        # p = 0.2: best is 0 (s0 = 1/1 = 1.0, s1 = 1.2/1.25 = 0.96), but 1.0 is not
        # > 1.05 * 0.96 = 1.008 -> stays at 1.
        # p = 0.1: s1 = 1.1/1.25 = 0.88 and 1.0 > 1.05 * 0.88 = 0.924 -> to 0
        c = self.cfg0()
        st, _ = decide(c, GoodputState(index=1), 1, [0.2], [1], ema_fails=[0.8], batch=1)
        assert st.index == 1
        st, d = decide(c, GoodputState(index=1), 1, [0.1], [1], ema_fails=[0.9], batch=1)
        assert st.index == 0 and d.switched and not d.probe


# ------------------------------------------------------------------------- goodput: the reset
class TestSurprise:
    def test_by_hand(self):
        # 16 requests reject at once at depth 7 (A 0, F 16) against ema 0.85 / fail 0.15 (p 0.85):
        # r = 0 -> 16·ln(1/0.15) = 30.3539...
        assert surprise([0] * 16, 7, 0.85, 0.15) == pytest.approx(16 * math.log(1 / 0.15))
        # [3, 1] at depth 3: A 4, F 1, r 0.8, against ema 1.0 / fail 1.0 (p 0.5):
        # 4·ln(0.8/0.5) + 1·ln(0.2/0.5) = 1.880017 - 0.916291 = 0.963726
        assert surprise([3, 1], 3, 1.0, 1.0) == pytest.approx(
            4 * math.log(1.6) + math.log(0.4), abs=1e-12)
        # every draft accepted (F 0): only the A term; [7] against p 0.3: 7·ln(1/0.3) = 8.4278
        assert surprise([7], 7, 0.3, 0.7) == pytest.approx(7 * math.log(1 / 0.3))
        # the round agreeing with the EMAs exactly: 0
        assert surprise([1, 0], 1, 1.0, 1.0) == pytest.approx(0.0, abs=1e-15)

    def test_rate_held_inside_one_percent(self):
        # p 0 (ema 0, fail 1) held to 0.01: [1, 1] at depth 1 -> 2·ln(1/0.01) = 9.2103
        assert surprise([1, 1], 1, 0.0, 1.0) == pytest.approx(2 * math.log(100))
        # p 1 (fail 0) held to 0.99: [0] at depth 3 -> ln(1/0.01)
        assert surprise([0], 3, 2.0, 0.0) == pytest.approx(math.log(100))

    def test_nothing_to_test(self):
        assert surprise([], 3, 1.0, 1.0) == 0.0
        assert surprise([0, 0], 0, 1.0, 1.0) == 0.0

    def test_round_update_resets_only_goodput_above_the_threshold(self):
        # [0] * 16 at depth 7 from (4.5, 0.5): p 0.9, surprise 16·ln 10 = 36.8 > 8
        g = gp(ema_alpha=0.25)
        assert round_update(g, 4.5, 0.5, [0] * 16, 7) == (0.0, 1.0, True)
        # the same round with the reset off, or under ema: the alpha update
        # ema 0.75·4.5 = 3.375, fail 0.75·0.5 + 0.25 = 0.625
        assert round_update(g.replace(reset_nats=0.0), 4.5, 0.5, [0] * 16, 7) == (
            3.375, 0.625, False)
        e = AdaptiveConfig(ema_alpha=0.25)
        assert round_update(e, 4.5, 0.5, [0] * 16, 7) == (3.375, 0.625, False)
        # one request rejecting at once against p 0.9: ln 10 = 2.30 < 8: the alpha update
        assert round_update(g, 4.5, 0.5, [0], 7) == (3.375, 0.625, False)
        # a threshold above the surprise (36.84 < 40): no reset
        assert round_update(g.replace(reset_nats=40.0), 4.5, 0.5, [0] * 16, 7)[2] is False
        # [2, 3] at depth 3 from (0.0, 1.0) (p held to 0.01): A 5, F 1, r 5/6 ->
        # 5·ln(83.33) + ln(0.1683) = 22.1 - 1.78 > 8: mean 2.5, rejecting share 0.5
        assert round_update(g, 0.0, 1.0, [2, 3], 3) == (2.5, 0.5, True)


class TestMixture:
    def test_scores_by_hand_against_the_pooled_rate(self):
        """Two ranks, weight 1 each: rank 0 ema 0.1 / fail 0.9 (p 0.1), rank 1 ema 0.9 / fail 0.1
        (p 0.9); costs 1: 1.0, 3: 1.5, margin 0, at depth 1.
        mixture: E1 = (0.1 + 0.9)/2 = 0.5, E3 = (0.111 + 2.439)/2 = 1.275 -> s1 1.5,
        s3 2.275/1.5 = 1.516667 -> to 3. Pooled (weighted_mean): p = 1.0/2.0 = 0.5, E3 = 0.875
        -> s3 1.25 < s1 1.5 -> stays at 1."""
        base = dict(policy="goodput", candidate_steps=[1, 3], initial_steps=1,
                    warmup_batches=0, update_interval=1, switch_margin=0.0,
                    round_cost={"1": 1.0, "3": 1.5})
        emas, fails, weights = [0.1, 0.9], [0.9, 0.1], [1, 1]
        for reducer, want, rate in (("mixture", 3, 0.5), ("weighted_mean", 1, 0.5)):
            c = AdaptiveConfig(**base, reducer=reducer)
            _, d = decide(c, depth_policy(c).initial_state(), 2, emas, weights, ema_fails=fails, batch=1)
            assert c.candidate_steps[d.new_index] == want and d.accept_rate == pytest.approx(rate)
        mix = live_rates(emas, fails, weights)
        assert mix == [(pytest.approx(0.1), 1), (pytest.approx(0.9), 1)]
        assert mixture_expected(mix, 3) == pytest.approx((0.111 + 2.439) / 2)
        c = AdaptiveConfig(**base, reducer="mixture")
        assert goodput_scores(c, 0.5, 1, mix=mix) == [pytest.approx(1.5),
                                                      pytest.approx(2.275 / 1.5)]

    def test_weights_and_ranks_without_weight(self):
        # weights 3 and 1 (a rank with weight 0 is left out): E1 = (3·0.5 + 1·1.0)/4 = 0.625
        mix = live_rates([1.0, 0.4, 2.0], [1.0, 0.6, 0.0], [3, 0, 1])
        assert mix == [(0.5, 3), (1.0, 1)] and mixture_expected(mix, 1) == 0.625
        assert cluster_rate([1.0, 0.4, 2.0], [1.0, 0.6, 0.0], [3, 0, 1], "mixture") == 0.625
        assert cluster_rate([1.0], [1.0], [0], "mixture") is None

    def test_mixture_is_goodput_only(self):
        with pytest.raises(Exception, match="mixture .* goodput policy only"):
            AdaptiveConfig(reducer="mixture")
        assert AdaptiveConfig(policy="goodput", reducer="mixture").reducer == "mixture"
