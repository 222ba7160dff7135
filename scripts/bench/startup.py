"""Start-up time and memory of `serve`, step by step (issue 34 §1).

    # one H200, Llama-3.1-8B shape (random bf16 weights; written first when DIR has none)
    python -m scripts.bench.startup --checkpoint DIR --shape llama3-8b --device cuda \\
        --runs no-spec,goodput --two-servers --out runs/startup
    # the same on the CPU with the bundled pair (a smoke test of this script)
    python -m scripts.bench.startup --device cpu --runs no-spec,goodput --max-batch-size 4 \\
        --max-model-len 256 --two-servers --out runs/startup_cpu
    # where start-up goes, without a GPU: the captures an engine makes, counted, and their
    # bodies run as the capture runs them (2 warm-ups + the recording) on the CPU
    python -m scripts.bench.startup --count --max-batch-size 64 --max-model-len 2048 \\
        --out runs/startup_count

**Runs** (`--runs`, each a `serve` mode: `no-spec`, `goodput` = `--adaptive --policy goodput`,
`static3` = `--steps 3`): for each, `python -m adaptive_dist serve` at the given shape
(`--max-batch-size`, `--max-model-len`, `--serve "MORE FLAGS"`) with
``ADAPTIVE_DIST_STARTUP_LOG`` set, so rank 0 writes its timeline (`workers.startup_log`) as JSON
lines; the clock runs from the process's launch to the first `/health` 200, then one completion
(the first contact) is timed, the device's memory read (nvidia-smi, per process) and the server
stopped. `--repeat N` starts each mode N times (the first start also fills the kernel caches).

**Two servers** (`--two-servers`): two `serve` processes of `--two-servers-mode` with
`--gpu-memory-utilization 0.45` each (`--utilization`), started one after the other on one GPU;
both must answer a completion while both run. On the CPU the flag is refused (`serve` exits 2),
so there the pair runs without it, `--kv-cache-memory 64M` each, to check the rest.

**Count** (`--count`): no server. An engine of the bundled pair at the given batch and context
is built with CUDA graphs emulated (on a CPU nothing is captured), and for each mode it reports
the captures per family (the round's per phase, the padded prefill's per rows bucket) and each
family's CPU-emulated capture time (every body run 3 times, as `CudaGraphRunner.capture_body`
runs it: 2 warm-ups and the recording; a CPU's eager time per forward is host time, what the
recording costs on a GPU too); the counts are exact for any model at that configuration.

Writes OUT/startup.json after every run (so a run cut short keeps what finished) and prints a
table per run: each step's time since loading began, its seconds, and memory.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
TREES = "3x2x6,5x4x8,7x2x12,7x4x16"
"""`goodput-trees`' tree candidates (issue 35: the priced benchmark's set)."""
MODES = {"no-spec": ["--no-spec"], "goodput": ["--adaptive", "--policy", "goodput"],
         "static3": ["--steps", "3"],
         "goodput-trees": ["--adaptive", "--policy", "goodput", "--tree-candidates", TREES]}


def say(text: str) -> None:
    print(f"[startup] {text}", flush=True)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


# ---- the checkpoint ---------------------------------------------------------------------------

def model_flags(args: argparse.Namespace) -> list[str]:
    """`--model`/`--draft-model` of the checkpoint (written by `scripts.gen.make_checkpoint`
    when `--checkpoint DIR` has none); none for the bundled pair."""
    if args.checkpoint is None:
        return []
    root = Path(args.checkpoint)
    target, eagle = root / "target", root / "eagle"
    if not (target / "config.json").is_file() or not (eagle / "config.json").is_file():
        cmd = [sys.executable, "-m", "scripts.gen.make_checkpoint", "--shape", args.shape,
               "--head", "eagle3", "--out", str(root)]
        say(f"writing the checkpoint: {shlex.join(cmd)}")
        start = time.monotonic()
        subprocess.run(cmd, check=True, cwd=ROOT)
        say(f"checkpoint written in {time.monotonic() - start:.0f} s")
    return ["--model", str(target), "--draft-model", str(eagle)]


# ---- one server -------------------------------------------------------------------------------

def gpu_memory() -> dict[str, Any]:
    """nvidia-smi's view: used / total MiB of GPU 0 and MiB per process (empty without it)."""
    try:
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total",
                               "--format=csv,noheader,nounits", "-i", "0"], capture_output=True,
                              text=True, timeout=30).stdout.split(",")
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    per = {}
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            per[int(parts[0])] = int(parts[1])
    out: dict[str, Any] = {"per_process_mib": per}
    if len(used) == 2:
        out.update(used_mib=int(used[0]), total_mib=int(used[1]))
    return out


