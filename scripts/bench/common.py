"""What the benchmarks (and the diagnostics) share: the prompt regimes, the model pairs and the
engines built on them, timing, and the results (JSON, plots).

The engine's packages (`workers`, `adaptive_dist`) are imported inside the helpers that use them,
never at the top of this module, and an engine gets only the settings a caller names: the
'before' run of `scripts.bench.hotpath` imports them from an older tree (`gpu_check.sh`'s
`hotpath_before`), which may lack newer ones.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

# ---- prompt regimes ------------------------------------------------------------------------------
# code (middling acceptance), high-entropy random base64 (near-zero acceptance) and repetitive runs
# (saturated acceptance) for the bundled byte pair

KINDS = ("code", "high_entropy", "repetitive")
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def code_prompts(n: int, rng: random.Random) -> list[str]:
    """Python function openings: a signature, a docstring, the start of a body."""
    verbs = ["parse", "merge", "load", "render", "split", "count", "normalize", "validate"]
    nouns = ["config", "records", "intervals", "header", "tokens", "path", "matrix", "options"]
    bodies = ["result = []\n    for item in {n}:\n        ", "if not {n}:\n        return None\n    ",
              "with open({n}) as f:\n        ", "total = 0\n    for key, value in {n}.items():\n"]
    out = []
    for i in range(n):
        verb, noun = verbs[i % len(verbs)], nouns[(i * 3) % len(nouns)]
        body = bodies[i % len(bodies)].format(n=noun)
        out.append(f'def {verb}_{noun}({noun}, strict=False):\n    """{verb.capitalize()} the '
                   f'{noun} and return the result."""\n    {body}')
    rng.shuffle(out)
    return out


def high_entropy_prompts(n: int, rng: random.Random) -> list[str]:
    """Random base64: a bare blob, or an opened `TOKEN = "...` string (as code embeds keys)."""
    return ["".join(rng.choice(B64) for _ in range(160)) if i % 2 == 0 else
            '    TOKEN = "' + "".join(rng.choice(B64) for _ in range(48)) for i in range(n)]


def repetitive_prompts(n: int, rng: random.Random) -> list[str]:
    """Runs of one character and ruler lines, as code's separators and padding are (the bundled
    pair continues these and its head predicts them: the saturated regime, see its model card)."""
    chars = "#*= -0_~"
    out = []
    for i in range(n):
        c = chars[i % len(chars)]
        out.append(c * rng.randint(80, 140) if i % 3 else ("#" + c * 70 + "\n") * 2)
    rng.shuffle(out)
    return out


def make_prompts(n: int, seed: int = 0) -> dict[str, list[str]]:
    """`n` prompts of every regime."""
    rng = random.Random(seed)
    return {"code": code_prompts(n, rng), "high_entropy": high_entropy_prompts(n, rng),
            "repetitive": repetitive_prompts(n, rng)}


def encode_prompts(texts: dict[str, list[str]],
                   encode: Callable[[str], list[int]]) -> dict[str, list[list[int]]]:
    """Every regime's prompts as token ids."""
    return {k: [encode(t) for t in v] for k, v in texts.items()}


# ---- model pairs -------------------------------------------------------------------------------

def load_pair(model: Any, device: str, *, draft: Any = None, par: Any = None,
              half: bool = False, dtype: Any = None) -> tuple[Any, Any]:
    """The target and draft head that `model` (and `draft`) name, as `generate` loads them
    (`workers.loading.load_pair`: this rank's shards under `par`, a `ModelParallel`; read in
    `dtype`, default float32); `half`: then converted to float16, their buffers recomputed."""
    from workers.loading import load_pair as load

    named = {k: v for k, v in (("draft", draft), ("dtype", dtype)) if v is not None}
    target, head = load(model, par, device, **named)   # an older tree may lack either keyword
    if half:
        target, head = target.half(), head.half()
        target.reset_buffers()
        head.reset_buffers()
    return target, head


def random_pair(shape: str, head: str, device: Any, *, par: Any = None,
                seed: int = 0) -> tuple[Any, Any]:
    """A target of `shape` and a `head` ("eagle3" / "eagle") with random bfloat16 weights made on
    `device` (`scripts.gen.make_checkpoint`), split over `par` (default: this process alone)."""
    from scripts.gen.make_checkpoint import build
    from workers.model import ModelParallel

    return build(shape, head, None, seed, par if par is not None else ModelParallel.single(device),
                 device)


