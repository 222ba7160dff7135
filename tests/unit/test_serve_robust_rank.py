"""A rank that meets a request it cannot run refuses that request and keeps serving.

The HTTP frontend refuses these requests first (test_serve_robust.py); here the test is the
frontend and PUSHes them to the rank's real inbox, so only the rank's own check stands between
them and the engine round (a seed past int64, for one, raised inside the round and ended the
rank). One process; tests/multirank/test_serve_cluster.py runs the same on two ranks."""
from __future__ import annotations

import pytest

from multirank import run_ranks
from serve_helpers import (BAD_GENERATES, PROMPTS, REFUSAL_SERVE, _offline_pair, check_outcomes,
                           drive_ranks_job, offline_greedy, refusal_script)
from workers.loading import encode_prompt


def test_one_rank_refuses_what_it_cannot_run_and_keeps_serving() -> None:
    ids = encode_prompt(PROMPTS[0], _offline_pair()[1])
    result, = run_ranks(drive_ranks_job, 1, REFUSAL_SERVE, refusal_script(ids, 0, (0,)),
                        timeout=240)
    value = result.value
    assert value["driver_error"] is None, value["driver_error"]
    assert value["exit"] == ("the frontend asked to stop (the test is done)", False)
    assert value["code"] == 0
    check_outcomes(value["outcomes"], offline_greedy([PROMPTS[0]], 8)[0])
    assert len(value["refusals"]) == len(BAD_GENERATES)


def test_an_engine_refusal_fails_the_request_not_the_rank() -> None:
    """Past the value checks: `Engine.add` itself refuses (a KV pool of 3 pages, smaller than
    the context). The adapter turns that into a refusal of the request (400, nothing queued),
    and the engine serves the next request as if the refused one had never come."""
    from workers.config import EngineConfig
    from workers.engine import build_engine
    from workers.server.engine_glue import EngineAdapter, Refused
    from workers.server.protocol import Generate

    target, cfg = _offline_pair()
    engine = build_engine(EngineConfig(max_batch_size=2, max_context_len=64, num_pages=3),
                          target, None)
    adapter = EngineAdapter(engine, tuple(cfg.eos_token_ids), 0, cfg.vocab_size)
    ids = encode_prompt(PROMPTS[0], cfg)
    with pytest.raises(Refused) as info:
        adapter.add(Generate(1, "big", 0, ids, 64 - len(ids), 0.0, 1.0, 0))
    assert info.value.status == 400 and "the engine cannot run this request" in str(info.value)
    assert "KV cache" in str(info.value)
    assert not engine.scheduler.has_work and adapter.live == {}
    adapter.add(Generate(2, "small", 0, ids, 8, 0.0, 1.0, 0))
    tokens: list[int] = []
    for _ in range(40):
        adapter.step(seq=0, leave=False, pending=False)
        for delta in adapter.collect():
            tokens += delta.token_ids
        if not adapter.live:
            break
    assert tokens == offline_greedy([PROMPTS[0]], 8)[0]
