"""One real server (`python -m adaptive_dist serve --steps 3`, a subprocess, the bundled pair),
driven by the official `openai` client and raw HTTP: outputs equal the offline greedy reference,
bad requests fail alone, stop strings, disconnects free KV, metrics, the client command."""
from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from serve_helpers import (PROMPTS, decode, kv_back_to_full, metric, metrics, offline_greedy,
                           sse_chunks, start_server, wait_until, ON_GPU)
from workers.server.metrics import find

MAX_TOKENS = 12
CONTEXT = 2048 if ON_GPU else 256


@pytest.fixture(scope="module")
def server():
    proc = start_server(["--steps", "3", "--max-batch-size", "4", "--max-model-len",
                         str(CONTEXT)])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def reference():
    return offline_greedy(PROMPTS, MAX_TOKENS)


def _complete(client: openai.OpenAI, prompt: str, stream: bool, **kw) -> tuple[str, list[int], str]:
    """(text, token ids, finish reason) of one completion through the openai client."""
    extra = {"return_token_ids": True}
    if not stream:
        out = client.completions.create(model="tiny_pair", prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body=extra, **kw)
        c = out.choices[0]
        assert out.usage.completion_tokens == len(c.token_ids)
        return c.text, c.token_ids, c.finish_reason
    text, ids, finish = "", [], None
    for chunk in client.completions.create(model="tiny_pair", prompt=prompt,
                                           max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                           extra_body=extra, **kw):
        for c in chunk.choices:
            text += c.text
            ids += c.token_ids
            finish = c.finish_reason or finish
    return text, ids, finish


def test_health_and_models(server, client) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "ranks": 1}
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny_pair"]


def test_greedy_equals_offline_reference_concurrent_stream_and_not(client, reference) -> None:
    jobs = [(p, i % 2 == 0) for i, p in enumerate(PROMPTS)]      # 12 requests, batch of 4
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: _complete(client, *j), jobs))
    for (prompt, stream), ref, (text, ids, finish) in zip(jobs, reference, results):
        assert ids == ref, (prompt, stream)
        assert text == decode(ref)
        assert finish == ("stop" if len(ref) < MAX_TOKENS else "length")


