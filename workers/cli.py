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

from adaptive_dist.cli import seconds
from workers.loading import DEFAULT_MODEL
from workers.settings import (
    ATTENTION_BACKENDS,
    DTYPES,
    MLP_SCATTERS,
    ClusterShape,
    GenerateSettings,
    LaunchSettings,
    SamplingFlags,
    SpecChoice,
)

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
    """Flags shared by `generate` and `serve`: model, mode, cluster shape, device."""
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--steps", type=int, metavar="K",
                      help="static speculation with K draft steps (default: 3)")
    mode.add_argument("--adaptive", action="store_true",
                      help="adaptive draft depth over candidate tiers, chosen by --policy: ema "
                           "(the acceptance ladder, default) or goodput (expected tokens per "
                           "measured round cost; it may turn speculation off)")
    mode.add_argument("--no-spec", action="store_true", help="plain decoding with the target")
    p.add_argument("--policy", choices=("ema", "goodput"), default=None,
                   help="with --adaptive: ema (the acceptance ladder, default) or goodput "
                        "(expected tokens per unit of measured round cost)")
    p.add_argument("--config", metavar="FILE", help="JSON file of adaptive settings (--adaptive only)")
    p.add_argument("--per-request", action="store_true",
                   help="with --adaptive: per-request budgets — every request drafts what its own "
                        "acceptance pays for, inside a round shape (draft forwards, verify "
                        "tokens) agreed every round; implies --policy goodput")
    p.add_argument("--model-costs", metavar="FILE", default=None,
                   help="with --adaptive --policy goodput: decide on this cost table file "
                        "(docs/data/cost_tables/*.json) instead of measuring one at start-up "
                        "(a CPU run priced as the GPU the table was measured on)")
    p.add_argument("--round-log", metavar="FILE", default=None,
                   help="write one JSON line per rank per round (shape, each request's draft "
                        "and accepted tokens; docs/cli.md); with several ranks each writes "
                        "FILE with .rank<R> before its suffix")
    p.add_argument("--model", default=str(DEFAULT_MODEL), metavar="DIR",
                   help="the target: a Hugging Face directory (config.json, weights, "
                        "tokenizer.json; Llama, Qwen2, Qwen3, and the MoE families Qwen3-MoE, "
                        "Mixtral, Qwen2-MoE), or a directory holding target/ and eagle/ "
                        "(default: the bundled tiny pair)")
    p.add_argument("--draft-model", default=None, metavar="DRAFT_DIR",
                   help="the draft head: an EAGLE (our layout or the EAGLE project's) or EAGLE-3 "
                        "(SGLang's or the speculators library's layout) head directory "
                        "(default: DIR/eagle when --model DIR holds target/)")
    p.add_argument("--dp", type=int, default=1,
                   help="DP-attention replicas (each owns its requests and KV cache; default: 1)")
    p.add_argument("--attn-tp", type=int, default=None,
                   help="ranks that split one replica's attention (default: world / dp)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="plain tensor parallelism over N ranks (the same as --dp 1 --attn-tp N)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda for --attention-backend flashinfer, else cpu")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="torch",
                   help="attention of the ragged prefill forwards, those beyond "
                        "--padded-prefill-tokens (flashinfer needs a CUDA GPU; default: torch)")
    p.add_argument("--padded-prefill-tokens", type=int, default=4096, metavar="N",
                   help="a prefill of at most N token slots (requests bucket x longest-prompt "
                        "bucket) runs padded, as a CUDA graph per shape (0: every prefill ragged; "
                        "default: 4096)")
    p.add_argument("--catchup-rounds", type=int, default=32, metavar="N",
                   help="at depth 0 (a goodput policy's plain rounds) the draft head's cache "
                        "lags up to N rounds, then one head forward catches it up (default: 32)")
    p.add_argument("--defer-prefill-width", type=int, default=256, metavar="N",
                   help="at depth 0 with a draft head, a padded prefill whose longest prompt fits "
                        "N token slots leaves the head's part to the next catch-up (0: never; "
                        "default: 256)")
    p.add_argument("--max-batch-size", type=int, default=16, metavar="B",
                   help="requests per replica at once (default: 16)")
    p.add_argument("--eager", action="store_true",
                   help="no CUDA graphs (on a CUDA device speculative rounds replay graphs "
                        "per tier and batch bucket by default)")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="launch round r+1 before reading round r, so the host's bookkeeping runs "
                        "while the GPU computes (auto, the default: on with CUDA)")
    p.add_argument("--mlp-scatter", choices=MLP_SCATTERS, default="reduce_scatter",
                   help="how MLP outputs return to the DP replicas (the same values; default: "
                        "reduce_scatter)")
    p.add_argument("--moe-parallel", choices=("tp", "ep"), default="tp",
                   help="a MoE target's experts: every rank a slice of every expert's width (tp), "
                        "or E/world whole experts per rank (ep); the same collectives either way "
                        "(default: tp)")
    p.add_argument("--timeout", type=seconds, default=60.0, metavar="S",
                   help="seconds a collective may take before the job stops with an error; a "
                        "finite number > 0 (default: 60)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the weights' and the KV cache's dtype: auto (the default) loads a "
                        "checkpoint in its own dtype (config.json's torch_dtype) on CUDA and in "
                        "float32 on the CPU")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=None, metavar="F",
                   help="the fraction of the GPU's total memory this engine may use; the KV "
                        "pool gets what is left after the weights, the activations and the CUDA "
                        "graphs, at most what --max-batch-size full contexts need (default: "
                        "that pool); CUDA only")
    p.add_argument("--kv-cache-memory", type=byte_count, default=None, metavar="BYTES",
                   help="the KV pool's size per rank, in bytes or with a K, M, G or T suffix "
                        "(powers of 1024), at most what --max-batch-size full contexts need "
                        "(default: that pool); not with --gpu-memory-utilization")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `generate`."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help='one {"prompt": "...", "dp_rank": k (optional)} per line')
    add_engine_arguments(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass, in (0, 1] (default: 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens to generate per prompt at most, >= 1; a prompt also ends at the "
                        "model's end-of-sequence token (default: 128)")
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed S+i (default: 0)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (outputs and statistics) as the last line")


def fraction(text: str) -> float:
    """argparse type of `--gpu-memory-utilization`: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a fraction in (0, 1] of the GPU's "
                                         f"total memory")
    return value


def byte_count(text: str) -> int:
    """argparse type of `--kv-cache-memory`: bytes, or a number with K/M/G/T."""
    from workers.memory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# ---- settings ---------------------------------------------------------------------------------

def launch_settings(args: argparse.Namespace) -> LaunchSettings:
    """The engine's flags (`add_engine_arguments`), typed: the one place that reads them."""
    return LaunchSettings(
        model=args.model, draft_model=args.draft_model,
        shape=ClusterShape(dp=args.dp, attn_tp=args.attn_tp, tp=args.tp),
        spec=SpecChoice(steps=args.steps, adaptive=args.adaptive, no_spec=args.no_spec,
                        policy=args.policy, config=args.config,
                        per_request=args.per_request, model_costs=args.model_costs),
        device=args.device, attention_backend=args.attention_backend,
        padded_prefill_tokens=args.padded_prefill_tokens, catchup_rounds=args.catchup_rounds,
        defer_prefill_width=args.defer_prefill_width, max_batch_size=args.max_batch_size,
        eager=args.eager, overlap=args.overlap, mlp_scatter=args.mlp_scatter,
        moe_parallel=args.moe_parallel, timeout=args.timeout, round_log=args.round_log,
        dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory)


def generate_settings(args: argparse.Namespace) -> GenerateSettings:
    """`generate`'s flags (`add_arguments`), typed."""
    return GenerateSettings(
        launch=launch_settings(args), prompt=args.prompt, prompts=args.prompts,
        sampling=SamplingFlags(temperature=args.temperature, top_p=args.top_p,
                               max_new_tokens=args.max_new_tokens),
        seed=args.seed, json=args.json)


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
    return {"max_batch_size": max(1, min(launch.max_batch_size, busiest)),
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