def tokenizer(model: Any, draft: Any, vocab_size: int) -> Any:
    """The pair's tokenizer, as `generate` reads it, checked against the target's vocabulary."""
    from workers.loading import load_tokenizer_for, model_paths

    return load_tokenizer_for(model_paths(model, draft), vocab_size)


# ---- engines -----------------------------------------------------------------------------------

def add_overlap_argument(p: argparse.ArgumentParser) -> None:
    """`--overlap auto|on|off`, as the engine's command line (auto: on with CUDA)."""
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="launch round r+1 before reading round r (auto: on with CUDA)")


def overlap_of(args: argparse.Namespace, device: str) -> dict:
    """EngineConfig keywords for `--overlap` (none when off, so an older engine tree that has no
    such setting still builds)."""
    on = args.overlap == "on" or (args.overlap == "auto" and device == "cuda")
    return {"overlap": True} if on else {}


def static_spec(steps: int | str) -> Any:
    """No speculation (`"nospec"` or 0), or the static policy at `steps` draft tokens a round."""
    from adaptive_dist.config import load_config
    from workers.config import no_spec

    if steps in ("nospec", 0):
        return no_spec()
    return load_config(None, "static", initial_steps=int(steps))


def held_at_zero(top: int = 1, **settings: Any) -> Any:
    """The goodput engine held at depth 0: its head kept current (prefilled, caught up, the
    shadow acceptance checked) but never drafting, since its other depth `top` is priced out of
    reach and no probe is ever due; `settings`: further AdaptiveConfig keys."""
    from adaptive_dist.config import AdaptiveConfig

    return AdaptiveConfig(policy="goodput", candidate_steps=(0, top), initial_steps=0,
                          round_cost={"0": 1.0, str(top): 1e9}, probe_every=10 ** 6, **settings)


def build(spec: Any, target: Any, head: Any, *, batch: int, context: int, device: Any,
          graphs: bool | None = None, group: Any = None, guard: Any = None,
          **settings: Any) -> Any:
    """An engine of `spec` over the pair: at most `batch` requests of `context` positions, on
    `device`, with CUDA graphs when `graphs` (None: the engine's default); `group`/`guard`: the
    cluster's (multi-rank runs); `settings`: further EngineConfig keys, and only those."""
    from workers.config import EngineConfig
    from workers.engine import build_engine

    if graphs is not None:
        settings["cuda_graphs"] = graphs
    config = EngineConfig(spec=spec, max_batch_size=batch, max_context_len=context,
                          device=device, **settings)
    cluster = {k: v for k, v in (("group", group), ("guard", guard)) if v is not None}
    return build_engine(config, target, head, **cluster)


HEADLESS = "nohead"
"""The name of the engine without a head, beside engines held at depth 0 (`depth0_engines`)."""
DEPTH0_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def depth0_engines(target: Any, head: Any, held: dict[str, int | None],
                   **engine: Any) -> dict[str, Any]:
    """An engine without a head (`HEADLESS`) and, per name in `held`, the goodput engine held at
    depth 0 (`held_at_zero`) with that catch-up interval (None: the engine's default); graphs at
    every bucket of `DEPTH0_BUCKETS`; `engine`: `build`'s keywords for all of them."""
    engines = {HEADLESS: build(static_spec(0).replace(graph_buckets=DEPTH0_BUCKETS), target,
                               None, **engine)}
    for name, every in held.items():
        extra = {} if every is None else {"catchup_rounds": every}
        engines[name] = build(held_at_zero(1, graph_buckets=DEPTH0_BUCKETS), target, head,
                              **engine, **extra)
    return engines


