"""`generate`: run prompts through the engine (one process, or a DP-attention cluster under
torchrun) and print the text and acceptance statistics.

    python -m adaptive_dist generate (--prompt TEXT | --prompts FILE.jsonl) \
        [--steps K | --adaptive [--config FILE] | --no-spec] [--temperature T] [--top-p P] \
        [--max-new-tokens N] [--attention-backend torch|flashinfer] [--seed S] [--json]
        [--dp D] [--attn-tp A] [--model DIR [--draft-model DRAFT_DIR]] [--device cpu|cuda]
        [--eager] [--overlap auto|on|off]
    torchrun --nproc-per-node N -m adaptive_dist generate --dp D [--attn-tp A] ...   (N = D x A)

Plugged into `python -m adaptive_dist` through the `adaptive_dist.commands` entry point; this module
imports only the standard library at import time (so `--help` stays fast). Prompts are spread over
the DP replicas (`workers.loading`); every rank reads every prompt, the ranks agree every setting
at start-up, and rank 0 prints the outputs in prompt order and the stats table.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from typing import TYPE_CHECKING, Any, Optional, Sequence

from workers.options import add_flags, from_flags
from workers.settings import GenerateSettings, LaunchSettings, SamplingFlags

if TYPE_CHECKING:
    from workers.launch import Cluster


# ---- arguments --------------------------------------------------------------------------------

def register(subparsers: Any) -> None:
    """Add the `generate` command to `python -m adaptive_dist`'s subparsers."""
    parser = subparsers.add_parser(
        "generate", allow_abbrev=False,
        help="generate text with (adaptive) speculative decoding",
        description="Generate text with the EAGLE engine (one process, or a DP-attention cluster "
                    "under torchrun) and print acceptance statistics.")
    add_arguments(parser)
    parser.set_defaults(handler=cmd_generate)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `generate` and `serve`: model, mode, cluster shape, device, the engine's
    own (one per declaration of `workers.settings.LaunchSettings`)."""
    add_flags(p, LaunchSettings)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `generate` (one per declaration of `workers.settings.GenerateSettings`)."""
    add_flags(p, GenerateSettings)


# ---- settings ---------------------------------------------------------------------------------

def launch_settings(args: argparse.Namespace) -> LaunchSettings:
    """The engine's flags (`add_engine_arguments`), typed: the one place that reads them."""
    return from_flags(LaunchSettings, args)


def generate_settings(args: argparse.Namespace) -> GenerateSettings:
    """`generate`'s flags (`add_arguments`), typed."""
    return from_flags(GenerateSettings, args)


# ---- run --------------------------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    """Handler of `generate`: every failure is one line per rank and a documented exit code."""
    from workers.launch import run_distributed

    settings = generate_settings(args)
    return run_distributed(settings.launch, settings, _generate)


def _generate(ctx: Any, settings: GenerateSettings, closers: Any) -> Optional[str]:
    """The whole job on one rank; returns what rank 0 prints (None elsewhere)."""
    from workers.launch import start_engine
    from workers.loading import Prompt, assign_replicas, load_tokenizer_for, read_prompts

    launch, sampling = settings.launch, settings.sampling
    prompts = ([Prompt(settings.prompt)] if settings.prompt is not None
               else read_prompts(settings.prompts))
    if settings.prompt == "":
        raise ValueError("--prompt: the prompt is empty; give at least one character")
    paths = launch.model_paths()
    tok = load_tokenizer_for(paths)  # the sizes need it (checked against the model once loaded)
    encoded = [tok.encode(p.text) for p in prompts]
    sampling.params()  # refused before the model loads
    digest = hashlib.sha256(json.dumps([[p.text, p.dp_rank] for p in prompts]).encode())
    cluster = start_engine(ctx, launch, closers,
                           extra={"--temperature": sampling.temperature,
                                  "--top-p": sampling.top_p,
                                  "--max-new-tokens": sampling.max_new_tokens,
                                  "--seed": settings.seed, "--json": settings.json,
                                  "--prompt/--prompts (contents)": digest.hexdigest()[:16]},
                           size_for=lambda cfg, dp: _sizes(launch, sampling, cfg, prompts,
                                                           encoded, dp),
                           paths=paths, tokenizer=tok)
    engine, par = cluster.engine, cluster.par
    params = sampling.params(stop_token_ids=cluster.tokenizer.eos_token_ids)
    replicas = assign_replicas(prompts, cluster.config.dp)
    mine = [i for i, r in enumerate(replicas) if r == par.replica]
    reqs = engine.generate([encoded[i] for i in mine], params,
                           seeds=[settings.seed + i for i in mine])
    report = cluster.gather_report(mine, reqs)
    if report is None:
        return None
    out = summary(prompts, report, cluster)
    if settings.json:
        return json.dumps(out)
    texts = [f"=== prompt {i} ===\n{p.text}{item['text']}\n" for i, (p, item)
             in enumerate(zip(prompts, out["outputs"]))]
    return "\n".join(texts) + "\n" + stats_table(out)


