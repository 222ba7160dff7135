"""The OpenAI completions wire format: request validation and response objects.

``parse_completion`` turns a decoded JSON body into ``CompletionParams`` or raises ``ApiError``
(HTTP 400 with an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``) naming the
field, its value (cut when long) and what is allowed. Unknown fields are refused too (a typo would
otherwise be silently ignored). The ranges are ``admission``'s, which the ranks check again;
docs/serving.md lists them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from workers.server import admission
from workers.server.admission import shown

DEFAULT_MAX_TOKENS = 16          # OpenAI's default for completions
DEFAULT_TEMPERATURE = 1.0

_ACCEPTED = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
             "stream_options", "n", "best_of", "echo", "logprobs", "suffix", "presence_penalty",
             "frequency_penalty", "logit_bias", "user", "dp_rank", "return_token_ids"}


class ApiError(Exception):
    """An error answered to the client with `status` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 naming `param`."""
    return ApiError(400, f"{param}: {message}", param=param, code=code)


@dataclass(frozen=True)
class Limits:
    """What the model allows (from the ranks' `Ready`)."""

    max_context_len: int
    vocab_size: int
    dp: int
    max_prompts: Optional[int] = None    # sub-requests the server can ever hold (None: no bound)


@dataclass(frozen=True)
class CompletionParams:
    model: str
    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    stop: list[str]
    stream: bool
    include_usage: bool
    dp_rank: Optional[int]
    return_token_ids: bool


def _type_name(value: Any) -> str:
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                       (list, "array"), (dict, "object"), (type(None), "null")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _int(body: dict, key: str, default: Optional[int]) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"expected an integer, got {_type_name(value)}", "invalid_type")
    return value


def _number(body: dict, key: str, default: float, check: Callable[[Any], Optional[str]]
            ) -> float:
    """`body[key]` as a float, refused unless `check` (an ``admission`` rule) passes it."""
    value = body.get(key)
    if value is None:
        return default
    if not admission.is_number(value):
        raise bad(key, f"expected a number, got {_type_name(value)}", "invalid_type")
    problem = check(value)
    if problem is not None:
        raise bad(key, problem)
    return float(value)


def _bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(key, f"expected a boolean, got {_type_name(value)}", "invalid_type")
    return value


_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None,
                "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}


def _unsupported(body: dict) -> None:
    """Fields of the API this server does not implement: refused unless null or the default."""
    for key, default in _UNSUPPORTED.items():
        value = body.get(key)
        if value is None or (value == default
                             and isinstance(value, bool) == isinstance(default, bool)):
            continue
        raise bad(key, f"{shown(value)} is not supported by this server (only {default!r})",
                  "unsupported")


def _prompts(body: dict, encode: Callable[[str], list[int]], limits: Limits) -> list[list[int]]:
    value = body.get("prompt")
    if value is None:
        raise bad("prompt", "required (a string, a list of strings, or token ids)", "missing")
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(admission.is_int(v) for v in value):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise bad("prompt", f"expected a string or a list, got {_type_name(value)}",
                  "invalid_type")
    if not items:
        raise bad("prompt", "the list of prompts is empty")
    if limits.max_prompts is not None and len(items) > limits.max_prompts:
        raise bad("prompt", f"{len(items)} prompts; this server holds at most "
                            f"{limits.max_prompts} requests at once (running and queued)")
    return [_prompt(item, "prompt" if len(items) == 1 else f"prompt[{i}]", encode, limits)
            for i, item in enumerate(items)]


def _prompt(item: Any, where: str, encode: Callable[[str], list[int]], limits: Limits
            ) -> list[int]:
    """One prompt's token ids (a string is encoded); `where` names it in messages."""
    def refuse(message: str, code: str = "invalid_value") -> ApiError:
        return ApiError(400, f"{where}: {message}", param="prompt", code=code)

    if isinstance(item, str):
        if not item:
            raise refuse("the prompt is empty; give at least one character")
        try:
            ids = encode(item)
        except Exception as err:   # e.g. a lone surrogate (JSON allows "\ud800"): no UTF-8
            raise refuse(f"the text cannot be encoded ({type(err).__name__}: "
                         f"{str(err)[:120]})") from None
        problem = admission.token_error(ids, limits.vocab_size)
        if problem is not None:
            raise refuse(f"the text encodes to ids the model does not have: {problem}")
        return ids
    if not isinstance(item, list) or not all(admission.is_int(t) for t in item):
        raise refuse(f"expected a string or a list of token ids, got {_type_name(item)}",
                     "invalid_type")
    problem = admission.token_error(item, limits.vocab_size)
    if problem is not None:
        raise refuse(problem)
    return list(item)


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise bad("stop", f"expected a string or a list of strings, got {_type_name(value)}",
              "invalid_type")


def parse_completion(body: Any, served_model: str, limits: Limits,
                     encode: Callable[[str], list[int]]) -> CompletionParams:
    """Validate a `/v1/completions` body; `ApiError` (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}",
                       code="invalid_json")
    unknown = sorted(set(body) - _ACCEPTED)
    if unknown:
        raise bad(unknown[0], "unknown field", "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model", "required, a string" if model is None else
                  f"expected a string, got {_type_name(model)}", "invalid_type")
    if model != served_model:
        raise ApiError(400, f"model: {shown(model)} does not exist; this server serves "
                            f"{served_model!r}", param="model", code="model_not_found")
    _unsupported(body)
    max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise bad("max_tokens", f"{shown(max_tokens)} must be >= 1")
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, admission.temperature_error)
    top_p = _number(body, "top_p", 1.0, admission.top_p_error)
    seed = _int(body, "seed", None)
    dp_rank = _int(body, "dp_rank", None)
    if dp_rank is not None and not 0 <= dp_rank < limits.dp:
        raise bad("dp_rank", f"{shown(dp_rank)} must be in [0, {limits.dp})")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", f"expected an object, got {_type_name(options)}",
                  "invalid_type")
    include_usage = _bool(options or {}, "include_usage", False)
    stop = _stop(body)
    prompts = _prompts(body, encode, limits)
    if seed is not None:
        problem = admission.seed_error(seed, len(prompts))
        if problem is not None:
            raise bad("seed", problem)
    _check_context(prompts, max_tokens, limits.max_context_len)
    return CompletionParams(model, prompts, max_tokens, temperature, top_p, seed, stop, stream,
                            include_usage, dp_rank, _bool(body, "return_token_ids", False))


def _check_context(prompts: list[list[int]], max_tokens: int, context: int) -> None:
    for i, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        refusal = admission.length_error(len(ids), max_tokens, context, where)
        if refusal is not None:
            raise ApiError(400, refusal.message, param=refusal.param,
                           code="context_length_exceeded")


# ---- responses ----------------------------------------------------------------------------------

def choice(index: int, text: str, finish_reason: Optional[str],
           token_ids: Optional[list[int]] = None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                           "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def completion(cid: str, model: str, created: int, choices: list[dict[str, Any]],
               usage: Optional[dict[str, int]]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created,
                           "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())
