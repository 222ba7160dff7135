"""consensus.frozen_positional / frozen_by_name (issue 37): decode's constructor of a ClusterRound and a Pooled gives
the instance the dataclass's own __init__ gives (equal, same repr and hash, still frozen), and
refuses a class whose __init__ does more."""
from __future__ import annotations

import dataclasses
import random

import pytest

from adaptive_dist import consensus
from adaptive_dist.consensus import ClusterRound, RoundVector, frozen_by_name, frozen_positional
from adaptive_dist.policy.reducers import Pooled


def test_positional_equals_the_dataclass_init():
    rng = random.Random(37)
    for _ in range(200):
        pooled = (rng.randrange(1, 9), rng.random() * 100, rng.random(), rng.random(),
                  rng.random(), rng.random(), rng.random(), rng.random(), rng.random(),
                  tuple((s, rng.random()) for s in range(rng.randrange(3))))
        a, b = Pooled(*pooled), consensus._new_pooled(*pooled)
        assert a == b and repr(a) == repr(b) and hash(a) == hash(b) and type(b) is Pooled
        cluster = (rng.randrange(100), rng.randrange(50), rng.randrange(9), rng.randrange(9),
                   rng.randrange(9), rng.randrange(9), rng.random() < 0.5, rng.random() < 0.5,
                   rng.randrange(-5, 5), rng.random() < 0.5, rng.randrange(50),
                   rng.random() < 0.5, rng.random(), a if rng.random() < 0.5 else None,
                   tuple(rng.randrange(1000) for _ in range(rng.randrange(4))))
        c, d = ClusterRound(*cluster), consensus._new_cluster(*cluster)
        assert c == d and repr(c) == repr(d) and hash(c) == hash(d)
        with pytest.raises(dataclasses.FrozenInstanceError):
            d.round = 1
    with pytest.raises(TypeError, match="missing 13 required positional arguments: "
                                        "'n_req_max', 'tokens_max'"):
        consensus._new_cluster(1, 2)
    with pytest.raises(TypeError, match="takes 15 positional arguments but 16"):
        consensus._new_cluster(*range(16))


def test_positional_refuses_a_class_whose_init_does_more():
    @dataclasses.dataclass(frozen=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass
    class Mutable:
        x: int

    for cls in (Checked, Mutable, int):
        with pytest.raises(TypeError, match="not a plain frozen dataclass"):
            frozen_positional(cls)
        with pytest.raises(TypeError, match="not a plain frozen dataclass"):
            frozen_by_name(cls)


def test_by_name_equals_the_dataclass_init_and_names_a_missing_field():
    make = frozen_by_name(RoundVector)
    rng = random.Random(7)
    for _ in range(100):
        kw = {f.name: rng.randrange(-9, 9) for f in dataclasses.fields(RoundVector)}
        kw.update(ema=rng.random(), ema_fail=rng.random(), period=rng.random(),
                  values=tuple(rng.randrange(99) for _ in range(rng.randrange(3))))
        a, b = RoundVector(**kw), make(**kw)
        assert a == b and repr(a) == repr(b) and hash(a) == hash(b) and a.row() == b.row()
    del kw["period"]
    with pytest.raises(TypeError, match=r"missing \['period'\]"):
        make(**kw)
    with pytest.raises(TypeError, match=r"unknown \['periods'\]"):
        make(**kw, period=0.0, periods=1.0)


def test_evolve_equals_dataclasses_replace():
    """policy.base.evolve (the round's state and estimate, issue 37) gives the instance
    ``dataclasses.replace`` gives: equal, the same repr and hash, frozen; an unknown field is
    refused as replace refuses it; a class whose __init__ does more takes replace itself."""
    from adaptive_dist.policy.base import PolicyState, RankEstimate, evolve
    from adaptive_dist.policy.goodput import GoodputEstimate, GoodputState

    rng = random.Random(38)
    for _ in range(300):
        est = RankEstimate(rng.random() * 7, rng.random(), rng.randrange(100))
        changes = {"ema": rng.random(), "weight": rng.randrange(9)}
        a, b = dataclasses.replace(est, **changes), evolve(est, **changes)
        assert a == b and repr(a) == repr(b) and hash(a) == hash(b) and type(b) is RankEstimate
        st = PolicyState(rng.randrange(3), rng.randrange(99), rng.randrange(-1, 9))
        a, b = dataclasses.replace(st, counted=st.counted + 1), evolve(st, counted=st.counted + 1)
        assert a == b and repr(a) == repr(b) and hash(a) == hash(b)
        with pytest.raises(dataclasses.FrozenInstanceError):
            b.counted = 0
    for obj in (GoodputState(1), GoodputEstimate(2.0)):      # subclasses: every field copied
        got = evolve(obj, index=0) if isinstance(obj, GoodputState) else evolve(obj, weight=3)
        want = (dataclasses.replace(obj, index=0) if isinstance(obj, GoodputState)
                else dataclasses.replace(obj, weight=3))
        assert got == want and repr(got) == repr(want) and type(got) is type(want)
    with pytest.raises(TypeError):
        evolve(RankEstimate(1.0), nope=1)

    @dataclasses.dataclass(frozen=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            if self.x < 0:
                raise ValueError("x < 0")
    assert evolve(Checked(1), x=2) == Checked(2)
    with pytest.raises(ValueError, match="x < 0"):     # replace ran, so did __post_init__
        evolve(Checked(1), x=-1)


def test_fail_ema_update_equals_the_flags_ema():
    """rules.ema_fail_update (a count in C since issue 37) is ema_update of the float flags."""
    from adaptive_dist.policy.rules import ema_fail_update, ema_update, fail_flags

    rng = random.Random(39)
    for _ in range(20000):
        steps = rng.randrange(0, 9)
        accepts = [rng.randrange(0, steps + 1) for _ in range(rng.randrange(0, 40))]
        ema_fail, alpha = rng.random(), rng.choice([0.1, 0.3, rng.random()])
        want = ema_update(ema_fail, fail_flags(accepts, steps), alpha)
        got = ema_fail_update(ema_fail, accepts, steps, alpha)
        assert got == want and type(got) is type(want), (accepts, steps)
