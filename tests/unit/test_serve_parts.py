"""The server's parts without a server: wire format, the sequenced inbox over real zmq sockets,
the stop-string text stream, request validation, routing, the Prometheus page."""
from __future__ import annotations

import math
import re
import time

import pytest
import zmq

from workers.server import protocol
from workers.server.channel import Endpoints, JobKey, Signer
from workers.server.inbox import Inbox
from workers.server.metrics import FrontendMetrics, find, parse, render
from workers.server.openai_io import ApiError, Limits, parse_completion
from workers.server.protocol import (Abort, Generate, ModelInfo, QueueStats, Ready, Shutdown,
                                     StepOutput, TokenDelta)
from workers.server.router import Router
from workers.server.text import ByteCodec, TextStream

CODEC = ByteCodec(bos_token_id=256)
LIMITS = Limits(max_context_len=64, vocab_size=264, dp=2)


def _gen(seq: int, rid: str = "r", dp: int = 0) -> Generate:
    return Generate(seq, rid, dp, [256, 97], 4, 0.0, 1.0, 0)


# ---- wire format --------------------------------------------------------------------------------

def test_messages_round_trip_with_nested_objects() -> None:
    stats = QueueStats(1, 2, 3, 40, 50, 7, 9, 3, 11, 0.5, {"rounds": 11.0}, {"switches": 1.0},
                       {"0": 4, "2": 1})
    for msg in (_gen(1), Abort(2, "x"), Shutdown(3, "bye"),
                Ready(0, 0, True, 123, ModelInfo(64, 256, [257], 264, "static steps=3"), 12),
                StepOutput(1, [TokenDelta("a", [1, 2], None, 0.001, 0.02),
                               TokenDelta("b", [], "length")], stats)):
        assert protocol.decode(protocol.encode(msg)) == msg


@pytest.mark.parametrize("data,match", [
    (b"not json", "not JSON"),
    (b'{"seq": 1}', "no 'type' field"),
    (b'{"type": "Bogus"}', "unknown message type"),
    (b'{"type": "Abort", "seq": 1, "rid": "x", "extra": 2}', "unknown field.*extra"),
    (b'{"type": "Abort", "seq": 1}', "Abort: .*rid"),
])
def test_bad_messages_are_named(data: bytes, match: str) -> None:
    with pytest.raises(protocol.ProtocolError, match=match):
        protocol.decode(data)


# ---- inbox ----------------------------------------------------------------------------------------

KEY = JobKey("the secret of this test's serving job")


class _Sealed:
    """A PUSH socket that seals what it sends with the job's control key (as the frontend)."""

    def __init__(self, sock) -> None:
        self.sock, self.signer = sock, Signer(KEY.control)

    def send(self, data: bytes) -> None:
        self.sock.send(self.signer.seal(data))


@pytest.fixture
def inbox_and_push():
    ctx = zmq.Context()
    endpoints = Endpoints()
    inbox = Inbox(ctx, endpoints, KEY)
    push = ctx.socket(zmq.PUSH)
    push.connect(inbox.address)
    yield inbox, _Sealed(push)
    push.close(linger=0)
    inbox.close()
    ctx.term()
    endpoints.close()


def _wait_for(inbox: Inbox, seq: int) -> None:
    deadline = time.monotonic() + 5
    while inbox.received_seq < seq and time.monotonic() < deadline:
        inbox.wait(0.5)
    assert inbox.received_seq == seq


def test_inbox_applies_in_seq_order_up_to_the_agreed_seq(inbox_and_push) -> None:
    inbox, push = inbox_and_push
    for seq in (2, 3, 5):                       # out of order, 1 and 4 missing
        push.send(protocol.encode(_gen(seq, f"r{seq}")))
    deadline = time.monotonic() + 5
    while len(inbox._pending) < 3 and time.monotonic() < deadline:
        inbox.wait(0.5)
    assert inbox.received_seq == 0 and not inbox.has_unapplied     # 1 is missing
    push.send(protocol.encode(Abort(1, "r0")))
    _wait_for(inbox, 3)                          # 1..3 arrived; 4 is still missing
    assert [m.seq for m in inbox.take_upto(2)] == [1, 2]   # an agreed point below what arrived
    assert inbox.has_unapplied
    with pytest.raises(ValueError, match="only messages up to seq 3"):
        inbox.take_upto(4)
    push.send(protocol.encode(Shutdown(4)))
    _wait_for(inbox, 5)
    assert [m.seq for m in inbox.take_upto(inbox.received_seq)] == [3, 4, 5]
    assert inbox.take_upto(5) == [] and not inbox.has_unapplied


def test_idle_inbox_blocks_until_a_message_wakes_it(inbox_and_push) -> None:
    inbox, push = inbox_and_push
    start = time.monotonic()
    assert inbox.wait(0.3) is False              # nothing: the poll times out
    assert time.monotonic() - start >= 0.25
    push.send(protocol.encode(_gen(1)))
    start = time.monotonic()
    assert inbox.wait(10.0) is True              # a message ends the wait at once
    assert time.monotonic() - start < 1.0


