"""Served tokens/s through SGLang's bench_serving, unmodified, against `serve` at a production
shape, next to what the engine's own round table predicts for the same batch (issue 34 §2).

    # one H200, Llama-3.1-8B shape, random bf16 weights (written first if DIR has none)
    python -m scripts.bench.production_serving --checkpoint DIR --shape llama3-8b --device cuda \\
        --concurrency 1,16,64 --modes no-spec,goodput --out runs/production_serving
    # or in steps of a few minutes each (the tables, then one server per mode, merged)
    python -m scripts.bench.production_serving --checkpoint DIR --tables-only --out OUT
    python -m scripts.bench.production_serving --checkpoint DIR --modes no-spec --reuse-tables \
        --merge --out OUT
    python -m scripts.bench.production_serving --checkpoint DIR --modes goodput --reuse-tables \
        --merge --out OUT
    # a finished run's levels priced again with a table's prefill term (runs nothing)
    python -m scripts.bench.production_serving --reprice OUT/summary.log \
        --round-table docs/data/cost_tables/h200_tp1_llama3-8b.json
    # the same pipeline end to end on the CPU, a tiny random shape (a smoke test of this script)
    python -m scripts.bench.production_serving --checkpoint /tmp/ps --shape tiny --device cpu \\
        --concurrency 1,4 --input-len 32 --output-len 16 --max-batch-size 4 --max-model-len 256 \\
        --out runs/production_serving_cpu

For each mode (`no-spec`: `serve --no-spec`; `goodput`: `serve --adaptive --policy goodput`):

1. **The round table.** A separate process builds the engine exactly as `serve` builds it (the
   same flags, through `workers.launch.start_engine`), measures one round at every depth and
   batch bucket (`Engine.measure_round_costs`: dummy rows at `--input-len + --output-len / 2`
   cached positions, CUDA graphs and overlap as served, median of 5 chains) and exits, so the
   server has the GPU to itself. Or `--round-table FILE` (a `docs/data/cost_tables/*.json`).
2. **The server** (`python -m adaptive_dist serve ...`, one process), then for each concurrency
   `c`: `python -m sglang.bench_serving --backend vllm` (streamed /v1/completions), its random
   dataset (`--random-range-ratio 1`, every request exactly `--input-len` tokens in and, with
   `ignore_eos`, `--output-len` out; the text drawn from the checkpoint's own word-level
   vocabulary), `--max-concurrency c`, `max(8, 4c)` prompts (`--prompts-per-level`), the
   checkpoint's tokenizer. /metrics is read before and after each level: the rounds the server
   ran, their time, the depths and the accepted draft tokens.
3. **The prediction** for concurrency `c`: `c (1 + a) / t` tokens/s, where `t` is the table's
   round time at the batch bucket that holds `c` (the engine pads a round to it), weighted by the
   depths the server ran (`no-spec`: depth 0 only), and `a` the accepted draft tokens per
   request-round the server reported (0 without speculation; near 0 for a random head, where
   goodput settles at depth 0). It prices decode rounds only: `served decode` (c over
   bench_serving's mean time per output token) is what it compares with; `served output`
   (bench_serving's output throughput: total output tokens over the run's wall time, prefills
   and ramp included) is beside it. `steady / predicted` takes `c (1 + a)` over bench_serving's
   median inter-token latency instead: one decode round between prefills (a streamed chunk
   carries a round's tokens), where the mean TPOT also holds the rounds that waited for other
   requests' prefills (with `ignore_eos` and equal lengths the requests finish in waves, and a
   wave of 64 x 1024-token prefills stops decoding for about a second).
4. **The prediction with prefills** (`predict_served`), what `served output` compares with: the
   table process also measures the prefill term of the cost model
   (`workers.worker.round_cost.measure_prefills`: every padded width, and the ragged path at `c x
   --input-len` tokens for every level; `adaptive_dist.cost_tables.PrefillTerm`), and a wave of
   `c` requests is priced as `(O - 1) / (1 + a)` decode rounds of `t` plus one prefill of `c`
   prompts of `I` tokens: `c O / ((O - 1) / (1 + a) t + prefill(c I slots, c I (I + 1) / 2
   positions))` output tokens/s. A `--round-table FILE` without `prefill_cost_ms` leaves it out.
   goodput's table process also measures the catch-up term (cost model version 2,
   `workers.worker.round_cost.measure_catchups`: one catch-up of the draft cache per bucket at
   0, the table's context and twice it); with it a wave's depth-0 rounds are priced without the
   table's share of catch-ups (one per `catchup_rounds` rounds at the table's context) and with
   the wave's own, `(O - 1) / catchup_rounds` of them at contexts spread over `I .. I + O`
   (`wave_catchups`). A table without the term leaves the share in (as before) and says so.

Writes OUT/results.json (settings, each mode's tables, every level's bench_serving result line,
its /metrics deltas, the prediction and the ratios, goodput over no-spec) and
OUT/production_serving.png; prints a Markdown table. The issue's goals: at concurrency 64 the
served decode rate >= 0.9 x the prediction, and goodput >= 0.97 x no-spec.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
MODES = {"no-spec": ["--no-spec"], "goodput": ["--adaptive", "--policy", "goodput"]}
BENCH_KEYS = ("completed", "duration", "total_input_tokens", "total_output_tokens",
              "total_output_tokens_retokenized", "request_throughput", "output_throughput",
              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
              "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms")


# ---- the checkpoint and the dataset ------------------------------------------------------------

def ensure_checkpoint(args: argparse.Namespace) -> tuple[Path, Path]:
    """DIR/target and DIR/eagle, written by `scripts.gen.make_checkpoint` when DIR has none."""
    root = Path(args.checkpoint)
    target, eagle = root / "target", root / "eagle"
    if not (target / "config.json").is_file() or not (eagle / "config.json").is_file():
        cmd = [sys.executable, "-m", "scripts.gen.make_checkpoint", "--shape", args.shape,
               "--head", "eagle3", "--out", str(root)]
        if args.layers is not None:
            cmd += ["--layers", str(args.layers)]
        print(f"[production_serving] writing the checkpoint: {shlex.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    if not (target / "tokenizer.json").is_file():
        raise SystemExit(f"{target} has no tokenizer.json (written by an older make_checkpoint?): "
                         f"run python -m scripts.gen.make_checkpoint again, or add one")
    return target, eagle


def write_dataset(path: Path, target: Path, n: int, words: int, seed: int = 0) -> Path:
    """A ShareGPT-shaped file (what bench_serving's random dataset samples its text from): `n`
    prompts of `words` words of the target's vocabulary, special tokens left out."""
    from workers.tokenizer import load_tokenizer

    tok = load_tokenizer(target)
    specials = {tok.bos_token_id, *tok.eos_token_ids}
    ids = [i for i in range(tok.vocab_size) if i not in specials]
    rng = random.Random(seed)
    rows = [{"id": str(k), "conversations": [
        {"from": "human", "value": tok.decode([rng.choice(ids) for _ in range(words)])},
        {"from": "gpt", "value": tok.decode([rng.choice(ids)])}]} for k in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))
    return path


