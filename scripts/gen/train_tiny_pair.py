"""Train the bundled byte-level model pair: a small Llama target and its EAGLE draft head.

Data: the Python standard library sources of the interpreter running this script
(``sysconfig.get_paths()["stdlib"]``, site-packages excluded); every 40th file is held out. Each
file becomes ``BOS + bytes + EOS``; 30% of training files are followed by 1-4 lines such as
``    TOKEN = "<64-1500 random base64 or hex chars>"`` so the model learns to stay inside
high-entropy content (see MODEL_CARD.md, "Data").

Then: the target (next-byte cross-entropy), the EAGLE head by self-distillation on the frozen
target (smooth-L1 regression on the target's post-norm features + cross-entropy to the target's
next-token distribution, two unrolled passes), both written in Hugging Face layout in bfloat16
(``OUT/target``, ``OUT/eagle``), reloaded from disk and evaluated: bits per byte on held-out code,
mean accepted draft tokens per round (greedy, bonus excluded) at steps 1/3/7 on code,
high-entropy and repetitive-prose prompts (``OUT/eval.json``). Losses go to ``OUT/train_log.json``.

    python -m scripts.gen.train_tiny_pair --device cuda --out runs/tiny_pair
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from workers.model import (
    DenseCausalAttention,
    EagleConfig,
    EagleHead,
    LlamaConfig,
    LlamaForCausalLM,
    load_eagle,
    load_llama,
    save_pretrained,
)
from workers import tokenizer as tok

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
HEX = "0123456789abcdef"
SECRET_NAMES = ["TOKEN", "TOKEN", "TOKEN", "API_KEY", "SECRET", "DIGEST", "PAYLOAD"]
PROSE = [
    "The old lighthouse keeper climbed the stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens, and watched the ships pass slowly along the rocky coast.",
    "In the spring the village market opened again. Farmers brought baskets of early vegetables, "
    "and the children ran between the stalls while their parents talked about the weather.",
    "She had always wanted to travel, so when the letter arrived she packed a small bag, locked "
    "the door of her apartment, and walked to the station without looking back.",
    "The committee met on Tuesday to discuss the budget for the coming year. After a long debate "
    "the members agreed to spend more on the library and less on the new parking lot.",
    "Rivers carry water from the mountains to the sea. Along the way they shape valleys, feed "
    "forests and fields, and give towns a reason to grow on their banks.",
    "When the storm finally passed, the neighbours came out of their houses to look at the fallen "
    "branches. Someone brought coffee, and soon everyone was helping to clear the road.",
]


@dataclass(frozen=True)
class Corpus:
    """Training stream (with secret lines), held-out stream (plain code) and held-out files."""

    train: np.ndarray
    heldout: np.ndarray
    heldout_texts: list[bytes]
    num_train_files: int


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=3000, help="target training steps")
    p.add_argument("--eagle-steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eagle-lr", type=float, default=2e-3)
    p.add_argument("--secret-fraction", type=float, default=0.3,
                   help="probability of 1-4 secrets after each --secret-every-lines lines and at file end")
    p.add_argument("--secret-every-lines", type=int, default=200)
    p.add_argument("--data-file-fraction", type=float, default=0.05,
                   help="random base64/hex data files added, as a fraction of the code files")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--eval-prompts", type=int, default=6, help="prompts per regime")
    p.add_argument("--eval-new-tokens", type=int, default=96)
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows for bits per byte")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-only", action="store_true",
                   help="skip training; evaluate the pair already in --out and rewrite its eval.json")
    return p.parse_args()


# ---------------------------------------------------------------- data


def stdlib_files() -> list[Path]:
    """Every ``.py`` file of this interpreter's standard library, sorted, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(root.rglob("*.py"))
             if "site-packages" not in f.parts and "dist-packages" not in f.parts and f.is_file()]
    if len(files) < 100:
        raise SystemExit(f"found only {len(files)} .py files under {root}; need the stdlib sources")
    return files


