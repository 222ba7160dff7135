"""Data-parallel ranks with different workloads stay in lockstep: an idle rank keeps joining the
round's consensus until every rank is done (real gloo process groups, 2 ranks)."""
from __future__ import annotations

import pytest

from engine_fixtures import engine_for, random_prompts, tiny_pair
from multirank import run_ranks
from workers.sampling import SamplingParams
import rank_jobs

pytestmark = pytest.mark.multirank


def test_ranks_with_different_work_finish_together_and_lose_nothing():
    prompts = [random_prompts(2, 64, seed=1), random_prompts(3, 64, seed=2)]
    new_tokens = [4, 40]  # rank 0 runs out of work long before rank 1
    res = [r.value for r in run_ranks(rank_jobs.dp_engine_job, 2, prompts, new_tokens,
                                      timeout=120)]
    # every rank ran the same rounds and made the same decisions
    assert res[0]["rounds"] == res[1]["rounds"] and res[0]["digest"] == res[1]["digest"]
    assert res[0]["timeline"] == res[1]["timeline"]
    # and each rank's outputs equal plain greedy decoding of its own prompts
    target, head = tiny_pair(seed=0)
    for rank in range(2):
        ref = engine_for(target, head, "nospec").generate(
            prompts[rank], SamplingParams(max_new_tokens=new_tokens[rank]))
        assert res[rank]["outputs"] == [r.output_ids for r in ref]


def test_graph_dummy_page_is_not_counted_as_usable():
    from workers.kv_cache import KVCache, RequestTooLargeError

    cache = KVCache(1, 3, 16, 1, 8)
    cache.admit(-1, 16)   # an internal entry (the CUDA-graph runner's dummy page)
    cache.extend(-1, 16)
    assert cache.usable_pages == 2
    with pytest.raises(RequestTooLargeError, match="only 32 tokens"):
        cache.check_fits(40)  # 3 pages: the pool has 3, but one is never free
