"""The `serve` and `client` commands of ``python -m adaptive_dist`` (entry points in the
``adaptive_dist.commands`` group). Registration imports nothing heavy: the server's dependencies
load when a command runs."""
from __future__ import annotations

import argparse
from typing import Any

from workers.cli import add_engine_arguments


def register_serve(subparsers: Any) -> None:
    """Add `serve` to `python -m adaptive_dist`."""
    p = subparsers.add_parser(
        "serve", allow_abbrev=False,
        help="serve the engine behind an OpenAI-compatible HTTP endpoint",
        description="Serve completions over HTTP (OpenAI API). Under torchrun every rank runs "
                    "an engine; rank 0 also starts the HTTP frontend, which routes requests to "
                    "the DP groups over pyzmq.")
    add_serve_arguments(p)
    p.set_defaults(handler=_cmd_serve)


def register_client(subparsers: Any) -> None:
    """Add `client` to `python -m adaptive_dist`."""
    from workers.server.client import add_arguments

    p = subparsers.add_parser("client", allow_abbrev=False,
                              help="send one completion request to a running server")
    add_arguments(p)
    p.set_defaults(handler=_cmd_client)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags (shared with `generate`) and the server's own."""
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait beyond the batch capacity; more get 503")
    p.add_argument("--routing", choices=("shortest", "round_robin"), default="shortest",
                   help="how new requests pick a DP replica (a request's dp_rank field pins it)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the model directory's name)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length to serve (default: the model's)")


def _cmd_serve(args: argparse.Namespace) -> int:
    from workers.server.launch import cmd_serve

    return cmd_serve(args)


def _cmd_client(args: argparse.Namespace) -> int:
    from workers.server.client import cmd_client

    return cmd_client(args)
