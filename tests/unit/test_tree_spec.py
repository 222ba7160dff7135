"""Draft trees in the engine (issue 35 §1, §3): greedy tree speculation equals plain greedy
decoding token for token (the tiny random pair in float64, the bundled pair in float32, a
transformers-built checkpoint whose outputs are transformers' `generate`'s); top-k 1 is the chain
exactly; the drafted verify set equals a cache-free EAGLE-2 reference (dense forwards of the
head over every node's path) and is closed under ancestors, ancestors first; sampled trees keep
the target's law (chi-square); what trees do not run is refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaptive_dist.config import load_config
from adaptive_dist.shape import RoundShape, TreeShape
from engine_fixtures import (check_pages_back, engine_config, engine_for, lossless_params,
                             random_prompts, tiny_config, tiny_pair)
from workers.config import EngineConfig
from workers.sampling import SamplingParams
from workers.worker.graph_table import GraphPhase
from workers.worker.tree import TreeRound

SHAPES = [(3, 2, 6), (3, 4, 8), (2, 3, 12), (5, 2, 8), (1, 4, 5)]


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(12, vocab=64, seed=7)


@pytest.fixture(scope="module")
def reference(pair, prompts) -> list[list[int]]:
    engine = engine_for(pair[0], None, "nospec")
    return [r.output_ids for r in engine.generate(prompts, lossless_params(len(prompts)))]


def tree_engine(target, head, steps: int, topk: int, tokens: int, **kw):
    return engine_for(target, head, "static", steps=steps, speculative_eagle_topk=topk,
                      speculative_num_draft_tokens=tokens, **kw)


@pytest.mark.parametrize("steps,topk,tokens", SHAPES)
def test_greedy_tree_equals_plain_greedy(pair, prompts, reference, steps, topk, tokens) -> None:
    engine = tree_engine(*pair, steps, topk, tokens)
    out = engine.generate(prompts, lossless_params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    hist = engine.stats.accept_histogram
    assert sum(v for a, v in hist.items() if a > 0) > 0, hist
    check_pages_back(engine)


def test_greedy_tree_with_overlap_and_continuous_batching(pair, prompts, reference) -> None:
    engine = tree_engine(*pair, 4, 2, 9, overlap=True, max_batch=3)
    out = engine.generate(prompts, lossless_params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    check_pages_back(engine)


def test_greedy_tree_through_graphs_equals_plain_greedy(pair, prompts, reference) -> None:
    """The tree round captured per bucket (draft, verify, acceptance and commit as one graph,
    then draft-extend; emulated on the CPU: the replay runs the captured body)."""
    engine = tree_engine(*pair, 3, 2, 6, cuda_graphs=True)
    table = engine.worker.table
    assert {k.phase for k in table} >= {GraphPhase.TREE, GraphPhase.EXTEND}
    assert not table.of(GraphPhase.TARGET)
    out = engine.generate(prompts, lossless_params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    assert engine.stats.graph_rounds > 0
    check_pages_back(engine)


def test_sampled_tree_through_graphs_equals_eager(pair, prompts) -> None:
    """The sampling variant of the tree graph: the same seeded tokens as the eager round."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=p.max_new_tokens)
              for p in lossless_params(len(prompts))]
    seeds = list(range(len(prompts)))
    eager = tree_engine(*pair, 3, 2, 6).generate(prompts, params, seeds=seeds)
    graphs = tree_engine(*pair, 3, 2, 6, cuda_graphs=True)
    out = graphs.generate(prompts, params, seeds=seeds)
    assert [r.output_ids for r in out] == [r.output_ids for r in eager]
    assert graphs.stats.graph_rounds > 0


def test_top_k_1_is_the_chain(pair, prompts) -> None:
    """--speculative-eagle-topk 1 --speculative-num-draft-tokens S+1 runs the chain's code:
    the same tokens, accept lengths and round shapes."""
    chain = engine_for(*pair, "static", steps=3)
    same = tree_engine(*pair, 3, 1, 4)
    assert same.worker.tree is None and same.config.tree is None
    params = lossless_params(len(prompts))
    assert ([r.output_ids for r in chain.generate(prompts, params)]
            == [r.output_ids for r in same.generate(prompts, params)])
    assert chain.stats.accept_histogram == same.stats.accept_histogram
    assert chain.planner.stats.rounds_at_shape == same.planner.stats.rounds_at_shape