def test_bad_requests_fail_alone_with_400_naming_the_field(server, client, reference) -> None:
    url = f"{server.url}/v1/completions"
    good = {"model": "tiny_pair", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "return_token_ids": True}
    bad = [
        ({"model": "nope", "prompt": "a"}, "model"),
        ({"model": "tiny_pair", "prompt": ""}, "prompt"),
        ({"model": "tiny_pair", "prompt": "x" * CONTEXT}, "prompt"),
        ({"model": "tiny_pair", "prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny_pair", "prompt": "a", "max_tokens": CONTEXT}, "max_tokens"),
        ({"model": "tiny_pair", "prompt": "a", "temperature": -1}, "temperature"),
        ({"model": "tiny_pair", "prompt": "a", "top_p": 0}, "top_p"),
        ({"model": "tiny_pair", "prompt": "a", "top_p": 1.01}, "top_p"),
        ({"model": "tiny_pair", "prompt": "a", "max_tokens": "many"}, "max_tokens"),
        ({"model": "tiny_pair", "prompt": ["a", 7]}, "prompt"),
    ]
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=good) as in_flight:
        assert in_flight.status_code == 200
        for body, param in bad:
            r = http.post(url, json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["message"].startswith(param), err
            assert set(err) == {"message", "type", "param", "code"}
        for raw in (b'{"model": "tiny_pair", "prompt": ', b'{"model": "tiny_pair", '
                    b'"prompt": "a", "temperature": NaN}'):
            r = http.post(url, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["message"], r.text
        chunks = sse_chunks(in_flight)
    ids = [t for c in chunks if "choices" in c for ch in c["choices"] for t in ch["token_ids"]]
    assert ids == reference[0] and chunks[-1] == {"done": True}
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny_pair", prompt="a", temperature=-0.5)


def test_stop_string_cuts_the_text_and_frees_the_request(server, client, reference) -> None:
    i = next(i for i, r in enumerate(reference) if len(set(decode(r))) > 4)
    full = decode(reference[i])
    stop = full[3:5]
    cut = full[:full.index(stop)]
    for stream in (False, True):
        text, _, finish = _complete(client, PROMPTS[i], stream, stop=[stop, "@@never@@"])
        assert (text, finish) == (cut, "stop")
    assert wait_until(lambda: kv_back_to_full(server.url))


def test_prompt_list_gives_one_choice_each_and_usage(client, reference) -> None:
    out = client.completions.create(model="tiny_pair", prompt=PROMPTS[:3], max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [decode(r) for r in reference[:3]]
    assert out.usage.completion_tokens == sum(len(r) for r in reference[:3])
    assert out.usage.prompt_tokens == sum(len(p.encode()) + 1 for p in PROMPTS[:3])
    chunks = list(client.completions.create(model="tiny_pair", prompt=PROMPTS[:2], temperature=0,
                                            max_tokens=MAX_TOKENS, stream=True,
                                            stream_options={"include_usage": True}))
    texts = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [decode(r) for r in reference[:2]]
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + sum(
        len(r) for r in reference[:2])


# greedy runs these prompts to max_tokens (no end of sequence): run to the end, a request needs at
# least LONG / (steps + 1) rounds; an aborted one far fewer
LONG = CONTEXT - 20
# At steps 3 a request makes at most 4 tokens a round: one that ran to the end took at least
# LONG / 4 rounds, so fewer rounds than that (counted from before it was sent) means it was stopped.
# (How many fewer depends on how fast the rounds are while the client's leaving is noticed.)
LONG_BODY = {"model": "tiny_pair", "prompt": "def main():", "max_tokens": LONG, "temperature": 0}


def _rounds(url: str) -> float:
    return metric(url, "rounds_total", dp_rank=0)


def test_client_gone_mid_stream_frees_kv_and_slots(server) -> None:
    rounds, gone = _rounds(server.url), metric(server.url, "requests_total", outcome="client_gone")
    with httpx.Client(timeout=60) as http:
        streams = [http.stream("POST", f"{server.url}/v1/completions",
                               json={**LONG_BODY, "stream": True}) for _ in range(6)]
        responses = [s.__enter__() for s in streams]   # 6 requests: 4 run, 2 wait
        for r in responses[:4]:
            assert next(r.iter_lines()).startswith("data: ")   # the running ones made tokens
        for s in streams:
            s.__exit__(None, None, None)                 # ...then every client leaves
    assert wait_until(lambda: kv_back_to_full(server.url)), metrics(server.url)
    assert metric(server.url, "requests_total", outcome="client_gone") - (gone or 0) == 6
    assert _rounds(server.url) - rounds < LONG / 4   # stopped, not run to the end


def test_client_gone_non_streaming_frees_kv(server) -> None:
    rounds = _rounds(server.url)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=LONG_BODY, timeout=0.3)
    assert wait_until(lambda: kv_back_to_full(server.url)), metrics(server.url)
    assert _rounds(server.url) - rounds < LONG / 4


def test_metrics_expose_queues_depth_and_accept_lengths(server, client) -> None:
    client.completions.create(model="tiny_pair", prompt="def f(x):", max_tokens=8, temperature=0)
    m = metrics(server.url)
    assert find(m, "healthy") == 1 and find(m, "ranks_ready") == 1
    assert find(m, "spec_steps", dp_rank=0) == 3
    assert find(m, "accept_length_count", dp_rank=0) > 0
    assert find(m, "accept_length_bucket", dp_rank=0, le="+Inf") == find(
        m, "accept_length_count", dp_rank=0)
    assert find(m, "rounds_total", dp_rank=0) > 0
    assert find(m, "engine_stat", dp_rank=0, stat="rounds") > 0
    assert find(m, "planner_stat", dp_rank=0, stat="rounds") > 0
    assert find(m, "requests_total", outcome="success") > 0
    assert find(m, "wake_seconds_count") > 0


def test_idle_wakeup_is_fast(server, client) -> None:
    """Idle rank blocked in poll: frontend send -> the rank applied the request."""
    before = metrics(server.url)
    for _ in range(5):
        time.sleep(0.3)                                  # let the rank go idle
        client.completions.create(model="tiny_pair", prompt="a", max_tokens=1, temperature=0)
    after = metrics(server.url)
    n = find(after, "wake_seconds_count") - find(before, "wake_seconds_count")
    mean = (find(after, "wake_seconds_sum") - find(before, "wake_seconds_sum")) / n
    assert n == 5 and mean < 0.05, mean


def test_client_command_prints_the_text(server, reference) -> None:
    for extra in ([], ["--stream"]):
        out = subprocess.run([sys.executable, "-m", "adaptive_dist", "client", "--url", server.url,
                              "--prompt", PROMPTS[1], "--max-tokens", str(MAX_TOKENS), *extra],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout == decode(reference[1]) + "\n"
        assert f"{len(reference[1])} tokens" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "adaptive_dist", "client", "--url", server.url,
                          "--prompt", "a", "--max-tokens", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1 and "max_tokens" in bad.stderr


def test_json_of_every_response_is_openai_shaped(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny_pair", "prompt": "a",
                                                          "max_tokens": 2, "temperature": 0})
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert httpx.get(f"{server.url}/nowhere").status_code == 404
    assert "error" in json.loads(httpx.get(f"{server.url}/nowhere").text)
