"""A rank that meets a request it cannot run refuses that request and keeps serving.

The HTTP frontend refuses these requests first (test_serve_robust.py); here the test is the
frontend and PUSHes them to the rank's real inbox, so only the rank's own check stands between
them and the engine round (a seed past int64, for one, raised inside the round and ended the
rank). One process; tests/multirank/test_serve_cluster.py runs the same on two ranks."""
from __future__ import annotations

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
    check_outcomes(value["outcomes"], offline_greedy([PROMPTS[0]], 8)[0])
    assert len(value["refusals"]) == len(BAD_GENERATES)