def random_blob(rng: random.Random, lo: int, hi: int) -> str:
    """``lo..hi`` random base64 or (half the time) hex characters."""
    alphabet = B64 if rng.random() < 0.5 else HEX
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def secret_lines(rng: random.Random) -> str:
    """One secret: ``    NAME = "<blob>"`` on one line (70%), or wrapped in 64-char string lines."""
    name, blob = rng.choice(SECRET_NAMES), random_blob(rng, 64, 1500)
    if rng.random() < 0.7:
        return f'    {name} = "{blob}"\n'
    body = "".join(f'        "{blob[i:i + 64]}"\n' for i in range(0, len(blob), 64))
    return f"    {name} = (\n{body}    )\n"


def with_secrets(text: bytes, rng: random.Random, fraction: float, every_lines: int) -> bytes:
    """``text`` with 1-4 secrets, each with probability ``fraction``, after every ``every_lines``
    lines and at the end of the file (so ``fraction`` of the files end with secrets)."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith(b"\n"):
        lines[-1] += b"\n"
    out = []
    for start in range(0, len(lines), every_lines):
        out += lines[start:start + every_lines]
        if rng.random() < fraction:
            out.append(b"\n" + "".join(secret_lines(rng) for _ in range(rng.randint(1, 4))).encode())
    return b"".join(out)


def data_file(rng: random.Random) -> bytes:
    """A whole file of random base64/hex: one long line or lines of 64 or 76 characters."""
    blob = random_blob(rng, 256, 4096)
    if rng.random() < 0.3:
        return blob.encode() + b"\n"
    width = rng.choice((64, 76))
    return "".join(blob[i:i + width] + "\n" for i in range(0, len(blob), width)).encode()


def to_stream(docs: list[bytes]) -> np.ndarray:
    """``BOS doc EOS`` for every doc, concatenated as int16 ids."""
    parts = []
    for doc in docs:
        parts += [np.array([tok.BOS_ID], np.int16), np.frombuffer(doc, np.uint8).astype(np.int16),
                  np.array([tok.EOS_ID], np.int16)]
    return np.concatenate(parts)


def build_corpus(args: argparse.Namespace) -> Corpus:
    """Read the stdlib, hold out every 40th file, add secrets and random data files to the rest."""
    rng = random.Random(args.seed)
    texts = [f.read_bytes() for f in stdlib_files()]
    texts = [t for t in texts if len(t) >= 256]
    heldout = [t for i, t in enumerate(texts) if i % 40 == 7]
    train = [with_secrets(t, rng, args.secret_fraction, args.secret_every_lines)
             for i, t in enumerate(texts) if i % 40 != 7]
    train += [data_file(rng) for _ in range(int(args.data_file_fraction * len(train)))]
    rng.shuffle(train)
    return Corpus(to_stream(train), to_stream(heldout), heldout, len(train))


def sample_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``seq + 1`` ids from the on-device stream: [batch, seq + 1]."""
    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=gen, device="cpu")
    idx = starts.to(stream.device)[:, None] + torch.arange(seq + 1, device=stream.device)[None, :]
    return stream[idx].long()


# ---------------------------------------------------------------- models


def target_config(args: argparse.Namespace) -> LlamaConfig:
    """The target's configuration from the command line."""
    return LlamaConfig(vocab_size=tok.VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=2048,
                       rope_theta=10000.0, bos_token_id=tok.BOS_ID, eos_token_id=tok.EOS_ID)


def init_weights(model: torch.nn.Module, num_layers: int) -> None:
    """Small embeddings; residual output projections scaled down by sqrt(2 * layers)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.02)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.div_(math.sqrt(2 * num_layers))


def make_optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def autocast(device: str):
    """bf16 autocast on CUDA, nothing on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


def positions_for(batch: int, seq: int, device: str, start: int = 0) -> torch.Tensor:
    """Flattened positions ``start .. start+seq-1`` for each of ``batch`` sequences."""
    return torch.arange(start, start + seq, device=device).repeat(batch)


