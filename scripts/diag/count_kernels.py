"""Device kernels per phase of a speculative round, counted on a CPU (no GPU needed).

    python -m scripts.diag.count_kernels [--batch 16] [--depths 0 1 3 7] [--sampled] [--out FILE]
        [--shape tiny-moe]             # a Qwen3-MoE-layered target (random weights), not the pair
        (FILE.json and a plot next to it, FILE.png)
        [--ops]                        # also the per-op breakdown of every phase
    python -m scripts.diag.count_kernels --merge BEFORE.json AFTER.json   # one before/after table

On the GPU a round runs as CUDA graphs of many small kernels, so how many a round launches matters
as much as their work (`docs/benchmarks.md`, "Fewer kernels per round", for what the GPU
measured). This script builds the engine with the bundled pair on the CPU, makes the fused kernels of
``workers.kernels`` serve CPU tensors (``kernels.enabled`` forced on while counting; each triton
launch is recorded, not run: values do not change which ops run, and triton's interpreter would
take minutes), and calls each phase body of the worker (``draft``, ``target``, ``accept``,
``extend``: exactly what one CUDA graph of a round holds) once under ``torch.profiler``; the
table's ``verify`` column is ``target`` + ``accept`` (an earlier worker's one verify phase). It
counts:

- every triton launch of ``workers.kernels`` as one kernel (the aten ops the interpreter runs
  inside a launch are not counted);
- every aten op that launches a kernel on a device: an op with no counted op below it in the
  profiler's tree, except pure view / metadata / allocation ops (``VIEW_OPS``). A composite op
  counts what it calls (``aten::linear`` -> ``aten::mm``).

Not modelled: cuBLAS's split-K reduce kernels (a GEMM counts as one), multi-kernel CUDA
implementations of one op (sort, cumsum, searchsorted count one each), and ops the CPU
implements differently. The counts are for comparing trees, not an exact trace of a GPU.

Run it on another tree's packages (e.g. exported with ``git archive HEAD collectives
adaptive_dist workers | tar -x -C /tmp/before``) from this repository's root with
``PYTHONPATH=/tmp/before:$PWD python -P -m scripts.diag.count_kernels``: the script imports
``workers`` from the path, and ``-P`` keeps the current directory (this tree) off its front.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch  # noqa: E402

from scripts.bench.common import (  # noqa: E402
    build,
    load_pair,
    pyplot,
    random_pair,
    save,
    static_spec,
)

VIEW_OPS = frozenset(f"aten::{n}" for n in (
    "view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "expand", "expand_as",
    "t", "transpose", "permute", "unsqueeze", "squeeze", "detach", "alias", "_unsafe_view",
    "empty", "empty_strided", "empty_like", "resolve_conj", "resolve_neg", "lift_fresh",
    "numpy_T", "unflatten", "flatten", "split", "split_with_sizes", "chunk", "unbind",
    "narrow", "contiguous", "to", "_to_copy_noop", "view_as", "result_type", "is_nonzero",
    "item", "_local_scalar_dense", "size", "stride", "dim", "sym_size", "sym_stride",
    "set_", "resize_", "_has_compatible_shallow_copy_type", "new_empty", "new_empty_strided",
    "_nested_tensor_from_mask_left_aligned", "diagonal", "movedim", "swapaxes", "matrix_H",
    "type_as", "align_as", "retains_grad", "requires_grad_", "output_nr", "_version",
    "is_same_size", "broadcast_tensors", "meshgrid", "atleast_1d", "real", "imag", "conj",
))
TRITON_PREFIX = "triton::"


class _Counting:
    """While on: the fused kernels of ``workers.kernels`` serve CPU tensors, and every triton
    launch is a profiler range ``triton::<kernel>`` that does not run the kernel (float outputs
    are left as allocated, integer arguments are zeroed so ids stay in range: the phases' shapes
    and ops do not depend on values, and the interpreter would take minutes)."""

    on = False
    hooks: list = []     # called with each launch's kernel name and its programs
    installed = False
    launching = False    # inside a recorded launch

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        cls.installed = True
        from types import SimpleNamespace

        from workers import kernels

        real_enabled = kernels.enabled
        kernels.enabled = lambda x: True if cls.on else real_enabled(x)  # noqa: E731

        class Launcher:
            def __init__(self, name: str, kernel: Any) -> None:
                self.name, self.kernel = name, kernel

            def __getitem__(self, grid: Any) -> Any:
                def run(*args: Any, **kwargs: Any) -> None:
                    programs = 1
                    for g in (grid if isinstance(grid, tuple) else (grid,)):
                        programs *= int(g)
                    for hook in cls.hooks:
                        hook(self.name, programs)
                    with torch.profiler.record_function(TRITON_PREFIX + self.name):
                        cls.launching = True    # the zeroing is not the model's (no count)
                        try:
                            for a in args:  # integer outputs (tokens, lengths) stay in range
                                if isinstance(a, torch.Tensor) and not a.is_floating_point():
                                    a.zero_()
                        finally:
                            cls.launching = False
                return run

        from workers import moe_kernels

        for module in (kernels, moe_kernels):   # the MoE path's launches too (MoeBlock.fused)
            real = module._kernels()
            wrapped = SimpleNamespace(**{k: Launcher(k, v) for k, v in vars(real).items()})
            module._kernels = (lambda w: lambda: w)(wrapped)  # read at every launch


def count_events(events: list[Any]) -> Counter:
    """Kernel launches by op name in a profiler event list (see the module docstring)."""
    out: Counter = Counter()

    def walk(e: Any) -> Counter:
        if e.name.startswith(TRITON_PREFIX):
            return Counter({e.name: 1})
        below: Counter = Counter()
        for child in e.cpu_children:
            below.update(walk(child))
        if below:
            return below
        if e.name.startswith("aten::") and e.name not in VIEW_OPS:
            return Counter({e.name: 1})
        return Counter()

    for e in events:
        if e.cpu_parent is None:
            out.update(walk(e))
    return out


def profile_call(fn: Any) -> Counter:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return count_events(list(prof.events()))


def prompts(n: int) -> list[list[int]]:
    return [[256] + [(7 * i + 3 * j) % 200 + 32 for j in range(24 + i)] for i in range(n)]


def count_depth(target: Any, head: Any, depth: int, batch: int, greedy: bool) -> dict:
    from workers.sampling import SamplingParams

    engine = build(static_spec(depth), target, head if depth else None, batch=batch, context=128,
                   device="cpu")
    params = SamplingParams(max_new_tokens=3) if greedy else SamplingParams(
        max_new_tokens=3, temperature=0.8, top_p=0.9)
    # warm: fills slots, applies the runtime state (sampled requests seeded from 1)
    engine.generate(prompts(batch), params, seed=0 if greedy else 1)
    worker = engine.worker
    bufs = worker.state.payload
    if hasattr(worker, "table"):    # the worker package with its graph table (shapes)
        from workers.worker.phases import phase_key, round_phases

        phases = round_phases(bufs.steps)
        tokens = worker.default_shape(batch).verify_tokens

        def body_of(bufs: Any, phase: Any, batch: int, reach: int, greedy: bool) -> Any:
            key = phase_key(phase, batch, bufs.steps, tokens, greedy)
            return worker.phases.body(key, bufs, reach)
        reach, cache_len = worker.slots.reach, worker.slots.cache_len
        bufs.budget[:batch] = bufs.steps
    elif hasattr(worker, "phases"):   # the worker package before round shapes
        from workers.worker.phases import round_phases

        phases, body_of = round_phases(bufs.steps), worker.phases.body
        reach, cache_len = worker.slots.reach, worker.slots.cache_len
    else:                           # another tree's one-piece EagleWorker
        phases, body_of = worker._phases(bufs.steps), worker._body
        reach, cache_len = worker.slot_pages.shape[1], worker.slot_len
    lens = cache_len.clone()
    res: dict[str, Any] = {}
    with torch.inference_mode():
        bufs.rows[:batch] = torch.arange(batch)
        for phase in phases:
            body = body_of(bufs, phase, batch, reach, greedy)
            cache_len.copy_(lens)
            cache_len[:batch] = 40
            _Counting.on = True
            try:
                ops = profile_call(body)
            finally:
                _Counting.on = False
            res[str(phase)] = {"kernels": sum(ops.values()), "ops": dict(ops.most_common())}
    engine.close()
    res["round"] = sum(res[str(p)]["kernels"] for p in phases)
    if "target" in res and "verify" not in res:   # the verify column: target + acceptance
        ops = Counter(res["target"]["ops"]) + Counter(res["accept"]["ops"])
        res["verify"] = {"kernels": res["target"]["kernels"] + res["accept"]["kernels"],
                         "ops": dict(ops.most_common())}
    return res


def run(args: argparse.Namespace) -> dict:
    from workers import loading

    torch.set_num_threads(1)
    if args.shape:   # random bfloat16 weights of a named shape (scripts.gen.make_checkpoint)
        target, head = random_pair(args.shape, "eagle3", "cpu")
    else:
        target, head = load_pair(loading.DEFAULT_MODEL, "cpu")
    _Counting.install()
    out = {"meta": {"batch": args.batch, "greedy": not args.sampled, "shape": args.shape,
                    "workers": str(Path(loading.__file__).resolve().parent.parent),
                    "torch": torch.__version__}, "depths": {}}
    for depth in args.depths:
        out["depths"][str(depth)] = count_depth(target, head, depth, args.batch, not args.sampled)
    return out


def table(before: dict | None, after: dict, ops: bool = False) -> str:
    lines = [f"kernels per phase, batch {after['meta']['batch']}, "
             f"{'greedy' if after['meta']['greedy'] else 'sampled'}"
             + ("  (before -> after)" if before else "")]
    lines.append(f"{'depth':<7}{'draft':>14}{'verify':>14}{'extend':>14}{'round':>14}")
    for depth, rec in after["depths"].items():
        old = (before or {}).get("depths", {}).get(depth, {})
        cells = []
        for phase in ("draft", "verify", "extend", "round"):
            now = rec.get(phase)
            now = now["kernels"] if isinstance(now, dict) else now
            was = old.get(phase)
            was = was["kernels"] if isinstance(was, dict) else was
            if now is None:
                cells.append(f"{'-':>14}")
            elif was is None or not before:
                cells.append(f"{now:>14}")
            else:
                cells.append(f"{f'{was} -> {now}':>14}")
        lines.append(f"{('nospec' if depth == '0' else depth):<7}" + "".join(cells))
    if ops:
        for depth, rec in after["depths"].items():
            for phase in ("draft", "verify", "extend"):
                if phase in rec:
                    top = ", ".join(f"{k.split('::')[-1]} {v}" for k, v in rec[phase]["ops"].items())
                    lines.append(f"  depth {depth} {phase}: {top}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--depths", nargs="+", type=int, default=[0, 1, 3, 7])
    p.add_argument("--sampled", action="store_true", help="sampled requests (default: greedy)")
    p.add_argument("--ops", action="store_true", help="print the per-op breakdown")
    p.add_argument("--shape", default=None,
                   help="a target of this shape with random weights (scripts.gen.make_checkpoint,"
                        " e.g. tiny-moe: the Qwen3-MoE layer's kernels) instead of the bundled "
                        "pair")
    p.add_argument("--merge", nargs=2, metavar=("BEFORE", "AFTER"), default=None)
    p.add_argument("--out", default=None, help="write the counts as JSON")
    args = p.parse_args()
    if args.merge:
        before, after = (json.loads(Path(f).read_text()) for f in args.merge)
        print(table(before, after, args.ops))
        return 0
    result = run(args)
    print(table(None, result, args.ops))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        plot(result, Path(args.out).with_suffix(".png"))
    return 0


def plot(result: dict, path: Path) -> None:
    """Kernels per phase, stacked, one bar per depth."""
    plt = pyplot()
    depths = list(result["depths"])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bottom = [0] * len(depths)
    for phase in ("draft", "verify", "extend"):
        vals = [result["depths"][d].get(phase, {}).get("kernels", 0) for d in depths]
        ax.bar([("no spec" if d == "0" else d) for d in depths], vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("depth")
    ax.set_ylabel("kernels per round")
    ax.set_title(f"kernels per round, batch {result['meta']['batch']}, "
                 f"{'greedy' if result['meta']['greedy'] else 'sampled'}")
    ax.legend()
    save(fig, path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
