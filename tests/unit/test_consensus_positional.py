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
    with pytest.raises(TypeError, match="15 fields"):
        consensus._new_cluster(1, 2)


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
