"""The serving job's secret across two real ranks (`launch.job_secret`; docs/serving.md,
"Security"): drawn by rank 0 and shared when nobody sets one; the user's own when every rank has
the same; refused on every rank, naming the variable, when the ranks disagree."""
from __future__ import annotations

import pytest

from multirank import run_ranks
from serve_helpers import secret_job
from workers.server.channel import SECRET_ENV, user_secret

SECRET = "a secret every host of the job was given"


def test_one_secret_per_job_drawn_or_given_and_disagreement_refused_on_every_rank():
    cases = [{}, {}, {0: SECRET, 1: SECRET}, {0: SECRET}, {0: SECRET, 1: SECRET + "!"}]
    rank0, rank1 = (r.value for r in run_ranks(secret_job, 2, cases, timeout=120))
    drawn, again, given, one_sided, different = zip(rank0, rank1)
    assert drawn[0]["digest"] == drawn[1]["digest"]           # rank 0's, shared
    assert again[0]["digest"] != drawn[0]["digest"]           # a fresh one each time
    assert all(v["given"] for v in given) and given[0]["control"] == given[1]["control"]
    for values, what in ((one_sided, "set on some ranks only (unset on rank(s) [1])"),
                         (different, "different values on the ranks")):
        assert list(values) == [{"error": f"{SECRET_ENV}: {what}; give every rank the same "
                                          f"secret, or none"}] * 2


def test_a_secret_too_short_to_be_one_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=f"{SECRET_ENV}: 5 characters; give at least 16"):
        user_secret()
