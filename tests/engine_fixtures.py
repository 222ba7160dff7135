"""Tiny random-init model pairs and engines for the engine tests (CPU, seconds).

`tiny_pair` builds a target whose attention and MLP branches are scaled by `eps` (so it is close
to a bigram model of its embedding) and an EAGLE head that is exactly that bigram model
(`fc` passes the token embedding, its decoder layer adds nothing). The head is right where the
target's context matters little and wrong elsewhere, which gives every accept length from 0 to
`steps` without training: the accept and reject paths both run.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from adaptive_dist.config import AdaptiveConfig
from adaptive_dist.coordinator import RoundPlan, RoundReport, RoundStats
from workers.config import EngineConfig
from workers.engine import Engine, build_engine
from workers.model import EagleConfig, EagleHead, LlamaConfig, LlamaForCausalLM, save_pretrained
from workers.settings import SpecChoice

# NOTE: these models are tiny; with more than one thread, OpenMP spin-waits dominate (and on a
# shared 2-core machine make every forward ~50x slower). Tests that import this module run on one.
torch.set_num_threads(1)


# A tiny byte-level config (the bundled tokenizer's vocabulary), as a Hugging Face-style dict.
TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, bos_token_id=256, eos_token_id=257)


def tiny_config(vocab: int = 64, hidden: int = 64, layers: int = 2, max_pos: int = 512,
                eos: int | None = None) -> LlamaConfig:
    """A small Llama config with grouped-query attention (4 query heads, 2 KV heads)."""
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=max_pos, eos_token_id=eos)


@torch.no_grad()
def tiny_pair(seed: int = 0, eps: float = 0.1, dtype: torch.dtype = torch.float64,
              cfg: LlamaConfig | None = None) -> tuple[LlamaForCausalLM, EagleHead]:
    """A random target and a bigram-copy EAGLE head (see the module docstring)."""
    cfg = cfg or tiny_config()
    torch.manual_seed(seed)
    target = LlamaForCausalLM(cfg)
    head = EagleHead(EagleConfig.for_target(cfg), target)
    for layer in target.model.layers:
        layer.self_attn.o_proj.weight.mul_(eps)
        layer.mlp.down_proj.weight.mul_(eps)
    d = cfg.hidden_size
    head.fc.weight.zero_()
    head.fc.bias.zero_()
    head.fc.weight[:, :d] = torch.eye(d)
    for layer in head.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    head.norm.weight.copy_(target.model.norm.weight)
    return target.to(dtype).eval(), head.to(dtype).eval()


def save_pair(target: LlamaForCausalLM, head: EagleHead, root: Path) -> Path:
    """Write the pair as `root/target` and `root/eagle` (float32, Hugging Face layout)."""
    save_pretrained(target, root / "target", dtype=torch.float32)
    save_pretrained(head, root / "eagle", dtype=torch.float32)
    return root


LOSSLESS_STOP = 45  # a token the tiny target emits often: stops inside accepted runs are exercised


def lossless_params(n: int) -> list:
    """Varied lengths; every third request stops at `LOSSLESS_STOP`."""
    from workers.sampling import SamplingParams

    return [SamplingParams(max_new_tokens=8 + 7 * (i % 5),
                           stop_token_ids=(LOSSLESS_STOP,) if i % 3 == 0 else ()) for i in range(n)]


def check_pages_back(engine: Engine) -> None:
    """Every KV page is back and every batch slot free (nothing leaked)."""
    engine.scheduler.allocator.check_empty()
    assert len(engine.scheduler._free_slots) == engine.config.max_batch_size


def random_prompts(n: int, vocab: int, seed: int, lo: int = 1, hi: int = 24) -> list[list[int]]:
    """`n` prompts of random token ids with lengths in [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_config(mode: str = "static", steps: int = 3, config: AdaptiveConfig | None = None,
                  max_batch: int = 4, num_pages: int | None = None, page_size: int = 4,
                  device: str = "cpu", max_context: int = 512, **kw) -> EngineConfig:
    """An `EngineConfig` in `mode` "nospec" (`--no-spec`), "static" (`--steps steps`) or "ema"
    (`config`, else `--adaptive`): the speculative settings those flags build
    (`SpecChoice.build`)."""
    if mode == "ema" and config is not None:
        spec = config
    else:
        spec = SpecChoice(no_spec=mode == "nospec", adaptive=mode == "ema",
                          steps=steps if mode not in ("nospec", "ema") else None).build()
    return EngineConfig(spec=spec, max_batch_size=max_batch, page_size=page_size,
                        num_pages=num_pages, max_context_len=max_context, device=device, **kw)


def engine_for(target: LlamaForCausalLM, head: EagleHead | None, mode: str = "static",
               steps: int = 3, config: AdaptiveConfig | None = None, max_batch: int = 4,
               num_pages: int | None = None, page_size: int = 4, device: str = "cpu",
               **kw) -> Engine:
    """An engine in `mode` "nospec", "static" (at `steps`) or "ema" (adaptive, `config`)."""
    cfg = engine_config(mode, steps, config, max_batch, num_pages, page_size, device,
                        max_context=target.config.max_position_embeddings, **kw)
    return build_engine(cfg, target, head)


class ScriptPlanner:
    """Plans the depth of round i as `script[i]` (the last entry once the script runs out), every
    round padded to `bucket` rows (None: the batch), through the graphs when `use_graph`."""

    def __init__(self, script: list[int], use_graph: bool, bucket: int | None) -> None:
        self.script, self.use_graph, self.bucket, self.i = script, use_graph, bucket, 0
        self.steps, self.stats = script[0], RoundStats()

    @property
    def round(self) -> int:
        return self.i

    def begin_round(self, report: RoundReport) -> RoundPlan:
        steps = self.script[min(self.i, len(self.script) - 1)]
        self.i += 1
        self.steps = steps
        graph = self.use_graph and report.can_graph
        return RoundPlan(round=self.i, steps=steps, use_graph=graph,
                         batch_bucket=self.bucket if graph else None,
                         batch_pad=self.bucket or report.num_requests,
                         extend_tokens=report.num_tokens, extend_requests=report.num_extend,
                         cluster_requests=report.num_requests, switched=True,
                         all_done=report.done, extend_width=report.extend_len)

    def ran(self, executed) -> None:
        pass

    def end_round(self, accepts, executed=None, plan=None, shadow=None, requests=None,
                  shadow_rows=None) -> None:
        assert all(a == 0 for a in accepts) or plan.steps > 0


def synthetic_costs(buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                    depths: tuple[int, ...] = (0, 1, 3, 7), draft: float = 0.3,
                    fixed: float = 1.0, per_token: float = 0.02,
                    top_tokens: int = 1024) -> tuple[dict, dict]:
    """A consistent pair of cost tables (round_cost by bucket and depth, verify_cost by token
    rung) for per-request runs that must not depend on a timed measurement: the verify forward
    costs `fixed + per_token * tokens`, each draft forward `draft`, so a chain round costs
    `draft * S + verify(bucket x (S + 1))`."""
    from adaptive_dist.shape import token_bucket, token_ladder

    ladder = token_ladder(top_tokens)
    verify = {t: fixed + per_token * t for t in ladder}
    rounds = {str(b): {str(s): draft * s + verify[token_bucket(b * (s + 1), ladder)]
                       for s in depths} for b in buckets}
    return rounds, {str(t): c for t, c in verify.items()}


def per_request_config(**kw) -> AdaptiveConfig:
    """goodput with per-request budgets, deciding on `synthetic_costs` (keywords: theirs)."""
    rounds, verify = synthetic_costs(**kw)
    return AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3, 7), initial_steps=3,
                          per_request=True, round_cost=rounds, verify_cost=verify)
