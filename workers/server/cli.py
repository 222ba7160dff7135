"""The `serve` and `client` commands of ``python -m adaptive_dist`` (entry points in the
``adaptive_dist.commands`` group). Registration imports nothing heavy: the server's dependencies
load when a command runs."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from workers.cli import add_engine_arguments, launch_settings
from workers.settings import ServeSettings

API_KEY_ENV = "ADAPTIVE_DIST_API_KEY"    # as workers.server.frontend.API_KEY_ENV (no import here)


ALIASES = (("--tensor-parallel-size", "--tp"), ("--data-parallel-size", "--dp"),
           ("--max-num-seqs", "--max-batch-size"), ("--speculative-num-steps", "--steps"))
"""Other servers' spellings of our flags, with the same meaning: (theirs, ours)."""
_UNSET = object()


def register_serve(subparsers: Any) -> None:
    """Add `serve` to `python -m adaptive_dist`."""
    p = subparsers.add_parser(
        "serve", allow_abbrev=False,
        help="serve the engine behind an OpenAI-compatible HTTP endpoint",
        description="Serve completions and chat over HTTP (OpenAI API). Under torchrun every "
                    "rank runs an engine; rank 0 also starts the HTTP frontend, which routes "
                    "requests to the DP groups over pyzmq.")
    p.__class__ = _serve_parser_class(type(p))
    add_serve_arguments(p)
    p.set_defaults(handler=_cmd_serve)


def _serve_parser_class(base: type) -> type:
    class ServeParser(base):  # type: ignore[misc, valid-type]
        """Resolves the other spellings (`ALIASES`, a positional MODEL) as it parses, so every
        caller of the parser sees our flags only."""

        def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
            namespace = namespace if namespace is not None else argparse.Namespace()
            flags = {o for _, o in ALIASES} | {"--model"}
            ours = {a.dest: a for a in self._actions if set(a.option_strings) & flags}
            for dest in ours:        # tells a flag given from one left at its default
                if not hasattr(namespace, dest):
                    setattr(namespace, dest, _UNSET)
            ns, extras = super().parse_known_args(args, namespace)
            if extras and getattr(ns, "model_path", None) is not None and args is not None:
                # refused anyway: a stray value after an unknown flag is no model path
                # ("--served 1" is one unknown argument pair, as without a positional)
                stray = set(extras) | {ns.model_path}
                extras = [a for a in args if a in stray]
                ns.model_path = None
            try:
                resolve_aliases(ns, {d: a.default for d, a in ours.items()})
                if getattr(ns, "chat_template", None):   # refused now, not at the first chat
                    from workers.server.chat import load_chat_template

                    load_chat_template(None, ns.chat_template)
                    ns.chat_template = str(Path(ns.chat_template).resolve())
            except ValueError as err:
                self.error(str(err))
            return ns, extras

    return ServeParser


