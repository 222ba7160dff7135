"""RoundCoordinator on a size-1 group: whole round sequences against hand-worked examples
(docs/policy.md), the runtime-state pool contract and the graph/eager plan."""
from __future__ import annotations

import pytest

from collectives import Group
from adaptive_dist.config import AdaptiveConfig, ConfigError
from adaptive_dist.coordinator import RoundCoordinator, RoundReport
from workers.runtime_state import AdaptiveSpecWorker, RuntimeStatePool, SpecRuntimeState


def make(policy="ema", **kw) -> RoundCoordinator:
    return RoundCoordinator(AdaptiveConfig(policy=policy, **kw), Group.single())


class FakeWorker:
    """Records every build/apply; states are distinct objects so identity can be checked."""

    def __init__(self):
        self.built: list[int] = []
        self.applied: list[SpecRuntimeState] = []
        self.states: dict[int, SpecRuntimeState] = {}

    def build_runtime_state(self, steps: int) -> SpecRuntimeState:
        self.built.append(steps)
        s = SpecRuntimeState(steps=steps, payload=object(), nbytes=10 * steps)
        self.states[steps] = s
        return s

    def apply_runtime_state(self, state: SpecRuntimeState) -> None:
        self.applied.append(state)


# The hand-worked example: candidates [1,3,7], initial 3 (EMA starts at 2.0), alpha 0.5,
# warmup 2, interval 1, up 0.0, down -0.25.
#   at index 1 (steps 3): drop if E <= 0.25, rise if E > 2.5
#   at index 2 (steps 7): drop if E <= 2.25
# Each row: (requests at begin_round, accepts at end_round, steps that ran, switched before it,
#            EMA after end_round)
# r0  c1            [3]    -> 0.5*2.0   + 0.5*3 = 2.5
# r1  c2            [3]    -> 2.75
# r2  c3 (point)    [3]    -> 2.875  ; decision at r2: 2.875 > 2.5 -> up to 7, applied before r3
# r3  c4 (point)    [7,5]  -> 0.5*2.875 + 0.5*6 = 4.4375 ; stays at 7
# r4  c5 (point)    [0]    -> 2.21875 ; decision at r4: 2.21875 <= 2.25 -> down to 3 (not to 1)
# r5  idle: not counted, [] -> 2.21875 unchanged
# r6  c6 (point)    [0,0]  -> 1.109375 ; stays at 3 (1.109375 > 0.25)
# r7  c7            [0]    -> 0.5546875 ; stays
# r8  c8            [0]    -> 0.27734375 ; stays (> 0.25)
# r9  c9            [0]    -> 0.138671875 ; <= 0.25 -> down to 1, applied before r10
# r10 idle          []
# r11 idle          []
EXAMPLE = [
    (1, [3], 3, False, 2.5),
    (1, [3], 3, False, 2.75),
    (1, [3], 3, False, 2.875),
    (2, [7, 5], 7, True, 4.4375),
    (1, [0], 7, False, 2.21875),
    (0, [], 3, True, 2.21875),
    (2, [0, 0], 3, False, 1.109375),
    (1, [0], 3, False, 0.5546875),
    (1, [0], 3, False, 0.27734375),
    (1, [0], 3, False, 0.138671875),
    (0, [], 1, True, 0.138671875),
    (0, [], 1, False, 0.138671875),
]
EXAMPLE_CFG = dict(candidate_steps=[1, 3, 7], initial_steps=3, ema_alpha=0.5, warmup_batches=2,
                   update_interval=1, up_hysteresis=0.0, down_hysteresis=-0.25)


def run_example(ctl: RoundCoordinator, rows=EXAMPLE):
    plans, emas = [], []
    for n, accepts, *_ in rows:
        plans.append(ctl.begin_round(RoundReport(n, num_tokens=n)))
        ctl.end_round(accepts)
        emas.append(ctl.ema)
    return plans, emas


# -------------------------------------------------------------------------------------- EMA
@pytest.mark.parametrize("initial,expected", [(1, 0.0), (3, 2.0), (7, 6.0)])
def test_ema_starts_at_initial_steps_minus_one(initial, expected):
    ctl = make(initial_steps=initial)
    assert ctl.ema == expected
    assert ctl.steps == initial


def test_idle_round_leaves_ema_unchanged():
    ctl = make(ema_alpha=0.5)
    ctl.begin_round(RoundReport(1))
    ctl.end_round([3])          # 0.5*2 + 0.5*3 = 2.5
    assert ctl.ema == 2.5
    ctl.begin_round(RoundReport(0))
    ctl.end_round([])
    assert ctl.ema == 2.5


