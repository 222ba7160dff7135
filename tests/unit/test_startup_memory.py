"""Issue 34 §1 on the CPU: `--dtype` (auto = the checkpoint's dtype on CUDA, float32 on the CPU),
the KV pool sized to `--kv-cache-memory` / `--gpu-memory-utilization` (refused by name on the
CPU), the start-up timeline (one line per step, progress of a long step, JSON events), and the
capture count the memory profile makes without capturing."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine_fixtures import engine_for, save_pair, tiny_config, tiny_pair
from workers import memory, startup_log
from workers.cli import main
from workers.loading import model_paths, resolve_dtype
from workers.worker.graph_table import GraphPhase
from workers.model.loader import checkpoint_dtype
from workers.model.weights import CheckpointError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A byte-vocabulary tiny pair (BOS 256, EOS 257) with a 96-token context."""
    cfg = dataclasses.replace(tiny_config(vocab=264, max_pos=96, eos=257), bos_token_id=256)
    return save_pair(*tiny_pair(seed=4, cfg=cfg), tmp_path_factory.mktemp("pair"))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---- dtype ------------------------------------------------------------------------------------

def test_auto_is_float32_on_the_cpu_and_the_checkpoints_dtype_on_cuda():
    paths = model_paths(None)                                  # the bundled pair: bfloat16
    assert checkpoint_dtype(paths.target) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", paths)[0] == torch.float32
    if not torch.cuda.is_available():   # on a GPU it also checks bfloat16 support
        dtype, why = resolve_dtype("auto", "cuda", paths)
        assert dtype == torch.bfloat16 and "torch_dtype" in why
    assert resolve_dtype("float16", "cpu", paths)[0] == torch.float16
    with pytest.raises(ValueError, match="--dtype half: allowed: auto, bfloat16"):
        resolve_dtype("half", "cpu", paths)


@pytest.mark.parametrize("raw, expect", [
    ({}, None), ({"torch_dtype": "float32"}, torch.float32), ({"dtype": "bfloat16"}, torch.bfloat16),
    ({"torch_dtype": "float16"}, torch.float16), ({"torch_dtype": "half"}, torch.float16)])
def test_checkpoint_dtype_reads_torch_dtype_or_dtype(tmp_path, raw, expect):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert checkpoint_dtype(tmp_path) == expect


def test_checkpoint_dtype_refuses_a_non_float_dtype_by_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "int8"}))
    with pytest.raises(CheckpointError, match="torch_dtype='int8'; allowed: bfloat16"):
        checkpoint_dtype(tmp_path)


def test_generate_on_the_cpu_runs_float32_and_prints_the_timeline(capsys, model_dir, tmp_path,
                                                                   monkeypatch):
    events = tmp_path / "startup.jsonl"
    monkeypatch.setenv(startup_log.ENV_FILE, str(events))
    code, out, err = _run(capsys, "--prompt", "def f(", "--steps", "3", "--model", str(model_dir),
                          "--max-new-tokens", "8", "--json")
    assert code == 0
    lines = [ln for ln in err.splitlines() if ln.startswith("[start-up ")]
    steps = [ln.split(" s] ", 1)[1].split(":")[0] for ln in lines]
    assert steps[:3] == ["begin", "loading", "KV pool"] and steps[-2:] == ["memory", "ready"]
    assert "depth 3" in steps and "warm-up" in steps
    assert "in float32 (--dtype auto on the CPU)" in err
    got = [json.loads(x) for x in events.read_text().splitlines()]
    assert [e["step"] for e in got if "step" in e] == steps
    kv = next(e for e in got if e.get("step") == "KV pool")
    assert kv["source"] == "batch" and kv["tokens"] > 0
    assert all("rss" in e["memory"] for e in got if "memory" in e)


def test_generate_with_explicit_dtype_names_it(capsys, model_dir):
    code, _, err = _run(capsys, "--prompt", "def f(", "--no-spec", "--model", str(model_dir),
                        "--max-new-tokens", "4", "--dtype", "bfloat16")
    assert code == 0 and "in bfloat16 (--dtype bfloat16)" in err


# ---- the KV pool ------------------------------------------------------------------------------

