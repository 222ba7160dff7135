"""The reduced consensus round (issue 27): one all-reduce of sums and maxima instead of the
all-gather of every rank's vector, with exact sums, the same decisions and the same error
messages as the gather scheme (``RoundCoordinator(scheme="gather")``)."""
from __future__ import annotations

import dataclasses
import functools
import math
import random

import pytest

from adaptive_dist import consensus
from adaptive_dist.config import AdaptiveConfig
from adaptive_dist.policy import depth_policy
from adaptive_dist.policy.reducers import exact_sum
from consensus_reference import adversarial_traces, reduced_vector, simulate, write_traces
from multirank import run_ranks


# ------------------------------------------------------------------ exact sums, no processes
def _floats(rng: random.Random, n: int) -> list[float]:
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.1:
            out.append(rng.choice([0.0, 5e-324, 2.5e-310, 1e-300, -3e-320]))
        elif kind < 0.2:
            out.append(0.8 ** rng.randint(200, 3000))       # a decayed EMA
        else:
            out.append(rng.choice([1, -1]) * rng.random() * 10 ** rng.randint(-12, 12))
    return out


def _summed(terms: list[float]) -> float:
    acc = [0] * consensus.LIMBS
    for t in terms:
        one = [0] * consensus.LIMBS
        assert consensus.put_fixed(t, one, 0)
        acc = [a + b for a, b in zip(acc, one)]
    return consensus.get_fixed(acc)


@pytest.mark.parametrize("seed", range(20))
def test_fixed_point_sum_is_the_exactly_rounded_sum(seed):
    rng = random.Random(seed)
    terms = _floats(rng, rng.randint(1, 64))
    want = exact_sum(terms)
    assert _summed(terms) == want and math.copysign(1, _summed(terms)) == math.copysign(1, want)
    rng.shuffle(terms)
    assert _summed(terms) == want
    # rounding ties and cancellation: 1 + 2^-53 (a tie, to even), 1e16 + 1 - 1e16
    for case in ([1.0, 2.0 ** -53], [1.0, 2.0 ** -53, 2.0 ** -106], [1e16, 1.0, -1e16],
                 [0.1] * 10, [3 * 0.1, -0.3]):
        assert _summed(case) == exact_sum(case)


def test_fixed_point_refuses_what_does_not_fit():
    out = [0] * consensus.LIMBS
    assert not consensus.put_fixed(float("inf"), out, 0)
    assert not consensus.put_fixed(2.0 ** 90, [0] * consensus.LIMBS, 0)
    assert consensus.put_fixed(2.0 ** 80, [0] * consensus.LIMBS, 0)


def test_float_keys_keep_the_order():
    xs = sorted(_floats(random.Random(3), 200) + [-1.0, -0.5, 0.0, 2.0])
    keys = [consensus.float_key(x) for x in xs]
    assert keys == sorted(keys)
    assert all(consensus.key_float(k) == x for k, x in zip(keys, xs))


def _vectors(rng: random.Random, world: int) -> list[consensus.RoundVector]:
    out = []
    for _ in range(world):
        w = rng.choice([0, 0, 1, 3, 17, 250])
        out.append(consensus.RoundVector(
            round=9, n_req=rng.randint(0, 70), num_tokens=rng.randint(0, 900),
            n_extend=rng.randint(0, 5), can_graph=rng.random() > 0.2, done=rng.random() > 0.7,
            seq=rng.randint(0, 40), leave=rng.random() > 0.9, prev_n_req=rng.randint(0, 9),
            ema=rng.choice([rng.random() * 7, 0.0, 0.8 ** 900, 2.0]),
            weight=w, steps=3, counted=4, last_switch=-1, config_hash=0xABCDEF123456,
            prev_plan_hash=0x123, ema_fail=rng.choice([rng.random(), 0.0, 0.8 ** 400]),
            period=rng.choice([-1.0, rng.random() / 100]), extend_len=rng.randint(0, 300)))
    return out


