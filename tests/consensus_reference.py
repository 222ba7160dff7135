"""An independent single-process reference of the policy (docs/policy.md), used to check multi-rank runs.

Written separately from ``adaptive_dist.policy`` on purpose: it simulates every rank's EMA and the
cluster-wide decision from all ranks' traces in one loop, straight from the rules in docs/policy.md.
Every cluster-wide sum of floats is the exactly rounded sum of its terms (``_exact``, math.fsum:
the order the ranks' terms meet in does not matter).
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path


def simulate(traces: list[list[dict]], cfg: dict, policy: str) -> list[dict]:
    """Expected output records (sorted by round, rank) for ``traces`` (one list per rank).

    ``cfg`` is the effective configuration as ``AdaptiveConfig.to_dict()`` gives it (for goodput
    with ``round_cost``, ``switch_margin`` and ``probe_every``). A round may
    carry ``"shadow": [hits, checks, rows]`` (goodput at depth 0: the head's guesses checked by
    the engine's catch-up), or ``"shadow": None`` (the engine reported none that round); without
    the key a depth-0 round reports what a replay derives (one check per request)."""
    cand = sorted(cfg["candidate_steps"])
    idx = cand.index(cfg["initial_steps"])
    world = len(traces)
    goodput = policy == "goodput"
    start = float(cfg["initial_steps"] - 1)
    ema = [max(start, 0.0) if goodput else start] * world
    fail = [1.0] * world
    weight = [0] * world
    unseen = [0] * world   # depth-0 rounds with requests since the rank's EMAs last moved
    measured = [False] * world   # the rank's EMAs moved on a measurement (not start values)
    counted, last_switch = 0, None
    points_since_switch = 0
    buckets = sorted(cfg["graph_buckets"])
    alpha = cfg["ema_alpha"]
    out = []
    for r in range(max(len(t) for t in traces)):
        steps = cand[idx]
        rounds = [t[r] if r < len(t) else {"accept": []} for t in traces]
        batches = [len(x["accept"]) for x in rounds]
        for k, x in enumerate(rounds):
            acc = [min(a, steps) for a in x["accept"]]
            if acc and not (goodput and steps == 0):
                rejected = len([a for a in acc if a < steps])
                a_k = alpha
                if goodput and cfg.get("reset_nats", 0) > 0 and (not measured[k] or _reference_nats(
                        sum(acc), rejected, ema[k], fail[k]) > cfg["reset_nats"]):
                    a_k = 1.0   # the first measurement, or a surprise: restart from this round
                measured[k] = True
                ema[k] = (1.0 - a_k) * ema[k] + a_k * (sum(acc) / len(acc))
                fail[k] = (1.0 - a_k) * fail[k] + a_k * (rejected / len(acc))
                weight[k] += len(acc)
                unseen[k] = 0
            elif goodput and steps == 0:
                unseen[k] += 1 if acc else 0
                # depth-1 observations, share hits / checks: the engine's report, or (a replayed
                # trace) one check per request, a hit when its unlimited accept is >= 1
                report = x["shadow"] if "shadow" in x else (
                    len([a for a in x["accept"] if a >= 1]), len(x["accept"]), len(x["accept"]))
                if report is not None and report[1] > 0:
                    hits, checks, rows = report
                    if not measured[k] and cfg.get("reset_nats", 0) > 0:
                        ema[k], fail[k] = hits / checks, 1.0 - hits / checks   # the first
                    else:
                        # one update per round since the EMAs last moved, all with this share
                        for _ in range(max(unseen[k], 1)):
                            ema[k] = (1.0 - alpha) * ema[k] + alpha * (hits / checks)
                            fail[k] = (1.0 - alpha) * fail[k] + alpha * (1.0 - hits / checks)
                    measured[k] = True
                    unseen[k] = 0
                    weight[k] += rows
        eligible = all(x.get("can_graph", True) for x in rounds)
        graph = eligible and max(batches) <= buckets[-1]
        pad = min(b for b in buckets if b >= max(batches)) if graph else max(batches)
        if sum(batches) == 0:
            continue
        counted += 1
        live = [(e, w) for e, w in zip(ema, weight) if w > 0]
        if not live:
            g = None
        elif cfg["reducer"] in ("weighted_mean", "mixture"):
            g = _exact(w * e for e, w in live) / _exact(w for _, w in live)
        elif cfg["reducer"] == "min":
            g = min(e for e, _ in live)
        else:
            g = max(e for e, _ in live)
        point = counted > cfg["warmup_batches"] and (counted - cfg["warmup_batches"]) % cfg["update_interval"] == 0
        if point:
            points_since_switch += 1
        new = idx
        probe = False
        dwell_ok = last_switch is None or counted - last_switch >= cfg["min_dwell_rounds"]
        if policy == "ema" and point and g is not None and dwell_ok:
            while new > 0 and g <= cand[new - 1] - 0.5 + cfg["down_hysteresis"]:
                new -= 1
            if new == idx:
                while new < len(cand) - 1 and g > cand[new] - 0.5 + cfg["up_hysteresis"]:
                    new += 1
        if goodput:
            rate = _reference_rate(ema, fail, weight, cfg["reducer"])
            row_key, costs = _reference_costs(cfg["round_cost"], pad)
            if point and dwell_ok and steps == 0 and rate is None:   # no signal: probe
                if points_since_switch >= cfg["probe_every"]:
                    new, probe = idx + 1, True
            elif point and dwell_ok and rate is not None:
                if cfg["reducer"] == "mixture":   # each live rank's own E(S), weighted
                    live = [k for k in range(world) if weight[k] > 0]
                    rates = [1.0 if ema[k] + fail[k] == 0 else ema[k] / (ema[k] + fail[k])
                             for k in live]
                    total_w = _exact(weight[k] for k in live)
                    scores = []
                    for s in cand:
                        mixed = _exact(weight[k] * _reference_expected(rk, s)
                                       for k, rk in zip(live, rates))
                        scores.append((1.0 + mixed / total_w) / costs[str(s)])
                else:
                    scores = [(1.0 + _reference_expected(rate, s)) / costs[str(s)]
                              for s in cand]
                best = max(range(len(cand)), key=lambda i: (scores[i], -i))
                if best != idx and scores[best] > (1.0 + cfg["switch_margin"]) * scores[idx]:
                    new = best
        if goodput and point and steps == 0 and rate is not None:
            points_since_switch = 0   # a signal at depth 0: the probe wait starts again
        for k in range(world):
            rec = {"round": r, "rank": k, "steps": steps, "local_ema": ema[k],
                   "global_ema": g, "switched": new != idx, "graph": graph}
            if goodput:
                rec.update(local_ema_fail=fail[k], accept_rate=rate, cost_row=row_key,
                           probe=probe)
            out.append(rec)
        if point:
            weight = [0] * world
        if new != idx:
            last_switch = counted
            points_since_switch = 0
        idx = new
    return out


def _exact(terms) -> float:
    """The exact sum of the float terms, rounded once (+0.0 for zero)."""
    return math.fsum(terms) + 0.0


def _reference_nats(accepted: int, rejected: int, ema: float, fail: float) -> float:
    """The round's log-likelihood ratio (docs/policy.md, goodput's reset): its own rate
    against the rank's EMAs' rate held to [0.01, 0.99]."""
    if accepted + rejected == 0:
        return 0.0
    rank_rate = 1.0 if ema + fail == 0 else ema / (ema + fail)
    rank_rate = min(0.99, max(0.01, rank_rate))
    own = accepted / (accepted + rejected)
    out = 0.0
    if accepted > 0:
        out += accepted * math.log(own / rank_rate)
    if rejected > 0:
        out += rejected * math.log((1.0 - own) / (1.0 - rank_rate))
    return out


def _reference_rate(ema: list[float], fail: list[float], weight: list[int],
                    reducer: str):
    """The cluster's acceptance rate (docs/policy.md, goodput), None without live ranks."""
    live = [k for k in range(len(ema)) if weight[k] > 0]
    if not live:
        return None
    if reducer == "weighted_mean":
        a = _exact(weight[k] * ema[k] for k in live)
        f = _exact(weight[k] * fail[k] for k in live)
        return 1.0 if a + f == 0 else a / (a + f)
    rates = [1.0 if ema[k] + fail[k] == 0 else ema[k] / (ema[k] + fail[k]) for k in live]
    if reducer == "mixture":
        return _exact(weight[k] * r for k, r in zip(live, rates)) / _exact(weight[k] for k in live)
    return min(rates) if reducer == "min" else max(rates)


