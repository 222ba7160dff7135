"""The parts behind /v1/chat/completions and the benchmark clients' fields, without a server: the
bundled pair's tokenizer.json (the same ids as the engine's byte tokenizer, through `tokenizers`
and transformers' AutoTokenizer), chat templates rendered as transformers renders them (sandbox,
raise_exception, tojson, generation blocks), request validation of chat and the no-op fields,
the stop rules of `include_stop_str_in_output` / stop tokens / `skip_special_tokens`, the ranks'
checks of `stop_token_ids` / `ignore_eos`, the other spellings of the server's flags, and the
thread count of a rank."""
from __future__ import annotations

import json
import os
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workers import tokenizer as bytes_tok
from workers.server import admission
from workers.server.chat import (ChatTemplate, TemplateRefusal, TemplateSource, find_template,
                                 load_chat_template, special_tokens)
from workers.server.openai_io import (ApiError, Limits, parse_chat, parse_completion,
                                      parse_detokenize, parse_tokenize)
from workers.server.protocol import Generate
from workers.server.text import ByteCodec, Codec, TextStream
from workers.tokenizer import ByteTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "workers" / "assets" / "tiny_pair" / "target"
CODEC = ByteCodec(bos_token_id=256)
LIMITS = Limits(max_context_len=64, vocab_size=264, dp=2, max_prompts=8, eos_token_ids=(257,))
CORPUS = ["def f(x):\n    return 'héllo wörld' + x  # ✓ 中文 🙂 — ok", "", " ",
          "  leading",
          "tab\tnew\nline\r\ncr", "\x00\x01\x7f\x80 controls", "ÿĀ Latin-1 edges \u00a0\u00ad",
          "<|bos|", "|eos|>", "<| bos |>", "a" * 3000, "\U0010ffff\ufeff\u200b",
          "<|bos|># user:\nhi\n# assistant:\n", "a<|eos|><|eos|>b<|pad|>", "<|unused4|>",
          "x<|bos|>y<|unused0|><<|eos|>>", "<|unused5|><|bos|"]


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = [chr(c) for c in [*range(0, 0x250), *range(0x4e00, 0x4e40), 0x1f642, 0x10ffff]
                if not 0xd800 <= c < 0xe000]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80))) for _ in range(n)]


# ---- the bundled pair's tokenizer.json -----------------------------------------------------------

def test_tokenizer_json_gives_the_engine_tokenizer_ids() -> None:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    engine = load_tokenizer(TARGET)
    assert isinstance(engine, ByteTokenizer)          # the engine keeps its own implementation
    assert hf.get_vocab_size(with_added_tokens=True) == 264
    assert {i: hf.id_to_token(i) for i in range(256, 264)} == bytes_tok.SPECIAL_TOKENS
    for text in CORPUS + _random_texts(300, 0):
        assert hf.encode(text).ids == engine.encode(text), text            # BOS + bytes
        assert hf.encode(text, add_special_tokens=False).ids == engine.encode(
            text, add_special_tokens=False)
    rng = random.Random(1)
    for _ in range(1000):       # every id, invalid UTF-8 included, with and without specials
        ids = [rng.randrange(264) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == engine.decode(ids, skip), ids


def test_special_tokens_texts_are_their_ids() -> None:
    engine = load_tokenizer(TARGET)
    assert engine.encode("a<|eos|>b<|bos|", add_special_tokens=False) == [97, 257, 98,
                                                                           *b"<|bos|"]
    assert engine.decode(engine.encode("x<|pad|>y"), skip_special_tokens=False) == \
        "<|bos|>x<|pad|>y"
    assert bytes_tok.encode("<|eos|>") == list(b"<|eos|>")      # the module's encode: bytes


def test_auto_tokenizer_loads_the_bundled_pair() -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(TARGET))
    engine = load_tokenizer(TARGET)
    for text in CORPUS[:6]:
        assert tok(text).input_ids == engine.encode(text)
        assert tok.decode(engine.encode(text), skip_special_tokens=True) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ours = load_chat_template(TARGET).render(messages, True)
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == ours
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == CODEC.encode(ours, add_special_tokens=False)


# ---- chat templates ------------------------------------------------------------------------------