def test_what_is_not_this_job_s_is_dropped_and_counted_never_fatal(inbox_and_push) -> None:
    """Garbage, a message sealed with another key or the other direction's key, a replay of a
    sealed message, a sealed message that is no control message or repeats a seq: each is
    dropped and counted, and the inbox goes on taking the job's messages in order."""
    inbox, push = inbox_and_push
    raw = push.sock
    good = Signer(KEY.control).seal(protocol.encode(_gen(1)))
    raw.send(b"{not json at all")                                    # the 15 bytes of the issue
    raw.send(protocol.encode(_gen(1)))                               # right message, no MAC
    raw.send(Signer(JobKey("another job's secret, 32 chars").control).seal(
        protocol.encode(_gen(1))))
    raw.send(Signer(KEY.output).seal(protocol.encode(_gen(1))))      # the ranks' direction
    raw.send(good[:-1] + b"x")                                       # tampered
    assert inbox.wait(0.5) is False                  # nothing of the job's: the wait goes on
    raw.send(good)
    _wait_for(inbox, 1)
    raw.send(good)                                                   # a replay
    push.send(b"not json")                                           # sealed, undecodable
    push.send(protocol.encode(Ready(0, 0, True, 1, ModelInfo(64, 256, [257], 264, "x"))))
    push.send(protocol.encode(_gen(1)))                              # seq 1 again
    push.send(protocol.encode(_gen(2)))
    _wait_for(inbox, 2)
    assert [m.seq for m in inbox.take_upto(2)] == [1, 2]
    assert inbox.verifier.snapshot() == {"unauthenticated": 5, "replayed": 1, "malformed": 3}


# ---- text ---------------------------------------------------------------------------------------

def _feed_bytes(stream: TextStream, data: bytes, final_at_end: bool = True) -> list[str]:
    ids = list(data)
    pieces = [stream.feed([t], final=final_at_end and i == len(ids) - 1)
              for i, t in enumerate(ids)]
    return pieces


def test_text_stream_cuts_at_the_first_stop_string_across_tokens() -> None:
    stream = TextStream(CODEC, ["\n\n", "END"])
    pieces = _feed_bytes(stream, b"abc EN de\n\nmore END")
    assert "".join(pieces) == "abc EN de" and stream.text == "abc EN de" and stream.stopped
    assert stream.feed(list(b"xyz"), final=True) == ""


def test_text_stream_holds_back_incomplete_utf8_and_emits_it_whole() -> None:
    stream = TextStream(CODEC)
    data = "héllo ✓ ok".encode()
    pieces = _feed_bytes(stream, data)
    assert "".join(pieces) == "héllo ✓ ok"
    assert all("\ufffd" not in p for p in pieces)
    assert stream.token_ids == list(data)


def test_text_stream_final_equals_tokenizer_decode_with_specials_and_bad_bytes() -> None:
    from workers import tokenizer

    ids = [104, 105, 0xff, 257, 0xe2, 0x9c]      # invalid byte, EOS, truncated character
    stream = TextStream(CODEC)
    text = stream.feed(ids[:3], final=False) + stream.feed(ids[3:], final=True)
    assert text == tokenizer.decode(ids)


# ---- request validation -------------------------------------------------------------------------

def _body(**kw):
    return {"model": "m", "prompt": "hi", **kw}


