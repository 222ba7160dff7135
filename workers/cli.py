"""`generate`: run prompts through the engine and print the text and acceptance statistics.

    python -m adaptive_dist generate (--prompt TEXT | --prompts FILE.jsonl) \
        [--steps K | --adaptive [--config FILE] | --no-spec] [--temperature T] [--top-p P] \
        [--max-new-tokens N] [--backend torch|flashinfer] [--seed S] [--json] [--tp N] [--model DIR]
        [--device cpu|cuda] [--eager]

Reached through the `adaptive_dist.commands` entry point (`generate = "workers.cli:register"`) or
as `python -m workers generate`. Without `--steps`, `--adaptive` or `--no-spec` it runs the static
policy at the default `initial_steps` (3). Under torchrun, `--tp N` splits the model over N ranks
(the world); every rank runs the same requests and rank 0 prints. On a CUDA device the
speculative rounds replay CUDA graphs per tier and batch bucket (`--eager` turns them off).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "tiny_pair"


# ---- arguments --------------------------------------------------------------------------------

def register(subparsers: Any) -> None:
    """Add the `generate` command to `python -m adaptive_dist`'s subparsers."""
    parser = subparsers.add_parser(
        "generate", help="generate text with (adaptive) speculative decoding",
        description="Generate text with the EAGLE engine and print acceptance statistics.")
    add_arguments(parser)
    parser.set_defaults(handler=cmd_generate)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `generate`."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", metavar="FILE.jsonl", help='one {"prompt": "..."} per line')
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--steps", type=int, metavar="K",
                      help="static speculation with K draft steps (default: 3)")
    mode.add_argument("--adaptive", action="store_true",
                      help="adaptive draft depth (EMA policy over candidate tiers)")
    mode.add_argument("--no-spec", action="store_true", help="plain decoding with the target")
    p.add_argument("--config", metavar="FILE", help="JSON file of adaptive settings (--adaptive only)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--backend", choices=("torch", "flashinfer"), default="torch",
                   help="attention backend (flashinfer needs a CUDA GPU)")
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed S+i")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (outputs and statistics) as the last line")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (under torchrun)")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="directory with target/ and eagle/ in Hugging Face layout "
                        "(default: the bundled tiny pair)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda for flashinfer, else cpu")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--eager", action="store_true",
                   help="no CUDA graphs (on a CUDA device speculative rounds replay graphs "
                        "per tier and batch bucket by default)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a collective may take under torchrun")


# ---- inputs -----------------------------------------------------------------------------------

def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt texts, in order; `ValueError` naming the line for a bad prompts file."""
    if args.prompt is not None:
        texts = [args.prompt]
    else:
        texts = _read_jsonl(Path(args.prompts))
    for i, text in enumerate(texts):
        if text == "":
            where = "--prompt" if args.prompt is not None else f"{args.prompts} prompt {i + 1}"
            raise ValueError(f"{where}: the prompt is empty; give at least one character")
    return texts


def _read_jsonl(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist")
    texts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f'{path}:{n}: expected an object {{"prompt": "<text>"}}')
        texts.append(obj["prompt"])
    if not texts:
        raise ValueError(f"{path}: no prompts in the file")
    return texts


def encode_prompt(text: str, config: Any) -> list[int]:
    """Byte ids of `text`, preceded by the model's BOS id when it has one."""
    from workers.model import tokenizer

    ids = tokenizer.encode(text)
    return ([config.bos_token_id] if config.bos_token_id is not None else []) + ids


def load_pair(root: str | Path, tp_group: Any = None, device: str = "cpu",
              with_head: bool = True) -> tuple[torch.nn.Module, Optional[torch.nn.Module]]:
    """Load `root/target` (and `root/eagle`); errors name the missing or broken file."""
    from workers.model import load_eagle, load_llama

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(root)!r} does not exist")
    target = load_llama(root / "target", tp_group=tp_group, device=device)
    head = load_eagle(root / "eagle", target) if with_head else None
    return target, head


def _sampling(args: argparse.Namespace, stop: tuple[int, ...]) -> Any:
    from workers.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                          max_new_tokens=args.max_new_tokens, stop_token_ids=stop)


def _adaptive_config(args: argparse.Namespace) -> Any:
    """None for --no-spec; else the effective config (a static K becomes a never-left candidate)."""
    from adaptive_dist.config import load_config

    if args.no_spec:
        if args.config is not None:
            raise ValueError("--config applies to --adaptive only, not to --no-spec")
        return None
    return load_config(args.config, "ema" if args.adaptive else "static", initial_steps=args.steps)


# ---- run --------------------------------------------------------------------------------------

