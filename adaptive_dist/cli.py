"""``python -m adaptive_dist``: the built-in ``consensus`` and ``config`` commands, plus commands
that other packages contribute through the ``adaptive_dist.commands`` entry-point group (each a
``register(subparsers)`` function), so this package never imports the engine."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from importlib.metadata import entry_points
from typing import Optional, Sequence

from collectives import EXIT_DIVERGENCE, EXIT_TIMEOUT, CollectiveTimeoutError, DivergenceError
from adaptive_dist.config import POLICIES, ConfigError, load_config

EXIT_CONFIG = 2
EXIT_INTERNAL = 1
log = logging.getLogger("adaptive_dist")


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every distributed command."""
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a collective may take before the job stops with an error")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="device process-group backend (auto: NCCL if every local rank has a GPU)")
    p.add_argument("--strict-lockstep", action="store_true",
                   help="debug: compare every collective across ranks before issuing it")
    p.add_argument("--record-dir", default=None,
                   help="write each rank's collective log to DIR/collectives.rank{R}.jsonl")


def register_consensus(sub) -> None:
    p = sub.add_parser("consensus", help="consensus-only mode: replay acceptance traces",
                       description="Replay per-rank acceptance traces through the adaptive "
                                   "policy and the real per-round consensus collective.")
    p.add_argument("--trace", required=True, help="directory holding rank{R}.jsonl per rank")
    p.add_argument("--policy", choices=POLICIES, default="ema")
    p.add_argument("--config", default=None, help="JSON file of adaptive settings (ema only)")
    p.add_argument("--initial-steps", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON-lines output, one line per rank per counted round")
    p.add_argument("--no-progress", action="store_true")
    add_runtime_args(p)
    p.set_defaults(handler=cmd_consensus)


def register_config(sub) -> None:
    p = sub.add_parser("config", help="validate a config file and print the effective settings")
    p.add_argument("--config", default=None)
    p.add_argument("--policy", choices=POLICIES, default="ema")
    p.add_argument("--initial-steps", type=int, default=None)
    p.set_defaults(handler=cmd_config)


def cmd_config(args) -> int:
    cfg = load_config(args.config, args.policy, args.initial_steps)
    print(json.dumps({**cfg.to_dict(), "digest": cfg.digest()}, indent=2))
    return 0


def start_distributed(args):
    """init_distributed from the torchrun environment with the shared runtime flags."""
    from collectives import init_distributed

    backend = None if args.backend == "auto" else args.backend
    return init_distributed(timeout_s=args.timeout, backend=backend, record=True,
                            strict=args.strict_lockstep, keep_log=bool(args.record_dir))


def cmd_consensus(args) -> int:
    from adaptive_dist.replay import run_consensus

    ctx = start_distributed(args)
    try:
        text = run_consensus(ctx, args.trace, args.policy, args.config, args.initial_steps,
                             args.out, show_progress=not args.no_progress)
    except Exception as exc:
        _dump_log(ctx, args)
        try:
            code = report_failure(exc)
        except Exception:  # a bug: show it, but still leave in bounded time
            traceback.print_exc()
            code = EXIT_INTERNAL
        ctx.shutdown(aborted=True)
        if ctx.distributed:
            # NOTE: the process-group teardown can block on a stuck peer; leave without it.
            os._exit(code)
        return code
    _dump_log(ctx, args)
    if text:
        print(text, flush=True)
    ctx.shutdown()
    return 0


def _dump_log(ctx, args) -> None:
    if args.record_dir and ctx.recorder is not None:
        os.makedirs(args.record_dir, exist_ok=True)
        ctx.recorder.dump(os.path.join(args.record_dir, f"collectives.rank{ctx.rank}.jsonl"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m adaptive_dist",
        description="Adaptive speculative decoding that stays in lockstep across DP/TP ranks.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register_consensus(sub)
    register_config(sub)
    for ep in entry_points(group="adaptive_dist.commands"):
        ep.load()(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_CONFIG
    try:
        return args.handler(args)
    except Exception as exc:
        return report_failure(exc)


def report_failure(exc: BaseException) -> int:
    """Print a known failure as one line naming the rank; return its exit code. Anything else
    is a bug and propagates with its traceback."""
    for kinds, label, code in (
        ((DivergenceError,), "DivergenceError", EXIT_DIVERGENCE),
        ((CollectiveTimeoutError,), "CollectiveTimeoutError", EXIT_TIMEOUT),
        ((ConfigError, ValueError, FileNotFoundError), "error", EXIT_CONFIG),
    ):
        if isinstance(exc, kinds):
            rank = os.environ.get("RANK", "0")
            # one write per line: ranks share stderr, and print() writes the newline apart
            sys.stderr.write(f"[rank {rank}] {label}: {exc}\n")
            sys.stderr.flush()
            return code
    raise exc
