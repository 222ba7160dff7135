"""Round cost at production shapes without a download: a Llama-3.1-8B-shaped target (or a
Qwen3-30B-A3B-shaped MoE target, `--shape qwen3-30b-a3b`) and an EAGLE-3-shaped head with random
weights, generated on the GPU in bfloat16.

    python -m scripts.bench.model_shapes --layout tp1 --out OUT            # one GPU
    python -m scripts.bench.model_shapes --layout tp1 --shape qwen3-30b-a3b --out OUT
    torchrun --nproc-per-node 2 -m scripts.bench.model_shapes --layout tp2 --out OUT
    torchrun --nproc-per-node 2 -m scripts.bench.model_shapes --layout dp2 --out OUT

`tp1`: one GPU; `tp2`: one replica, attention and MLP tensor-parallel over both GPUs; `dp2`: DP attention, two
replicas (attention data-parallel, MLP and vocabulary tensor-parallel over both GPUs). The engine
is built as `--adaptive --policy goodput` builds it (CUDA graphs for every depth and batch bucket,
candidates 0/1/3/7): at start-up every rank measures one round per depth and bucket (dummy rows,
graph replays, median of 5) and the ranks agree the table (element-wise maximum). This script
reports that agreed table (milliseconds per round: what the policy weighs depths with at this
size), then profiles 10 replays of every (depth, bucket) round, the ranks in step: GPU busy = GPU
kernel time per round over the agreed round cost (NCCL kernels count as busy). The weights are random, so acceptance means nothing here: the
numbers are costs, not tokens/s. Writes `OUT/<layout>.json` and `OUT/<layout>.png` (with another
`--shape`: `OUT/<layout>_<shape>.*`).

`--routing` (one rank, a MoE shape) then counts the distinct experts each MoE layer routes in
one eager round at batch 1, 8 and 64 (`--routing-batches`) and depth `--routing-depth`, three
ways: the start-up measurement's round (`workers.worker.round_cost.TrafficRows`), the all-dummy
round it ran before them (every row the same inputs: `top_k` experts), and a round of as many
requests of random prompts, prefilled (random weights: the nearest to traffic this shape has);
printed per batch (mean, min, max over the layers) and kept per layer in the JSON's `routing`.

`--cost-context C [C ...]` measures the cost model's other terms on the built engine
(`adaptive_dist.cost_tables`, docs/policy.md "The cost model"): the packed verify forward per
token rung with every row holding C cached positions (the context term), and the prefills of
`workers.worker.round_cost.prefill_shapes` (the narrowest width at every rows bucket, one row
at every wider width, more rows at the widest, `--ragged-prefills` token counts of the ragged
path), from which the prefill term is fitted; the JSON then holds them under the keys a
cost table file has (`agreed_verify_cost_ms_at_context`, `prefill_cost_ms`,
`prefill_ms_per_million_positions`) with the samples and the seconds each measurement took.

`--schedule N` then checks the cost model (one rank): N requests of mixed prompt lengths arrive
in a server's order (a few per round, at most `--max-batch` running) and run with per-request
budgets and overlap on, every engine step timed. A step waits for the round launched by the step
before, so each plan is charged the next step's time. Every round is priced by the model (its
decode part at the KV positions its verify tokens read and the context of its longest row, its
prefill by slots and prompt positions; a term not measured is priced at its base and named) and
by the decode table alone; measured / predicted is reported per kind (decode, prefill, mixed)
and over all, with the served tokens/s the model predicts for the schedule beside the measured.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import collectives as C
from adaptive_dist.config import AdaptiveConfig
from scripts.bench.common import build, pyplot, random_pair, save, write_json
from workers.model import ModelParallel
from workers.worker.graph_table import GraphPhase

TIERS = (0, 1, 3, 7)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=("tp1", "tp2", "dp2"))
    p.add_argument("--shape", choices=("llama3-8b", "qwen3-30b-a3b"), default="llama3-8b")
    p.add_argument("--moe-parallel", choices=("tp", "ep"), default="tp",
                   help="a MoE shape's experts over the ranks (see --moe-parallel of generate)")
    p.add_argument("--reanalyse", nargs="+", metavar="JSON", help="recompute a finished run's "
                   "GPU busy shares (kernel time over the agreed cost) and plot")
    p.add_argument("--reprice", nargs="+", metavar=("RUN", "TABLE"),
                   help="price a finished --schedule run's rounds again by the cost model of "
                        "TABLE (a cost table file; default the run's own terms) and print "
                        "measured / predicted per kind")
    p.add_argument("--copy-terms", nargs=2, metavar=("RUN", "TABLE"),
                   help="copy the cost model's terms a --cost-context run measured (RUN, its "
                        "JSON) into the cost table file TABLE, beside its decode tables")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--schedule", type=int, default=0, metavar="N",
                   help="then time N requests' rounds against the table's prices (one rank)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled replays")
    p.add_argument("--schedule-profile", action="store_true",
                   help="profile rounds 150..170 of --schedule (kernel time, costliest kernels; "
                        "the profiler slows those rounds' host side)")
    p.add_argument("--cost-context", type=int, nargs="+", default=[], metavar="C",
                   help="also measure the cost model's context term (the verify forward per "
                        "rung with every row holding C cached positions, each C) and its "
                        "prefill term; the JSON then holds them as a cost table file does, and "
                        "--schedule prices with them")
    p.add_argument("--ragged-prefills", type=int, nargs="*", default=[8192, 16384], metavar="T",
                   help="token counts of the ragged prefill path measured with --cost-context "
                        "(those above --padded-prefill-tokens; default: 8192 16384)")
    p.add_argument("--routing", action="store_true",
                   help="then count the distinct experts per MoE layer: measurement, dummy and "
                        "real rounds (one rank, a MoE shape)")
    p.add_argument("--routing-batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--routing-depth", type=int, default=0, choices=TIERS)
    p.add_argument("--tiny", action="store_true",
                   help="a small model of the same layout on the CPU (a smoke test of this script)")
    p.add_argument("--out", default="runs/bench_model_shapes")
    return p.parse_args()


def shaped_pair(par: ModelParallel, device: torch.device, seed: int, tiny: bool = False,
                shape: str = "llama3-8b") -> tuple[Any, Any]:
    """The `shape` target and its EAGLE-3 head (`scripts.gen.make_checkpoint`'s shapes), random
    bf16 weights made on `device`; `tiny`: a small model of the same kind."""
    if tiny:
        shape = "tiny-moe" if shape == "qwen3-30b-a3b" else "tiny"
    target, head = random_pair(shape, "eagle3", device, par=par, seed=seed)
    target.reset_buffers()
    head.reset_buffers()
    return target.eval(), head.eval()


def profile_rounds(engine: Any, replays: int, buckets: list[int],
                   barrier: Any) -> dict[str, dict[str, dict[str, float]]]:
    """Per bucket and depth: GPU kernel ms per round (profiled) and wall ms per round (not
    profiled) over `replays` rounds. `barrier()` lines the ranks up before each loop, so no rank
    times its rounds while another still runs under the profiler (their collectives couple
    them)."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, dict[str, dict[str, float]]] = {}
    worker = engine.worker
    cuda = worker.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for bucket in buckets:
        graph = bucket if worker.buckets else None
        for steps in TIERS:
            engine.pool.apply(steps)
            worker.spec_round([], bucket, graph)  # warm
            sync()
            barrier()
            start = time.perf_counter()
            with profile(activities=acts) as prof:
                for _ in range(replays):
                    worker.spec_round([], bucket, graph)
                sync()
            wall = time.perf_counter() - start
            kernel_us = sum(e.device_time if hasattr(e, "device_time") else e.cuda_time
                            for e in prof.events()
                            if e.device_type == torch.autograd.DeviceType.CUDA)
            # the unprofiled round time (the profiler slows the host)
            sync()
            barrier()
            t0 = time.perf_counter()
            for _ in range(replays):
                worker.spec_round([], bucket, graph)
            sync()
            round_ms = 1000 * (time.perf_counter() - t0) / replays
            out.setdefault(str(bucket), {})[str(steps)] = {
                "round_ms": round_ms, "gpu_kernel_ms": kernel_us / 1000 / replays,
                "profiled_wall_ms": 1000 * wall / replays}
    engine.pool.apply(engine.config.spec.initial_steps)
    return out


def main() -> int:
    args = parse_args()
    if args.reanalyse:  # recompute the busy shares and the plot of a finished run
        for name in args.reanalyse:
            finish(json.loads(Path(name).read_text()), Path(name))
        return 0
    if args.reprice:
        if len(args.reprice) > 2:
            raise SystemExit("--reprice RUN [TABLE]: at most two files")
        reprice(Path(args.reprice[0]), args.reprice[1] if len(args.reprice) > 1 else None)
        return 0
    if args.copy_terms:
        copy_terms(Path(args.copy_terms[0]), Path(args.copy_terms[1]))
        return 0
    if args.layout is None:
        raise SystemExit("bench_model_shapes: --layout tp1|tp2|dp2 is required (or --reanalyse)")
    ctx = C.init_distributed(timeout_s=600, backend="gloo" if args.tiny else None)
    want = 1 if args.layout == "tp1" else 2
    if ctx.world_size != want:
        raise SystemExit(f"bench_model_shapes: --layout {args.layout} runs on {want} rank(s); "
                         f"this launch has {ctx.world_size}")
    layout = ctx.layout(dp=2 if args.layout == "dp2" else 1)
    world = layout.group("world")
    par = ModelParallel.from_layout(layout, moe=args.moe_parallel)
    device = torch.device("cpu") if args.tiny else ctx.device
    if not args.tiny and device.type != "cuda" and torch.cuda.is_available():
        device = torch.device("cuda", 0)    # one process without torchrun: the first GPU
    t0 = time.perf_counter()
    target, head = shaped_pair(par, device, seed=1234 + ctx.rank, tiny=args.tiny,
                               shape=args.shape)
    spec = AdaptiveConfig(policy="goodput", candidate_steps=TIERS, initial_steps=1,
                          per_request=True)
    if ctx.rank == 0:
        print(f"[{args.layout}] weights ready in {time.perf_counter() - t0:.0f} s; building the "
              f"engine (graphs for depths {TIERS}, buckets up to {args.max_batch}) ...", flush=True)
    t1 = time.perf_counter()
    engine = build(spec, target, head, batch=args.max_batch, context=args.context,
                   device=str(device), graphs=device.type == "cuda", group=world, dp=layout.dp,
                   attn_tp=layout.attn_tp, overlap=device.type == "cuda")
    build_s = time.perf_counter() - t1
    agreed = engine.config.spec.round_cost.to_json()
    verify = engine.config.spec.verify_cost
    graph_bytes = engine.worker.graphs.pool_bytes() if engine.worker.graphs is not None else 0
    table = engine.worker.table   # the round's captures (not the padded prefill's)
    captures = len(table) - len(table.of(GraphPhase.PREFILL)) if table is not None else 0
    if ctx.rank == 0:
        print(f"[{args.layout}] engine built in {build_s:.0f} s; profiling ...", flush=True)
    import torch.distributed as dist

    barrier = ((lambda: dist.barrier(group=world.control_pg)) if world.size > 1
               else (lambda: None))
    rounds = ({} if args.no_profile else
              profile_rounds(engine, args.replays, sorted(int(b) for b in agreed), barrier))
    terms = (measure_cost_terms(engine, args.cost_context, args.ragged_prefills)
             if args.cost_context else None)
    model = None
    if world.size == 1:
        from adaptive_dist.cost_tables import CostModel

        model = CostModel(engine.config.spec.round_cost, verify,
                          terms["context"] if terms else None,
                          terms["prefill"] if terms else None,
                          catchup=terms["catchup"] if terms else None)
    schedule = (check_schedule(engine, args.schedule, args.context, target.config.vocab_size,
                               model, args.schedule_profile)
                if args.schedule and world.size == 1 else None)
    routing = (routing_check(engine, args.routing_batches, args.routing_depth, args.context,
                             target.config.vocab_size)
               if args.routing and world.size == 1 else None)
    parts: list[Any] = [rounds]
    if world.size > 1:
        parts = [None] * world.size
        dist.all_gather_object(parts, rounds, group=world.control_pg)
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    engine.close()
    if ctx.rank == 0:
        name = {"llama3-8b": "Llama-3.1-8B", "qwen3-30b-a3b": "Qwen3-30B-A3B"}[args.shape]
        result = {"layout": args.layout, "dp": layout.dp, "attn_tp": layout.attn_tp,
                  "shape": args.shape, "moe_parallel": args.moe_parallel,
                  "model": f"{name}-shaped target + EAGLE-3-shaped head, random bf16 weights",
                  "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                  "torch": torch.__version__, "tiny": args.tiny,
                  "max_batch": args.max_batch, "context": args.context,
                  "build_seconds": build_s, "max_memory_gib_rank0": mem,
                  "agreed_round_cost_ms": {b: {s: 1000 * v for s, v in row.items()}
                                           for b, row in agreed.items()},
                  "agreed_verify_cost_ms": {str(t): 1000 * c for t, c in
                                            zip(verify.tokens, verify.costs)},
                  "graph_captures": captures, "graph_pool_gib": graph_bytes / 2**30,
                  **(cost_terms_json(terms) if terms else {}),
                  "schedule_check": schedule, "routing": routing,
                  "rounds_per_rank": parts, "command": " ".join(sys.argv)}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = args.layout if args.shape == "llama3-8b" else f"{args.layout}_{args.shape}"
        finish(result, out / f"{stem}.json")
    ctx.shutdown()
    return 0


def routing_check(engine: Any, batches: list[int], depth: int, context: int,
                  vocab: int) -> dict[str, Any]:
    """`--routing`: per batch, the distinct experts per MoE layer of one eager round at `depth`
    (the measurement's rows reading `context // 2` positions; the all-dummy rows; `batch`
    requests of random prompts of 16 .. 64 tokens, prefilled, then retired)."""
    import random

    from workers.sampling import SamplingParams
    from workers.worker.round_cost import measurement_routing, round_routing

    if engine.worker.models.target.config.moe is None:
        raise SystemExit("bench_model_shapes: --routing needs a MoE shape")
    rng = random.Random(36)
    worker, out = engine.worker, {"depth": depth, "batches": {}}

    def summary(counts: list[int]) -> str:
        return f"mean {sum(counts) / len(counts):6.1f} min {min(counts):4d} max {max(counts):4d}"

    for batch in batches:
        if batch > engine.config.max_batch_size:
            raise SystemExit(f"bench_model_shapes: --routing-batches {batch} > --max-batch")
        engine.pool.apply(depth)
        dummy = measurement_routing(worker, batch, context // 2, dummy=True)
        measured = measurement_routing(worker, batch, context // 2)
        reqs = [engine.add([rng.randrange(vocab) for _ in range(rng.randint(16, 64))],
                           SamplingParams(max_new_tokens=8)) for _ in range(batch)]
        admitted = engine.scheduler.admit()
        assert admitted == reqs, "the routing check runs on an idle engine"
        worker.prefill(admitted, sum(len(r.prompt_ids) for r in admitted), len(admitted))
        real = round_routing(worker, admitted, batch)
        for req in admitted:
            engine.abort(req.rid)
        engine.scheduler.retire()
        out["batches"][str(batch)] = {"measured": measured, "dummy": dummy, "real": real}
        print(f"== routing, batch {batch}, depth {depth}: distinct experts per MoE layer "
              f"(of {engine.worker.models.target.config.moe.num_experts})\n"
              f"   measurement {summary(measured)}\n   real        {summary(real)}\n"
              f"   all-dummy   {summary(dummy)}", flush=True)
    engine.pool.apply(engine.config.spec.initial_steps)
    return out


PROFILE_AT = (150, 170)
"""The schedule's rounds profiled (kernel time and the costliest kernels): past the arrivals."""

KINDS = ("decode", "prefill", "mixed")
"""A scheduled round's kind: decode only; a prefill whose round runs only the requests it
admitted; a prefill beside requests already decoding."""


def measure_cost_terms(engine: Any, contexts: list[int], ragged: list[int],
                       repeats: int = 3) -> dict[str, Any]:
    """The cost model's context and prefill terms on this engine (`--cost-context`):
    the verify forward per rung at 0 (the term's own base) and each of `contexts` cached
    positions, the prefills of
    `workers.worker.round_cost.prefill_shapes` (`ragged`: token counts of the ragged path) and
    the prefill term fitted from them; the seconds each took."""
    from adaptive_dist.config import VerifyCost
    from adaptive_dist.cost_tables import ContextTerm, fit_prefill
    from workers.worker.round_cost import measure_prefills, measure_target_contexts

    from adaptive_dist.cost_tables import CatchupTerm
    from workers.worker.round_cost import measure_catchups

    worker = engine.worker
    t0 = time.perf_counter()
    at = measure_target_contexts(worker, worker.ladder, [0, *contexts], repeats)
    t1 = time.perf_counter()
    samples = measure_prefills(worker, repeats, ragged, graphs=worker.graphs is not None)
    t2 = time.perf_counter()
    buckets = worker.buckets or tuple(b for b in engine.config.spec.graph_buckets
                                      if b <= engine.config.max_batch_size) or (1,)
    caught = measure_catchups(worker, engine.pool, buckets, [0, *contexts],
                              graphs=bool(worker.buckets), repeats=repeats)
    engine.pool.apply(engine.config.spec.initial_steps)
    t3 = time.perf_counter()
    # the engine's own table (start-up) was measured with rows holding no cached positions
    catchup = CatchupTerm.parse({str(c): {str(b): 1e3 * v for b, v in row.items()}
                                 for c, row in caught.items()},
                                worker.lag.catchup_every, 0) if caught else None
    context = ContextTerm.parse({str(c): VerifyCost.parse({str(t): v for t, v in row.items()})
                                 for c, row in at.items()}) if at else None
    prefill = fit_prefill([(x.slots, x.positions, x.seconds) for x in samples])
    print(f"== cost model terms: the verify forward at contexts {sorted(at)} in {t1 - t0:.1f} s, "
          f"{len(samples)} prefill shapes in {t2 - t1:.1f} s; prefill ms by slots "
          + json.dumps({s: round(1e3 * c, 3) for s, c in zip(prefill.slots, prefill.costs)})
          + f", attention {1e9 * (prefill.per_position or 0):.3f} ms per million positions"
          + (f"; the catch-up at contexts {sorted(caught)} in {t3 - t2:.1f} s, ms by bucket "
             + json.dumps({c: {b: round(1e3 * v, 3) for b, v in row.items()}
                           for c, row in caught.items()}) if caught else ""), flush=True)
    return {"context": context, "prefill": prefill, "catchup": catchup,
            "context_seconds": t1 - t0, "prefill_seconds": t2 - t1,
            "catchup_seconds": t3 - t2, "prefill_samples": [x.as_json() for x in samples]}


def cost_terms_json(terms: dict[str, Any]) -> dict[str, Any]:
    """The measured terms as a cost table file holds them (`adaptive_dist.cost_tables`:
    milliseconds), with the prefill samples and what each measurement took."""
    from adaptive_dist.cost_tables import CONTEXT_KEY

    out: dict[str, Any] = {}
    if terms["context"] is not None:
        out[CONTEXT_KEY] = {c: {t: 1e3 * v for t, v in row.items()}
                            for c, row in terms["context"].to_json().items()}
    out.update(terms["prefill"].to_json())
    if terms.get("catchup") is not None:
        from adaptive_dist.cost_tables import COST_MODEL_VERSION, VERSION_KEY

        out[VERSION_KEY] = COST_MODEL_VERSION
        out.update(terms["catchup"].to_json())
    out["prefill_samples"] = terms["prefill_samples"]
    out["cost_terms_seconds"] = {"context": terms["context_seconds"],
                                 "prefill": terms["prefill_seconds"],
                                 "catchup": terms.get("catchup_seconds")}
    return out


TERM_KEYS = ("agreed_verify_cost_ms_at_context", "prefill_cost_ms",
             "prefill_ms_per_million_positions", "catchup_cost_ms_at_context", "catchup_rounds",
             "catchup_table_context", "cost_model_version", "prefill_samples",
             "cost_terms_seconds")
"""What `--copy-terms` copies (all but the last two are what `adaptive_dist.cost_tables`
reads; a run without the catch-up term leaves a table's version as it was)."""


def copy_terms(run: Path, table: Path) -> None:
    """`--copy-terms`: the cost model's terms of `run` into `table` (its other keys kept), with
    the run's command as `cost_terms_command`."""
    data, into = json.loads(run.read_text()), json.loads(table.read_text())
    if "prefill_cost_ms" not in data:
        raise SystemExit(f"--copy-terms: {run} has no cost model terms (run model_shapes with "
                         f"--cost-context)")
    differ = [k for k in ("layout", "shape", "gpu", "tiny", "max_batch", "context")
              if k in data and k in into and data[k] != into[k]]
    if differ:
        raise SystemExit(f"--copy-terms: {run} was measured with other "
                         + ", ".join(f"{k} ({data[k]!r}, the table {into[k]!r})" for k in differ))
    for key in TERM_KEYS:
        if key == "cost_model_version" and key not in data:
            continue   # a run without the catch-up term: the table's version as it was
        into.pop(key, None)
        if key in data:
            into[key] = data[key]
    into["cost_terms_command"] = data.get("command")
    write_json(table, into)
    print(f"copied {', '.join(k for k in TERM_KEYS if k in data)} from {run} into {table}")


def prefill_size(engine: Any, plan: Any, lengths: list[int]) -> tuple[int, int]:
    """(token slots, KV positions read) of a plan's prefill of prompts of `lengths`: on the
    padded path rows bucket x width bucket, every slot attending its row causally; on the ragged
    path the agreed token count, each prompt attending itself."""
    from adaptive_dist.cost_tables import causal_positions
    from workers.worker.round_cost import padded_positions

    shape = engine.worker.prefill_runner.shape(plan.extend_requests, plan.extend_width)
    if shape is not None:
        return shape[0] * shape[1], padded_positions(*shape)
    return plan.extend_tokens, causal_positions(lengths)


def served_prediction(kinds: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Tokens/s over the schedule: `tokens` (every output token) over the sum of every round's
    price, prefills included (`predicted`), over the sum without the prefill term and the
    context term (`base`: the decode table alone), and as measured."""
    def per_s(key: str) -> float | None:
        total = sum(kinds[k][key] for k in KINDS if k in kinds)
        return tokens / total if total else None
    return {"output_tokens": tokens, "measured_tokens_per_s": per_s("measured_s"),
            "predicted_tokens_per_s": per_s("predicted_s"),
            "base_tokens_per_s": per_s("base_s")}


def schedule_requests(n: int, context: int, vocab: int) -> tuple[Any, list[tuple[list[int], int]]]:
    """`--schedule`'s requests, (prompt ids, output tokens) in the order they are created (the
    last arrives first), and the generator that then draws the arrivals per step (seed 7)."""
    import random

    rng = random.Random(7)
    lengths = [p for p in (16, 64, 200, 512) if p + 256 <= context] or [8]
    outputs = [o for o in (32, 64, 128, 256) if max(lengths) + o <= context] or [8]
    return rng, [([rng.randrange(vocab) for _ in range(rng.choice(lengths))], rng.choice(outputs))
                 for _ in range(n)]


def replay_contexts(rounds: list[dict[str, Any]], n: int, context: int,
                    vocab: int) -> list[int]:
    """The longest row's context in each of a finished `--schedule` run's `rounds` (a run
    recorded before `longest_context` was): its requests replayed in their arrival order, each
    round's prefill taking the next prompts its `prefill_tokens` hold, every running request
    growing one token a round and leaving at its output length (depth 0, or nothing accepted:
    a random head). Checked against every round at depth 0: its request count must be the
    recorded one and the KV positions its verify tokens read within one per request of the
    recorded (a request's length is read before the round in flight commits its token, and a
    draft accepted at depth > 0 is not replayed), else ValueError naming the round (the replay
    does not hold for that run)."""
    _, pending = schedule_requests(n, context, vocab)
    prompts = [len(ids) for ids, _ in reversed(pending)]   # in arrival order
    outs = [out for _, out in reversed(pending)]
    running: list[list[int]] = []   # [context, tokens generated, output length]
    longest = []
    for i, r in enumerate(rounds):
        running = [q for q in running if q[1] < q[2]]
        fresh, tokens = [], 0
        while tokens < r["prefill_tokens"] and prompts:
            fresh.append([prompts[0], 0, outs[0]])
            tokens += prompts.pop(0)
            outs.pop(0)
        rows = running + fresh
        if tokens != r["prefill_tokens"] or (r["steps"] == 0 and (
                len(rows) != r["requests"]
                or abs(sum(q[0] for q in rows) - r["positions_read"]) > len(rows))):
            raise ValueError(f"round {i}: the replay gives {len(rows)} requests reading "
                             f"{sum(q[0] for q in rows)} positions, prefilling {tokens} tokens; "
                             f"the run recorded {r['requests']}, {r['positions_read']}, "
                             f"{r['prefill_tokens']}")
        longest.append(max((q[0] for q in rows), default=0))
        for q in rows:
            q[0] += 1
            q[1] += 1
        running = rows
    return longest


def reprice(path: Path, table: str | None = None) -> dict[str, Any]:
    """`--reprice`: a finished `--schedule` run's rounds priced again by the cost model of
    `table` (a cost table file; default the run's own terms and tables), the longest row's
    context replayed where the run did not record it (`replay_contexts`). Returns and prints
    measured / predicted per kind, as the run did."""
    from adaptive_dist.cost_tables import cost_model

    data = json.loads(path.read_text())
    check = data.get("schedule_check")
    if not check or not check.get("rounds"):
        raise SystemExit(f"--reprice: {path} holds no --schedule rounds")
    model = cost_model(table or str(path))
    rounds = [dict(r) for r in check["rounds"]]
    if any("longest_context" not in r for r in rounds):
        n = int(data["command"].split("--schedule")[1].split()[0])
        from scripts.gen.make_checkpoint import SHAPES

        shape = data["shape"] if not data.get("tiny") else (
            "tiny-moe" if data["shape"] == "qwen3-30b-a3b" else "tiny")
        vocab = SHAPES[shape]["vocab_size"]
        for r, c in zip(rounds, replay_contexts(rounds, n, data["context"], vocab)):
            r["longest_context"] = c
    kinds: dict[str, Any] = {}
    for r in rounds:
        decode = model.round_seconds(r["steps"], r["tokens"], r["batch"], r["positions_read"],
                                     r["verify_tokens_real"], r["longest_context"],
                                     catchup=r.get("catchup"))
        pre = (model.prefill_seconds(r["prefill_slots"], r["prefill_positions"])
               if r["prefill_slots"] else 0.0)
        for kind in (r["kind"], "all"):
            k = kinds.setdefault(kind, {"rounds": 0, "measured_s": 0.0, "predicted_s": 0.0})
            k["rounds"] += 1
            k["measured_s"] += r["seconds"]
            k["predicted_s"] += decode + pre
    print(f"== {path}: measured / predicted, repriced by {table or 'its own terms'}")
    for kind in KINDS + ("all",):
        k = kinds.get(kind)
        if k:
            k["measured_over_predicted"] = k["measured_s"] / k["predicted_s"]
            print(f"   {kind:8s} {k['rounds']:4d} rounds  measured {1e3 * k['measured_s']:9.1f} "
                  f"ms  predicted {1e3 * k['predicted_s']:9.1f} ms  "
                  f"x{k['measured_over_predicted']:.3f}", flush=True)
    return kinds


def check_schedule(engine: Any, n: int, context: int, vocab: int,
                   model: Any = None, profile_rounds: bool = False) -> dict[str, Any]:
    """`--schedule`: `n` requests (prompts of 16 .. 512 tokens, outputs of 32 .. 256) admitted
    a few per round, every engine step timed. With overlap an engine step launches its prefill
    and round and then waits for the round launched by the step before, so a step's time is
    (when the device is the bottleneck) the device time of the previous step's prefill and round:
    each plan is charged the next step's time (the last one the final drain's). Per kind
    (`KINDS`) the measured seconds against the cost model's (`model`, an
    `adaptive_dist.cost_tables.CostModel`; default the engine's own tables): `predicted` with
    every term the model has (the context its verify tokens read, its prefill), `base` with the
    decode table alone. Every round is kept (its time, the time the host waited for the device,
    both prices, shape, batch, the KV positions its verify tokens read, its longest row's
    context, whether it ran the draft cache's catch-up and the deferred prompts' forward width,
    priced by the model's catch-up term where it has one, its prefill's slots and positions);
    `served` is the tokens/s each way
    (`served_prediction`). `profile_rounds`: rounds `PROFILE_AT` under the torch profiler (their
    kernels kept in `profiled`)."""
    from adaptive_dist.cost_tables import CostModel
    from workers.sampling import SamplingParams

    spec = engine.config.spec
    model = model if model is not None else CostModel(spec.round_cost, spec.verify_cost)
    worker = engine.worker
    cuda = worker.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng, pending = schedule_requests(n, context, vocab)
    waited = [0.0]
    collect = worker.collect

    def timed_collect(launched: Any) -> Any:
        if launched.done is not None:
            t = time.perf_counter()
            launched.done.synchronize()
            waited[0] += time.perf_counter() - t
        return collect(launched)
    worker.collect = timed_collect
    launch = worker.launch
    ran = [None]   # the last launched round's handle (whether it ran a catch-up)

    def noted_launch(*args: Any, **kw: Any) -> Any:
        ran[0] = launch(*args, **kw)
        return ran[0]
    worker.launch = noted_launch
    rounds: list[dict[str, Any]] = []
    steps: list[float] = []      # every step's wall time, charged to the plan before it
    profiled: dict[str, Any] = {}
    prof = None
    added: list[Any] = []
    sync()
    last = time.perf_counter()
    while pending or engine.scheduler.has_work:
        if profile_rounds and cuda and len(rounds) == PROFILE_AT[0]:   # under the profiler
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
            profiled["first_round"] = len(rounds)
        if prof is not None and len(rounds) == PROFILE_AT[1]:
            sync()
            prof.__exit__(None, None, None)
            events = prof.key_averages()
            kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                             key=lambda e: -e.self_device_time_total)
            profiled.update(
                rounds=PROFILE_AT[1] - PROFILE_AT[0],
                kernel_ms=sum(e.self_device_time_total for e in kernels) / 1e3,
                top=[{"name": e.key[:90], "ms": e.self_device_time_total / 1e3,
                      "calls": e.count} for e in kernels[:25]])
            prof = None
        for _ in range(min(len(pending), rng.choice((0, 0, 1, 4)))):
            ids, out = pending.pop()
            added.append(engine.add(ids, SamplingParams(max_new_tokens=out)))
        waited[0] = 0.0
        ran[0] = None
        waiting = {r.rid: len(r.prompt_ids) for r in engine.scheduler.waiting}
        running = {r.rid: r.num_tokens for r in engine.scheduler.running}
        engine.step()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        plan = engine.last_plan
        if not plan.cluster_requests or plan.shape is None:
            rounds.append(None)
            continue
        budget = plan.budget_of()
        ctx = {rid: running.get(rid, waiting.get(rid, 0)) for rid in budget}
        read = sum((budget[rid] + 1) * c for rid, c in ctx.items())
        longest = max(ctx.values(), default=0)
        real = sum(b + 1 for b in budget.values())
        fresh = [waiting[rid] for rid in budget if rid in waiting]
        kind = ("decode" if not plan.extend_tokens else
                "prefill" if len(fresh) == len(budget) else "mixed")
        tokens, batch = plan.shape.verify_tokens, plan.batch_pad
        base = model.round_seconds(plan.steps, tokens, batch)
        caught = bool(ran[0] is not None and ran[0].catchup)
        decode = model.round_seconds(plan.steps, tokens, batch, read, real, longest,
                                     catchup=caught)
        slots, positions = prefill_size(engine, plan, fresh) if plan.extend_tokens else (0, 0)
        pre = model.prefill_seconds(slots, positions) if slots else 0.0
        rounds.append({"kind": kind, "waited": waited[0], "base": base,
                       "predicted": decode + pre, "predicted_decode": decode,
                       "predicted_prefill": pre, "steps": plan.steps, "tokens": tokens,
                       "batch": batch, "requests": len(budget), "verify_tokens_real": real,
                       "positions_read": read, "longest_context": longest, "catchup": caught,
                       "pending": ran[0].pending if ran[0] is not None else 0,
                       "prefill_tokens": plan.extend_tokens,
                       "prefill_slots": slots, "prefill_positions": positions})
    t = time.perf_counter()
    engine.drain()
    sync()
    steps.append(time.perf_counter() - t)
    worker.collect = collect
    worker.launch = launch
    for i, r in enumerate(rounds):   # a plan's device time shows in the next step's wait
        if r is not None:
            r["seconds"] = steps[i + 1]
            r["step_seconds"] = steps[i]
    rounds = [r for r in rounds if r is not None]
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        mine = [r for r in rounds if r["kind"] == kind]
        measured = sum(r["seconds"] for r in mine)
        predicted, base = sum(r["predicted"] for r in mine), sum(r["base"] for r in mine)
        kinds[kind] = {"rounds": len(mine), "measured_s": measured, "predicted_s": predicted,
                       "base_s": base,
                       "measured_over_predicted": measured / predicted if predicted else None,
                       "measured_over_base": measured / base if base else None,
                       "host_bound_rounds": sum(1 for r in mine if r["waited"] < 1e-4)}
    every = kinds["all"] = {"rounds": len(rounds),
                            **{k: sum(kinds[c][k] for c in KINDS)
                               for k in ("measured_s", "predicted_s", "base_s")}}
    every["measured_over_predicted"] = every["measured_s"] / every["predicted_s"]
    every["measured_over_base"] = every["measured_s"] / every["base_s"]
    tokens = sum(len(r.output_ids) for r in added)
    kinds["served"] = served_prediction(kinds, tokens)
    kinds["unpriced"] = model.unpriced()
    if profiled:
        span = rounds[PROFILE_AT[0]:PROFILE_AT[1]]
        profiled.update(wall_ms=1e3 * sum(r["seconds"] for r in span),
                        predicted_ms=1e3 * sum(r["predicted"] for r in span))
    print("== schedule: measured / predicted by the cost model (base: the decode table alone)")
    for kind in KINDS + ("all",):
        k = kinds[kind]
        if k["rounds"]:
            print(f"   {kind:8s} {k['rounds']:4d} rounds  measured {1e3 * k['measured_s']:9.1f} "
                  f"ms  predicted {1e3 * k['predicted_s']:9.1f} ms  x{k['measured_over_predicted']:.3f}"
                  f"  (base x{k['measured_over_base']:.3f})", flush=True)
    served = kinds["served"]
    print(f"   served: {tokens} tokens, measured {served['measured_tokens_per_s']:.0f} tok/s, "
          f"predicted {served['predicted_tokens_per_s']:.0f}, base "
          f"{served['base_tokens_per_s']:.0f}; not priced: {kinds['unpriced'] or 'nothing'}",
          flush=True)
    kinds["rounds"] = rounds
    kinds["profiled"] = profiled
    return kinds


def finish(result: dict, path: Path) -> None:
    """GPU busy per (bucket, depth) and rank: GPU kernel time per round over the agreed round
    cost (the start-up median, taken with every rank in step); write JSON and plot, print."""
    if not result["rounds_per_rank"][0]:   # --no-profile
        write_json(path, result)
        return
    for part in result["rounds_per_rank"]:
        for bucket, row in part.items():
            for steps, rec in row.items():
                rec["gpu_busy"] = rec["gpu_kernel_ms"] / result["agreed_round_cost_ms"][bucket][steps]
    result["depth7_over_depth0"] = {b: row["7"] / row["0"]
                                    for b, row in result["agreed_round_cost_ms"].items()}
    write_json(path, result)
    print_table(result)
    plot(result, path.with_suffix(".png"))


def print_table(result: dict) -> None:
    print(f"== {result['layout']}: agreed cost (ms per round) and GPU busy (rank 0: kernel time "
          f"over the agreed cost) by bucket")
    print(f"{'bucket':>7}" + "".join(f"{'d' + str(s) + ' ms':>10}{'busy':>6}" for s in TIERS)
          + f"{'d7/d0':>7}")
    r0 = result["rounds_per_rank"][0]
    for bucket, row in result["agreed_round_cost_ms"].items():
        cells = "".join(f"{row[str(s)]:>10.2f}{100 * r0[bucket][str(s)]['gpu_busy']:>5.0f}%"
                        for s in TIERS)
        print(f"{bucket:>7}{cells}{row['7'] / row['0']:>7.2f}")


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    table = result["agreed_round_cost_ms"]
    buckets = sorted(table, key=int)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    r0 = result["rounds_per_rank"][0]
    for s in TIERS:
        ax.plot([int(b) for b in buckets], [table[b][str(s)] for b in buckets], "o-",
                label=f"depth {s}")
        ax2.plot([int(b) for b in buckets], [100 * r0[b][str(s)]["gpu_busy"] for b in buckets],
                 "o-", label=f"depth {s}")
    for a, title in ((ax, "agreed round cost (ms)"), (ax2, "GPU busy, rank 0 (%)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch bucket")
        a.set_title(f"{result['layout']}: {title}")
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(result.get("model", "Llama-3.1-8B-shaped target + EAGLE-3-shaped head, "
                                     "random bf16 weights"))
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
