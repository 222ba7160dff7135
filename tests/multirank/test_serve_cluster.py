"""A served cluster under torchrun: 2 ranks, 2 DP groups (one engine rank each), the frontend
spawned by rank 0. Outputs equal the offline reference whichever group serves them; stray
messages to a rank's inbox are dropped, not fatal; a killed rank is reported as the first cause;
a frozen rank brings the job down within seconds of being declared dead; a killed rank and
Ctrl-C both end in errors for the clients and no process left; SIGTERM to the ranks ends
torchrun cleanly (exit 0), SIGTERM to torchrun with its documented traceback. And on two gloo
ranks driven by the test itself: requests no rank can run are refused by every rank of their
replica alike, and the cluster keeps serving."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from multirank import run_ranks
from serve_helpers import (BAD_GENERATES, LONG_CONTEXT, PROMPTS, REFUSAL_SERVE, _offline_pair,
                           check_outcomes, decode, drive_ranks_job, frontend_config,
                           health_latency, kv_back_to_full, metric, metrics, offline_greedy,
                           refusal_script, send_stray, start_server, stray_messages, wait_until)
from workers.loading import encode_prompt
from workers.server.metrics import find

MAX_TOKENS = 10
TIMEOUT = 5      # --timeout: a rank silent this long is dead
LONG = {"model": "tiny_pair", "prompt": "def main():", "max_tokens": LONG_CONTEXT - 22,
        "temperature": 0}
# (greedy runs the whole max_tokens on this prompt: no early end of sequence)


def _rank_pid(server, rank: int) -> int:
    for pid in server.record_tree():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"adaptive_dist" in cmd and b"serve" in cmd \
                and b"torch.distributed.run" not in cmd:
            return pid
    raise AssertionError(f"no process of rank {rank} in {server.tree}")


def _stream_until_error(url: str) -> str:
    with httpx.stream("POST", f"{url}/v1/completions",
                      json={**LONG, "stream": True, "dp_rank": 1}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith('data: {"error"'):
                return json.loads(line[6:])["error"]["message"]
            if line == "data: [DONE]":
                return "finished normally"
    return "no error event"


@pytest.mark.parametrize("overlap", ["auto", "on"])
def test_two_dp_groups_serve_the_reference_output(overlap: str) -> None:
    server = start_server(["--dp", "2", "--adaptive", "--max-batch-size", "3",
                           "--max-model-len", "256", "--timeout", str(TIMEOUT),
                           "--overlap", overlap], nproc=2)
    try:
        reference = offline_greedy(PROMPTS, MAX_TOKENS)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        def one(i: int) -> tuple[str, list[int]]:
            extra = {"return_token_ids": True}
            if i % 4 == 0:
                extra["dp_rank"] = 1                     # pinned; the rest are routed
            if i % 2:
                text, ids = "", []
                for chunk in client.completions.create(
                        model="tiny_pair", prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                        temperature=0, stream=True, extra_body=extra):
                    text += chunk.choices[0].text
                    ids += chunk.choices[0].token_ids
                return text, ids
            out = client.completions.create(model="tiny_pair", prompt=PROMPTS[i],
                                            max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body=extra)
            return out.choices[0].text, out.choices[0].token_ids

        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(one, range(len(PROMPTS))))
        for ref, (text, ids) in zip(reference, results):
            assert ids == ref and text == decode(ref)
        assert wait_until(lambda: kv_back_to_full(server.url, dp=2)), metrics(server.url)
        m = metrics(server.url)
        for g in (0, 1):                                 # both groups served requests
            assert find(m, "rounds_total", dp_rank=g) > 0
            assert find(m, "spec_steps", dp_rank=g) in (1, 3, 7)
        if overlap == "auto":
            # SIGTERM to the ranks, not to torchrun: every process exits 0, so does torchrun,
            # and nothing prints a traceback (docs/serving.md, "Stopping")
            for pid in _torchrun_children(server):
                os.kill(pid, signal.SIGTERM)
            assert server.wait_exit(30) == 0, server.output()
            out = server.output()
            assert "Traceback" not in out and "[rank 0] the frontend exited (code 0)" in out, out
            assert "[rank 0] stopping: received SIGTERM" in out, out
    finally:
        server.stop()
    assert server.left_behind() == []


def _torchrun_children(server) -> list[int]:
    pid = server.proc.pid
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_over_two_dp_groups_with_a_template_file(tmp_path) -> None:
    """`--chat-template FILE` (and vLLM's spelling of --dp): n greedy choices of one chat
    request, routed over both groups, are each the offline reference of the rendered prompt."""
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = start_server(["--data-parallel-size", "2", "--steps", "3", "--max-batch-size", "2",
                           "--max-model-len", "256", "--timeout", str(TIMEOUT),
                           "--chat-template", str(template)], nproc=2)
    try:
        messages = [{"role": "system", "content": "code"}, {"role": "user", "content": "x = ["}]
        [ref] = offline_greedy(["<system>code\n<user>x = [\n<assistant>"], MAX_TOKENS)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        before = [find(metrics(server.url), "rounds_total", dp_rank=g) for g in (0, 1)]
        out = client.chat.completions.create(model="tiny_pair", messages=messages, n=4,
                                             temperature=0, max_tokens=MAX_TOKENS)
        assert [c.message.content for c in out.choices] == [decode(ref)] * 4
        assert out.usage.completion_tokens == 4 * len(ref)
        streamed = [""] * 4
        for chunk in client.chat.completions.create(model="tiny_pair", messages=messages, n=4,
                                                    temperature=0, max_tokens=MAX_TOKENS,
                                                    stream=True):
            for c in chunk.choices:
                streamed[c.index] += c.delta.content or ""
        assert streamed == [decode(ref)] * 4
        # logprobs on both groups alike; echo with logprobs needs one replica: a 400 naming it
        lps = [c.logprobs.content for c in client.chat.completions.create(
            model="tiny_pair", messages=messages, n=2, temperature=0, max_tokens=MAX_TOKENS,
            logprobs=True, top_logprobs=2).choices]
        assert [e.token for e in lps[0]] == [e.token for e in lps[1]] and len(lps[0]) == len(ref)
        assert all(abs(a.logprob - b.logprob) < 2e-3 for a, b in zip(*lps))
        with pytest.raises(openai.BadRequestError, match="echo") as info:
            client.completions.create(model="tiny_pair", prompt="x", echo=True, logprobs=1,
                                      max_tokens=2)
        assert info.value.body["param"] == "echo"
        after = [find(metrics(server.url), "rounds_total", dp_rank=g) for g in (0, 1)]
        assert all(a > b for a, b in zip(after, before)), (before, after)   # both groups ran
        # SIGTERM to torchrun itself: our processes stop cleanly, then torchrun's agent re-raises
        # the signal as its SignalException: a traceback and exit 1, as docs/serving.md says
        server.signal(signal.SIGTERM)
        assert server.wait_exit(30) == 1, server.output()
        out = server.output()
        for line in ("[rank 0] stopping: received SIGTERM", "[rank 1] stopping: received SIGTERM",
                     "[rank 0] the frontend exited (code 0)"):
            assert line in out, out
        assert out.rstrip().splitlines()[-1].startswith(
            "torch.distributed.elastic.multiprocessing.api.SignalException: Process "), out
        assert out.rstrip().endswith("got signal: 15"), out
        assert out.count("Traceback") == 1, out
    finally:
        server.stop()
    assert server.left_behind() == []


HANG_TIMEOUT = 30   # a frozen rank: declared dead after min(--timeout, 10) = 10 s


@pytest.mark.parametrize("how", ["kill_rank_1", "hang_rank_1", "ctrl_c"])
def test_rank_death_or_ctrl_c_fails_requests_and_leaves_nothing(how: str) -> None:
    timeout = HANG_TIMEOUT if how == "hang_rank_1" else TIMEOUT
    server = start_server(["--dp", "2", "--steps", "3", "--max-model-len", str(LONG_CONTEXT),
                           "--timeout", str(timeout)], nproc=2)
    try:
        if how == "kill_rank_1":
            # first, the issue's attack: stray messages to rank 1's inbox end nothing
            send_stray(frontend_config(server)["ranks"][1]["address"], stray_messages())
            assert wait_until(lambda: metric(server.url, "dropped_messages_total",
                                             receiver="rank1", reason="unauthenticated")
                              == len(stray_messages()), 10), metrics(server.url)
            status, seconds = health_latency(server.url)
            assert status == 200 and seconds < 1.0
            [ref] = offline_greedy([PROMPTS[0]], MAX_TOKENS)
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": "tiny_pair", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                "temperature": 0, "dp_rank": 1, "return_token_ids": True})
            assert r.json()["choices"][0]["token_ids"] == ref
        with cf.ThreadPoolExecutor(4) as pool:
            # on the group of rank 1, so none can finish before the failure is noticed
            streams = [pool.submit(_stream_until_error, server.url) for _ in range(2)]
            plain = pool.submit(httpx.post, f"{server.url}/v1/completions",
                                json={**LONG, "dp_rank": 1}, timeout=60)
            time.sleep(1.0)                              # every request is generating
            assert not any(f.done() for f in streams + [plain])
            start = time.monotonic()
            rank1 = _rank_pid(server, 1)
            if how == "kill_rank_1":                     # torchrun sees it and stops the job
                os.kill(rank1, signal.SIGKILL)
            elif how == "hang_rank_1":                   # alive but silent: only heartbeats tell
                os.kill(rank1, signal.SIGSTOP)
            else:
                server.signal(signal.SIGINT)
            health, refused = _observe_failure(server.url, timeout)
            declared = time.monotonic()
            if how == "hang_rank_1":
                assert "rank 1 stopped responding" in refused, refused
            for f in streams:
                assert "the server is shutting down" in f.result(timeout=30)
            r = plain.result(timeout=30)
            assert r.status_code == 503 and r.json()["error"]["message"]
        code = server.wait_exit(timeout + 20)
        elapsed = time.monotonic() - start
        assert code is not None and elapsed < min(timeout, 10) + 8, (elapsed, server.output())
        assert health == 503 and refused and "shutting down" in refused, (health, refused)
        assert server.left_behind() == [], server.output()
        out = server.output()
        if how == "kill_rank_1":
            # the first cause, not torchrun's SIGTERM that reached the frontend after it
            assert "rank 1 failed: its process" in refused and "SIGTERM" not in refused, refused
            assert f"[frontend] rank 1 failed: its process (pid {rank1})" in out, out
        elif how == "hang_rank_1":
            # declared dead at 10 s; the frontend kills the frozen rank, rank 0 leaves its
            # collective at once: down within seconds, not at the 30 s collective timeout
            assert time.monotonic() - declared < 6.0, (time.monotonic() - declared, out)
            assert f"rank 1 (pid {rank1}) was declared dead: killing it (SIGKILL)" in out, out
        else:
            assert re.search(r"\[frontend\] rank [01] stopped: received SIGINT", out), out
    finally:
        server.stop()


def _observe_failure(url: str, timeout: float = TIMEOUT) -> tuple:
    """(/health status, a new request's error message) while the frontend is still up."""
    health, refused = None, None
    deadline = time.monotonic() + min(timeout, 10) + 10
    while time.monotonic() < deadline and (health != 503 or refused is None):
        try:
            health = httpx.get(f"{url}/health", timeout=2).status_code
            if health == 503:
                r = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2},
                               timeout=5)
                if r.status_code >= 500:
                    refused = r.json()["error"]["message"]
        except httpx.HTTPError:
            break                                        # the frontend is gone already
        time.sleep(0.05)
    return health, refused