def bodies(engine: Any, bucket: int, context: int,
           width: int) -> dict[str, Callable[[], None]]:
    """The depth-0 round's forward at `bucket` rows (its graph, or the eager body), with a lag
    ring the catch-up forward, and the padded prefill of `bucket` rows of `width` slots; dummy
    rows whose cache holds `context` positions. `setup` sets the dummy rows (every other body
    assumes it ran)."""
    from workers.worker.graph_table import GraphKey, GraphPhase

    worker = engine.worker
    engine.pool.apply(0)
    bufs = worker.state.payload
    slot_state, lag, prefill = worker.slots, worker.lag, worker.prefill_runner
    reach = slot_state.reach

    def setup() -> None:
        bufs.rows[:bucket].fill_(slot_state.dummy)
        slot_state.set_dummy_length(context)

    def run(phase: str) -> Callable[[], None]:
        if phase == "round":   # the depth-0 round: the target over the rows, the acceptance
            body = worker.round_body(bucket)
        elif worker.buckets:
            body = worker.table.get(GraphKey(GraphPhase.CATCHUP, batch=bucket)).replay
        else:
            body = lag.catchup_phase_body(bufs, bucket, reach)
        return lambda: (setup(), body())

    out = {"round": run("round"), "setup": setup}
    if lag.built:
        out["catchup"] = run("catchup")
    shape = prefill.shape(bucket, width)
    if shape is not None:
        rows, slots = shape
        _, slot_of, length = prefill.inputs(rows, slots)
        slot_of.fill_(slot_state.dummy)   # full-length dummy prompts
        length.fill_(slots)
        table = worker.table
        graph = table.get(prefill.key(rows, slots, True)) if table else None   # greedy requests
        out["prefill"] = graph.replay if graph is not None else (
            lambda: prefill.padded(rows, slots, True))
        if lag.deferred_len is not None and slots in lag.defer_widths:
            # at depth 0 the head's part waits: the prefill without it, and the forward over
            # `bucket` waiting prompts of `slots` tokens that a later catch-up runs (real slots
            # whose pages are the dummy page; their waiting length set before each run)
            graph = table.get(prefill.key(rows, slots, True, defer=True)) if table else None
            out["prefill_deferred"] = graph.replay if graph is not None else (
                lambda: prefill.padded(rows, slots, True, True))
            pending = table.get(GraphKey(GraphPhase.PENDING, batch=bucket, tokens=slots)) \
                if table else None
            run_pending = pending.replay if pending is not None else (
                lambda: lag.prompt_phase(bucket, reach, slots))

            def waiting() -> None:
                slot_state.round_rows[:bucket] = torch.arange(bucket, device=worker.device)
                lag.deferred_len[:bucket] = slots
                run_pending()
                slot_state.round_rows[:bucket] = slot_state.dummy
            out["pending"] = waiting
    return out


def in_flight(sched: Any) -> int:
    """Requests the scheduler holds that have not finished: running or waiting."""
    return len([r for r in sched.running if not r.finished]) + len(sched.waiting)


def run_continuous(engine: Any, prompts: list[list[int]], batch: int, params: Any) -> list[Any]:
    """`prompts` (with `params`, one SamplingParams for all or a list, one each) through the
    engine with at most `batch` of them running: before every round the free places are refilled
    from the queue. Every rank steps until the cluster agrees that no rank has work left (a rank
    with prompts still queued says so), as `Engine.run` does."""
    per = params if isinstance(params, list) else [params] * len(prompts)
    queue, reqs = list(zip(prompts, per)), []
    sched = engine.scheduler
    while True:
        while queue and in_flight(sched) < batch:
            prompt, p = queue.pop(0)
            reqs.append(engine.add(prompt, p, seed=len(reqs)))
        engine.step(pending=bool(queue))
        if engine.last_plan.all_done and not queue:
            break
    engine.drain()
    return reqs


def settle_heap() -> None:
    """After building and warming the engines: their objects out of the garbage collector's
    walks (`workers.engine.freeze_heap`, which `generate` and `serve` run after start-up; an
    older engine tree without it gets the same two calls), so no timed run pays a full
    collection over them."""
    try:
        from workers.engine import freeze_heap
    except ImportError:
        import atexit

        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)
    else:
        freeze_heap()


# ---- timing ------------------------------------------------------------------------------------

def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA), so a timer reads finished work."""
    if device == "cuda":
        torch.cuda.synchronize()


def spread(xs: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def timer(device: str) -> Callable[[Callable[[], None], int], float]:
    """`time(fn, iters)`: seconds per call of `fn` run `iters` times back to back (CUDA events
    on a GPU: the device's time; the host's clock on a CPU)."""
    if device != "cuda":
        def host(fn: Callable[[], None], iters: int) -> float:
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - start) / iters
        return host

    def events(fn: Callable[[], None], iters: int) -> float:
        fn()  # the first replay after another graph may pay for loading it
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / iters
    return events


class GcPauses:
    """Count and time the garbage collector's full (generation-2) collections while active."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = 0, 0.0, None

    def _hook(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._hook)


# ---- results -----------------------------------------------------------------------------------

def gpu_name(device: str) -> str | None:
    """The CUDA device's name for a results file's metadata (None off CUDA)."""
    return torch.cuda.get_device_name() if device == "cuda" else None


def write_json(path: Path | str, data: Any, indent: int = 1) -> None:
    """`data` as JSON at `path` (its folder made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent))


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path | str, dpi: int = 110) -> None:
    """Lay `fig` out, write it to `path` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
