"""Host work per round, without the model: the engine on a model so small (1 layer, width 8,
vocabulary 16) that a round's compute is negligible next to its Python, timed per part —
admission and retirement, the planner's begin/end (the consensus), the worker's glue around the
round's bodies, the bodies themselves (here: eager forwards of the tiny model), and the batch
commit. What this measures is the host cost that CUDA graphs do not remove; on a GPU it is the
gap between a round's GPU time and its wall time.

    python scripts/bench_host.py [--batch 16] [--policy ema] [--tokens 400] [--repeats 3] [--out DIR]

Writes `OUT/host.json` (medians and min-max over the repeats, microseconds per round) and
`OUT/host.png`.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adaptive_dist.config import load_config  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine import build_engine  # noqa: E402
from workers.model import EagleConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from workers.model.eagle import EagleHead  # noqa: E402
from workers.sampling import SamplingParams  # noqa: E402

PARTS = (("retire", "scheduler", "retire"), ("admit", "scheduler", "admit"),
         ("plan_begin", "planner", "begin_round"), ("plan_end", "planner", "end_round"),
         ("commit", "scheduler", "commit_round"), ("launch", "worker", "launch"),
         ("launch", "worker", "collect"),
         ("bodies", "worker", "_draft_phase"), ("bodies", "worker", "_verify_phase"),
         ("bodies", "worker", "_extend_phase"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--policy", default="ema", choices=("ema", "static"))
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench_host")
    return p.parse_args()


def timed(acc: collections.Counter, key: str, fn: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - start
    return run


def one_run(args: argparse.Namespace) -> dict[str, float]:
    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval()
    head = EagleHead(EagleConfig.for_target(cfg), target).eval()
    spec = load_config(None, args.policy, **({"initial_steps": 3} if args.policy == "static" else {}))
    engine = build_engine(EngineConfig(spec=spec, max_batch_size=args.batch,
                                       max_context_len=args.tokens + 32, device="cpu",
                                       cuda_graphs=False), target, head)
    acc: collections.Counter = collections.Counter()
    owners = {"scheduler": engine.scheduler, "planner": engine.planner, "worker": engine.worker}
    for key, owner, name in PARTS:
        obj = owners[owner]
        setattr(obj, name, timed(acc, key, getattr(obj, name)))
    prompts = [[3, 4, 5, 6] * 5 for _ in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.tokens)
    engine.generate(prompts, params)  # warm
    acc.clear()
    rounds0, seconds0 = engine.stats.rounds, engine.stats.round_seconds
    engine.generate(prompts, params)
    n = engine.stats.rounds - rounds0
    total = (engine.stats.round_seconds - seconds0) / n
    us = {k: 1e6 * v / n for k, v in acc.items()}
    us["worker_glue"] = us.pop("launch") - us["bodies"]   # launch + collect, bodies excluded
    us["engine_other"] = 1e6 * total - sum(us.values())
    us["host_total"] = 1e6 * total - us["bodies"]
    us["round_total"] = 1e6 * total
    return us


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    from tqdm import tqdm

    runs = [one_run(args) for _ in tqdm(range(args.repeats), desc="bench_host", unit="run")]
    keys = list(runs[0])
    summary = {k: {"median": statistics.median(r[k] for r in runs),
                   "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)} for k in keys}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"batch": args.batch, "policy": args.policy, "tokens": args.tokens,
            "repeats": args.repeats, "torch": torch.__version__, "command": " ".join(sys.argv)}
    (out / "host.json").write_text(json.dumps({"meta": meta, "us_per_round": summary,
                                               "runs": runs}, indent=1))
    for k in keys:
        s = summary[k]
        print(f"{k:<14}{s['median']:>9.0f} us/round  ({s['min']:.0f}-{s['max']:.0f})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [k for k in keys if k not in ("host_total", "round_total", "bodies")]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    med = [summary[k]["median"] for k in parts]
    err = [[m - summary[k]["min"] for k, m in zip(parts, med)],
           [summary[k]["max"] - m for k, m in zip(parts, med)]]
    ax.bar(parts, med, yerr=err, capsize=3)
    ax.set_ylabel("µs per round (median, min-max)")
    ax.set_title(f"host work per round, batch {args.batch}, {args.policy}: "
                 f"{summary['host_total']['median']:.0f} µs in all")
    ax.tick_params(axis="x", rotation=20)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "host.png", dpi=110)
    print(f"wrote {out / 'host.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
