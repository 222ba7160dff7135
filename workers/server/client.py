"""`client`: send one completion request to a running server and print the text.

    python -m adaptive_dist client --url http://127.0.0.1:8000 --prompt "def fib(n):" \
        [--stream] [--max-tokens N] [--temperature T] [--stop S] [--model NAME] [--json]

The text goes to stdout (streamed piece by piece with ``--stream``); one summary line (finish
reason, tokens, time to first token, total time) goes to stderr. With ``--json`` the response
object (non-streaming) is printed instead. HTTP errors exit 1 with the server's message.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Iterator


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server's base URL (default: http://127.0.0.1:8000)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--model", default=None,
                   help="the model id to ask for (default: the server's first model)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate at most (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass, in (0, 1] (default: 1.0)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: none)")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print the text as it arrives")
    p.add_argument("--json", action="store_true", help="print the response object")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds to wait for the server (default: 300)")


class ClientError(RuntimeError):
    """The server answered with an error (its message) or could not be reached."""


def _error_message(response: Any) -> str:
    try:
        return response.json()["error"]["message"]
    except Exception:
        return response.text.strip() or f"HTTP {response.status_code}"


def cmd_client(args: argparse.Namespace) -> int:
    """Handler of `client`."""
    import httpx

    base = args.url.rstrip("/")
    try:
        with httpx.Client(base_url=base, timeout=args.timeout) as http:
            model = args.model or _only_model(http)
            body = {"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens,
                    "temperature": args.temperature, "top_p": args.top_p, "stream": args.stream}
            if args.seed is not None:
                body["seed"] = args.seed
            if args.stop:
                body["stop"] = args.stop
            start = time.perf_counter()
            if args.stream:
                _print_stream(http, body, start)
            else:
                _print_once(http, body, start, args.json)
    except httpx.HTTPError as err:
        sys.stderr.write(f"error: cannot reach {base}: {err}\n")
        return 1
    except ClientError as err:
        sys.stderr.write(f"error: {err}\n")
        return 1
    return 0


def _only_model(http: Any) -> str:
    response = http.get("/v1/models")
    if response.status_code != 200:
        raise ClientError(_error_message(response))
    return response.json()["data"][0]["id"]


def _print_once(http: Any, body: dict, start: float, as_json: bool) -> None:
    response = http.post("/v1/completions", json=body)
    if response.status_code != 200:
        raise ClientError(f"HTTP {response.status_code}: {_error_message(response)}")
    out = response.json()
    if as_json:
        print(json.dumps(out))
        return
    choice = out["choices"][0]
    print(choice["text"])
    _summary(choice["finish_reason"], out["usage"]["completion_tokens"], None,
             time.perf_counter() - start)


def _print_stream(http: Any, body: dict, start: float) -> None:
    body = dict(body, stream_options={"include_usage": True})
    first, finish, tokens = None, None, 0
    with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise ClientError(f"HTTP {response.status_code}: {_error_message(response)}")
        for event in _sse_events(response.iter_lines()):
            if "error" in event:
                raise ClientError(event["error"]["message"])
            for choice in event.get("choices", []):
                if first is None and choice["text"]:
                    first = time.perf_counter() - start
                sys.stdout.write(choice["text"])
                sys.stdout.flush()
                finish = choice["finish_reason"] or finish
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    sys.stdout.write("\n")
    _summary(finish, tokens, first, time.perf_counter() - start)


def _sse_events(lines: Iterator[str]) -> Iterator[dict]:
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data.strip() == "[DONE]":
            return
        yield json.loads(data)


def _summary(finish: Any, tokens: int, ttft: Any, total: float) -> None:
    first = f", first token {ttft * 1000:.0f} ms" if ttft is not None else ""
    sys.stderr.write(f"[{finish}, {tokens} tokens{first}, {total * 1000:.0f} ms]\n")
