"""`scripts.gen.make_checkpoint` writes a tokenizer with the checkpoint (issue 34 §2): a
word-level tokenizer.json whose vocabulary is the model's, read by the engine's loader (and by
transformers, as the serving benchmarks read it), in which every id decodes to text."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from scripts.gen.make_checkpoint import SHAPES, build, write_tokenizer
from workers.loading import load_tokenizer_for, model_paths
from workers.model import LlamaConfig, save_pretrained
from workers.tokenizer import load_tokenizer


def _target_dir(cfg: LlamaConfig, path: Path) -> Path:
    """A target directory's config.json and the tokenizer (weights are not needed to read it)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    assert write_tokenizer(cfg, path) == cfg.vocab_size
    return path


def _check_every_id(tok, cfg: LlamaConfig) -> None:
    specials = {cfg.bos_token_id, *cfg.eos_token_ids} - {None}
    assert tok.vocab_size == cfg.vocab_size
    for i in range(cfg.vocab_size):
        assert tok.decode([i], skip_special_tokens=False).strip(), i
        if i not in specials:
            assert tok.decode([i]).strip(), i      # what a server sends for a generated id


@pytest.mark.parametrize("shape", ["tiny", "llama3-8b", "qwen3-8b"])
def test_every_id_of_the_shape_decodes_to_text_through_the_engines_loader(tmp_path, shape):
    cfg = LlamaConfig(**SHAPES[shape])
    tok = load_tokenizer(_target_dir(cfg, tmp_path / "target"))
    assert type(tok).__name__ == "HFTokenizer"          # not the byte fallback
    assert tok.bos_token_id == cfg.bos_token_id and tok.eos_token_ids == cfg.eos_token_ids
    _check_every_id(tok, cfg)
    # a decoded text encodes back to the same ids (the benchmarks' retokenized counts are exact)
    rng = random.Random(0)
    ids = [rng.randrange(cfg.vocab_size) for _ in range(300)]
    assert tok.encode(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False) == ids
    # BOS as the model's template adds it (Llama-3 style); none for a shape without one (Qwen)
    body = tok.encode("w7 w8 hello", add_special_tokens=False)
    assert body == [7, 8, tok.encode("<unk>", add_special_tokens=False)[0]]
    assert tok.encode("w7 w8 hello") == ([cfg.bos_token_id] if cfg.bos_token_id is not None
                                         else []) + body


def test_transformers_reads_the_same_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = dataclasses.replace(LlamaConfig(**SHAPES["tiny"]), eos_token_id=(2, 5))
    root = _target_dir(cfg, tmp_path / "target")
    ours = load_tokenizer(root)
    theirs = transformers.AutoTokenizer.from_pretrained(str(root))
    assert len(theirs) == cfg.vocab_size
    assert theirs.bos_token_id == cfg.bos_token_id and theirs.eos_token_id == 2
    text = "def w42 fib(n): w7 <|eos_1|> w9"
    assert theirs.encode(text) == ours.encode(text)
    ids = list(range(cfg.vocab_size))
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    assert theirs.decode(ids) == ours.decode(ids, skip_special_tokens=False)
    chat = theirs.apply_chat_template([{"role": "user", "content": "w3 w4"}], tokenize=False,
                                      add_generation_prompt=True)
    assert chat == "user: w3 w4\nassistant:"


def test_the_written_checkpoint_loads_with_its_tokenizer(tmp_path):
    """The script's directory as `generate` and `serve` read it: the tokenizer is checked against
    the model and the head loads beside it."""
    import torch

    target, head = build("tiny", "eagle3", None, 0)
    save_pretrained(target, tmp_path / "target")
    write_tokenizer(target.config, tmp_path / "target")
    save_pretrained(head, tmp_path / "eagle")
    paths = model_paths(tmp_path)
    tok = load_tokenizer_for(paths, target.config.vocab_size)
    _check_every_id(tok, target.config)
    from workers.loading import load_pair

    loaded, draft = load_pair(tmp_path, dtype=torch.float32)
    assert loaded.config.vocab_size == tok.vocab_size and draft is not None
