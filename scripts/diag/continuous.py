"""Diagnostic: where a continuous-arrival phase spends its time, per engine (no speculation,
static 1 and 3, goodput, and goodput held at depth 0): each engine step timed and sorted into
admission rounds (a prefill ran) and plain rounds, with the graph path and padded batches seen;
and one short request end to end.

    python -m scripts.diag.continuous [cuda|cpu] [BATCH] [OUT.json]

4 x BATCH prompts per regime (high_entropy, code), 64 new tokens each, at most BATCH in flight
(`scripts.bench.common.run_continuous`, as `scripts.bench.adaptive --waves` runs them), three
passes (the last is reported). Writes OUT.json and OUT.png (milliseconds per admission round and
per plain round, per engine and regime)."""
from __future__ import annotations

import argparse
import json
import os
import statistics as st
import sys
import time
from typing import Any

from adaptive_dist.config import AdaptiveConfig
from scripts.bench.common import (build, encode_prompts, held_at_zero, load_pair, make_prompts,
                                  pyplot, run_continuous, save, static_spec, sync, write_json)
from workers.loading import DEFAULT_MODEL, encode_prompt
from workers.sampling import SamplingParams

KINDS = ("high_entropy", "code")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("device", nargs="?", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("batch", nargs="?", type=int, default=16, help="requests in flight at most")
    p.add_argument("out", nargs="?", default="runs/diag_continuous.json",
                   help="the JSON file (the plot goes beside it, .png)")
    return p.parse_args()


def specs() -> dict[str, Any]:
    return {"static0": static_spec(0), "static1": static_spec(1), "static3": static_spec(3),
            "goodput": AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3, 7),
                                      initial_steps=1, warmup_batches=4, update_interval=2,
                                      ema_alpha=0.3),
            # the goodput engine held at depth 0 (bench.adaptive's depth0_head): against static0
            # it prices the head's share of each prefill (admission rounds) and the catch-up's
            # (plain)
            "depth0_head": held_at_zero(7)}


def diagnose(engine: Any, enc: dict[str, list[list[int]]], batch: int,
             dev: str) -> dict[str, Any]:
    """The engine's steps over continuous arrivals of each regime, and one short request."""
    rows: list[tuple] = []
    orig = engine.step

    def step(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        r = orig(*a, **k)
        p = engine.last_plan
        rows.append((p.extend_requests, p.extend_tokens, p.use_graph, p.batch_pad, p.steps,
                     time.perf_counter() - t0))
        return r
    engine.step = step
    res: dict[str, Any] = {}
    for kind in KINDS:
        for _ in range(3):
            rows.clear()
            sync(dev)
            t0 = time.perf_counter()
            reqs = run_continuous(engine, enc[kind][:4 * batch], batch,
                                  SamplingParams(max_new_tokens=64))
            sync(dev)
            wall = time.perf_counter() - t0
        adm = [r for r in rows if r[0]]
        plain = [r for r in rows if not r[0]]
        res[kind] = {"wall_ms": 1e3 * wall, "tokens": sum(len(r.output_ids) for r in reqs),
                     "rounds": len(rows), "admission_rounds": len(adm),
                     "admitted_per_round": st.mean(r[0] for r in adm) if adm else 0,
                     "adm_ms_median": 1e3 * st.median(r[5] for r in adm) if adm else 0,
                     "adm_ms_sum": 1e3 * sum(r[5] for r in adm),
                     "plain_ms_median": 1e3 * st.median(r[5] for r in plain) if plain else 0,
                     "plain_ms_sum": 1e3 * sum(r[5] for r in plain),
                     "eager_rounds": sum(1 for r in rows if not r[2]),
                     "pads": sorted({r[3] for r in rows}), "steps": sorted({r[4] for r in rows})}
    # one prefill of one request, timed alone
    ts = []
    for _ in range(5):
        engine.add(enc["code"][0], SamplingParams(max_new_tokens=2))
        sync(dev)
        t0 = time.perf_counter()
        engine.run()
        sync(dev)
        ts.append(1e3 * (time.perf_counter() - t0))
    res["one_request_2_tokens_ms"] = st.median(ts)
    return res


def plot(out: dict[str, Any], batch: int, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{n}\n{k}" for n in out for k in KINDS]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [out[n][k]["adm_ms_median"] for n in out for k in KINDS],
           width=0.4, label="admission round (median ms)")
    ax.bar([i + 0.2 for i in x], [out[n][k]["plain_ms_median"] for n in out for k in KINDS],
           width=0.4, label="plain round (median ms)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"continuous arrivals, batch {batch}: host time per engine step")
    save(fig, path)


def main() -> int:
    args = parse_args()
    dev, batch = args.device, args.batch
    t, h = load_pair(str(DEFAULT_MODEL), dev, half=dev == "cuda")
    enc = encode_prompts(make_prompts(4 * batch, seed=2), lambda x: encode_prompt(x, t.config))
    ctx = max(len(p) for ps in enc.values() for p in ps) + 65
    out = {}
    for name, spec in specs().items():
        e = build(spec, t, h, batch=64, context=ctx, device=dev, graphs=dev == "cuda",
                  overlap=dev == "cuda")
        e.warmup()
        out[name] = diagnose(e, enc, batch, dev)
        print(name, json.dumps(out[name]), flush=True)
        e.close()
    write_json(args.out, out)
    plot(out, batch, os.path.splitext(args.out)[0] + ".png")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