class Server:
    """One `serve` process with its start-up timeline written to a file."""

    def __init__(self, flags: list[str], name: str) -> None:
        from scripts.bench.server_process import ServerProcess, _free_port

        self.name = name
        self.events_file = Path(tempfile.mkstemp(prefix="startup-", suffix=".jsonl")[1])
        self.flags = flags
        self.launched = time.monotonic()
        self.proc = ServerProcess(flags, _free_port(),
                                  env={"ADAPTIVE_DIST_STARTUP_LOG": str(self.events_file)})
        self.ready_s: Optional[float] = None

    def wait_ready(self, timeout_s: float) -> float:
        self.proc.wait_ready(timeout_s)
        self.ready_s = time.monotonic() - self.launched
        return self.ready_s

    def complete(self, prompt: str = "def fib(n):", max_tokens: int = 8) -> dict[str, Any]:
        """One /v1/completions request: status, seconds, text."""
        import httpx

        model = httpx.get(f"{self.proc.url}/v1/models", timeout=30.0).json()["data"][0]["id"]
        start = time.monotonic()
        r = httpx.post(f"{self.proc.url}/v1/completions", timeout=120.0,
                       json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                             "temperature": 0})
        took = time.monotonic() - start
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") \
            else {}
        if r.status_code != 200:
            return {"status": r.status_code, "seconds": round(took, 3), "text": None,
                    "error": r.text[:500]}
        return {"status": 200, "seconds": round(took, 3), "text": body["choices"][0]["text"]}

    def events(self) -> list[dict[str, Any]]:
        try:
            return [json.loads(x) for x in self.events_file.read_text().splitlines() if x]
        except OSError:
            return []

    def stop(self) -> None:
        self.proc.stop()
        self.events_file.unlink(missing_ok=True)