def _distributed(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(context, tp group, dp group, lockstep guard); a single process unless launched by
    torchrun."""
    from collectives import init_distributed

    if args.tp < 1:
        raise ValueError(f"--tp {args.tp}: must be >= 1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        how = f"torchrun --nproc-per-node {args.tp} -m adaptive_dist generate --tp {args.tp} ..."
        raise ValueError(f"--tp {args.tp} needs {args.tp} processes, but this job has {world}; "
                         f"launch with: {how}")
    if world == 1:
        return None, None, None, None
    ctx = init_distributed(timeout_s=args.timeout, record=True)
    layout = ctx.layout(dp=1, tp=world)
    # NOTE: with dp=1 the DP group has size 1; the consensus runs over every rank instead, so TP
    # peers (which share the batch) still pre-flight-check their plans every round.
    return ctx, layout.group("tp"), layout.group("world"), layout.group("world")


def cmd_generate(args: argparse.Namespace) -> int:
    """Handler of `generate`."""
    from adaptive_dist.startup import agree_config
    from workers.attention import make_backend
    from workers.engine import make_engine

    device = args.device or ("cuda" if args.backend == "flashinfer" else "cpu")
    make_backend(args.backend, device)  # fail early: unknown backend, flashinfer without GPU
    texts = read_prompts(args)
    _sampling(args, ())                  # fail early: temperature, top-p, max-new-tokens
    config = _adaptive_config(args)
    ctx, tp_group, dp_group, world = _distributed(args)
    engine = None
    guard = None
    failed = True
    try:
        if ctx is not None and config is not None:
            # every rank must run the same effective configuration, or none runs
            mine = config
            config = agree_config(lambda: mine, world)
            guard = ctx.guard(world, check_every=config.lockstep_check_every)
        target, head = load_pair(args.model, tp_group, device, with_head=config is not None)
        params = _sampling(args, target.config.eos_token_ids)
        prompts = [encode_prompt(t, target.config) for t in texts]
        wcfg = _worker_config(args, target.config, prompts, config)
        engine = make_engine(target, head, adaptive_config=config,
                             backend=args.backend,
                             device=device, worker_config=wcfg, dp_group=dp_group,
                             cuda_graphs=torch.device(device).type == "cuda" and not args.eager,
                             guard=guard)
        reqs = engine.generate(prompts, params, seed=args.seed)
        if ctx is None or ctx.rank == 0:
            _report(args, texts, reqs, engine, config)
        failed = False
    finally:
        try:
            if engine is not None:
                engine.close()  # NOTE: CUDA graphs go before the process group
        finally:
            if ctx is not None:
                # after a failure skip the collective teardown: a stuck peer must not hang us
                ctx.shutdown(aborted=failed)
    return 0


def _worker_config(args: argparse.Namespace, model_config: Any, prompts: list[list[int]],
                   config: Any) -> Any:
    """Sizes for this run: a batch no larger than the prompts need (so no CUDA graphs are
    captured for buckets it can never fill) and a KV pool just large enough for that many of the
    longest request."""
    from workers.eagle_worker import WorkerConfig
    from workers.kv_cache import pages_for

    page_size, max_steps = 16, (config.max_steps if config is not None else 1)
    longest = max(len(p) for p in prompts) + args.max_new_tokens + max_steps + 1
    batch = max(1, min(args.max_batch_size, len(prompts)))
    return WorkerConfig(max_batch_size=batch, page_size=page_size,
                        max_context_len=model_config.max_position_embeddings, max_steps=max_steps,
                        num_pages=batch * pages_for(longest, page_size))


def _mode(args: argparse.Namespace, config: Any) -> str:
    if config is None:
        return "no speculation"
    if args.adaptive:
        return f"adaptive (ema over {list(config.candidate_steps)}, start {config.initial_steps})"
    return f"static steps={config.initial_steps}"


def summary(args: argparse.Namespace, reqs: list, engine: Any, config: Any) -> dict[str, Any]:
    """The JSON object of `--json` (also the source of the text table)."""
    from workers.model import tokenizer

    stats = engine.stats.to_dict()
    spec = config is not None
    pool = engine.pool.nbytes if spec else 0
    per_tier = {str(s): st.nbytes for s, st in engine.pool.states.items()} if spec else {}
    return {
        "outputs": [{"text": tokenizer.decode(r.output_ids), "token_ids": r.output_ids,
                     "finish_reason": r.finish_reason} for r in reqs],
        "mean_accept_length": stats["mean_accept_length"] if spec else None,
        "accept_histogram": stats["accept_histogram"],
        "tokens_per_second": stats["tokens_per_second"],
        "switches": stats["switches"],
        "mode": _mode(args, config), "steps_timeline": stats["steps_timeline"],
        "rounds": stats["rounds"], "generated_tokens": stats["generated_tokens"],
        "elapsed_s": stats["elapsed_s"], "runtime_state_bytes": pool,
        "runtime_state_bytes_per_tier": per_tier, "graph_rounds": stats["graph_rounds"],
    }


def _report(args: argparse.Namespace, texts: list[str], reqs: list, engine: Any, config: Any) -> None:
    out = summary(args, reqs, engine, config)
    if not args.json:
        for i, (text, item) in enumerate(zip(texts, out["outputs"])):
            print(f"=== prompt {i} ===\n{text}{item['text']}\n")
        print(stats_table(out))
    else:
        print(json.dumps(out), flush=True)


def stats_table(out: dict[str, Any]) -> str:
    """The human-readable statistics block."""
    mean = out["mean_accept_length"]
    rows = [("mode", out["mode"]), ("requests", str(len(out["outputs"]))),
            ("generated tokens", str(out["generated_tokens"])),
            ("time", f"{out['elapsed_s']:.2f} s"), ("tokens/s", f"{out['tokens_per_second']:.1f}"),
            ("rounds", str(out["rounds"])),
            ("mean accept length", "-" if mean is None else
             f"{mean:.2f} (accepted draft tokens per request per round, bonus excluded)"),
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
    """`python -m workers generate ...`: the same command without the adaptive_dist front end."""
    parser = argparse.ArgumentParser(prog="python -m workers")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(sub)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as err:
        rank = os.environ.get("RANK", "0")
        sys.stderr.write(f"[rank {rank}] error: {err}\n")  # one write: ranks share stderr
        sys.stderr.flush()
        return 2
