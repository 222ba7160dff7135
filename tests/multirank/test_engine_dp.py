"""DP attention on real gloo process groups: attention data-parallel over the replicas, the MLP and
the vocabulary tensor-parallel over every rank, every forward's collectives shaped by every
replica's batch, adaptive depth in lockstep.

- the model: logits under dp 2 (and dp 2 x attn-tp 2) equal one process's, each rank loading its
  shards of one checkpoint;
- the engine: greedy outputs equal single-process greedy without speculation, token for token, at
  static depths 1/3/7, adaptive, with a forced random tier switch every round, and with draft
  trees (issue 35: top-k 2 and 4), under heterogeneous load (one replica with one short request
  that idles for many rounds, the other with many); every rank made the same decisions and
  issued the same collectives;
- the hazards, shown then caught: ranks that decide their depth alone, and an idle rank that skips
  its dummy forwards, end in an error on every rank in bounded time, never a hang; ranks started
  with different draft trees are named at start-up, before any device collective.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dp_jobs
from collectives import free_port
from engine_fixtures import engine_for, random_prompts, save_pair, tiny_config, tiny_pair
from multirank import run_ranks
from workers.model import DenseCausalAttention, load_eagle, load_llama
from workers.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny byte-vocabulary pair (4 heads, 2 KV heads, MLP 128, vocab 264) saved in float32."""
    import dataclasses

    cfg = dataclasses.replace(tiny_config(vocab=264, eos=257), bos_token_id=256)
    return save_pair(*tiny_pair(seed=3, cfg=cfg), tmp_path_factory.mktemp("dp_pair"))


def _single(model_dir: Path):
    target = load_llama(model_dir / "target", dtype=torch.float64)
    return target, load_eagle(model_dir / "eagle", target)


# Heterogeneous load: replica 0 one short request (done after a few rounds, then idle), replica 1
# five requests of varied lengths (more than the batch of 4, so one waits).
PROMPTS = [random_prompts(1, 256, seed=21, lo=3, hi=5), random_prompts(5, 256, seed=22)]
NEW = [[3], [24, 9, 30, 16, 20]]


def _reference(model_dir: Path, prompts, new_tokens) -> list[list[list[int]]]:
    target, _ = _single(model_dir)
    out = []
    for mine, lens in zip(prompts, new_tokens):
        engine = engine_for(target, None, "nospec")
        reqs = engine.generate(mine, [SamplingParams(max_new_tokens=n) for n in lens])
        out.append([r.output_ids for r in reqs])
    return out


# ---- the model ----------------------------------------------------------------------------------

