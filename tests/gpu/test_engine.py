"""The engine's GPU paths: CUDA-graph rounds, tier switches without capture, the flashinfer backend.

Two tiers of checks (the CPU-emulated graph path is in `tests/unit/test_graph_path.py`):
- CUDA: graph replay equals eager (the float64 tiny pair, so no near-tie
  can flip an argmax; an EAGLE-3 oracle pair too), a tier switch captures and allocates nothing;
- `gpu` + flashinfer (skipped when it is not importable): its attention equals the torch
  backend's on every forward mode, and greedy outputs agree with the torch backend's (the bundled
  pair in float16, flashinfer's dtype; two float16 backends sum in different orders, so outputs may
  part only where the float32 target sees a near-tie: the test says where and how near).
"""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from adaptive_dist.config import AdaptiveConfig
from engine_fixtures import ScriptPlanner, check_pages_back, engine_for, random_prompts, tiny_pair
from workers.attention import ForwardMode, build_metadata
from workers.attention.torch_backend import TorchBackend
from workers.engine import Engine
from workers.kv_cache import KVPool, PageAllocator
from workers.model import DenseCausalAttention
from workers.runtime_state import RuntimeStatePool
from workers.sampling import SamplingParams
from workers.worker.graph_table import GraphPhase

CUDA = torch.cuda.is_available()
HAS_FLASHINFER = CUDA and importlib.util.find_spec("flashinfer") is not None
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="needs CUDA and flashinfer")
BUNDLED = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny_pair"


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=8 + 7 * (i % 5)) for i in range(n)]


def _engine(target, head, mode: str, steps: int = 3, *, graphs: bool = False,
            backend: str = "torch", device: str = "cpu", max_batch: int = 4,
            page_size: int = 4, config: AdaptiveConfig | None = None,
            overlap: bool = False) -> Engine:
    return engine_for(target, head, mode, steps, config=config, max_batch=max_batch,
                      page_size=page_size, device=device, cuda_graphs=graphs,
                      attention_backend=backend, overlap=overlap)


def _outputs(engine: Engine, prompts, params) -> list[list[int]]:
    return [r.output_ids for r in engine.generate(prompts, params)]


def _close_and_check_pages(engine: Engine) -> None:
    engine.close()
    check_pages_back(engine)


def _captures_per_bucket(steps: int) -> int:
    """Graphs a tier captures per bucket: the acceptance (twice: device sampling, greedy-only),
    and twice more with the logits processing (top-k, min_tokens, penalties, logprobs); when
    speculating also the whole draft loop (twice) and draft-extend + slot update. The target's
    packed verify forward is captured once per token rung (`_target_captures`), for every
    tier."""
    return 4 if steps == 0 else 7


def _target_captures(engine) -> int:
    return len(engine.worker.table.of(GraphPhase.TARGET))


def _prefill_graphs(engine, head: bool = True) -> dict:
    """The padded prefill's graphs (`head` False: the deferred ones, without the head's part); an
    eager engine has no graph table and none."""
    table = engine.worker.table
    if table is None:
        return {}
    return {k: e for k, e in table.of(GraphPhase.PREFILL).items() if k.head == head}


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(10, vocab=64, seed=7)


@pytest.fixture(scope="module")
def reference(pair, prompts) -> list[list[int]]:
    return _outputs(_engine(pair[0], None, "nospec"), prompts, _params(len(prompts)))


@pytest.fixture(scope="module")
def gpu_pair():
    return tuple(m.to("cuda") for m in tiny_pair(seed=0))


@gpu
@needs_cuda
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("steps", [0, 1, 3, 7])
def test_cuda_graph_replay_equals_eager(gpu_pair, prompts, reference, steps: int,
                                        overlap: bool) -> None:
    if steps == 0:
        engine = _engine(gpu_pair[0], None, "nospec", graphs=True, device="cuda",
                         overlap=overlap)
    else:
        engine = _engine(*gpu_pair, "static", steps, graphs=True, device="cuda",
                         overlap=overlap)
    runner = engine.worker.graphs
    # a static run builds only its own tier (and the padded prefill: one graph per shape)
    prefill = len(_prefill_graphs(engine))
    assert prefill == 30   # buckets 1, 2, 4 x widths 32 .. 512 (the context) x greedy or not
    assert _target_captures(engine) == len(engine.config.verify_ladder)
    assert runner.capture and runner.num_captures == _captures_per_bucket(steps) * len(
        engine.worker.buckets) + prefill + _target_captures(engine)
    assert _outputs(engine, prompts, _params(len(prompts))) == reference
    assert engine.stats.graph_rounds == engine.stats.rounds > 0
    _close_and_check_pages(engine)


