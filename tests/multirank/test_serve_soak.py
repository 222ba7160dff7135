"""The soak of `scripts.bench.soak`, shortened, against the `--dp 2` torchrun cluster (two engine
ranks, the frontend spawned by rank 0). After a warm-up (16 greedy requests of the longest
prompts at once, pinned to the two DP groups, then 64 of the mix), 160 requests from 16
concurrent clients, drawn at random (seeded): chat and completions, streamed or not, greedy and
sampled (random seeds, top_k, penalties), logprobs, prompts and max_tokens of random lengths,
10% of them streams the client closes after their first chunk, 5% bad requests. Every request
that was not cancelled completes, greedy ones (and sampled ones with top_k 1) with the offline
reference's tokens (the engine without speculation) and text; every bad one gets its 400 naming
the field; the server's counters agree; the KV pools are full again; resident memory of the job
after the run is within 8% of after the warm-up (the full soak: 5%); no process of the job was replaced and /health
is 200. About 30 s on the 2-core CPU machine. The full soak (2000 requests, 64 clients, the same
cluster) is `python -m scripts.bench.soak`; its figures are in docs/serving.md ("Soak")."""
from __future__ import annotations

from scripts.bench.soak import run_soak

REQUESTS = 160


def test_a_short_soak_of_the_dp2_cluster() -> None:
    report = run_soak(requests=REQUESTS, clients=16, dp=2, max_tokens=12, seed=7, warmup=64,
                      prompt_pool_size=24, progress_every=40)
    counts, checks = report["counts"], report["checks"]
    assert report["failures"] == [], report["failures"]
    assert sum(counts.values()) == REQUESTS
    assert counts.get("bad_400", 0) == report["expected_bad"] > 0, counts
    assert counts.get("cancelled", 0) > 0, counts
    assert report["exact_checked"]["greedy"] > 50, report["exact_checked"]
    assert report["server_requests_total"]["rejected"] == report["expected_bad"]
    assert report["kv_full_after"] and report["same_processes"] and report["healthy_after"]
    assert len(report["rss_mb"]["per_process"]) >= 4        # torchrun, 2 ranks, the frontend
    # the full soak holds the 5% (docs/serving.md); 160 requests after a short warm-up have been
    # seen at 2-4% on a loaded 2-core machine, so the suite keeps a margin
    assert abs(report["rss_mb"]["growth"]) <= 0.08, report["rss_mb"]
    assert all(checks.values()), checks
    assert report["passed"]
