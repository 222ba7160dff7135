"""A rank that meets a request it cannot run refuses that request and keeps serving.

The HTTP frontend refuses these requests first (test_serve_robust.py); here the test is the
frontend and PUSHes them to the rank's real inbox, so only the rank's own check stands between
them and the engine round (a seed past int64, for one, raised inside the round and ended the
rank). One process; tests/multirank/test_serve_cluster.py runs the same on two ranks."""
from __future__ import annotations

from multirank import run_ranks
from serve_helpers import BAD_GENERATES, PROMPTS, _offline_pair, drive_ranks_job, offline_greedy, \
    refusal_script
from workers.loading import encode_prompt

SERVE = ["--steps", "3", "--max-batch-size", "4", "--max-model-len", "64", "--timeout", "30"]


def check_outcomes(outcomes: dict, reference: list[int]) -> None:
    """Every bad request refused with 400 naming its field; every good one equal to the
    reference; the sampled one with the largest seed ran."""
    for i, (fields, param) in enumerate(BAD_GENERATES):
        rid = f"bad-{i}" if "rid" not in fields else repr(fields["rid"])
        kind, status, got_param, message = outcomes[rid]
        assert (kind, status, got_param) == ("refused", 400, param), (fields, outcomes[rid])
        assert message.startswith(f"{param}: ") and len(message) < 200, message
    for rid, outcome in outcomes.items():
        if rid.startswith("good-"):
            assert outcome == ("done", reference, "length" if len(reference) == 8 else "stop")
    assert outcomes["sampled"][0] == "done" and len(outcomes["sampled"][1]) >= 1


def test_one_rank_refuses_what_it_cannot_run_and_keeps_serving() -> None:
    ids = encode_prompt(PROMPTS[0], _offline_pair()[1])
    result, = run_ranks(drive_ranks_job, 1, SERVE, refusal_script(ids, 0, (0,)), timeout=240)
    value = result.value
    assert value["driver_error"] is None, value["driver_error"]
    assert value["exit"] == ("the frontend asked to stop (the test is done)", False)
    check_outcomes(value["outcomes"], offline_greedy([PROMPTS[0]], 8)[0])
    assert len(value["refusals"]) == len(BAD_GENERATES)