# ------------------------------------------------------------------------- the worked example
def test_hand_worked_sequence():
    ctl = make(**EXAMPLE_CFG)
    plans, emas = run_example(ctl)
    assert [p.steps for p in plans] == [r[2] for r in EXAMPLE]
    assert [p.switched for p in plans] == [r[3] for r in EXAMPLE]
    assert emas == [r[4] for r in EXAMPLE]
    assert [p.round for p in plans] == list(range(12))
    assert ctl.stats.switches == 3
    assert ctl.stats.counted_rounds == 9
    assert ctl.stats.steps_timeline == [(0, 3), (3, 7), (5, 3), (10, 1)]
    assert ctl.steps == 1


def test_hand_worked_outcomes():
    ctl = make(**EXAMPLE_CFG)
    outcomes = []
    for n, accepts, *_ in EXAMPLE:
        ctl.begin_round(RoundReport(n))
        outcomes.append(ctl.last_outcome)
        ctl.end_round(accepts)
    assert outcomes[0] is None  # no previous round to decide on
    d = [o.decision for o in outcomes[1:]]  # the decision on round r is seen at r+1
    assert [o.round for o in outcomes[1:]] == list(range(11))
    assert [x.counted for x in d] == [True] * 5 + [False] + [True] * 4 + [False]
    assert [x.decision_point for x in d] == [False, False] + [True] * 3 + [False] + [True] * 4 + [False]
    # global EMA at the decision points (single rank: its own EMA, including that round)
    assert d[2].global_ema == 2.875
    assert d[3].global_ema == 4.4375
    assert d[4].global_ema == 2.21875
    assert d[5].global_ema is None  # not counted
    assert d[9].global_ema == 0.138671875
    assert [x.switched for x in d] == [False, False, True, False, True, False, False, False,
                                       False, True, False]
    assert outcomes[3].steps == 3 and outcomes[4].steps == 7  # steps that ran in rounds 2, 3
    assert outcomes[3].local_ema == 2.875


def test_weights_reset_at_decision_points():
    ctl = make(**EXAMPLE_CFG)
    weights_after_begin = []
    for n, accepts, *_ in EXAMPLE[:8]:
        ctl.begin_round(RoundReport(n))
        weights_after_begin.append(ctl.weight)
        ctl.end_round(accepts)
    # r0: nothing yet; r1: c1 (1 req) no point; r2: c2 -> 2; r3: point -> 0; r4: point -> 0;
    # r5: point -> 0; r6: previous round idle, not counted -> stays 0; r7: point -> 0
    assert weights_after_begin == [0, 1, 2, 0, 0, 0, 0, 0]
    assert ctl.weight == 1  # r7's one request


def test_static_policy_same_inputs_never_switches():
    ctl = make("static", **EXAMPLE_CFG)
    # same rows, accepts capped at the 3 steps that static keeps running
    rows = [(n, [min(a, 3) for a in acc], *rest) for n, acc, *rest in EXAMPLE]
    plans, emas = run_example(ctl, rows)
    assert [p.steps for p in plans] == [3] * 12
    assert not any(p.switched for p in plans)
    # the EMA still runs (and crosses the rise threshold 2.5 at round 2, then the drop
    # threshold 0.25 at round 8): 2.5, 2.75, 2.875, then [3,3] -> 2.9375, [0] -> 1.46875, ...
    assert emas == [2.5, 2.75, 2.875, 2.9375, 1.46875, 1.46875, 0.734375, 0.3671875,
                    0.18359375, 0.091796875, 0.091796875, 0.091796875]
    assert ctl.stats.switches == 0


def test_round_own_statistics_in_its_decision():
    # warmup 0, interval 1, alpha 1: round 0's accepts [3] make EMA 3.0 > 2.5 and the decision
    # at round 0 (counted 1) already moves to 7, so round 1 runs 7.
    ctl = make(ema_alpha=1.0, warmup_batches=0, update_interval=1)
    assert ctl.begin_round(RoundReport(1)).steps == 3
    ctl.end_round([3])
    p = ctl.begin_round(RoundReport(1))
    assert p.steps == 7 and p.switched


def test_warmup_zero_interval_three():
    # points at counted 3, 6. alpha 1. Accepts 3 each round: EMA 3.0 from round 0 on.
    ctl = make(ema_alpha=1.0, warmup_batches=0, update_interval=3)
    steps = []
    for _ in range(5):
        steps.append(ctl.begin_round(RoundReport(1)).steps)
        ctl.end_round([min(3, ctl.steps)])
    # decisions at rounds 0,1 (counted 1,2) none; round 2 (counted 3) -> up, applied at round 3
    assert steps == [3, 3, 3, 7, 7]


def test_idle_rounds_do_not_count_toward_warmup():
    ctl = make(ema_alpha=1.0, warmup_batches=2, update_interval=1)
    pattern = [(1, [3]), (0, []), (0, []), (1, [3]), (0, []), (1, [3]), (0, [])]
    steps = []
    for n, acc in pattern:
        steps.append(ctl.begin_round(RoundReport(n)).steps)
        ctl.end_round(acc)
    # counted rounds: r0 c1, r3 c2, r5 c3 (first point) -> switch applied before r6
    assert steps == [3, 3, 3, 3, 3, 3, 7]


