"""One real server started as other servers are: a positional model path (a copy of the bundled
pair whose tokenizer has no chat template), vLLM's / SGLang's flag spellings, and `--api-key`:
every route but /health and /metrics wants the key (401 in OpenAI's error shape otherwise, the
official client's AuthenticationError), the key never shows in the log, /metrics or the
frontend's command line, and chat without a template is a 400 that says what to do."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from serve_helpers import metric, start_server
from workers.loading import DEFAULT_MODEL

KEY = "sk-test-5f8e2c41d9a7"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair") / "plain_pair"
    shutil.copytree(DEFAULT_MODEL, root, ignore=shutil.ignore_patterns("*.md", "*_log.json",
                                                                       "eval.json"))
    config = root / "target" / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    del settings["chat_template"]
    config.write_text(json.dumps(settings))
    proc = start_server([str(root), "--max-num-seqs", "2", "--speculative-num-steps", "2",
                         "--max-model-len", "128", "--api-key", KEY])
    yield proc
    proc.stop()


def test_health_and_metrics_stay_open_everything_else_wants_the_key(server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    routes = [("GET", "/v1/models", None), ("GET", "/v1/models/plain_pair", None),
              ("POST", "/v1/completions", {"model": "plain_pair", "prompt": "a"}),
              ("POST", "/v1/chat/completions", {"model": "plain_pair", "messages": []}),
              ("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [1]}),
              ("GET", "/nowhere", None)]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            r = httpx.request(method, f"{server.url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            assert set(err) == {"message", "type", "param", "code"} and KEY not in r.text
    ok = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "plain_pair"


def test_the_official_client_with_and_without_the_key(server) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="plain_pair", prompt="a", max_tokens=2)
    right = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    out = right.completions.create(model="plain_pair", prompt="def f(x):", max_tokens=4,
                                   temperature=0)
    assert out.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="has no chat template.*--chat-template"):
        right.chat.completions.create(model="plain_pair", max_tokens=2,
                                      messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"


def test_the_other_spellings_took_effect(server) -> None:
    assert metric(server.url, "spec_steps", dp_rank=0) == 2           # --speculative-num-steps
    assert "batch 2" in server.output()                               # --max-num-seqs


def test_the_key_is_nowhere_to_be_read(server) -> None:
    assert KEY not in httpx.get(f"{server.url}/metrics").text
    assert KEY not in server.output()
    frontends = []
    for pid in server.record_tree():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"workers.server.frontend" in cmd:
            frontends.append(cmd)
    assert len(frontends) == 1 and KEY.encode() not in frontends[0]
