"""Where a speculative round's time goes: tokens/s, round wall time, GPU kernel time per round and
host synchronisations per round, per batch, depth and prompt regime.

    python -m scripts.bench.hotpath [--device cuda] [--model DIR [--draft-model DIR]]
        [--batches 1 16 64] [--modes nospec 1 3 7 [7+serial 7+overlap ...]] [--overlap auto|on|off]
        [--new-tokens 48] [--repeats 3] [--label after] [--out DIR]
    python -m scripts.bench.hotpath --merge BEFORE.json AFTER.json --out DIR   # one table

A mode is a depth (`nospec` or steps), with `--overlap` (default: on with CUDA), or with a
`+serial` / `+overlap` suffix that sets it for that mode (so both run interleaved in one process).
One engine per mode (torch attention; CUDA graphs on a GPU, eager on a CPU), built once and
warmed on every batch shape. Timed runs are interleaved over the repeats (every configuration
once per repeat); tokens/s and round wall time are medians with min-max. Then one profiled run
per configuration (torch.profiler): the sum of CUDA kernel time divided by the rounds (GPU kernel
time per round), its ratio to the round's wall time, and the host synchronisations per round
(`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize` calls) and
device-to-host copies. Writes `OUT/<label>.json` and `OUT/hotpath.png`; `--merge` writes
`OUT/before_after.json`, `OUT/before_after.png` and prints the table the hot-path issue asks for.
The profiled run also splits the device's idle time between consecutive kernels (ms per round):
gaps under 5 us (the device's own latency between graph nodes) and longer ones (the device waited
for the host; the profiler's own host overhead makes these larger than in an unprofiled run).

A whole run's rounds include the prefill and the last rounds, where the batch empties (with few
new tokens per request and a deep tier, these are most of the run). `--steady-rounds N` (default
32, 0: off) also times decode rounds alone: every request admitted and prefilled, none able to
finish within the window (their budget exceeds it), `N` rounds after 4 warm ones, on the same
engines and interleaved with the whole runs; then one profiled window per configuration. Those
are the `steady_*` fields: round wall time, GPU kernel time per round and their ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from scripts.bench.common import (KINDS, add_overlap_argument, build, encode_prompts, gpu_name,
                                  load_pair, make_prompts, overlap_of, pyplot, save,
                                  settle_heap, spread, static_spec, sync, tokenizer, write_json)

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--modes", nargs="+", default=["nospec", "1", "3", "7"])
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--label", default="after")
    p.add_argument("--model", default=None, help="default: the bundled pair")
    p.add_argument("--draft-model", default=None, help="draft head directory (as generate)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--steady-rounds", type=int, default=32,
                   help="decode rounds per steady window (0: no steady measurement)")
    add_overlap_argument(p)
    p.add_argument("--merge", nargs=2, metavar=("BEFORE", "AFTER"), default=None)
    p.add_argument("--out", default="runs/bench_hotpath")
    args = p.parse_args()
    if args.steady_rounds < 0:
        p.error(f"--steady-rounds {args.steady_rounds}: must be >= 0 (0: no steady windows)")
    return args


def mode_engine(mode: str, target: Any, head: Any, device: str, max_batch: int, context: int,
                extra: dict) -> Any:
    """The engine of a `--modes` entry (a depth, `nospec`, either with `+serial`/`+overlap`)."""
    if mode.endswith(("+overlap", "+serial")):  # this mode with overlap forced on / off
        mode, how = mode.split("+")
        extra = {"overlap": True} if how == "overlap" else {}
    return build(static_spec(mode), target, head, batch=max_batch, context=context,
                 device=device, graphs=device == "cuda", **extra)


def timed(engine: Any, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    from workers.sampling import SamplingParams

    rounds0 = engine.stats.rounds
    sync(device)
    start = time.perf_counter()
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    sync(device)
    wall = time.perf_counter() - start
    rounds = max(engine.stats.rounds - rounds0, 1)
    tokens = sum(len(r.output_ids) for r in reqs)
    spec = sum(getattr(r, "spec_rounds", 0) for r in reqs)
    accepted = sum(getattr(r, "accepted", 0) for r in reqs)
    if not spec and hasattr(reqs[0], "accept_lengths"):  # an older engine (the "before" tree)
        spec = sum(len(r.accept_lengths) for r in reqs)
        accepted = sum(sum(r.accept_lengths) for r in reqs)
    return {"tokens_per_second": tokens / wall, "round_ms": 1000 * wall / rounds,
            "rounds": rounds, "accept": accepted / spec if spec else None}


def profiled(engine: Any, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    """One run under the profiler: kernel time, syncs and device-to-host copies per round."""
    from torch.profiler import ProfilerActivity, profile

    from workers.sampling import SamplingParams

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    rounds0 = engine.stats.rounds
    sync(device)
    start = time.perf_counter()
    with profile(activities=acts) as prof:
        engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
        sync(device)
    wall = time.perf_counter() - start
    rounds = max(engine.stats.rounds - rounds0, 1)
    kernel_us = syncs = d2h = kernels = 0.0
    by_name: dict[str, list[float]] = {}
    spans: list[tuple[float, float]] = []
    for e in prof.events():
        if device == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time if hasattr(e, "device_time") else e.cuda_time
            kernel_us += us
            kernels += 1
            spans.append((e.time_range.start, e.time_range.end))
            entry = by_name.setdefault(e.name[:90], [0.0, 0])
            entry[0] += us
            entry[1] += 1
        elif e.name in SYNC_CALLS:
            syncs += 1
        elif e.name == "Memcpy DtoH (Device -> Pinned)" or e.name == "Memcpy DtoH (Device -> Pageable)":
            d2h += 1
    short_us, long_us = idle_gaps(spans)
    return {"idle_short_ms_per_round": short_us / 1000 / rounds,
            "idle_long_ms_per_round": long_us / 1000 / rounds,
            "gpu_kernel_ms_per_round": kernel_us / 1000 / rounds,
            "gpu_kernels_per_round": kernels / rounds,
            "top_kernels": [{"name": n, "us_per_round": t / rounds, "per_round": c / rounds}
                            for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]],
            "profiled_round_ms": 1000 * wall / rounds,
            "gpu_busy_profiled": (kernel_us / 1e6) / wall if wall > 0 else None,
            "host_syncs_per_round": syncs / rounds, "d2h_copies_per_round": d2h / rounds}


STEADY_WARM = 4  # rounds run before a steady window (the first prefills)


def steady_budget(mode: str, rounds: int) -> int:
    """New tokens per request so that no request can finish within a steady window of `rounds`
    (a round commits at most steps + 1 tokens per request)."""
    steps = 0 if mode.split("+")[0] == "nospec" else int(mode.split("+")[0])
    return (STEADY_WARM + rounds + 2) * (steps + 1)


def steady(engine: Any, prompts: list[list[int]], mode: str, rounds: int, device: str,
           profiler: Any = None) -> dict:
    """Decode rounds alone: admit and prefill `prompts`, run warm rounds, time `rounds` rounds
    (under `profiler` when given: a started-not-entered torch profiler), then abort the requests
    and let the engine retire them. Raises if a request finished inside the window."""
    from workers.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=steady_budget(mode, rounds))
    reqs = [engine.add(p, params, seed=i) for i, p in enumerate(prompts)]
    for _ in range(STEADY_WARM):
        engine.step()
    if engine.scheduler.waiting or len(engine.scheduler.running) != len(reqs):
        raise RuntimeError("steady window: not every request is running after the warm rounds")
    sync(device)
    if profiler is not None:
        profiler.__enter__()
    start = time.perf_counter()
    for _ in range(rounds):
        engine.step()
    sync(device)
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.__exit__(None, None, None)
    if any(r.finished for r in reqs):
        raise RuntimeError("steady window: a request finished inside it (budget too small)")
    for r in reqs:
        engine.abort(r.rid)
    engine.run()
    return {"round_ms": 1000 * wall / rounds, "wall_s": wall}


def steady_profiled(engine: Any, prompts: list[list[int]], mode: str, rounds: int,
                    device: str) -> dict:
    """One steady window under the profiler: GPU kernel time per decode round."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=acts)
    steady(engine, prompts, mode, rounds, device, profiler=prof)
    kernel_us, spans = 0.0, []
    for e in prof.events():
        if device == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += e.device_time if hasattr(e, "device_time") else e.cuda_time
            spans.append((e.time_range.start, e.time_range.end))
    short_us, long_us = idle_gaps(spans)
    return {"steady_gpu_kernel_ms_per_round": kernel_us / 1000 / rounds,
            "steady_idle_short_ms_per_round": short_us / 1000 / rounds,
            "steady_idle_long_ms_per_round": long_us / 1000 / rounds}


