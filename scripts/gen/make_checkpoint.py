"""Write a random-weight checkpoint pair in the layout of a real one (nothing is downloaded): a
target of a real model's shape, a tokenizer for it, and an EAGLE or EAGLE-3 head, for timing on
GPUs.

    python -m scripts.gen.make_checkpoint --shape llama3-8b --head eagle3 --out DIR [--layers N] \
        [--head-layout sglang|speculators]
    torchrun --nproc-per-node 2 -m scripts.bench.dp --dp 2 --device cuda \
        --model DIR/target --draft-model DIR/eagle ...
    torchrun --nproc-per-node 2 -m adaptive_dist generate --tp 2 --device cuda \
        --model DIR/target --draft-model DIR/eagle --steps 3 --prompt "..."

Shapes: ``llama3-8b`` (Llama-3.1-8B: vocab 128256, d 4096, 32 layers, GQA 32/8, Llama-3 RoPE
scaling; its EAGLE-3 head drafts over 32000 ids), ``qwen3-8b`` (vocab 151936, d 4096, 36 layers,
head_dim 128, q/k norms), ``tiny`` (for a smoke test). Weights are bfloat16, N(0, 0.02) (norms 1),
in 5 GB safetensors shards; the draft vocabulary is a random set of target ids. Random weights
make acceptance meaningless: time fixed depths (``--steps K``), not acceptance. An EAGLE-3 head is
written in SGLang's layout (``LlamaForCausalLMEagle3``) or, with ``--head-layout speculators``, the
speculators library's (``Eagle3Speculator``, as vLLM reads it).

The target gets a word-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, read by
the engine and by transformers alike) whose vocabulary is the model's: id ``i`` is the word
``w{i}`` (the first free id is ``<unk>``, the shape's BOS/EOS ids are special tokens), words are
split at whitespace and decoded joined by spaces. So every id decodes to text (a random model's
output is never empty, as the serving benchmarks need), a decoded text encodes back to the same
ids (their retokenized counts are exact), and any prompt tokenizes (unknown words to ``<unk>``).
Needs about twice the target's bfloat16 size in host memory (16 GB for llama3-8b).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from workers.model import (
    Eagle3Config,
    Eagle3Head,
    EagleConfig,
    EagleHead,
    LlamaConfig,
    LlamaForCausalLM,
    save_pretrained,
)
from workers.model.config import MoeSpec, RopeScaling

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), bos_token_id=128000,
                      eos_token_id=(128001, 128008, 128009)),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     explicit_head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
                     eos_token_id=(151645, 151643), architecture="Qwen3ForCausalLM"),
    # Qwen3-30B-A3B: 48 layers, d 2048, GQA 32/4 (head_dim 128), 128 experts of width 768, top 8
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          explicit_head_dim=128, rope_theta=1000000.0,
                          max_position_embeddings=40960, eos_token_id=(151645, 151643),
                          architecture="Qwen3MoeForCausalLM",
                          moe=MoeSpec(num_experts=128, top_k=8, expert_size=768,
                                      norm_topk_prob=True)),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2),
    "tiny-moe": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                     architecture="Qwen3MoeForCausalLM",
                     moe=MoeSpec(num_experts=8, top_k=2, expert_size=32, norm_topk_prob=True)),
}
DRAFT_VOCAB = {"llama3-8b": 32000, "qwen3-8b": 32000, "qwen3-30b-a3b": 32000, "tiny": 256,
               "tiny-moe": 256}


@torch.no_grad()
def fill(model: torch.nn.Module, seed: int, device: str | torch.device = "cpu") -> None:
    """bfloat16 on `device`: matrices N(0, 0.02), vectors (norms) 1."""
    model.to_empty(device=device)
    model.to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32,
                                device=device).mul_(0.02))


def build(shape: str, head: str, layers: int | None, seed: int, par: Any = None,
          device: str | torch.device = "cpu"):
    """The target of `shape` and a `head` ("eagle3" / "eagle") with random bf16 weights made on
    `device`, split over `par` (a `ModelParallel`; default: one process)."""
    kw = dict(SHAPES[shape])
    if layers is not None:
        kw["num_hidden_layers"] = layers
    cfg = LlamaConfig(**kw)
    with torch.device("meta"):
        target = LlamaForCausalLM(cfg, par)
        if head == "eagle3":
            draft = Eagle3Head(Eagle3Config.for_target(cfg, DRAFT_VOCAB[shape],
                                                        rope_theta=cfg.rope_theta,
                                                        rope_scaling=cfg.rope_scaling), target)
        else:
            draft = EagleHead(EagleConfig.for_target(cfg, layout="eagle", fc_bias=True,
                                                     first_input_norm=False, final_norm=False),
                              target)
    fill(target, seed, device)
    if cfg.tie_word_embeddings:
        target.lm_head.weight = target.model.embed_tokens.weight
    fill(draft, seed + 1, device)
    if isinstance(draft, Eagle3Head):
        gen = torch.Generator().manual_seed(seed + 2)
        ids = torch.randperm(cfg.vocab_size, generator=gen)[:DRAFT_VOCAB[shape]].sort().values
        draft.set_vocab_map((ids - torch.arange(ids.numel())).to(device))
    return target, draft


def special_tokens(cfg: LlamaConfig) -> dict[int, str]:
    """The shape's BOS and EOS ids and their token strings."""
    out = {}
    if cfg.bos_token_id is not None:
        out[cfg.bos_token_id] = "<|begin_of_text|>"
    for k, eos in enumerate(cfg.eos_token_ids):
        out.setdefault(eos, "<|end_of_text|>" if k == 0 else f"<|eos_{k}|>")
    return out