def _policy_layout(reducer: str, policy: str, n_values: int = 0):
    """The configuration, policy and reduced layout of `policy` with `reducer` (goodput with a
    round cost over depths 0, 1, 3, 7)."""
    extra = {"round_cost": {"0": 1.0, "1": 1.2, "3": 1.6, "7": 2.4},
             "candidate_steps": [0, 1, 3, 7]} if policy == "goodput" else {}
    cfg = AdaptiveConfig.from_dict({"policy": policy, "reducer": reducer, **extra})
    pol = depth_policy(cfg)
    mixes = pol.reducer.mixes
    layout = consensus.ReducedLayout(pol.reducer.needs, cfg.candidate_steps if mixes else (),
                                     pol.expected if mixes else None, n_values)
    return cfg, pol, layout


@pytest.mark.parametrize("reducer,policy", [("weighted_mean", "ema"), ("min", "ema"),
                                            ("max", "goodput"), ("mixture", "goodput"),
                                            ("weighted_mean", "goodput")])
@pytest.mark.parametrize("world", [1, 2, 5, 16])
def test_reduced_round_equals_the_gathered_one(reducer, policy, world):
    """The reduction of the encoded vectors (summed and maxed here in Python, any order)
    decodes to the very ClusterRound the gathered matrix gives, bit for bit."""
    cfg, pol, layout = _policy_layout(reducer, policy)
    rng = random.Random(world * 7 + len(reducer))
    for _ in range(30):
        vecs = _vectors(rng, world)
        enc = [layout.encode(v) for v in vecs]
        rng.shuffle(enc)
        red = [sum(col) for col in zip(*(e[:layout.n_sum] for e in enc))] + \
              [max(col) for col in zip(*(e[layout.n_sum:] for e in enc))]
        assert layout.agreed(red)
        got = layout.decode(red)
        want = consensus.ClusterRound.from_matrix([v.row() for v in vecs], pol.pooled)
        assert dataclasses.replace(got, pooled=None) == dataclasses.replace(want, pooled=None)
        assert (got.pooled is None) == (want.pooled is None)
        if got.pooled is not None:   # every field the reducer reads
            read = ("live", "weight", "mix") + pol.reducer.needs
            assert [getattr(got.pooled, f) for f in read] == \
                [getattr(want.pooled, f) for f in read]   # the policy reads the same values
            assert pol.reducer.ema(got.pooled) == pol.reducer.ema(want.pooled)
            assert pol.reducer.rate(got.pooled) == pol.reducer.rate(want.pooled)


def test_a_disagreeing_field_fails_the_check():
    cfg = AdaptiveConfig()
    pol = depth_policy(cfg)
    layout = consensus.ReducedLayout(pol.reducer.needs)
    vecs = _vectors(random.Random(1), 3)
    for field in consensus.MUST_AGREE[1:]:
        bad = list(vecs)
        bad[1] = dataclasses.replace(bad[1], **{field: getattr(bad[1], field) + 1})
        enc = [layout.encode(v) for v in bad]
        red = [sum(c) for c in zip(*(e[:layout.n_sum] for e in enc))] + \
              [max(c) for c in zip(*(e[layout.n_sum:] for e in enc))]
        assert not layout.agreed(red), field


_ODD = [0.0, -0.0, 5e-324, -5e-324, 2.5e-310, 2.2250738585072014e-308, 1e-300, 2.0 ** 85,
        -(2.0 ** 85), 2.0 ** 86, 1e30, float("inf"), float("-inf"), float("nan")]


def _any_float(rng: random.Random) -> float:
    kind = rng.random()
    if kind < 0.2:
        return rng.choice(_ODD)
    if kind < 0.4:
        return rng.uniform(-1, 1) * 2.0 ** rng.randint(-1074, 90)
    return rng.random() * rng.choice([1, 7, 100])


@pytest.mark.parametrize("reducer,policy", [("weighted_mean", "ema"), ("min", "ema"),
                                            ("mixture", "goodput"), ("max", "goodput")])