def test_page_bytes_is_what_the_worker_allocates():
    target, head = tiny_pair(seed=1, dtype=torch.float32)
    for mode, h in (("nospec", None), ("static", head)):
        engine = engine_for(target, h, mode, max_batch=3)
        models = engine.worker.models
        pools = models.target_kv.nbytes + (models.draft_kv.nbytes if models.draft_kv else 0)
        per_page = memory.page_bytes(target, h, engine.config.page_size, "torch")
        assert per_page * engine.config.pool_pages == pools
        assert memory.need_pages(engine.config) == engine.config.pool_pages


def test_kv_cache_memory_sizes_the_pool_caps_it_and_refuses_too_little():
    target, head = tiny_pair(seed=1, dtype=torch.float32)
    config = engine_for(target, head, "static", max_batch=4).config
    per_page = memory.page_bytes(target, head, config.page_size, "torch")
    need = memory.need_pages(config)
    two = (2 * config.pages_per_request + 1) * per_page + per_page - 1
    plan = memory.plan_kv_pages(config, target, head, kv_cache_memory=two)
    assert plan.pages == 2 * config.pages_per_request + 1 and plan.num_pages == plan.pages
    assert memory.plan_kv_pages(config, target, head, kv_cache_memory=10 ** 12).num_pages is None
    assert memory.plan_kv_pages(config, target, head).pages == need
    with pytest.raises(ValueError, match=r"^--kv-cache-memory .*one request of the full context"):
        memory.plan_kv_pages(config, target, head, kv_cache_memory=config.pages_per_request
                             * per_page)


def test_a_utilization_budget_gives_the_pool_what_is_left():
    target, head = tiny_pair(seed=1, dtype=torch.float32)
    config = engine_for(target, head, "static", max_batch=4).config
    per_page = memory.page_bytes(target, head, config.page_size, "torch")
    base = memory.Baseline(torch.device("cpu"), total=100 << 30, free=90 << 30, reserved=0,
                           allocated=0)
    prof = memory.Profile(buffers=1 << 30, activations=2 << 30, graphs_estimate=3 << 30)
    base.non_torch_growth = lambda: 1 << 30          # type: ignore[method-assign]
    split = memory.budget_split(0.5, base, 40 << 30, prof)
    assert split["kv"] == (50 - 40 - 1 - 2 - 3 - 1) << 30
    plan = memory.plan_kv_pages(config, target, head, utilization=0.5, measured=split)
    assert plan.pages == memory.need_pages(config)          # 3 GiB is more than 4 contexts need
    tight = dict(split, kv=(config.pages_per_request + 1) * per_page)
    assert memory.plan_kv_pages(config, target, head, utilization=0.5,
                                measured=tight).pages == config.pages_per_request + 1
    with pytest.raises(ValueError, match=r"^--gpu-memory-utilization 0.5: 50.00 GiB \(0.5 of "
                                         r"100.00 GiB\) less weights 40.00 GiB"):
        memory.plan_kv_pages(config, target, head, utilization=0.5,
                             measured=dict(split, kv=-1))
    with pytest.raises(ValueError, match="asks for 95.00 GiB .* only 90.00 GiB are free"):
        memory.budget_split(0.95, base, 40 << 30, prof)


def test_generate_with_a_small_kv_pool_gives_the_same_tokens(capsys, model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("ab", "x = [", "def")))
    base = ["--prompts", str(prompts), "--steps", "3", "--model", str(model_dir),
            "--max-new-tokens", "12", "--json"]
    def pool_tokens(err: str) -> int:
        return int(err.split("KV pool: ")[1].split(" tokens")[0])

    code, out, err = _run(capsys, *base)
    assert code == 0
    full, full_pool = json.loads(out.splitlines()[-1]), pool_tokens(err)
    # room for one request at a time: the three run one after another
    code, out, err = _run(capsys, *base, "--kv-cache-memory", "40K")
    assert code == 0, err
    small = json.loads(out.splitlines()[-1])
    assert [o["token_ids"] for o in small["outputs"]] == [o["token_ids"] for o in full["outputs"]]
    assert "room for 1 request(s)" in err and "from --kv-cache-memory 40.0 KiB" in err
    assert pool_tokens(err) < full_pool


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory-utilization", "0.45"], "--gpu-memory-utilization 0.45: applies to --device "
                                           "cuda only"),
    (["--kv-cache-memory", "1K"], "--kv-cache-memory 1.0 KiB: 1024 bytes at"),
    (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: 'lots' is not a size"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: 1.5: must be a "
                                          "fraction in (0, 1]"),
    (["--dtype", "half"], "argument --dtype: invalid choice: 'half'"),
])
def test_memory_flags_are_refused_by_name(capsys, model_dir, argv, message):
    try:
        code, _, err = _run(capsys, "--prompt", "ab", "--no-spec", "--model", str(model_dir),
                            "--max-new-tokens", "4", *argv)
    except SystemExit as exit_:
        code, err = exit_.code, capsys.readouterr().err
    assert code == 2 and message in err, err


