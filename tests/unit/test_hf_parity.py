"""The engine against an independent implementation: Hugging Face transformers.

Every checkpoint here is written by transformers' own classes (``LlamaForCausalLM`` with Llama-3
RoPE scaling, tied and untied; ``Qwen2ForCausalLM`` with q/k/v biases; ``Qwen3ForCausalLM`` with
q/k norms and an explicit ``head_dim``), float32, randomly initialised, saved as one safetensors
file, as shards, or as ``pytorch_model.bin``, with ``config.json`` in the layout transformers 5
writes (``rope_parameters``) or the older one (top-level ``rope_theta`` + ``rope_scaling``).
Checks (``tests/hf_models.py`` builds the models and the references):

* the target's logits at every position of every prompt (the engine's paged prefill, in two
  chunks) within 1e-4 of transformers' forward;
* the engine's greedy ``--no-spec`` tokens equal ``model.generate(do_sample=False)``, stopping at
  the same end-of-sequence token;
* the other RoPE types: ``linear`` and ``yarn`` computed as transformers computes them,
  ``dynamic`` refused by name;
* EAGLE (1) and EAGLE-3 heads in SGLang's tensor names and config fields: their logits within
  1e-4 of a reference assembled from transformers' Llama blocks, through draft-extend and
  fed-back draft steps; greedy speculative decoding (depths 1, 3, 7, adaptive) equal to no
  speculation and to transformers' ``generate``;
* nothing the engine imports imports transformers.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaptive_dist.config import AdaptiveConfig
from engine_fixtures import check_pages_back, engine_for
from hf_models import (
    ARCHS,
    FORMATS,
    LAYOUTS,
    ROPE_TYPES,
    Eagle3Reference,
    EagleReference,
    bigram_target,
    build_target,
    draft_vocab,
    eagle3_tensors,
    eagle_tensors,
    head_config,
    hf_generate,
    hf_hidden_states,
    hf_logits,
    oracle_eagle3_tensors,
    oracle_eagle_tensors,
    rope_parameters,
    save_target,
    set_eos,
    target_hf_config,
    to_legacy_layout,
    write_head,
)
from workers.attention import ForwardMode, build_metadata
from workers.attention.torch_backend import TorchBackend
from workers.kv_cache import DUMMY_PAGE, KVPool
from workers.model import CheckpointError, DenseCausalAttention, load_eagle, load_llama
from workers.sampling import SamplingParams

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
N_NEW = 20
_rng = random.Random(2024)
PROMPTS = [[_rng.randrange(64) for _ in range(n)] for n in (1, 6, 17, 30, 45)]
MODES = [("static", 1, None), ("static", 3, None), ("static", 7, None),
         ("ema", 7, AdaptiveConfig(warmup_batches=1, update_interval=1, ema_alpha=0.6,
                                initial_steps=7))]


# ---- the engine's side -------------------------------------------------------------------------

@torch.no_grad()
def engine_logits(target, prompts: list[list[int]], page_size: int = 4) -> list[torch.Tensor]:
    """The target's logits [len, V] at every position of every prompt, as the engine's prefill
    computes them: one ragged batch over the paged KV pool (torch backend), each prompt in two
    chunks (the second attends to the first through the cache)."""
    cfg = target.config
    pages = [-(-len(p) // page_size) for p in prompts]
    pool = KVPool(cfg.num_hidden_layers, 1 + sum(pages), page_size, cfg.num_key_value_heads,
                  cfg.head_dim, dtype=torch.float32)
    free = iter(p for p in range(pool.num_pages) if p != DUMMY_PAGE)
    tables = [[next(free) for _ in range(n)] for n in pages]
    parts: list[list[torch.Tensor]] = [[] for _ in prompts]
    for chunk in range(2):
        spans = [(0, len(p) // 2) if chunk == 0 else (len(p) // 2, len(p)) for p in prompts]
        rows = [b for b, (lo, hi) in enumerate(spans) if hi > lo]
        meta = build_metadata(ForwardMode.EXTEND, [tables[b] for b in rows],
                              [spans[b][0] for b in rows], [spans[b][1] - spans[b][0] for b in rows],
                              page_size)
        ids = torch.tensor([t for b in rows for t in prompts[b][spans[b][0]:spans[b][1]]])
        pos = torch.cat([torch.arange(*spans[b]) for b in rows])
        logits = target.compute_logits(target(ids, pos, TorchBackend().plan(meta, pool)))
        for b, part in zip(rows, logits.split([spans[b][1] - spans[b][0] for b in rows])):
            parts[b].append(part)
    return [torch.cat(p) for p in parts]


def greedy(target, head, mode: str = "nospec", steps: int = 3, config=None,
           prompts: list[list[int]] = PROMPTS):
    """The engine's greedy outputs (stopping at the target's end-of-sequence ids, as the CLI
    does) and its stats."""
    engine = engine_for(target, head, mode, steps=steps, config=config)
    params = SamplingParams(max_new_tokens=N_NEW, stop_token_ids=target.config.eos_token_ids)
    out = [r.output_ids for r in engine.generate(prompts, params)]
    check_pages_back(engine)
    return out, engine.stats


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ---- transformers' side: models, checkpoints, references (module-scoped) ------------------------

def choose_eos(model, prompts: list[list[int]]) -> int:
    """A token the model emits in some greedy continuations (not first) and not in others, so the
    stop is exercised and so is running to the length limit."""
    outs = [hf_generate(model, p, N_NEW)[0] for p in prompts]
    for t in sorted({t for out in outs for t in out[2:]}):
        hit = [t in out for out in outs]
        if any(t in out[2:] and t not in out[:2] for out in outs) and not all(hit):
            return t
    raise AssertionError(f"no token stops some continuations and not others: {outs}")


class Saved:
    """One transformers model, its checkpoints ({(format, layout): dir}) and its references."""

    def __init__(self, model, root: Path, prompts: list[list[int]]) -> None:
        self.model = model
        set_eos(model, choose_eos(model, prompts))
        self.dirs: dict[tuple[str, str], Path] = {}
        for fmt in FORMATS:
            v5 = save_target(model, root / f"{fmt}-v5", fmt)
            self.dirs[fmt, "v5"] = v5
            self.dirs[fmt, "legacy"] = to_legacy_layout(v5, root / f"{fmt}-legacy")
        refs = [hf_generate(model, p, N_NEW) for p in prompts]
        self.reference = [r[0] for r in refs]
        # a near-tie could flip an argmax between two correct float32 implementations
        assert min(r[1] for r in refs) > 1e-3, [r[1] for r in refs]
        self.logits = [hf_logits(model, p) for p in prompts]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache: dict[str, Saved] = {}

    def get(arch: str) -> Saved:
        if arch not in cache:
            seed = ARCHS.index(arch) if arch in ARCHS else 10 + ROPE_TYPES.index(arch)
            model = (build_target(arch, seed) if arch in ARCHS
                     else build_target("llama", seed, rope=arch))
            cache[arch] = Saved(model, tmp_path_factory.mktemp(arch), PROMPTS)
        return cache[arch]
    return get


# ---- the fixtures are what they claim ------------------------------------------------------------

def test_fixture_scalings_change_some_frequencies_and_keep_others() -> None:
    """At the tiny head_dim, Llama-3 scaling keeps a frequency, blends one and divides the rest
    by 8, and YaRN keeps, blends and interpolates: catches a fixture whose scaling would be a
    no-op (then the parity tests below would not test it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def inv_freq(cfg):
        kind = cfg.rope_parameters["rope_type"]
        if kind == "default":
            dim = cfg.hidden_size // cfg.num_attention_heads
            return 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
        return ROPE_INIT_FUNCTIONS[kind](cfg)[0]

    for cfg, factor in ((target_hf_config("llama3"), 8.0), (target_hf_config("llama", "yarn"), 4.0)):
        plain_cfg = target_hf_config("llama3")
        plain_cfg.rope_parameters = {"rope_type": "default",
                                     "rope_theta": cfg.rope_parameters["rope_theta"]}
        ratio = inv_freq(plain_cfg) / inv_freq(cfg)
        kept = torch.isclose(ratio, torch.tensor(1.0))
        divided = torch.isclose(ratio, torch.tensor(factor))
        assert kept.any() and divided.any() and (~kept & ~divided).any(), ratio
    yarn = ROPE_INIT_FUNCTIONS["yarn"](target_hf_config("llama", "yarn"))[1]
    assert yarn > 1.0  # its cos/sin scaling is used too


def test_checkpoints_are_what_transformers_writes_and_reads(saved) -> None:
    """The v5 directories hold what transformers 5 wrote (``rope_parameters``, no top-level
    theta), the legacy ones the older layout; transformers itself loads the legacy and ``.bin``
    directories back to the same logits: catches a fixture rewrite that changed the model (the
    layout tests would then compare against the wrong thing)."""
    for arch in ARCHS:
        s = saved(arch)
        for fmt in FORMATS:
            v5 = json.loads((s.dirs[fmt, "v5"] / "config.json").read_text())
            old = json.loads((s.dirs[fmt, "legacy"] / "config.json").read_text())
            assert "rope_parameters" in v5 and "rope_theta" not in v5 and "rope_scaling" not in v5
            assert "rope_parameters" not in old and old["rope_theta"] == v5["rope_parameters"]["rope_theta"]
            assert (old["rope_scaling"] is None) == (v5["rope_parameters"]["rope_type"] == "default")
        assert (s.dirs["bin", "v5"] / "pytorch_model.bin").is_file()
        assert not (s.dirs["bin", "v5"] / "model.safetensors").exists()
    s = saved("llama3-tied")
    for key in (("bin", "legacy"), ("sharded", "legacy")):
        back = type(s.model).from_pretrained(s.dirs[key], attn_implementation="eager").eval()
        assert back.config.rope_parameters == s.model.config.rope_parameters
        assert max_diff(hf_logits(back, PROMPTS[-1]), s.logits[-1]) == 0.0, key


# ---- targets: logits, formats, layouts -------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(saved, arch: str, fmt: str, layout: str) -> None:
    """Logits at every position within 1e-4 of transformers': catches any config key read wrong
    (RoPE theta or scaling in either layout, eps, head_dim, tying), a weight read wrong from any
    format, and any difference in the forward (biases, q/k norms, GQA, RoPE layout)."""
    s = saved(arch)
    target = load_llama(s.dirs[fmt, layout])
    assert target.config.eos_token_ids == (s.model.config.eos_token_id,)
    diffs = [max_diff(got, want) for got, want in zip(engine_logits(target, PROMPTS), s.logits)]
    assert max(diffs) <= TOL, f"{arch} {fmt} {layout}: max |logit diff| per prompt {diffs}"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_format_and_layout_loads_the_same_model(saved, arch: str) -> None:
    """Both config layouts and all three weight formats give one configuration and bit-identical
    tensors: catches a layout read differently from the other (e.g. the scaling dropped from one)."""
    s = saved(arch)
    models = {key: load_llama(path) for key, path in s.dirs.items()}
    first_key, first = next(iter(models.items()))
    want = first.state_dict()
    for key, model in models.items():
        assert model.config == first.config, (key, model.config, first_key, first.config)
        got = model.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), key


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_no_spec_equals_transformers_generate(saved, arch: str, layout: str) -> None:
    """The engine's greedy tokens (no speculation) equal ``generate(do_sample=False)`` for every
    prompt, the end-of-sequence stop included: catches a wrong decode path (KV cache, positions
    after the prompt) or eos read wrong from generation_config.json / config.json."""
    s = saved(arch)
    fmt = FORMATS[(ARCHS.index(arch) + LAYOUTS.index(layout)) % len(FORMATS)]
    target = load_llama(s.dirs[fmt, layout])
    eos = s.model.config.eos_token_id
    assert any(out[-1] == eos for out in s.reference)            # the stop is exercised
    assert any(len(out) == N_NEW for out in s.reference)         # and the length limit
    got, _ = greedy(target, None)
    assert got == s.reference, f"{arch} {fmt} {layout}"


