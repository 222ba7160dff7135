"""The `serve` and `client` commands of ``python -m adaptive_dist`` (entry points in the
``adaptive_dist.commands`` group). Registration imports nothing heavy: the server's dependencies
load when a command runs."""
from __future__ import annotations

import argparse
from typing import Any

from workers.cli import DEFAULT_MODEL


def register_serve(subparsers: Any) -> None:
    """Add `serve` to `python -m adaptive_dist`."""
    p = subparsers.add_parser(
        "serve", help="serve the engine behind an OpenAI-compatible HTTP endpoint",
        description="Serve completions over HTTP (OpenAI API). Under torchrun every rank runs "
                    "an engine; rank 0 also starts the HTTP frontend, which routes requests to "
                    "the DP groups over pyzmq.")
    add_serve_arguments(p)
    p.set_defaults(handler=_cmd_serve)


def register_client(subparsers: Any) -> None:
    """Add `client` to `python -m adaptive_dist`."""
    from workers.server.client import add_arguments

    p = subparsers.add_parser("client", help="send one completion request to a running server")
    add_arguments(p)
    p.set_defaults(handler=_cmd_client)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", type=int, default=1, help="DP groups (attention replicas)")
    p.add_argument("--attn-tp", type=int, default=1, help="ranks per DP group (1 for now)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--steps", type=int, metavar="K",
                      help="static speculation with K draft steps (default: 3)")
    mode.add_argument("--adaptive", action="store_true", help="adaptive draft depth (EMA policy)")
    mode.add_argument("--no-spec", action="store_true", help="plain decoding with the target")
    p.add_argument("--config", metavar="FILE", help="JSON file of adaptive settings (--adaptive)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--max-batch-size", type=int, default=16, help="running requests per DP group")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait beyond the batch capacity; more get 503")
    p.add_argument("--routing", choices=("shortest", "round_robin"), default="shortest",
                   help="how new requests pick a DP group (a request's dp_rank field pins it)")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="directory with target/ and eagle/ (default: the bundled tiny pair)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the model directory's name)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length to serve (default: the model's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cpu")
    p.add_argument("--backend", choices=("torch", "flashinfer"), default="torch",
                   help="attention backend (flashinfer needs a CUDA GPU)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs on a CUDA device")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a collective may take; a rank silent for min(this, 10) s is dead")


def _cmd_serve(args: argparse.Namespace) -> int:
    from workers.server.launch import cmd_serve

    return cmd_serve(args)


def _cmd_client(args: argparse.Namespace) -> int:
    from workers.server.client import cmd_client

    return cmd_client(args)
