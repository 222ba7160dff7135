"""What a request may hold: the ranges of its values, checked twice with the same rules.

The frontend checks every field of an HTTP request (``openai_io``; a bad one is a 400 naming the
field) and a rank checks every ``Generate`` it is about to add (``engine_glue``), since what a
request's values reach inside a round (a seed in an int64 tensor, a temperature in a float32 one,
a token id as an embedding row) would raise there, in the middle of the round's collectives, and
end the rank instead of the request. The rank's check is a pure function of the message and of
settings every rank of the replica shares, so every rank of the replica refuses the same request
in the same round (docs/serving.md, "When a rank refuses a request").

No torch here (the frontend imports it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
FLOAT32_MAX = 3.4028234663852886e38    # the ranks hold temperature and top_p as float32
MIN_TEMPERATURE = 1e-5
"""The smallest positive temperature: below it float32 logits / temperature overflow (the
bundled model's draws turn to noise near 1e-38), and sampling that cold is greedy anyway."""

SEED_RANGE = "an integer in [-2**63, 2**63 - 1] (int64)"
TEMPERATURE_RANGE = f"0 (greedy) or a number in [{MIN_TEMPERATURE:g}, 3.4e38]"
TOP_P_RANGE = "a number in (0, 1]"
SHOWN_CHARS = 40
TOP_K_RANGE = "-1 or 0 (no top-k), or an integer k >= 1 (at most 2**63 - 1)"
PENALTY_RANGE = "a number in [-2, 2]"
MIN_REPETITION, MAX_REPETITION = 0.01, 100.0
REPETITION_RANGE = f"a number in [{MIN_REPETITION:g}, {MAX_REPETITION:g}] (1: none)"
"""The ranks divide (or multiply) float32 logits by it: far outside this range the logits
overflow to infinity and the draws turn to NaN; nothing useful lies out there."""
MAX_LOGPROBS = 20
"""The most alternatives per token a rank computes (``workers.sampling.MAX_LOGPROBS``; a test
keeps the two equal). The completions API allows 5 of them (OpenAI's limit), chat 20."""
MAX_STOP_IDS = 8
"""Stop token ids a request may have, the model's end-of-sequence ids included: the engine's
output buffer holds that many per request (``workers.scheduler.MAX_STOP_IDS``; a test keeps the
two equal)."""


class LongInt(int):
    """An integer literal too long for ``int()`` (Python refuses more than 4300 digits): its
    sign and a magnitude past every range a request allows; ``text`` keeps the literal for
    messages. The frontend's JSON parser makes one, so such a value is refused by its field."""

    text: str

    def __new__(cls, text: str) -> "LongInt":
        obj = super().__new__(cls, -(10 ** 4300) if text.startswith("-") else 10 ** 4300)
        obj.text = text
        return obj


def shown(value: Any) -> str:
    """`value` for an error message: its repr, a long one cut (huge integers by their digits)."""
    if isinstance(value, int) and not isinstance(value, bool) \
            and (isinstance(value, LongInt) or abs(value) >= 10 ** SHOWN_CHARS):
        text = value.text if isinstance(value, LongInt) else str(value)
        digits = len(text.lstrip("-"))
        return f"{text[:12]}... (an integer of {digits} digits)"
    text = repr(value)
    if len(text) > SHOWN_CHARS:
        return f"{text[:SHOWN_CHARS - 8]}... ({len(text)} characters)"
    return text


@dataclass(frozen=True)
class Refusal:
    """Why a request cannot run: the API field and a message that starts with its name."""

    param: str
    message: str


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number_error(value: Any, allowed: str, ok: Any) -> Optional[str]:
    """Why `value` is not a number with `ok(value)` (None: it is one); `allowed` says which are.
    An integer past the float range (JSON has no limit) and NaN / infinity (which Python's JSON
    parser lets through) are refused like any other value out of range."""
    if not is_number(value):
        return f"{shown(value)} is not a number; allowed: {allowed}"
    try:
        x = float(value)
    except OverflowError:
        return f"{shown(value)} is out of range; allowed: {allowed}"
    if not math.isfinite(x):
        return f"{shown(value)} is not a finite number; allowed: {allowed}"
    if not ok(x):
        return f"{shown(value)} is out of range; allowed: {allowed}"
    return None


def temperature_error(value: Any) -> Optional[str]:
    """Why `value` is no temperature (None: it is one)."""
    return number_error(value, TEMPERATURE_RANGE,
                        lambda t: t == 0 or MIN_TEMPERATURE <= t <= FLOAT32_MAX)


def top_p_error(value: Any) -> Optional[str]:
    """Why `value` is no top_p (None: it is one)."""
    return number_error(value, TOP_P_RANGE, lambda p: 0.0 < p <= 1.0)


def seed_error(value: Any, count: int = 1) -> Optional[str]:
    """Why `value` cannot seed `count` choices (choice i samples with `value + i`; prompt p of
    a list with n choices each gives choices p * n ... p * n + n - 1)."""
    if not is_int(value) or not INT64_MIN <= value <= INT64_MAX:
        return f"{shown(value)} is out of range; allowed: {SEED_RANGE}"
    if value + count - 1 > INT64_MAX:
        return (f"{shown(value)} + {count - 1} (choice i samples with seed + i) exceeds "
                f"2**63 - 1; allowed with {count} choices: at most {INT64_MAX - count + 1}")
    return None


def top_k_error(value: Any) -> Optional[str]:
    """Why `value` is no top_k (None: it is one; k >= the vocabulary keeps every token)."""
    if not is_int(value) or not -1 <= value <= INT64_MAX:
        return f"{shown(value)} is out of range; allowed: {TOP_K_RANGE}"
    return None


def min_tokens_error(value: Any, max_tokens: Any) -> Optional[str]:
    """Why `value` is no min_tokens for `max_tokens` (None: it is one)."""
    if not is_int(value) or not 0 <= value <= (max_tokens if is_int(max_tokens) else 0):
        return (f"{shown(value)} is out of range; allowed: an integer in [0, max_tokens] "
                f"(here {shown(max_tokens)})")
    return None


def penalty_error(value: Any) -> Optional[str]:
    """Why `value` is no presence / frequency penalty (None: it is one)."""
    return number_error(value, PENALTY_RANGE, lambda x: -2.0 <= x <= 2.0)


def repetition_error(value: Any) -> Optional[str]:
    """Why `value` is no repetition penalty (None: it is one)."""
    return number_error(value, REPETITION_RANGE,
                        lambda x: MIN_REPETITION <= x <= MAX_REPETITION)


def logprobs_error(value: Any, most: int = MAX_LOGPROBS) -> Optional[str]:
    """Why `value` is no count of logprob alternatives, at most `most` (None: it is one, or
    None: none asked)."""
    if value is not None and (not is_int(value) or not 0 <= value <= most):
        return f"{shown(value)} is out of range; allowed: null or an integer in [0, {most}]"
    return None


def token_error(ids: Sequence[Any], vocab_size: int) -> Optional[str]:
    """Why `ids` are no prompt of token ids (None: they are)."""
    if not ids:
        return "the prompt is empty; give at least one token"
    for t in ids:
        if not is_int(t):
            return f"token id {shown(t)} is not an integer"
        if not 0 <= t < vocab_size:
            return f"token id {shown(t)} is outside the vocabulary [0, {vocab_size})"
    return None


def stop_count_error(stop_ids: Sequence[Any], eos_ids: Sequence[int]) -> Optional[str]:
    """Why `stop_ids` beside the model's `eos_ids` (none with ignore_eos) are too many."""
    total = len(set(stop_ids) | set(eos_ids))
    if total <= MAX_STOP_IDS:
        return None
    eos = f" with the model's end-of-sequence id(s) {list(eos_ids)}" if eos_ids else ""
    return (f"{len(set(stop_ids))} stop token ids{eos} make {total}; at most {MAX_STOP_IDS} "
            f"are allowed")


def length_error(prompt_len: int, max_tokens: Any, context: int, where: str = "prompt"
                 ) -> Optional[Refusal]:
    """Why a prompt of `prompt_len` tokens (named `where` in the message) and `max_tokens` new
    ones do not fit `context` tokens."""
    if not is_int(max_tokens) or max_tokens < 1:
        return Refusal("max_tokens", f"max_tokens: {shown(max_tokens)} must be an integer >= 1")
    if prompt_len >= context:
        return Refusal("prompt", f"{where}: {prompt_len} tokens is longer than the context "
                                 f"length ({context} tokens, room for at least one new token)")
    if prompt_len + max_tokens > context:
        return Refusal("max_tokens", f"max_tokens: prompt ({prompt_len} tokens) + max_tokens "
                                     f"({shown(max_tokens)}) exceeds the context length "
                                     f"({context} tokens); allowed: at most "
                                     f"{context - prompt_len}")
    return None


def generate_refusal(msg: Any, context: int, vocab_size: int,
                     eos_token_ids: Sequence[int] = ()) -> Optional[Refusal]:
    """Why the ``Generate`` `msg` cannot run on a replica of `context` tokens, `vocab_size`
    ids and the end-of-sequence ids `eos_token_ids` (None: it can). Every field the round reads
    is checked, types too: the message may come from anything that can reach the inbox, not
    only the frontend."""
    if not isinstance(msg.rid, str):
        return Refusal("rid", f"rid: {shown(msg.rid)} is not a string")
    ids = msg.prompt_ids
    if not isinstance(ids, list):
        return Refusal("prompt", f"prompt: {shown(ids)} is not a list of token ids")
    problem = token_error(ids, vocab_size)
    if problem is not None:
        return Refusal("prompt", f"prompt: {problem}")
    fit = length_error(len(ids), msg.max_tokens, context)
    if fit is not None:
        return fit
    for param, check in (("temperature", temperature_error), ("top_p", top_p_error),
                         ("seed", seed_error), ("sent_at", _time_error)):
        problem = check(getattr(msg, param))
        if problem is not None:
            return Refusal(param, f"{param}: {problem}")
    if not isinstance(msg.ignore_eos, bool):
        return Refusal("ignore_eos", f"ignore_eos: {shown(msg.ignore_eos)} is not a boolean")
    stops = msg.stop_token_ids
    if not isinstance(stops, list):
        return Refusal("stop_token_ids", f"stop_token_ids: {shown(stops)} is not a list of "
                                         f"token ids")
    for t in stops:
        if not is_int(t) or not 0 <= t < vocab_size:
            return Refusal("stop_token_ids", f"stop_token_ids: token id {shown(t)} is not in "
                                             f"the vocabulary [0, {vocab_size})")
    problem = stop_count_error(stops, () if msg.ignore_eos else tuple(eos_token_ids))
    if problem is not None:
        return Refusal("stop_token_ids", f"stop_token_ids: {problem}")
    for param, check in (("top_k", top_k_error),
                         ("min_tokens", lambda v: min_tokens_error(v, msg.max_tokens)),
                         ("presence_penalty", penalty_error),
                         ("frequency_penalty", penalty_error),
                         ("repetition_penalty", repetition_error),
                         ("logprobs", logprobs_error), ("prompt_logprobs", logprobs_error)):
        problem = check(getattr(msg, param))
        if problem is not None:
            return Refusal(param, f"{param}: {problem}")
    return None


def _time_error(value: Any) -> Optional[str]:
    return number_error(value, "a time.time() value", lambda t: t >= 0)
