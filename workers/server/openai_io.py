"""The OpenAI wire format: request validation and response objects (completions and chat).

``parse_completion`` / ``parse_chat`` turn a decoded JSON body into ``CompletionParams`` or raise
``ApiError`` (HTTP 400 with an OpenAI-style body ``{"error": {"message", "type", "param",
"code"}}``) naming the field, its value (cut when long) and what is allowed. Unknown fields are
refused too (a typo would otherwise be silently ignored), and so is every field of the API this
server does not implement unless its value changes nothing (``min_p: 0``, ``logit_bias: {}``,
``suffix: null``, ...: benchmark clients send those defaults). The sampling features (top_k,
min_tokens, the penalties, logprobs, echo) are implemented. The ranges are ``admission``'s,
which the ranks check again; docs/serving.md lists them.

The logprobs of a response: ``completion_logprobs`` (completions: ``{tokens, token_logprobs,
top_logprobs, text_offset}``) and ``chat_logprobs`` (chat: ``{content: [{token, logprob, bytes,
top_logprobs}]}``), from the ranks' wire entries ``[token_id, logprob, [[id, logprob], ...]]``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from workers.server import admission
from workers.server.admission import shown

DEFAULT_MAX_TOKENS = 16          # OpenAI's default for completions (chat: the rest of the context)
DEFAULT_TEMPERATURE = 1.0
COMPLETION_LOGPROBS = 5          # OpenAI's limit of `logprobs` on completions
CHAT_TOP_LOGPROBS = admission.MAX_LOGPROBS   # of `top_logprobs` on chat (20)
MIN_LOGPROB = -9999.0
"""A logprob of -infinity (a probability float32 rounds to 0) is written as this (JSON has no
infinity; vLLM writes the same)."""

_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "n", "user", "dp_rank", "return_token_ids", "ignore_eos",
           "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "top_k",
           "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "logprobs"}


def _zero(value: Any) -> bool:
    return admission.is_number(value) and value == 0


# fields of the API whose sampling this server does not implement: accepted only at a value that
# changes nothing (null always is); (what is allowed, the test)
_NO_OPS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "min_p": ("0", _zero),
    "logit_bias": ("{}", lambda v: v == {}),
}
_COMPLETION_NO_OPS = {**_NO_OPS, "suffix": ("null", lambda v: False)}
_CHAT_NO_OPS = dict(_NO_OPS)
_COMPLETION_FIELDS = _COMMON | set(_COMPLETION_NO_OPS) | {"prompt", "best_of", "echo"}
_CHAT_FIELDS = _COMMON | set(_CHAT_NO_OPS) | {"messages", "max_completion_tokens",
                                              "add_generation_prompt", "top_logprobs"}
_STREAM_OPTIONS = {"include_usage"}
_ROLES = ("system", "user", "assistant")
_MESSAGE_FIELDS = {"role", "content", "name"}


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
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids (stop unless ignore_eos)


@dataclass(frozen=True)
class CompletionParams:
    """A validated completions or chat request. ``prompts[i]`` gives ``n`` choices, numbered
    ``i * n + j``; choice ``k`` samples with ``seed + k``."""

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
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()    # beside the model's EOS (unless ignore_eos)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    chat: bool = False
    top_k: int = 0                  # 0: off (-1 is stored as 0)
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None  # alternatives per token (None: no logprobs)
    echo: bool = False              # completions: the prompt precedes the completion

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def prompt_logprobs(self) -> Optional[int]:
        """What the ranks compute for the prompt: echo with logprobs needs the prompt's."""
        return self.logprobs if self.echo else None

    @property
    def engine_max_tokens(self) -> int:
        """The max_tokens the ranks get: `echo` with `max_tokens: 0` returns only the prompt,
        and the engine makes at least one token (its prompt logprobs come with that token's
        round), so the ranks are asked for 1 and the frontend drops it."""
        return max(1, self.max_tokens)

    @property
    def needs_engine(self) -> bool:
        """False for echo with max_tokens 0 and no logprobs: the answer is the prompt alone,
        nothing runs on a rank."""
        return self.max_tokens > 0 or self.prompt_logprobs is not None

    def sampling(self) -> dict[str, Any]:
        """The ``Generate`` sampling fields."""
        return dict(top_k=self.top_k, min_tokens=self.min_tokens,
                    presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, logprobs=self.logprobs,
                    prompt_logprobs=self.prompt_logprobs)


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