def _sizes(launch: LaunchSettings, sampling: SamplingFlags, model_cfg: Any, prompts: list,
           encoded: list[list[int]], dp: int) -> dict[str, int]:
    """Engine sizes for this run, the same on every rank: a batch no larger than the busiest
    replica needs, a context (and KV reach) just long enough for the longest request."""
    from workers.loading import assign_replicas

    new = sampling.max_new_tokens
    replicas = assign_replicas(prompts, dp)
    busiest = max(replicas.count(r) for r in range(dp))
    context = model_cfg.max_position_embeddings
    for i, ids in enumerate(encoded):  # before anything is allocated
        n = len(ids)
        if n >= context or n + new > context:
            raise ValueError(f"prompt {i}: {n} prompt tokens + --max-new-tokens "
                             f"{new} = {n + new} exceeds the "
                             f"model's context of {context} tokens")
    longest = max(len(ids) for ids in encoded) + new
    return {"max_batch_size": max(1, min(launch.engine.max_batch_size, busiest)),
            "max_context_len": longest}


# ---- report -----------------------------------------------------------------------------------

def summary(prompts: list, report: dict, cluster: "Cluster") -> dict[str, Any]:
    """The JSON object of `--json` (also the source of the text table)."""
    tokenizer = cluster.tokenizer
    hist: dict[int, int] = {}
    for rep in report["replicas"]:
        for k, v in rep["accept_histogram"].items():
            hist[int(k)] = hist.get(int(k), 0) + v
    total = sum(hist.values())
    spec = cluster.config.speculative
    stats = report["replicas"][0]
    elapsed = max(rep["elapsed_s"] for rep in report["replicas"])
    generated = sum(len(o["token_ids"]) for o in report["outputs"])
    return {
        "outputs": [{"text": tokenizer.decode(o["token_ids"]), "token_ids": o["token_ids"],
                     "finish_reason": o["finish_reason"], "dp_rank": o["dp_rank"]}
                    for o in report["outputs"]],
        "mean_accept_length": (sum(k * v for k, v in hist.items()) / total if total else 0.0)
        if spec else None,
        "accept_histogram": {str(k): v for k, v in sorted(hist.items())},
        "tokens_per_second": generated / elapsed if elapsed > 0 else 0.0,
        "switches": stats["switches"], "mode": cluster.config.mode,
        "steps_timeline": stats["steps_timeline"],
        "rounds": max(rep["rounds"] for rep in report["replicas"]),
        "cluster_rounds": stats["cluster_rounds"],
        "generated_tokens": generated, "elapsed_s": elapsed,
        "runtime_state_bytes": sum(report["tier_bytes"].values()),
        "runtime_state_bytes_per_tier": report["tier_bytes"],
        "graph_rounds": max(rep["graph_rounds"] for rep in report["replicas"]),
        "dp": cluster.config.dp, "attn_tp": cluster.config.attn_tp,
        "dp_ranks": [{"dp_rank": rep["dp_rank"], "requests": rep["requests"],
                      "rounds": rep["rounds"], "mean_accept_length": rep["mean_accept_length"]
                      if spec else None, "accept_histogram": rep["accept_histogram"]}
                     for rep in report["replicas"]],
    }


def stats_table(out: dict[str, Any]) -> str:
    """The human-readable statistics block."""
    mean = out["mean_accept_length"]
    per_rank = ", ".join(f"dp {r['dp_rank']}: {r['requests']} req"
                         + ("" if r["mean_accept_length"] is None
                            else f" / {r['mean_accept_length']:.2f}") for r in out["dp_ranks"])
    rows = [("mode", out["mode"]), ("cluster", f"dp={out['dp']} x attn_tp={out['attn_tp']}"),
            ("requests", str(len(out["outputs"]))),
            ("generated tokens", str(out["generated_tokens"])),
            ("time", f"{out['elapsed_s']:.2f} s"), ("tokens/s", f"{out['tokens_per_second']:.1f}"),
            ("rounds", str(out["rounds"])),
            ("mean accept length", "-" if mean is None else
             f"{mean:.2f} (accepted draft tokens per request per round, bonus excluded)"),
            ("per DP replica", per_rank + (" (requests / mean accept)" if mean is not None else "")),
            ("tier switches", str(out["switches"])),
            ("steps timeline", ", ".join(f"round {r}: {s}" for r, s in out["steps_timeline"]) or "-"),
            ("runtime states", f"{out['runtime_state_bytes'] / 1024:.1f} KiB" + (
                " (" + ", ".join(f"steps {s}: {b / 1024:.1f} KiB" for s, b in
                                 out["runtime_state_bytes_per_tier"].items()) + ")"
                if out["runtime_state_bytes_per_tier"] else "")),
            ("CUDA-graph rounds", f"{out['graph_rounds']} of {out['rounds']}")]
    lines = ["--- stats ---"] + [f"{k:<20}{v}" for k, v in rows]
    hist = {int(k): v for k, v in out["accept_histogram"].items()}
    if hist:
        total, top = sum(hist.values()), max(hist.values())
        lines.append("accept histogram    (accept length: request-rounds)")
        for k in range(max(hist) + 1):
            n = hist.get(k, 0)
            lines.append(f"  {k:>2} {'#' * round(30 * n / top):<30} {n} ({100 * n / total:.1f}%)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`generate` without the rest of `python -m adaptive_dist` (tests call it in-process)."""
    parser = argparse.ArgumentParser(prog="python -m adaptive_dist", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.handler(args)