@pytest.mark.parametrize("body,param,match", [
    ([1, 2], None, "must be a JSON object"),
    (_body(model="gpt-4"), "model", "'gpt-4' does not exist; this server serves 'm'"),
    ({"prompt": "x"}, "model", "required"),
    (_body(prompt=""), "prompt", "prompt is empty"),
    (_body(prompt=[]), "prompt", "list of prompts is empty"),
    (_body(prompt=["ok", ""]), "prompt", r"prompt\[1\]: the prompt is empty"),
    (_body(prompt=5), "prompt", "expected a string or a list, got integer"),
    (_body(prompt=[[1, 999]]), "prompt", "token id 999 is outside the vocabulary"),
    (_body(prompt="x" * 64), "prompt", "longer than the context length \\(64 tokens"),
    (_body(prompt="x" * 40, max_tokens=30), "max_tokens", "exceeds the context length"),
    (_body(max_tokens=0), "max_tokens", "0 must be >= 1"),
    (_body(max_tokens=-3), "max_tokens", "must be >= 1"),
    (_body(max_tokens="8"), "max_tokens", "expected an integer, got string"),
    (_body(max_tokens=True), "max_tokens", "expected an integer, got boolean"),
    (_body(temperature=-0.5), "temperature", r"-0.5 is out of range; allowed: 0 \(greedy\) or"),
    (_body(temperature=math.nan), "temperature", "not a finite number"),
    (_body(temperature="hot"), "temperature", "expected a number"),
    (_body(top_p=0), "top_p", r"0 is out of range; allowed: a number in \(0, 1\]"),
    (_body(top_p=1.5), "top_p", r"1.5 is out of range; allowed: a number in \(0, 1\]"),
    (_body(stop=3), "stop", "expected a string or a list of strings"),
    (_body(stream="yes"), "stream", "expected a boolean"),
    (_body(n=0), "n", "0 must be >= 1"),
    (_body(logprobs=6), "logprobs", r"6 is out of range; allowed: null or an integer in \[0, 5\]"),
    (_body(logprobs=True), "logprobs", "expected an integer, got boolean"),
    (_body(dp_rank=2), "dp_rank", r"must be in \[0, 2\)"),
    (_body(temprature=0), "temprature", "unknown field"),
])
def test_bad_requests_name_the_field(body, param, match) -> None:
    with pytest.raises(ApiError) as info:
        parse_completion(body, "m", LIMITS, CODEC.encode)
    err = info.value
    assert err.status == 400 and err.param == param
    assert re.search(match, err.message), err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_good_request_defaults_and_prompt_forms() -> None:
    p = parse_completion(_body(), "m", LIMITS, CODEC.encode)
    assert p.prompts == [[256, 104, 105]] and p.max_tokens == 16 and p.temperature == 1.0
    p = parse_completion(_body(prompt=["a", [1, 2]], stop="x", temperature=0, seed=3,
                               stream=True, stream_options={"include_usage": True}),
                         "m", LIMITS, CODEC.encode)
    assert p.prompts == [[256, 97], [1, 2]] and p.stop == ["x"] and p.include_usage
    assert parse_completion(_body(prompt=[5, 6]), "m", LIMITS, CODEC.encode).prompts == [[5, 6]]


# ---- routing --------------------------------------------------------------------------------------

def test_router_shortest_round_robin_and_pinning() -> None:
    shortest = Router(3, "shortest")
    assert shortest.choose([5, 2, 2]) == 1 and shortest.choose([0, 0, 0]) == 0
    assert shortest.choose([0, 9, 9], pinned=2) == 2
    rr = Router(3, "round_robin")
    assert [rr.choose([0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="routing='fastest'"):
        Router(2, "fastest")


# ---- metrics page ---------------------------------------------------------------------------------

def test_metrics_page_parses_and_has_the_histogram() -> None:
    metrics = FrontendMetrics()
    metrics.requests["success"] += 3
    metrics.wake.observe(0.002)
    stats = QueueStats(0, 1, 2, 30, 40, 5, 10, 3, 8, 0.25, {"rounds": 8.0},
                       {"switches": 2.0}, {"0": 1, "3": 2})
    page = render(metrics, healthy=True, ranks=1, ranks_ready=1, in_flight=3, loads=[7],
                  stats={0: stats})
    samples = parse(page)
    assert find(samples, "requests_total", outcome="success") == 3
    assert find(samples, "kv_free_pages", dp_rank=0) == 5
    assert find(samples, "switches_total", dp_rank=0) == 2
    assert find(samples, "accept_length_bucket", dp_rank=0, le="2") == 1
    assert find(samples, "accept_length_bucket", dp_rank=0, le="+Inf") == 3
    assert find(samples, "accept_length_sum", dp_rank=0) == 6
    assert find(samples, "planner_stat", dp_rank=0, stat="switches") == 2


def test_admission_logprob_limit_is_the_engines() -> None:
    from workers import sampling
    from workers.server import admission

    assert admission.MAX_LOGPROBS == sampling.MAX_LOGPROBS


def test_metrics_histograms_have_cumulative_buckets_and_the_model_label() -> None:
    metrics = FrontendMetrics()
    for value in (0.004, 0.02, 0.02, 400.0):
        metrics.ttft.observe(value)
    stats = QueueStats(0, 1, 0, 30, 0, 2, 10, 3, 8, 0.25, spec_drafts=4, spec_draft_tokens=12,
                       spec_accepted_tokens=5, spec_accepted_per_pos=[3, 2, 0])
    samples = parse(render(metrics, healthy=True, ranks=1, ranks_ready=1, in_flight=0,
                           loads=[0], stats={0: stats}, model_name='m "x"'))
    assert find(samples, "time_to_first_token_seconds_bucket", le="0.005") == 1
    assert find(samples, "time_to_first_token_seconds_bucket", le="0.025") == 3
    assert find(samples, "time_to_first_token_seconds_bucket", le="300") == 3
    assert find(samples, "time_to_first_token_seconds_bucket", le="+Inf") == 4
    assert find(samples, "time_to_first_token_seconds_count") == 4
    assert find(samples, "kv_cache_usage_perc", dp_rank=0) == 0.8
    assert find(samples, "spec_decode_num_accepted_tokens_per_pos_total", dp_rank=0,
                position=1) == 2
    assert find(samples, "healthy", model_name='m "x"') == 1
    assert find(samples, "healthy", model_name="other") is None