SHORT_GAP_US = 5.0


def idle_gaps(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """The device's idle time between consecutive kernels (profiler timeline, microseconds),
    split at SHORT_GAP_US: short gaps are the device's own launch and dependency latency between
    graph nodes; long ones are waits for work the host had not queued yet."""
    short = long = 0.0
    end = None
    for start, stop in sorted(spans):
        if end is not None and start > end:
            gap = start - end
            if gap < SHORT_GAP_US:
                short += gap
            else:
                long += gap
        end = stop if end is None else max(end, stop)
    return short, long


def busy(rec: dict) -> dict:
    """GPU busy share of a round: the profiled GPU kernel time per round over the (unprofiled)
    median round wall time — the profiler's own host overhead would otherwise count as idle."""
    kernel = rec.get("gpu_kernel_ms_per_round")
    rec["gpu_busy"] = kernel / rec["round_ms"]["median"] if kernel else None
    kernel = rec.get("steady_gpu_kernel_ms_per_round")
    if kernel and rec.get("steady_round_ms"):
        rec["steady_gpu_busy"] = kernel / rec["steady_round_ms"]["median"]
    return rec


def run(args: argparse.Namespace) -> dict:
    from workers import loading

    torch.set_num_threads(1 if args.device == "cpu" else 4)
    model = args.model or loading.DEFAULT_MODEL
    if hasattr(loading, "load_tokenizer_for"):  # an older tree (the "before" run) has neither
        target, head = load_pair(model, args.device, draft=args.draft_model)
        encode = tokenizer(model, args.draft_model, target.config.vocab_size).encode
    else:
        target, head = loading.load_pair(model, device=args.device)
        encode = lambda text: loading.encode_prompt(text, target.config)  # noqa: E731
    if args.dtype != "float32":
        dtype = getattr(torch, args.dtype)
        target, head = target.to(dtype), head.to(dtype)
        target.reset_buffers()
        head.reset_buffers()
    texts = make_prompts(max(args.batches), seed=0)
    prompts = encode_prompts(texts, encode)
    budget = max([args.new_tokens] + [steady_budget(m, args.steady_rounds) for m in args.modes
                                      if args.steady_rounds])
    context = max(len(p) for ps in prompts.values() for p in ps) + budget + 1
    extra = overlap_of(args, args.device)
    engines = {m: mode_engine(m, target, head, args.device, max(args.batches), context, extra)
               for m in args.modes}
    for engine in engines.values():  # warm every batch shape
        for b in args.batches:
            timed(engine, prompts["code"][:b], 4, args.device)
    settle_heap()
    configs = [(m, k, b) for m in args.modes for k in KINDS for b in args.batches]
    samples: dict[tuple, list[dict]] = {c: [] for c in configs}
    from tqdm import tqdm

    windows: dict[tuple, list[dict]] = {c: [] for c in configs}
    per_config = 2 if args.steady_rounds else 1
    bar = tqdm(total=(args.repeats + (0 if args.no_profile else 1)) * len(configs) * per_config,
               desc=f"bench_hotpath ({args.label})", unit="run")
    for rep in range(args.repeats):
        shift = rep % len(configs)
        for m, k, b in configs[shift:] + configs[:shift]:
            samples[(m, k, b)].append(timed(engines[m], prompts[k][:b], args.new_tokens,
                                            args.device))
            bar.update()
            if args.steady_rounds:
                windows[(m, k, b)].append(steady(engines[m], prompts[k][:b], m,
                                                 args.steady_rounds, args.device))
                bar.update()
    records = []
    for (m, k, b), runs in samples.items():
        rec = {"mode": m, "prompts": k, "batch": b,
               "tokens_per_second": spread([r["tokens_per_second"] for r in runs]),
               "round_ms": spread([r["round_ms"] for r in runs]), "accept": runs[0]["accept"]}
        if args.steady_rounds:
            rec["steady_round_ms"] = spread([w["round_ms"] for w in windows[(m, k, b)]])
        if not args.no_profile:
            rec.update(profiled(engines[m], prompts[k][:b], args.new_tokens, args.device))
            bar.update()
            if args.steady_rounds:
                rec.update(steady_profiled(engines[m], prompts[k][:b], m, args.steady_rounds,
                                           args.device))
                bar.update()
        busy(rec)
        records.append(rec)
    bar.close()
    for engine in engines.values():
        engine.close()
    meta = {"label": args.label, "device": args.device, "overlap": bool(extra),
            "gpu": gpu_name(args.device),
            "torch": torch.__version__, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "dtype": args.dtype, "steady_rounds": args.steady_rounds,
            "command": " ".join(sys.argv)}
    return {"meta": meta, "records": records}


def table(before: dict | None, after: dict) -> str:
    def key(r: dict) -> tuple:
        return (r["mode"], r["prompts"], r["batch"])

    old = {key(r): busy(r) for r in (before or {}).get("records", [])}
    for r in after["records"]:
        busy(r)
    head = (f"{'mode':<11}{'prompts':<14}{'batch':>6}{'tok/s':>10}{'before':>9}{'round ms':>10}"
            f"{'GPU ms':>8}{'busy':>7}{'before':>8}{'kernels':>9}{'before':>8}{'syncs':>7}"
            f"{'before':>8}{'idle<5us':>9}{'idle>=5us':>10}{'steady ms':>10}{'GPU ms':>8}"
            f"{'busy':>6}")
    lines = [head]
    for r in after["records"]:
        b = old.get(key(r), {})
        share = r.get("gpu_busy")
        lines.append(
            f"{r['mode']:<11}{r['prompts']:<14}{r['batch']:>6}"
            f"{r['tokens_per_second']['median']:>10.0f}"
            f"{b.get('tokens_per_second', {}).get('median', float('nan')):>9.0f}"
            f"{r['round_ms']['median']:>10.2f}{r.get('gpu_kernel_ms_per_round', float('nan')):>8.2f}"
            f"{(100 * share if share is not None else float('nan')):>6.0f}%"
            f"{100 * (b.get('gpu_busy') or float('nan')):>7.0f}%"
            f"{r.get('gpu_kernels_per_round', float('nan')):>9.0f}"
            f"{b.get('gpu_kernels_per_round', float('nan')):>8.0f}"
            f"{r.get('host_syncs_per_round', float('nan')):>7.1f}"
            f"{b.get('host_syncs_per_round', float('nan')):>8.1f}"
            f"{r.get('idle_short_ms_per_round', float('nan')):>9.2f}"
            f"{r.get('idle_long_ms_per_round', float('nan')):>10.2f}"
            f"{r.get('steady_round_ms', {}).get('median', float('nan')):>10.2f}"
            f"{r.get('steady_gpu_kernel_ms_per_round', float('nan')):>8.2f}"
            f"{100 * (r.get('steady_gpu_busy') or float('nan')):>5.0f}%")
    return "\n".join(lines)


def plot(before: dict | None, after: dict, path: Path) -> None:
    plt = pyplot()
    batches = sorted({r["batch"] for r in after["records"]})
    modes = list(dict.fromkeys(r["mode"] for r in after["records"]))
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for label, data, off in (("before", before, -0.2), ("after", after, 0.2)):
            if data is None:
                continue
            ys = [statistics.mean([r["tokens_per_second"]["median"] for r in data["records"]
                                   if r["batch"] == b and r["mode"] == m] or [0.0])
                  for m in modes]  # 0: a mode the other run did not have
            ax.bar([i + off for i in range(len(modes))], ys, 0.4, label=label)
        ax.set_xticks(range(len(modes)), [f"steps {m}" if m != "nospec" else "no spec"
                                          for m in modes])
        ax.set_title(f"batch {b} (tokens/s, mean over the prompt regimes)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend()
    save(fig, path)


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        before, after = (json.loads(Path(p).read_text()) for p in args.merge)
        write_json(out / "before_after.json", {"before": before, "after": after})
        plot(before, after, out / "before_after.png")
        print(table(before, after))
        return 0
    result = run(args)
    write_json(out / f"{args.label}.json", result)
    plot(None, result, out / "hotpath.png")
    print(table(None, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
