"""Real checkpoint layouts on spawned gloo ranks: Llama-3 / Llama / Qwen2 / Qwen3 targets with EAGLE
(the EAGLE project's layout) and EAGLE-3 heads, each rank loading its shards (the draft
vocabulary split over every rank like the target's), under ``--tp 2`` and ``--dp 2``:

- greedy speculative output equals one process's greedy output without speculation, token for
  token, at static depths and adaptive (and, under DP, with a forced tier switch every round);
  every rank made the same decisions;
- at static depths every request's accepted drafts and rounds equal one process's (a draft that
  went wrong under the split — the draft vocabulary, the d2t map, the captured layers — would show
  here even though verification keeps the output right);
- the ``generate`` command with ``--model T --draft-model D`` (a tokenizer.json target) under
  ``--dp 2`` prints one process's tokens and text.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

import dp_jobs
from engine_fixtures import engine_for, random_prompts
from model_fixtures import (
    bigram_map,
    draft_vocab,
    mixed_eps,
    oracle_head,
    oracle_target,
    random_head,
    random_target,
    target_config,
    write_checkpoint,
    write_tokenizer,
)
from multirank import run_ranks
from workers.model import load_eagle, load_llama
from workers.sampling import SamplingParams

pytestmark = pytest.mark.multirank
S = draft_vocab(64, 32)


def _write_pair(root: Path, arch: str, kind: str, fmt: str) -> Path:
    """An oracle pair (at an eps that gives every accept length) as `root/target` + `root/eagle`."""
    cfg = target_config(arch)
    f = bigram_map(64, S, identity=cfg.tie_word_embeddings)
    target = oracle_target(cfg, f, mixed_eps(arch, kind))
    write_checkpoint(target, root / "target", fmt, dtype=torch.float64)
    write_checkpoint(oracle_head(kind, target, f, S), root / "eagle", fmt, dtype=torch.float64)
    return root


def models_job(rank: int, roots: list[str], dp: int, modes: list[str],
               prompts: list[list[list[int]]], new_tokens: list[list[int]]) -> dict:
    """Every pair in `roots`, every mode, on this replica's prompts: outputs, accept lengths,
    decisions; and the shapes of this rank's shards."""
    ctx, layout, par = dp_jobs.setup(dp)
    try:
        world = layout.group("world")
        out: dict = {"replica": par.replica}
        for root in roots:
            target, head = dp_jobs.load(root, par)
            with torch.no_grad():  # collective: every rank, one row each
                draft = head.compute_logits(torch.zeros(1, head.feature_size, dtype=torch.float64))
            res: dict = {"draft_rows": tuple(draft.shape),
                         "lm_rows": tuple(getattr(head, "lm_head", target.lm_head).weight.shape)}
            for mode in modes:
                guard = ctx.guard(world, check_every=4)
                engine = dp_jobs._engine(mode, target, head, world, guard, max_batch=4, dp=dp,
                                         attn_tp=layout.attn_tp)
                mine = prompts[par.replica]
                reqs = engine.generate(mine, [SamplingParams(max_new_tokens=n)
                                              for n in new_tokens[par.replica]])
                guard.check(engine.planner.round, engine.planner.decision_digest())
                engine.close()
                guard.close()
                res[mode] = {"outputs": [r.output_ids for r in reqs],
                             "accepts": [(r.accepted, r.spec_rounds) for r in reqs],
                             "digest": engine.planner.decision_digest(),
                             "hist": dict(engine.stats.accept_histogram)}
            out[root] = res
        return out
    finally:
        ctx.shutdown()


def _single(root: Path, prompts, new_tokens, modes: list[str]) -> list[dict]:
    """One process, per replica: greedy without speculation and each static mode."""
    target = load_llama(root / "target", dtype=torch.float64)
    head = load_eagle(root / "eagle", target)
    out = []
    for mine, lens in zip(prompts, new_tokens):
        params = [SamplingParams(max_new_tokens=n) for n in lens]
        rep = {"nospec": [r.output_ids for r in engine_for(target, None, "nospec").generate(mine, params)]}
        for mode in (m for m in modes if m.startswith("static")):
            reqs = engine_for(target, head, "static", steps=int(mode[6:])).generate(mine, params)
            rep[mode] = [(r.accepted, r.spec_rounds) for r in reqs]
        out.append(rep)
    return out