# ---- the other RoPE types --------------------------------------------------------------------------

SUPPORTED_ROPE = ("linear", "yarn")    # docs/models.md: computed as transformers computes them
REFUSED_ROPE = ("dynamic",)            # rescaled by the current length: not lossless with a cache


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ROPE_TYPES)
def test_other_rope_types_match_transformers_or_are_refused_by_name(saved, kind: str,
                                                                    layout: str) -> None:
    """``linear`` / ``yarn``: logits within 1e-4 and greedy tokens equal to transformers' (catches
    a wrong factor, ramp or attention factor); ``dynamic``: refused, naming the type and the file
    (catches it loading as plain RoPE: transformers rescales every frequency once a sequence
    outgrows ``max_position_embeddings``, which a KV cache cannot follow)."""
    s = saved(kind)
    path = s.dirs["safetensors", layout]
    if kind in REFUSED_ROPE:
        with pytest.raises(CheckpointError, match=rf"config\.json.*rope_type.*'{kind}'"):
            load_llama(path)
        return
    assert kind in SUPPORTED_ROPE
    target = load_llama(path)
    diffs = [max_diff(got, want) for got, want in zip(engine_logits(target, PROMPTS), s.logits)]
    assert max(diffs) <= TOL, f"{kind} {layout}: max |logit diff| per prompt {diffs}"
    got, _ = greedy(target, None)
    assert got == s.reference