# ---- the round table ---------------------------------------------------------------------------

def serve_flags(args: argparse.Namespace, mode: str, target: Path, eagle: Path) -> list[str]:
    """The flags of `serve` (and of the table's engine) for `mode`."""
    return ["--model", str(target), "--draft-model", str(eagle), "--device", args.device,
            "--max-batch-size", str(args.max_batch_size), "--max-model-len",
            str(args.max_model_len), *MODES[mode], *shlex.split(args.serve)]


def context_of(args: argparse.Namespace) -> int:
    """Cached positions of the table's dummy rows: the mean context of a decode round."""
    return args.input_len + args.output_len // 2


def prefill_sizes(args: argparse.Namespace) -> list[int]:
    """Token counts of the prefills a level runs when its requests arrive together: `c` prompts
    of `--input-len` at every concurrency `c` (the ragged path's measured sizes; the padded ones
    are measured at every width whatever this says)."""
    return sorted({c * args.input_len for c in args.concurrency})


def measure_table(args: argparse.Namespace, flags: list[str], out: Path) -> dict[str, Any]:
    """The round table of the engine `serve flags` builds, measured in a process of its own."""
    cmd = [sys.executable, "-m", "scripts.bench.production_serving", "--measure-table", str(out),
           "--context", str(context_of(args)), "--prefill-tokens",
           ",".join(str(t) for t in prefill_sizes(args)), "--", *flags]
    print(f"[production_serving] round table: {shlex.join(cmd)}", flush=True)
    # the threads the server's rank runs with (`ServerProcess` sets OMP_NUM_THREADS=1 too)
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         timeout=args.ready_timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if res.returncode != 0 or not out.is_file():
        raise RuntimeError(f"measuring the round table failed (exit {res.returncode}):\n"
                           f"{(res.stdout + res.stderr)[-4000:]}")
    return json.loads(out.read_text())


