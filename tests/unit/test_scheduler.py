"""Continuous batching: admission by batch size and KV room, retirement, batch independence, no leaks."""
from __future__ import annotations

import random

import pytest

from engine_fixtures import check_pages_back, engine_for, random_prompts, tiny_pair
from workers.kv_cache import RequestTooLargeError
from workers.sampling import SamplingParams
from workers.scheduler import Request


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=1)


_pages_back = check_pages_back


@pytest.mark.parametrize("mode", ["nospec", "static"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_output_does_not_depend_on_the_rest_of_the_batch(pair, mode: str, temperature: float) -> None:
    """Request 0 alone, then in a batch of 6 others that come and go, gives the same tokens."""
    probe = [3, 14, 15, 9, 26]
    params = SamplingParams(temperature=temperature, max_new_tokens=30)
    alone = engine_for(*pair, mode, steps=3).generate([probe], params, seed=42)[0].output_ids
    others = random_prompts(6, 64, seed=5)
    engine = engine_for(*pair, mode, steps=3, max_batch=3)
    mixed = [others[0], others[1], probe] + others[2:]
    per = [SamplingParams(temperature=temperature, max_new_tokens=n) for n in (5, 50, 30, 9, 2, 40, 17)]
    reqs = [engine.add(ids, p, seed=(42 if ids is probe else 7 + i))
            for i, (ids, p) in enumerate(zip(mixed, per))]
    engine.run()
    assert reqs[2].output_ids == alone
    assert [len(r.output_ids) for r in reqs] == [5, 50, 30, 9, 2, 40, 17]
    _pages_back(engine)


def test_batch_never_exceeds_max_and_requests_join_between_rounds(pair) -> None:
    engine = engine_for(*pair, "static", steps=3, max_batch=2)
    reqs = [engine.add(ids, SamplingParams(max_new_tokens=10))
            for ids in random_prompts(5, 64, seed=2)]
    sizes, finished = [], []
    while engine.scheduler.has_work:
        finished += engine.step()
        sizes.append(len(engine.scheduler.running))
        if len(sizes) == 3:
            reqs.append(engine.add([1, 2, 3], SamplingParams(max_new_tokens=4)))
    assert max(sizes) == 2
    assert sorted(r.rid for r in finished) == [r.rid for r in reqs] == list(range(6))
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in reqs)
    assert not engine.live, "finished requests are not kept"
    _pages_back(engine)


def test_requests_wait_for_kv_room_then_run(pair) -> None:
    # Each request reserves 20 + 30 + 8 = 58 tokens = 15 pages of 4; the pool of 32 pages (one of
    # them the dummy page) holds two.
    engine = engine_for(*pair, "static", steps=7, max_batch=8, num_pages=32)
    prompts = random_prompts(5, 64, seed=3, lo=20, hi=20)
    for ids in prompts:
        engine.add(ids, SamplingParams(max_new_tokens=30))
    peak = 0
    while engine.scheduler.has_work:
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
        assert engine.scheduler.allocator.num_free_pages >= 0
    assert peak == 2
    assert engine.stats.generated_tokens == 30 * 5 and not engine.live
    _pages_back(engine)


def test_request_that_can_never_fit_is_refused_clearly(pair) -> None:
    engine = engine_for(*pair, "static", steps=7, num_pages=9)  # 32 tokens + the dummy page
    with pytest.raises(RequestTooLargeError, match=r"needs up to 40 tokens.*holds only 32 tokens"):
        engine.add([1] * 10, SamplingParams(max_new_tokens=22))
    assert not engine.scheduler.has_work


@pytest.mark.parametrize("prompt,max_new,match", [
    ([], 4, "prompt is empty"),
    ([5] * 512, 4, "prompt of 512 tokens is longer than the context length \\(512 tokens"),
    ([5] * 500, 20, r"prompt \(500 tokens\) \+ max_new_tokens \(20\) = 520 exceeds the context length"),
])
def test_bad_requests_are_named(pair, prompt: list[int], max_new: int, match: str) -> None:
    engine = engine_for(*pair, "nospec")
    with pytest.raises(ValueError, match=match):
        engine.add(prompt, SamplingParams(max_new_tokens=max_new))


def test_generate_validates_every_request_before_running_any(pair) -> None:
    engine = engine_for(*pair, "static", steps=3)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([[1, 2], []], SamplingParams(max_new_tokens=3))
    assert engine.stats.rounds == 0 and not engine.live


def test_every_page_back_after_many_random_requests(pair) -> None:
    rng = random.Random(9)
    engine = engine_for(*pair, "static", steps=7, max_batch=5, num_pages=60)
    reqs = []
    for step in range(60):
        if rng.random() < 0.5:
            n = rng.randint(1, 30)
            reqs.append(engine.add([rng.randrange(64) for _ in range(n)],
                       SamplingParams(max_new_tokens=rng.randint(1, 25),
                                      temperature=rng.choice([0.0, 1.0]),
                                      stop_token_ids=(45,) if rng.random() < 0.5 else ()),
                       seed=step))
        engine.step()
    engine.run()
    assert all(r.finished for r in reqs) and len(reqs) > 20 and not engine.live
    _pages_back(engine)


def test_commit_stops_at_stop_token_and_length() -> None:
    req = Request(0, [1], SamplingParams(max_new_tokens=5, stop_token_ids=(9,)))
    req.commit([4, 9, 7])
    assert req.output_ids == [4, 9] and req.finish_reason == "stop"
    req = Request(1, [1], SamplingParams(max_new_tokens=3))
    req.commit([4, 5])
    req.commit([6, 7, 8])
    assert req.output_ids == [4, 5, 6] and req.finish_reason == "length"
