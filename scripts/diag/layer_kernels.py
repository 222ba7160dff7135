"""Kernels per decoder layer of the target's forward in a round, by part (attention, norms, MoE /
MLP, head, the rest), counted on a CPU or profiled and timed on a GPU.

    python -m scripts.diag.layer_kernels                         # CPU: tiny-moe, depth 0, batch 1
        [--shape tiny-moe] [--experts 128 --top-k 8] [--shared-expert 48] [--layers 2]
        [--batch 1 8 64] [--depths 0 1 3 7] [--out FILE.json]
    python3 -m scripts.diag.layer_kernels --device cuda --shape qwen3-30b-a3b \\
        --batch 1 8 64 --depths 0 1 3 7 --out OUT.json          # one GPU (~1.5 min on an H200)

Each layer's code is labelled while it runs (`Scopes`: the residual add and norm entering it,
the attention block, the post-attention add and norm, the MoE block or dense MLP; outside the
layers the embedding, RoPE's angles, the final norm, the LM head and the rest of the round).

On the CPU (no GPU needed) the fused path runs as it runs on CUDA: `kernels.enabled` forced on,
every Triton launch of `workers.kernels` / `workers.moe_kernels` recorded as one kernel and not
run (`scripts.diag.count_kernels._Counting`; values do not change which ops run), and every aten
op the dispatcher sees (`TorchDispatchMode`, below autograd and the composite decompositions:
``F.linear`` is ``aten.mm``) that is not a view, a shape query or an allocation counts as one
launch. Host syncs (``aten._local_scalar_dense``) are listed apart: a captured round has none.
Not modelled: cuBLAS's split-K reduce kernels, multi-kernel CUDA implementations of one op.

On a GPU the rounds run as the engine runs them: the depth-0 round (`round_body`: the verify
forward and the acceptance) and, for depths > 0, the packed verify forward alone (rows =
batch x (depth + 1) tokens, one engine at the deepest depth with its head), CUDA-graph replayed
over `TrafficRows` (varied tokens: the router spreads them as traffic), timed against the
weight floor (every weight read: attention, norms, routers, LM head, the batch's embedding rows,
the experts each layer's rows hit, counted in an eager forward over the same rows; KV left out)
over `--bandwidth`. `torch.profiler` then runs one eager forward with the labels as
``record_function`` ranges (each device kernel attributed to the label around the op that
launched it) and `--replays` graph replays (the kernels CUPTI reports inside the graph); the
replay's kernels take the eager run's labels where the two kernel-name sequences match
(`difflib`), so each part's device time is the replay's. Printed per depth and batch: the time,
the floor, the kernels per layer and per part, each part's device time, and the gap (the round's
time less its kernels' time: launch gaps inside the graph).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

PARTS = ("norm", "attention", "moe", "mlp", "head", "other")
NO_LAUNCH = frozenset((
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
    "set_", "resize_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size",
    "stride", "dim", "is_same_size", "_local_scalar_dense", "record_stream",
))
SYNC_OPS = frozenset(("_local_scalar_dense",))


# ---- labels ------------------------------------------------------------------------------------

class Scopes:
    """While installed, the target's code runs under labels ``(where, part)``: ``where`` a layer
    index or "embed" / "final" / "head" / "round"; ``part`` one of `PARTS`. ``current`` is the
    innermost label; with ``ranges`` each label is also a ``torch.profiler.record_function``
    range named ``where/part`` (how the GPU profile attributes kernels)."""

    def __init__(self, target: torch.nn.Module, ranges: bool = False) -> None:
        self.target, self.ranges = target, ranges
        self.stack: list[tuple[Any, str]] = []
        self.patched: list[tuple[Any, ...]] = []

    @property
    def current(self) -> tuple[Any, str]:
        return self.stack[-1] if self.stack else ("round", "other")

    @contextmanager
    def scope(self, label: tuple[Any, str]) -> Iterator[None]:
        self.stack.append(label)
        try:
            if self.ranges:
                with torch.profiler.record_function(f"{label[0]}/{label[1]}"):
                    yield
            else:
                yield
        finally:
            self.stack.pop()

    def _wrap(self, obj: Any, name: str, label: tuple[Any, str]) -> None:
        inner = getattr(obj, name, None)
        if inner is None:   # an older tree's model (diag.count_kernels says how to run one)
            return

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.scope(label):
                return inner(*args, **kwargs)
        object.__setattr__(obj, name, wrapped)     # the instance's, shadowing the class's
        self.patched.append((obj, name))

    def install(self) -> "Scopes":
        from workers.model import llama
        from workers.model.llama import LlamaDecoderLayer
        from workers.model.moe import MoeBlock

        model = self.target.model
        self._wrap(model.embed_tokens, "forward", ("embed", "other"))
        self._wrap(model.rotary, "forward", ("embed", "other"))
        for i, layer in enumerate(model.layers):
            if not isinstance(layer, LlamaDecoderLayer):
                continue
            self._wrap(layer, "enter", (i, "norm"))
            self._wrap(layer, "body", (i, "other"))
            self._wrap(layer.self_attn, "forward", (i, "attention"))
            self._wrap(layer.post_attention_layernorm, "add_forward", (i, "norm"))
            ffn = layer.ffn
            moe = isinstance(ffn, MoeBlock)
            for name in ("forward", "pending") if moe else ("forward",):
                self._wrap(ffn, name, (i, "moe" if moe else "mlp"))
        for name in ("add_forward", "forward"):
            self._wrap(model.norm, name, ("final", "norm"))
        self._wrap(self.target.lm_head, "forward", ("head", "head"))
        # the final residual add and norm (with a MoE block's sum, not through the norm's methods)
        inner, final = llama.add_norm, model.norm

        def add_norm(norm: Any, *args: Any) -> Any:
            if norm is not final:
                return inner(norm, *args)
            with self.scope(("final", "norm")):
                return inner(norm, *args)
        llama.add_norm = add_norm
        self.patched.append((llama, "add_norm", inner))
        return self

    def remove(self) -> None:
        for obj, name, *old in reversed(self.patched):
            if old:
                setattr(obj, name, old[0])
            else:
                obj.__dict__.pop(name, None)
        self.patched.clear()

    def __enter__(self) -> "Scopes":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def label_key(label: tuple[Any, str]) -> str:
    return f"{label[0]}/{label[1]}"


# ---- the CPU count -----------------------------------------------------------------------------

class Launches:
    """What one call launched, in order: ``(label, op)`` per launch; host syncs by label."""

    def __init__(self) -> None:
        self.records: list[tuple[tuple[Any, str], str]] = []
        self.syncs: list[tuple[Any, str]] = []
        self.programs: list[tuple[tuple[Any, str], str, int]] = []   # Triton launches' grids


@contextmanager
def counting(scopes: Scopes) -> Iterator[Launches]:
    """Record every launch while open (see the module docstring): the dispatcher's aten ops and
    the Triton launches `count_kernels._Counting` records (installed by the caller)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from scripts.diag.count_kernels import _Counting

    got = Launches()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if _Counting.launching:     # a recorded Triton launch's own bookkeeping
                return out
            name = func.overloadpacket.__name__
            ns = func.namespace
            if ns == "aten" and name in SYNC_OPS:
                got.syncs.append(scopes.current)
            elif ns == "aten" and not func.is_view and name not in NO_LAUNCH:
                got.records.append((scopes.current, f"aten::{name}"))
            return out

    def on_launch(name: str, programs: int) -> None:
        got.records.append((scopes.current, f"triton::{name}"))
        got.programs.append((scopes.current, name, programs))

    _Counting.hooks.append(on_launch)
    _Counting.on = True
    try:
        with Mode():
            yield got
    finally:
        _Counting.on = False
        _Counting.hooks.remove(on_launch)