def test_tree_accepts_at_least_the_chain_on_average(pair, prompts) -> None:
    """Equal draft steps: on this pair a tree that verifies every node accepts at least as much
    per round as the chain. Not a theorem (the frontier keeps the K best nodes by cumulative
    score, which may drop the chain's greedy path): a regression check of the drafting."""
    params = lossless_params(len(prompts))

    def mean_accept(engine) -> float:
        engine.generate(prompts, params)
        hist = engine.stats.accept_histogram
        return sum(a * v for a, v in hist.items()) / sum(hist.values())
    chain = mean_accept(engine_for(*pair, "static", steps=3))
    tree = mean_accept(tree_engine(*pair, 3, 2, TreeShape(3, 2, 2).nodes + 1))
    assert tree >= chain, (tree, chain)


# ---- sampling: multi-branch rejection keeps the target's distribution ---------------------------

@pytest.mark.parametrize("topk,tokens,temperature,top_p",
                         [(2, 6, 1.0, 1.0), (2, 6, 0.7, 0.8), (4, 8, 0.7, 0.8)])
def test_tree_sampling_matches_target_distribution(topk, tokens, temperature, top_p) -> None:
    """The first three tokens of 8000 sampled requests (trees of 3 steps over a random head that
    is often wrong: siblings rejected, residuals drawn) against the target's exact joint law,
    computed independently (dense attention, no cache, every prefix enumerated)."""
    from sampling_reference import ALPHA, PROMPT, VOCAB, chi_square_pvalue, exact_joint

    target, head = tiny_pair(seed=2, eps=1.0, cfg=tiny_config(vocab=VOCAB, hidden=32))
    engine = tree_engine(target, head, 3, topk, tokens, max_batch=64)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=3)
    out = engine.generate([PROMPT] * 8000, params, seed=1000)
    counts = torch.zeros(VOCAB ** 3)
    for req in out:
        t0, t1, t2 = req.output_ids
        counts[(t0 * VOCAB + t1) * VOCAB + t2] += 1
    hist = engine.stats.accept_histogram
    assert hist[0] > 0 and hist[2] + hist[3] > 0, f"no rejections or no deep accepts: {hist}"
    assert chi_square_pvalue(counts, exact_joint(target, temperature, top_p)) > ALPHA
    hotter = exact_joint(target, temperature * 1.3, top_p)
    assert chi_square_pvalue(counts, hotter) < ALPHA, "the test cannot tell a 30% hotter target"


def test_greedy_rows_of_a_sampled_tree_round_stay_greedy(pair, prompts, reference) -> None:
    engine = tree_engine(*pair, 3, 2, 6)
    params = [p if i % 2 else SamplingParams(temperature=0.9, max_new_tokens=p.max_new_tokens)
              for i, p in enumerate(lossless_params(len(prompts)))]
    out = engine.generate(prompts, params, seeds=list(range(len(prompts))))
    assert [r.output_ids for r in out][1::2] == reference[1::2]
    check_pages_back(engine)


# ---- the verify set ----------------------------------------------------------------------------

def test_select_keeps_the_best_nodes_closed_under_ancestors(pair) -> None:
    """Random scores that decrease along every path (as cumulative log-probabilities do), ties
    included: the N-1 chosen are the best, each one's parent is chosen or the root, parents come
    first."""
    gen = torch.Generator().manual_seed(3)
    shape = TreeShape(4, 3, 14)
    engine = tree_engine(*pair, 4, 3, 14)
    round_ = TreeRound(shape, engine.worker.slots, engine.worker.models)
    k, m = shape.topk, shape.nodes
    rows = torch.full((5,), engine.worker.slots.dummy)
    parent = [-1] * k
    for step in range(2, shape.steps + 1):
        first = k + (step - 3) * k * k if step > 2 else 0
        width = k if step == 2 else k * k
        parent += [first + int(torch.randint(width, (1,), generator=gen)) for _ in range(k * k)]
    parent_t = torch.tensor(parent).expand(5, m)
    score = torch.zeros(5, m)
    for i in range(m):
        step = torch.rand(5, generator=gen).round(decimals=1)   # ties and zero steps
        score[:, i] = (0.0 if parent[i] < 0 else score[:, parent[i]]) - step
    depth = torch.zeros(5, m, dtype=torch.int64)
    for i in range(m):
        depth[:, i] = 1 if parent[i] < 0 else depth[:, parent[i]] + 1
    tree = round_.select(rows, score, torch.arange(m).expand(5, m), parent_t, depth)
    for b in range(5):
        chosen = tree.tokens[b, 1:].tolist()          # token = node id here
        assert chosen == sorted(chosen)
        assert sorted(score[b, chosen].tolist()) == sorted(score[b].tolist())[-len(chosen):]
        for i, node in enumerate(chosen, start=1):
            p = parent[node]
            assert (p < 0 and tree.parent[b, i] == 0) or chosen[tree.parent[b, i] - 1] == p
            assert tree.parent[b, i] < i
            assert tree.depth[b, i] == depth[b, node]