def _reference_costs(table: dict, pad: int):
    """(bucket key of the row or None for a flat table, {steps: cost}) for padded batch ``pad``."""
    if not isinstance(next(iter(table.values())), dict):
        return None, table
    keys = sorted(int(b) for b in table)
    fits = [b for b in keys if b >= pad]
    key = fits[0] if fits else keys[-1]
    return key, table[str(key)]


def _reference_expected(p: float, steps: int) -> float:
    """p + p^2 + ... + p^steps, each power the previous one times p, added left to right."""
    powers = []
    for _ in range(steps):
        powers.append(p * powers[-1] if powers else p)
    total = 0.0
    for x in powers:
        total += x
    return total


def adversarial_traces(world: int, rounds: int, seed: int) -> list[list[dict]]:
    """Ranks in different phases, idle stretches, bursts past the graph buckets, graph-ineligible
    rounds, accept lengths that sit on thresholds, and ranks whose traces end early."""
    rng = random.Random(seed)
    traces = []
    for rank in range(world):
        n = rounds if rank % 2 == 0 else rng.randint(rounds // 3, rounds)
        lines, r = [], 0
        while r < n:
            kind = rng.choice(["low", "mid", "high", "idle", "edge"])
            for _ in range(min(n - r, rng.randint(4, 40))):
                if kind == "idle":
                    lines.append({"accept": []})
                else:
                    batch = rng.randint(1, 6) if rng.random() > 0.05 else rng.randint(65, 80)
                    if kind == "edge":  # values that land the EMA near thresholds
                        acc = [rng.choice([0, 1, 2, 3]) for _ in range(batch)]
                    else:
                        p = {"low": 0.05, "mid": 0.7, "high": 0.98}[kind]
                        acc = []
                        for _ in range(batch):
                            a = 0
                            while a < 12 and rng.random() < p:
                                a += 1
                            acc.append(a)
                    line = {"accept": acc, "num_tokens": batch * 3}
                    if rng.random() < 0.03:
                        line["can_graph"] = False
                    lines.append(line)
                r += 1
        traces.append(lines)
    return traces


def phased_traces(world: int, rounds: int, seed: int, low: float = 0.05,
                  high: float = 0.95) -> list[list[dict]]:
    """Every rank at acceptance ``low`` for the first half of the rounds and ``high`` after
    (per-token acceptance probability), with idle rounds and different batch sizes per rank."""
    rng = random.Random(seed)
    traces = []
    for _ in range(world):
        lines = []
        for r in range(rounds):
            if rng.random() < 0.1:
                lines.append({"accept": []})
                continue
            p = low if r < rounds // 2 else high
            acc = []
            for _ in range(rng.randint(1, 6)):
                a = 0
                while a < 12 and rng.random() < p:
                    a += 1
                acc.append(a)
            lines.append({"accept": acc, "num_tokens": 3 * len(acc)})
        traces.append(lines)
    return traces


def write_traces(traces: list[list[dict]], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, lines in enumerate(traces):
        with (directory / f"rank{rank}.jsonl").open("w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


# ---- the reduced vector, written out field by field (issue 37: the layout's encoder is tuned) ----
def reduced_vector(layout, vec) -> list[int]:
    """``consensus.ReducedLayout.encode`` as its docstring lays the vector out, one field at a
    time, with its own fixed-point digits (``float.as_integer_ratio``) and float keys: the tuned
    encoder must give this very list."""
    import struct
    from adaptive_dist import consensus as c
    from adaptive_dist.policy.rules import acceptance_rate

    def key(x: float) -> int:
        b = struct.unpack("<q", struct.pack("<d", x))[0]
        return b if b >= 0 else -(b & 0x7FFFFFFFFFFFFFFF)

    def digits(t: float) -> tuple[list[int], bool]:
        """t·2^1074 in LIMBS signed base-2^40 digits, and whether it fit (a term that does not
        leaves its low digits, a non-finite one none: the check fails, the gather decides)."""
        out = [0] * c.LIMBS
        if not math.isfinite(t):
            return out, False
        n, d = t.as_integer_ratio()               # d a power of two, at most 2^1074
        v = abs(n) * (2 ** c.FRACTION_BITS // d)
        sign = -1 if n < 0 else 1
        for k in range(c.LIMBS):
            out[k] = sign * (v % 2 ** c.LIMB_BITS)
            v //= 2 ** c.LIMB_BITS
        return out, v == 0

    w, e, f = vec.weight, vec.ema, vec.ema_fail
    low = -(2 ** 63) + 1
    n_exact = len(layout.sums) + len([s for s in layout.mix_steps if s])
    sums = [vec.n_req, vec.prev_n_req, w, 1 if w > 0 else 0]
    exact = True
    if w > 0:
        p = acceptance_rate(e, f)
        terms = [{"ema_sum": w * e, "fail_sum": w * f, "rate_sum": w * p}[n] for n in layout.sums]
        terms += [w * layout.expected(p, s) for s in layout.mix_steps if s]
        for t in terms:
            d, fits = digits(t)
            exact = exact and fits
            sums += d
        extremes = [key(e), key(-e), key(p), key(-p)]
    else:
        sums += [0] * (c.LIMBS * n_exact)
        extremes = [low] * 4
    sums += list(vec.values)
    period = vec.period
    maxes = [vec.n_req, vec.num_tokens, vec.n_extend, vec.extend_len, int(not vec.can_graph),
             int(not vec.done), -vec.seq, int(vec.leave), int(period < 0),
             key(period) if math.isfinite(period) else low, int(not exact)] + extremes
    for name in c.MUST_AGREE:
        v = c.REDUCED_MAGIC if name == "magic" else int(getattr(vec, name))
        maxes += [v, -v]
    return sums + maxes