# written in the style of Llama-3's and Qwen2.5's templates (their constructs: namespace, loop
# variables, trim, tojson, raise_exception, bos_token, a system prompt by default)
LLAMA3_STYLE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Cutting Knowledge Date: December 2023\\n\\n' }}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant') }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")
QWEN_STYLE = (
    "{%- if tools %}{{ raise_exception('no tools here') }}{%- endif %}\n"
    "{% for message in messages %}\n"             # block tags without '-': trim_blocks and
    "    {% if loop.first %}\n"                   # lstrip_blocks decide the whitespace
    "[first of {{ loop.length }}]\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
    "{%- if messages[0]['role'] != 'system' %}\n"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(turns=0) %}\n"
    "{%- for message in messages %}\n"
    "    {%- set ns.turns = ns.turns + 1 %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content }}\n"
    "    {%- if message.name is defined %}{{ ' (' ~ message.name ~ ')' }}{% endif %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '<!-- ' ~ ({'turns': ns.turns, 'last': messages[-1].content} | tojson) ~ ' -->' }}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "héllo ✓ <b>\"x\"</b>"}],
    [{"role": "user", "content": "a\n\nb", "name": "alice"}],
]


@pytest.mark.parametrize("template", [LLAMA3_STYLE, QWEN_STYLE], ids=["llama3", "qwen"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendering_equals_transformers(template: str, generation_prompt: bool) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(TARGET))
    ours = ChatTemplate(TemplateSource(template, "test"), special_tokens(TARGET))
    for messages in CONVERSATIONS:
        want = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=generation_prompt)
        assert ours.render(messages, generation_prompt) == want


def test_template_refusals_and_the_sandbox() -> None:
    llama = ChatTemplate(TemplateSource(LLAMA3_STYLE, "test"), {"bos_token": "<s>"})
    with pytest.raises(TemplateRefusal, match="roles must alternate"):
        llama.render([{"role": "assistant", "content": "x"}])
    evil = ChatTemplate(TemplateSource("{{ messages.__class__.__mro__ }}", "t"), {})
    with pytest.raises(TemplateRefusal, match="SecurityError|unsafe|UndefinedError"):
        evil.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate(TemplateSource("{{ messages.append(1) }}", "t"), {})
    with pytest.raises(TemplateRefusal):      # immutable: a template cannot change its inputs
        mutate.render([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate(TemplateSource("{% for %}", "broken.jinja"), {})
    block = ChatTemplate(TemplateSource(
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}", "t"), {})
    assert block.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) \
        == "[a][b]4"


def test_where_templates_come_from(tmp_path: Path) -> None:
    assert find_template(TARGET).origin.endswith("tokenizer_config.json's chat_template")
    assert special_tokens(TARGET)["bos_token"] == "<|bos|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"},
                           {"name": "default", "template": "D{{ eos_token }}"}],
         "eos_token": {"content": "</s>"}}))
    assert load_chat_template(tmp_path).render([]) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path).render([]) == "J"
    override = tmp_path / "mine.jinja"
    override.write_text("M{{ messages | length }}")
    assert load_chat_template(tmp_path, override).render([{}, {}]) == "M2"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_chat_template(empty) is None
    with pytest.raises(ValueError, match="--chat-template .*cannot be read"):
        load_chat_template(empty, tmp_path / "missing.jinja")


# ---- chat request validation --------------------------------------------------------------------

def _render(messages, add_generation_prompt):
    text = load_chat_template(TARGET).render([m.for_template() for m in messages],
                                             add_generation_prompt)
    return CODEC.encode(text, add_special_tokens=False)


def _chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def test_chat_request_prompt_and_defaults() -> None:
    p = parse_chat(_chat(), "m", LIMITS, _render)
    assert p.prompts == [[256, *b"# user:\nhi\n# assistant:\n"]] and p.chat
    assert p.max_tokens == 64 - len(p.prompts[0])        # the rest of the context
    parts = _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "h"},
                                                          {"type": "text", "text": "i"}]}])
    assert parse_chat(parts, "m", LIMITS, _render).prompts == [[256, *b"# user:\nh\ni\n"
                                                               b"# assistant:\n"]]
    p = parse_chat(_chat(max_completion_tokens=5, n=3, seed=7, stop_token_ids=[10, 10, 257],
                         ignore_eos=True, top_k=-1, min_tokens=0, logprobs=False,
                         presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1.0,
                         top_logprobs=0, stream=True, stream_options={"include_usage": True},
                         include_stop_str_in_output=True, skip_special_tokens=False,
                         max_tokens=5, add_generation_prompt=False),
                   "m", LIMITS, _render)
    assert (p.max_tokens, p.n, p.choices, p.seed, p.stop_token_ids, p.ignore_eos) == \
        (5, 3, 3, 7, (10, 257), True)
    assert p.include_stop_str_in_output and not p.skip_special_tokens and p.include_usage
    assert p.prompts == [[256, *b"# user:\nhi\n"]]