# ---- EAGLE-2 drafting against a cache-free reference ------------------------------------------

@torch.no_grad()
def _reference_tree(target, head, seq: list[int], steps: int, topk: int, tokens: int):
    """EAGLE-2 by hand, without a cache: every node's head output from a dense forward over the
    whole sequence (x_1..x_n with the target's features f_0..f_{n-1}, then the node's path with
    the head's own outputs); returns {path (tuple of tokens): score} of the N-1 best nodes."""
    from workers.model import DenseCausalAttention as Dense

    n = len(seq) - 1
    ids = torch.tensor(seq)
    feats = target(ids[:-1], torch.arange(n), Dense([n]))

    def output(path: tuple) -> torch.Tensor:
        h_ids, h_feats = ids[1:], feats
        out = head(h_ids, h_feats, torch.arange(1, n + 1), Dense([n]))
        for t in path:
            h_ids = torch.cat((h_ids, torch.tensor([t])))
            h_feats = torch.cat((h_feats, out[-1:]))
            out = head(h_ids, h_feats, torch.arange(1, len(h_ids) + 1), Dense([len(h_ids)]))
        return out[-1:]

    def children(path: tuple, score: float) -> list[tuple[tuple, float]]:
        lp = torch.log_softmax(head.compute_logits(output(path)).float(), -1)[0]
        top = lp.topk(topk)
        return [(path + (int(t),), score + float(v)) for v, t in zip(top.values, top.indices)]

    nodes = children((), 0.0)
    frontier = nodes
    for _ in range(2, steps + 1):
        cands = [c for path, score in frontier for c in children(path, score)]
        nodes += cands
        frontier = sorted(cands, key=lambda c: -c[1])[:topk]
    return dict(sorted(nodes, key=lambda c: -c[1])[:tokens - 1])


@pytest.mark.parametrize("steps,topk,tokens", [(3, 2, 6), (3, 3, 9)])
def test_drafted_tree_is_eagle2s(pair, steps, topk, tokens) -> None:
    """The verify set the engine drafts (tokens, structure, scores) equals the cache-free
    reference's, round after round (the float64 pair: no ties)."""
    target, head = pair
    engine = tree_engine(target, head, steps, topk, tokens, max_batch=1)
    seen = []
    draft = engine.worker.tree.draft

    def spy(rows, n, pages, budget=None):
        tree = draft(rows, n, pages, budget)
        seen.append((int(engine.worker.slots.last_token[rows[0]]), tree))
        return tree
    engine.worker.tree.draft = spy
    req = engine.add([5, 17, 3, 44, 9, 12, 30], SamplingParams(max_new_tokens=24))
    checked = 0
    while not req.finished:
        before = list(req.prompt_ids) + list(req.output_ids)
        count = len(seen)
        engine.step()
        if len(seen) > count and count > 0:   # the first round's prefill token is read with it
            last, tree = seen[count]
            assert before[-1] == last
            want = _reference_tree(target, head, before, steps, topk, tokens)
            got = {}
            toks, parent = tree.tokens[0].tolist(), tree.parent[0].tolist()
            for i in range(1, tokens):
                path, j = [], i
                while j:
                    path.append(toks[j])
                    j = parent[j]
                got[tuple(reversed(path))] = tree.depth[0, i].item()
            assert set(got) == set(want), (got, want)
            assert all(d == len(p) for p, d in got.items())
            checked += 1
    assert checked >= 3


