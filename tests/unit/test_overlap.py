"""Overlapped rounds (`EngineConfig.overlap`): round r+1 is launched before round r is read.

What must hold: the tokens are those of the serial engine (greedy and sampled: a request's draws
depend on its seed and positions only), results are read in launch order one round late, the
extra round a finished request runs stays inside the KV it reserved, and nothing is left in flight
at the end.
"""
from __future__ import annotations

import pytest

from engine_fixtures import check_pages_back, engine_for, lossless_params, random_prompts, tiny_pair
from workers.sampling import SamplingParams


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(12, vocab=64, seed=11)


def _sampled(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.9, top_p=0.9 if i % 2 else 1.0,
                           max_new_tokens=6 + 5 * (i % 4)) for i in range(n)]


@pytest.mark.parametrize("steps", [0, 3])
def test_sampled_outputs_equal_the_serial_engine(pair, prompts, steps: int) -> None:
    outs = {}
    for overlap in (False, True):
        engine = engine_for(*pair, "static" if steps else "nospec", steps=steps,
                            overlap=overlap)
        reqs = engine.generate(prompts, _sampled(len(prompts)), seed=5)
        outs[overlap] = [r.output_ids for r in reqs]
        assert engine._launched is None
        check_pages_back(engine)
    assert outs[True] == outs[False]
    assert len({tuple(o) for o in outs[True]}) > len(prompts) // 2  # not a degenerate stream


class Recorder:
    """Wraps a worker's launch / collect: the order of calls, and per launch how far each
    request's KV writes reach against what it reserved."""

    def __init__(self, engine) -> None:
        self.engine, self.events, self.over = engine, [], []
        worker = engine.worker
        launch, collect = worker.launch, worker.collect
        page = engine.config.page_size

        def launch_(reqs, batch_pad, bucket=None, shape=None, budgets=None):
            steps = worker.steps
            for r in reqs:  # this round writes KV positions n .. n + steps
                last = int(worker.slots.cache_len[r.slot]) + steps
                self.over.append((last + 1, len(r.pages) * page,
                                  engine.config.replace(overlap=False).kv_tokens(
                                      len(r.prompt_ids), r.params.max_new_tokens)))
            handle = launch(reqs, batch_pad, bucket, shape, budgets)
            self.events.append(("launch", id(handle)))
            return handle

        def collect_(handle):
            self.events.append(("collect", id(handle)))
            return collect(handle)

        worker.launch, worker.collect = launch_, collect_


def test_rounds_are_read_one_late_in_launch_order(pair, prompts) -> None:
    engine = engine_for(*pair, "static", steps=3, overlap=True)
    rec = Recorder(engine)
    engine.generate(prompts, lossless_params(len(prompts)))
    launches = [h for kind, h in rec.events if kind == "launch"]
    collects = [h for kind, h in rec.events if kind == "collect"]
    assert collects == launches  # every round read once, in order
    # after the first launch, each read comes after the next launch: the device always has a
    # round queued while the host commits
    for i, (kind, handle) in enumerate(rec.events[1:-1], start=1):
        if kind == "collect":
            assert rec.events[i - 1][0] == "launch" and rec.events[i - 1][1] != handle


def test_serial_engine_reads_each_round_before_the_next(pair, prompts) -> None:
    engine = engine_for(*pair, "static", steps=3, overlap=False)
    rec = Recorder(engine)
    engine.generate(prompts, lossless_params(len(prompts)))
    kinds = [kind for kind, _ in rec.events]
    assert kinds == ["launch", "collect"] * (len(kinds) // 2)


def test_the_extra_round_stays_in_the_reserved_kv(pair, prompts) -> None:
    """A request that ends at its limit while others run on is in one round more than it needs;
    that round's KV writes land in pages it reserved — which the serial reservation would not
    have covered."""
    engine = engine_for(*pair, "static", steps=7, overlap=True, page_size=1)
    rec = Recorder(engine)
    params = [SamplingParams(max_new_tokens=4 + (i % 3) if i % 2 else 40)
              for i in range(len(prompts))]
    reqs = engine.generate(prompts, params)
    assert all(r.finish_reason == "length" for r in reqs)
    assert all(reach <= held for reach, held, _ in rec.over)
    assert any(reach > serial for reach, _, serial in rec.over), "the margin was never needed"
    check_pages_back(engine)


def test_overlap_needs_no_more_rounds_than_one_per_batch_turnover(pair, prompts) -> None:
    """Overlap costs at most one extra round each time the batch's last requests finish (here
    one batch of every prompt, so one round; none when the engine sees that every request of
    the round in flight may end in it), and counts only rounds with live requests."""
    counts = {}
    for overlap in (False, True):
        engine = engine_for(*pair, "static", steps=3, overlap=overlap, max_batch=16)
        engine.generate(prompts, lossless_params(len(prompts)))
        counts[overlap] = (engine.planner.round, engine.stats.rounds,
                           engine.stats.generated_tokens)
    (serial_rounds, serial_busy, serial_tokens) = counts[False]
    (rounds, busy, tokens) = counts[True]
    assert tokens == serial_tokens and busy == serial_busy
    assert serial_rounds <= rounds <= serial_rounds + 1


def test_overlap_is_part_of_the_agreed_config() -> None:
    from workers.config import EngineConfig

    a, b = EngineConfig(), EngineConfig(overlap=True)
    assert a.to_dict() != b.to_dict() and b.to_dict()["overlap"] is True
    assert b.kv_tokens(10, 20) - a.kv_tokens(10, 20) == a.max_steps + 1
    assert b.max_kv_tokens - a.max_kv_tokens == a.max_steps + 1





def test_a_round_that_may_end_every_request_is_read_before_the_next(pair, prompts) -> None:
    """Equal short budgets: every request of the round in flight may finish in it, so the engine
    reads it before planning the next and runs no round of only dropped rows."""
    counts = {}
    for overlap in (False, True):
        engine = engine_for(*pair, "static", steps=7, overlap=overlap, max_batch=16)
        engine.generate(prompts, [SamplingParams(max_new_tokens=5)] * len(prompts))
        counts[overlap] = engine.planner.round
    assert counts[True] == counts[False]