@pytest.mark.parametrize("world,dp", [(2, 2), (4, 2)])
def test_dp_logits_equal_one_process(model_dir: Path, world: int, dp: int) -> None:
    """Both ways of returning MLP outputs to the replicas (reduce-scatter + all-reduce over the
    attention group, or one all-reduce over the world) give one process's logits."""
    batches = [[[5, 9, 12, 7], [1, 2, 3]], [[40, 41], [8, 8, 8, 8, 8]]]  # 7 tokens per replica
    target = load_llama(model_dir / "target")
    head = load_eagle(model_dir / "eagle", target)
    results = run_ranks(dp_jobs.logits_job, world, str(model_dir), dp, batches, timeout=120)
    attn_tp = world // dp
    for res, scatter in ((r, s) for r in results for s in ("reduce_scatter", "all_reduce")):
        v = res.value[scatter]
        seqs = batches[v["replica"]]
        ids = torch.tensor([t for s in seqs for t in s])
        pos = torch.cat([torch.arange(len(s)) for s in seqs])
        with torch.no_grad():
            hidden = target(ids, pos, DenseCausalAttention([len(s) for s in seqs]))
            feats = head(ids, hidden, pos, DenseCausalAttention([len(s) for s in seqs]))
            want, want_draft = target.compute_logits(hidden), head.compute_logits(feats)
        torch.testing.assert_close(torch.from_numpy(v["logits"]), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.from_numpy(v["draft"]), want_draft, atol=1e-5, rtol=1e-5)
        # attention split over attn_tp, the MLP and the vocabulary over the whole world
        assert v["shapes"] == {"q": (64 // attn_tp, 64), "down": (64, 128 // world),
                               "embed": (264 // world, 64)}
    assert sorted(r.value["all_reduce"]["replica"] for r in results) == \
        sorted(list(range(dp)) * attn_tp)


# ---- the engine ---------------------------------------------------------------------------------

def _check_lockstep(results: list, modes: list[str]) -> None:
    for mode in modes:
        first = results[0].value[mode]
        for res in results[1:]:
            got = res.value[mode]
            assert got["timeline"] == first["timeline"], mode
            assert got["digest"] == first["digest"] and got["rounds"] == first["rounds"], mode
            assert got["log"] == first["log"], f"{mode}: collective logs differ"


def _check_leaves_depth_0(results: list, mode: str) -> None:
    """The goodput run went to depth 0 and drafted again afterwards: the draft cache's catch-up
    (with the head's collectives) ran on every rank in the same round."""
    depths = [s for _, s in results[0].value[mode]["timeline"]]
    assert 0 in depths and any(s > 0 for s in depths[depths.index(0):]), (mode, depths)


def _check_outputs(results: list, modes: list[str], reference) -> None:
    for res in results:
        for mode in modes:
            assert res.value[mode]["outputs"] == reference[res.value["replica"]], \
                f"rank {res.rank} (replica {res.value['replica']}), {mode}"


def test_dp2_lossless_in_lockstep_under_heterogeneous_load(model_dir: Path) -> None:
    modes = ["nospec", "static1", "static3", "static7", "ema", "forced", "goodput",
             "perrequest", "nospec+overlap", "static3+overlap", "ema+overlap", "forced+overlap",
             "goodput+overlap", "perrequest+overlap", "tree3k2n6", "tree4k4n10+overlap"]
    results = run_ranks(dp_jobs.generate_job, 2, str(model_dir), 2, modes, PROMPTS, NEW,
                        timeout=240)
    _check_outputs(results, modes, _reference(model_dir, PROMPTS, NEW))
    _check_lockstep(results, modes)
    _check_leaves_depth_0(results, "goodput")
    _check_leaves_depth_0(results, "goodput+overlap")
    idle = next(r.value for r in results if r.value["replica"] == 0)
    busy = next(r.value for r in results if r.value["replica"] == 1)
    for mode in modes:  # replica 0 idled (dummy forwards) for most of the rounds
        assert idle[mode]["busy_rounds"] < busy[mode]["busy_rounds"] / 2, mode
        assert busy[mode]["rounds"] >= busy[mode]["busy_rounds"]
    forced = busy["forced"]
    assert forced["switches"] >= forced["rounds"] - 2 and len(set(
        s for _, s in forced["timeline"])) >= 3, "a switch every round"
    assert busy["static7"]["hist"].get(0, 0) > 0 and busy["static7"]["hist"].get(7, 0) > 0
    _check_per_request(busy, "perrequest")
    # the trees (draft trees, issue 35): deep paths accepted, in lockstep (checked above)
    for mode in ("tree3k2n6", "tree4k4n10+overlap"):
        assert sum(v for a, v in busy[mode]["hist"].items() if int(a) >= 2) > 0, busy[mode]
    # goodput: both ranks hold the same agreed cost table (every tier, every bucket)
    assert idle["goodput"]["round_cost"] == busy["goodput"]["round_cost"]
    assert all(set(row) == {"0", "1", "3", "7"} for row in busy["goodput"]["round_cost"].values())


def _check_per_request(busy: dict, mode: str) -> None:
    """The per-request run took several shapes and its requests drafted below the deepest."""
    run = busy[mode]
    assert len({(s, t) for s, _, t in run["shapes"]}) >= 3, run["shapes"]
    assert 0 < run["draft_tokens"] < 7 * run["drafts"], (run["draft_tokens"], run["drafts"])


def test_dp2_attn_tp2_lossless_in_lockstep(model_dir: Path) -> None:
    """Four ranks: two replicas, each splitting its attention over two ranks; replica 1 light."""
    modes = ["static3", "ema", "forced", "ema+overlap", "goodput", "perrequest", "tree3k2n6"]
    prompts, new = PROMPTS[::-1], NEW[::-1]
    results = run_ranks(dp_jobs.generate_job, 4, str(model_dir), 2, modes, prompts, new,
                        timeout=300)
    _check_outputs(results, modes, _reference(model_dir, prompts, new))
    _check_lockstep(results, modes)
    _check_leaves_depth_0(results, "goodput")


# ---- sampling stays lossless under DP ------------------------------------------------------------

def test_dp2_sampling_matches_target_distribution(tmp_path: Path) -> None:
    from sampling_reference import ALPHA, PROMPT, VOCAB, chi_square_pvalue, exact_joint

    target, head = tiny_pair(seed=2, eps=1.0, cfg=tiny_config(vocab=VOCAB, hidden=32))
    save_pair(target, head, tmp_path)
    target = load_llama(tmp_path / "target", dtype=torch.float64)
    n = 1500  # per replica
    modes = ["static3", "tree3k2n6"]   # the chain, and a sampled tree (multi-branch rejection)
    results = run_ranks(dp_jobs.generate_job, 2, str(tmp_path), 2, modes,
                        [[PROMPT] * n, [PROMPT] * n], [[3] * n, [3] * n], 1.0, 7, timeout=300)
    _check_lockstep(results, modes)
    for mode in modes:
        counts = torch.zeros(VOCAB ** 3)
        for res in results:
            for t0, t1, t2 in res.value[mode]["outputs"]:
                counts[(t0 * VOCAB + t1) * VOCAB + t2] += 1
        assert chi_square_pvalue(counts, exact_joint(target, 1.0, 1.0)) > ALPHA, mode
        # the test has power: a target 60% hotter is rejected at this sample size
        assert chi_square_pvalue(counts, exact_joint(target, 1.6, 1.0)) < ALPHA, mode


# ---- the hazards ------------------------------------------------------------------------------

def test_attn_tp_ranks_of_a_replica_pick_the_same_budgets(model_dir: Path, tmp_path: Path
                                                          ) -> None:
    """One replica over two ranks, each rank's own state (its EMAs, its clock) made different:
    the budgets read only what both ranks have (the replica's requests and their accepted
    lengths) and the agreed shape, so both ranks log the same rounds, request for request, and
    the output is plain greedy's."""
    prompts, new = [random_prompts(4, 256, seed=31)], [[18, 9, 25, 12]]
    results = run_ranks(dp_jobs.budgets_job, 2, str(model_dir), prompts, new, str(tmp_path),
                        timeout=180)
    a, b = (r.value for r in results)
    assert a["ema"] != b["ema"]                       # the local state did differ
    assert a["log"] == b["log"] and a["outputs"] == b["outputs"]
    assert a["outputs"] == _reference(model_dir, prompts, new)[0]
    drafts = {q["draft"] for rec in a["log"] if rec["kind"] == "decode" for q in rec["requests"]}
    assert len(drafts) > 1


@pytest.mark.parametrize("hazard", ["local_only", "local_shape", "skip_dummy"])
def test_hazard_raises_on_every_rank_in_bounded_time(model_dir: Path, hazard: str) -> None:
    # replica 0 repeats one token (its drafts are accepted), replica 1 random text; replica 0
    # finishes early, so with skip_dummy it stops joining the forwards replica 1 still runs
    prompts = [[[7] * 6], random_prompts(3, 256, seed=5)]
    new = [[4], [40, 40, 40]]
    results = run_ranks(dp_jobs.hazard_job, 2, str(model_dir), hazard, prompts, new, 3.0,
                        timeout=90, check=False)
    for res in results:
        assert res.ok, res.traceback
        assert res.value["raised"] in ("DivergenceError", "CollectiveTimeoutError"), res.value
        assert res.value["elapsed"] < 30
    if hazard == "local_only":  # caught at the decision point, before the forwards diverge
        for res in results:
            assert res.value["raised"] == "DivergenceError"
            assert "decisions differ" in res.value["message"], res.value["message"]
    if hazard == "local_shape":   # caught in the pre-flight of the round that would run it
        for res in results:
            assert res.value["raised"] == "DivergenceError"
            msg = res.value["message"]
            assert "pre-flight" in msg and ("tokens" in msg or "steps" in msg), msg


def test_ranks_started_with_different_trees_are_named_before_any_collective(model_dir: Path
                                                                          ) -> None:
    """A rank that would draft another tree (top-k 4, not 2): every rank refuses at start-up,
    naming the setting, before any device collective (its rows per draft step would differ)."""
    results = run_ranks(dp_jobs.tree_hazard_job, 2, str(model_dir), [(2, 6), (4, 6)],
                        timeout=90)
    for res in results:
        value = res.value
        assert value["raised"] == "ConfigMismatchError", value
        assert "--speculative-eagle-topk" in value["message"], value["message"]
        assert "--speculative-num-draft-tokens" not in value["message"], value["message"]
        assert value["device_collectives"] == 0 and value["elapsed"] < 30, value


# ---- the command --------------------------------------------------------------------------------

def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "-m", "adaptive_dist", "generate", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


def test_generate_command_dp2_equals_one_process(model_dir: Path, tmp_path: Path) -> None:
    texts = ["def f(x):", "import os", "while True:", "x = ["]
    pinned = [None, 1, 1, None]
    plain, spread = tmp_path / "plain.jsonl", tmp_path / "spread.jsonl"
    plain.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    spread.write_text("".join(json.dumps({"prompt": t, **({"dp_rank": r} if r is not None else {})})
                              + "\n" for t, r in zip(texts, pinned)))
    common = ["--max-new-tokens", "12", "--json", "--model", str(model_dir)]
    single = subprocess.run([sys.executable, "-m", "adaptive_dist", "generate", "--no-spec",
                             "--prompts", str(plain), *common], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120, cwd=ROOT)
    assert single.returncode == 0, single.stderr[-2000:]
    want = [o["token_ids"] for o in json.loads(single.stdout.strip().splitlines()[-1])["outputs"]]
    res = _torchrun(2, "--dp", "2", "--adaptive", "--prompts", str(spread), *common)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert [o["token_ids"] for o in got["outputs"]] == want
    assert [o["dp_rank"] for o in got["outputs"]] == [0, 1, 1, 1]  # pinned, else i % dp
    assert [r["requests"] for r in got["dp_ranks"]] == [1, 3]
    assert res.stdout.count('"outputs"') == 1, "only rank 0 prints"