@pytest.mark.parametrize("layout", ["dp_2", "attn_tp_2"])
def test_a_replica_refuses_what_it_cannot_run_on_every_rank_in_the_same_round(layout) -> None:
    """The test is the frontend: it PUSHes requests no rank can run (a seed past int64, token
    ids past the vocabulary, NaN, ...) to every rank's real inbox, among good ones. Two replicas
    of one rank (the bad ones on replica 1), or one replica over two attention ranks: every rank
    of the replica refuses each bad request in the same round (so the good ones equal the
    reference: the replica stayed in lockstep), the leader reports 400 naming the field, and
    every rank leaves at the Shutdown, not by a failure."""
    argv = REFUSAL_SERVE + (["--dp", "2"] if layout == "dp_2" else ["--dp", "1", "--attn-tp", "2"])
    bad_dp, good_dps = (1, (0, 1)) if layout == "dp_2" else (0, (0,))
    ids = encode_prompt(PROMPTS[0], _offline_pair()[1])
    # prompt logprobs (echo with logprobs): refused naming echo with several replicas, run
    # with one (its eager prefill on both attention ranks)
    echo = {**refusal_script(ids, bad_dp, good_dps)[0], "rid": "echo", "dp_rank": bad_dp,
            "prompt_logprobs": 1, "logprobs": 1}
    results = run_ranks(drive_ranks_job, 2, argv, refusal_script(ids, bad_dp, good_dps) + [echo],
                        timeout=300)
    first = results[0].value
    assert first["driver_error"] is None, first["driver_error"]
    outcomes = dict(first["outcomes"])
    reference = offline_greedy([PROMPTS[0]], 8)[0]
    if layout == "dp_2":
        kind, status, param, message = outcomes.pop("echo")
        assert (kind, status, param) == ("refused", 400, "echo") and "--dp" in message, message
    else:
        assert outcomes.pop("echo") == ("done", reference,
                                        "length" if len(reference) == 8 else "stop")
    check_outcomes(outcomes, reference)
    for r in results:
        assert r.value["exit"] == ("the frontend asked to stop (the test is done)", False)
        assert r.value["code"] == 0
    refusals = [r.value["refusals"] for r in results]
    if layout == "dp_2":                                 # only replica 1's rank saw them
        assert refusals[0] == [] and len(refusals[1]) == len(BAD_GENERATES) + 1
    else:                                                # the same requests, the same rounds
        assert refusals[0] == refusals[1] and len(refusals[0]) == len(BAD_GENERATES)