@gpu
@needs_cuda
def test_overlapped_graph_rounds_sample_as_the_serial_engine(gpu_pair, prompts) -> None:
    """With overlap (round r+1 queued before round r is read) the sampled tokens are the serial
    engine's: a request's draws depend on its seed and positions, not on when the host reads."""
    params = [SamplingParams(temperature=0.9, top_p=0.9 if i % 2 else 1.0,
                             max_new_tokens=6 + 5 * (i % 4)) for i in range(len(prompts))]
    outs = []
    for overlap in (False, True):
        engine = _engine(*gpu_pair, "static", 3, graphs=True, device="cuda", overlap=overlap)
        outs.append(_outputs(engine, prompts, params))
        assert engine.stats.graph_rounds == engine.stats.rounds > 0
        _close_and_check_pages(engine)
    assert outs[0] == outs[1]


@gpu
@needs_cuda
def test_tier_switch_captures_and_allocates_nothing(gpu_pair, prompts, reference) -> None:
    config = AdaptiveConfig(warmup_batches=1, update_interval=1, ema_alpha=0.6, initial_steps=7)
    engine = _engine(*gpu_pair, "ema", graphs=True, device="cuda", config=config)
    runner, pool = engine.worker.graphs, engine.pool
    captured = runner.num_captures
    assert captured == sum(_captures_per_bucket(s) for s in pool.states) * len(
        engine.worker.buckets) + len(_prefill_graphs(engine)) + _target_captures(
        engine)
    shared = engine.worker.buffers.nbytes   # counted in the first tier's state
    growth = {s: st.nbytes - (shared if i == 0 else 0)
              for i, (s, st) in enumerate(pool.states.items())}
    assert all(g >= 0 for g in growth.values())
    assert all(e.graph is not None for e in engine.worker.table.entries.values())
    pool_bytes = runner.pool_bytes()
    print(f"graph pool {pool_bytes} B; growth of the shared pool while each tier captured: {growth}")
    # a tier may fit in segments an earlier tier left free: the growths (and the padded
    # prefill's, captured last) add up to the pool
    prefill = engine.worker.prefill_runner.graph_bytes
    assert pool_bytes > 0 and sum(growth.values()) + prefill == pool_bytes
    for steps in list(pool.states) * 2:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        pool.apply(steps)
        assert torch.cuda.memory_allocated() == before
        assert engine.worker.state is pool.states[steps]
        assert runner.num_captures == captured
    assert _outputs(engine, prompts, _params(len(prompts))) == reference
    assert engine.stats.switches >= 1 and engine.stats.graph_rounds == engine.stats.rounds
    assert runner.num_captures == captured, "a tier switch captured a graph"
    _close_and_check_pages(engine)


@gpu
@needs_cuda
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_per_request_graphs_equal_plain_greedy(gpu_pair, prompts, reference, overlap) -> None:
    """Per-request budgets on the CUDA-graph path (the packed verify forward per token rung,
    the acceptance and the draft loop per depth and bucket, replayed): plain greedy's tokens,
    every round through the graphs, requests drafting differently inside a round."""
    from engine_fixtures import per_request_config

    engine = _engine(*gpu_pair, "ema", graphs=True, device="cuda", overlap=overlap,
                     config=per_request_config(per_token=0.05))
    captured = engine.worker.graphs.num_captures
    assert _outputs(engine, prompts, _params(len(prompts))) == reference
    stats = engine.planner.stats
    assert engine.stats.graph_rounds == engine.stats.rounds > 0
    assert len({(s, t) for s, _, t in stats.rounds_at_shape}) >= 3
    assert 0 < stats.draft_tokens < 7 * stats.drafts
    assert engine.worker.graphs.num_captures == captured
    _close_and_check_pages(engine)