def _check(results, roots: list[Path], modes: list[str], prompts, new_tokens) -> None:
    for root in roots:
        want = _single(root, prompts, new_tokens, modes)
        hist: dict[int, int] = {}
        for res in results:
            got, ref = res.value[str(root)], want[res.value["replica"]]
            assert got["draft_rows"] == (1, 64), "draft logits over the whole target vocabulary"
            for mode in modes:
                assert got[mode]["outputs"] == ref["nospec"], f"{root.name}, rank {res.rank}, {mode}"
                assert got[mode]["digest"] == results[0].value[str(root)][mode]["digest"]
                if mode in ref:
                    assert got[mode]["accepts"] == ref[mode], f"{root.name}, {mode}: acceptance"
                for k, v in got[mode]["hist"].items():
                    hist[k] = hist.get(k, 0) + v
        assert hist.get(0, 0) > 0 and sum(v for k, v in hist.items() if k >= 3) > 0, (root, hist)


PROMPTS_TP = [random_prompts(5, 64, seed=31, lo=2, hi=16)]
NEW_TP = [[20, 9, 14, 24, 6]]


def test_tp2_models_lossless(tmp_path: Path) -> None:
    pairs = [("llama3", "eagle3"), ("qwen2", "eagle"), ("qwen3", "eagle3")]
    roots = [_write_pair(tmp_path / f"{a}-{k}", a, k, fmt)
             for (a, k), fmt in zip(pairs, ["safetensors-sharded", "bin", "safetensors"])]
    modes = ["static1", "static3", "static7", "ema"]
    results = run_ranks(models_job, 2, [str(r) for r in roots], 1, modes, PROMPTS_TP, NEW_TP,
                        timeout=300)
    for res in results:
        for root in roots:
            rows = res.value[str(root)]["lm_rows"]
            assert rows[0] == (16 if "eagle3" in root.name else 32), "vocabulary split over 2"
    _check(results, roots, modes, PROMPTS_TP, NEW_TP)


# replica 0: one short request (then idle, dummy rows); replica 1: five, more than its batch of 4
PROMPTS_DP = [random_prompts(1, 64, seed=41, lo=3, hi=5), random_prompts(5, 64, seed=42, hi=14)]
NEW_DP = [[4], [22, 9, 18, 12, 16]]


def test_dp2_models_lossless_in_lockstep(tmp_path: Path) -> None:
    pairs = [("qwen3", "eagle3"), ("llama", "eagle"), ("qwen2", "eagle3")]
    roots = [_write_pair(tmp_path / f"{a}-{k}", a, k, fmt)
             for (a, k), fmt in zip(pairs, ["bin-sharded", "safetensors", "bin"])]
    modes = ["static1", "static3", "ema", "forced"]
    results = run_ranks(models_job, 2, [str(r) for r in roots], 2, modes, PROMPTS_DP, NEW_DP,
                        timeout=300)
    assert sorted(r.value["replica"] for r in results) == [0, 1]
    _check(results, roots, modes, PROMPTS_DP, NEW_DP)


# ---- the command -----------------------------------------------------------------------------------

def cli_job(rank: int, argv: list[str]) -> str:
    """One rank running `generate`; its stdout."""
    from workers.cli import main

    torch.set_num_threads(1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["generate", *argv]) == 0
    return buf.getvalue()


def test_generate_dp2_with_model_and_draft_model(tmp_path: Path, capsys) -> None:
    from workers.cli import main

    write_tokenizer(tmp_path / "target", "bytelevel", vocab=300)
    target = random_target(target_config("qwen3", vocab=320, max_pos=128), seed=5)
    head = random_head("eagle3", target, list(range(1, 320, 2)))
    write_checkpoint(target, tmp_path / "target", "safetensors-sharded")
    write_checkpoint(head, tmp_path / "draft", "bin")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in ["def f(x):", "héllo ✓ wörld", "import os", "x = ["]))
    common = ["--prompts", str(prompts), "--max-new-tokens", "10", "--json",
              "--model", str(tmp_path / "target")]
    assert main(["generate", *common, "--no-spec"]) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"]
    results = run_ranks(cli_job, 2, [*common, "--draft-model", str(tmp_path / "draft"),
                                     "--dp", "2", "--adaptive"], timeout=240)
    got = json.loads(results[0].value.strip().splitlines()[-1])
    assert [o["token_ids"] for o in got["outputs"]] == [o["token_ids"] for o in want]
    assert [o["text"] for o in got["outputs"]] == [o["text"] for o in want]
    assert [r["requests"] for r in got["dp_ranks"]] == [2, 2] and results[1].value == ""