def _measure_main(out: Path, context: int, repeats: int, flags: list[str],
                  prefill_tokens: Optional[list[int]] = None) -> int:
    """`--measure-table`: build the engine as `serve FLAGS` does, measure, write `out`."""
    import torch

    from adaptive_dist.cli import build_parser
    from scripts.bench.common import gpu_name, write_json
    from workers.launch import run_distributed, start_engine
    from workers.server.cli import serve_settings
    from workers.server.engine_glue import serving_sizes

    settings = serve_settings(build_parser().parse_args(["serve", *flags]))
    launch = settings.launch

    def job(ctx: Any, _: Any, closers: Any) -> Optional[str]:
        start = time.perf_counter()
        cluster = start_engine(ctx, launch, closers, extra={},
                               size_for=lambda cfg, dp: serving_sizes(
                                   cfg, launch.engine.max_batch_size, settings.max_model_len))
        built = time.perf_counter() - start
        engine = cluster.engine
        table = engine.measure_round_costs(repeats=repeats, context=context)
        measured = time.perf_counter()
        from adaptive_dist.cost_tables import fit_prefill
        from workers.worker.round_cost import measure_prefills

        samples = measure_prefills(engine.worker, max(1, min(repeats, 3)), prefill_tokens or (),
                                   graphs=engine.worker.graphs is not None)
        prefill = fit_prefill([(x.slots, x.positions, x.seconds) for x in samples])
        prefilled = time.perf_counter()
        catchups = catchup_json(engine, context, max(1, min(repeats, 3)))
        own = engine.config.spec.round_cost
        device = str(cluster.config.device)
        write_json(out, {
            "table_s": {str(b): {str(s): v for s, v in row.items()} for b, row in table.items()},
            "context": context, "repeats": repeats,
            "engine_table_s": own.to_json() if own is not None else None,
            **prefill.to_json(), "prefill_samples": [x.as_json() for x in samples],
            "prefill_measure_s": prefilled - measured, **catchups,
            "catchup_measure_s": time.perf_counter() - prefilled,
            "engine_build_s": built, "measure_s": time.perf_counter() - start - built,
            "mode": cluster.config.mode, "device": device,
            "gpu": gpu_name(device) if device.startswith("cuda") else None,
            "max_memory_gib": (torch.cuda.max_memory_allocated() / 2**30
                               if device.startswith("cuda") else None),
            "flags": flags})
        return None

    return run_distributed(launch, settings, job)


def catchup_json(engine: Any, context: int, repeats: int) -> dict[str, Any]:
    """The catch-up term of `engine` as a cost table file holds it (version 2: milliseconds by
    context and bucket, `catchup_rounds`): measured at no context, at the table's `context` and
    at twice it (held inside a slot's pages), every bucket the round table has; {} without a
    lag ring (`--no-spec`)."""
    from adaptive_dist.cost_tables import (CATCHUP_BASE_KEY, CATCHUP_KEY, CATCHUP_ROUNDS_KEY,
                                           COST_MODEL_VERSION, VERSION_KEY)
    from workers.worker.round_cost import measure_catchups

    worker = engine.worker
    buckets = worker.buckets or tuple(b for b in engine.config.spec.graph_buckets
                                      if b <= engine.config.max_batch_size) or (1,)
    at = measure_catchups(worker, engine.pool, buckets, [0, context, 2 * context],
                          graphs=bool(worker.buckets), repeats=repeats)
    engine.pool.apply(engine.config.spec.initial_steps)
    if not at:
        return {}
    return {VERSION_KEY: COST_MODEL_VERSION, CATCHUP_ROUNDS_KEY: worker.lag.catchup_every,
            CATCHUP_BASE_KEY: context,
            CATCHUP_KEY: {str(c): {str(b): 1e3 * v for b, v in row.items()}
                          for c, row in at.items()}}


def table_from_file(path: str) -> dict[str, Any]:
    """`--round-table FILE`: a cost table file's `agreed_round_cost_ms`, in seconds."""
    data = json.loads(Path(path).read_text())
    if "agreed_round_cost_ms" not in data:
        raise SystemExit(f"--round-table {path}: no 'agreed_round_cost_ms' (a "
                         f"docs/data/cost_tables/*.json file)")
    from adaptive_dist.cost_tables import (CATCHUP_BASE_KEY, CATCHUP_KEY, CATCHUP_ROUNDS_KEY,
                                           PREFILL_KEY, PREFILL_POSITION_KEY)

    return {"table_s": {b: {s: ms / 1e3 for s, ms in row.items()}
                        for b, row in data["agreed_round_cost_ms"].items()},
            "context": data.get("context"), "file": path,
            **{k: data[k] for k in (PREFILL_KEY, PREFILL_POSITION_KEY, CATCHUP_KEY,
                                    CATCHUP_ROUNDS_KEY, CATCHUP_BASE_KEY) if k in data}}


def bucket_of(table: dict[str, dict[str, float]], concurrency: int) -> str:
    """The batch bucket a round of `concurrency` requests is padded to (the largest when none
    holds it)."""
    buckets = sorted(table, key=int)
    return next((b for b in buckets if int(b) >= concurrency), buckets[-1])


def predict(table: dict[str, dict[str, float]], concurrency: int, depths: dict[int, float],
            accepted: float) -> dict[str, Any]:
    """Tokens/s the table predicts at `concurrency`: `c (1 + accepted) / t`, `t` the bucket's
    round time weighted by the share of rounds at each depth (`depths`; default depth 0)."""
    bucket = bucket_of(table, concurrency)
    row = table[bucket]
    mix = {d: f for d, f in depths.items() if str(d) in row and f > 0} or {0: 1.0}
    total = sum(mix.values())
    seconds = sum(f * row[str(d)] for d, f in mix.items()) / total
    return {"bucket": int(bucket), "round_ms": 1e3 * seconds,
            "depth_share": {str(d): f / total for d, f in sorted(mix.items())},
            "accepted_per_request_round": accepted,
            "tokens_per_s": concurrency * (1.0 + accepted) / seconds}


