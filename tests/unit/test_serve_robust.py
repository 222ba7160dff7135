"""One real server (`serve --steps 3`, a subprocess, the bundled pair) against request content
that used to end the cluster or get a 500: every such request fails alone with a 400 naming the
field (its value shortened, what is allowed), and the next good request is served, with the
right output. Stop strings: the tokens counted and returned end with the one that completes the
stop string (docs/serving.md), counted here independently with the tokenizer."""
from __future__ import annotations

import json

import httpx
import pytest

from serve_helpers import PROMPTS, decode, metric, offline_greedy, start_server, wait_until

CONTEXT = 256
BATCH, QUEUE = 4, 4
GOOD = {"model": "tiny_pair", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
        "return_token_ids": True}
STOP_TOKENS = 40        # the reference run, without stop strings


@pytest.fixture(scope="module")
def server():
    proc = start_server(["--steps", "3", "--max-batch-size", str(BATCH), "--max-queue",
                         str(QUEUE), "--max-model-len", str(CONTEXT)])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference():
    return offline_greedy(PROMPTS, STOP_TOKENS)


def _raw(fields: str) -> bytes:
    """A body with `fields` (JSON text) after the model and a prompt."""
    return ('{"model": "tiny_pair", "prompt": "a", ' + fields + "}").encode()


DIGITS_401 = "1" + "0" * 400
DIGITS_5000 = "9" * 5000
# (body: a dict, or raw JSON bytes; the field named; text the message must hold)
BAD = {
    "seed past int64 (the issue)": ({"seed": 2 ** 63}, "seed", "9223372036854775808 is out of range"),
    "seed below int64": ({"seed": -2 ** 63 - 1}, "seed", "[-2**63, 2**63 - 1]"),
    "seed + i past int64": ({"prompt": ["a", "b", "c"], "seed": 2 ** 63 - 2}, "seed",
                            "+ 2 (choice i samples with seed + i)"),
    "seed of 401 digits": (_raw(f'"seed": {DIGITS_401}'), "seed", "an integer of 401 digits"),
    "seed of 5000 digits": (_raw(f'"seed": {DIGITS_5000}'), "seed", "an integer of 5000 digits"),
    "seed streamed": ({"seed": 2 ** 64, "stream": True}, "seed", "out of range"),
    "temperature of 401 digits": (_raw(f'"temperature": {DIGITS_401}'), "temperature",
                                  "(an integer of 401 digits) is out of range; allowed: 0"),
    "temperature -401 digits": (_raw(f'"temperature": -{DIGITS_401}'), "temperature",
                                "out of range"),
    "temperature 1e400": (_raw('"temperature": 1e400'), "temperature", "not a finite number"),
    "temperature NaN": (_raw('"temperature": NaN'), "temperature", "nan is not a finite number"),
    "temperature Infinity": (_raw('"temperature": Infinity'), "temperature", "inf is not a"),
    "temperature too cold": ({"temperature": 1e-45}, "temperature", "[1e-05, 3.4e38]"),
    "temperature past float32": ({"temperature": 1e39}, "temperature", "out of range"),
    "top_p of 401 digits": (_raw(f'"top_p": {DIGITS_401}'), "top_p", "of 401 digits"),
    "top_p NaN": (_raw('"top_p": NaN'), "top_p", "not a finite number; allowed: a number in (0, 1]"),
    "top_p -Infinity": (_raw('"top_p": -Infinity'), "top_p", "-inf is not a finite number"),
    "max_tokens of 401 digits": (_raw(f'"max_tokens": {DIGITS_401}'), "max_tokens",
                                 "of 401 digits)) exceeds the context length"),
    "max_tokens past int64": ({"max_tokens": 2 ** 64}, "max_tokens", "allowed: at most 254"),
    "max_tokens past the context": ({"max_tokens": CONTEXT}, "max_tokens", "exceeds the context"),
    "max_tokens negative": ({"max_tokens": -1}, "max_tokens", "-1 must be >= 1"),
    "max_tokens NaN": (_raw('"max_tokens": NaN'), "max_tokens", "expected an integer"),
    "token id = vocab": ({"prompt": [256, 264]}, "prompt", "token id 264 is outside the vocab"),
    "token id negative": ({"prompt": [256, -1]}, "prompt", "token id -1 is outside"),
    "token id of 401 digits": (_raw(f'"prompt": [1, {DIGITS_401}]'.replace('"prompt": "a", ', "")),
                               "prompt", "of 401 digits) is outside the vocabulary"),
    "token id list, second bad": ({"prompt": [[1, 2], [3, 264]]}, "prompt", "prompt[1]: token"),
    "token id a float": ({"prompt": [[1, 2.0]]}, "prompt", "list of token ids, got array"),
    "token id NaN": (_raw('"prompt": [1, NaN]'.replace('"prompt": "a", ', "")), "prompt",
                     "expected a string or a list of token ids"),
    "empty token list": ({"prompt": [[]]}, "prompt", "the prompt is empty"),
    "empty prompt list": ({"prompt": []}, "prompt", "the list of prompts is empty"),
    "empty string": ({"prompt": ["a", ""]}, "prompt", "prompt[1]: the prompt is empty"),
    "lone surrogate": (_raw('"stop": "x"').replace(b'"prompt": "a"', b'"prompt": "\\ud800"'),
                       "prompt", "the text cannot be encoded"),
    "prompt past the context": ({"prompt": "x" * CONTEXT}, "prompt", "longer than the context"),
    "more prompts than the server holds": ({"prompt": ["a"] * (BATCH + QUEUE + 1)}, "prompt",
                                           "holds at most 8 requests"),
    "dp_rank of 1 group": ({"dp_rank": 1}, "dp_rank", "1 must be in [0, 1)"),
    "dp_rank past int64": ({"dp_rank": 2 ** 64}, "dp_rank", "must be in [0, 1)"),
    "n": ({"n": 0}, "n", "0 must be >= 1"),
    "n more than the server holds": ({"n": BATCH + QUEUE + 1}, "n", "holds at most 8"),
    "n of 401 digits": (_raw(f'"n": {DIGITS_401}'), "n", "an integer of 401 digits"),
    "seed + choice past int64": ({"n": 3, "seed": 2 ** 63 - 2}, "seed", "+ 2 (choice i"),
    "top_k": ({"top_k": -40}, "top_k", "-40 is out of range; allowed: -1 or 0 (no top-k)"),
    "repetition_penalty NaN": (_raw('"repetition_penalty": NaN'), "repetition_penalty",
                               "not a finite number"),
    "min_tokens past max_tokens": ({"max_tokens": 4, "min_tokens": 5}, "min_tokens",
                                   "(here 4)"),
    "stop_token_ids past the vocabulary": ({"stop_token_ids": [1, 264]}, "stop_token_ids",
                                           "stop_token_ids[1]: token id 264 is outside"),
    "stop_token_ids too many": ({"stop_token_ids": list(range(8))}, "stop_token_ids",
                                "at most 8"),
    "best_of NaN": (_raw('"best_of": NaN'), "best_of", "not supported"),
    "model name huge": ({"model": "m" * 10000}, "model", "(10002 characters) does not exist"),
    "include_usage": ({"stream": True, "stream_options": {"include_usage": 1}}, "include_usage",
                      "expected a boolean"),
}


