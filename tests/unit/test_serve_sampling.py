"""The engine's sampling features through the API, with the official `openai` client, against a
speculating server (`--steps 3`) and a `--no-spec` one: greedy logprobs (completions and chat,
streamed or not) equal between the two, top_k=1 is greedy, penalties change the output (and stay
lossless under speculation), min_tokens holds stop tokens and stop strings back, echo returns the
prompt (with its logprobs, and alone with max_tokens 0); the speculative-decoding counters and
the histograms of /metrics."""
from __future__ import annotations

import math

import httpx
import openai
import pytest

from serve_helpers import (PROMPTS, decode, kv_back_to_full, metrics, offline_greedy,
                           start_server, wait_until)
from workers.server.metrics import find

MODEL = "tiny_pair"
MAX_TOKENS = 10
ARGS = ["--max-batch-size", "4", "--max-model-len", "256"]
TOL = 2e-3     # float32 logits of a verify window vs a one-token decode step


@pytest.fixture(scope="module")
def spec():
    proc = start_server(["--steps", "3", *ARGS])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def plain():
    proc = start_server(["--no-spec", *ARGS])
    yield proc
    proc.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def _completion(server, prompt, stream=False, **kw):
    """(text, logprobs as a dict of lists, usage) through the openai client."""
    client = _client(server)
    args = dict(model=MODEL, prompt=prompt, max_tokens=kw.pop("max_tokens", MAX_TOKENS),
                temperature=kw.pop("temperature", 0), **kw)
    if not stream:
        out = client.completions.create(**args)
        c = out.choices[0]
        return c.text, (c.logprobs.model_dump() if c.logprobs else None), out.usage
    text, lp, usage = "", None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **args):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                part = c.logprobs.model_dump()
                lp = part if lp is None else {k: lp[k] + part[k] for k in lp}
    return text, lp, usage


def _chat(server, stream=False, **kw):
    client = _client(server)
    args = dict(model=MODEL, messages=[{"role": "user", "content": kw.pop("content")}],
                max_tokens=MAX_TOKENS, temperature=0, **kw)
    if not stream:
        c = client.chat.completions.create(**args).choices[0]
        return c.message.content, [e.model_dump() for e in (c.logprobs.content or [])]
    text, entries = "", []
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                entries += [e.model_dump() for e in c.logprobs.content or []]
    return text, entries


def _close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) <= TOL)


def _same_completion_logprobs(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"], (a, b)
    assert all(_close(x, y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])), (a, b)
    for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
        assert (x is None) == (y is None)
        if x is not None:
            assert set(x) == set(y) and all(_close(x[k], y[k]) for k in x), (x, y)


def test_greedy_logprobs_under_speculation_equal_no_spec(spec, plain) -> None:
    reference = offline_greedy(PROMPTS[:4], MAX_TOKENS)
    for prompt, ref in zip(PROMPTS[:4], reference):
        got = {}
        for name, server in (("spec", spec), ("plain", plain)):
            for stream in (False, True):
                text, lp, usage = _completion(server, prompt, stream, logprobs=3)
                assert text == decode(ref)
                assert len(lp["tokens"]) == usage.completion_tokens == len(ref)
                assert all(1 <= len(t) <= 4 for t in lp["top_logprobs"])   # 3 + the token
                assert all(v <= 0 for v in lp["token_logprobs"])
                got[name, stream] = lp
        first = got["plain", False]
        for lp in got.values():
            _same_completion_logprobs(lp, first)
        # text_offset: each token's text starts there
        text = decode(ref)
        assert first["text_offset"][0] == 0 and first["text_offset"] == sorted(first["text_offset"])
        assert first["text_offset"][-1] <= len(text)
    chats = {}
    for name, server in (("spec", spec), ("plain", plain)):
        for stream in (False, True):
            text, entries = _chat(server, stream, content="def fib(n):", logprobs=True,
                                  top_logprobs=2)
            assert entries and all(len(e["top_logprobs"]) == 2 for e in entries)
            assert all(bytes(e["bytes"]).decode("utf-8", "replace") for e in entries)
            chats[name, stream] = (text, entries)
    text, base = chats["plain", False]
    assert "".join(bytes(e["bytes"]).decode() for e in base).startswith(text)
    for t, entries in chats.values():
        assert t == text and [e["token"] for e in entries] == [e["token"] for e in base]
        assert all(_close(e["logprob"], f["logprob"]) for e, f in zip(entries, base))
        assert all([x["token"] for x in e["top_logprobs"]] == [x["token"] for x in f["top_logprobs"]]
                   for e, f in zip(entries, base))
    # the greedy token is the most likely one
    assert all(e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"], abs=TOL)
               for e in base)


def test_top_k_one_is_greedy_and_penalties_change_the_output(spec, plain) -> None:
    reference = offline_greedy(PROMPTS[:3], MAX_TOKENS)
    for i, (prompt, ref) in enumerate(zip(PROMPTS[:3], reference)):
        for stream in (False, True):
            text, _, _ = _completion(spec, prompt, stream, temperature=1.0, seed=i,
                                     extra_body={"top_k": 1})
            assert text == decode(ref)
    prompt, none = "aaa aaa aaa aaa", None
    none = _completion(spec, prompt, max_tokens=24)[0]
    for field, value in (("presence_penalty", 2.0), ("frequency_penalty", 2.0),
                         ("repetition_penalty", 1.8)):
        extra = {"extra_body": {field: value}} if field == "repetition_penalty" else {field: value}
        outs = [_completion(server, prompt, stream, max_tokens=24, **extra)[0]
                for server in (spec, plain) for stream in (False, True)]
        assert outs[0] != none, field
        assert len(set(outs)) == 1, (field, outs)      # greedy: lossless under speculation
        # a sampled request with a penalty runs too
        text, _, usage = _completion(spec, prompt, temperature=0.8, seed=3, max_tokens=24,
                                     **extra)
        assert usage.completion_tokens >= 1