# --------------------------------------------------------------------------------- dwell
def test_dwell_in_controller_and_weight_reset_at_blocked_point():
    # warmup 0, interval 1, alpha 1, dwell 2.
    ctl = make(ema_alpha=1.0, warmup_batches=0, update_interval=1, min_dwell_rounds=2)
    p0 = ctl.begin_round(RoundReport(1)); ctl.end_round([3])   # EMA 3
    p1 = ctl.begin_round(RoundReport(1))  # decision at c1: up to 7 (last switch c1)
    ctl.end_round([0])                            # EMA 0
    p2 = ctl.begin_round(RoundReport(1))  # c2: 1 counted round since switch -> blocked
    blocked = ctl.last_outcome.decision
    w_after_blocked = ctl.weight
    ctl.end_round([0])
    p3 = ctl.begin_round(RoundReport(1))  # c3: 2 rounds since -> allowed, down to 1
    assert [p0.steps, p1.steps, p2.steps, p3.steps] == [3, 7, 7, 1]
    assert blocked.decision_point and not blocked.switched and blocked.global_ema == 0.0
    assert w_after_blocked == 0


# -------------------------------------------------------------------------- accept lengths
def test_accept_outside_range_raises():
    ctl = make()
    ctl.begin_round(RoundReport(2))
    with pytest.raises(ValueError):
        ctl.end_round([4])
    with pytest.raises(ValueError):
        ctl.end_round([-1])
    with pytest.raises(ValueError):
        ctl.end_round([1, 7])
    ctl.end_round([0, 3])  # bounds themselves are fine
    assert ctl.ema == pytest.approx(0.8 * 2.0 + 0.2 * 1.5)


def test_accept_bound_follows_steps_in_force():
    ctl = make(**EXAMPLE_CFG)
    for n, accepts, *_ in EXAMPLE[:3]:
        ctl.begin_round(RoundReport(n))
        ctl.end_round(accepts)
    assert ctl.begin_round(RoundReport(2)).steps == 7
    ctl.end_round([7, 7])  # allowed at steps 7
    ctl2 = make(**EXAMPLE_CFG)
    ctl2.begin_round(RoundReport(1))
    with pytest.raises(ValueError):
        ctl2.end_round([7])  # steps 3 in force


def test_negative_begin_round_raises():
    ctl = make()
    with pytest.raises(ValueError):
        ctl.begin_round(RoundReport(-1))
    with pytest.raises(ValueError):
        ctl.begin_round(RoundReport(1, num_tokens=-1))


def test_unknown_policy_raises():
    with pytest.raises(ConfigError, match="policy"):
        make("min_vote")


# ------------------------------------------------------------------------ runtime-state pool
def test_worker_build_once_per_candidate_apply_on_switch_only():
    """The driver pattern an engine follows: build every tier once, apply on a switch only."""
    w = FakeWorker()
    assert isinstance(w, AdaptiveSpecWorker)
    ctl = make(**EXAMPLE_CFG)
    pool = RuntimeStatePool(w, ctl.config.tiers)
    pool.apply(ctl.steps)
    assert w.built == [1, 3, 7]
    built_states = dict(w.states)
    assert len(w.applied) == 1 and w.applied[0] is built_states[3]
    assert pool.nbytes == 10 + 30 + 70

    applied_at = []
    for r, (n, accepts, *_ ) in enumerate(EXAMPLE):
        before = len(w.applied)
        p = ctl.begin_round(RoundReport(n))
        if p.switched:
            pool.apply(p.steps)
        if len(w.applied) != before:
            assert len(w.applied) == before + 1
            applied_at.append((r, w.applied[-1]))
        ctl.end_round(accepts)
        assert len(w.applied) == before + (1 if p.switched else 0)
    assert w.built == [1, 3, 7]  # nothing built during rounds
    assert [r for r, _ in applied_at] == [3, 5, 10]
    assert applied_at[0][1] is built_states[7]
    assert applied_at[1][1] is built_states[3]
    assert applied_at[2][1] is built_states[1]


def test_worker_static_no_apply_during_rounds():
    w = FakeWorker()
    ctl = make("static", candidate_steps=[2, 4], initial_steps=4, warmup_batches=0,
               update_interval=1, ema_alpha=1.0)
    pool = RuntimeStatePool(w, ctl.config.tiers)
    pool.apply(ctl.steps)
    for _ in range(4):
        assert not ctl.begin_round(RoundReport(1)).switched
        ctl.end_round([0])
    assert w.built == [4]  # a static run builds only the depth it keeps
    assert w.applied == [w.states[4]]
    with pytest.raises(RuntimeError, match="no runtime state was built for steps=2"):
        pool.apply(2)


def test_worker_wrong_state_refused():
    class Bad(FakeWorker):
        def build_runtime_state(self, steps):
            return SpecRuntimeState(steps=steps + 1)

    with pytest.raises(ValueError, match="steps"):
        RuntimeStatePool(Bad(), (1, 3))