def step_table(events: list[dict[str, Any]], ready_s: Optional[float]) -> str:
    """The timeline as a table: step, t, seconds, memory."""
    rows = ["| step | t (s) | seconds | memory |", "| --- | --- | --- | --- |"]
    for e in events:
        if "step" not in e:
            continue
        mem = e.get("memory") or {}
        if "allocated" in mem:
            text = (f"alloc {mem['allocated'] / 2**30:.2f} GiB, reserved "
                    f"{mem['reserved'] / 2**30:.2f} GiB, device {mem['device_used'] / 2**30:.2f}"
                    f" GiB")
        elif "rss" in mem:
            text = f"rss {mem['rss'] / 2**20:.0f} MiB"
        else:
            text = ""
        sec = e.get("seconds")
        rows.append(f"| {e['step']} | {e['t']:.1f} | {'' if sec is None else f'{sec:.2f}'} | "
                    f"{text} |")
    if ready_s is not None:
        rows.append(f"| /health 200 (from launch) | {ready_s:.1f} | | |")
    return "\n".join(rows)


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per kind of step (loading, graphs, cost tables, ...) and the memory split."""
    kinds: dict[str, float] = {}
    graphs = 0
    for e in events:
        name, sec = e.get("step"), e.get("seconds")
        if name is None or sec is None:
            continue
        kind = ("graphs: round" if name.startswith(("depth", "verify forward")) and e.get("graphs")
                else "graphs: prefill" if name.startswith("prefill graphs")
                else "buffers" if name.startswith("depth") else name)
        if kind.startswith("graphs"):
            graphs += e.get("graphs", 0)
        if kind != "ready":
            kinds[kind] = round(kinds.get(kind, 0.0) + sec, 3)
    split = next((e.get("split") for e in events if e.get("step") == "memory"), None)
    ready = next((e for e in events if e.get("step") == "ready"), {})
    age = next((e.get("process_age_s") for e in events if e.get("step") == "begin"), None)
    return {"seconds_by_step": kinds, "graphs": graphs, "memory_split": split,
            "ready_after_loading_began_s": ready.get("seconds"), "imports_s": age,
            "engine_ready_after_process_start_s": ready.get("since_process_start")}


def run_one(args: argparse.Namespace, mode: str, flags: list[str], name: str) -> dict[str, Any]:
    server = Server(flags, name)
    say(f"{name}: serve {shlex.join(flags)}")
    result: dict[str, Any] = {"name": name, "mode": mode, "flags": flags}
    try:
        result["ready_s"] = round(server.wait_ready(args.ready_timeout), 3)
        result["first_request"] = server.complete()
        result["gpu"] = gpu_memory() if args.device == "cuda" else {}
        pid = server.proc.proc.pid
        result["gpu_mib_this_process"] = result["gpu"].get("per_process_mib", {}).get(pid)
    except RuntimeError as err:
        result["error"] = str(err)[-3000:]
    finally:
        result["events"] = server.events()
        server.stop()
    result.update(summarize(result["events"]))
    say(f"{name}: ready {result.get('ready_s', 'never')} s after launch; first request "
        f"{result.get('first_request')}")
    print(step_table(result["events"], result.get("ready_s")), flush=True)
    return result


def two_servers(args: argparse.Namespace, base: list[str]) -> dict[str, Any]:
    """Two servers of `--two-servers-mode` side by side, each with its share of the GPU."""
    share = (["--gpu-memory-utilization", str(args.utilization)] if args.device == "cuda"
             else ["--kv-cache-memory", "64M"])
    flags = [*base, *MODES[args.two_servers_mode], *share]
    servers, out = [], {"flags": flags, "servers": []}
    try:
        for i in range(2):
            s = Server(flags, f"server {i}")
            servers.append(s)
            say(f"two servers: starting {s.name}: serve {shlex.join(flags)}")
            try:
                ready = s.wait_ready(args.ready_timeout)
            except RuntimeError as err:
                out["servers"].append({"name": s.name, "error": str(err)[-3000:],
                                       "events": s.events()})
                out["ok"] = False
                return out
            say(f"two servers: {s.name} ready in {ready:.1f} s")
        gpu = gpu_memory() if args.device == "cuda" else {}
        answers = [s.complete() for s in servers]
        for s, answer in zip(servers, answers):
            out["servers"].append({
                "name": s.name, "ready_s": round(s.ready_s or 0, 3), "answer": answer,
                "gpu_mib": gpu.get("per_process_mib", {}).get(s.proc.proc.pid),
                **summarize(s.events())})
        out["gpu"] = gpu
        out["ok"] = all(a["status"] == 200 and a["text"] is not None for a in answers)
        if gpu.get("total_mib"):   # each within its share of the GPU (nvidia-smi's count)
            cap = args.utilization * gpu["total_mib"]
            out["within_budget"] = [s["gpu_mib"] is not None and s["gpu_mib"] <= cap
                                    for s in out["servers"]]
    finally:
        for s in servers:
            s.stop()
    say(f"two servers: {'both answered' if out.get('ok') else 'FAILED'}; GPU "
        f"{out.get('gpu', {}).get('used_mib', '-')} of {out.get('gpu', {}).get('total_mib', '-')} "
        f"MiB used while both ran; per server "
        f"{[s.get('gpu_mib') for s in out['servers']]} MiB (within "
        f"{args.utilization:g} of the GPU: {out.get('within_budget', '-')})")
    return out


# ---- count: captures and CPU-emulated capture time -----------------------------------------------

def family(name: str) -> str:
    """A capture's family from its name (`GraphKey.name`; the prefill's by rows)."""
    parts = name.split("/")
    if parts[0] == "prefill":
        rows = parts[1]
        return f"prefill {rows}" + (" deferred" if parts[-1] == "deferred" else "")
    return parts[0]


def count(args: argparse.Namespace) -> dict[str, Any]:
    """Captures per family and their CPU-emulated capture time, per mode (see the doc)."""
    import torch

    from adaptive_dist.config import load_config
    from workers.config import EngineConfig, no_spec
    from workers.engine import build_engine
    from workers.loading import load_pair

    torch.set_grad_enabled(False)
    target, head = load_pair(None)
    specs = {"no-spec": no_spec(), "goodput": load_config(None, "goodput"),
             "static3": load_config(None, "static", initial_steps=3),
             "goodput-trees": load_config(None, "goodput").replace(
                 tree_candidates=TREES.split(","))}
    out: dict[str, Any] = {"max_batch_size": args.max_batch_size,
                           "max_context_len": args.max_model_len}
    for mode in args.runs.split(","):
        spec = specs[mode]
        if spec.needs_round_cost:   # a table, so the build measures none
            spec = spec.replace(round_cost={str(s): 1.0 + s for s in spec.candidate_steps})
        if "verify_cost" in spec.start_up_needs:   # trees: a verify table too (any numbers)
            spec = spec.replace(verify_cost={str(t): 1.0 + t for t in (1, 2, 4, 8, 16)})
        extra = dict(padded_prefill_tokens=args.padded_prefill_tokens,
                     defer_prefill_width=args.defer_prefill_width)
        cfg = EngineConfig(spec=spec, max_batch_size=args.max_batch_size,
                           max_context_len=args.max_model_len, cuda_graphs=True, overlap=True,
                           **extra)
        engine = build_engine(cfg, target, head if cfg.speculative else None)
        entries = engine.worker.graphs.entries
        fams: dict[str, dict[str, float]] = {}
        for entry in entries:
            f = fams.setdefault(family(entry.name), {"count": 0, "cpu_capture_s": 0.0})
            f["count"] += 1
            if args.time:
                start = time.perf_counter()
                with torch.inference_mode():
                    for _ in range(3):        # 2 warm-ups + the recording
                        entry.body()
                f["cpu_capture_s"] = round(f["cpu_capture_s"] + time.perf_counter() - start, 3)
        engine.close()
        total = sum(f["count"] for f in fams.values())
        secs = sum(f["cpu_capture_s"] for f in fams.values())
        out[mode] = {"captures": total, "cpu_capture_s": round(secs, 2), "families": fams,
                     "cost_table_rounds": cost_rounds(cfg, specs[mode].policy == "goodput")}
        say(f"count {mode}: {total} captures" + (f", {secs:.1f} s CPU-emulated" if args.time
                                                 else ""))
        for name, f in sorted(fams.items(), key=lambda kv: -kv[1]["count"]):
            share = f" ({100 * f['cpu_capture_s'] / secs:.0f}% of the time)" if secs else ""
            say(f"   {name:<24} {f['count']:>4}{share}")
    return out


def cost_rounds(cfg: Any, goodput: bool) -> int:
    """Rounds the start-up cost table runs for `cfg` (goodput): per bucket and depth, 6 chains
    (a warm-up and 5) of 8 rounds, of the catch-up interval at depth 0 with a head."""
    from workers.worker.round_cost import COST_CHAIN

    if not goodput:
        return 0
    chains = 6
    per_bucket = sum(chains * (cfg.catchup_rounds if s == 0 else COST_CHAIN)
                     for s in cfg.spec.tiers)
    return per_bucket * len(cfg.graph_buckets)


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a DIR/target + DIR/eagle pair (written by scripts.gen.make_checkpoint "
                        "--shape SHAPE when missing; default: the bundled pair)")
    p.add_argument("--shape", default="llama3-8b",
                   help="make_checkpoint's shape for a missing --checkpoint (default: llama3-8b)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="(default: cuda)")
    p.add_argument("--runs", default="no-spec,goodput",
                   help=f"comma-separated modes of {sorted(MODES)} (default: no-spec,goodput)")
    p.add_argument("--repeat", type=int, default=1, help="starts per mode (default: 1)")
    p.add_argument("--max-batch-size", type=int, default=64, help="(default: 64)")
    p.add_argument("--max-model-len", type=int, default=2048, help="(default: 2048)")
    p.add_argument("--serve", default="", help="more serve flags, one string")
    p.add_argument("--two-servers", action="store_true",
                   help="then two servers side by side, --gpu-memory-utilization U each")
    p.add_argument("--two-servers-mode", choices=sorted(MODES), default="no-spec",
                   help="(default: no-spec)")
    p.add_argument("--utilization", type=float, default=0.45, help="(default: 0.45)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /health (default: 600)")
    p.add_argument("--count", action="store_true",
                   help="no server: count the captures per family and time their bodies on the CPU")
    p.add_argument("--no-time", dest="time", action="store_false",
                   help="with --count: counts only")
    p.add_argument("--padded-prefill-tokens", type=int, default=4096,
                   help="with --count (default: 4096)")
    p.add_argument("--defer-prefill-width", type=int, default=256,
                   help="with --count (default: 256)")
    p.add_argument("--out", required=True, help="writes OUT/startup.json (or count.json)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # SIGTERM (`timeout`) unwinds like Ctrl-C: the servers started are stopped, what finished
    # is in OUT/startup.json already
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.count:
        write_json(out / "count.json", count(args))
        say(f"wrote {out / 'count.json'}")
        return 0
    base = [*model_flags(args), "--device", args.device, "--max-batch-size",
            str(args.max_batch_size), "--max-model-len", str(args.max_model_len),
            *shlex.split(args.serve)]
    results: dict[str, Any] = {"settings": vars(args), "runs": []}
    failed = False
    for mode in args.runs.split(","):
        if mode not in MODES:
            raise SystemExit(f"--runs: unknown mode {mode!r}; allowed: {sorted(MODES)}")
        for i in range(args.repeat):
            name = mode if args.repeat == 1 else f"{mode} #{i + 1}"
            result = run_one(args, mode, [*base, *MODES[mode]], name)
            failed |= "error" in result
            results["runs"].append(result)
            write_json(out / "startup.json", results)
    if args.two_servers:
        results["two_servers"] = two_servers(args, base)
        failed |= not results["two_servers"].get("ok")
        write_json(out / "startup.json", results)
    say("summary (seconds from launch to /health 200; before the timeline began (imports); "
        "the engine ready; seconds per kind of step):")
    for r in results["runs"]:
        say(f"  {r['name']:<12} /health 200 at {r.get('ready_s', 'never')} s, imports "
            f"{r.get('imports_s')} s, engine ready at {r.get('engine_ready_after_process_start_s')}"
            f" s, steps {r.get('seconds_by_step')}, {r.get('graphs')} graphs")
    plot(results, out / "startup.png")
    say(f"wrote {out / 'startup.json'} and {out / 'startup.png'}")
    return 1 if failed else 0


def plot(results: dict[str, Any], path: Path) -> None:
    """One bar per start: launch to /health 200 split into the imports before the timeline, each
    kind of step, the rest of the engine's start, and the frontend after the engine was ready."""
    from scripts.bench.common import pyplot, save

    runs = [r for r in results["runs"] if r.get("ready_s")]
    if not runs:
        return
    kinds = list(dict.fromkeys(k for r in runs for k in (r.get("seconds_by_step") or {})))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.5 * len(runs)))
    for y, r in enumerate(runs):
        parts = [("imports", r.get("imports_s") or 0.0)]
        parts += [(k, (r.get("seconds_by_step") or {}).get(k, 0.0)) for k in kinds]
        engine = r.get("engine_ready_after_process_start_s") or 0.0
        parts.append(("engine, other", max(0.0, engine - sum(v for _, v in parts))))
        parts.append(("frontend", max(0.0, r["ready_s"] - max(engine, sum(v for _, v in parts)))))
        left = 0.0
        for i, (label, seconds) in enumerate(parts):
            ax.barh(y, seconds, left=left, color=f"C{i % 10}", label=label if y == 0 else None)
            left += seconds
    ax.set_yticks(range(len(runs)), [r["name"] for r in runs])
    ax.set_xlabel("seconds from launch to /health 200")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    save(fig, path)


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