@gpu
@needs_cuda
def test_depth_0_catch_up_graphs_equal_eager(gpu_pair, prompts, reference) -> None:
    """Depth-0 rounds (the head's cache lagging) and the catch-up forward, replayed from CUDA
    graphs, leave the draft cache as the eager rounds do: with the same schedule of depths the
    drafts, hence the accept lengths, are identical, and the tokens are plain greedy's."""
    script = [0] * 11 + [3] * 3 + [0] * 5 + [1] * 2 + [0] * 9 + [7]
    runs = []
    for graphs in (False, True):
        engine = _engine(*gpu_pair, "static", 7, graphs=graphs, device="cuda")
        engine.pool = RuntimeStatePool(engine.worker, (0, 1, 3, 7))
        engine.planner = ScriptPlanner(script, graphs, 4)
        out = _outputs(engine, prompts, _params(len(prompts)))
        assert out == reference
        assert bool(engine.worker.table and engine.worker.table.of(GraphPhase.CATCHUP)) == graphs
        runs.append(dict(engine.stats.accept_histogram))
        _close_and_check_pages(engine)
    assert runs[0] == runs[1] and sum(v for k, v in runs[0].items() if k > 0) > 0


@gpu
@needs_cuda
def test_deferred_prefill_graphs_equal_eager(gpu_pair, prompts, reference) -> None:
    """An engine whose tiers include depth 0 from the start captures the padded prefill with the
    head left out (and the forward over the waiting prompts per bucket and width): admissions at
    depth 0 replay it, the catch-ups run the waiting prompts, and with the same schedule the graph
    path accepts what the eager path accepts (what the head run in every prefill accepts), with
    plain greedy's tokens."""
    config = AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3), initial_steps=0,
                            round_cost={"0": 1.0, "1": 2.0, "3": 3.0})
    script = [0] * 11 + [3] * 3 + [0] * 5 + [1] * 2 + [0] * 9 + [3]
    runs = []
    for graphs, defer in ((False, 0), (False, 128), (True, 128)):
        engine = engine_for(*gpu_pair, "ema", config=config, device="cuda", cuda_graphs=graphs,
                            defer_prefill_width=defer)
        worker = engine.worker
        engine.planner = ScriptPlanner(script, graphs, 4)
        replays = [0]
        for entry in _prefill_graphs(engine, head=False).values():
            entry.replay = (lambda e: lambda: (replays.__setitem__(0, replays[0] + 1),
                                               type(e).replay(e))[1])(entry)
        assert _outputs(engine, prompts, _params(len(prompts))) == reference
        assert bool(_prefill_graphs(engine, head=False)) == bool(
            worker.table and worker.table.of(GraphPhase.PENDING)) == graphs
        assert replays[0] > 0 if graphs else replays[0] == 0
        runs.append(dict(engine.stats.accept_histogram))
        _close_and_check_pages(engine)
    assert runs[0] == runs[1] == runs[2] and sum(v for k, v in runs[0].items() if k > 0) > 0


@gpu
@needs_cuda
def test_eagle3_cuda_graph_replay_equals_eager(prompts) -> None:
    """An EAGLE-3 oracle pair (`model_fixtures`, float64) on the GPU: the captured draft loop (the
    d2t map inside the head's logits), verify (the target's three captured states inside its
    forward) and draft-extend replay to the no-speculation output at static depths and adaptive;
    drafts are accepted (a wrong map or wrong features would show as acceptance 0)."""
    from model_fixtures import (bigram_map, draft_vocab, mixed_eps, oracle_head, oracle_target,
                                target_config)

    ids = draft_vocab(64, 32)
    f = bigram_map(64, ids)
    target = oracle_target(target_config("qwen3"), f, mixed_eps("qwen3", "eagle3"))
    head = oracle_head("eagle3", target, f, ids)
    target, head = target.to("cuda"), head.to("cuda")
    params = _params(len(prompts))
    reference = _outputs(_engine(target, None, "nospec", device="cuda"), prompts, params)
    config = AdaptiveConfig(warmup_batches=1, update_interval=1, ema_alpha=0.6, initial_steps=7)
    for mode, steps in (("static", 1), ("static", 3), ("static", 7), ("ema", 3)):
        engine = _engine(target, head, mode, steps, graphs=True, device="cuda",
                         config=config if mode == "ema" else None)
        assert _outputs(engine, prompts, params) == reference, (mode, steps)
        assert engine.stats.graph_rounds == engine.stats.rounds > 0
        hist = engine.stats.accept_histogram
        assert sum(v for k, v in hist.items() if k > 0) > 0, hist
        _close_and_check_pages(engine)