CHAT_TEMPLATE = ("{%- for message in messages -%}{{- message['role'] + ': ' + message['content'] "
                 "+ '\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- 'assistant:' -}}"
                 "{%- endif -%}")


def write_tokenizer(cfg: LlamaConfig, path: Path) -> int:
    """Write the word-level tokenizer of `cfg`'s vocabulary into the target directory `path`
    (see the module docstring); return its size (= `cfg.vocab_size`)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    specials = special_tokens(cfg)
    unk = next(i for i in range(cfg.vocab_size) if i not in specials)
    words = {i: specials.get(i, "<unk>" if i == unk else f"w{i}") for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel({w: i for i, w in words.items()}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(w, special=True, normalized=False)
                            for _, w in sorted(specials.items())])
    # "<unk>" is an ordinary word to both readers (not in unk_token: transformers would skip it)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "clean_up_tokenization_spaces": False,
                              "model_max_length": cfg.max_position_embeddings,
                              "chat_template": CHAT_TEMPLATE}
    if cfg.bos_token_id is not None:     # Llama-3's way: the post-processor adds BOS
        bos = words[cfg.bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, cfg.bos_token_id)])
        config["bos_token"] = bos
    if cfg.eos_token_ids:
        config["eos_token"] = words[cfg.eos_token_ids[0]]
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != cfg.vocab_size:
        raise RuntimeError(f"the tokenizer has {size} tokens, the model {cfg.vocab_size}")
    return size


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--head", choices=("eagle3", "eagle"), default="eagle3")
    p.add_argument("--head-layout", choices=("sglang", "speculators"), default="sglang",
                   help="an EAGLE-3 head's layout: SGLang's LlamaForCausalLMEagle3 (default) or "
                        "the speculators library's Eagle3Speculator")
    p.add_argument("--layers", type=int, default=None, help="fewer target layers than the shape's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="writes OUT/target and OUT/eagle")
    args = p.parse_args()
    target, draft = build(args.shape, args.head, args.layers, args.seed)
    if args.head_layout != "sglang" and args.head != "eagle3":
        p.error(f"--head-layout {args.head_layout} applies to --head eagle3 only")
    out = Path(args.out)
    save_pretrained(target, out / "target", max_shard_bytes=5 * 2**30)
    words = write_tokenizer(target.config, out / "target")
    layout = {"layout": args.head_layout} if args.head == "eagle3" else {}
    save_pretrained(draft, out / "eagle", max_shard_bytes=5 * 2**30, **layout)
    params = sum(p.numel() for p in target.parameters()) / 1e9
    print(f"wrote {out / 'target'} ({params:.2f} B parameters, a {words}-word tokenizer) and "
          f"{out / 'eagle'} ({args.head}{', ' + args.head_layout + ' layout' if layout else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
