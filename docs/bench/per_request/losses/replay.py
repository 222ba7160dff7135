"""Replay of the per-request rule on the per-request oracle's accept tapes: a fast, approximate
stand-in for the benchmark when comparing variants of the rule (docs/results.md, "Per-request
budgets", "Where the rest goes").

Run from the repository root:
    python docs/bench/per_request/losses/replay.py BATCH ORACLE.jsonl [ORACLE.jsonl ...]

A tape is one request's accepted lengths, round after round, in the oracle's run (the depth-7
chain: every request drafts 7, so an accept below 7 is what it would accept at any budget >= 7).
The replay keeps BATCH requests in flight (admitted in tape order, shuffled by a seed), and per
round: the rule's estimates (adaptive_dist.policy.budgets, as shipped), its value curve, the
shape decided the round before and its budgets, each request's accept min(budget, the tape's
next entry); a request leaves when its tokens reach its tape's. Every round is priced by the
one-H200 8B table (shape_cost); the oracle replays the same tapes with every request drafting
its accept. Knobs are module constants: set them on `B` before calling `replay`.
Approximations: a tape entry is taken per round, not per output position, and a request at
depth 0 learns nothing (no catch-up shadow checks)."""
import collections
import gzip
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import adaptive_dist.policy.budgets as B  # noqa: E402
from adaptive_dist.cost_tables import load_model_costs  # noqa: E402
from adaptive_dist.shape import token_bucket  # noqa: E402

TABLE, VERIFY, _ = load_model_costs("docs/data/cost_tables/h200_tp1_llama3-8b.json")
CANDS = (0, 1, 3, 7)


def tapes(path):
    t = collections.defaultdict(list)
    for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path)):
        r = json.loads(line)
        if r["kind"] == "decode":
            for q in r["requests"]:
                t[q["id"]].append(q["accepted"])
    return [t[i] for i in sorted(t)]


def replay(tp, batch, rounds=240, oracle=False, shuffle=None, lam_decay=None):
    """tokens per second; `lam_decay`: pick the shape by V - lambda * cost, lambda the decayed
    mean of the chosen shapes' rates (the ratio of sums' optimum), instead of V / cost."""
    tp = list(tp)
    if shuffle is not None:
        random.Random(shuffle).shuffle(tp)
    ladder = tuple(VERIFY.tokens)
    tracker = B.SurvivalTracker(7)
    nxt, active = 0, []
    state_s, state_t, tok, cost, lam = 7, 0, 0, 0.0, None
    for _ in range(rounds):
        while len(active) < batch:
            i = nxt % len(tp)
            active.append([nxt, i, 0, 0, sum(a + 1 for a in tp[i])])
            nxt += 1
        ids = [a[0] for a in active]
        n = len(ids)
        ls = [min(tp[a[1]][a[3] % len(tp[a[1]])], 7) for a in active]
        if oracle:
            top = max(ls)
            s = next(c for c in CANDS if c >= top) if top else 0
            t = token_bucket(sum(x + 1 for x in ls), ladder)
            acc = ls
        else:
            prior = tracker.prior()
            surv = B.Estimates([tracker.survival(i, prior) for i in ids],
                               [tracker.due(i, 8) for i in ids])
            curve = B.value_curve(surv, CANDS, ladder)
            s, t = state_s, B.effective_tokens(state_t, n, state_s, ladder)
            bud = B.fill_budgets(surv, B.RoundShape(s, t))
            shape, rate = B.choose_shape(curve, CANDS, ladder, n, batch, TABLE, VERIFY)
            if lam_decay is not None and lam is not None:
                best = None
                for a, cs in enumerate(CANDS):
                    for b, ct in enumerate(ladder):
                        if ct < n:
                            continue
                        c = B.shape_cost(TABLE, VERIFY, cs, ct, batch)
                        v = curve[a * len(ladder) + b] / B.VALUE_SCALE
                        key = (v - lam * c, -ct, -cs)
                        if best is None or key > best:
                            best, shape, rate = key, B.RoundShape(cs, ct), v / c
            if lam_decay is not None:
                lam = rate if lam is None else lam_decay * lam + (1 - lam_decay) * rate
            state_s, state_t = shape.draft_forwards, shape.verify_tokens
            acc = [min(b, x) for b, x in zip(bud, ls)]
            tracker.observe(ids, list(bud), acc)
        cost += B.shape_cost(TABLE, VERIFY, s, t, batch)
        tok += n + sum(acc)
        for a, x in zip(active, acc):
            a[2] += x + 1
            a[3] += 1
        active[:] = [a for a in active if a[2] < a[4]]
    return tok / cost


if __name__ == "__main__":
    batch = int(sys.argv[1])
    for path in sys.argv[2:]:
        tp = tapes(path)
        ratios = [replay(tp, batch, shuffle=s) / replay(tp, batch, oracle=True, shuffle=s)
                  for s in range(4)]
        print(f"{path}: the rule over the oracle, 4 admission orders: "
              f"{' '.join(f'{r:.4f}' for r in ratios)} (mean {sum(ratios) / 4:.4f})")