# ---- flashinfer ---------------------------------------------------------------------------------

def _pool(backend, num_kv_heads: int, head_dim: int, pages: int, page_size: int,
          dtype: torch.dtype) -> KVPool:
    fmt = getattr(backend, "kv_format", None)
    dim, dt = fmt(head_dim, dtype) if fmt else (head_dim, dtype)
    return KVPool(1, pages, page_size, num_kv_heads, dim, dtype=dt, device="cuda")


@gpu
@needs_flashinfer
@pytest.mark.parametrize("mode", list(ForwardMode))
def test_flashinfer_attention_matches_torch(mode: ForwardMode) -> None:
    """Two ragged forwards per mode (a prefix, then `mode`'s new tokens) through both backends,
    the second one padded with extra rows as a DP-attention round pads it."""
    from workers.attention.flashinfer_backend import FlashInferBackend

    rng = random.Random(mode.value)
    torch.manual_seed(0)
    hq, hkv, d, ps, dtype = 8, 4, 32, 16, torch.float16
    backends = {"torch": TorchBackend(), "flashinfer": FlashInferBackend("cuda")}
    pools = {n: _pool(b, hkv, d, 64, ps, dtype) for n, b in backends.items()}
    alloc = PageAllocator(64, ps)
    batch = 5
    tables = [alloc.allocate(rid, 100) for rid in range(batch)]
    prefix = [rng.randint(1, 70) for _ in range(batch)]
    new = {ForwardMode.DECODE: [1] * batch, ForwardMode.VERIFY: [4] * batch}.get(
        mode, [rng.randint(1, 8) for _ in range(batch)])
    cached = [0] * batch
    for step_mode, lens, pad in ((ForwardMode.EXTEND, prefix, 0), (mode, new, 3)):
        rows = sum(lens) + pad
        q = torch.randn(rows, hq, d, dtype=dtype, device="cuda")
        k = torch.randn(rows, hkv, d, dtype=dtype, device="cuda")
        v = torch.randn(rows, hkv, d, dtype=dtype, device="cuda")
        meta = build_metadata(step_mode, tables, cached, lens, ps, "cuda")
        outs = {name: backend.plan(meta, pools[name]).forward(0, q, k, v)
                for name, backend in backends.items()}
        torch.testing.assert_close(outs["flashinfer"], outs["torch"], atol=2e-3, rtol=2e-3)
        assert outs["flashinfer"][sum(lens):].abs().sum() == 0  # padding rows
        cached = [c + n for c, n in zip(cached, lens)]


def _pair_in(dtype: torch.dtype):
    """The bundled pair (else the tiny random one) on the GPU in `dtype`."""
    if (BUNDLED / "target" / "config.json").is_file():
        from workers.model import load_eagle, load_llama

        target = load_llama(BUNDLED / "target", dtype=dtype, device="cuda")
        return target, load_eagle(BUNDLED / "eagle", target)
    target, head = (m.to("cuda") for m in tiny_pair(seed=0, dtype=dtype))
    target.reset_buffers()
    head.reset_buffers()
    return target, head


def _fresh_prompts(config) -> list[list[int]]:
    """Prompts not in the repository (byte ids for the bundled pair, random ids otherwise)."""
    from workers.loading import encode_prompt

    if config.vocab_size == 64:
        return random_prompts(6, vocab=64, seed=7)
    texts = ["def merge_intervals(spans):\n    ", "class LRUCache:\n    def __init__(self, ",
             "    for idx, (name, val) in enumerate(sorted(table.items())):\n",
             'KEY = "QmFzZTY0IGlzIG5vdCBlbmNyeXB0aW9uLg==',
             "The lighthouse keeper wrote in her log that the storm",
             "import os\nimport sys\n\ndef main(argv):\n"]
    return [encode_prompt(t, config) for t in texts]