def resolve_aliases(ns: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Fold the other spellings into ours; `ValueError` naming both when they disagree.
    Our flags not given are `_UNSET` in `ns` (then their `defaults` apply)."""
    pairs = [(theirs, ours, ours.lstrip("-").replace("-", "_"),
              "alias_" + theirs.lstrip("-").replace("-", "_")) for theirs, ours in ALIASES]
    pairs.append(("MODEL (positional)", "--model", "model", "model_path"))
    for theirs, ours, dest, alias in pairs:
        value, other = getattr(ns, dest, _UNSET), getattr(ns, alias, None)
        if other is not None:
            same = (Path(value).resolve() == Path(other).resolve() if dest == "model"
                    and value is not _UNSET else value == other)
            if value is not _UNSET and not same:
                raise ValueError(f"{ours} {value} and {theirs} {other} disagree; give one")
            if dest == "steps" and (ns.adaptive or ns.no_spec):
                raise ValueError(f"{theirs}: not allowed with "
                                 f"{'--adaptive' if ns.adaptive else '--no-spec'}")
            value = other
        setattr(ns, dest, defaults.get(dest) if value is _UNSET else value)
        if hasattr(ns, alias):
            delattr(ns, alias)


def register_client(subparsers: Any) -> None:
    """Add `client` to `python -m adaptive_dist`."""
    from workers.server.client import add_arguments

    p = subparsers.add_parser(
        "client", allow_abbrev=False,
        help="send one completion request to a running server",
        description="Send one completion request (POST /v1/completions) to a running `serve` "
                    "(or any OpenAI-compatible server) and print the text on stdout, streamed "
                    "with --stream; a summary line (finish reason, tokens, time to first token, "
                    "total time) goes to stderr. HTTP errors exit 1 with the server's message.")
    add_arguments(p)
    p.set_defaults(handler=_cmd_client)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags (shared with `generate`), the server's own, and other servers'
    spellings of ours (`ALIASES`, a positional MODEL)."""
    add_engine_arguments(p)
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="the same as --model MODEL")
    for theirs, ours in ALIASES:
        p.add_argument(theirs, dest="alias_" + theirs.lstrip("-").replace("-", "_"),
                       type=int, default=None, metavar="N", help=f"the same as {ours}")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait beyond the batch capacity; more get 503 "
                        "(default: 256)")
    p.add_argument("--routing", choices=("shortest", "round_robin"), default="shortest",
                   help="how new requests pick a DP replica (a request's dp_rank field pins it; "
                        "default: shortest)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the model directory's name)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length to serve (default: the model's)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template for /v1/chat/completions (default: the model's "
                        "tokenizer_config.json chat_template)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health and "
                        f"/metrics (or set {API_KEY_ENV}, which keeps it off the command line)")
    p.add_argument("--max-body-size", type=byte_size, default="32M", metavar="SIZE",
                   help="largest request body, in bytes or with a K, M or G suffix (powers of "
                        "1024); a bigger one gets 413 before it is read (default: 32M)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds from a request's first byte to the end of its headers; a "
                        "slower client's connection is closed with 408 (default: 10)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                   help="seconds from a request's headers to the end of its body; slower gets "
                        "408 (default: 60)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                   help="seconds an open connection without a request in progress may stay "
                        "silent before it is closed (uvicorn's flag; default: 5)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open HTTP connections at most; more are closed at once (default: the "
                        "open-file limit, raised to its hard limit, less what the server keeps "
                        "for itself)")
    p.add_argument("--chat-template-timeout", type=float, default=5.0, metavar="S",
                   help="seconds one chat template render may take; a slower one is stopped "
                        "and the request gets 400 naming messages (default: 5)")


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    from workers.server.launch import cmd_serve

    if args.api_key:        # the frontend reads it from its environment (`spawn_frontend`)
        os.environ[API_KEY_ENV] = args.api_key
    args.api_key = None
    return cmd_serve(serve_settings(args))


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """`serve`'s flags (`add_serve_arguments`, the other spellings folded in), typed: the one
    place that reads them."""
    return ServeSettings(
        launch=launch_settings(args), host=args.host, port=args.port, max_queue=args.max_queue,
        routing=args.routing, served_model_name=args.served_model_name,
        max_model_len=args.max_model_len, chat_template=getattr(args, "chat_template", None),
        max_body_size=args.max_body_size, header_timeout=args.header_timeout,
        body_timeout=args.body_timeout, timeout_keep_alive=args.timeout_keep_alive,
        max_connections=args.max_connections, chat_template_timeout=args.chat_template_timeout)


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def byte_size(text: str) -> int:
    """A size in bytes: an integer, or one with a K / M / G suffix (powers of 1024; "KiB",
    "MB", ... read the same)."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = raw[-1:] if raw[-1:] in _SIZE_UNITS and raw[-1:] else ""
    number = raw[:-1] if unit else raw
    try:
        value = int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no size: give bytes, or a number with K, M or G (e.g. 32M)") from None
    return value * _SIZE_UNITS[unit]


def _cmd_client(args: argparse.Namespace) -> int:
    from workers.server.client import cmd_client

    return cmd_client(args)
