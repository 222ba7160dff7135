"""Diagnostic: the goodput engine's start-up cost table (dummy rows at cache length 0/128/256)
against real rounds of static engines (ms per round = wall / rounds, prefill included), the
bundled pair (float16 on CUDA), batch 16 and 64, high-entropy and code prompts, median of 3.

    python scripts/diag_costs.py [cuda|cpu] [NEW_TOKENS] > costs.json
"""
import json, sys, time
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import torch
from regimes import make_prompts
from adaptive_dist.config import AdaptiveConfig, load_config
from workers.config import EngineConfig, no_spec
from workers.engine import build_engine
from workers.loading import DEFAULT_MODEL, encode_prompt, load_pair
from workers.sampling import SamplingParams
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
NEW = int(sys.argv[2]) if len(sys.argv) > 2 else 256
t, h = load_pair(str(DEFAULT_MODEL), device=dev)
if dev == "cuda":
    t, h = t.half(), h.half(); t.reset_buffers(); h.reset_buffers()
texts = make_prompts(64, seed=2)
enc = {k: [encode_prompt(x, t.config) for x in v] for k, v in texts.items()}
ctx = max(len(p) for ps in enc.values() for p in ps) + 257
def cfg(spec): return EngineConfig(spec=spec, max_batch_size=64, max_context_len=ctx, device=dev, cuda_graphs=dev == "cuda")
g = build_engine(cfg(AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3, 7), initial_steps=1)), t, h)
out = {"startup_table_ms": {b: {s: 1e3 * v for s, v in r.items()} for b, r in g.config.spec.round_cost.to_json().items()}}
for c in (0, 128, 256):
    out[f"table_ctx{c}_ms"] = {b: {s: 1e3 * v for s, v in r.items()} for b, r in g.measure_round_costs(context=c).items()}
real = {}
for name, spec in (("static0", no_spec()), ("static1", load_config(None, "static", initial_steps=1)),
                   ("static3", load_config(None, "static", initial_steps=3)), ("static7", load_config(None, "static", initial_steps=7))):
    e = build_engine(cfg(spec), t, h); e.warmup()
    for kind in ("high_entropy", "code"):
        for b in (16, 64):
            e.generate(enc[kind][:b], SamplingParams(max_new_tokens=8))
            ts = []
            for _ in range(3):
                r0 = e.stats.rounds; torch.cuda.synchronize() if dev == "cuda" else None
                t0 = time.perf_counter(); e.generate(enc[kind][:b], SamplingParams(max_new_tokens=NEW))
                torch.cuda.synchronize() if dev == "cuda" else None
                ts.append(1e3 * (time.perf_counter() - t0) / (e.stats.rounds - r0))
            real.setdefault(name, {})[f"{kind}_b{b}"] = sorted(ts)[1]
    e.close()
out["real_round_ms"] = real
print(json.dumps(out, indent=1))
