"""Split-KV padded attention (``workers.kernels.padded_attention`` with ``splits``) against the
unsplit kernels, CUDA-graph replayed on one GPU: the figures that set ``kernels.SPLIT_*``.

    python3 -m scripts.bench.attention_split --out OUT        # one H200 (not yet run there)
    python3 -m scripts.bench.attention_split --tiny --out OUT # CPU smoke (numbers mean nothing)

Per head shape (``qwen3-moe``: 32 query / 4 KV heads of 128, ``llama-8b``: 32 / 8 of 128;
bfloat16, pages of 16), rows (`--rows`, default 1 4 16 64), width (`--widths`, 1 4 8: decode and
verify at depths 3 and 7) and context (`--contexts`, 256 1024 4096 cached keys per row): every row
holds `context` keys and its slots attend causally over them plus the slots before (the row's
reach = its page table = ``context + width`` rounded up to pages). Variants, each captured in
one CUDA graph of `inner` calls over distinct KV buffers (as many as a 48-layer model's layers,
or fewer when they alone overflow the L2 cache) and replayed, median of `--repeats` samples of
`--iters` replays, per call:

- ``unsplit``: ``splits=1``, the kernels that ran before (width 1: one program per row and KV
  head; widths 2..31: one per slot and query head);
- ``auto``: ``splits=None``, what the engine now runs (``kernels.attention_splits`` with the
  module's ``SPLIT_*`` constants; equal to ``unsplit`` where it picks 1);
- ``s1, s2, s4 ... s64``: the split kernel with at most that many chunks (``s1``: one chunk,
  the split kernel's tiles and the combine without a split).

`--slack-reach N` (default 4160) also times width 1 with every row's page table N keys long and
only `context` of them live, as the engine's graphs are captured (their reach is the configured
maximum; chunks past the live keys write empty states): shows what a split count chosen from the
reach costs when the context is short.

Each configuration checks ``auto`` and the best ``s`` against ``unsplit`` (max abs difference;
a difference above 0.05 stops the run). Prints a line per configuration, then a table; writes
OUT/attention_split.json (every time in microseconds) and OUT/attention_split.png (the speed-up
of ``auto`` and of the best ``s`` over ``unsplit`` against context, per shape and width, a line
per rows).

Setting the thresholds from its output (``workers/kernels.py``; the JSON's ``fit`` section lists
the same figures): for each configuration the best split count ``n*`` and its gain over
``unsplit``; ``SPLIT_BUSY`` just below the smallest unsplit program count
(``programs``, rows x tiles x KV heads) over SMs at which no split gains 5%; ``SPLIT_MIN_REACH``
the shortest reach where one gains 5%; ``SPLIT_PROGRAMS`` about the median of ``n* x programs /
SMs`` where splitting gains; ``SPLIT_MIN_CHUNK`` about the smallest ``reach / n*`` there (rounded
to 64); ``SPLIT_MAX_WIDTH`` the widest width that gains. Then re-run: ``auto`` should sit at the
best ``s`` within a few percent, and never below ``unsplit``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from scripts.bench.common import gpu_name, pyplot, save, write_json

SHAPES = {"qwen3-moe": (32, 4, 128), "llama-8b": (32, 8, 128)}   # query heads, KV heads, dim
PAGE = 16
LAYERS = 48            # KV buffers cycled per graph at most (a 48-layer model's)
L2_FLUSH = 256 << 20   # ... or as many as make this many bytes of KV (well past an H200's L2)
MAX_KV_BYTES = 12 << 30
GAIN = 1.05            # a split "gains" when unsplit / split >= this (the `fit` section)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                   help="forced split counts timed besides unsplit and auto")
    p.add_argument("--slack-reach", type=int, default=4160,
                   help="also width 1 with page tables this many keys long (0: skip)")
    p.add_argument("--iters", type=int, default=10, help="graph replays per sample")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a CPU smoke test of this script")
    p.add_argument("--out", default="runs/attention_split")
    return p.parse_args()


class Case:
    """One configuration's KV buffers, page tables, queries, and the timed callables."""

    def __init__(self, shape: tuple[int, int, int], rows: int, width: int, context: int,
                 reach: int, dtype: torch.dtype, device: str, tiny: bool) -> None:
        hq, hkv, dim = shape
        self.rows, self.width, self.context, self.shape = rows, width, context, shape
        pages_row = -(-reach // PAGE)
        self.reach = pages_row * PAGE
        per_layer = 2 * rows * pages_row * PAGE * hkv * dim * torch.finfo(dtype).bits // 8
        layers = 1 if tiny else max(1, min(LAYERS, -(-L2_FLUSH // per_layer),
                                           MAX_KV_BYTES // per_layer))
        self.inner = 1 if tiny else max(8, layers)
        pool = rows * pages_row + 1
        self.kv = [(torch.randn(pool, PAGE, hkv, dim, device=device).to(dtype),
                    torch.randn(pool, PAGE, hkv, dim, device=device).to(dtype))
                   for _ in range(layers)]
        self.page_tab = (torch.randperm(pool - 1, device=device)[:rows * pages_row] + 1
                         ).view(rows, pages_row)
        self.cached = torch.full((rows,), context, dtype=torch.int64, device=device)
        self.q = torch.randn(rows * width, hq, dim, device=device).to(dtype)
        self.scale = dim ** -0.5
        self.live_kv_bytes = 2 * rows * (context + width) * hkv * dim * torch.finfo(dtype).bits // 8

    def call(self, layer: int, splits: int | None, forced: bool) -> torch.Tensor:
        from workers import kernels

        k, v = self.kv[layer % len(self.kv)]
        if forced:     # the split kernel with at most `splits` chunks (1 too)
            out = torch.empty_like(self.q)
            kernels._split_attention(self.q, k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:]),
                                     self.page_tab, self.cached, out, self.width,
                                     self.shape[0] // self.shape[1], self.reach, PAGE,
                                     self.scale, splits)
            return out
        return kernels.padded_attention(self.q, k, v, self.page_tab, self.cached, self.width,
                                        self.scale, splits=splits)

    def body(self, splits: int | None, forced: bool) -> Callable[[], None]:
        def run() -> None:
            for i in range(self.inner):
                self.call(i, splits, forced)
        return run


def timed(fn: Callable[[], None], device: str, iters: int, repeats: int) -> float:
    """Seconds per replay of `fn` captured in a CUDA graph (on a CPU: per eager call)."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    fn()                                   # compile, warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()     # about 10 ms a sample at most: heavy cases replay fewer times
    iters = max(2, min(iters, math.ceil(0.01 / max(begin.elapsed_time(end) / 1e3, 1e-6))))
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / 1e3 / iters)
    del graph
    return statistics.median(samples)


def measure(case: Case, args: argparse.Namespace, device: str, sms: int) -> dict[str, Any]:
    from workers import kernels

    hq, hkv, _ = case.shape
    block_w, _ = kernels._split_tile(hq // hkv, case.width)
    programs = case.rows * -(-case.width // block_w) * hkv
    auto = kernels.attention_splits(case.rows, case.width, hq, hkv, case.reach, sms)
    blocks = -(-case.reach // kernels.SPLIT_BLOCK_N)
    us: dict[str, float] = {}
    us["unsplit"] = 1e6 * timed(case.body(1, False), device, args.iters, args.repeats) / case.inner
    us["auto"] = 1e6 * timed(case.body(None, False), device, args.iters,
                             args.repeats) / case.inner
    chunks: dict[str, int] = {}
    for s in args.splits:
        n = -(-case.reach // (-(-blocks // s) * kernels.SPLIT_BLOCK_N))   # chunks launched
        if f"s{n}" in us:
            continue
        us[f"s{n}"] = 1e6 * timed(case.body(s, True), device, args.iters,
                                  args.repeats) / case.inner
        chunks[f"s{n}"] = n
    best = min(chunks, key=lambda k: us[k])
    ref = case.call(0, 1, False).float()
    diff = {k: float((case.call(0, s, f).float() - ref).abs().max())
            for k, s, f in (("auto", None, False), (best, chunks[best], True))}
    if max(diff.values()) > 0.05:
        raise SystemExit(f"split attention differs from unsplit by {diff} at rows {case.rows} "
                         f"width {case.width} context {case.context}")
    return {"rows": case.rows, "width": case.width, "context": case.context,
            "reach": case.reach, "programs": programs, "auto_splits": auto,
            "best": best, "best_splits": chunks[best], "us": us, "max_abs_diff": diff,
            "live_kv_bytes": case.live_kv_bytes, "inner": case.inner, "kv_buffers": len(case.kv),
            "gb_s": {k: case.live_kv_bytes / (t * 1e-6) / 1e9 for k, t in us.items()}}


def fit(results: list[dict[str, Any]], sms: int) -> dict[str, Any]:
    """The figures the thresholds come from (docstring: 'Setting the thresholds')."""
    tight = [r for r in results if not r["slack"]]
    gains = [r for r in tight if r["us"]["unsplit"] / r["us"][r["best"]] >= GAIN
             and r["best_splits"] > 1]
    none = [r for r in tight if r not in gains]
    return {
        "gain": GAIN,
        "widths_that_gain": sorted({r["width"] for r in gains}),
        "shortest_reach_that_gains": min((r["reach"] for r in gains), default=None),
        "smallest_programs_over_sms_without_gain": min(
            (r["programs"] / sms for r in none), default=None),
        "largest_programs_over_sms_with_gain": max(
            (r["programs"] / sms for r in gains), default=None),
        "median_best_programs_over_sms": statistics.median(
            [r["best_splits"] * r["programs"] / sms for r in gains]) if gains else None,
        "smallest_best_chunk_keys": min(
            (r["reach"] // r["best_splits"] for r in gains), default=None),
        "auto_vs_best": statistics.median(
            [r["us"]["auto"] / r["us"][r["best"]] for r in tight]) if tight else None,
        "auto_slower_than_unsplit": [
            {k: r[k] for k in ("shape", "rows", "width", "context", "reach")}
            | {"ratio": r["us"]["auto"] / r["us"]["unsplit"]}
            for r in results if r["us"]["auto"] > 1.03 * r["us"]["unsplit"]],
    }


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'shape':10} {'rows':>4} {'w':>2} {'ctx':>5} {'reach':>5} {'prog':>5} "
            f"{'unsplit':>8} {'auto':>8} {'(n)':>4} {'best':>8} {'(n)':>4} {'x auto':>7} "
            f"{'x best':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        us = r["us"]
        lines.append(f"{r['shape']:10} {r['rows']:4d} {r['width']:2d} {r['context']:5d} "
                     f"{r['reach']:5d} {r['programs']:5d} {us['unsplit']:8.1f} {us['auto']:8.1f} "
                     f"{r['auto_splits']:4d} {us[r['best']]:8.1f} {r['best_splits']:4d} "
                     f"{us['unsplit'] / us['auto']:7.2f} {us['unsplit'] / us[r['best']]:7.2f}")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], shapes: list[str], widths: list[int],
         path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(shapes), len(widths), figsize=(4.2 * len(widths),
                                                              3.4 * len(shapes)),
                             squeeze=False, sharey=True)
    for i, shape in enumerate(shapes):
        for j, width in enumerate(widths):
            ax = axes[i][j]
            mine = [r for r in results if r["shape"] == shape and r["width"] == width
                    and not r["slack"]]
            for k, rows in enumerate(sorted({r["rows"] for r in mine})):
                pts = sorted((r["context"], r["us"]["unsplit"] / r["us"]["auto"],
                              r["us"]["unsplit"] / r["us"][r["best"]])
                             for r in mine if r["rows"] == rows)
                color = f"C{k}"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color,
                        label=f"{rows} rows, auto")
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=color,
                        label=f"{rows} rows, best n")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{shape}, width {width}")
            ax.set_xlabel("context (keys per row)")
            if j == 0:
                ax.set_ylabel("unsplit time / split time")
    axes[0][0].legend(fontsize=7)
    save(fig, path)


def main() -> int:
    args = parse_args()
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
        shapes = {"tiny": (8, 2, 64)}
        args.rows, args.widths, args.contexts = [1, 2], [1, 4], [200]
        args.splits, args.slack_reach, args.iters, args.repeats = [1, 2, 4], 512, 1, 1
        dtype = torch.float16
    else:
        if not torch.cuda.is_available():
            raise SystemExit("attention_split: needs a CUDA GPU (--tiny: a CPU smoke test)")
        shapes = {s: SHAPES[s] for s in args.shapes}
        dtype = torch.bfloat16
    from workers import kernels

    sms = kernels._sm_count(torch.cuda.current_device()) if device == "cuda" else 132
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    meta = {"gpu": gpu_name(device), "sms": sms, "dtype": str(dtype), "page": PAGE,
            "argv": sys.argv[1:], "constants": {k: getattr(kernels, k) for k in dir(kernels)
                                                if k.startswith("SPLIT_")}}
    plan = [(s, rows, width, ctx, ctx + width, False) for s in shapes for rows in args.rows
            for width in args.widths for ctx in args.contexts]
    if args.slack_reach:
        plan += [(s, rows, 1, ctx, args.slack_reach, True) for s in shapes for rows in args.rows
                 for ctx in args.contexts if 2 * (ctx + 1) <= args.slack_reach]
    print(f"attention_split: {len(plan)} configurations on {meta['gpu'] or 'the CPU'} "
          f"({sms} SMs), constants {meta['constants']}", flush=True)
    for i, (shape, rows, width, ctx, reach, slack) in enumerate(plan):
        case = Case(shapes[shape], rows, width, ctx, reach, dtype, device, args.tiny)
        r = {"shape": shape, "slack": slack, **measure(case, args, device, sms)}
        results.append(r)
        del case
        us = r["us"]
        print(f"[{i + 1}/{len(plan)} {time.perf_counter() - start:5.1f}s] {shape} rows {rows} "
              f"width {width} context {ctx} reach {r['reach']}{' (slack)' if slack else ''}: "
              f"unsplit {us['unsplit']:.1f} us, auto {us['auto']:.1f} us (n={r['auto_splits']}), "
              f"best {us[r['best']]:.1f} us (n={r['best_splits']})", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    report = {"meta": meta | {"seconds": time.perf_counter() - start}, "results": results,
              "fit": fit(results, sms)}
    write_json(out / "attention_split.json", report)
    plot(results, list(shapes), args.widths, out / "attention_split.png")
    print(table(results))
    print("fit:", report["fit"])
    print(f"wrote {out / 'attention_split.json'} and {out / 'attention_split.png'} "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