def summarize(records: list[tuple[tuple[Any, str], str]], times: list[float] | None = None
              ) -> dict[str, Any]:
    """Per layer and part: kernels (and with `times`, ms) and their ops; the layers grouped by
    identical op lists; the parts' totals over the whole call."""
    layers: dict[Any, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    ms: dict[Any, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    parts_total: Counter = Counter()
    parts_ms: dict[str, float] = defaultdict(float)
    for j, (label, op) in enumerate(records):
        where, part = label
        layers[where][part][op] += 1
        parts_total[part] += 1
        if times is not None:
            ms[where][part] += times[j]
            parts_ms[part] += times[j]
    numbered = sorted(k for k in layers if isinstance(k, int))
    per_layer = {}
    for i in numbered:
        rec = {part: {"kernels": sum(c.values()), "ops": dict(c.most_common())}
               for part, c in layers[i].items()}
        if times is not None:
            for part in rec:
                rec[part]["ms"] = ms[i][part]
        per_layer[str(i)] = rec
    outside = {}
    for where in layers:
        if not isinstance(where, int):
            outside[str(where)] = {part: {"kernels": sum(c.values()), "ops": dict(c.most_common())}
                                   for part, c in layers[where].items()}
            if times is not None:
                for part in outside[str(where)]:
                    outside[str(where)][part]["ms"] = ms[where][part]
    groups: list[dict[str, Any]] = []   # runs of layers with the same ops
    for i in numbered:
        sig = {p: r["ops"] for p, r in per_layer[str(i)].items()}
        if groups and groups[-1]["sig"] == sig:
            groups[-1]["layers"].append(i)
        else:
            groups.append({"layers": [i], "sig": sig,
                           "kernels": sum(r["kernels"] for r in per_layer[str(i)].values())})
    out = {"kernels": len(records), "per_layer": per_layer, "outside_layers": outside,
           "layer_groups": [{"layers": g["layers"], "kernels": g["kernels"], "ops": g["sig"]}
                            for g in groups],
           "parts": dict(parts_total)}
    if times is not None:
        out["parts_ms"] = dict(parts_ms)
        out["kernel_ms"] = sum(times)
        by_name: dict[str, list[float]] = {}    # every kernel name: [count, ms], labels aside
        for (_, op), ms_ in zip(records, times):
            acc = by_name.setdefault(op, [0, 0.0])
            acc[0] += 1
            acc[1] += ms_
        out["by_name"] = dict(sorted(by_name.items(), key=lambda kv: -kv[1][1]))
    return out


def describe(summary: dict[str, Any], indent: str = "  ") -> list[str]:
    """Lines: each group of identical layers (kernels, by part, their ops in order of count),
    then what runs outside the layers."""
    lines = []
    for g in summary["layer_groups"]:
        span = g["layers"]
        name = (f"layer {span[0]}" if len(span) == 1 else
                f"layers {span[0]}-{span[-1]} ({len(span)})")
        lines.append(f"{indent}{name}: {g['kernels']} kernels each")
        for part in PARTS:
            if part in g["ops"]:
                ops = g["ops"][part]
                text = ", ".join(f"{k.split('::')[-1]}{'' if v == 1 else f' x{v}'}"
                                 for k, v in ops.items())
                lines.append(f"{indent}  {part:<10}{sum(ops.values()):>3}: {text}")
    for where, parts in summary["outside_layers"].items():
        for part, rec in parts.items():
            text = ", ".join(f"{k.split('::')[-1]}{'' if v == 1 else f' x{v}'}"
                             for k, v in rec["ops"].items())
            lines.append(f"{indent}{where}/{part}: {rec['kernels']}: {text}")
    return lines


def model_config(args: argparse.Namespace) -> Any:
    """The target's `LlamaConfig`: `--shape` (`scripts.gen.make_checkpoint.SHAPES`) with the
    overrides given (experts, top k, a shared expert, layers)."""
    from dataclasses import replace

    from scripts.gen.make_checkpoint import SHAPES
    from workers.model.config import LlamaConfig

    kw = dict(SHAPES[args.shape])
    if args.layers is not None:
        kw["num_hidden_layers"] = args.layers
    moe = kw.get("moe")
    if moe is None and (args.experts or args.top_k or args.shared_expert):
        raise SystemExit(f"--experts / --top-k / --shared-expert: shape {args.shape} is dense")
    if moe is not None:
        changes = {}
        if args.experts:
            changes["num_experts"] = args.experts
        if args.top_k:
            changes["top_k"] = args.top_k
        if args.shared_expert:
            changes["shared_expert_size"] = args.shared_expert
        kw["moe"] = replace(moe, **changes)
    if args.shared_expert:
        kw["architecture"] = "Qwen2MoeForCausalLM"     # its q/k/v biases, no q/k norms
        kw.pop("explicit_head_dim", None)
    return LlamaConfig(**kw)


def random_target(cfg: Any, shape: str, device: str, with_head: bool) -> tuple[Any, Any]:
    """A target of `cfg` (and an EAGLE-3 head) with random bfloat16 weights on `device`, as
    `scripts.gen.make_checkpoint.build` makes them."""
    from scripts.gen.make_checkpoint import DRAFT_VOCAB, fill
    from workers.model import ModelParallel
    from workers.model.eagle3 import Eagle3Config, Eagle3Head
    from workers.model.llama import LlamaForCausalLM

    par = ModelParallel.single(device)
    with torch.device("meta"):
        target = LlamaForCausalLM(cfg, par)
        head = None
        if with_head:
            head = Eagle3Head(Eagle3Config.for_target(cfg, DRAFT_VOCAB.get(shape, 256),
                                                      rope_theta=cfg.rope_theta,
                                                      rope_scaling=cfg.rope_scaling), target)
    fill(target, 0, device)
    if head is not None:
        fill(head, 1, device)
        gen = torch.Generator().manual_seed(2)
        vocab = DRAFT_VOCAB.get(shape, 256)
        ids = torch.randperm(cfg.vocab_size, generator=gen)[:vocab].sort().values
        head.set_vocab_map((ids - torch.arange(ids.numel())).to(device))
    target.reset_buffers()
    target.eval()
    return target, head


def count_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """Per depth and batch: the launches of the verify forward (`target`) and, at depth 0, of
    the acceptance, per layer and part."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from scripts.bench.common import build, static_spec
    from scripts.diag.count_kernels import _Counting, prompts
    from workers.sampling import SamplingParams
    from workers.worker.graph_table import GraphKey, GraphPhase
    from workers.worker.phases import phase_key, round_phases

    torch.set_num_threads(1)
    cfg = model_config(args)
    target, head = random_target(cfg, args.shape, "cpu", with_head=max(args.depths) > 0)
    _Counting.install()
    out: dict[str, Any] = {"meta": meta(args, cfg), "runs": []}
    for depth in args.depths:
        for batch in args.batch:
            engine = build(static_spec(depth), target, head if depth else None, batch=batch,
                           context=128, device="cpu")
            engine.generate(prompts(batch), SamplingParams(max_new_tokens=2), seed=0)
            worker = engine.worker
            bufs = worker.state.payload
            shape = worker.default_shape(batch)
            reach, cache_len = worker.slots.reach, worker.slots.cache_len
            lens = cache_len.clone()
            run: dict[str, Any] = {"depth": depth, "batch": batch,
                                   "tokens": shape.verify_tokens}
            with torch.inference_mode(), Scopes(target) as scopes:
                bufs.rows[:batch] = torch.arange(batch)
                bufs.budget[:batch] = depth
                worker.buffers.rows[:batch] = torch.arange(batch)
                worker.buffers.budget[:batch] = depth
                for phase in round_phases(bufs.steps):
                    if phase not in (GraphPhase.TARGET, GraphPhase.ACCEPT):
                        continue
                    key = phase_key(phase, batch, bufs.steps, shape.verify_tokens, True)
                    body = worker.phases.body(key, bufs, reach)
                    cache_len.copy_(lens)
                    cache_len[:batch] = 40
                    with counting(scopes) as got:
                        body()
                    rec = summarize(got.records)
                    rec["host_syncs"] = [label_key(s) for s in got.syncs]
                    # programs per Triton launch of one layer (the last): fewer than a GPU's
                    # SMs (132 on an H200) and the launch is latency-bound, whatever it reads
                    last = max((lab[0] for lab, _, _ in got.programs
                                if isinstance(lab[0], int)), default=None)
                    rec["programs_last_layer"] = [[lab[1], name, n] for lab, name, n
                                                  in got.programs if lab[0] == last]
                    run["target" if phase is GraphPhase.TARGET else "accept"] = rec
                    if not isinstance(key, GraphKey):
                        raise TypeError(key)
            engine.close()
            out["runs"].append(run)
            print(report_cpu(run), flush=True)
    return out


def report_cpu(run: dict[str, Any]) -> str:
    t = run["target"]
    lines = [f"depth {run['depth']}, batch {run['batch']} ({run['tokens']} verify tokens): "
             f"verify forward {t['kernels']} kernels"
             + (f", acceptance {run['accept']['kernels']}" if "accept" in run else "")
             + (f"; HOST SYNCS: {t['host_syncs']}" if t["host_syncs"] else "")]
    lines += describe(t)
    if t.get("programs_last_layer"):
        lines.append("  programs per Triton launch (last layer): " + ", ".join(
            f"{name} {n}" for _, name, n in t["programs_last_layer"]))
    return "\n".join(lines)


def meta(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    moe = cfg.moe
    return {"shape": args.shape, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "experts": moe.num_experts if moe else None, "top_k": moe.top_k if moe else None,
            "shared_expert": moe.shared_expert_size if moe else None,
            "device": args.device, "torch": torch.__version__, "command": " ".join(sys.argv)}


# ---- the GPU profile ---------------------------------------------------------------------------

def clock(fn: Callable[[], Any], iters: int) -> float:
    """Milliseconds per call of `fn` over `iters` back-to-back calls (CUDA events; on the CPU,
    `--smoke`, the wall clock)."""
    if not torch.cuda.is_available():
        begun = time.perf_counter()
        for _ in range(iters):
            fn()
        return 1000 * (time.perf_counter() - begun) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@contextmanager
def triton_log(scopes: Scopes) -> Iterator[list[tuple[tuple[Any, str], str]]]:
    """While open, every Triton launch of `workers.kernels` / `workers.moe_kernels` runs as
    before and is logged as (the label around it, the kernel's name as the profiler reports it):
    a launch from Python has no aten op for the profiler to link its kernel to, and the
    ``record_function`` range around it does not get the link either (what the first H200 run
    showed: every Triton kernel unlabelled)."""
    from types import SimpleNamespace

    from workers import kernels, moe_kernels

    log: list[tuple[tuple[Any, str], str]] = []

    class Logged:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel
            self.name = getattr(kernel, "__name__", None) or kernel.fn.__name__

        def __getitem__(self, grid: Any) -> Any:
            launch = self.kernel[grid]

            def run(*args: Any, **kwargs: Any) -> Any:
                log.append((scopes.current, self.name))
                return launch(*args, **kwargs)
            return run

    saved = []
    for module in (kernels, moe_kernels):
        real = module._kernels
        wrapped = SimpleNamespace(**{k: Logged(v) for k, v in vars(real()).items()})
        module._kernels = (lambda w: lambda: w)(wrapped)
        saved.append((module, real))
    try:
        yield log
    finally:
        for module, real in saved:
            module._kernels = real


def _label_of(event: Any) -> tuple[Any, str] | None:
    """The label of the innermost `Scopes` range around a profiler event, if any."""
    node = event
    while node is not None:
        where, _, part = node.name.partition("/")
        if part in PARTS and (where.isdigit() or where in ("embed", "final", "head", "round")):
            return (int(where) if where.isdigit() else where, part)
        node = node.cpu_parent
    return None


def eager_kernels(fn: Callable[[], Any], scopes: Scopes
                  ) -> list[tuple[tuple[Any, str], str, float]]:
    """One eager call of `fn` under the profiler, its labels as ranges: every device kernel (and
    memset / memcpy) it ran, in device order (one stream: launch order), as (label, kernel name,
    device ms). A Triton kernel takes the label its launch was logged under (`triton_log`,
    matched in order by name), a kernel of an aten op the label around that op (the profiler
    links the two), any other ("round", "other")."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    scopes.ranges = True
    try:
        with triton_log(scopes) as launches, \
                profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    finally:
        scopes.ranges = False
    events = list(prof.events())
    ops = {e.id: e for e in events if e.device_type == DeviceType.CPU and e.id}
    device = sorted((e for e in events if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    out, pending = [], 0
    for e in device:
        label = None
        if pending < len(launches) and e.name == launches[pending][1]:   # the next Triton one
            label = launches[pending][0]
            pending += 1
        else:
            op = ops.get(getattr(e, "linked_correlation_id", 0) or -1)
            label = _label_of(op) if op is not None else None
        out.append((label or ("round", "other"), e.name, e.time_range.elapsed_us() / 1000))
    return out


def replay_kernels(fn: Callable[[], Any], replays: int) -> list[list[tuple[str, float]]]:
    """`replays` calls of `fn` (graph replays) under the profiler: per call, its device kernels
    in device order (name, ms); [] when the profiler reports none inside the graphs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    dev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    if not dev or len(dev) % replays:
        return [[(e.name, e.time_range.elapsed_us() / 1000) for e in dev]] if dev else []
    per = len(dev) // replays
    return [[(e.name, e.time_range.elapsed_us() / 1000) for e in dev[r * per:(r + 1) * per]]
            for r in range(replays)]


def label_replay(eager: list[tuple[tuple[Any, str], str, float]],
                 replay: list[tuple[str, float]]) -> tuple[list[tuple[Any, str]], float]:
    """Labels for a replay's kernels from the eager run's (kernel names matched in order,
    `difflib`); an unmatched kernel is ("round", "unmatched"). Returns (labels, the share of
    the replay's kernels matched)."""
    a = [name for _, name, _ in eager]
    b = [name for name, _ in replay]
    labels: list[tuple[Any, str]] = [("round", "unmatched")] * len(b)
    matched = 0
    for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        for j in range(block.size):
            labels[block.b + j] = eager[block.a + j][0]
            matched += 1
    return labels, matched / max(1, len(b))


def profile_gpu(args: argparse.Namespace) -> dict[str, Any]:
    from scripts.bench.common import build, static_spec
    from scripts.gen.make_checkpoint import SHAPES  # noqa: F401 (the shape's name is checked)
    from adaptive_dist.shape import token_bucket
    from workers.model.moe import MoeBlock, routed_experts
    from workers.worker.graph_table import GraphKey, GraphPhase
    from workers.worker.round_cost import TrafficRows

    cfg = model_config(args)
    deep = max(args.depths)
    dev = "cpu" if args.smoke else "cuda"
    if args.smoke:   # this flow on the CPU: the launches counted, no graphs, no device times
        from scripts.diag.count_kernels import _Counting
        _Counting.install()
    target, head = random_target(cfg, args.shape, dev, with_head=deep > 0)
    blocks = [m for m in target.modules() if isinstance(m, MoeBlock)]
    every = sum(p.numel() * p.element_size() for p in target.parameters())
    experts_all = sum(b.gate_up.stacked.numel() * b.gate_up.stacked.element_size()
                      + b.down.stacked.numel() * b.down.stacked.element_size() for b in blocks)
    expert_bytes = (experts_all // max(1, len(blocks) * cfg.moe.num_experts)) if blocks else 0
    embed = target.model.embed_tokens.weight
    row_bytes = embed.shape[1] * embed.element_size()
    batches = sorted(args.batch)
    out: dict[str, Any] = {"meta": meta(args, cfg), "bandwidth": args.bandwidth, "runs": []}
    engines = []
    if 0 in args.depths:
        engines.append((0, static_spec(0), None))
    if deep > 0:
        engines.append((deep, static_spec(deep), head))
    t0 = time.perf_counter()
    for steps, spec, eng_head in engines:
        engine = build(spec.replace(graph_buckets=tuple(batches)), target, eng_head,
                       batch=max(batches), context=args.context + args.iters * (deep + 1) + 16,
                       device=dev, graphs=not args.smoke)
        print(f"[layer_kernels] engine at depth {steps} built "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        worker = engine.worker
        depths = [0] if steps == 0 else [d for d in args.depths if d > 0]
        for depth in depths:
            for batch in batches:
                tokens = token_bucket(batch * (depth + 1), worker.ladder)
                what = "round" if steps == 0 else "verify"
                key = GraphKey(GraphPhase.TARGET, tokens=tokens)
                if steps == 0:
                    replay = worker.round_body(batch)
                    eager = worker.round_body(batch, graphs=False)
                    graphed = batch in worker.buckets
                else:
                    replay = worker.target_body(tokens)
                    eager = worker.phases.body(key, None, worker.slots.reach)
                    graphed = worker.table is not None and key in worker.table

                with TrafficRows(worker, batch, args.context,
                                 chain=args.iters + 1) as rows:
                    def stage() -> None:
                        rows.start()
                        worker.buffers.rows[:batch] = torch.arange(batch, device=dev)
                        worker.buffers.budget[:batch] = depth
                    with torch.inference_mode():
                        stage()
                        with routed_experts(target) as seen:
                            eager()
                        hits = seen.counts()
                        samples = []
                        for _ in range(args.repeats):
                            stage()
                            samples.append(clock(replay, args.iters))
                        errors = []     # a profile that fails is reported, the run goes on
                        labelled, replays = [], []
                        try:
                            stage()
                            with Scopes(target) as scopes:
                                if args.smoke:
                                    with counting(scopes) as got:
                                        eager()
                                    labelled = [(lab, op, 0.0) for lab, op in got.records]
                                else:
                                    labelled = eager_kernels(eager, scopes)
                        except Exception as e:  # noqa: BLE001 (reported by name)
                            errors.append(f"eager profile: {type(e).__name__}: {e}")
                        try:
                            stage()
                            replays = replay_kernels(replay, args.replays) if graphed else []
                        except Exception as e:  # noqa: BLE001
                            errors.append(f"replay profile: {type(e).__name__}: {e}")
                floor_bytes = (every - experts_all - embed.numel() * embed.element_size()
                               + tokens * row_bytes + sum(hits) * expert_bytes)
                floor_ms = 1000 * floor_bytes / args.bandwidth
                med = statistics.median(samples)
                run = {"what": what, "depth": depth, "batch": batch, "tokens": tokens,
                       "graph": graphed, "ms": med, "spread_ms": [min(samples), max(samples)],
                       "floor_ms": floor_ms, "over_floor": med / floor_ms,
                       "floor_gb": floor_bytes / 1e9,
                       "experts_per_layer": sum(hits) / max(1, len(hits))}
                run["eager"] = summarize([(lab, name) for lab, name, _ in labelled],
                                         [ms for _, _, ms in labelled])
                if replays:
                    labels, share = label_replay(labelled, replays[-1])
                    # device time per kernel: the median over the replays, position by position
                    per_kernel = [statistics.median(r[j][1] for r in replays
                                                    if len(r) == len(replays[-1]))
                                  for j in range(len(replays[-1]))]
                    run["replay"] = summarize(
                        [(lab, name) for lab, (name, _) in zip(labels, replays[-1])], per_kernel)
                    run["replay"]["matched_share"] = share
                    run["gap_ms"] = med - run["replay"]["kernel_ms"]
                run["errors"] = errors
                out["runs"].append(run)
                print(report_gpu(run), flush=True)
                if args.out:    # after every run: a cut-short run keeps what it measured
                    write(args.out, out)
        engine.close()
        del engine
        if not args.smoke:
            torch.cuda.empty_cache()
    out["seconds"] = time.perf_counter() - t0
    return out


def report_gpu(run: dict[str, Any]) -> str:
    name = ("depth-0 round" if run["what"] == "round" else
            f"verify forward, depth {run['depth']}")
    lines = [f"{name}, batch {run['batch']} ({run['tokens']} tokens): {run['ms']:.3f} ms "
             f"({'graph replay' if run['graph'] else 'EAGER: no graph at this shape'}), floor "
             f"{run['floor_ms']:.3f} ms ({run['floor_gb']:.2f} GB, "
             f"{run['experts_per_layer']:.1f} experts per layer), x{run['over_floor']:.2f}"]
    for error in run.get("errors", ()):
        lines.append(f"  PROFILE FAILED: {error}")
    src = run.get("replay") or run["eager"]
    if not src["kernels"]:
        return "\n".join(lines)
    kind = "graph replay" if "replay" in run else "eager run (no replay kernels reported)"
    parts = ", ".join(f"{p} {src['parts'].get(p, 0)} kernels {src['parts_ms'].get(p, 0.0):.3f} ms"
                      for p in PARTS + ("unmatched",) if p in src["parts"])
    lines.append(f"  {kind}: {src['kernels']} kernels, {src['kernel_ms']:.3f} ms of kernel time"
                 + (f", gap {run['gap_ms']:.3f} ms" if "gap_ms" in run else "")
                 + (f", {100 * src['matched_share']:.0f}% of kernels labelled"
                    if "matched_share" in src else ""))
    lines.append(f"  by part: {parts}")
    top = list(src.get("by_name", {}).items())[:12]
    if top:
        lines.append("  costliest kernels (count, ms per round): " + "; ".join(
            f"{name[:60]} x{int(n)} {ms:.3f}" for name, (n, ms) in top))
    lines += describe(src, indent="    ")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--shape", default=None,
                   help="scripts.gen.make_checkpoint's shape (default: tiny-moe on the CPU, "
                        "qwen3-30b-a3b on a GPU)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts (default: the shape's)")
    p.add_argument("--top-k", type=int, default=None,
                   help="experts per token (default: the shape's)")
    p.add_argument("--shared-expert", type=int, default=None,
                   help="a Qwen2-MoE shared expert of this width (q/k/v biases, no q/k norms)")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--depths", type=int, nargs="+", default=[0])
    p.add_argument("--context", type=int, default=1024, help="GPU: the rows' cached positions")
    p.add_argument("--iters", type=int, default=30, help="GPU: graph replays per sample")
    p.add_argument("--repeats", type=int, default=5, help="GPU: samples (the median is shown)")
    p.add_argument("--replays", type=int, default=3, help="GPU: profiled graph replays")
    p.add_argument("--bandwidth", type=float, default=3.25e12, help="GPU: bytes/s of the floor")
    p.add_argument("--smoke", action="store_true",
                   help="the GPU flow on the CPU (tiny-moe: no graphs, wall-clock times that "
                        "mean nothing, launches counted as on the CPU): a test of this script")
    p.add_argument("--out", default=None, help="write the result as JSON")
    args = p.parse_args()
    if args.shape is None:
        args.shape = "tiny-moe" if args.device == "cpu" else "qwen3-30b-a3b"
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
        result = profile_gpu(args)
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("layer_kernels --device cuda: no CUDA device")
        result = profile_gpu(args)
    else:
        result = count_cpu(args)
    if args.out:
        write(args.out, result)
    return 0


def write(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