@pytest.mark.parametrize("n_values", [0, 6])
def test_encoder_gives_the_field_by_field_vector(reducer, policy, n_values):
    """The tuned encoder (issue 37) against the vector written out field by field
    (``consensus_reference.reduced_vector``) on random vectors — odd floats (±0, subnormals,
    terms past 2^86, non-finite: the inexact flag) included — the same integers in the same
    places; and the reduction of several of them reads back the sums ``exact_sum`` gives."""
    cfg, pol, layout = _policy_layout(reducer, policy, n_values)
    rng = random.Random(len(reducer) * 10 + n_values)
    for _ in range(400):
        vec = consensus.RoundVector(
            round=rng.randrange(1 << 20), n_req=rng.randrange(300), num_tokens=rng.randrange(9000),
            n_extend=rng.randrange(9), can_graph=rng.random() < 0.5, done=rng.random() < 0.5,
            seq=rng.randrange(1 << 30), leave=rng.random() < 0.5, prev_n_req=rng.randrange(300),
            ema=_any_float(rng), weight=rng.choice([0, 0, 1, 3, 17, 1 << 30]),
            steps=rng.choice(cfg.candidate_steps), counted=rng.randrange(1000),
            last_switch=rng.randrange(-1, 1000), config_hash=rng.randrange(1 << 48),
            prev_plan_hash=rng.randrange(1 << 48), ema_fail=_any_float(rng),
            period=rng.choice([-1.0, 0.004, _any_float(rng)]), extend_len=rng.randrange(500),
            tokens=rng.randrange(64), values=tuple(rng.randrange(1 << 40) for _ in range(n_values)))
        got, want = layout.encode(vec), reduced_vector(layout, vec)
        assert got == want and all(type(x) is int for x in got), vec
        # the coordinator's encoder, from the round's fields (no RoundVector): the same list
        fields = layout.encode_round(
            vec.n_req, vec.num_tokens, vec.n_extend, vec.extend_len, vec.can_graph, vec.done,
            vec.seq, vec.leave, vec.prev_n_req, vec.ema, vec.ema_fail, vec.weight, vec.period,
            (vec.round, vec.steps, vec.tokens, vec.counted, vec.last_switch, vec.config_hash,
             vec.prev_plan_hash), vec.values)
        assert fields == want, vec
    # the sums read back: terms over the whole exponent range, summed over a few ranks
    for _ in range(300):
        terms = [_any_float(rng) for _ in range(rng.randint(1, 6))]
        terms = [t for t in terms if math.isfinite(t) and abs(t) < 2.0 ** 86]
        acc = [0] * consensus.LIMBS
        for t in terms:
            one = [0] * consensus.LIMBS
            assert consensus.put_fixed(t, one, 0)
            acc = [a + b for a, b in zip(acc, one)]
        want = exact_sum(terms) if terms else 0.0
        got = consensus.get_fixed(acc)
        assert got == want and math.copysign(1, got) == math.copysign(1, want), terms


def test_a_field_that_is_no_int64_is_refused():
    """The channel packs the vector as int64s: a value past int64 or not an integer is a
    ValueError naming the round, not a wrapped or truncated integer."""
    from collectives import Group

    layout = consensus.ReducedLayout(("ema_sum", "fail_sum"), n_values=2)
    channel = consensus.ReduceChannel(Group.single(), layout, "doubling")
    vec = _vectors(random.Random(2), 1)[0]
    vec = dataclasses.replace(vec, values=(1, 2))
    assert channel.reduce(vec) == layout.encode(vec)          # a group of one: its own vector
    for bad in ({"values": (1, 2.5)}, {"seq": 1 << 64}):
        with pytest.raises(ValueError, match="round vector of round 9: a field is not an integer"):
            channel.reduce(dataclasses.replace(vec, **bad))


def test_draft_counts_are_the_per_token_counts():
    """``RoundStats.count_drafts`` (a tally per round since issue 37) against the counts taken
    one accepted token at a time, over rounds of every depth, with and without budgets."""
    from adaptive_dist.coordinator import RoundStats

    rng = random.Random(11)
    stats = RoundStats()
    drafts = draft_tokens = accepted = 0
    per_pos: list[int] = []
    for _ in range(2000):
        steps = rng.choice([0, 1, 3, 7])
        accepts = [rng.randint(0, steps) for _ in range(rng.randrange(40))]
        budgets = None
        if rng.random() < 0.5:
            budgets = [rng.choice([0, steps, a]) for a in accepts]
            accepts = [min(a, d) for a, d in zip(accepts, budgets)]
        stats.count_drafts(accepts, steps, budgets)
        if steps <= 0 or not accepts:
            continue
        per_pos += [0] * (steps - len(per_pos))
        for a, d in zip(accepts, budgets or [steps] * len(accepts)):
            if d > 0:
                drafts, draft_tokens, accepted = drafts + 1, draft_tokens + d, accepted + a
                for i in range(a):
                    per_pos[i] += 1
        assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens,
                stats.accepted_per_pos) == (drafts, draft_tokens, accepted, per_pos)