@pytest.mark.parametrize("body,param,match", [
    (_chat(messages=None), "messages", "messages: required"),
    (_chat(messages=[]), "messages", "list of messages is empty"),
    (_chat(messages="hi"), "messages", "expected a list of messages"),
    (_chat(messages=[{"role": "tool", "content": "x"}]), "messages",
     r"messages\[0\]\.role: 'tool' is not a supported role"),
    (_chat(messages=[{"role": "user"}]), "messages", r"messages\[0\]\.content: required"),
    (_chat(messages=[{"role": "user", "content": 3}]), "messages", "got integer"),
    (_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages", r"content\[0\]\.type: 'image_url' is not supported by this server"),
    (_chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages",
     r"messages\[0\]\.tool_calls: not supported"),
    (_chat(messages=[{"role": "user", "content": "x" * 64}]), "messages",
     "longer than the context length"),
    (_chat(max_tokens=3, max_completion_tokens=4), "max_completion_tokens", "disagree"),
    (_chat(max_completion_tokens=60), "max_completion_tokens",
     "max_completion_tokens: prompt .* exceeds the context length"),
    (_chat(max_completion_tokens=0), "max_completion_tokens", "must be >= 1"),
    (_chat(top_k=-2), "top_k", r"-2 is out of range; allowed: -1 or 0 \(no top-k\)"),
    (_chat(top_k=2 ** 63), "top_k", "out of range"),
    (_chat(top_k=1.5), "top_k", "expected an integer"),
    (_chat(max_tokens=4, min_tokens=5), "min_tokens", r"5 is out of range; .*\(here 4\)"),
    (_chat(min_tokens=-1), "min_tokens", "out of range"),
    (_chat(logprobs=1), "logprobs", "expected a boolean"),
    (_chat(top_logprobs=2), "top_logprobs", "2 needs logprobs: true"),
    (_chat(logprobs=True, top_logprobs=21), "top_logprobs", r"allowed: null or an integer in \[0, 20\]"),
    (_chat(repetition_penalty=0), "repetition_penalty", r"0 is out of range; allowed: a number in \[0.01, 100\]"),
    (_chat(repetition_penalty=1e300), "repetition_penalty", "out of range"),
    (_chat(frequency_penalty=2.5), "frequency_penalty", r"allowed: a number in \[-2, 2\]"),
    (_chat(presence_penalty=math.nan), "presence_penalty", "not a finite number"),
    (_chat(logit_bias={"1": 2}), "logit_bias", "not supported"),
    (_chat(tools=[]), "tools", "unknown field"),
    (_chat(echo=False), "echo", "unknown field"),             # a completions field
    (_chat(n=9), "n", "holds at most 8"),
    (_chat(n=3, seed=2 ** 63 - 2), "seed", r"\+ 2 \(choice i samples with seed \+ i\)"),
    (_chat(ignore_eos="yes"), "ignore_eos", "expected a boolean"),
    (_chat(stop_token_ids=[1, 2, 3, 4, 5, 6, 7, 8]), "stop_token_ids",
     "8 stop token ids with the model's end-of-sequence id.* make 9; at most 8"),
    (_chat(stop_token_ids=[300]), "stop_token_ids", r"stop_token_ids\[0\]: token id 300"),
    (_chat(stop_token_ids=[True]), "stop_token_ids", "expected a token id"),
    (_chat(stream_options={"continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats", "unknown field"),
    (_chat(skip_special_tokens=0), "skip_special_tokens", "expected a boolean"),
])
def test_bad_chat_requests_name_the_field(body, param, match) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat(body, "m", LIMITS, _render)
    err = info.value
    assert err.status == 400 and err.param == param, err.message
    assert re.search(match, err.message), err.message


def test_completion_fields_of_the_benchmarks() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 5, "best_of": 2, "echo": False,
            "logprobs": None, "ignore_eos": True, "top_k": 0, "stop_token_ids": [10]}
    p = parse_completion(body, "m", LIMITS, CODEC.encode)
    assert (p.choices, p.n, p.ignore_eos, p.stop_token_ids) == (4, 2, True, (10,))
    assert parse_completion({**body, "ignore_eos": True, "stop_token_ids": list(range(8))},
                            "m", LIMITS, CODEC.encode).stop_token_ids == tuple(range(8))
    for bad, param in (({"best_of": 3}, "best_of"), ({"echo": 1}, "echo"),
                       ({"suffix": "x"}, "suffix"), ({"logprobs": 6}, "logprobs"),
                       ({"echo": True, "logprobs": 0}, "echo"),   # LIMITS: dp 2
                       ({"n": 5}, "n"), ({"messages": []}, "messages")):
        with pytest.raises(ApiError) as info:
            parse_completion({**body, **bad}, "m", LIMITS, CODEC.encode)
        assert info.value.param == param, info.value.message


def test_tokenize_and_detokenize_requests() -> None:
    r = parse_tokenize({"prompt": "hi"}, "m")
    assert (r.text, r.add_special_tokens) == ("hi", True)
    r = parse_tokenize({"model": "m", "messages": [{"role": "user", "content": "x"}],
                        "add_generation_prompt": False}, "m")
    assert r.messages[0].content == "x" and not r.add_special_tokens
    assert not r.add_generation_prompt
    for body, param in (({}, "prompt"), ({"prompt": "a", "messages": []}, "prompt"),
                        ({"prompt": 3}, "prompt"), ({"prompt": "a", "model": "x"}, "model"),
                        ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
                        ({"prompt": "a", "return_token_strs": True}, "return_token_strs")):
        with pytest.raises(ApiError) as info:
            parse_tokenize(body, "m")
        assert info.value.param == param and info.value.status == 400
    assert parse_detokenize({"tokens": [1, 263]}, "m", 264) == [1, 263]
    for tokens in ([264], [-1], "ab", [1.0]):
        with pytest.raises(ApiError, match="tokens"):
            parse_detokenize({"tokens": tokens}, "m", 264)


# ---- stop rules ---------------------------------------------------------------------------------

def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    ids = list(b", name, value): pass")
    for include, want in ((False, ", name, val"), (True, ", name, value")):
        s = TextStream(CODEC, ["value):", "ue"], include_stop=include)
        out = "".join(s.feed([t], final=False) for t in ids)
        assert (out, s.stopped, s.token_ids) == (want, True, ids[:ids.index(ord("e"), 8) + 1])


def test_a_stop_token_is_counted_but_not_written() -> None:
    ids = [*b"abc", 10]                # the engine stopped at stop token 10 ("\n")
    for include, want in ((False, "abc"), (True, "abc\n")):
        s = TextStream(CODEC, include_stop=include)
        out = s.feed(ids[:2], final=False) + s.feed(ids[2:], final=True, stop_token=True)
        assert (out, s.token_ids) == (want, ids)
    s = TextStream(CODEC, ["zz"], skip_special_tokens=False)   # EOS with the specials shown
    out = s.feed([*b"ab", 257], final=True, stop_token=True)
    assert (out, s.token_ids) == ("ab", [97, 98, 257])
    s = TextStream(CODEC, skip_special_tokens=False)          # an EOS in the middle is text
    assert s.feed([97, 257, 98], final=True) == "a<|eos|>b"
    s = TextStream(CODEC)
    assert s.feed([97, 257, 98], final=True) == "ab"


# ---- the ranks' checks ---------------------------------------------------------------------------

def _generate(**kw) -> Generate:
    fields = dict(seq=1, rid="r", dp_rank=0, prompt_ids=[256, 97], max_tokens=4,
                  temperature=0.0, top_p=1.0, seed=0, **kw)
    return Generate(**fields)


def test_the_ranks_check_stop_token_ids_and_ignore_eos() -> None:
    from workers.scheduler import MAX_STOP_IDS

    assert admission.MAX_STOP_IDS == MAX_STOP_IDS        # what the engine's buffer holds
    ok = [dict(stop_token_ids=list(range(7))), dict(stop_token_ids=list(range(8)),
                                                     ignore_eos=True),
          dict(stop_token_ids=[257, 257, 1]), dict(ignore_eos=True)]
    for kw in ok:
        assert admission.generate_refusal(_generate(**kw), 64, 264, (257,)) is None, kw
    for kw in (dict(stop_token_ids=list(range(8))), dict(stop_token_ids=[264]),
               dict(stop_token_ids=(1,)), dict(stop_token_ids=[True]), dict(ignore_eos=0)):
        refusal = admission.generate_refusal(_generate(**kw), 64, 264, (257,))
        assert refusal is not None and refusal.message.startswith(refusal.param + ": "), kw


# ---- the server's flags --------------------------------------------------------------------------

def _parse(*argv: str):
    from adaptive_dist.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_other_servers_spellings_of_the_flags(tmp_path: Path) -> None:
    a = _parse("/some/model", "--tensor-parallel-size", "2", "--max-num-seqs", "4",
               "--speculative-num-steps", "2")
    assert (a.model, a.tp, a.max_batch_size, a.steps) == ("/some/model", 2, 4, 2)
    assert not [k for k in vars(a) if k.startswith("alias_") or k == "model_path"]
    b = _parse("--data-parallel-size", "2", "--dp", "2", "--model", "/m", "/m")
    assert (b.dp, b.model) == (2, "/m")
    c = _parse()
    assert (c.dp, c.tp, c.max_batch_size, c.steps) == (1, None, 16, None)
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages | length }}")
    assert _parse("--chat-template", str(template)).chat_template == str(template.resolve())


