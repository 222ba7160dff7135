"""Where goodput_pr's tokens/s go against the per-request oracle, from two round logs of one
mixed stream (scripts.bench.adaptive --round-log DIR --policies goodput_pr oracle_pr).

Run from the repository root:
    python docs/bench/per_request/losses/decompose.py RULE.jsonl ORACLE.jsonl BATCH

Per round of the rule: its price (the table's shape_cost at its (S, T)); the cheapest shape that
holds the same accepts (S* the smallest candidate >= the largest accept, T* the rung holding
sum(accept + 1)); the price split into the draft forwards beyond S*, the verify rungs the rejected
drafts took, and padding beyond the rung the drafts needed; the draft steps at which few rows
drafted. The oracle's rounds priced as scripts.bench.adaptive prices them."""
import collections, gzip, json, sys
from adaptive_dist.cost_tables import load_model_costs
from adaptive_dist.policy.budgets import shape_cost
from adaptive_dist.shape import token_bucket
table, verify, _ = load_model_costs('docs/data/cost_tables/h200_tp1_llama3-8b.json')
CANDS = [0, 1, 3, 7]
rungs = verify.tokens

def load(path):
    with (gzip.open(path, 'rt') if path.endswith('.gz') else open(path)) as fh:
        return [json.loads(l) for l in fh if '"decode"' in l]

def analyse(rule_path, oracle_path, batch):
    R, O = load(rule_path), load(oracle_path)
    cost = lambda s, t: shape_cost(table, verify, s, t, batch)
    D = lambda s: cost(s, rungs[-1]) - verify.cost(rungs[-1])
    tot = collections.Counter()
    for r in R:
        reqs = r['requests']; n = len(reqs)
        S, T = r['draft_forwards'], r['padded_tokens']
        acc = [q['accepted'] for q in reqs]; dr = [q['draft'] for q in reqs]
        top = max(acc); Sst = next(c for c in CANDS if c >= top) if top else 0
        Tst = token_bucket(sum(a + 1 for a in acc), rungs)
        Td = token_bucket(sum(d + 1 for d in dr), rungs)
        c = cost(S, T)
        tot['rounds'] += 1; tot['tokens'] += n + sum(acc); tot['cost'] += c
        tot['cheapest'] += cost(Sst, Tst)
        tot['draft_excess'] += D(S) - D(Sst)
        tot['rejected_verify'] += verify.cost(Td) - verify.cost(Tst) if Td > Tst else 0
        tot['padding'] += verify.cost(T) - verify.cost(max(Td, Tst)) if T > max(Td, Tst) else 0
        tot['rejected_tokens'] += sum(d - a for d, a in zip(dr, acc))
        tot['pad_tokens'] += T - sum(d + 1 for d in dr)
        tot['S%d' % S] += 1
        if S:
            per = D(S) / S
            for j in range(1, S + 1):
                rows = sum(1 for d in dr if d >= j)
                tot['df_time'] += per
                if rows <= max(2, n // 8): tot['df_few'] += per
                if rows == 0: tot['df_none'] += per
        tot['shapes', S, T] += 1
        tot['T'] += T
    # oracle run
    ot = collections.Counter()
    for r in O:
        acc = [q['accepted'] for q in r['requests']]; n = len(acc)
        top = max(acc); Sst = next(c for c in CANDS if c >= top) if top else 0
        Tst = token_bucket(sum(a + 1 for a in acc), rungs)
        ot['rounds'] += 1; ot['tokens'] += n + sum(acc); ot['cost'] += cost(Sst, Tst)
        ot['S%d' % Sst] += 1; ot['T'] += Tst; ot['shapes', Sst, Tst] += 1
    otop = sorted(((v, k) for k, v in ot.items() if isinstance(k, tuple)), reverse=True)[:5]
    rate = tot['tokens'] / tot['cost']; orate = ot['tokens'] / ot['cost']
    print(f"== {rule_path}")
    print(f"rule: {tot['rounds']} rounds, {tot['tokens']} tok, {tot['cost']*1e3:.0f} ms -> {rate:.0f} tok/s; "
          f"oracle {ot['rounds']} rounds {ot['tokens']} tok {ot['cost']*1e3:.0f} ms -> {orate:.0f}; ratio {rate/orate:.4f}")
    print(f"  tokens/round rule {tot['tokens']/tot['rounds']:.2f} oracle {ot['tokens']/ot['rounds']:.2f}; "
          f"ms/round rule {tot['cost']/tot['rounds']*1e3:.3f} (cheapest for its accepts {tot['cheapest']/tot['rounds']*1e3:.3f}) oracle {ot['cost']/ot['rounds']*1e3:.3f}")
    for k in ('draft_excess', 'rejected_verify', 'padding'):
        print(f"  {k:16s} {tot[k]/tot['cost']*100:5.1f}% of the rule's time")
    print(f"  shape efficiency (cheapest/actual) {tot['cheapest']/tot['cost']:.4f}; "
          f"yield at cheapest shapes rule {tot['tokens']/tot['cheapest']:.0f} vs oracle {orate:.0f} tok/s: {tot['tokens']/tot['cheapest']/orate:.4f}")
    print(f"  rejected tokens {tot['rejected_tokens']} ({tot['rejected_tokens']/tot['rounds']:.1f}/round), padding tokens {tot['pad_tokens']/tot['rounds']:.1f}/round, mean T {tot['T']/tot['rounds']:.1f} (oracle {ot['T']/ot['rounds']:.1f})")
    print(f"  S: rule " + ' '.join(f"{s}:{tot['S%d'%s]}" for s in CANDS) + " | oracle " + ' '.join(f"{s}:{ot['S%d'%s]}" for s in CANDS))
    print(f"  draft forward time {tot['df_time']/tot['cost']*100:.1f}% of the rule's; steps with <= max(2, n/8) rows drafting {tot['df_few']/tot['cost']*100:.2f}%, with none {tot['df_none']/tot['cost']*100:.2f}%")
    top = sorted(((v, k) for k, v in tot.items() if isinstance(k, tuple)), reverse=True)[:5]
    print('  rule shapes (S, T): ' + ', '.join(f"({k[1]},{k[2]}) x{v}" for v, k in top))
    print('  oracle shapes (S, T): ' + ', '.join(f"({k[1]},{k[2]}) x{v}" for v, k in otop))
    return tot, ot

if __name__ == '__main__':
    b = int(sys.argv[3])
    analyse(sys.argv[1], sys.argv[2], b)