def _draft_reference(round_: TreeRound, rows, n, pages, budget=None):
    """`TreeRound.draft` as first written (one op per quantity and step: the mask cloned and
    its own slots set, the ancestors gathered then the parent's slot added by comparison, the
    parents and depths laid out at every step): the fused form must equal it exactly."""
    from workers.attention.tree import TreeAttention, TreeKV
    from workers.worker.tree import _log_probs, _top

    steps, k = round_.tree.steps, round_.tree.topk
    models, bp, device = round_.models, rows.shape[0], rows.device
    head = models.head
    g = round_.slots.feature[rows]
    score, token = _log_probs(head.compute_logits(g)).topk(k, dim=-1)
    scores, toks = [score], [token]
    parents = [torch.full_like(token, -1)]
    depths = [torch.ones_like(token)]
    ids = torch.arange(k, device=device).expand(bp, k)
    feat = g[:, None, :].expand(bp, k, g.shape[-1])
    slots = (steps - 1) * k
    anc = torch.zeros(bp, k, max(slots, 1), dtype=torch.bool, device=device)
    memory = None
    if steps > 1:
        pool = models.draft_kv
        memory = TreeKV(len(pool.k), bp, slots, pool.num_kv_heads, head.config.head_dim,
                        g.dtype, device)
    eye = torch.eye(k, dtype=torch.bool, device=device)
    for step in range(2, steps + 1):
        start = (step - 2) * k
        mask = anc.clone()
        mask[:, :, start:start + k] |= eye
        attn = TreeAttention(models.draft_kv, pages, n, memory, start, mask)
        pos = (n + step - 1)[:, None].expand(bp, k).reshape(-1)
        out = head(token.reshape(-1), feat.reshape(bp * k, -1), pos, attn)
        lp, child = _log_probs(head.compute_logits(out)).topk(k, dim=-1)
        cand = (score[:, :, None] + lp.view(bp, k, k)).reshape(bp, k * k)
        base = k + (step - 2) * k * k
        scores.append(cand)
        toks.append(child.view(bp, k * k))
        parents.append(ids[:, :, None].expand(bp, k, k).reshape(bp, k * k))
        depths.append(torch.full_like(cand, step, dtype=torch.int64))
        best = _top(cand, k)
        origin = best // k
        ids = base + best
        score = cand.gather(1, best)
        token = child.view(bp, k * k).gather(1, best)
        feat = out.view(bp, k, -1).gather(1, origin[:, :, None].expand(-1, -1, out.shape[-1]))
        anc = anc.gather(1, origin[:, :, None].expand(-1, -1, anc.shape[2]))
        anc = anc | (torch.arange(anc.shape[2], device=device)[None, None, :]
                     == (start + origin)[:, :, None])
    return round_.select(rows, torch.cat(scores, 1), torch.cat(toks, 1),
                         torch.cat(parents, 1), torch.cat(depths, 1), budget)


@pytest.mark.parametrize("steps,topk,tokens", [(3, 2, 6), (5, 4, 8), (4, 3, 12), (1, 4, 5)])
def test_draft_equals_the_one_op_per_quantity_form(pair, prompts, steps, topk, tokens) -> None:
    """Every round of a batched run (rows of different contexts, the padding row): the tree
    `draft` returns (tokens, parents, depths, mask, live) equals `_draft_reference`'s, bit for
    bit, on the same inputs."""
    engine = tree_engine(*pair, steps, topk, tokens)
    round_ = engine.worker.tree
    draft = round_.draft
    checked = []

    def spy(rows, n, pages, budget=None):
        want = _draft_reference(round_, rows, n, pages, budget)
        tree = draft(rows, n, pages, budget)
        for field in ("tokens", "parent", "depth", "mask"):
            assert torch.equal(getattr(tree, field), getattr(want, field)), field
        assert (tree.live is None) == (want.live is None)
        checked.append(rows.shape[0])
        return tree
    round_.draft = spy
    engine.generate(prompts[:5], SamplingParams(max_new_tokens=12))
    assert len(checked) >= 3


# ---- real checkpoints ----------------------------------------------------------------------------

BUNDLED = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny_pair"
FRESH_PROMPTS = [
    "def merge_intervals(spans):\n    ",
    "The lighthouse keeper wrote in her log that the storm",
    "for idx, (name, val) in enumerate(sorted(table.items())):\n",
]