def _post(http: httpx.Client, url: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(url, content=body, headers={"content-type": "application/json"})
    return http.post(url, json={"model": "tiny_pair", "prompt": "a", **body})


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_value_fails_alone_and_the_next_request_is_served(server, reference, case) -> None:
    body, param, text = BAD[case]
    url = f"{server.url}/v1/completions"
    with httpx.Client(timeout=60) as http:
        r = _post(http, url, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert err["message"].split(":")[0].split("[")[0] == param, err
        assert text in err["message"] and len(err["message"]) < 300, err["message"]
        good = http.post(url, json=GOOD)
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["token_ids"] == reference[0][:4]
        assert http.get(f"{server.url}/health").status_code == 200


def test_bodies_that_are_not_json_get_400(server) -> None:
    url = f"{server.url}/v1/completions"
    for raw in (b"[" * 100_000, b'{"model": "tiny_pair", "prompt": ', b"\xff\xfe"):
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400, r.text
        assert "not valid JSON" in r.json()["error"]["message"]
    assert httpx.post(url, json=GOOD, timeout=60).status_code == 200


def test_the_largest_seeds_run(server) -> None:
    """The ends of the seed range sample (seed + i stays in int64 over a prompt list)."""
    for seed, prompts in ((2 ** 63 - 1, ["a"]), (2 ** 63 - 3, ["a", "b", "c"]),
                          (-2 ** 63, ["a", "b"])):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny_pair", "prompt": prompts, "max_tokens": 4, "temperature": 1.0,
            "seed": seed})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == len(prompts)


# ---- stop strings: what is counted ---------------------------------------------------------------

def expected_stop(ids: list[int], stops: list[str]) -> tuple[str, list[int]]:
    """The rule, computed from the tokenizer alone: the completion ends with the first token
    after which the decoded text holds a stop string; its text is cut before the earliest stop
    string in that text."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], ids[:k]
    raise AssertionError(f"no stop string of {stops} in {decode(ids)!r}")


# (prompt index, stop strings): "\n" as the first token (the issue: text "", 9 tokens counted);
# a 3-character stop mid-output; one stop string starting earlier but completed later than
# another (the one completed first decides)
STOPS = [(0, ["\n"]), (1, ["sys"]), (3, ["value):", "ue"]), (10, ["\n\n\n", "def"])]


@pytest.mark.parametrize("index,stops", STOPS)
def test_tokens_after_a_stop_string_are_never_counted(server, reference, index, stops) -> None:
    want_text, want_ids = expected_stop(reference[index], stops)
    assert len(want_ids) < len(reference[index])       # the engine made tokens past the stop
    body = {"model": "tiny_pair", "prompt": PROMPTS[index], "max_tokens": STOP_TOKENS,
            "temperature": 0, "stop": stops, "return_token_ids": True}
    out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    c = out["choices"][0]
    assert (c["text"], c["token_ids"], c["finish_reason"]) == (want_text, want_ids, "stop")
    assert out["usage"]["completion_tokens"] == len(want_ids)
    text, ids, usage = "", [], None
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}
                      ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for ch in event["choices"]:
                    text += ch["text"]
                    ids += ch["token_ids"]
                usage = event.get("usage") or usage
    assert (text, ids) == (want_text, want_ids)
    assert usage["completion_tokens"] == len(want_ids)


def test_completion_tokens_metric_counts_only_up_to_the_stop(server, reference) -> None:
    before = metric(server.url, "generation_tokens_total") or 0
    index, stops = STOPS[1]
    _, want_ids = expected_stop(reference[index], stops)
    httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "tiny_pair", "prompt": PROMPTS[index], "max_tokens": STOP_TOKENS,
        "temperature": 0, "stop": stops})
    assert wait_until(lambda: metric(server.url, "generation_tokens_total") - before
                      == len(want_ids), timeout_s=5)
