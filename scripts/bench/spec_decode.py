"""Time the device-side sampling of one speculative round (`workers.spec_decode`) against the host
loop it replaced (per-request generators, `.item()` per decision; `_host_probs` and
`_host_accept` below, the host references that `tests/sampling_reference.py` keeps for the tests).

    python -m scripts.bench.spec_decode [--device cuda] [--vocab 128256] [--json out.json]

For each (batch, steps): `draft_step` x steps + `verify`, eagerly and (on CUDA) as one CUDA-graph
replay per variant of the static flags:
- `top_p`: every row samples with temperature 0.8, top-p 0.95 (the general path: sorts);
- `top_p_target_only`: the same target, the draft sampled without top-p (`use_top_p=False`);
- `no_top_p`: top-p 1 everywhere (`use_top_p=False`: no sort at all);
- `greedy`: every row greedy (`all_greedy=True`: argmax only);
and the old path (`top_p` only): per request and step `_host_probs` + `torch.multinomial` with its
own generator, then `_host_accept` per request. The draft logits are the target's plus noise.
Model forwards are not included: this is the sampling/acceptance work alone.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from scripts.bench.common import write_json
from workers.spec_decode import draft_step, verify


VARIANTS = {  # name: (temperature, top_p, draft flags, verify flags)
    "top_p": (0.8, 0.95, {}, {}),
    "top_p_target_only": (0.8, 0.95, {"use_top_p": False}, {}),
    "no_top_p": (0.8, 1.0, {"use_top_p": False}, {"use_top_p": False}),
    "greedy": (0.0, 1.0, {"all_greedy": True}, {"all_greedy": True}),
}


def _inputs(b: int, s: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    target = 4 * torch.randn(b, s + 1, vocab, device=device, generator=g)
    draft = target[:, :s].permute(1, 0, 2) + torch.randn(s, b, vocab, device=device, generator=g)
    return dict(draft_logits=draft.contiguous(), target_logits=target,
                temperature=torch.full((b,), 0.8, device=device),
                top_p=torch.full((b,), 0.95, device=device),
                seed=torch.arange(b, device=device), counter=torch.full((b,), 100, device=device),
                num_draft=torch.full((b,), s, device=device))


def _round(x: dict[str, torch.Tensor], s: int, draft_flags: dict[str, bool] | None = None,
           verify_flags: dict[str, bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    toks, qs = [], []
    for k in range(s):
        t, q = draft_step(x["draft_logits"][k], x["temperature"], x["top_p"], x["seed"],
                          x["counter"], k, **(draft_flags or {}))
        toks.append(t)
        qs.append(q)
    return verify(torch.stack(toks, 1), torch.stack(qs, 1), x["target_logits"], x["temperature"],
                  x["top_p"], x["seed"], x["counter"], x["num_draft"], **(verify_flags or {}))


def _graph_ms(x: dict[str, torch.Tensor], s: int, draft_flags: dict[str, bool],
              verify_flags: dict[str, bool], reps: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _round(x, s, draft_flags, verify_flags)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _round(x, s, draft_flags, verify_flags)
    ms = 1e3 * _time(graph.replay, "cuda", reps)
    del graph
    return ms


def _host_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[..., V] float32 probabilities after temperature and top-p, on the host's terms (a sort and
    a scatter per call; `temperature` > 0)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def _host_accept(draft: list[int], draft_probs: torch.Tensor, probs: torch.Tensor,
                 gen: torch.Generator) -> int:
    """Rejection sampling of one request's `draft` with a host read per decision: the accepted
    draft tokens (the replacement or bonus token drawn as well)."""
    uniforms = torch.rand(len(draft), generator=gen, device=gen.device)
    for j, token in enumerate(draft):
        if bool(uniforms[j] * draft_probs[j, token] < probs[j, token]):
            continue
        residual = (probs[j] - draft_probs[j]).clamp_min(0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else probs[j]
        torch.multinomial(residual[None], 1, generator=gen).item()
        return j
    torch.multinomial(probs[len(draft)][None], 1, generator=gen).item()
    return len(draft)


def _old_round(x: dict[str, torch.Tensor], s: int, gens: list[torch.Generator]) -> list[int]:
    b = x["seed"].shape[0]
    accepts = []
    drafts = [[] for _ in range(b)]
    qs = [[] for _ in range(b)]
    for k in range(s):                      # as EagleWorker._draft: per step, per request
        for i in range(b):
            q = _host_probs(x["draft_logits"][k, i][None], 0.8, 0.95)
            drafts[i].append(int(torch.multinomial(q, 1, generator=gens[i])))
            qs[i].append(q[0])
    for i in range(b):                      # as EagleWorker._verify
        p = _host_probs(x["target_logits"][i], 0.8, 0.95)
        accepts.append(_host_accept(drafts[i], torch.stack(qs[i]), p, gens[i]))
    return accepts


def _time(fn, device: str, reps: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--shapes", default="1x4,16x4,64x4,64x8", help="BxS,...")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--old-reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="print the top CUDA kernels of the general path at the last shape")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        x = _inputs(b, s, args.vocab, args.device)
        row = dict(batch=b, steps=s, vocab=args.vocab, device=args.device)
        row["eager_ms"] = 1e3 * _time(lambda: _round(x, s), args.device, args.reps)
        if args.device == "cuda":
            for name, (temperature, top_p, dflags, vflags) in VARIANTS.items():
                x["temperature"].fill_(temperature)
                x["top_p"].fill_(top_p)
                row[f"graph_ms_{name}"] = _graph_ms(x, s, dflags, vflags, args.reps)
            x["temperature"].fill_(0.8)
            x["top_p"].fill_(0.95)
        gens = [torch.Generator(device=args.device).manual_seed(i) for i in range(b)]
        row["old_host_loop_ms"] = 1e3 * _time(lambda: _old_round(x, s, gens), args.device,
                                              args.old_reps)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
    if args.profile and args.device == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                _round(x, s)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