def _bool(body: dict, key: str, default: bool, where: Optional[str] = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(where or key, f"expected a boolean, got {_type_name(value)}", "invalid_type")
    return value


def _common_checks(body: Any, served_model: str, fields: set[str],
                   no_ops: dict[str, tuple[str, Callable[[Any], bool]]]) -> str:
    """The body is an object of known fields for `served_model`, every no-op field at a value
    that changes nothing; returns the model name."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}",
                       code="invalid_json")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad(unknown[0], "unknown field", "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model", "required, a string" if model is None else
                  f"expected a string, got {_type_name(model)}", "invalid_type")
    if model != served_model:
        raise ApiError(400, f"model: {shown(model)} does not exist; this server serves "
                            f"{served_model!r}", param="model", code="model_not_found")
    for key, (allowed, passes) in no_ops.items():
        value = body.get(key)
        if value is not None and not passes(value):
            raise bad(key, f"{shown(value)} is not supported by this server (allowed: null or "
                           f"{allowed})", "unsupported")
    return model


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

    def fits(ids: list) -> None:
        # before the per-token checks: a prompt of millions of tokens is refused in no time
        if len(ids) >= limits.max_context_len:
            refusal = admission.length_error(len(ids), 1, limits.max_context_len, where)
            raise ApiError(400, refusal.message, param="prompt", code="context_length_exceeded")

    if isinstance(item, str):
        if not item:
            raise refuse("the prompt is empty; give at least one character")
        try:
            ids = encode(item)
        except Exception as err:   # e.g. a lone surrogate (JSON allows "\ud800"): no UTF-8
            raise refuse(f"the text cannot be encoded ({type(err).__name__}: "
                         f"{str(err)[:120]})") from None
        fits(ids)
        problem = admission.token_error(ids, limits.vocab_size)
        if problem is not None:
            raise refuse(f"the text encodes to ids the model does not have: {problem}")
        return ids
    if not isinstance(item, list) or not all(admission.is_int(t) for t in item):
        raise refuse(f"expected a string or a list of token ids, got {_type_name(item)}",
                     "invalid_type")
    fits(item)
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


def _stop_token_ids(body: dict, limits: Limits, ignore_eos: bool) -> tuple[int, ...]:
    """`stop_token_ids`: ids of the vocabulary; with the model's EOS (unless `ignore_eos`) at
    most ``admission.MAX_STOP_IDS`` different ones."""
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("stop_token_ids", f"expected a list of token ids, got {_type_name(value)}",
                  "invalid_type")
    for i, t in enumerate(value):
        if not admission.is_int(t):
            raise ApiError(400, f"stop_token_ids[{i}]: expected a token id (an integer), got "
                                f"{_type_name(t)}", param="stop_token_ids", code="invalid_type")
        if not 0 <= t < limits.vocab_size:
            raise ApiError(400, f"stop_token_ids[{i}]: token id {shown(t)} is outside the "
                                f"vocabulary [0, {limits.vocab_size})", param="stop_token_ids",
                           code="invalid_value")
    ids = tuple(dict.fromkeys(value))
    problem = admission.stop_count_error(ids, () if ignore_eos else limits.eos_token_ids)
    if problem is not None:
        raise bad("stop_token_ids", problem)
    return ids


def _sampling(body: dict, limits: Limits, prompts: int) -> dict[str, Any]:
    """The fields completions and chat share (everything but the prompts and max_tokens)."""
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, admission.temperature_error)
    top_p = _number(body, "top_p", 1.0, admission.top_p_error)
    n = _int(body, "n", 1)
    if n < 1:
        raise bad("n", f"{shown(n)} must be >= 1")
    if limits.max_prompts is not None and prompts * n > limits.max_prompts:
        raise bad("n", f"{shown(n)} choices of {prompts} prompt(s) make {shown(prompts * n)} "
                       f"requests; this server holds at most {limits.max_prompts} at once "
                       f"(running and queued)")
    seed = _int(body, "seed", None)
    if seed is not None:
        problem = admission.seed_error(seed, prompts * n)
        if problem is not None:
            raise bad("seed", problem)
    dp_rank = _int(body, "dp_rank", None)
    if dp_rank is not None and not 0 <= dp_rank < limits.dp:
        raise bad("dp_rank", f"{shown(dp_rank)} must be in [0, {limits.dp})")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", f"expected an object, got {_type_name(options)}",
                  "invalid_type")
    unknown = sorted(set(options or {}) - _STREAM_OPTIONS)
    if unknown:
        raise bad(f"stream_options.{unknown[0]}", "unknown field", "unknown_parameter")
    ignore_eos = _bool(body, "ignore_eos", False)
    top_k = _int(body, "top_k", 0)
    problem = admission.top_k_error(top_k)
    if problem is not None:
        raise bad("top_k", problem)
    penalties = {key: _number(body, key, 0.0, admission.penalty_error)
                 for key in ("presence_penalty", "frequency_penalty")}
    return dict(
        top_k=max(top_k, 0), **penalties,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, admission.repetition_error),

        temperature=temperature, top_p=top_p, seed=seed, stop=_stop(body), stream=stream,
        include_usage=_bool(options or {}, "include_usage", False), dp_rank=dp_rank,
        return_token_ids=_bool(body, "return_token_ids", False), n=n,
        stop_token_ids=_stop_token_ids(body, limits, ignore_eos), ignore_eos=ignore_eos,
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True))


def parse_completion(body: Any, served_model: str, limits: Limits,
                     encode: Callable[[str], list[int]]) -> CompletionParams:
    """Validate a `/v1/completions` body; `ApiError` (400) naming the first bad field."""
    model = _common_checks(body, served_model, _COMPLETION_FIELDS, _COMPLETION_NO_OPS)
    echo = _bool(body, "echo", False)
    max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens < (0 if echo else 1):
        raise bad("max_tokens", f"{shown(max_tokens)} must be >= 1 (or 0 with echo: the "
                                f"prompt alone)")
    prompts = _prompts(body, encode, limits)
    sampling = _sampling(body, limits, len(prompts))
    best_of = body.get("best_of")
    if best_of is not None and not (admission.is_int(best_of) and best_of == sampling["n"]):
        raise bad("best_of", f"{shown(best_of)} is not supported by this server (allowed: null "
                             f"or n, here {sampling['n']})", "unsupported")
    value = body.get("logprobs")
    logprobs = None if value is None or value is False else _int(body, "logprobs", None)
    problem = admission.logprobs_error(logprobs, COMPLETION_LOGPROBS)
    if problem is not None:
        raise bad("logprobs", problem)
    if echo and logprobs is not None and limits.dp > 1:
        raise bad("echo", f"echo with logprobs needs the prompt's logprobs, which this server "
                          f"computes with one DP replica only (it runs {limits.dp}); drop "
                          f"logprobs or echo", "unsupported")
    min_tokens = _min_tokens(body, max_tokens, "max_tokens")
    _check_context(prompts, max(1, max_tokens), limits.max_context_len)
    return CompletionParams(model, prompts, max_tokens, logprobs=logprobs, echo=echo,
                            min_tokens=min_tokens, **sampling)


def _min_tokens(body: dict, max_tokens: int, max_name: str) -> int:
    value = _int(body, "min_tokens", 0)
    if not 0 <= value <= max_tokens:
        raise bad("min_tokens", f"{shown(value)} is out of range; allowed: an integer in [0, "
                                f"{max_name}] (here {max_tokens})")
    return value


def _check_context(prompts: list[list[int]], max_tokens: int, context: int,
                   prompt_name: Optional[str] = None, max_name: str = "max_tokens") -> None:
    """Every prompt and `max_tokens` fit the context; the refusal names the prompt field
    (`prompt_name`, default "prompt") or `max_name`."""
    for i, ids in enumerate(prompts):
        where = prompt_name or ("prompt" if len(prompts) == 1 else f"prompt[{i}]")
        refusal = admission.length_error(len(ids), max_tokens, context, where)
        if refusal is None:
            continue
        param, message = refusal.param, refusal.message
        if param == "prompt":
            param = prompt_name or "prompt"
        elif max_name != param:
            param, message = max_name, max_name + message[len(param):]
        raise ApiError(400, message, param=param, code="context_length_exceeded")


# ---- chat ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatMessage:
    """One message as the chat template sees it (text parts joined with newlines)."""

    role: str
    content: str
    name: Optional[str] = None

    def for_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        return out


def parse_messages(value: Any, where: str = "messages") -> list[ChatMessage]:
    """`messages`: a non-empty list of ``{"role", "content"[, "name"]}`` with the roles system,
    user and assistant and the content a string or a list of ``{"type": "text", "text"}``
    parts (joined with newlines, as the template gets one string)."""
    def refuse(path: str, message: str, code: str = "invalid_value") -> ApiError:
        return ApiError(400, f"{path}: {message}", param=where, code=code)

    if value is None:
        raise refuse(where, "required (a list of {\"role\", \"content\"} objects)", "missing")
    if not isinstance(value, list):
        raise refuse(where, f"expected a list of messages, got {_type_name(value)}",
                     "invalid_type")
    if not value:
        raise refuse(where, "the list of messages is empty")
    out = []
    for i, msg in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(msg, dict):
            raise refuse(at, f"expected an object, got {_type_name(msg)}", "invalid_type")
        unknown = sorted(set(msg) - _MESSAGE_FIELDS)
        if unknown:
            raise refuse(f"{at}.{unknown[0]}", "not supported by this server (a message has "
                                               "role, content and name)", "unsupported")
        role = msg.get("role")
        if role not in _ROLES:
            raise refuse(f"{at}.role", f"{shown(role)} is not a supported role; allowed: "
                                       f"{', '.join(_ROLES)}")
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise refuse(f"{at}.name", f"expected a string, got {_type_name(name)}",
                         "invalid_type")
        out.append(ChatMessage(role, _content(msg.get("content"), f"{at}.content", refuse),
                               name))
    return out


def _content(value: Any, at: str, refuse: Callable[..., ApiError]) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        raise refuse(at, "required (a string or a list of text parts)", "missing")
    if not isinstance(value, list):
        raise refuse(at, f"expected a string or a list of parts, got {_type_name(value)}",
                     "invalid_type")
    texts = []
    for j, part in enumerate(value):
        here = f"{at}[{j}]"
        if not isinstance(part, dict):
            raise refuse(here, f"expected an object, got {_type_name(part)}", "invalid_type")
        if part.get("type") != "text":
            raise refuse(f"{here}.type", f"{shown(part.get('type'))} is not supported by this "
                                         f"server (only 'text')", "unsupported")
        unknown = sorted(set(part) - {"type", "text"})
        if unknown:
            raise refuse(f"{here}.{unknown[0]}", "unknown field", "unknown_parameter")
        if not isinstance(part.get("text"), str):
            raise refuse(f"{here}.text", f"expected a string, got "
                                         f"{_type_name(part.get('text'))}", "invalid_type")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_chat(body: Any, served_model: str, limits: Limits,
               render: Callable[[list[ChatMessage], bool], list[int]]) -> CompletionParams:
    """Validate a `/v1/chat/completions` body; `ApiError` (400) naming the first bad field.
    `render(messages, add_generation_prompt)` is the prompt's token ids (the chat template,
    then the tokenizer; it raises `ApiError` itself, e.g. without a template)."""
    model = _common_checks(body, served_model, _CHAT_FIELDS, _CHAT_NO_OPS)
    max_name, max_tokens = "max_tokens", _int(body, "max_tokens", None)
    newer = _int(body, "max_completion_tokens", None)
    if newer is not None:
        if max_tokens is not None and max_tokens != newer:
            raise bad("max_completion_tokens", f"{shown(newer)} and max_tokens "
                                               f"{shown(max_tokens)} disagree; give one")
        max_name, max_tokens = "max_completion_tokens", newer
    if max_tokens is not None and max_tokens < 1:
        raise bad(max_name, f"{shown(max_tokens)} must be >= 1")
    messages = parse_messages(body.get("messages"))
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    sampling = _sampling(body, limits, 1)
    ids = render(messages, add_generation_prompt)
    problem = admission.token_error(ids, limits.vocab_size)
    if problem is not None:
        raise bad("messages", f"the rendered prompt cannot run: {problem}")
    if max_tokens is None:     # as OpenAI: up to the end of the context
        max_tokens = max(1, limits.max_context_len - len(ids))
    _check_context([ids], max_tokens, limits.max_context_len, "messages", max_name)
    min_tokens = _min_tokens(body, max_tokens, max_name)
    return CompletionParams(model, [ids], max_tokens, chat=True, min_tokens=min_tokens,
                            logprobs=_chat_logprobs(body), **sampling)


def _chat_logprobs(body: dict) -> Optional[int]:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (0 .. 20 alternatives, only with
    logprobs) as the alternatives per token (None: no logprobs)."""
    wanted = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None:
        problem = admission.logprobs_error(top, CHAT_TOP_LOGPROBS)
        if problem is not None:
            raise bad("top_logprobs", problem)
        if top > 0 and not wanted:
            raise bad("top_logprobs", f"{top} needs logprobs: true")
    return (top or 0) if wanted else None


