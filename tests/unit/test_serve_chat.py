"""One real server (`serve --steps 3`, a subprocess, the bundled pair) as real clients use it:
/v1/chat/completions through the official `openai` client (streaming and not; its prompt is the
bundled chat template's rendering, its output the offline greedy reference of that prompt),
`n` choices (choice k samples with seed + k), `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, the bodies the vLLM / SGLang benchmarks
send, GET /v1/models/{id}, /tokenize and /detokenize."""
from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import httpx
import openai
import pytest

from serve_helpers import PROMPTS, decode, kv_back_to_full, offline_greedy, sse_chunks, \
    start_server, wait_until
from workers.server.chat import load_chat_template
from workers.server.text import ByteCodec

TARGET = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny_pair" / "target"
MAX_TOKENS = 12
CONTEXT = 256
MODEL = "tiny_pair"
CONVERSATIONS = [
    [{"role": "user", "content": "def fib(n):"}],
    [{"role": "system", "content": "You write Python."},
     {"role": "user", "content": "import os\n"},
     {"role": "assistant", "content": "x = ["}, {"role": "user", "content": "while True:"}],
]
EOS_PROMPT = 'if __name__ == "__main__":\n    main()\n'


@pytest.fixture(scope="module")
def server():
    proc = start_server(["--steps", "3", "--max-batch-size", "4", "--max-model-len",
                         str(CONTEXT)])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def rendered(messages: list[dict]) -> str:
    """The prompt text of `messages` (the bundled template); it starts with the BOS text."""
    text = load_chat_template(TARGET).render(messages, True)
    assert text.startswith("<|bos|>") and text.count("<|bos|>") == 1
    return text


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of every conversation's rendered prompt (BOS + its bytes)."""
    return offline_greedy([rendered(m)[len("<|bos|>"):] for m in CONVERSATIONS], MAX_TOKENS)


def test_chat_completion_is_the_greedy_continuation_of_the_rendered_prompt(client, reference
                                                                          ) -> None:
    for messages, ref in zip(CONVERSATIONS, reference):
        prompt_tokens = len(ByteCodec(256).encode(rendered(messages), False))
        out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                             max_tokens=MAX_TOKENS)
        c = out.choices[0]
        assert (c.message.role, c.message.content, c.finish_reason) == \
            ("assistant", decode(ref), "length")
        assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens,
                                                                          len(ref))
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_completion_tokens=MAX_TOKENS,
            stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
            decode(ref)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref)
        assert chunks[-1].object == "chat.completion.chunk"


def test_content_parts_and_tokenize_give_the_same_prompt(server, client, reference) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "def"},
                                             {"type": "text", "text": " fib(n):"}]}]
    joined = [{"role": "user", "content": "def\n fib(n):"}]      # parts join with newlines
    a = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_tokens=MAX_TOKENS)
    b = client.chat.completions.create(model=MODEL, messages=joined, temperature=0,
                                       max_tokens=MAX_TOKENS)
    assert a.choices[0].message.content == b.choices[0].message.content
    want = ByteCodec(256).encode(rendered(CONVERSATIONS[0]), add_special_tokens=False)
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL,
                                                   "messages": CONVERSATIONS[0]}).json()
    assert r == {"count": len(want), "max_model_len": CONTEXT, "tokens": want,
                 "token_strs": None}
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hé"}).json()
    assert r["tokens"] == [256, 104, 0xC3, 0xA9] and r["count"] == 4
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hé", "add_special_tokens": False})
    assert r.json()["tokens"] == [104, 0xC3, 0xA9]
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": want + reference[0]}).json()
    assert r == {"prompt": rendered(CONVERSATIONS[0]) + decode(reference[0])}
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, 264]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_n_choices_sample_with_seed_plus_their_index(client) -> None:
    messages = CONVERSATIONS[0]
    kw = dict(model=MODEL, messages=messages, temperature=1.0, max_tokens=8)
    out = client.chat.completions.create(n=3, seed=11, **kw)
    texts = [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]
    assert [c.index for c in out.choices] == [0, 1, 2] and len(set(texts)) > 1
    alone = [client.chat.completions.create(seed=11 + k, **kw).choices[0].message.content
             for k in range(3)]
    assert texts == alone
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(n=3, seed=11, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    # completions: prompt p of a list, choice j -> index p * n + j, seed + that index
    many = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, seed=5,
                                     temperature=1.0, max_tokens=6)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    third = client.completions.create(model=MODEL, prompt=PROMPTS[1], seed=7, temperature=1.0,
                                      max_tokens=6)
    assert many.choices[2].text == third.choices[0].text
    assert many.usage.prompt_tokens == sum(len(p.encode()) + 1 for p in PROMPTS[:2])