# --------------------------------------------------------------------------- graph / eager
def test_can_graph_false_means_eager():
    ctl = make()
    p = ctl.begin_round(RoundReport(4, num_tokens=40, can_graph=False))
    assert p.use_graph is False and p.batch_bucket is None
    assert p.extend_tokens == 40 and p.cluster_requests == 4 and p.batch_pad == 4


@pytest.mark.parametrize("batch,bucket", [(1, 1), (3, 4), (5, 8), (8, 8), (17, 32), (64, 64)])
def test_bucket_smallest_at_least_batch(batch, bucket):
    ctl = make()
    p = ctl.begin_round(RoundReport(batch, num_tokens=batch))
    assert p.use_graph is True and p.batch_bucket == bucket


def test_batch_above_largest_bucket_is_eager():
    ctl = make()
    p = ctl.begin_round(RoundReport(65, num_tokens=65))
    assert p.use_graph is False and p.batch_bucket is None
    ctl.end_round([1] * 65)
    p = ctl.begin_round(RoundReport(64))
    assert p.use_graph is True and p.batch_bucket == 64


def test_custom_buckets():
    ctl = make(graph_buckets=[12, 4])
    assert ctl.begin_round(RoundReport(5)).batch_bucket == 12
    ctl.end_round([0] * 5)
    assert ctl.begin_round(RoundReport(4)).batch_bucket == 4
    ctl.end_round([0] * 4)
    p = ctl.begin_round(RoundReport(13))
    assert p.use_graph is False and p.batch_bucket is None


def test_done_flag():
    ctl = make()
    assert ctl.begin_round(RoundReport(0, done=True)).all_done is True
    ctl.end_round([])
    assert ctl.begin_round(RoundReport(0, done=False)).all_done is False


# ====================================================================================== goodput
# candidates [0, 1, 3], initial 1 (EMA starts at 0.0, ema_fail at 1.0), alpha 0.5, warmup 0,
# interval 1, margin 0, probe_every 2, flat costs 0: 1.0, 1: 1.25, 3: 1.5; no reset (reset_nats 0:
# r4 is a surprise of 2·ln(1/0.01) = 9.2 nats, which the default would act on).
#   r0 steps 1 [0, 0]: ema 0.0, fail 1.0 -> p 0: s0 1.0 > s1 0.8 -> down to 0 (c1, last switch 1)
#   r1 steps 0 [0, 0]: no signal (EMAs, weight unchanged); c2: 1 point since the switch -> stay
#   r2 idle: not counted, nothing changes
#   r3 steps 0 [0]:    c3: 2 points since -> probe: up to 1 (last switch 3)
#   r4 steps 1 [1, 1]: ema 0.5, fail 0.5 -> p 0.5: s0 1.0, s1 1.5/1.25 = 1.2,
#                      s3 1.875/1.5 = 1.25 -> up to 3
#   r5 steps 3 [3, 3]: ema 1.75, fail 0.25 -> p 0.875: s3 = (1+.875+.765625+.669921875)/1.5
#                      = 2.20703125 > s1 = 1.5, s0 = 1 -> stays
GP_CFG = dict(policy="goodput", candidate_steps=[0, 1, 3], initial_steps=1, ema_alpha=0.5,
              warmup_batches=0, update_interval=1, switch_margin=0.0, probe_every=2,
              round_cost={"0": 1.0, "1": 1.25, "3": 1.5}, reset_nats=0.0)
GP_ROWS = [  # (requests, full accepts, steps that ran, ema, ema_fail, weight after end_round)
    (2, [0, 0], 1, 0.0, 1.0, 2),
    (2, [5, 5], 0, 0.0, 1.0, 0),
    (0, [], 0, 0.0, 1.0, 0),
    (1, [4], 0, 0.0, 1.0, 0),
    (2, [1, 1], 1, 0.5, 0.5, 2),
    (2, [3, 3], 3, 1.75, 0.25, 2),
]


def test_goodput_hand_worked_sequence_down_to_zero_probe_and_up():
    ctl = RoundCoordinator(AdaptiveConfig(**GP_CFG), Group.single())
    assert (ctl.ema, ctl.ema_fail) == (0.0, 1.0)
    got, outcomes = [], []
    for n, full, *_ in GP_ROWS:
        plan = ctl.begin_round(RoundReport(n))
        outcomes.append(ctl.last_outcome)
        ctl.end_round([min(a, plan.steps) for a in full])
        got.append((plan.steps, ctl.ema, ctl.ema_fail, ctl.weight))
    assert got == [(s, e, f, w) for _, _, s, e, f, w in GP_ROWS]
    d = [o.decision for o in outcomes[1:]]  # decisions on rounds 0..4
    assert [x.counted for x in d] == [True, True, False, True, True]
    assert [x.accept_rate for x in d] == [0.0, None, None, None, 0.5]
    assert [x.switched for x in d] == [True, False, False, True, True]
    assert [x.probe for x in d] == [False, False, False, True, False]
    assert [x.cost_row for x in d] == [None] * 5  # a flat table
    assert outcomes[4].local_ema_fail == 1.0 and outcomes[5].local_ema_fail == 0.5
    assert ctl.stats.steps_timeline == [(0, 1), (1, 0), (4, 1), (5, 3)]
    plan = ctl.begin_round(RoundReport(1))
    assert plan.steps == 3 and not plan.switched
    assert ctl.last_outcome.decision.accept_rate == 0.875


