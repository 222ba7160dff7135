"""Unit tests for the pure policy functions (adaptive_dist.policy) against docs/policy.md,
"The adaptive layer". Every expected value is worked out by hand in the test."""
from __future__ import annotations

import pytest

from adaptive_dist.config import AdaptiveConfig
from adaptive_dist.policy import (
    PolicyState,
    decide,
    ema_update,
    is_decision_point,
    ladder_walk,
    pick_bucket,
    reduce_emas,
)

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
        st, d = decide(c, PolicyState.initial(c), 1, [0.0], [1])
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
