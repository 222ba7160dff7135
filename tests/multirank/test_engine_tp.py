"""Tensor parallelism: tp=2 (two spawned gloo ranks on CPU) generates what tp=1 generates.

The same checkpoint is loaded sharded over the TP group (each rank reads its slices); both ranks
run the same requests and must return identical tokens, equal to the single-process run: greedy
without speculation, at a static tier and adaptive, and through the `generate` command itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch

from adaptive_dist.config import AdaptiveConfig
from engine_fixtures import engine_for, random_prompts, save_pair, tiny_config, tiny_pair
from multirank import run_ranks
from workers.model import ModelParallel, load_eagle, load_llama
from workers.sampling import SamplingParams

pytestmark = pytest.mark.multirank

MODES = [("nospec", None), ("static", None), ("ema", AdaptiveConfig(warmup_batches=1, update_interval=1))]
PARAMS = SamplingParams(max_new_tokens=24)


def _generate_all(target, head, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    out = {}
    for mode, cfg in MODES:
        engine = engine_for(target, head, mode, steps=3, config=cfg)
        out[mode] = [r.output_ids for r in engine.generate(prompts, PARAMS)]
    return out


def tp_engine_job(rank: int, model_dir: str, prompts: list[list[int]]) -> dict:
    """One TP rank: load its shards (float64) and run every mode."""
    from collectives import init_distributed

    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=60.0, record=False)
    try:
        par = ModelParallel.from_layout(ctx.layout(dp=1))
        target = load_llama(Path(model_dir) / "target", par=par, dtype=torch.float64)
        head = load_eagle(Path(model_dir) / "eagle", target)
        local = target.model.layers[0].self_attn.q_proj.weight.shape[0]
        return {"tp_size": par.attn.size, "q_rows": local,
                "outputs": _generate_all(target, head, prompts)}
    finally:
        ctx.shutdown()


def tp_cli_job(rank: int, model_dir: str) -> str:
    """One TP rank running the `generate` command; returns its stdout."""
    from workers.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["generate", "--prompt", "def f(x):", "--adaptive", "--tp", "2",
                     "--max-new-tokens", "16", "--json", "--model", model_dir])
    assert code == 0
    return buf.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    cfg = dataclasses.replace(tiny_config(vocab=264, eos=257), bos_token_id=256)
    return save_pair(*tiny_pair(seed=6, cfg=cfg), tmp_path_factory.mktemp("tp_pair"))


def test_tp2_equals_tp1_greedy(model_dir: Path) -> None:
    prompts = random_prompts(6, 256, seed=8)
    target = load_llama(model_dir / "target", dtype=torch.float64)
    reference = _generate_all(target, load_eagle(model_dir / "eagle", target), prompts)
    results = run_ranks(tp_engine_job, 2, str(model_dir), prompts, timeout=120)
    for res in results:
        assert res.value["tp_size"] == 2
        assert res.value["q_rows"] == target.model.layers[0].self_attn.q_proj.weight.shape[0] // 2
        for mode in reference:
            assert res.value["outputs"][mode] == reference[mode], f"rank {res.rank}, {mode}"


def test_generate_command_under_tp2(model_dir: Path, capsys) -> None:
    from workers.cli import main

    assert main(["generate", "--prompt", "def f(x):", "--adaptive", "--max-new-tokens", "16",
                 "--json", "--model", str(model_dir)]) == 0
    single = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results = run_ranks(tp_cli_job, 2, str(model_dir), timeout=120)
    printed = json.loads(results[0].value.strip().splitlines()[-1])
    assert printed["outputs"][0]["token_ids"] == single["outputs"][0]["token_ids"]
    assert results[1].value == "", "only rank 0 prints"