def lm_loss(model: LlamaForCausalLM, xy: torch.Tensor, device: str) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``model`` on windows ``xy`` [B, L+1]."""
    b, l1 = xy.shape
    x, y = xy[:, :-1].reshape(-1), xy[:, 1:].reshape(-1)
    with autocast(device):
        hidden = model(x, positions_for(b, l1 - 1, device), DenseCausalAttention.uniform(b, l1 - 1))
        logits = model.compute_logits(hidden)
    return F.cross_entropy(logits.float(), y)


def train_target(model: LlamaForCausalLM, stream: torch.Tensor, args: argparse.Namespace,
                 log: list[dict]) -> None:
    """Next-byte training of the target."""
    opt = make_optimizer(list(model.parameters()), args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    bar = tqdm(range(args.steps), desc="target", mininterval=2.0)
    total, count = torch.zeros((), device=args.device), 0
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr)
        loss = lm_loss(model, sample_batch(stream, args.batch, args.seq, gen), args.device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        total, count = total + loss.detach(), count + 1
        if step % args.log_every == 0 or step == args.steps - 1:
            mean = total.item() / count  # mean since the previous record
            total, count = torch.zeros((), device=args.device), 0
            log.append({"phase": "target", "step": step, "loss": mean, "bpb": mean / math.log(2),
                        "lr": opt.param_groups[0]["lr"]})
            bar.set_postfix(bpb=f"{mean / math.log(2):.3f}")


def eagle_losses(head: EagleHead, target: LlamaForCausalLM, xy: torch.Tensor, device: str,
                 unroll: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Regression loss, soft cross-entropy and top-1 agreement of ``head`` on windows ``xy``.

    The head sees token ``x_p`` with feature ``f_{p-1}`` at position ``p`` and is trained to give
    ``f_p`` (and ``f_p``'s next-token distribution). Pass ``k > 1`` replaces the input features
    from position 2 on with the previous pass's outputs, as in multi-step drafting.
    """
    b, l1 = xy.shape
    seq = l1 - 1
    x = xy[:, :-1].reshape(-1)
    with torch.no_grad(), autocast(device):
        feats = target(x, positions_for(b, seq, device), DenseCausalAttention.uniform(b, seq))
        feats = feats.float().view(b, seq, -1)
        probs = F.softmax(target.compute_logits(feats).float(), dim=-1)
    ids = xy[:, 1:seq].reshape(-1)
    pos = positions_for(b, seq - 1, device, start=1)
    attn = DenseCausalAttention.uniform(b, seq - 1)
    want, want_p = feats[:, 1:], probs[:, 1:]
    inp = feats[:, :-1]
    reg = ce = torch.zeros((), device=device)
    for k in range(unroll):
        noisy = inp + 0.05 * torch.randn_like(inp) if head.training else inp
        with autocast(device):
            out = head(ids, noisy.reshape(-1, noisy.shape[-1]), pos, attn).float().view(b, seq - 1, -1)
            logp = F.log_softmax(head.compute_logits(out).float(), dim=-1)
        reg = reg + F.smooth_l1_loss(out, want)
        ce = ce + -(want_p * logp).sum(-1).mean()
        if k == 0:
            agree = (logp.argmax(-1) == want_p.argmax(-1)).float().mean()
        inp = torch.cat((feats[:, :1], out[:, :-1].detach()), dim=1)
    return reg / unroll, ce / unroll, agree


