"""Per-rank jobs for the DP-attention tests (module level, so spawned ranks import them).

Each rank loads its shards of one saved checkpoint (float64, so no near-tie can flip an argmax
between differently-ordered sums), builds the DP-attention layout, and runs an engine whose round
consensus spans every rank, on the prompts of its own replica.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import collectives as C
from adaptive_dist.config import AdaptiveConfig, load_config
from adaptive_dist.coordinator import RoundCoordinator
from adaptive_dist.policy import Decision
from workers.config import EngineConfig, no_spec
from workers.engine import Engine, build_engine
from workers.model import DenseCausalAttention, ModelParallel, load_eagle, load_llama
from workers.sampling import SamplingParams


def setup(dp: int, timeout: float = 30.0, scatter: str = "reduce_scatter", moe: str = "tp"):
    torch.set_num_threads(1)
    ctx = C.init_distributed(timeout_s=timeout, record=True, keep_log=True)
    layout = ctx.layout(dp=dp)
    return ctx, layout, ModelParallel.from_layout(layout, scatter, moe=moe)


def load(root: str, par: ModelParallel, dtype: torch.dtype = torch.float64):
    target = load_llama(Path(root) / "target", par=par, dtype=dtype)
    return target, load_eagle(Path(root) / "eagle", target)


# ---- the model alone --------------------------------------------------------------------------

def logits_job(rank: int, root: str, dp: int, batches: list[list[list[int]]]) -> dict:
    """This replica's batch (whole sequences, dense attention): target and draft logits, with
    each way of returning MLP outputs to the replicas."""
    ctx, layout, _ = setup(dp)
    try:
        return {scatter: _logits(root, ModelParallel.from_layout(layout, scatter), batches)
                for scatter in ("reduce_scatter", "all_reduce")}
    finally:
        ctx.shutdown()


def _logits(root: str, par: ModelParallel, batches: list[list[list[int]]]) -> dict:
    target, head = load(root, par, torch.float32)
    seqs = batches[par.replica]
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        hidden = target(ids, pos, DenseCausalAttention(lens))
        feats = head(ids, hidden, pos, DenseCausalAttention(lens))
        out = {"logits": target.compute_logits(hidden).numpy(),
               "draft": head.compute_logits(feats).numpy()}
    attn, mlp = target.model.layers[0].self_attn, target.model.layers[0].mlp
    out["shapes"] = {"q": tuple(attn.q_proj.weight.shape), "down": tuple(mlp.down_proj.weight.shape),
                     "embed": tuple(target.model.embed_tokens.weight.shape)}
    out["replica"] = par.replica
    return out


# ---- policies used to drive (or break) the engine --------------------------------------------

class ForcedSwitches(RoundCoordinator):
    """Every counted round switches to a random other tier; the random stream is seeded the same
    on every rank, so the ranks stay agreed (a stress test of switching under DP)."""

    def __init__(self, *args: Any, seed: int = 0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.rng = random.Random(seed)

    def _decide_previous(self, cols):  # noqa: ANN001 - same signature as the parent
        out = super()._decide_previous(cols)  # the normal bookkeeping (the static policy)
        if out is None:
            return None
        tiers = [s for s in self.config.candidate_steps if s != self.steps]
        old, new = self.state.index, self.config.candidate_steps.index(self.rng.choice(tiers))
        self.state = replace(self.state, index=new, last_switch=self.state.counted)
        self.stats.switches += 1
        self.stats.steps_timeline.append((self.round, self.steps))
        return replace(out, decision=Decision(True, True, None, old, new))


class ForcedShapes(RoundCoordinator):
    """Every counted round switches to a random other candidate, chains and trees alike
    (goodput's ``tree_candidates``), seeded the same on every rank: switching between trees
    and chains under DP."""

    def __init__(self, *args: Any, seed: int = 0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.rng = random.Random(seed)

    def _decide_previous(self, cols):  # noqa: ANN001 - same signature as the parent
        from adaptive_dist.policy.tree import candidate_count

        out = super()._decide_previous(cols)
        if out is None:
            return None
        old = self.state.index
        new = self.rng.choice([i for i in range(candidate_count(self.config)) if i != old])
        self.state = replace(self.state, index=new, last_switch=self.state.counted)
        self.stats.switches += 1
        self.stats.steps_timeline.append((self.round, self.steps))
        return replace(out, decision=Decision(True, True, None, old, new))


class LocalTree(RoundCoordinator):
    """The hazard: rank 1 moves to another tree (same steps, another top-k and N) on its own
    at its first decision point; every other rank follows the policy."""

    def __init__(self, *args: Any, rank: int = 0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.rank = rank

    def _decide_previous(self, cols):  # noqa: ANN001 - same signature as the parent
        from adaptive_dist.policy.tree import candidate_count

        out = super()._decide_previous(cols)
        if out is not None and self.rank == 1 and out.decision.decision_point:
            # another tree than the agreed candidate (the first tree after a chain)
            chains, idx = len(self.config.candidate_steps), self.state.index
            trees = candidate_count(self.config) - chains
            self.state = replace(self.state, index=chains + (
                (idx - chains + 1) % trees if idx >= chains else 0))
        return out


class LocalPerTree(RoundCoordinator):
    """The hazard (per-request trees): rank 1 moves, at its first counted round on a tree, to
    another tree (of the same steps where one is listed: another top-k and N) on its own; the
    other ranks follow the rule."""

    def __init__(self, *args: Any, rank: int = 0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.rank, self.strayed = rank, False

    def _decide_shape(self, cluster, plan):  # noqa: ANN001 - same signature as the parent
        out = super()._decide_shape(cluster, plan)
        chains, idx = len(self.config.candidate_steps), self.state.index
        if self.rank == 1 and not self.strayed and idx >= chains and out.decision.counted:
            trees = self.config.tree_candidates
            mine = trees[idx - chains]
            other = [j for j, t in enumerate(trees) if t[0] == mine[0] and t != mine] or \
                [j for j in range(len(trees)) if j != idx - chains]
            self.state = replace(self.state, index=chains + other[0])
            self.strayed = True
        return out


class LocalOnly(RoundCoordinator):
    """The hazard: each rank walks the ladder on its OWN EMA (the other ranks' weights are
    ignored, so the decision is the per-rank one the open proposals warn about)."""

    def _decide_previous(self, cluster):  # noqa: ANN001 - same signature as the parent
        mine = self.policy.pooled([self.ema], [self.weight], [self.ema_fail])
        return super()._decide_previous(replace(cluster, pooled=mine))


class LocalShape(RoundCoordinator):
    """The hazard: each rank picks the next round's shape from its OWN value curve (the other
    ranks' curves ignored), so ranks would run different draft forwards or verify tokens."""

    def _decide_shape(self, cluster, plan):  # noqa: ANN001 - same signature as the parent
        mine = self.rule.curve(self._survivals)
        return super()._decide_shape(replace(cluster, values_sum=mine), plan)


class Tampered(RoundCoordinator):
    """Rank-local state that differs between the ranks of one replica (its EMAs, its clock):
    per-request budgets must not read it."""

    def __init__(self, *args: Any, offset: float = 0.0, **kw: Any) -> None:
        base = time.perf_counter
        super().__init__(*args, clock=lambda: base() * (1.0 + offset), **kw)
        self.offset = offset

    def end_round(self, accepts, plan=None, shadow=None, requests=None,  # noqa: ANN001
                  shadow_rows=None) -> None:
        super().end_round(accepts, plan, shadow, requests, shadow_rows)
        self.local = replace(self.local, ema=self.local.ema + self.offset,
                             ema_fail=self.local.ema_fail * (1.0 + self.offset))


class SkipsDummy(Engine):
    """The hazard: an idle rank skips the dummy forwards of the round."""

    def _launch(self, plan, live):  # noqa: ANN001
        if not live:  # as if no rank ran requests: no forward
            plan = replace(plan, cluster_requests=0)
        return super()._launch(plan, live)


OVERLAP = "+overlap"
"""A mode's suffix that runs it with `EngineConfig.overlap`."""


def _tree(mode: str) -> tuple[int, int, int] | None:
    """A tree mode's (steps, top-k, verify tokens): "tree3k2n6" -> (3, 2, 6); else None."""
    mode = mode.removesuffix(OVERLAP)
    if not mode.startswith("tree"):
        return None
    steps, rest = mode[len("tree"):].split("k")
    topk, tokens = rest.split("n")
    return int(steps), int(topk), int(tokens)


def _spec(mode: str) -> AdaptiveConfig:
    tree = _tree(mode)
    mode = mode.removesuffix(OVERLAP)
    if mode == "nospec":
        return no_spec()
    if tree is not None:
        return load_config(None, "static", initial_steps=tree[0])
    if mode.startswith("static"):
        return load_config(None, "static", initial_steps=int(mode[len("static"):]))
    cfg = AdaptiveConfig(warmup_batches=1, update_interval=1, ema_alpha=0.5, lockstep_check_every=4)
    if mode == "forced":  # the static policy underneath: only the forced switches move the depth
        return cfg.replace(policy="static", candidate_steps=(1, 2, 3, 5, 7))
    if mode == "perrequest":   # per-request budgets on a fixed synthetic table (no timing)
        from engine_fixtures import per_request_config

        return per_request_config(per_token=0.05).replace(lockstep_check_every=4)
    if mode == "pertree":   # per-request budgets over chains and trees, the 8B table
        return tree_goodput_config().replace(per_request=True, lockstep_check_every=4)
    if mode in ("goodtree", "cycletrees"):   # goodput over chains and trees, the 8B table
        return tree_goodput_config().replace(warmup_batches=1, update_interval=1,
                                             ema_alpha=0.5, lockstep_check_every=4,
                                             switch_margin=0.0)
    if mode == "goodput":  # the cost table is measured and agreed at start-up
        # starts at depth 0 (the head's cache lags) and leaves it on the catch-up's shadow
        # checks or a probe; timed rounds move the table, the same on every rank
        return cfg.replace(policy="goodput", candidate_steps=(0, 1, 3, 7), initial_steps=0,
                           probe_every=2, cost_alpha=0.3)
    return cfg


def tree_goodput_config(trees=((3, 2, 6), (5, 4, 8), (3, 4, 8))) -> AdaptiveConfig:
    """goodput with chains 0/1/3/7 and `trees`, priced by the one-H200 8B table."""
    from pathlib import Path

    from adaptive_dist.cost_tables import load_model_costs, restrict_costs

    table, verify, _ = load_model_costs(str(Path(__file__).resolve().parents[1] / "docs" / "data"
                                            / "cost_tables" / "h200_tp1_llama3-8b.json"))
    return load_config(None, "goodput").replace(
        round_cost=restrict_costs(table, (0, 1, 3, 7)), verify_cost=verify,
        tree_candidates=[list(t) for t in trees])


def _engine(mode: str, target, head, world, guard, max_batch: int, dp: int, attn_tp: int,
            graphs: bool = False) -> Engine:
    spec, tree = _spec(mode), _tree(mode)
    overlap, mode = mode.endswith(OVERLAP), mode.removesuffix(OVERLAP)
    cfg = EngineConfig(spec=spec, max_batch_size=max_batch, page_size=4,
                       max_context_len=target.config.max_position_embeddings, dp=dp,
                       attn_tp=attn_tp, cuda_graphs=graphs, overlap=overlap,
                       device=str(next(target.parameters()).device))
    if tree is not None:
        cfg = cfg.replace(speculative_eagle_topk=tree[1], speculative_num_draft_tokens=tree[2])
    if mode == "forced":  # every tier pre-built, although the policy underneath is static
        cfg = cfg.replace(spec=spec.replace(policy="ema"))
    if mode == "goodput":  # a catch-up every 4 depth-0 rounds: shadow reports (and the probe
        cfg = cfg.replace(catchup_rounds=4)   # wait they bound, 6 points) fit the short runs
    engine = build_engine(cfg, target, head, group=world, guard=guard)
    if mode == "forced":
        engine.planner = ForcedSwitches(spec, world, guard=guard, seed=11)
    if mode == "cycletrees":
        engine.planner = ForcedShapes(engine.config.spec, world, guard=guard, seed=11,
                                      verify_ladder=cfg.verify_ladder)
    return engine


def generate_job(rank: int, root: str, dp: int, modes: list[str], prompts: list[list[list[int]]],
                 new_tokens: list[list[int]], temperature: float = 0.0, seed: int = 0,
                 graphs: bool = False, moe: str = "tp") -> dict:
    """Run every mode on this replica's prompts (`prompts[replica]`); return outputs, decisions
    and this rank's collective log (signatures) per mode (`moe`: how a MoE target's experts
    split)."""
    ctx, layout, par = setup(dp, moe=moe)
    try:
        # NCCL ranks run on their GPU; gloo ranks on the CPU (graphs emulated there)
        device = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
        target, head = load(root, par)
        target, head = target.to(device), head.to(device)
        world = layout.group("world")
        out: dict[str, Any] = {"replica": par.replica}
        for mode in modes:
            guard = ctx.guard(world, check_every=4)
            start = ctx.recorder.count
            engine = _engine(mode, target, head, world, guard, max_batch=4, dp=dp,
                             attn_tp=layout.attn_tp, graphs=graphs)
            captured = engine.worker.graphs.num_captures if graphs else 0
            mine = prompts[par.replica]
            params = [SamplingParams(temperature=temperature, max_new_tokens=n)
                      for n in new_tokens[par.replica]]
            reqs = engine.generate(mine, params, seeds=[seed + 1_000_000 * par.replica + i
                                                        for i in range(len(mine))])
            guard.check(engine.planner.round, engine.planner.decision_digest())
            captures_after = engine.worker.graphs.num_captures if graphs else 0
            engine.close()
            guard.close()
            out[mode] = {"outputs": [r.output_ids for r in reqs],
                         "timeline": engine.planner.stats.steps_timeline,
                         "digest": engine.planner.decision_digest(),
                         "rounds": engine.planner.round, "busy_rounds": engine.stats.rounds,
                         "switches": engine.planner.stats.switches,
                         "hist": dict(engine.stats.accept_histogram),
                         "graph_rounds": engine.stats.graph_rounds,
                         "captures": [captured, captures_after],
                         "round_cost": engine.planner.config.to_dict().get("round_cost"),
                         "shapes": sorted(engine.planner.stats.rounds_at_shape),
                         "draft_tokens": engine.planner.stats.draft_tokens,
                         "drafts": engine.planner.stats.drafts,
                         "log": [e.signature() for e in ctx.recorder.log[start:]]}
        return out
    finally:
        ctx.shutdown()


def budgets_job(rank: int, root: str, prompts: list[list[list[int]]],
                new_tokens: list[list[int]], log_dir: str) -> dict:
    """Per-request budgets on dp 1 x attn-tp 2 (one replica over two ranks) with each rank's
    local state (EMAs, clock) made different: every rank's round log and outputs."""
    from workers.round_log import RoundLog

    ctx, layout, par = setup(1)
    try:
        world = layout.group("world")
        guard = ctx.guard(world, check_every=4)
        target, head = load(root, par)
        spec = _spec("perrequest")
        cfg = EngineConfig(spec=spec, max_batch_size=4, page_size=4, dp=1, attn_tp=2,
                           max_context_len=target.config.max_position_embeddings)
        engine = build_engine(cfg, target, head, group=world, guard=guard)
        engine.planner = Tampered(spec, world, guard=guard, offset=0.37 * rank,
                                  verify_ladder=cfg.verify_ladder)
        path = f"{log_dir}/rank{rank}.jsonl"
        engine.round_log = RoundLog(path, rank)
        reqs = engine.generate(prompts[0], [SamplingParams(max_new_tokens=n)
                                            for n in new_tokens[0]])
        engine.round_log.close()
        guard.check(engine.planner.round, engine.planner.decision_digest())
        engine.close()
        guard.close()
        return {"outputs": [r.output_ids for r in reqs], "ema": engine.planner.ema,
                "log": [{k: v for k, v in json.loads(line).items() if k != "rank"}
                        for line in open(path)]}
    finally:
        ctx.shutdown()


def hazard_job(rank: int, root: str, hazard: str, prompts: list[list[list[int]]],
               new_tokens: list[list[int]], timeout: float = 4.0) -> dict:
    """`local_only`: ranks decide their depth alone; `local_shape`: ranks pick the next round's
    shape (per-request budgets) from their own value curve alone; `skip_dummy`: an idle rank
    skips its dummy forwards. Returns what was raised and how long it took (the harness bounds the wait)."""
    import time

    ctx, layout, par = setup(2, timeout=timeout)
    world = layout.group("world")
    guard = ctx.guard(world, check_every=16)
    guard.exit_on_watchdog = False
    target, head = load(root, par)
    spec = _spec({"local_shape": "perrequest", "local_tree": "goodtree",
                  "local_pertree": "pertree"}.get(hazard, "ema"))
    cfg = EngineConfig(spec=spec, max_batch_size=4, page_size=4, dp=2, attn_tp=layout.attn_tp,
                       max_context_len=target.config.max_position_embeddings)
    engine = build_engine(cfg, target, head, group=world, guard=guard)
    if hazard == "local_only":
        engine.planner = LocalOnly(spec, world, guard=guard)
    elif hazard == "local_shape":
        engine.planner = LocalShape(spec, world, guard=guard, verify_ladder=cfg.verify_ladder)
    elif hazard == "skip_dummy":
        engine = SkipsDummy(cfg, engine.worker, engine.scheduler, engine.planner, guard)
    elif hazard == "local_tree":
        engine.planner = LocalTree(engine.config.spec, world, guard=guard, rank=rank,
                                   verify_ladder=cfg.verify_ladder)
    elif hazard == "local_pertree":
        engine.planner = LocalPerTree(engine.config.spec, world, guard=guard, rank=rank,
                                      verify_ladder=cfg.verify_ladder)
    t0 = time.monotonic()
    try:
        mine = prompts[par.replica]
        engine.generate(mine, [SamplingParams(max_new_tokens=n) for n in new_tokens[par.replica]])
        return {"raised": None, "elapsed": time.monotonic() - t0}
    except (C.DivergenceError, C.CollectiveTimeoutError) as exc:
        return {"raised": type(exc).__name__, "message": str(exc),
                "elapsed": time.monotonic() - t0}
    finally:
        guard.close()
        ctx.shutdown(aborted=True)


def tree_hazard_job(rank: int, root: str, trees: list[tuple[int, int]]) -> dict:
    """Each rank builds a tree engine of its own (top-k, verify tokens) = `trees[rank]` at 3
    steps over dp 2: what was raised, where, and how long it took."""
    from adaptive_dist.startup import ConfigMismatchError

    ctx, layout, par = setup(2, timeout=4.0)
    world = layout.group("world")
    target, head = load(root, par)
    topk, tokens = trees[rank]
    cfg = EngineConfig(spec=load_config(None, "static", initial_steps=3), max_batch_size=4,
                       page_size=4, dp=2, attn_tp=layout.attn_tp,
                       max_context_len=target.config.max_position_embeddings,
                       speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)
    t0, start = time.monotonic(), ctx.recorder.count
    try:
        build_engine(cfg, target, head, group=world)
        return {"raised": None}
    except ConfigMismatchError as exc:
        return {"raised": type(exc).__name__, "message": str(exc),
                "elapsed": time.monotonic() - t0,
                "device_collectives": ctx.recorder.count - start}
    finally:
        ctx.shutdown(aborted=True)