# ---- tokenize / detokenize ---------------------------------------------------------------------

@dataclass(frozen=True)
class TokenizeRequest:
    text: Optional[str]                     # a prompt, or
    messages: Optional[list[ChatMessage]]   # messages to render
    add_special_tokens: bool
    add_generation_prompt: bool


def parse_tokenize(body: Any, served_model: str) -> TokenizeRequest:
    """`/tokenize`: ``{"prompt", "add_special_tokens" (default true)}`` or ``{"messages",
    "add_generation_prompt" (default true), "add_special_tokens" (default false)}``, with an
    optional `model`."""
    body = _optional_model(body, served_model,
                           {"model", "prompt", "messages", "add_special_tokens",
                            "add_generation_prompt"})
    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "give either prompt (a string) or messages", "missing")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad("prompt", f"expected a string, got {_type_name(body['prompt'])}",
                      "invalid_type")
        if "add_generation_prompt" in body:
            raise bad("add_generation_prompt", "applies to messages only", "unsupported")
        return TokenizeRequest(body["prompt"], None, _bool(body, "add_special_tokens", True),
                               False)
    return TokenizeRequest(None, parse_messages(body["messages"]),
                           _bool(body, "add_special_tokens", False),
                           _bool(body, "add_generation_prompt", True))