def catchup_term(tables: dict[str, Any], base_context: Optional[int] = None) -> Any:
    """The catch-up term of `tables` (a measured table's or a table file's keys), its depth-0
    entries' context `base_context` (default the table's `catchup_table_context`); None
    without one."""
    from adaptive_dist.cost_tables import (CATCHUP_BASE_KEY, CATCHUP_KEY, CATCHUP_ROUNDS_KEY,
                                           CatchupTerm)

    if tables.get(CATCHUP_KEY) is None:
        return None
    return CatchupTerm.parse(tables[CATCHUP_KEY], tables.get(CATCHUP_ROUNDS_KEY),
                             base_context if base_context is not None
                             else tables.get(CATCHUP_BASE_KEY, 0))


def wave_catchups(term: Any, concurrency: int, rounds: float, input_len: int,
                  output_len: int) -> dict[str, Any]:
    """What the catch-up term changes in a wave of `rounds` depth-0 rounds at batch
    `concurrency`: the depth-0 table price holds one catch-up per `every` rounds at the table's
    context (`share`); the wave runs `rounds / every` of them, their rows' contexts spread evenly
    over `input_len .. input_len + output_len` (each priced at its own context, the midpoints of
    equal parts). Seconds added (`delta`: the catch-ups at their contexts less the share)."""
    n = rounds / term.every
    parts = max(1, round(n))
    at = [term.cost(concurrency, input_len + output_len * (i + 0.5) / parts)
          for i in range(parts)]
    catchups = n * sum(at) / parts
    share = rounds * term.share(concurrency)
    return {"catchups": n, "catchup_s": catchups, "table_share_s": share,
            "delta_s": catchups - share}


def predict_served(tables: dict[str, Any], concurrency: int, prediction: dict[str, Any],
                   input_len: int, output_len: int, mode: str = "goodput",
                   base_context: Optional[int] = None) -> dict[str, Any]:
    """Output tokens/s the table predicts for a level, prefills included: a wave of `c` requests
    costs `(O - 1) / (1 + a)` decode rounds at the level's round time `t` (`predict`: the first
    output token comes from the prefill) and one prefill of `c` prompts of `I` tokens
    (`prefill(c x I slots, c x I (I + 1) / 2 positions)`, the cost model's prefill term), so
    `c O / ((O - 1) / (1 + a) t + prefill)`. Without a prefill term in `tables`: None, named.
    With a catch-up term (cost model version 2) and a `mode` with a head, the depth-0 rounds'
    catch-ups priced at their contexts instead of the table's share (`wave_catchups`; the share
    at `base_context`, default the table's own context: the context `t` was measured at)."""
    from adaptive_dist.cost_tables import (PREFILL_KEY, PREFILL_POSITION_KEY, PrefillTerm,
                                           causal_positions)

    if PREFILL_KEY not in tables:
        return {"tokens_per_s": None, "unpriced": "prefill (the table has no prefill_cost_ms)"}
    term = PrefillTerm.parse(tables[PREFILL_KEY], tables.get(PREFILL_POSITION_KEY))
    c, a = concurrency, prediction["accepted_per_request_round"]
    rounds = max(output_len - 1, 0) / (1.0 + a)
    decode = rounds * prediction["round_ms"] / 1e3
    slots = c * input_len
    prefill = term.cost(slots, causal_positions([input_len] * c))
    out: dict[str, Any] = {}
    catchup = catchup_term(tables, base_context) if mode != "no-spec" else None
    if catchup is not None:
        share0 = float(prediction.get("depth_share", {}).get("0", 1.0))
        out["catchups"] = wave_catchups(catchup, c, rounds * share0, input_len, output_len)
        decode += out["catchups"]["delta_s"]
    elif mode != "no-spec":
        out["unpriced"] = ("catch-up (the table's depth-0 price holds one per catchup_rounds "
                           "rounds at its context)")
    return {"tokens_per_s": c * output_len / (decode + prefill), "wave_decode_s": decode,
            "wave_prefill_s": prefill, "prefill_share": prefill / (decode + prefill),
            "prefill_slots": slots, **out}