# -------------------------------------------------------------------------- real gloo ranks
def sum_max_job(rank: int, values: list[list[int]], n_sum: int, algorithm: str) -> dict:
    import torch
    import collectives as C

    ctx = C.init_distributed(timeout_s=20.0, record=True, keep_log=True)
    world = ctx.layout().group("world")
    t = torch.tensor(values[rank], dtype=torch.int64)
    C.ops.all_reduce_sum_max(t, world, n_sum, algorithm)
    log = [e.signature() for e in ctx.recorder.log]
    ctx.shutdown()
    return {"out": t.tolist(), "log": log}


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("algorithm", ["doubling", "gloo"])
def test_sum_max_all_reduce(world, algorithm):
    rng = random.Random(world)
    values = [[rng.randint(-2 ** 40, 2 ** 40) for _ in range(9)] for _ in range(world)]
    want = [sum(c) for c in zip(*(v[:4] for v in values))] + \
           [max(c) for c in zip(*(v[4:] for v in values))]
    results = run_ranks(sum_max_job, world, values, 4, algorithm, timeout=90)
    assert all(r.value["out"] == want for r in results)
    assert all(r.value["log"] == [("all_reduce.sum_max." + algorithm + ".control", "world",
                                   (9,), "int64")] for r in results)


def scheme_replay_job(rank: int, trace_dir: str, cfg_dict: dict, policy: str,
                      scheme: str) -> dict:
    """``rank_jobs.replay_job`` with the coordinator's consensus scheme chosen."""
    import adaptive_dist.replay as replay_mod
    from adaptive_dist.coordinator import RoundCoordinator
    import rank_jobs

    replay_mod.RoundCoordinator = functools.partial(RoundCoordinator, scheme=scheme)
    return rank_jobs.replay_job(rank, trace_dir, cfg_dict, policy)


GOODPUT_MIX = {"policy": "goodput", "reducer": "mixture", "candidate_steps": [0, 1, 3, 7],
               "initial_steps": 1, "ema_alpha": 0.4, "warmup_batches": 1, "update_interval": 2,
               "probe_every": 3, "round_cost": {"4": {"0": 1.0, "1": 1.25, "3": 1.6, "7": 2.4},
                                                "32": {"0": 2.0, "1": 2.6, "3": 3.6, "7": 6.0}}}


@pytest.mark.multirank
@pytest.mark.parametrize("policy,cfg,world", [("ema", {}, 3), ("goodput", GOODPUT_MIX, 5)])
def test_both_schemes_give_the_reference(tmp_path, policy, cfg, world):
    traces = adversarial_traces(world, rounds=120, seed=world)
    write_traces(traces, tmp_path)
    cfg = AdaptiveConfig.from_dict({**cfg, "policy": policy}).to_dict()
    expected = simulate(traces, cfg, policy)
    logs = {}
    for scheme in ("reduce", "gather"):
        results = run_ranks(scheme_replay_job, world, str(tmp_path), cfg, policy, scheme,
                            timeout=180)
        merged = sorted((rec for r in results for rec in r.value["records"]),
                        key=lambda x: (x["round"], x["rank"]))
        assert merged == expected, scheme
        logs[scheme] = results[0].value["log"]
        assert all(r.value["log"] == logs[scheme] for r in results)
    # one collective per round either way: the reduction replaced the gather one for one
    ops = {s: [op for op, *_ in log if not op.startswith("all_gather.guard")]
           for s, log in logs.items()}
    # (one host: the default transport is shared memory, issue 37)
    assert ops["reduce"].count("all_reduce.sum_max.shm.control") == \
        ops["gather"].count("all_gather.control") > 100
    assert "all_gather.control" not in ops["reduce"]
