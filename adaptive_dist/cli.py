"""``python -m adaptive_dist``: the built-in ``consensus`` and ``config`` commands, plus commands
that other packages contribute through the ``adaptive_dist.commands`` entry-point group (each a
``register(subparsers)`` function), so this package never imports the engine.

Importing this module does not import torch (``--help`` stays fast); commands import it when they
run. Every failure a user can cause ends as one line per rank, ``[rank R] Kind: message``, with
the exit codes of ``EXIT_*``; Ctrl-C ends every rank with one line and exit code 130.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from importlib.metadata import entry_points
from typing import Any, NoReturn, Optional, Sequence

from adaptive_dist.config import POLICIES, load_config
from adaptive_dist.failures import (  # the failure path lives in the library; named here too
    EXIT_CONFIG,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    describe_failure,
    fail_distributed,
    rank_label,
    report_failure,
    say,
)

__all__ = ["EXIT_CONFIG", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "Parser", "build_parser",
           "describe_failure", "fail_distributed", "main", "rank_label", "report_failure", "say",
           "seconds"]


# ---- arguments --------------------------------------------------------------------------------

def seconds(text: str) -> float:
    """argparse type of ``--timeout``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number of seconds > 0")
    return value


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``[rank R] error: ...``, exit 2). Under a
    distributed launch the rank also tells its peers, so they stop with the same line instead of
    waiting for it to join."""

    def error(self, message: str) -> NoReturn:
        text = f"{self.prog}: {message} (see --help)"
        if _launched_distributed():
            from collectives.distributed import announce_startup_failure

            agreed = announce_startup_failure(text)
            text = str(agreed) if agreed is not None else text
        say(f"error: {text}")
        sys.exit(EXIT_CONFIG)


def _launched_distributed() -> bool:
    return os.environ.get("WORLD_SIZE", "1") not in ("", "1") or bool(os.environ.get("MASTER_ADDR"))


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every distributed command."""
    p.add_argument("--timeout", type=seconds, default=60.0, metavar="S",
                   help="seconds a collective (and the start-up join) may take before the job "
                        "stops with an error; a finite number > 0 (default: 60)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="device process-group backend (auto, the default: NCCL if every local "
                        "rank has a GPU, else gloo)")
    p.add_argument("--strict-lockstep", action="store_true",
                   help="debug: compare every collective across ranks before issuing it")
    p.add_argument("--record-dir", default=None, metavar="DIR",
                   help="write each rank's collective log to DIR/collectives.rank{R}.jsonl")


def register_consensus(sub: Any) -> None:
    p = sub.add_parser("consensus", help="consensus-only mode: replay acceptance traces",
                       allow_abbrev=False,
                       description="Replay per-rank acceptance traces through the adaptive "
                                   "policy and the real per-round consensus collective.")
    p.add_argument("--trace", required=True, metavar="DIR",
                   help="directory holding rank{R}.jsonl for every rank R (and no other rank)")
    p.add_argument("--policy", choices=POLICIES, default="ema",
                   help="ema: adapt the depth to the acceptance (default); goodput: the depth "
                        "with the most expected tokens per unit of round cost (needs round_cost "
                        "in --config); static: keep --initial-steps (the consensus still agrees "
                        "the graph path); registered now: %(choices)s")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="JSON file of adaptive settings (ema and goodput only)")
    p.add_argument("--initial-steps", type=int, default=None, metavar="K",
                   help="depth at start (default: the config's initial_steps, 3); with ema or "
                        "goodput one of candidate_steps")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="JSON-lines output, one line per rank per counted round (written by "
                        "rank 0, atomically, at the end)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar on rank 0 (must be the same on every rank)")
    add_runtime_args(p)
    p.set_defaults(handler=cmd_consensus)


CONFIG_USES = ("consensus", "engine")
"""What `config --for` checks a file for: the `consensus` command, or an engine command."""