def summary_rows(text: str) -> list[dict[str, Any]]:
    """The rows of a run's printed Markdown table (`markdown`'s first nine columns: mode,
    concurrency, bucket, table round ms, predicted tok/s, served decode tok/s, decode /
    predicted, served output tok/s, TTFT p50), for a run whose results.json was not kept."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 9 or cells[0] not in MODES or not cells[1].isdigit():
            continue
        rows.append({"mode": cells[0], "concurrency": int(cells[1]),
                     "round_ms": float(cells[3]), "predicted_tokens_per_s": float(cells[4]),
                     "decode_tokens_per_s": float(cells[5]),
                     "output_tokens_per_s": float(cells[7])})
    if not rows:
        raise ValueError("no rows of the results table (| mode | concurrency | bucket | round "
                         "ms | predicted | ... |) in the summary")
    return rows


def reprice(text: str, tables: dict[str, Any], input_len: int,
            output_len: int) -> list[dict[str, Any]]:
    """Each level of a finished run's summary (`summary_rows`) priced again with the prefill
    term of `tables` (`predict_served` at the level's own table round time; the accepted
    draft tokens per request-round recovered from the printed decode prediction, `c (1 + a) /
    t`, never below 0) and, where `tables` has one, its catch-up term (goodput's depth-0 rounds:
    the summary's round time was measured at `input_len + output_len / 2` cached positions, the
    context of the catch-up share it holds): served output over the prediction with prefills,
    beside the decode-only prediction's ratios."""
    out = []
    for row in summary_rows(text):
        c, t = row["concurrency"], row["round_ms"] / 1e3
        accepted = max(0.0, row["predicted_tokens_per_s"] * t / c - 1.0)
        served = predict_served(tables, c, {"round_ms": row["round_ms"],
                                            "accepted_per_request_round": accepted},
                                input_len, output_len, row["mode"],
                                base_context=input_len + output_len // 2)
        predicted = served.get("tokens_per_s")
        out.append({**row, "accepted_per_request_round": accepted, "served_prediction": served,
                    "decode_over_prediction": row["decode_tokens_per_s"]
                    / row["predicted_tokens_per_s"],
                    "output_over_decode_prediction": row["output_tokens_per_s"]
                    / row["predicted_tokens_per_s"],
                    "output_over_served_prediction": (row["output_tokens_per_s"] / predicted
                                                      if predicted else None)})
    return out


# ---- the server, /metrics and bench_serving ----------------------------------------------------

def read_metrics(url: str) -> dict[str, float]:
    """The /metrics samples that price the rounds (summed over DP groups and labels)."""
    import httpx

    wanted = ("adaptive_dist_rounds_total", "adaptive_dist_round_seconds_total",
              "adaptive_dist_spec_decode_num_drafts_total",
              "adaptive_dist_spec_decode_num_accepted_tokens_total")
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base in wanted:
            out[base] = out.get(base, 0.0) + float(value)
        elif base == "adaptive_dist_planner_stat" and 'stat="rounds_at_steps_' in name:
            steps = name.split('stat="rounds_at_steps_', 1)[1].split('"', 1)[0]
            key = f"rounds_at_steps_{steps}"
            out[key] = out.get(key, 0.0) + float(value)
    return out


def metric_delta(before: dict[str, float], after: dict[str, float],
                 concurrency: int) -> dict[str, Any]:
    """What the server did during one level: rounds, their mean time, the depths' shares, the
    accepted draft tokens per request-round."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    rounds = d.get("adaptive_dist_rounds_total", 0.0)
    at = {int(k.rsplit("_", 1)[1]): v for k, v in d.items() if k.startswith("rounds_at_steps_")}
    drafts = d.get("adaptive_dist_spec_decode_num_drafts_total", 0.0)
    accepted = d.get("adaptive_dist_spec_decode_num_accepted_tokens_total", 0.0)
    return {"rounds": rounds,
            "mean_round_ms": 1e3 * d.get("adaptive_dist_round_seconds_total", 0.0) / rounds
            if rounds else None,
            "rounds_at_depth": {str(k): v for k, v in sorted(at.items())},
            "drafts": drafts, "accepted_tokens": accepted,
            "accepted_per_draft": accepted / drafts if drafts else 0.0}


def bench_command(args: argparse.Namespace, url: str, target: Path, dataset: Path,
                  concurrency: int, output: Path) -> list[str]:
    prompts = max(args.min_prompts, args.prompts_per_level * concurrency)
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "vllm", "--base-url", url,
            "--dataset-name", "random", "--dataset-path", str(dataset),
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--random-range-ratio", "1.0", "--num-prompts", str(prompts),
            "--max-concurrency", str(concurrency), "--tokenizer", str(target),
            "--seed", str(args.seed), "--warmup-requests", str(min(concurrency, 4)),
            "--disable-tqdm", "--output-file", str(output)]


def run_level(args: argparse.Namespace, url: str, target: Path, dataset: Path, mode: str,
              concurrency: int, out: Path) -> dict[str, Any]:
    from scripts.bench.sglang_client import table_lines

    result_file = out / f"{mode}_c{concurrency}.jsonl"
    result_file.unlink(missing_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = bench_command(args, url, target, dataset, concurrency, result_file)
    before = read_metrics(url)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out,
                         timeout=args.bench_timeout)
    after = read_metrics(url)
    (out / f"{mode}_c{concurrency}.log").write_text(res.stdout + res.stderr)
    row: dict[str, Any] = {"mode": mode, "concurrency": concurrency, "exit_code": res.returncode,
                           "command": shlex.join(cmd), "table": table_lines(res.stdout),
                           "server": metric_delta(before, after, concurrency)}
    if res.returncode == 0 and result_file.is_file():
        full = json.loads(result_file.read_text().strip().splitlines()[-1])
        row["bench"] = {k: full.get(k) for k in BENCH_KEYS}
    else:
        row["error"] = (res.stderr or res.stdout)[-2000:]
    return row


def compare(row: dict[str, Any], table: dict[str, dict[str, float]],
            tables: Optional[dict[str, Any]] = None, input_len: int = 0,
            output_len: int = 0) -> None:
    """The prediction for `row`'s level and the served rates over it (in place); with `tables`
    (the mode's, holding a prefill term) and the level's lengths, the served output prediction
    with prefills (`predict_served`) beside it."""
    c, server, bench = row["concurrency"], row["server"], row.get("bench")
    depths = {int(k): v for k, v in server["rounds_at_depth"].items()} if row["mode"] != \
        "no-spec" else {0: 1.0}
    rounds = sum(depths.values()) or 1.0
    # accepted draft tokens per request-round: a request drafts once per round it runs at depth > 0
    spec_rounds = server["drafts"]
    accepted = server["accepted_tokens"] / spec_rounds if spec_rounds else 0.0
    share_spec = sum(v for d, v in depths.items() if d > 0) / rounds
    row["prediction"] = predict(table, c, depths, accepted * share_spec)
    if tables is not None and output_len:
        row["prediction"]["served"] = predict_served(tables, c, row["prediction"], input_len,
                                                     output_len, row["mode"])
    if not bench or not bench.get("completed"):
        return
    predicted = row["prediction"]["tokens_per_s"]
    decode = c * 1e3 / bench["mean_tpot_ms"] if bench.get("mean_tpot_ms") else None
    # between prefills: the median interval between a request's chunks is one decode round (a
    # chunk carries the round's 1 + accepted tokens); the mean TPOT also holds the rounds that
    # stopped for other requests' prefills, which the decode-only table does not price
    tokens = 1.0 + row["prediction"]["accepted_per_request_round"]
    steady = c * tokens * 1e3 / bench["median_itl_ms"] if bench.get("median_itl_ms") else None
    row["served"] = {"output_tokens_per_s": bench["output_throughput"],
                     "decode_tokens_per_s": decode,
                     "decode_over_prediction": decode / predicted if decode else None,
                     "steady_decode_tokens_per_s": steady,
                     "steady_over_prediction": steady / predicted if steady else None,
                     "output_over_prediction": bench["output_throughput"] / predicted}
    with_prefill = row["prediction"].get("served", {}).get("tokens_per_s")
    if with_prefill:
        row["served"]["output_over_served_prediction"] = (bench["output_throughput"]
                                                          / with_prefill)


# ---- the run ------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    from collectives import free_port
    from scripts.bench.server_process import ServerProcess

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    target, eagle = ensure_checkpoint(args)
    dataset = write_dataset(out / "sharegpt_words.json", target,
                            max(64, max(args.concurrency) * args.prompts_per_level),
                            words=max(8, args.input_len // 2), seed=args.seed)
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items()},
                              "checkpoint": {"target": str(target), "eagle": str(eagle)},
                              "modes": {}, "rows": []}
    for mode in args.modes:
        flags = serve_flags(args, mode, target, eagle)
        saved = out / f"round_table_{mode}.json"
        if args.round_table:
            tables = table_from_file(args.round_table)
        elif args.reuse_tables and saved.is_file():
            tables = json.loads(saved.read_text())
            if tables.get("flags") != flags:
                raise SystemExit(f"--reuse-tables: {saved} was measured with other flags "
                                 f"({tables.get('flags')}); these are {flags}")
        else:
            tables = measure_table(args, flags, saved)
        report["modes"][mode] = {"serve": shlex.join(flags), **tables}
        if args.tables_only:
            continue
        server = ServerProcess(flags, free_port())
        started = time.monotonic()
        try:
            server.wait_ready(timeout_s=args.ready_timeout)
            report["modes"][mode]["ready_s"] = time.monotonic() - started
            for c in args.concurrency:
                print(f"[production_serving] {mode}: concurrency {c} ...", file=sys.stderr,
                      flush=True)
                row = run_level(args, server.url, target, dataset, mode, c, out)
                compare(row, tables["table_s"], tables, args.input_len, args.output_len)
                report["rows"].append(row)
        finally:
            (out / f"serve_{mode}.log").write_text(server.output())
            server.stop()
    return report


def merge(report: dict[str, Any], path: Path) -> dict[str, Any]:
    """`report` with the modes of an earlier results file it did not run (`--merge`)."""
    if not path.is_file():
        return report
    old = json.loads(path.read_text())
    ran = set(report["modes"])
    report["modes"] = {**{m: v for m, v in old.get("modes", {}).items() if m not in ran},
                       **report["modes"]}
    report["rows"] = [r for r in old.get("rows", []) if r["mode"] not in ran] + report["rows"]
    report["merged_from"] = str(path)
    return report


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Served goodput over served no-spec at each concurrency (output and decode rates)."""
    by = {(r["mode"], r["concurrency"]): r.get("served") for r in rows}
    out = {}
    for (mode, c), served in by.items():
        base = by.get(("no-spec", c))
        if mode == "goodput" and served and base:
            out[str(c)] = {k: served[k] / base[k] for k in ("output_tokens_per_s",
                                                             "decode_tokens_per_s")
                           if served.get(k) and base.get(k)}
    return out


def prefill_ratios(modes: dict[str, Any]) -> dict[str, Any]:
    """goodput's prefill over no-spec's at every shape both table processes measured
    (`prefill_samples`: the padded shapes, `rows x width`, and the ragged sizes, `ragged T`):
    the head's part of a prefill (its K/V at every prompt position, its layer at each prompt's
    last token, the target's feature tap) where goodput runs it in the prefill. {} unless both
    modes' tables hold samples."""
    def samples(mode: str) -> dict[str, float]:
        return {(f"ragged {x['width']}" if not x["rows"] else f"{x['rows']} x {x['width']}"):
                x["seconds"] for x in modes.get(mode, {}).get("prefill_samples") or []}
    spec, plain = samples("goodput"), samples("no-spec")
    return {k: {"goodput_ms": 1e3 * spec[k], "no_spec_ms": 1e3 * plain[k],
                "ratio": spec[k] / plain[k]} for k in spec if k in plain and plain[k] > 0}


def _cell(value: Optional[float], fmt: str) -> str:
    return fmt.format(value) if value else "-"


def markdown(report: dict[str, Any]) -> str:
    head = ["mode", "concurrency", "bucket", "round ms (table)", "predicted tok/s",
            "served decode tok/s", "decode / predicted", "steady / predicted",
            "predicted output tok/s (prefills priced)", "served output tok/s",
            "output / predicted with prefills", "TTFT p50 ms", "TPOT mean ms", "rounds at depth"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        p, s, b = r.get("prediction", {}), r.get("served"), r.get("bench") or {}
        cells = [r["mode"], str(r["concurrency"]), str(p.get("bucket", "")),
                 f"{p['round_ms']:.2f}" if p else "", f"{p['tokens_per_s']:.0f}" if p else ""]
        if s:
            cells += [f"{s['decode_tokens_per_s']:.0f}" if s["decode_tokens_per_s"] else "-",
                      f"{s['decode_over_prediction']:.2f}" if s["decode_over_prediction"] else "-",
                      f"{s['steady_over_prediction']:.2f}" if s.get("steady_over_prediction")
                      else "-",
                      _cell(p.get("served", {}).get("tokens_per_s"), "{:.0f}"),
                      f"{s['output_tokens_per_s']:.0f}",
                      _cell(s.get("output_over_served_prediction"), "{:.2f}"),
                      f"{b['median_ttft_ms']:.0f}", f"{b['mean_tpot_ms']:.2f}"]
        else:
            cells += ["failed"] * 8
        depth = r["server"]["rounds_at_depth"]
        cells.append(", ".join(f"{k}: {v:.0f}" for k, v in depth.items()) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    for c, ratio in report.get("goodput_over_no_spec", {}).items():
        lines.append(f"\ngoodput / no-spec at concurrency {c}: " + ", ".join(
            f"{k.replace('_tokens_per_s', '')} {v:.3f}" for k, v in ratio.items()))
    pre = report.get("prefill_goodput_over_no_spec") or {}
    if pre:
        lines.append("\nprefill, goodput over no-spec (the head's part; table processes): "
                     + ", ".join(f"{k} {v['goodput_ms']:.1f} / {v['no_spec_ms']:.1f} ms = "
                                 f"x{v['ratio']:.3f}" for k, v in pre.items()))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    from scripts.bench.common import pyplot, save

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for mode in report["modes"]:
        rows = [r for r in report["rows"] if r["mode"] == mode and r.get("served")]
        if not rows:
            continue
        cs = [r["concurrency"] for r in rows]
        ax.plot(cs, [r["prediction"]["tokens_per_s"] for r in rows], "--", marker="x",
                label=f"{mode}: round table")
        ax.plot(cs, [r["served"]["decode_tokens_per_s"] or 0 for r in rows], "-", marker="o",
                label=f"{mode}: served decode")
        ax.plot(cs, [r["served"]["output_tokens_per_s"] for r in rows], ":", marker="s",
                label=f"{mode}: served output")
        ax2.plot(cs, [r["served"]["decode_over_prediction"] or 0 for r in rows], "-o",
                 label=f"{mode}: decode / table")
    ax2.axhline(0.9, color="grey", lw=0.8, ls="--")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrency")
        a.legend(fontsize=7)
    ax.set_ylabel("tokens/s")
    ax2.set_ylabel("served / predicted")
    s = report["settings"]
    fig.suptitle(f"sglang.bench_serving vs serve ({s['shape']}, {s['device']}): random "
                 f"{s['input_len']} in / {s['output_len']} out", fontsize=10)
    save(fig, path)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]    # noqa: E731
    p.add_argument("--checkpoint", default="runs/production_serving/checkpoint", metavar="DIR",
                   help="DIR/target (with its tokenizer) and DIR/eagle; written by "
                        "scripts.gen.make_checkpoint --shape SHAPE when DIR has none")
    p.add_argument("--shape", default="llama3-8b",
                   help="make_checkpoint's shape when the checkpoint is written (default: "
                        "llama3-8b)")
    p.add_argument("--layers", type=int, default=None, help="fewer target layers than the shape's")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="(default: cuda)")
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                   help="no-spec and/or goodput (default: both)")
    p.add_argument("--concurrency", type=ints, default=[1, 16, 64],
                   help="bench_serving --max-concurrency levels (default: 1,16,64)")
    p.add_argument("--input-len", type=int, default=1024, help="(default: 1024)")
    p.add_argument("--output-len", type=int, default=256, help="(default: 256)")
    p.add_argument("--prompts-per-level", type=int, default=4,
                   help="prompts per level: this many times the concurrency (default: 4)")
    p.add_argument("--min-prompts", type=int, default=8, help="at least (default: 8)")
    p.add_argument("--max-batch-size", type=int, default=64, help="(default: 64)")
    p.add_argument("--max-model-len", type=int, default=2048, help="(default: 2048)")
    p.add_argument("--serve", default="", help="further flags of serve (both modes)")
    p.add_argument("--round-table", default=None, metavar="FILE",
                   help="a cost table file (docs/data/cost_tables/*.json) instead of measuring")
    p.add_argument("--tables-only", action="store_true",
                   help="measure the round tables (OUT/round_table_MODE.json) and stop")
    p.add_argument("--reuse-tables", action="store_true",
                   help="use OUT/round_table_MODE.json when it was measured with these flags")
    p.add_argument("--merge", action="store_true",
                   help="keep the other modes' rows of OUT/results.json (a run split by mode)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=1800.0,
                   help="seconds the round table and the server may take to start")
    p.add_argument("--bench-timeout", type=float, default=1800.0)
    p.add_argument("--out", default="runs/production_serving")
    p.add_argument("--reprice", default=None, metavar="SUMMARY",
                   help="price the levels of a finished run's printed table (SUMMARY: its log) "
                        "again with the prefill term (and the catch-up term, where it has one) "
                        "of --round-table FILE, at --input-len and --output-len, and print "
                        "served output over that prediction; runs nothing")
    p.add_argument("--measure-table", default=None, metavar="OUT.json", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--prefill-tokens", type=ints, default=[], help=argparse.SUPPRESS)
    p.add_argument("serve_flags", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"--modes: {unknown[0]!r}; allowed: {', '.join(MODES)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.reprice:
        if not args.round_table:
            raise SystemExit("--reprice SUMMARY needs --round-table FILE (a cost table file "
                             "with prefill_cost_ms)")
        rows = reprice(Path(args.reprice).read_text(), table_from_file(args.round_table),
                       args.input_len, args.output_len)
        print("| mode | concurrency | table round ms | decode-only predicted tok/s | served "
              "output tok/s | output / decode-only | predicted with prefills tok/s | wave "
              "prefill s | output / predicted with prefills |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            sp = r["served_prediction"]
            print(f"| {r['mode']} | {r['concurrency']} | {r['round_ms']:.2f} | "
                  f"{r['predicted_tokens_per_s']:.0f} | {r['output_tokens_per_s']:.0f} | "
                  f"{r['output_over_decode_prediction']:.3f} | "
                  + _cell(sp.get("tokens_per_s"), "{:.0f}") + " | "
                  + _cell(sp.get("wave_prefill_s"), "{:.3f}") + " | "
                  + _cell(r["output_over_served_prediction"], "{:.3f}") + " |")
        return 0
    if args.measure_table:
        flags = args.serve_flags[1:] if args.serve_flags[:1] == ["--"] else args.serve_flags
        return _measure_main(Path(args.measure_table), args.context, args.repeats, flags,
                             args.prefill_tokens)
    from scripts.bench.common import write_json
    from scripts.bench.sglang_client import importable

    problem = importable()
    if problem is not None:
        print(f"sglang.bench_serving does not import here ({problem}); see "
              f"scripts/bench/sglang_client.py for how to install it", file=sys.stderr)
        return 2
    report = run(args)
    out = Path(args.out)
    if args.tables_only:
        for mode, entry in report["modes"].items():
            print(f"{mode}: round table (ms) at context {entry.get('context')}: " + json.dumps(
                {b: {d: round(1e3 * v, 3) for d, v in row.items()}
                 for b, row in entry["table_s"].items()}))
            if entry.get("catchup_cost_ms_at_context"):
                print(f"{mode}: one catch-up (ms) by context and bucket: " + json.dumps(
                    {c: {b: round(v, 3) for b, v in row.items()}
                     for c, row in entry["catchup_cost_ms_at_context"].items()}))
        for shape, r in prefill_ratios(report["modes"]).items():
            print(f"prefill {shape}: goodput {r['goodput_ms']:.2f} ms, no-spec "
                  f"{r['no_spec_ms']:.2f} ms, x{r['ratio']:.3f}")
        return 0
    if args.merge:
        report = merge(report, out / "results.json")
    report["goodput_over_no_spec"] = ratios(report["rows"])
    report["prefill_goodput_over_no_spec"] = prefill_ratios(report["modes"])
    report["markdown"] = markdown(report)
    write_json(out / "results.json", report)
    plot(report, out / "production_serving.png")
    print(report["markdown"])
    failed = [f"{r['mode']}/c{r['concurrency']}" for r in report["rows"] if not r.get("served")]
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