def _near_tie_or_equal(ref: list[int], out: list[int], prompt: list[int], target32) -> str | None:
    """None when equal, or when they first part where the float32 target's two candidates are
    within 0.05 logits of each other; else a description of the divergence."""
    if ref == out:
        return None
    i = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
    if i == min(len(ref), len(out)):
        return f"lengths differ ({len(ref)} vs {len(out)}) with equal prefixes"
    ids = torch.tensor(prompt + ref[:i], device="cuda")
    with torch.inference_mode():
        hidden = target32(ids, torch.arange(len(ids), device="cuda"),
                          DenseCausalAttention([len(ids)]))
        logits = target32.compute_logits(hidden[-1:]).float()[0]
    gap = (logits[ref[i]] - logits[out[i]]).abs().item()
    return None if gap < 0.05 else f"token {i}: {ref[i]} vs {out[i]}, float32 logit gap {gap:.3f}"


@gpu
@needs_flashinfer
def test_flashinfer_greedy_equals_torch_backend() -> None:
    target, head = _pair_in(torch.float16)
    target32, _ = _pair_in(torch.float32)
    prompts = _fresh_prompts(target.config)
    params = [SamplingParams(max_new_tokens=40) for _ in prompts]
    kw = dict(device="cuda", max_batch=8, page_size=16)
    ref = _outputs(_engine(target, None, "nospec", **kw), prompts, params)
    runs = {"flashinfer nospec": _engine(target, None, "nospec", backend="flashinfer", **kw)}
    for steps in (1, 3, 7):
        runs[f"flashinfer steps={steps}"] = _engine(target, head, "static", steps,
                                                    backend="flashinfer", **kw)
    runs["flashinfer steps=3 + CUDA graphs"] = _engine(target, head, "static", 3, graphs=True,
                                                       backend="flashinfer", **kw)
    exact, problems = 0, []
    for name, engine in runs.items():
        outs = _outputs(engine, prompts, params)
        for p, r, o in zip(prompts, ref, outs):
            exact += r == o
            why = _near_tie_or_equal(r, o, p, target32)
            if why:
                problems.append(f"{name}: {why}")
        if engine.config.speculative:
            assert engine.stats.accept_histogram, name
        _close_and_check_pages(engine)
    print(f"{exact} of {len(runs) * len(prompts)} outputs equal exactly; near-ties: {problems}")
    assert not problems, "\n".join(problems)
    assert exact >= 0.8 * len(runs) * len(prompts), f"only {exact} outputs equal exactly"
    assert runs["flashinfer steps=3 + CUDA graphs"].stats.graph_rounds > 0


@gpu
@needs_flashinfer
def test_generate_command_with_flashinfer_and_graphs(capsys) -> None:
    import json

    from workers.cli import main

    assert main(["generate", "--prompt", "def fib(n):", "--steps", "3", "--attention-backend",
                 "flashinfer", "--max-new-tokens", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["outputs"][0]["token_ids"]) == 32
    assert out["graph_rounds"] > 0 and set(out["runtime_state_bytes_per_tier"]) == {"3"}


@gpu
@needs_cuda
def test_prefill_graph_replays_leave_what_the_ragged_prefill_leaves() -> None:
    """Prefills of 1..4 requests through the captured padded-prefill graphs (counted: they did
    replay) give the outputs of ragged prefills (the float64 pair: no near-tie to flip)."""
    pair = tuple(m.to("cuda") for m in tiny_pair(seed=0))
    prompts = random_prompts(7, vocab=64, seed=9, lo=1, hi=60)
    outs, replays = [], []
    for cap in (0, 4096):
        engine = engine_for(*pair, "static", steps=3, max_batch=4, device="cuda",
                            cuda_graphs=True, padded_prefill_tokens=cap)
        graphs = _prefill_graphs(engine)
        assert bool(graphs) == bool(cap)
        count = [0]
        for entry in graphs.values():
            entry.replay = (lambda e: lambda: (count.__setitem__(0, count[0] + 1),
                                               type(e).replay(e))[1])(entry)
        reqs = engine.generate(prompts, _params(len(prompts)))
        outs.append([r.output_ids for r in reqs])
        replays.append(count[0])
        check_pages_back(engine)
        engine.close()
    assert replays[0] == 0 and replays[1] >= 2
    assert outs[0] == outs[1]