def _eos_seed(server) -> tuple[int, list[int]]:
    """A seed whose sampled completion of `EOS_PROMPT` ends with EOS within 4 tokens (the draws
    are a function of the seed: the same seed finds the same one every run)."""
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": EOS_PROMPT, "n": 32, "seed": 0, "temperature": 1.0,
        "max_tokens": 4, "return_token_ids": True}).json()
    for c in r["choices"]:
        if c["finish_reason"] == "stop":
            assert c["token_ids"][-1] == 257 and c["text"] == decode(c["token_ids"])
            return c["index"], c["token_ids"]
    raise AssertionError(f"no seed in [0, 32) ends with EOS: {r['choices']}")


def test_ignore_eos_generates_past_the_end_of_sequence(server) -> None:
    seed, stopped = _eos_seed(server)
    body = {"model": MODEL, "prompt": EOS_PROMPT, "seed": seed, "temperature": 1.0,
            "max_tokens": len(stopped) + 6, "return_token_ids": True}
    again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert again["choices"][0]["token_ids"] == stopped              # the same seed, the same end
    for stream in (False, True):
        past = {**body, "ignore_eos": True, "skip_special_tokens": False, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=past,
                              timeout=60) as r:
                chunks = [c for c in sse_chunks(r) if "choices" in c]
            text = "".join(ch["text"] for c in chunks for ch in c["choices"])
            ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            c = httpx.post(f"{server.url}/v1/completions", json=past, timeout=60).json()
            text, ids, finish = (c["choices"][0][k] for k in ("text", "token_ids",
                                                              "finish_reason"))
        assert (len(ids), finish) == (body["max_tokens"], "length")
        assert ids[:len(stopped)] == stopped                          # EOS, then on
        assert "<|eos|>" in text and text == _with_specials(ids)


def _with_specials(ids: list[int]) -> str:
    from workers import tokenizer

    return tokenizer.decode(ids, skip_special_tokens=False)


def test_stop_token_ids_end_the_completion_at_the_token(client) -> None:
    [ref] = offline_greedy([PROMPTS[0]], 24)
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    token = ref[k]
    for include, text in ((False, decode(ref[:k])), (True, decode(ref[:k + 1]))):
        extra = {"stop_token_ids": [token], "include_stop_str_in_output": include,
                 "return_token_ids": True}
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                        temperature=0, extra_body=extra)
        c = out.choices[0]
        assert (c.text, c.token_ids, c.finish_reason) == (text, ref[:k + 1], "stop")
        assert out.usage.completion_tokens == k + 1
        got = "".join(ch.choices[0].text for ch in client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True,
            extra_body=extra))
        assert got == text


