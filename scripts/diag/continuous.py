"""Diagnostic: where a continuous-arrival phase spends its time, per engine (no speculation,
static 1 and 3, goodput, and goodput held at depth 0): each engine step timed and sorted into admission rounds (a prefill ran)
and plain rounds, with the graph path and padded batches seen; and one short request end to end.

    python -m scripts.diag.continuous [cuda|cpu] [BATCH] [OUT.json]

4 x BATCH prompts per regime (high_entropy, code), 64 new tokens each, at most BATCH in flight
(`scripts.bench.adaptive.run_continuous`), three passes (the last is reported). Writes OUT.json and
OUT.png (milliseconds per admission round and per plain round, per engine and regime)."""
import json, statistics as st, sys, time
import torch
from scripts.bench.regimes import make_prompts
from adaptive_dist.config import AdaptiveConfig, load_config
from scripts.bench.adaptive import run_continuous
from workers.config import EngineConfig, no_spec
from workers.engine import build_engine
from workers.loading import DEFAULT_MODEL, encode_prompt, load_pair
from workers.sampling import SamplingParams
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 16
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
t, h = load_pair(str(DEFAULT_MODEL), device=dev)
if dev == "cuda":
    t, h = t.half(), h.half(); t.reset_buffers(); h.reset_buffers()
texts = make_prompts(4 * B, seed=2)
enc = {k: [encode_prompt(x, t.config) for x in v] for k, v in texts.items()}
ctx = max(len(p) for ps in enc.values() for p in ps) + 65
specs = {"static0": no_spec(), "static1": load_config(None, "static", initial_steps=1),
         "static3": load_config(None, "static", initial_steps=3),
         "goodput": AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3, 7), initial_steps=1,
                                   warmup_batches=4, update_interval=2, ema_alpha=0.3),
         # the goodput engine held at depth 0 (bench_adaptive's depth0_head): against static0 it
         # prices the head's share of each prefill (admission rounds) and the catch-up's (plain)
         "depth0_head": AdaptiveConfig(policy="goodput", candidate_steps=(0, 7), initial_steps=0,
                                       round_cost={"0": 1.0, "7": 1e9}, probe_every=10 ** 6)}
out = {}
for name, spec in specs.items():
    e = build_engine(EngineConfig(spec=spec, max_batch_size=64, max_context_len=ctx, device=dev,
                                  cuda_graphs=dev == "cuda", overlap=dev == "cuda"), t, h)
    e.warmup()
    rows = []
    orig = e.step
    def step(*a, **k):
        t0 = time.perf_counter(); r = orig(*a, **k)
        p = e.last_plan
        rows.append((p.extend_requests, p.extend_tokens, p.use_graph, p.batch_pad, p.steps,
                     time.perf_counter() - t0))
        return r
    e.step = step
    res = {}
    for kind in ("high_entropy", "code"):
        for rep in range(3):
            rows.clear(); sync(); t0 = time.perf_counter()
            reqs = run_continuous(e, enc[kind][:4 * B], B, SamplingParams(max_new_tokens=64))
            sync(); wall = time.perf_counter() - t0
        adm = [r for r in rows if r[0]]; plain = [r for r in rows if not r[0]]
        res[kind] = {"wall_ms": 1e3 * wall, "tokens": sum(len(r.output_ids) for r in reqs),
                     "rounds": len(rows), "admission_rounds": len(adm),
                     "admitted_per_round": st.mean(r[0] for r in adm) if adm else 0,
                     "adm_ms_median": 1e3 * st.median(r[5] for r in adm) if adm else 0,
                     "adm_ms_sum": 1e3 * sum(r[5] for r in adm),
                     "plain_ms_median": 1e3 * st.median(r[5] for r in plain) if plain else 0,
                     "plain_ms_sum": 1e3 * sum(r[5] for r in plain),
                     "eager_rounds": sum(1 for r in rows if not r[2]),
                     "pads": sorted({r[3] for r in rows}), "steps": sorted({r[4] for r in rows})}
    # one prefill of one request, timed alone
    ts = []
    for _ in range(5):
        e.add(enc["code"][0], SamplingParams(max_new_tokens=2))
        sync(); t0 = time.perf_counter(); e.run()
        sync(); ts.append(1e3 * (time.perf_counter() - t0))
    res["one_request_2_tokens_ms"] = st.median(ts)
    out[name] = res
    print(name, json.dumps(res), flush=True)
    e.close()
path = sys.argv[3] if len(sys.argv) > 3 else "runs/diag_continuous.json"
import os
os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
json.dump(out, open(path, "w"), indent=1)
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(9, 4))
labels = [f"{n}\n{k}" for n in out for k in ("high_entropy", "code")]
x = range(len(labels))
ax.bar([i - 0.2 for i in x], [out[n][k]["adm_ms_median"] for n in out for k in ("high_entropy", "code")],
       width=0.4, label="admission round (median ms)")
ax.bar([i + 0.2 for i in x], [out[n][k]["plain_ms_median"] for n in out for k in ("high_entropy", "code")],
       width=0.4, label="plain round (median ms)")
ax.set_xticks(list(x)); ax.set_xticklabels(labels, fontsize=7); ax.legend(); ax.grid(axis="y", alpha=0.3)
ax.set_title(f"continuous arrivals, batch {B}: host time per engine step")
fig.tight_layout(); fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
print("wrote", path)