_YARN = rope_parameters("yarn", 10000.0)
VARIANTS = {  # name: (arch, config fields replaced)
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),          # as Qwen2.5-0.5B
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),          # as Qwen3-0.6B
    "qwen3-yarn": ("qwen3", {"rope_parameters": rope_parameters("yarn", 1e6)}),
    "yarn-attention-factor": ("llama", {"rope_parameters": {**_YARN, "attention_factor": 0.7}}),
    "yarn-mscale": ("llama", {"rope_parameters": {**_YARN, "mscale": 1.0, "mscale_all_dim": 0.5}}),
    "yarn-untruncated": ("llama", {"rope_parameters": {**_YARN, "truncate": False,
                                                       "beta_fast": 16.0, "beta_slow": 2.0}}),
    "llama3-head-dim-32": ("llama3", {"head_dim": 32}),
    "llama3-one-kv-head": ("llama3", {"num_key_value_heads": 1}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_variants_match_transformers(tmp_path: Path, name: str, layout: str) -> None:
    """Logits at every position within 1e-4 of transformers' for configurations real checkpoints
    use beside the main four: tied Qwen embeddings, YaRN with an explicit attention factor, with
    ``mscale`` / ``mscale_all_dim``, untruncated with other betas, on a Qwen3, an explicit Llama
    ``head_dim``, one KV head. Catches a key of these read wrong or ignored."""
    arch, overrides = VARIANTS[name]
    model = build_target(arch, seed=30 + list(VARIANTS).index(name), **overrides)
    path = save_target(model, tmp_path / "v5", "safetensors")
    if layout == "legacy":
        path = to_legacy_layout(path, tmp_path / "legacy")
    target = load_llama(path)
    diffs = [max_diff(got, hf_logits(model, p)) for got, p in zip(engine_logits(target, PROMPTS),
                                                                 PROMPTS)]
    assert max(diffs) <= TOL, f"{name} {layout}: max |logit diff| per prompt {diffs}"


# ---- draft heads: their forward against transformers' blocks ---------------------------------------

CHAIN = list(range(3, 64, 5))[:12] + [7, 7, 40, 2, 19, 33, 33, 8, 61, 0, 12, 5, 44]
DRAFT_STEPS = 4


@torch.no_grad()
def engine_chain(target, head, tokens: list[int], steps: int):
    """The engine head's logits over draft-extend (tokens 1..n paired with the target's
    features 0..n-1 at positions 1..n) and then `steps` fed-back greedy draft steps."""
    ids, n = torch.tensor(tokens), len(tokens) - 1
    feats = target(ids[:-1], torch.arange(n), DenseCausalAttention([n]))
    h_ids, h_feats, pos = ids[1:], feats, torch.arange(1, n + 1)
    out = head(h_ids, h_feats, pos, DenseCausalAttention([n]))
    extend = head.compute_logits(out)
    drafts = []
    for k in range(steps):
        logits = head.compute_logits(out[-1:])
        drafts.append(logits[0])
        token = logits.argmax(-1)
        h_ids, h_feats = torch.cat((h_ids, token)), torch.cat((h_feats, out[-1:]))
        pos = torch.cat((pos, torch.tensor([n + 1 + k])))
        out = head(h_ids, h_feats, pos, DenseCausalAttention([len(h_ids)]))
    return extend, torch.stack(drafts)


@torch.no_grad()
def reference_chain(ref, first_hidden: torch.Tensor, tokens: list[int], steps: int):
    """`engine_chain` for a reference head: `first_hidden` [n, d] are the head's inputs paired
    with tokens 1..n; a fed-back draft carries the reference's own output."""
    n = len(tokens) - 1
    ids, hidden, pos = torch.tensor(tokens[1:]), first_hidden, torch.arange(1, n + 1)
    extend, own = ref(ids, hidden, pos)
    drafts, logits = [], extend
    for k in range(steps):
        drafts.append(logits[-1])
        token = logits[-1:].argmax(-1)
        ids, hidden = torch.cat((ids, token)), torch.cat((hidden, own[-1:]))
        pos = torch.cat((pos, torch.tensor([n + 1 + k])))
        logits, own = ref(ids, hidden, pos)
    return extend, torch.stack(drafts)


def _compare(got: tuple, want: tuple, what: str) -> None:
    for name, a, b in zip(("draft-extend", "draft steps"), got, want):
        assert torch.equal(torch.isinf(a), torch.isinf(b)), f"{what} {name}: -inf pattern"
        fin = torch.isfinite(b)
        diff = max_diff(a[fin], b[fin])
        assert diff <= TOL, f"{what} {name}: max |logit diff| {diff}"
    assert torch.equal(got[1].argmax(-1), want[1].argmax(-1)), f"{what}: drafts differ"


EAGLE3_CASES = [  # target, layout, format, aux layer ids, extras
    ("llama3", "v5", "safetensors", [0, 1, 2], {}),
    ("llama3-tied", "legacy", "bin", [2, 0, 1], {"norm_before_residual": True}),
    ("qwen3", "v5", "safetensors", [1, 0, 2], {"head_dim": 32, "own_embedding": True,
                                               "aux_top_level": True}),
]


@pytest.mark.parametrize("case", EAGLE3_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_eagle3_head_matches_reference(saved, tmp_path: Path, case) -> None:
    """An EAGLE-3 head in SGLang's layout (random weights) computes what the reference computes,
    through draft-extend and fed-back draft steps: catches a tensor or config field read wrong
    (aux layer ids — in ``eagle_config`` or at the top level — and their order, ``d2t``/``t2d``,
    ``norm_before_residual``, an explicit ``head_dim``, its own embedding, its RoPE in either
    layout) or a wrong midlayer."""
    arch, layout, fmt, aux, extra = case
    s = saved(arch)
    own = extra.get("own_embedding", False)
    nbr = extra.get("norm_before_residual", False)
    cfg = head_config("eagle3", s.model, 32, aux, head_dim=extra.get("head_dim"),
                      norm_before_residual=nbr, aux_top_level=extra.get("aux_top_level", False))
    tensors = eagle3_tensors(cfg, draft_vocab(32, seed=5), seed=7, own_embedding=own)
    path = write_head(tmp_path / "eagle3", cfg, tensors, fmt, layout)
    target = load_llama(s.dirs["safetensors", layout])
    head = load_eagle(path, target)
    ref = Eagle3Reference(cfg, tensors, s.model, aux, norm_before_residual=nbr)
    fused = ref.fuse(hf_hidden_states(s.model, CHAIN[:-1]))
    _compare(engine_chain(target, head, CHAIN, DRAFT_STEPS),
             reference_chain(ref, fused, CHAIN, DRAFT_STEPS), f"eagle3 {case[:3]}")


EAGLE_CASES = [("llama3", "v5", "bin"), ("llama3-tied", "legacy", "safetensors"),
               ("qwen3", "v5", "safetensors")]


@pytest.mark.parametrize("case", EAGLE_CASES, ids=lambda c: "-".join(c))
def test_eagle_head_matches_reference(saved, tmp_path: Path, case) -> None:
    """An EAGLE (1) head in the EAGLE project's / SGLang's layout (``fc`` with a bias, no input
    norm in its layer, no final norm; random weights) computes what the reference computes:
    catches a missing or extra norm, ``fc``'s halves swapped, the wrong feature (it is the
    target's final-norm output) or its RoPE read wrong."""
    arch, layout, fmt = case
    s = saved(arch)
    cfg = head_config("eagle", s.model)
    tensors = eagle_tensors(cfg, seed=8)
    path = write_head(tmp_path / "eagle", cfg, tensors, fmt, layout)
    target = load_llama(s.dirs["safetensors", layout])
    head = load_eagle(path, target)
    ref = EagleReference(cfg, tensors, s.model)
    feats = hf_hidden_states(s.model, CHAIN[:-1])[-1]
    _compare(engine_chain(target, head, CHAIN, DRAFT_STEPS),
             reference_chain(ref, feats, CHAIN, DRAFT_STEPS), f"eagle {case}")


# ---- speculative decoding over transformers-saved checkpoints -----------------------------------

# head kind: (config layout, target format, head format, the target's eps). The EAGLE-3 oracle
# reads the state after target layer 0, which strays from the embedding as eps grows: it gets
# the smaller eps (its rejections come from its half-size draft vocabulary too).
SPEC_CASES = {"eagle3": ("v5", "sharded", "safetensors", 0.6),
              "eagle": ("legacy", "bin", "bin", 1.3)}


@pytest.fixture(scope="module")
def bigram_pairs(tmp_path_factory):
    """{head kind: (transformers' greedy outputs, target dir, head dir)}: a bigram target
    (transformers) saved, and a head drafting its bigram in SGLang's layout."""
    root = tmp_path_factory.mktemp("bigram")
    pairs = {}
    for kind, (layout, fmt, head_fmt, eps) in SPEC_CASES.items():
        model, perm = bigram_target(seed=21, eps=eps)
        set_eos(model, choose_eos(model, PROMPTS))
        refs = [hf_generate(model, p, N_NEW) for p in PROMPTS]
        assert min(r[1] for r in refs) > 1e-3, [r[1] for r in refs]
        v5 = save_target(model, root / f"{kind}-target-v5", fmt)
        target = v5 if layout == "v5" else to_legacy_layout(v5, root / f"{kind}-target")
        if kind == "eagle3":
            cfg = head_config("eagle3", model, 32, [0, 1, 2])
            tensors = oracle_eagle3_tensors(cfg, model, perm, draft_vocab(32, seed=3), seed=4)
        else:
            cfg = head_config("eagle", model)
            tensors = oracle_eagle_tensors(cfg, model, seed=4)
        head = write_head(root / f"{kind}-head", cfg, tensors, head_fmt, layout)
        pairs[kind] = ([r[0] for r in refs], target, head)
    return pairs


@pytest.mark.parametrize("kind", list(SPEC_CASES))
def test_speculative_equals_no_spec_equals_transformers(bigram_pairs, kind: str) -> None:
    """Greedy speculative decoding at depths 1, 3, 7 and adaptive gives the engine's greedy
    tokens without speculation, which are transformers' ``generate``'s; drafts are accepted and
    rejected, at every length: catches a lossy verify (accepted tokens past a stop, a wrong bonus
    token, a KV slot of a rejected draft left in use) on real checkpoint layouts, and a head whose
    vocabulary map or features are read wrong (no draft would be accepted)."""
    reference, target_dir, head_dir = bigram_pairs[kind]
    target = load_llama(target_dir)
    head = load_eagle(head_dir, target)
    plain, _ = greedy(target, None)
    assert plain == reference, "no speculation vs transformers"
    hist: dict[int, int] = {}
    for mode, steps, config in MODES:
        got, stats = greedy(target, head, mode, steps, config)
        assert got == plain, f"{kind}: {mode} {steps}"
        assert mode == "static" or stats.switches >= 1, "the adaptive run never changed depth"
        for k, v in stats.accept_histogram.items():
            hist[k] = hist.get(k, 0) + v
    assert hist.get(0, 0) > 0 and sum(v for k, v in hist.items() if k >= 3) > 0, hist


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_random_heads_speculative_equals_transformers(saved, tmp_path: Path, kind: str) -> None:
    """Random heads (rejected nearly always) over a random transformers target: speculative
    greedy at depth 3 and adaptive equals transformers' ``generate``: catches a wrong bonus token
    or a corrupted KV cache after rejections."""
    s = saved("llama3")
    cfg = (head_config("eagle3", s.model, 32, [0, 1, 2]) if kind == "eagle3"
           else head_config("eagle", s.model))
    tensors = (eagle3_tensors(cfg, draft_vocab(32, seed=9), seed=9) if kind == "eagle3"
               else eagle_tensors(cfg, seed=9))
    target = load_llama(s.dirs["safetensors", "v5"])
    head = load_eagle(write_head(tmp_path / kind, cfg, tensors), target)
    for mode, steps, config in (MODES[1], MODES[3]):
        got, _ = greedy(target, head, mode, steps, config)
        assert got == s.reference, f"{kind}: {mode} {steps}"


# ---- transformers stays a test-only dependency ---------------------------------------------------

_NO_TRANSFORMERS = r"""
import importlib, pkgutil, sys
for name in ("collectives", "adaptive_dist", "workers"):
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(info.name)
from adaptive_dist.config import load_config
from workers.config import EngineConfig
from workers.engine import build_engine
from workers.model import load_eagle, load_llama
from workers.sampling import SamplingParams
target = load_llama(sys.argv[1])
head = load_eagle(sys.argv[2], target)
config = EngineConfig(spec=load_config(None, "static", initial_steps=3), max_batch_size=2,
                      page_size=4, max_context_len=256, device="cpu")
out = build_engine(config, target, head).generate([[1, 2, 3]], SamplingParams(max_new_tokens=5))
assert len(out[0].output_ids) == 5, out[0].output_ids
loaded = sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers."))
print("TRANSFORMERS:", loaded)
"""


def test_engine_never_imports_transformers(bigram_pairs) -> None:
    """Every module of collectives / adaptive_dist / workers imported, a transformers-saved pair
    loaded and a speculative generation run, in a fresh interpreter: transformers is not in
    ``sys.modules``. Catches any engine import of transformers (it is a test-only dependency)."""
    _, target_dir, head_dir = bigram_pairs["eagle3"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    run = subprocess.run([sys.executable, "-c", _NO_TRANSFORMERS, str(target_dir), str(head_dir)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TRANSFORMERS: []" in run.stdout, run.stdout