def parse_detokenize(body: Any, served_model: str, vocab_size: int) -> list[int]:
    """`/detokenize`: ``{"tokens": [ids]}`` (and an optional `model`)."""
    body = _optional_model(body, served_model, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad("tokens", "required, a list of token ids" if tokens is None else
                  f"expected a list of token ids, got {_type_name(tokens)}", "invalid_type")
    for i, t in enumerate(tokens):
        if not admission.is_int(t) or not 0 <= t < vocab_size:
            raise ApiError(400, f"tokens[{i}]: {shown(t)} is no token id of the vocabulary "
                                f"[0, {vocab_size})", param="tokens", code="invalid_value")
    return list(tokens)


def _optional_model(body: Any, served_model: str, fields: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}",
                       code="invalid_json")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad(unknown[0], "unknown field", "unknown_parameter")
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(400, f"model: {shown(model)} does not exist; this server serves "
                            f"{served_model!r}", param="model", code="model_not_found")
    return body


# ---- responses ----------------------------------------------------------------------------------

def choice(index: int, text: str, finish_reason: Optional[str],
           token_ids: Optional[list[int]] = None,
           logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs,
                           "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def chat_choice(index: int, text: str, finish_reason: Optional[str],
                token_ids: Optional[list[int]] = None,
                logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": text},
                           "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def chat_delta(index: int, delta: dict[str, Any], finish_reason: Optional[str],
               token_ids: Optional[list[int]] = None,
               logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
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


# ---- logprobs -----------------------------------------------------------------------------------

def _lp(value: float) -> float:
    """A logprob JSON can hold: -infinity (and NaN, which never comes) as MIN_LOGPROB."""
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def token_string(piece: bytes) -> str:
    """A token's text in logprobs: its bytes as UTF-8 when they are whole characters, else
    ``bytes:\\xNN...`` (as OpenAI writes a part of a character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def completion_logprobs(ids: list[int], entries: list[Optional[list]], offsets: list[int],
                        piece: Callable[[int], bytes]) -> dict[str, Any]:
    """Completions' ``logprobs`` of tokens `ids` (their wire entries: ``[id, logprob, [[id,
    logprob], ...]]``, None for the first prompt token with echo; `offsets`: each token's
    character offset in the choice's text). ``top_logprobs[i]`` holds the asked alternatives
    and the token itself (OpenAI: up to logprobs + 1 entries)."""
    tokens, values, tops = [], [], []
    for t, entry in zip(ids, entries):
        tokens.append(token_string(piece(t)))
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        top = {token_string(piece(a)): _lp(v) for a, v in entry[2]}
        top.setdefault(tokens[-1], _lp(entry[1]))
        values.append(_lp(entry[1]))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": list(offsets[:len(tokens)])}


def chat_logprobs(entries: list[list], piece: Callable[[int], bytes]) -> dict[str, Any]:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}]}], "refusal": None}`` (top_logprobs: exactly the asked alternatives)."""
    def one(token_id: int, value: float) -> dict[str, Any]:
        raw = piece(token_id)
        return {"token": token_string(raw), "logprob": _lp(value), "bytes": list(raw)}

    return {"content": [{**one(e[0], e[1]), "top_logprobs": [one(a, v) for a, v in e[2]]}
                        for e in entries], "refusal": None}


def chat_completion(cid: str, model: str, created: int, choices: list[dict[str, Any]],
                    usage: Optional[dict[str, int]], chunk: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk" if chunk else
                           "chat.completion", "created": created, "model": model,
                           "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())


def model_card(name: str, max_model_len: Optional[int], mode: Optional[str]) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0,
                            "owned_by": "adaptive_dist"}
    if max_model_len is not None:
        card.update(max_model_len=max_model_len, mode=mode)
    return card