@pytest.mark.parametrize("argv,message", [
    (["--dp", "1", "--data-parallel-size", "2"], "--dp 1 and --data-parallel-size 2 disagree"),
    (["--tp", "2", "--tensor-parallel-size", "4"], "--tp 2 and --tensor-parallel-size 4"),
    (["--max-batch-size", "16", "--max-num-seqs", "8"], "--max-batch-size 16 and --max-num-seqs"),
    (["--steps", "2", "--speculative-num-steps", "3"], "--steps 2 and --speculative-num-steps 3"),
    (["--adaptive", "--speculative-num-steps", "3"], "not allowed with --adaptive"),
    (["--model", "/a", "/b"], "--model /a and MODEL (positional) /b disagree"),
    (["--chat-template", "/nonexistent.jinja"], "--chat-template '/nonexistent.jinja'"),
])
def test_conflicting_spellings_are_refused_naming_both(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(*argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err, err


def test_a_rank_picks_its_thread_count_unless_omp_num_threads_is_set() -> None:
    script = ("import os, torch\n"
              "from workers.server.launch import set_thread_count\n"
              "print(set_thread_count(), torch.get_num_threads(), "
              "len(os.sched_getaffinity(0)))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for extra, local in (({}, 1), ({"LOCAL_WORLD_SIZE": "2"}, 2),
                         ({"OMP_NUM_THREADS": "1"}, None)):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env={**env, **extra}, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
        chosen, got, cores = out.stdout.split()
        if local is None:
            assert (chosen, got) == ("None", "1")
        else:
            assert int(chosen) == int(got) == max(1, (int(cores) - 1) // local)


# ---- the render pool: renders in worker processes -------------------------------------------------

def test_render_pool_bounds_a_render_and_outlives_its_workers():
    """A render past the timeout is killed and the next one runs on a fresh worker; a worker
    that died while idle is replaced without failing the request; the output bound stops a
    render as it goes; the template's constant expressions are not computed at compile time."""
    import os
    import signal
    import time

    from workers.server.chat import ChatTemplate, TemplateRefusal, TemplateSource
    from workers.server.render import RenderPool

    text = ("{%- if messages[0].content == 'spin' -%}{%- for i in range(100000) -%}"
            "{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}"
            "{%- else -%}{{ messages[0].content }}{%- endif -%}{{ '' if 1 else 3 ** 10**8 }}")
    start = time.monotonic()
    ChatTemplate(TemplateSource(text + "{{ 3 ** 10**8 }}", "test"))     # compiles, folds nothing
    assert time.monotonic() - start < 1.0
    pool = RenderPool(TemplateSource(text, "test"), {}, timeout_s=1.0, max_chars=100, size=1)
    try:
        pool.warm()
        assert pool.render([{"role": "user", "content": "hi"}], True) == "hi"
        worker = pool._idle.get()
        pool._idle.put(worker)
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
        assert pool.render([{"role": "user", "content": "again"}], True) == "again"
        start = time.monotonic()
        with pytest.raises(TemplateRefusal, match="did not finish within 1 s") as info:
            pool.render([{"role": "user", "content": "spin"}], True)
        assert info.value.kind == "timeout" and time.monotonic() - start < 3.0
        with pytest.raises(TemplateRefusal, match="passed 100 characters") as info:
            pool.render([{"role": "user", "content": "x" * 101}], True)
        assert info.value.kind == "too_long"
        assert pool.render([{"role": "user", "content": "after"}], True) == "after"
        assert len(pool._all) == 1                       # the spinning one is gone
    finally:
        pool.close()
