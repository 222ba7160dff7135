"""A server in adaptive mode with a small batch: many concurrent greedy requests (more than the
batch holds) queue and complete with the offline reference output, streaming and not, while the
depth switches; beyond `--max-queue` a request gets 503 and the rest are unaffected."""
from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import openai
import pytest

from serve_helpers import (PROMPTS, decode, kv_back_to_full, metric, metrics, offline_greedy,
                           start_server, wait_until)

MAX_TOKENS = 16
BATCH, QUEUE = 2, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "adaptive.json"
    # decide often so the depth moves during a short test
    config.write_text(json.dumps({"candidate_steps": [1, 3, 7], "initial_steps": 1,
                                  "warmup_batches": 2, "update_interval": 2,
                                  "ema_alpha": 0.5}))
    proc = start_server(["--adaptive", "--config", str(config), "--max-batch-size", str(BATCH),
                         "--max-queue", str(QUEUE), "--max-model-len", "512"])
    yield proc
    proc.stop()


def test_more_requests_than_the_batch_queue_and_equal_the_reference(server) -> None:
    prompts = PROMPTS[:BATCH + QUEUE]                    # exactly fills batch + queue
    reference = offline_greedy(prompts, MAX_TOKENS)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

    def one(i: int) -> str:
        if i % 2:
            return "".join(c.choices[0].text for c in client.completions.create(
                model="tiny_pair", prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                stream=True))
        return client.completions.create(model="tiny_pair", prompt=prompts[i],
                                         max_tokens=MAX_TOKENS, temperature=0).choices[0].text

    for _ in range(2):                                   # twice: the depth moves in between
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(one, range(len(prompts))))
        assert texts == [decode(r) for r in reference]
    assert metric(server.url, "switches_total", dp_rank=0) >= 1, metrics(server.url)
    assert wait_until(lambda: kv_back_to_full(server.url)), metrics(server.url)


def test_queue_bound_answers_503_and_the_rest_complete(server) -> None:
    body = {"model": "tiny_pair", "prompt": "def main():", "max_tokens": 300,
            "temperature": 0, "stream": True}       # greedy never stops early here
    url = f"{server.url}/v1/completions"
    with httpx.Client(timeout=120) as http:
        streams = [http.stream("POST", url, json=body) for _ in range(BATCH + QUEUE)]
        responses = [s.__enter__() for s in streams]     # all accepted: batch + queue
        assert all(r.status_code == 200 for r in responses)
        over = http.post(url, json={**body, "stream": False})
        assert over.status_code == 503, over.text
        err = over.json()["error"]
        assert err["code"] == "overloaded" and "--max-queue" in err["message"]
        for r in responses:                              # the admitted ones still finish
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
        for s in streams:
            s.__exit__(None, None, None)
    assert metric(server.url, "requests_total", outcome="unavailable") >= 1
    assert wait_until(lambda: kv_back_to_full(server.url)), metrics(server.url)


def test_per_request_server_serves_the_reference_and_logs_its_rounds(tmp_path) -> None:
    """`serve --adaptive --per-request --model-costs FILE --round-log FILE`: concurrent greedy
    requests equal the offline reference; the round log holds the rounds' shapes, which move,
    and every request's budget inside its round's shape."""
    from workers.round_log import read_round_log

    log = tmp_path / "rounds.jsonl"
    costs = tmp_path / "costs.json"
    from engine_fixtures import synthetic_costs

    rounds, verify = synthetic_costs(per_token=0.05)
    costs.write_text(json.dumps({"agreed_round_cost_ms": {
        b: {s: 1e3 * c for s, c in row.items()} for b, row in rounds.items()},
        "agreed_verify_cost_ms": {t: 1e3 * c for t, c in verify.items()}}))
    proc = start_server(["--adaptive", "--per-request", "--model-costs", str(costs),
                         "--round-log", str(log), "--max-batch-size", "4",
                         "--max-model-len", "512"])
    try:
        prompts = PROMPTS[:6]
        reference = offline_greedy(prompts, MAX_TOKENS)
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0)
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: client.completions.create(
                model="tiny_pair", prompt=p, max_tokens=MAX_TOKENS,
                temperature=0).choices[0].text, prompts))
        assert texts == [decode(r) for r in reference]
    finally:
        proc.stop()
    decode_lines = [r for r in read_round_log(log) if r["kind"] == "decode"]
    assert decode_lines and all(r["verify_tokens"] <= r["padded_tokens"] for r in decode_lines)
    assert len({(r["draft_forwards"], r["padded_tokens"]) for r in decode_lines}) >= 2
    assert all(q["accepted"] <= q["draft"] <= r["draft_forwards"]
               for r in decode_lines for q in r["requests"])