def train_eagle(head: EagleHead, target: LlamaForCausalLM, stream: torch.Tensor,
                args: argparse.Namespace, log: list[dict]) -> None:
    """Self-distillation of the head on the frozen target."""
    target.eval().requires_grad_(False)
    params = list(head.parameters())
    opt = make_optimizer(params, args.eagle_lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    head.train()
    bar = tqdm(range(args.eagle_steps), desc="eagle", mininterval=2.0)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.eagle_steps, args.eagle_lr)
        reg, ce, agree = eagle_losses(head, target, sample_batch(stream, args.batch, args.seq, gen), args.device)
        loss = reg + 0.5 * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.eagle_steps - 1:
            log.append({"phase": "eagle", "step": step, "loss": loss.item(), "reg": reg.item(),
                        "ce": ce.item(), "top1_agree": agree.item(), "lr": opt.param_groups[0]["lr"]})
            bar.set_postfix(reg=f"{reg.item():.3f}", ce=f"{ce.item():.3f}", agree=f"{agree.item():.3f}")


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_bpb(model: LlamaForCausalLM, stream: torch.Tensor, windows: int, seq: int, device: str) -> float:
    """Bits per byte on up to ``windows`` consecutive non-overlapping held-out windows."""
    n = min(windows, (stream.numel() - 1) // seq)
    total = 0.0
    for chunk in torch.arange(n).split(32):
        idx = chunk[:, None].to(stream.device) * seq + torch.arange(seq + 1, device=stream.device)[None, :]
        total += lm_loss(model, stream[idx].long(), device).item() * len(chunk)
    return total / n / math.log(2)


def _features(target: LlamaForCausalLM, ids: list[int], device: str) -> torch.Tensor:
    t = torch.tensor(ids, device=device)
    return target(t, torch.arange(len(ids), device=device), DenseCausalAttention([len(ids)]))


def _draft(head: EagleHead, seq: list[int], feats: torch.Tensor, steps: int, device: str) -> list[int]:
    """``steps`` greedy draft tokens after ``seq`` (``feats`` are the target's for ``seq[:-1]``)."""
    tokens, inputs, drafts = list(seq[1:]), feats, []
    for _ in range(steps):
        n = len(tokens)
        out = head(torch.tensor(tokens, device=device), inputs, torch.arange(1, n + 1, device=device),
                   DenseCausalAttention([n]))
        drafts.append(int(head.compute_logits(out[-1:]).argmax(-1)))
        tokens.append(drafts[-1])
        inputs = torch.cat((inputs, out[-1:]))
    return drafts


def spec_accepts(target: LlamaForCausalLM, head: EagleHead, prompt: list[int], steps: int,
                 new_tokens: int, device: str) -> list[int]:
    """Greedy draft/verify rounds without a KV cache; accepted draft tokens per round (no bonus)."""
    feats = _features(target, prompt, device)
    seq = prompt + [int(target.compute_logits(feats[-1:]).argmax(-1))]
    feats, accepts = feats, []
    while len(seq) - len(prompt) < new_tokens:
        drafts = _draft(head, seq, feats, steps, device)
        full = _features(target, seq + drafts, device)
        best = target.compute_logits(full[len(seq) - 1:]).argmax(-1).tolist()
        a = 0
        while a < steps and drafts[a] == best[a]:
            a += 1
        accepts.append(a)
        seq = seq + drafts[:a] + [best[a]]
        feats = full[: len(seq) - 1]
    return accepts


def eval_prompts(corpus: Corpus, count: int, seed: int) -> dict[str, list[str]]:
    """Prompts per regime: held-out code; high-entropy (random base64 / an opened TOKEN blob);
    repetitive (runs of one character and ruler lines, as code's separators and padding are);
    a sentence said three times; plain prose paragraphs."""
    rng = random.Random(seed + 2)
    code = []
    for text in rng.sample(corpus.heldout_texts, count):
        lines = text.decode("utf-8", errors="replace").splitlines(keepends=True)
        start = rng.randrange(max(1, len(lines) // 2))
        code.append("".join(lines[start:])[:192])
    entropy = ["".join(rng.choice(B64) for _ in range(192)) if i % 2 == 0 else
               '    TOKEN = "' + "".join(rng.choice(B64) for _ in range(48)) for i in range(count)]
    sentences = [PROSE[i % len(PROSE)].split(". ")[0] + ". " for i in range(count)]
    runs = ["#" * 120, "*" * 100, " " * 100, ("# " + "-" * 70 + "\n") * 3, "0" * 150,
            ("#" + "=" * 70 + "\n") * 2]
    return {"code": code, "high_entropy": entropy,
            "repetitive": [runs[i % len(runs)] for i in range(count)],
            "repeated_sentence": [s * 3 for s in sentences],
            "prose": [PROSE[i % len(PROSE)] for i in range(count)]}


def eval_acceptance(target: LlamaForCausalLM, head: EagleHead, prompts: dict[str, list[str]],
                    new_tokens: int, device: str) -> tuple[dict, dict]:
    """Mean accepted draft tokens per round at steps 1, 3, 7 for each regime (all rounds of all
    its prompts), and the same per prompt."""
    means: dict[str, dict[str, float]] = {}
    per_prompt: dict[str, dict[str, list[float]]] = {}
    jobs = [(r, s) for r in prompts for s in (1, 3, 7)]
    for regime, steps in tqdm(jobs, desc="accept eval"):
        runs = [spec_accepts(target, head, tok.encode(text, add_bos=True), steps, new_tokens, device)
                for text in prompts[regime]]
        rounds = [a for run in runs for a in run]
        means.setdefault(regime, {})[f"steps_{steps}"] = sum(rounds) / len(rounds)
        per_prompt.setdefault(regime, {})[f"steps_{steps}"] = [round(sum(r) / len(r), 3) for r in runs]
    return means, per_prompt


@torch.no_grad()
def greedy_sample(target: LlamaForCausalLM, prompt: str, new_tokens: int, device: str) -> str:
    """Plain greedy continuation (no cache), for the record in eval.json."""
    ids = tok.encode(prompt, add_bos=True)
    for _ in range(new_tokens):
        ids.append(int(target.compute_logits(_features(target, ids, device)[-1:]).argmax(-1)))
    return tok.decode(ids[len(tok.encode(prompt, add_bos=True)):])


# ---------------------------------------------------------------- main


def count_params(module: torch.nn.Module) -> int:
    """Number of parameters registered in ``module`` (shared target modules excluded for the head)."""
    return sum(p.numel() for p in module.parameters())


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    t0 = time.time()
    corpus = build_corpus(args)
    print(f"data: {corpus.num_train_files} train files, {corpus.train.size} train ids, "
          f"{corpus.heldout.size} held-out ids ({time.time() - t0:.1f}s)")
    dev = args.device
    held = torch.from_numpy(corpus.heldout).to(dev)
    if args.eval_only:
        evaluate_saved(args, corpus, held)
        return
    stream = torch.from_numpy(corpus.train).to(dev)
    log: list[dict] = []
    cfg = target_config(args)
    target = LlamaForCausalLM(cfg).to(dev)
    init_weights(target, cfg.num_hidden_layers)
    t1 = time.time()
    train_target(target, stream, args, log)
    t2 = time.time()
    head = EagleHead(EagleConfig.for_target(cfg), target).to(dev)
    init_weights(head, 1)
    train_eagle(head, target, stream, args, log)
    t3 = time.time()
    save_pretrained(target, args.out / "target")
    save_pretrained(head, args.out / "eagle")
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    final_bpb = next(r["bpb"] for r in reversed(log) if r["phase"] == "target")
    evaluate(args, corpus, held, {"data_s": t1 - t0, "target_s": t2 - t1, "eagle_s": t3 - t2},
             {"target": count_params(target), "eagle": count_params(head), "final_target_bpb": final_bpb})


def evaluate_saved(args: argparse.Namespace, corpus: Corpus, held: torch.Tensor) -> None:
    """``--eval-only``: evaluate the pair already in ``--out`` (its train_log.json gives the final loss)."""
    log = json.loads((args.out / "train_log.json").read_text())
    target = load_llama(args.out / "target")
    head = load_eagle(args.out / "eagle", target)
    final_bpb = next(r["bpb"] for r in reversed(log) if r["phase"] == "target")
    evaluate(args, corpus, held, {}, {"target": count_params(target), "eagle": count_params(head),
                                      "final_target_bpb": final_bpb})


def evaluate(args: argparse.Namespace, corpus: Corpus, held: torch.Tensor, times: dict[str, float],
             facts: dict[str, float]) -> None:
    """Reload the saved bf16 pair in float32 and write ``eval.json``."""
    t = time.time()
    target = load_llama(args.out / "target", device=args.device)
    head = load_eagle(args.out / "eagle", target)
    prompts = eval_prompts(corpus, args.eval_prompts, args.seed)
    with torch.no_grad():
        bpb = heldout_bpb(target, held, args.eval_windows, args.seq, args.device)
        accept, accept_per_prompt = eval_acceptance(target, head, prompts, args.eval_new_tokens, args.device)
    samples = {r: [greedy_sample(target, p, 64, args.device) for p in ps] for r, ps in prompts.items()}
    times["eval_s"] = time.time() - t
    env = {"torch": torch.__version__, "python": sys.version.split()[0],
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    result = {"env": env, "heldout_bpb": bpb, "accept": accept, "accept_per_prompt": accept_per_prompt,
              "params": {"target": facts["target"], "eagle": facts["eagle"]},
              "final_target_bpb": facts["final_target_bpb"],
              "train_files": corpus.num_train_files, "train_ids": int(corpus.train.size), "args": {k: str(v) for k, v in vars(args).items()}, "times_s": times,
              "prompts": prompts, "greedy_samples": samples}
    (args.out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("heldout_bpb", "final_target_bpb", "accept", "params", "times_s")},
                     indent=1))


if __name__ == "__main__":
    main()