def test_goodput_ema_fail_idle_rounds_and_start():
    ctl = RoundCoordinator(AdaptiveConfig(**{**GP_CFG, "initial_steps": 3}), Group.single())
    assert (ctl.ema, ctl.ema_fail) == (2.0, 1.0)
    ctl.begin_round(RoundReport(4))
    ctl.end_round([0, 3, 1, 3])  # steps 3: ema 1.0 + 0.875 = 1.875; share 2/4 -> 0.75
    assert (ctl.ema, ctl.ema_fail) == (1.875, 0.75)
    ctl.begin_round(RoundReport(0))
    ctl.end_round([])            # idle: both unchanged
    assert (ctl.ema, ctl.ema_fail) == (1.875, 0.75)


def test_ema_fail_travels_with_ema_for_every_policy():
    from adaptive_dist import consensus

    assert consensus.MAGIC == 0x5ADE
    assert consensus.FIELDS.index("ema_fail") == consensus.FIELDS.index("ema") + 1
    vec = consensus.RoundVector(0, 4, 16, 0, True, False, 0, False, 4, 2.5, 4, 3, 0, -1, 7, 9,
                                ema_fail=0.375)
    values = vec.row()
    assert len(values) == len(consensus.FIELDS)
    assert values[consensus.COL["ema"]] == 2.5 and values[consensus.COL["ema_fail"]] == 0.375
    assert values[consensus.COL["weight"]] == 4.0
    ctl = make(ema_alpha=0.5)   # ema: the same update runs, the decision ignores it
    ctl.begin_round(RoundReport(2))
    ctl.end_round([3, 1])       # share 1/2: 0.5*1.0 + 0.25 = 0.75
    assert ctl.ema_fail == 0.75


def test_goodput_without_round_cost_refused():
    with pytest.raises(ValueError, match="agree_round_cost"):
        make("goodput")


def test_goodput_bucket_row_from_the_plan():
    # rows "1" and "8": batch 1 uses "1", batch 3 (graph bucket 4) uses "8", batch 65 (eager,
    # padded to 65) uses "8" (the largest)
    cost = {"1": {"1": 1.0, "3": 1.5, "7": 2.0}, "8": {"1": 1.0, "3": 2.0, "7": 4.0}}
    ctl = make("goodput", round_cost=cost, warmup_batches=0, update_interval=1)
    rows = []
    for n in (1, 3, 65, 2):
        ctl.begin_round(RoundReport(n))
        if ctl.last_outcome is not None:
            rows.append((ctl.last_outcome.batch_pad, ctl.last_outcome.decision.cost_row))
        ctl.end_round([0] * n)
    assert rows == [(1, 1), (4, 8), (65, 8)]


@pytest.mark.parametrize("reset_nats,climb", [
    (0.0, [(104, 1), (108, 3), (112, 7)]),   # the EMAs move by alpha: through 3
    # the first round restarts them (start values are not measurements: straight to 0 at round
    # 4, 6 rounds sooner, the probes shifted alike, one of them at 1 when acceptance rises);
    # the probe's round (3 of 3 accepted against a rate of ~0: 13.8 nats) restarts them again:
    # p = 1, on to 7
    (8.0, [(100, 0), (106, 1), (108, 7)]),
])
def test_goodput_goes_to_zero_on_low_acceptance_and_comes_back(reset_nats, climb):
    """A long run: acceptance collapses (every request rejects the first draft token), the
    policy goes to 0; probes go to depth 1, find nothing and return to 0; acceptance rises
    (every draft token accepted), the next probe stays up and climbs to the deepest tier (every
    probe waits probe_every decision points). Without probes (consensus-only mode: no shadow
    checks at depth 0) the policy would stay at 0 after the rise: they are what leaves it."""
    cfg = AdaptiveConfig(policy="goodput", candidate_steps=[0, 1, 3, 7], initial_steps=3,
                         warmup_batches=2, update_interval=2, probe_every=3,
                         round_cost={"0": 1.0, "1": 1.25, "3": 1.6, "7": 2.4},
                         reset_nats=reset_nats)
    ctl = RoundCoordinator(cfg, Group.single())
    steps, probes = [], []
    for r in range(200):
        full = [0, 0, 0] if r < 100 else [9, 9, 9]
        plan = ctl.begin_round(RoundReport(3))
        steps.append(plan.steps)
        if ctl.last_outcome is not None and ctl.last_outcome.decision.probe:
            probes.append(r - 1)
        ctl.end_round([min(a, plan.steps) for a in full])
    low, high = steps[:100], steps[100:]
    assert 0 in low and low[-1] in (0, 1)                # at 0, or probing at 1
    first_zero = low.index(0)
    assert all(s in (0, 1) for s in low[first_zero:])     # at 0, or probing at 1
    low_probes = [p for p in probes if p < 100]
    assert len(low_probes) >= 3                           # probed repeatedly, came back to 0
    assert high[-1] == 7 and all(s == 7 for s in high[-50:])
    # a cycle at low acceptance: one interval (2 rounds) probing at depth 1, then back at 0 for
    # probe_every (3) decision points of interval 2 (6 rounds): a probe every 8 rounds
    gaps = [b - a for a, b in zip(low_probes, low_probes[1:])]
    assert gaps == [8] * (len(low_probes) - 1)
    # the first probe after the rise (decided at round 103) stays up and climbs
    assert ctl.stats.steps_timeline[-3:] == climb
    assert ctl.stats.resets == (2 if reset_nats else 0)