def test_include_stop_str_in_output_keeps_the_stop_string(client) -> None:
    [ref] = offline_greedy([PROMPTS[1]], 24)
    full = decode(ref)
    stop = full[4:7]
    for include, want in ((False, full[:full.index(stop)]),
                          (True, full[:full.index(stop) + len(stop)])):
        for stream in (False, True):
            kw = dict(model=MODEL, temperature=0, max_tokens=24)
            if stream:
                text = "".join(ch.choices[0].text for ch in client.completions.create(
                    prompt=PROMPTS[1], stop=[stop], stream=True,
                    extra_body={"include_stop_str_in_output": include}, **kw))
            else:
                out = client.completions.create(prompt=PROMPTS[1], stop=[stop],
                                                extra_body={"include_stop_str_in_output":
                                                            include}, **kw)
                text = out.choices[0].text
                assert out.choices[0].finish_reason == "stop"
            assert text == want, (include, stream)


def test_the_bodies_benchmark_clients_send(server) -> None:
    """As vLLM's and SGLang's serving benchmarks send them (greedy, their no-op defaults,
    ignore_eos: every request makes max_tokens tokens)."""
    bodies = [
        ("/v1/completions", {"model": MODEL, "prompt": PROMPTS[2], "temperature": 0.0,
                             "best_of": 1, "max_tokens": 10, "stream": True,
                             "ignore_eos": True}),
        ("/v1/completions", {"model": MODEL, "prompt": PROMPTS[2], "temperature": 0.0,
                             "repetition_penalty": 1.0, "max_tokens": 10, "logprobs": None,
                             "stream": True, "stream_options": {"include_usage": True},
                             "ignore_eos": True, "top_k": -1, "min_tokens": 0,
                             "presence_penalty": 0.0, "frequency_penalty": 0.0}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "text", "text": PROMPTS[2]}]}],
            "temperature": 0.0, "max_completion_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": PROMPTS[2]}], "temperature": 0.0, "max_tokens": 10,
            "stream": False, "ignore_eos": True, "top_p": 1.0, "logprobs": False,
            "top_logprobs": 0}),
    ]

    def one(item):
        path, body = item
        if not body["stream"]:
            return httpx.post(f"{server.url}{path}", json=body, timeout=60).json()["usage"]
        with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            chunks = sse_chunks(r)
        assert chunks[-1] == {"done": True}
        usage = [c["usage"] for c in chunks if c.get("usage")]
        return usage[-1] if usage else None      # SGLang's asks for none

    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        usages = list(pool.map(one, bodies))
    assert [u["completion_tokens"] for u in usages[1:]] == [10, 10, 10]
    assert wait_until(lambda: kv_back_to_full(server.url))


def test_model_by_id(server, client) -> None:
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    r = httpx.get(f"{server.url}/v1/models/gpt-4o")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "model: 'gpt-4o' does not exist; this server "
                                            f"serves '{MODEL}'", "type": "invalid_request_error",
                                 "param": "model", "code": "model_not_found"}


def test_bad_chat_requests_fail_alone(server, client, reference) -> None:
    url = f"{server.url}/v1/chat/completions"
    good = {"model": MODEL, "messages": CONVERSATIONS[0], "temperature": 0,
            "max_tokens": MAX_TOKENS, "stream": True}
    bad = [({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
           ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                        "image_url": {"url": "x"}}]}]},
            "messages"),
           ({"messages": [{"role": "user", "content": "x" * CONTEXT}]}, "messages"),
           ({"max_tokens": CONTEXT}, "max_tokens"), ({"top_k": -5}, "top_k"),
           ({"logprobs": 3}, "logprobs"), ({"tools": []}, "tools"),
           ({"n": 0}, "n"), ({"stop_token_ids": [264]}, "stop_token_ids")]
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=good) as in_flight:
        assert in_flight.status_code == 200
        for fields, param in bad:
            r = http.post(url, json={**good, "stream": False, **fields})
            assert r.status_code == 400, (fields, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["message"].split(":")[0].split(".")[0] \
                .split("[")[0] == param, err
        chunks = sse_chunks(in_flight)
    text = "".join(ch["delta"].get("content", "") for c in chunks if "choices" in c
                   for ch in c["choices"])
    assert text == decode(reference[0])
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.chat.completions.create(model=MODEL, messages=CONVERSATIONS[0],
                                       extra_body={"top_k": -3})