def register_config(sub: Any) -> None:
    p = sub.add_parser("config", allow_abbrev=False,
                       help="validate a config file and print the effective settings",
                       description="Check an adaptive-settings file for --policy as the "
                                   "consensus command checks it (or, with --for engine, as "
                                   "generate and serve --adaptive do) and print the effective "
                                   "settings (JSON) with their digest; a refused file is one "
                                   "line naming the key (exit 2).")
    p.add_argument("--config", default=None, metavar="FILE", help="JSON file of adaptive settings")
    p.add_argument("--policy", choices=POLICIES, default="ema",
                   help="the depth policy, one of the registered: %(choices)s (default: ema; "
                        "docs/policy.md)")
    p.add_argument("--initial-steps", type=int, default=None, metavar="K", help="depth at start")
    p.add_argument("--for", dest="check_for", choices=CONFIG_USES, default="consensus",
                   help="check the file as consensus uses it (the default: goodput needs "
                        "round_cost, no model runs to measure it) or as generate/serve "
                        "--adaptive use it (engine: goodput may leave round_cost out, the engine "
                        "measures it at start-up)")
    p.set_defaults(handler=cmd_config)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(allow_abbrev=False,
        prog="python -m adaptive_dist",
        description="Adaptive speculative decoding that stays in lockstep across DP/TP ranks.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register_consensus(sub)
    register_config(sub)
    for ep in entry_points(group="adaptive_dist.commands"):
        ep.load()(sub)
    return parser


# ---- commands ---------------------------------------------------------------------------------

def cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.policy, args.initial_steps)
    if args.check_for == "consensus":
        from adaptive_dist.replay import require_round_cost

        require_round_cost(cfg)     # the check `consensus` makes, not a copy of it
    print(json.dumps({**cfg.to_dict(), "digest": cfg.digest()}, indent=2))
    return 0


def start_distributed(args: argparse.Namespace) -> Any:
    """init_distributed from the launcher's environment with the shared runtime flags."""
    from collectives.distributed import init_distributed

    backend = None if args.backend == "auto" else args.backend
    return init_distributed(timeout_s=args.timeout, backend=backend, record=True,
                            strict=args.strict_lockstep, keep_log=bool(args.record_dir))


def cmd_consensus(args: argparse.Namespace) -> int:
    from adaptive_dist.replay import run_consensus

    ctx = start_distributed(args)
    try:
        text = run_consensus(ctx, args.trace, args.policy, args.config, args.initial_steps,
                             args.out, show_progress=not args.no_progress,
                             record_dir=args.record_dir)
    except Exception as exc:
        return fail_distributed(ctx, exc, record_dir=args.record_dir)
    if text:
        print(text, flush=True)
    ctx.shutdown()
    return 0


# ---- Ctrl-C -----------------------------------------------------------------------------------

class InterruptExit:
    """Ctrl-C ends this rank with one line and exit code 130 — also while the main thread is
    blocked in a collective, where Python cannot raise ``KeyboardInterrupt`` until it returns:
    the signal's wake-up byte reaches a thread that ends the process after ``grace_s`` if the
    main thread has not by then.

    The SIGINT handler is installed explicitly, also when the process started with SIGINT
    ignored (a background job of a non-interactive shell, ``nohup cmd &`` in a script, a
    supervisor that ignores it), where Python would keep it ignored and the job could only be
    stopped by SIGTERM or SIGKILL; torchrun and uvicorn do the same. A job that must outlive the
    terminal's Ctrl-C runs in its own session (``setsid``)."""

    def __init__(self, grace_s: float = 1.0) -> None:
        self.grace_s = grace_s
        self._once = threading.Lock()

    def install(self) -> Optional[tuple[int, int, Any]]:
        """Call from the main thread, before the command runs; ``uninstall`` the result."""
        if threading.current_thread() is not threading.main_thread():
            return None
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        try:
            previous = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        except ValueError:
            os.close(rfd)
            os.close(wfd)
            return None
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):      # SIG_IGN inherited, SIG_DFL, or set outside Python
            signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=self._wait, args=(rfd,), name="interrupt-exit", daemon=True).start()
        return previous, wfd, handler

    @staticmethod
    def uninstall(installed: Optional[tuple[int, int, Any]]) -> None:
        """Restore the previous wake-up fd and SIGINT handler (for callers of ``main`` in a
        long-lived process)."""
        if installed is not None:
            previous, wfd, handler = installed
            signal.set_wakeup_fd(previous)
            if handler is not None and handler is not signal.getsignal(signal.SIGINT):
                signal.signal(signal.SIGINT, handler)
            os.close(wfd)  # the waiting thread reads EOF and ends

    def _wait(self, rfd: int) -> None:
        while True:
            data = os.read(rfd, 64)
            if not data:
                os.close(rfd)
                return
            if signal.SIGINT in data:
                time.sleep(self.grace_s)  # let the main thread unwind (temporary files go)
                self.exit()

    def exit(self) -> NoReturn:
        if self._once.acquire(blocking=False):
            say("interrupted (Ctrl-C): stopping")
            os._exit(EXIT_INTERRUPTED)
        while True:  # the other thread is ending the process
            time.sleep(1.0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    # torch's C++ logs repeat what the one-line errors say (set the variable to see them)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    interrupts = InterruptExit()
    installed = interrupts.install()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "handler", None):
            parser.print_help()
            return EXIT_CONFIG
        try:
            return args.handler(args)
        except Exception as exc:
            return report_failure(exc)
    except KeyboardInterrupt:
        interrupts.exit()
    finally:
        interrupts.uninstall(installed)