def test_bundled_pair_float32_tree_equals_no_spec() -> None:
    from workers.loading import encode_prompt, load_pair

    target, head = load_pair(BUNDLED)
    prompts = [encode_prompt(p, target.config) for p in FRESH_PROMPTS]
    params = SamplingParams(max_new_tokens=40, stop_token_ids=target.config.eos_token_ids)
    reference = [r.output_ids for r in engine_for(target, None, "nospec").generate(prompts, params)]
    for steps, topk, tokens in ((3, 2, 6), (5, 4, 8)):
        out = tree_engine(target, head, steps, topk, tokens).generate(prompts, params)
        assert [r.output_ids for r in out] == reference, (steps, topk, tokens)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_transformers_checkpoint_tree_equals_generate(tmp_path: Path, kind: str) -> None:
    """A bigram target built and saved by transformers, a head drafting its bigram in SGLang's
    layout (as the parity suite makes them): greedy trees give transformers' `generate`."""
    pytest.importorskip("transformers")
    from hf_models import (bigram_target, draft_vocab, head_config, hf_generate,
                           oracle_eagle3_tensors, oracle_eagle_tensors, save_target, set_eos,
                           write_head)
    from test_hf_parity import N_NEW, PROMPTS, SPEC_CASES, choose_eos
    from workers.model import load_eagle, load_llama

    layout, fmt, head_fmt, eps = SPEC_CASES[kind]
    model, perm = bigram_target(seed=21, eps=eps)
    set_eos(model, choose_eos(model, PROMPTS))
    reference = [hf_generate(model, p, N_NEW)[0] for p in PROMPTS]
    target = load_llama(save_target(model, tmp_path / "target", "safetensors"))
    if kind == "eagle3":
        cfg = head_config("eagle3", model, 32, [0, 1, 2])
        tensors = oracle_eagle3_tensors(cfg, model, perm, draft_vocab(32, seed=3), seed=4)
    else:
        cfg = head_config("eagle", model)
        tensors = oracle_eagle_tensors(cfg, model, seed=4)
    head = load_eagle(write_head(tmp_path / "head", cfg, tensors, head_fmt, "v5"), target)
    params = SamplingParams(max_new_tokens=N_NEW, stop_token_ids=target.config.eos_token_ids)
    hist: dict[int, int] = {}
    for steps, topk, tokens in ((3, 2, 7), (4, 4, 10)):
        engine = tree_engine(target, head, steps, topk, tokens)
        assert [r.output_ids for r in engine.generate(PROMPTS, params)] == reference
        for a, v in engine.stats.accept_histogram.items():
            hist[a] = hist.get(a, 0) + v
    assert hist.get(0, 0) > 0 and sum(v for a, v in hist.items() if a >= 2) > 0, hist


# ---- refused by name -----------------------------------------------------------------------------

@pytest.mark.parametrize("changes,match", [
    (dict(speculative_eagle_topk=2), "needs --speculative-num-draft-tokens"),
    (dict(speculative_num_draft_tokens=7), "top-k 1 is the chain"),
    (dict(speculative_eagle_topk=2, speculative_num_draft_tokens=40), "verifies 2 .. 11"),
    (dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6,
          attention_backend="flashinfer"), "--attention-backend torch"),
])
def test_unsupported_trees_are_refused_by_name(changes, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(spec=load_config(None, "static", initial_steps=3), **changes)


def test_adaptive_trees_are_refused() -> None:
    with pytest.raises(ValueError, match="--adaptive and --per-request"):
        engine_config("ema", speculative_eagle_topk=2, speculative_num_draft_tokens=4)


def test_no_spec_refuses_the_tree_flags() -> None:
    from workers.settings import LaunchSettings, SpecChoice

    launch = LaunchSettings(spec=SpecChoice(no_spec=True),
                            engine=engine_config("nospec", speculative_eagle_topk=2))
    with pytest.raises(ValueError, match="not with --no-spec"):
        launch.check()


def test_processed_requests_are_refused_with_trees(pair) -> None:
    engine = tree_engine(*pair, 3, 2, 6)
    with pytest.raises(ValueError, match="not implemented with draft trees"):
        engine.add([1, 2, 3], SamplingParams(max_new_tokens=4, logprobs=2))


def test_tree_shape_is_typed() -> None:
    shape = TreeShape(3, 2, 6).round_shape(4)
    assert shape == RoundShape(3, 24, 2, 6) and shape.tree == TreeShape(3, 2, 6)
    assert shape.fits([3, 3, 3, 3]) and not shape.fits([2])
    assert RoundShape(3, 16).tree is None and RoundShape(3, 16).to_json() == {
        "draft_forwards": 3, "verify_tokens": 16}
    with pytest.raises(ValueError, match="needs topk > 1"):
        RoundShape(3, 16, 1, 4)
