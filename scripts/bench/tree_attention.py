"""Tree attention (``workers.kernels.tree_attention``): the per-(node, query head) kernel against
the tiled kernel (a tile of a row's nodes x the query heads of one KV head, ``tl.dot``, the
context split over programs and merged after), CUDA-graph replayed on one GPU (issue 35: a tree
round at 8B costs 1.4-2.2 ms more than the chain round at batch 1).

    python3 -m scripts.bench.tree_attention --out OUT          # one H200, well under a minute
    python3 -m scripts.bench.tree_attention --tiny --out OUT   # CPU smoke (numbers mean nothing)

Llama-8B heads (32 query / 8 KV heads of 128), bfloat16, pages of 16. For each rows (`--rows`,
1 4 16), nodes per row (`--nodes`, 6 8 16: the N of the 2x6, 4x8 and 4x16 trees) and context
(`--contexts`, 128 1024 4096 cached keys per row; the row's page table exactly covers it, or
`--reach` keys when larger, as the engine's graphs are captured at the configured maximum): a
random tree per row (its ancestor mask), and variants, each captured in one CUDA graph of
`inner` calls (at least 8) over distinct KV buffers (32, a Llama-8B's layers, or as many as
make 256 MB of KV, well past the L2 cache) and replayed, median of `--repeats` samples, per call:

- ``old``: ``tiled=False``, the per-(node, query head) kernel the engine ran before;
- ``tiled1``: the tiled kernel, one chunk (no merge);
- ``auto``: ``tiled=None, splits=None``, what the engine runs now
  (``kernels.tree_attention_splits`` of the static shapes).

Each configuration checks ``tiled1`` and ``auto`` against ``old`` (max abs difference; above
0.05 stops the run). Prints a line per configuration, then a table; writes
OUT/tree_attention.json (times in microseconds, per call = per layer).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

import torch

from scripts.bench.attention_split import timed
from scripts.bench.common import gpu_name, write_json

HEADS = (32, 8, 128)   # Llama-3-8B: query heads, KV heads, head dim
PAGE = 16
LAYERS = 32
L2_FLUSH = 256 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--nodes", type=int, nargs="+", default=[6, 8, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--reach", type=int, default=0,
                   help="page tables at least this many keys long (0: the context's pages)")
    p.add_argument("--iters", type=int, default=10, help="graph replays per sample")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a CPU smoke test of this script")
    p.add_argument("--out", default="runs/tree_attention")
    return p.parse_args()


def tree_mask(rows: int, nodes: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, nodes, nodes] bool: node i sees itself and its ancestors (a random tree, node 0
    the root, parents before children)."""
    mask = torch.zeros(rows, nodes, nodes, dtype=torch.bool)
    for b in range(rows):
        for i in range(nodes):
            mask[b, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                mask[b, i] |= mask[b, parent]
    return mask


class Case:
    def __init__(self, rows: int, nodes: int, context: int, reach: int, dtype: torch.dtype,
                 device: str, tiny: bool) -> None:
        hq, hkv, dim = HEADS if not tiny else (8, 2, 64)
        self.rows, self.nodes, self.context = rows, nodes, context
        pages_row = max(1, -(-max(context, reach) // PAGE))
        self.reach = pages_row * PAGE
        per_layer = 2 * rows * pages_row * PAGE * hkv * dim * torch.finfo(dtype).bits // 8
        layers = 1 if tiny else max(1, min(LAYERS, -(-L2_FLUSH // per_layer)))
        self.inner = 1 if tiny else max(8, layers)
        pool = rows * pages_row + 1
        self.kv = [(torch.randn(pool, PAGE, hkv, dim, device=device).to(dtype),
                    torch.randn(pool, PAGE, hkv, dim, device=device).to(dtype))
                   for _ in range(layers)]
        self.tree_kv = [(torch.randn(rows, nodes, hkv, dim, device=device).to(dtype),
                         torch.randn(rows, nodes, hkv, dim, device=device).to(dtype))
                        for _ in range(layers)]
        self.page_tab = (torch.randperm(pool - 1, device=device)[:rows * pages_row] + 1
                         ).view(rows, pages_row)
        self.cached = torch.full((rows,), context, dtype=torch.int64, device=device)
        gen = torch.Generator().manual_seed(rows * 1000 + nodes)
        # int8, as TreeAttention hands it over (converted once per forward)
        self.mask = tree_mask(rows, nodes, gen).to(torch.int8).to(device)
        self.q = torch.randn(rows * nodes, hq, dim, device=device).to(dtype)
        self.scale = dim ** -0.5
        self.heads = (hq, hkv, dim)

    def call(self, layer: int, tiled: bool | None, splits: int | None) -> torch.Tensor:
        from workers import kernels

        k, v = self.kv[layer % len(self.kv)]
        tk, tv = self.tree_kv[layer % len(self.tree_kv)]
        return kernels.tree_attention(self.q, k, v, self.page_tab, self.cached, tk, tv,
                                      self.mask, self.scale, tiled=tiled, splits=splits)

    def body(self, tiled: bool | None, splits: int | None) -> Callable[[], None]:
        def run() -> None:
            for i in range(self.inner):
                self.call(i, tiled, splits)
        return run


VARIANTS = {"old": (False, 1), "tiled1": (True, 1), "auto": (None, None)}


def measure(case: Case, args: argparse.Namespace, device: str, sms: int) -> dict[str, Any]:
    from workers import kernels

    hq, hkv, _ = case.heads
    us = {name: 1e6 * timed(case.body(*cfg), device, args.iters, args.repeats) / case.inner
          for name, cfg in VARIANTS.items()}
    ref = case.call(0, False, 1).float()
    diff = {name: float((case.call(0, *VARIANTS[name]).float() - ref).abs().max())
            for name in ("tiled1", "auto")}
    if max(diff.values()) > 0.05:
        raise SystemExit(f"tiled tree attention differs from the per-node kernel by {diff} at "
                         f"rows {case.rows} nodes {case.nodes} context {case.context}")
    return {"rows": case.rows, "nodes": case.nodes, "context": case.context,
            "reach": case.reach, "auto_splits": kernels.tree_attention_splits(
                case.rows, case.nodes, hq, hkv, case.reach, sms) if device == "cuda" else 1,
            "us": us, "speedup_auto": us["old"] / us["auto"], "max_abs_diff": diff,
            "inner": case.inner, "kv_buffers": len(case.kv)}


def main() -> None:
    args = parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu":
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not args.tiny:
            raise SystemExit("tree_attention: no CUDA device (use --tiny for a CPU smoke test)")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = args.rows if not args.tiny else [1]
    nodes = args.nodes if not args.tiny else [6]
    contexts = args.contexts if not args.tiny else [40]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 1
    configs = [(r, n, c) for r in rows for n in nodes for c in contexts]
    print(f"tree_attention: {len(configs)} configurations on {gpu_name(device) or 'cpu'} "
          f"({sms} SMs), heads {HEADS}, {dtype}", flush=True)
    results = []
    t0 = time.perf_counter()
    for i, (r, n, c) in enumerate(configs, 1):
        case = Case(r, n, c, args.reach, dtype, device, args.tiny)
        res = measure(case, args, device, sms)
        results.append(res)
        us = res["us"]
        print(f"[{i}/{len(configs)} {time.perf_counter() - t0:5.1f}s] rows {r} nodes {n} "
              f"context {c} reach {case.reach}: old {us['old']:.1f} us, tiled1 "
              f"{us['tiled1']:.1f} us, auto {us['auto']:.1f} us (n={res['auto_splits']}), "
              f"x{res['speedup_auto']:.1f}", flush=True)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
    print()
    print("| rows | nodes | context | old us | tiled1 us | auto us | splits | old/auto | "
          "x32 layers saved us |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        us = res["us"]
        print(f"| {res['rows']} | {res['nodes']} | {res['context']} | {us['old']:.1f} | "
              f"{us['tiled1']:.1f} | {us['auto']:.1f} | {res['auto_splits']} | "
              f"{res['speedup_auto']:.1f} | {32 * (us['old'] - us['auto']):.0f} |")
    out = Path(args.out)
    write_json(out / "tree_attention.json", {
        "device": gpu_name(device), "sms": sms, "heads": HEADS, "dtype": str(dtype),
        "page": PAGE, "results": results, "elapsed_s": time.perf_counter() - t0})
    print(f"\nwrote {out / 'tree_attention.json'}")


if __name__ == "__main__":
    main()
