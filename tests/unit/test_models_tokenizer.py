"""The model's own tokenizer: `tokenizer.json` through the `tokenizers` library (byte-level BPE as
Llama-3 / Qwen, byte-fallback BPE as Llama-2), BOS / EOS as the tokenizer and config files say,
streaming decode that never emits half a character, the frontend's codec (no torch), and
`generate --model T --draft-model D` on a Hugging Face-style pair with its tokenizer."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from model_fixtures import (
    random_head,
    random_target,
    target_config,
    write_checkpoint,
    write_generation_config,
    write_tokenizer,
)
from workers.server.protocol import ModelInfo
from workers.server.text import Codec, TextStream, codec_for
from workers.tokenizer import ByteTokenizer, StreamDecoder, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXT = "def f(x):\n    return 'héllo wörld' + x  # ✓ 中文 🙂 — ok"
KINDS = ("bytelevel", "sentencepiece")


@pytest.fixture(scope="module", params=KINDS)
def tok_dir(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    write_tokenizer(path, request.param, vocab=300 if request.param == "bytelevel" else 400)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return path


def test_round_trip_and_bos(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    ids = tok.encode(TEXT)
    bos = tok._tok.token_to_id("<|begin_of_text|>" if tok_dir.name.startswith("byte") else "<s>")
    assert ids[0] == bos == tok.bos_token_id and bos not in ids[1:]  # template / add_bos_token
    assert tok.decode(ids) == TEXT
    pieces = [tok.decode([i]) for i in ids]
    assert any(p == "\ufffd" for p in pieces), "a multi-byte character should span tokens"
    assert tok.eos_token_ids == (tok._tok.token_to_id("<|end_of_text|>" if tok_dir.name.startswith(
        "byte") else "</s>"),)                                       # tokenizer_config.json
    assert tok.decode(ids + [10_000]) == TEXT                       # ids beyond the tokenizer


def _chunks(ids: list[int], seed: int) -> list[list[int]]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        out.append(ids[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_never_emits_half_a_character(tok_dir: Path, seed: int) -> None:
    tok = load_tokenizer(tok_dir)
    ids = tok.encode(TEXT)
    stream = StreamDecoder(tok)
    pieces = [stream.push(chunk) for chunk in _chunks(ids, seed)] + [stream.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) and sum(1 for p in pieces if p) > 10
    # an incomplete character at the end comes out (replaced) only when the stream finishes
    cut = next(i for i in range(2, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    stream = StreamDecoder(tok)
    held = stream.push(ids[:cut])
    assert "\ufffd" not in held and held + stream.finish() == tok.decode(ids[:cut])


def test_text_stream_on_a_tokenizer_cuts_at_stop_strings(tok_dir: Path) -> None:
    codec = Codec(load_tokenizer(tok_dir))
    ids = codec.encode(TEXT)
    stream = TextStream(codec, ["中文"])
    pieces = [stream.feed(c, final=False) for c in _chunks(ids, 3)]
    assert "".join(pieces) == TEXT[:TEXT.index("中文")] and stream.stopped
    whole = TextStream(codec)
    assert "".join(whole.feed(c, final=False) for c in _chunks(ids, 4)) + \
        whole.feed([], final=True) == TEXT


def test_eos_and_bos_from_the_config_files(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, "bytelevel")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    assert load_tokenizer(tmp_path).eos_token_ids == (1,)
    write_generation_config(tmp_path, [1, 2])
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == (1, 2) and tok.bos_token_id == 0
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert load_tokenizer(tmp_path).encode("ab")[0] != 0            # the config turns BOS off
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer.json' is not a usable tokenizer.json"):
        load_tokenizer(tmp_path)


def test_byte_tokenizer_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": [257]}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_ids == (257,)
    assert tok.encode("é") == [256, 0xC3, 0xA9] and tok.decode([0xC3, 0xA9, 257]) == "é"


def test_frontend_codec_uses_the_model_tokenizer_without_torch(tok_dir: Path) -> None:
    info = ModelInfo(64, None, [], 400, "static steps=3", tokenizer_dir=str(tok_dir))
    assert codec_for(info).encode(TEXT) == load_tokenizer(tok_dir).encode(TEXT)
    assert codec_for(ModelInfo(64, 256, [257], 264, "x")).encode("a") == [256, 97]
    script = ("import sys, json\n"
              "from workers.server.protocol import ModelInfo\n"
              "from workers.server.text import TextStream, codec_for\n"
              "import workers.server.api\n"
              f"codec = codec_for(ModelInfo(64, None, [], 400, 'x', tokenizer_dir={str(tok_dir)!r}))\n"
              f"ids = codec.encode({TEXT!r})\n"
              "s = TextStream(codec)\n"
              "text = ''.join(s.feed([i], final=False) for i in ids) + s.feed([], final=True)\n"
              f"assert text == {TEXT!r}, text\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []


# ---- generate --model T --draft-model D -------------------------------------------------------------

@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def hf_pair(request, tmp_path_factory) -> tuple[Path, Path]:
    """A Qwen2 target with a byte-level tokenizer.json (and generation_config.json), and a head."""
    root = tmp_path_factory.mktemp(f"hf_{request.param}")
    vocab = write_tokenizer(root / "target", "bytelevel", vocab=300)
    eot = json.loads((root / "target" / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    cfg = target_config("qwen2", vocab=320, max_pos=128)
    target = random_target(cfg, seed=7)
    head = random_head(request.param, target, list(range(0, 320, 2)) if request.param == "eagle3"
                       else None)
    write_checkpoint(target, root / "target", "bin")
    write_checkpoint(head, root / "draft", "safetensors-sharded")
    write_generation_config(root / "target", [eot])
    assert vocab <= 320
    return root / "target", root / "draft"


def _generate(capsys, *argv: str) -> tuple[int, dict, str]:
    from workers.cli import main

    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return code, (json.loads(lines[-1]) if code == 0 and lines else {}), err


def test_generate_with_model_and_draft_model(capsys, hf_pair) -> None:
    target, draft = hf_pair
    prompts = Path(target.parent / "prompts.jsonl")
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in ["def f(x):", "import os", "héllo ✓"]))
    common = ["--prompts", str(prompts), "--max-new-tokens", "12", "--json", "--model", str(target)]
    code, plain, err = _generate(capsys, *common, "--no-spec")
    assert code == 0, err
    tok = load_tokenizer(target)
    for mode in (["--steps", "3"], ["--adaptive"]):
        code, spec, err = _generate(capsys, *common, "--draft-model", str(draft), *mode)
        assert code == 0, err
        assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in plain["outputs"]]
        assert spec["mean_accept_length"] is not None
    for item in plain["outputs"]:
        assert item["text"] == tok.decode(item["token_ids"])
        assert item["finish_reason"] in ("length", "stop")


def test_generate_without_a_draft_head_is_refused(capsys, hf_pair) -> None:
    target, _ = hf_pair
    code, _, err = _generate(capsys, "--prompt", "x", "--steps", "2", "--model", str(target))
    assert code == 2 and "has no draft head" in err and "--draft-model" in err


def test_serve_with_model_and_draft_model(capsys, hf_pair) -> None:
    """`serve --model T --draft-model D`: the target's tokenizer encodes the prompt and decodes
    the output; the tokens are `generate --no-spec`'s, and the streamed pieces (never half a
    character) join into the same text."""
    import httpx

    from serve_helpers import sse_chunks, start_server

    target, draft = hf_pair
    prompt = "héllo ✓ def f(x):"
    code, plain, err = _generate(capsys, "--prompt", prompt, "--max-new-tokens", "12", "--json",
                                 "--model", str(target), "--no-spec")
    assert code == 0, err
    want = plain["outputs"][0]
    server = start_server(["--model", str(target), "--draft-model", str(draft), "--steps", "3",
                           "--max-batch-size", "2", "--max-model-len", "128"])
    try:
        body = {"model": target.name, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "return_token_ids": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["token_ids"], choice["text"]) == (want["token_ids"], want["text"])
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as resp:
            parts = [c for chunk in sse_chunks(resp) for c in chunk.get("choices", [])]
        assert [t for p in parts for t in p["token_ids"]] == want["token_ids"]
        assert "".join(p["text"] for p in parts) == want["text"]
    finally:
        server.stop()