def test_both_budget_flags_together_are_refused(capsys, model_dir):
    code, _, err = _run(capsys, "--prompt", "ab", "--no-spec", "--model", str(model_dir),
                        "--kv-cache-memory", "1G", "--gpu-memory-utilization", "0.5")
    assert code == 2 and "give one" in err


# ---- the timeline -----------------------------------------------------------------------------

def test_progress_prints_at_most_every_interval(capsys):
    ticks = iter([0.0, 100.0, 100.0, 100.5, 101.0, 104.5, 104.5, 105.0])
    tl = startup_log.Timeline(printing=True, clock=lambda: next(ticks))
    for done in range(5):
        tl.progress("cost table", done, 10, f"part {done}")
    err = capsys.readouterr().err
    assert [ln.split("cost table: ")[1].split(" (")[0] for ln in err.splitlines()] == \
        ["0/10", "3/10"]


def test_a_silent_timeline_records_nothing():
    assert startup_log.current().step("x", "y") == {}
    with startup_log.active(startup_log.Timeline(printing=False)) as tl:
        startup_log.current().step("x", "y", memory=False)
        assert tl.events == [{"step": "x", "t": tl.events[0]["t"]}]
    assert startup_log.current().step("x", "y") == {}


# ---- counting captures ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["nospec", "goodput"])
def test_the_profile_counts_the_captures_the_engine_makes(mode):
    from adaptive_dist.config import load_config

    target, head = tiny_pair(seed=1, dtype=torch.float32)
    spec = load_config(None, "goodput").replace(round_cost={"1": 1.0, "3": 1.2, "7": 1.5,
                                                            "0": 0.9}) \
        if mode == "goodput" else None
    engine = engine_for(target, head if mode != "nospec" else None,
                        "ema" if mode == "goodput" else "nospec", config=spec, max_batch=4,
                        cuda_graphs=True)
    built = engine.worker
    prefill = len(built.table.of(GraphPhase.PREFILL))
    prof = memory.profile_engine(engine.config, target, head if mode != "nospec" else None)
    assert prof.captures == len(built.table) and prof.prefill_graphs == prefill
    assert prof.round_graphs == len(built.table) - prefill > 0


def test_the_utilization_path_sizes_the_pool_from_the_profile(capsys):
    """`--gpu-memory-utilization`'s steps end to end on the CPU (the profile's forwards run, a
    device of 1 GiB stands in for the GPU's numbers)."""
    from collectives import Group
    from workers.launch import _size_kv_pool

    target, head = tiny_pair(seed=1, dtype=torch.float32)
    config = engine_for(target, head, "static", max_batch=4, cuda_graphs=True,
                        padded_prefill_tokens=64).config
    prof = memory.profile_engine(config, target, head)
    assert [n.split(" ")[0] for n in prof.forwards] == ["padded", "ragged", "round"]
    assert prof.captures > 0 and prof.graphs_estimate > 0

    class Launch:
        gpu_memory_utilization, kv_cache_memory = 0.5, None

    base = memory.Baseline(torch.device("cpu"), total=1 << 30, free=1 << 30, reserved=0,
                           allocated=0)
    base.non_torch_growth = lambda: 0          # type: ignore[method-assign]
    timeline = startup_log.Timeline(printing=True)
    sized = _size_kv_pool(config, Launch(), target, head, Group.single("cpu", name="world"),
                          base, memory.weight_bytes(target, head), timeline)
    assert sized.num_pages is None          # 512 MiB holds what 4 requests need
    err = capsys.readouterr().err
    assert "memory profile:" in err and "from --gpu-memory-utilization 0.5: 512.0 MiB (0.5 of " \
        "1.00 GiB) less weights" in err and "(capped at what the batch needs)" in err