def test_goodput_shadow_checks_at_depth_0_update_the_emas_and_leave_without_a_probe():
    """At depth 0 a round that reports shadow checks (hits, checks, rows) updates the EMAs as
    depth-1 rounds would (share hits/checks; one update for each depth-0 round with requests since
    they last moved, here two) and the weight by rows; at the next decision point the policy
    moves on the rate, not by a probe. Rounds at depth > 0 and the ema policy ignore shadow
    reports; a bad report is refused by name."""
    cost = {"0": 1.0, "1": 1.25, "3": 1.6, "7": 2.4}
    cfg = AdaptiveConfig(policy="goodput", candidate_steps=[0, 1, 3, 7], initial_steps=0,
                         warmup_batches=0, update_interval=2, ema_alpha=0.5, probe_every=50,
                         round_cost=cost, reset_nats=0.0)   # the alpha rules alone
    ctl = RoundCoordinator(cfg, Group.single())
    assert (ctl.ema, ctl.ema_fail) == (0.0, 1.0)
    ctl.begin_round(RoundReport(2))
    ctl.end_round([0, 0])                               # depth 0: no signal
    assert (ctl.ema, ctl.ema_fail, ctl.weight) == (0.0, 1.0, 0)
    ctl.begin_round(RoundReport(2))                                  # counted 1
    ctl.end_round([0, 0], shadow=(7, 7, 2))             # all 7 guesses right: share 1, 2 rounds
    assert (ctl.ema, ctl.ema_fail, ctl.weight) == (0.75, 0.25, 2)   # 0 -> .5 -> .75; 1 -> .5 -> .25
    assert ctl.stats.shadow_rounds == 1
    ctl.begin_round(RoundReport(2))  # decides round 1: counted 2, a point
    # p = 0.75: scores 1, 1.75/1.25 = 1.4, 2.734/1.6 = 1.71, 3.600/2.4 = 1.50 -> depth 3
    d = ctl.last_outcome.decision
    assert d.decision_point and d.accept_rate == 0.75 and d.switched and not d.probe
    assert ctl.steps == 3 and ctl.stats.probes == 0
    with pytest.raises(ValueError, match=r"shadow checks \(8, 7, 2\)"):
        ctl.end_round([0, 0], shadow=(8, 7, 2), plan=ctl._prev_plan.__class__(
            **{**ctl._prev_plan.__dict__, "steps": 0}))
    ctl.end_round([1, 0], shadow=(0, 7, 2))             # depth 3: the accepts count, not these
    assert (ctl.ema, ctl.ema_fail) == (0.5 * 0.75 + 0.25, 0.5 * 0.25 + 0.5)
    ema = make("ema", initial_steps=1)
    ema.begin_round(RoundReport(1))
    ema.end_round([1], shadow=(0, 7, 1))
    assert ema.stats.shadow_rounds == 0


def test_goodput_shadow_update_covers_the_depth_0_rounds_since_the_emas_moved():
    """The engine reports shadow checks once per catch-up: they count for every depth-0 round
    with requests since the EMAs last moved — not idle rounds, and a report without checks moves
    nothing (its rounds carry over); after a report the count starts again."""
    cfg = AdaptiveConfig(policy="goodput", candidate_steps=[0, 1], initial_steps=0,
                         warmup_batches=1000, ema_alpha=0.5, round_cost={"0": 1.0, "1": 1e9},
                         reset_nats=0.0)   # the alpha rules alone
    ctl = RoundCoordinator(cfg, Group.single())
    ctl.begin_round(RoundReport(2))
    ctl.end_round([0, 0])                               # 1 round unobserved
    ctl.begin_round(RoundReport(0))
    ctl.end_round([])                                   # idle: not counted
    ctl.begin_round(RoundReport(2))
    ctl.end_round([0, 0], shadow=(0, 0, 0))             # no checks: nothing moves; 2 rounds
    assert (ctl.ema, ctl.ema_fail, ctl.weight) == (0.0, 1.0, 0)
    ctl.begin_round(RoundReport(2))
    ctl.end_round([0, 0], shadow=(4, 4, 1))             # 3 rounds of share 1
    assert (ctl.ema, ctl.ema_fail, ctl.weight) == (0.875, 0.125, 1)
    ctl.begin_round(RoundReport(2))
    ctl.end_round([0, 0], shadow=(0, 4, 1))             # 1 round of share 0
    assert (ctl.ema, ctl.ema_fail, ctl.weight) == (0.4375, 0.5625, 2)
    assert ctl.stats.shadow_rounds == 2