def test_min_tokens_holds_stop_tokens_and_stop_strings_back(spec, plain) -> None:
    ref = offline_greedy([PROMPTS[0]], MAX_TOKENS)[0]
    stop_id = ref[1]
    short = _completion(spec, PROMPTS[0], extra_body={"stop_token_ids": [stop_id]})
    assert short[2].completion_tokens == ref.index(stop_id) + 1
    for server in (spec, plain):
        text, _, usage = _completion(server, PROMPTS[0], extra_body={
            "stop_token_ids": [stop_id], "min_tokens": 5})
        assert usage.completion_tokens >= 5
        assert stop_id not in _ids(server, PROMPTS[0], {"stop_token_ids": [stop_id],
                                                        "min_tokens": 5})[:5]
    # a stop string the first token completes counts only from the min_tokens-th token on
    stop = decode(ref[:1])
    assert _completion(spec, PROMPTS[0], stop=[stop])[0] == ""
    text, _, usage = _completion(spec, PROMPTS[0], stop=[stop], extra_body={"min_tokens": 4})
    assert usage.completion_tokens >= 4 and text.startswith(stop)


def _ids(server, prompt: str, extra: dict) -> list[int]:
    r = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_echo_returns_the_prompt_and_its_logprobs(spec) -> None:
    prompt = PROMPTS[0]
    client = _client(spec)
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].finish_reason == "length"
    for stream in (False, True):
        text, lp, usage = _completion(spec, prompt, stream, max_tokens=0, echo=True, logprobs=2)
        assert text == prompt and usage.completion_tokens == 0
        assert len(lp["tokens"]) == usage.prompt_tokens and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    # echo with generated tokens: the prompt's logprobs of those tokens (a prompt of P + G)
    # equal their logprobs when they were generated
    ref = offline_greedy([prompt], 6)[0]
    text, gen, usage = _completion(spec, prompt, logprobs=2, max_tokens=6)
    assert usage.completion_tokens == 6
    ids = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                    extra_body={"return_token_ids": True}).choices[0]
    full = _tokenize(spec, prompt) + ref
    _, echoed, usage = _completion(spec, full, max_tokens=0, echo=True, logprobs=2)
    tail = echoed["token_logprobs"][-6:]
    assert all(_close(a, b) for a, b in zip(tail, gen["token_logprobs"])), (tail, gen)
    assert ids.token_ids == ref[:1]
    echoed_text, both, usage = _completion(spec, prompt, echo=True, logprobs=1, max_tokens=6)
    assert echoed_text == prompt + text and len(both["tokens"]) == usage.prompt_tokens + 6
    assert both["text_offset"][usage.prompt_tokens] == len(prompt)


def _tokenize(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def test_metrics_count_drafts_per_position_and_have_the_histograms(spec, plain) -> None:
    _completion(spec, PROMPTS[5], max_tokens=16)
    assert wait_until(lambda: kv_back_to_full(spec.url))
    m = metrics(spec.url)
    drafts = find(m, "spec_decode_num_drafts_total", dp_rank=0)
    tokens = find(m, "spec_decode_num_draft_tokens_total", dp_rank=0)
    accepted = find(m, "spec_decode_num_accepted_tokens_total", dp_rank=0)
    per_pos = [find(m, "spec_decode_num_accepted_tokens_per_pos_total", dp_rank=0, position=i)
               for i in range(3)]
    assert drafts > 0 and tokens == 3 * drafts and 0 < accepted <= tokens
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    # the engine's own accept-length histogram counts the same request-rounds
    assert find(m, "accept_length_count", dp_rank=0) == drafts
    assert find(m, "accept_length_sum", dp_rank=0) == accepted
    assert find(m, "kv_cache_usage_perc", dp_rank=0) == 0
    assert find(m, "num_requests_running", dp_rank=0) == 0
    assert find(m, "num_requests_waiting", dp_rank=0) == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "inter_token_latency_seconds", "request_time_per_output_token_seconds",
                 "request_queue_time_seconds"):
        count = find(m, f"{name}_count")
        assert count > 0 and find(m, f"{name}_bucket", le="+Inf") == count, name
    assert find(m, "e2e_request_latency_seconds_count") == find(m, "request_latency_seconds_count")
    assert find(m, "generation_tokens_total") > 0
    page = httpx.get(f"{spec.url}/metrics", timeout=10).text
    samples = [line for line in page.splitlines() if line and not line.startswith("#")]
    assert samples and all('model_name="tiny_pair"' in line for line in samples)
    p = metrics(plain.url)
    assert find(p, "spec_decode_num_drafts_total", dp_rank=0) == 0
    assert find(p, "spec_steps", dp_rank=0) == 0
    assert not math.isnan(find(p, "time_to_first_token_seconds_sum"))