def test_goodput_with_shadow_checks_follows_the_single_process_reference():
    """A long random run at depth 0 and above, with shadow reports on some depth-0 rounds (as the
    engine's catch-up gives them), none on some (between catch-ups) and on the others the
    replay's (one check per request), decided as the independent reference decides."""
    import random

    from adaptive_dist.replay import shadow_checks
    from consensus_reference import simulate

    rng = random.Random(5)
    cfg = AdaptiveConfig(policy="goodput", candidate_steps=[0, 1, 3, 7], initial_steps=1,
                         warmup_batches=2, update_interval=2, probe_every=3,
                         ema_alpha=0.3, round_cost={"0": 1.0, "1": 1.3, "3": 1.9, "7": 3.1})
    trace = []
    for r in range(400):
        level = 0 if (r // 60) % 2 == 0 else 6
        width = rng.randint(1, 4) if r % 3 else rng.randint(8, 16)   # wide rounds: resets
        accepts = [min(rng.randint(0, 2 * level), 9) for _ in range(width)]
        item = {"accept": accepts}
        if r % 4 == 3:
            checks = 7 * len(accepts)
            hits = sum(rng.random() < level / 7 for _ in range(checks))
            item["shadow"] = [hits, checks, len(accepts)]
        elif r % 4 < 2 and (r // 60) % 3:
            item["shadow"] = None                        # between two catch-ups
        trace.append(item)
    expected = simulate([trace], cfg.to_dict(), "goodput")
    ctl = RoundCoordinator(cfg, Group.single())
    got = []
    for r, item in enumerate(trace):
        plan = ctl.begin_round(RoundReport(len(item["accept"])))
        if r:
            d = ctl.last_outcome.decision
            got[-1].update(switched=d.switched, probe=d.probe, accept_rate=d.accept_rate)
        got.append({"round": r, "steps": plan.steps})
        if "shadow" in item and plan.steps == 0:
            shadow = tuple(item["shadow"]) if item["shadow"] is not None else None
        else:
            shadow = shadow_checks(item["accept"], plan.steps)
        ctl.end_round([min(a, plan.steps) for a in item["accept"]], shadow=shadow)
    ref = [{"round": e["round"], "steps": e["steps"], "switched": e["switched"],
            "probe": e["probe"], "accept_rate": e["accept_rate"]} for e in expected]
    assert got[:-1] == ref[:-1]
    assert ctl.stats.shadow_rounds > 10 and ctl.stats.switches > 4 and ctl.stats.resets > 2
    assert any(e["switched"] and e["steps"] == 0 and not e["probe"] for e in ref)


def test_goodput_descends_straight_to_zero():
    """Candidates [0, 1, 3] at costs 1 / 1.25 / 1.5, starting at 3 (EMA 2.0, ema_fail 1.0),
    alpha 0.9, a decision every round, margin 0; every request rejects at once.
      r0 at 3 [0, 0]: ema 0.2, fail 1.0 -> p 1/6: s0 1, s1 (7/6)/1.25 = 0.9333,
         s3 (1 + 1/6 + 1/36 + 1/216)/1.5 = 0.7994 -> best 0: straight to 0 (no stop at 1; the
         `zero_via_smallest` stop was removed by issue 26: it moved no goal row)."""
    cfg = AdaptiveConfig(policy="goodput", candidate_steps=[0, 1, 3], initial_steps=3,
                         ema_alpha=0.9, warmup_batches=0, update_interval=1, switch_margin=0.0,
                         probe_every=50, round_cost={"0": 1.0, "1": 1.25, "3": 1.5},
                         reset_nats=0.0)
    ctl = RoundCoordinator(cfg, Group.single())
    steps, rates = [], []
    for _ in range(4):
        plan = ctl.begin_round(RoundReport(2))
        steps.append(plan.steps)
        if ctl.last_outcome is not None:
            rates.append(ctl.last_outcome.decision.accept_rate)
        ctl.end_round([0, 0])
    assert steps == [3, 0, 0, 0]
    assert rates[0] == pytest.approx(1 / 6)


@pytest.mark.parametrize("requests,reset_nats,want", [
    (5, 8.0, (1, 0.0, 1.0, 1)),        # 5·ln 7 = 9.73 nats > 8: the EMAs restart, p 0 -> to 1
    (4, 8.0, (7, 4.5, 1.0, 0)),        # 4·ln 7 = 7.78 nats: the alpha update, p 0.818 -> stays
    (5, 0.0, (7, 4.5, 1.0, 0)),        # the reset off: the alpha update
])
def test_goodput_surprise_restarts_the_emas(requests, reset_nats, want):
    """Candidates [1, 7] at costs 1 / 2, starting at 7, alpha 0.25, a decision every round,
    margin 0. Round 0: every request accepts 6 of 7 (mean 6, all reject one): with the reset on,
    the first measurement replaces the start values (ema 6, fail 1: p 6/7, which the start
    values happened to be already, so both runs go on from the same EMAs); s7 > s1 -> stays.
    Round 1: every request rejects its first draft token.
    A reset leaves ema 0, fail 1 (the round alone): p 0, s1 = 1 > s7 = 0.5 -> depth 1.
    Without: ema 0.75·6 = 4.5, fail 0.75·1 + 0.25·1 = 1.0, p 4.5/5.5 = 0.818:
    s7 = (1 + Σ_{k=1..7} p^k)/2 = 2.20 > s1 = 1.818 -> stays at 7."""
    cfg = AdaptiveConfig(policy="goodput", candidate_steps=[1, 7], initial_steps=7, ema_alpha=0.25,
                         warmup_batches=0, update_interval=1, switch_margin=0.0,
                         round_cost={"1": 1.0, "7": 2.0}, reset_nats=reset_nats)
    ctl = RoundCoordinator(cfg, Group.single())
    assert ctl.begin_round(RoundReport(requests)).steps == 7
    ctl.end_round([6] * requests)
    assert (ctl.ema, ctl.ema_fail) == (6.0, 1.0)
    assert ctl.begin_round(RoundReport(requests)).steps == 7
    ctl.end_round([0] * requests)
    ema, fail = ctl.ema, ctl.ema_fail
    plan = ctl.begin_round(RoundReport(requests))
    steps, want_ema, want_fail, resets = want
    assert plan.steps == steps
    assert (ema, fail) == (pytest.approx(want_ema), pytest.approx(want_fail))
    assert ctl.stats.resets == resets + (reset_nats > 0)   # + the first measurement
    if steps == 7:
        assert ctl.last_outcome.decision.accept_rate == pytest.approx(4.5 / 5.5)


def test_goodput_first_measurement_replaces_the_start_values():
    """With the reset on, a rank's first measurement — a round's accepts, or at depth 0 a shadow
    report — sets the EMAs alone (α = 1); the start values are placeholders. By hand:
    start at 3 (ema 2, fail 1), alpha 0.25, round [1, 3] at depth 3 (surprise: A 4, F 1, r 0.8
    against p 2/3: 0.4 nats): on -> ema 2.0, fail 0.5; off -> ema 0.75·2 + 0.25·2 = 2.0,
    fail 0.75 + 0.125 = 0.875. Start at 0 (ema 0, fail 1), three depth-0 rounds, then a report
    of 3 hits in 4 checks: on -> ema 0.75, fail 0.25; off -> three updates with h 0.75:
    ema 0.75·(1 - 0.75³) = 0.43359375, fail 0.75³ + 0.25·(1 - 0.75³) = 0.56640625."""
    for reset_nats, want in ((8.0, (2.0, 0.5)), (0.0, (2.0, 0.875))):
        ctl = RoundCoordinator(AdaptiveConfig(
            policy="goodput", candidate_steps=[0, 1, 3], initial_steps=3, ema_alpha=0.25,
            round_cost={"0": 1.0, "1": 1.2, "3": 1.5}, reset_nats=reset_nats), Group.single())
        ctl.begin_round(RoundReport(2))
        ctl.end_round([1, 3])
        assert (ctl.ema, ctl.ema_fail) == want and ctl.stats.resets == (reset_nats > 0)
        ctl.begin_round(RoundReport(2))
        ctl.end_round([3, 3])       # no longer the first, no surprise: the alpha update
        assert ctl.ema == pytest.approx(0.75 * want[0] + 0.25 * 3)
    for reset_nats, want in ((8.0, (0.75, 0.25)), (0.0, (0.43359375, 0.56640625))):
        ctl = RoundCoordinator(AdaptiveConfig(
            policy="goodput", candidate_steps=[0, 1], initial_steps=0, ema_alpha=0.25,
            warmup_batches=1000, round_cost={"0": 1.0, "1": 1.2}, reset_nats=reset_nats),
            Group.single())
        for shadow in (None, None, (3, 4, 2)):
            ctl.begin_round(RoundReport(2))
            ctl.end_round([0, 0], shadow=shadow)
        assert (ctl.ema, ctl.ema_fail) == (pytest.approx(want[0]), pytest.approx(want[1]))
        assert ctl.stats.resets == (reset_nats > 0)
