"""Draft trees as goodput candidates (issue 35 §2): a tree's price from the cost table and its
expected accepted tokens from the chain's acceptance rate (docs/policy.md, "Draft trees").

A goodput run with ``tree_candidates`` chooses, at each decision point, among its chain depths
(``candidate_steps``) and its trees ``TreeShape(S, K, N)``: candidate index ``i <
len(candidate_steps)`` is the chain of depth ``candidate_steps[i]``, index ``len(candidate_steps)
+ j`` the tree ``tree_candidates[j]``. Nothing here knows about models: a tree is three numbers,
priced from two tables and scored from one rate.

**Price** (``tree_round_cost``). The cost table prices a chain round of depth S at padded batch
b (``round_cost``: every row drafting every step, the verify forward over the rung holding ``b
(S + 1)`` tokens) and the verify forward alone at each token rung (``verify_cost``). Take the
verify forward out of a chain round: ``D(S, b) = cost(S, b) - verify(rung(b (S + 1)))``, the
round's draft work (the first step's logits, the S - 1 head forwards over b rows, draft-extend
over ``b (S + 1)`` rows, the acceptance). It is linear in S: ``D(S, b) = D₁(b) + (S - 1) h(b)``
with ``h(b)`` one draft forward over b rows, taken from the row's shallowest and deepest positive
depths (``draft_forward_cost``; the depths between are the check, ``derivation_check``: on the
H200 8B table depth 3 is derived within 0.12% of the measured round at batch 1-32, 1.2% at 64). A tree
round runs the same first step and acceptance, S - 1 head forwards over ``b K`` rows and one verify
over ``b N`` tokens: ``cost = D₁(b) + (S - 1) h(b K) + verify(b N)``. ``h`` at ``b K`` rows is
interpolated between the table's batch buckets (linear), and past the largest bucket the line
through the two largest is extended; a verify count past the largest rung, likewise (both are
estimates, ``extrapolated``). Left out (priced 0): what a tree round does beyond a chain's
(ranking the nodes, the tree mask, the path's KV commit) and draft-extend's growth with S
counted at b K rows instead of b (so a tree's draft steps are priced a little high).

**Expected accepted tokens** (``tree_rate``, ``expected_tree``). A chain at per-position
acceptance rate p accepts ``E(p, S) = p + ... + p^S``. A tree verifies, below each accepted
node, the head's K best children (as many as the budget N leaves): the target's token is among
them with probability ``c = p + (1 - p) f``, where ``f`` is the share of the chain's misses that
a sibling covers, per tree shape. Measured on the bundled pair, ``f`` is about the same in the
code and high-entropy regimes (p 0.87 and 0.13) for a tree whose budget leaves room for siblings
at every level (within 0.05 accepted tokens per round); for a tree whose budget is small for its
steps it over-predicts by 5-11% where the head is sure and under-predicts where it is not
(docs/policy.md, "Draft trees"). One ``f`` per shape (default by K, ``DEFAULT_COVERAGE``) turns
the rate the policy already tracks into every tree's expectation: ``E(c, S)``. While a tree runs, its
rounds measure c, not p: the policy reads the chain-equivalent ``p = (c - f) / (1 - f)``
(``chain_rate``), so every candidate is scored from one rate, whatever shape ran.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from adaptive_dist.config import ConfigError, RoundCost, VerifyCost
from adaptive_dist.shape import TreeShape, token_bucket

TREE_CODE = 1 << 16
"""A tree's code in the round vector's must-agree ``tokens`` column: ``K * TREE_CODE + N``
(0: a chain), so a rank that would run another tree (another K or N at the same S) differs in
the pre-flight check, before any device collective."""

DEFAULT_COVERAGE = {2: 0.35, 4: 0.55, 8: 0.7}
"""``f`` by top-k K where a candidate gives none: the share of the chain's misses a sibling
covers (docs/policy.md, "Draft trees": fitted on the bundled pair's accepted lengths)."""


def parse_tree_candidates(value: Any) -> tuple[tuple[int, int, int, float], ...]:
    """``tree_candidates``: a list of ``[S, K, N]`` or ``[S, K, N, f]`` (steps, top-k >= 2,
    verify tokens per request with the root, sibling coverage f in [0, 1)); also "SxKxN"
    strings. -> tuples (S, K, N, f); ``ConfigError`` naming the entry."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"tree_candidates={value!r}: must be a list of [steps, topk, tokens] "
                          f"(optionally [steps, topk, tokens, coverage])")
    out = []
    for entry in value:
        item = entry
        if isinstance(item, str):
            try:
                item = [int(x) for x in item.lower().split("x")]
            except ValueError:
                item = None
        if (not isinstance(item, (list, tuple)) or len(item) not in (3, 4)
                or any(type(x) is not int for x in item[:3])):
            raise ConfigError(f"tree_candidates entry {entry!r}: must be [steps, topk, tokens] "
                              f"or [steps, topk, tokens, coverage] (integers, coverage a number)"
                              f" or 'SxKxN'")
        s, k, n = item[:3]
        if k < 2:
            raise ConfigError(f"tree_candidates entry {entry!r}: topk {k} must be >= 2 (top-k 1 "
                              f"is the chain: list its depth in candidate_steps)")
        try:
            TreeShape(s, k, n)
        except ValueError as err:
            raise ConfigError(f"tree_candidates entry {entry!r}: {err}") from None
        f = item[3] if len(item) == 4 else default_coverage(k)
        if type(f) not in (int, float) or not 0 <= f < 1:
            raise ConfigError(f"tree_candidates entry {entry!r}: coverage {f!r} must be a "
                              f"number in [0, 1)")
        out.append((s, k, n, float(f)))
    if len({t[:3] for t in out}) != len(out):
        raise ConfigError(f"tree_candidates={value!r}: a tree is listed twice")
    return tuple(sorted(out))


def default_coverage(topk: int) -> float:
    """``DEFAULT_COVERAGE`` at ``topk`` (linear between the listed K, the last beyond)."""
    ks = sorted(DEFAULT_COVERAGE)
    if topk <= ks[0]:
        return DEFAULT_COVERAGE[ks[0]]
    for lo, hi in zip(ks, ks[1:]):
        if topk <= hi:
            a, b = DEFAULT_COVERAGE[lo], DEFAULT_COVERAGE[hi]
            return a + (b - a) * (topk - lo) / (hi - lo)
    return DEFAULT_COVERAGE[ks[-1]]


def tree_code(topk: int, tokens: int) -> int:
    """``TREE_CODE``'s code of a tree (0 for a chain)."""
    return topk * TREE_CODE + tokens if topk > 1 else 0


# ---- the candidates --------------------------------------------------------------------------
def candidate_count(cfg: Any) -> int:
    """Chains and trees of a config (``tree_candidates`` read where the policy has the key)."""
    return len(cfg.candidate_steps) + len(trees_of(cfg))


def trees_of(cfg: Any) -> tuple[tuple[int, int, int, float], ...]:
    """The config's tree candidates (() when its policy has none)."""
    try:
        return tuple(cfg.tree_candidates or ())
    except AttributeError:
        return ()


def candidate_tree(cfg: Any, index: int) -> Optional[tuple[int, int, int, float]]:
    """The tree of candidate ``index`` (None: a chain)."""
    chains = len(cfg.candidate_steps)
    return trees_of(cfg)[index - chains] if index >= chains else None


def candidate_steps_of(cfg: Any, index: int) -> int:
    """Draft forwards of candidate ``index``: the chain's depth or the tree's steps."""
    tree = candidate_tree(cfg, index)
    return tree[0] if tree is not None else cfg.candidate_steps[index]


def candidate_name(cfg: Any, index: int) -> str:
    tree = candidate_tree(cfg, index)
    return (f"tree {tree[0]}x{tree[1]}x{tree[2]}" if tree is not None
            else f"chain {cfg.candidate_steps[index]}")


# ---- price -----------------------------------------------------------------------------------
def verify_seconds(verify: VerifyCost, tokens: int) -> tuple[float, bool]:
    """(seconds of the verify forward over ``tokens`` tokens, extrapolated?): the smallest
    measured count holding them (the engine pads to its rung); past the largest, the line
    through the two largest counts extended."""
    if tokens <= verify.tokens[-1]:
        return verify.cost(token_bucket(tokens, verify.tokens)), False
    if len(verify.tokens) < 2:
        return verify.costs[-1], True
    (t0, t1), (c0, c1) = verify.tokens[-2:], verify.costs[-2:]
    return c1 + (c1 - c0) * (tokens - t1) / (t1 - t0), True


def _row(table: RoundCost, batch: int) -> tuple[int, dict[int, float]]:
    from adaptive_dist.policy.goodput import cost_row

    i = cost_row(table, batch)
    bucket = table.buckets[i] if table.buckets is not None else batch
    return bucket, dict(table.rows[i])


def draft_part(table: RoundCost, verify: VerifyCost, row: dict[int, float], bucket: int,
               steps: int) -> float:
    """``D(S, b)``: the chain round at ``steps`` in this row less its verify forward."""
    return row[steps] - verify_seconds(verify, bucket * (steps + 1))[0]


def _line(table: RoundCost, verify: VerifyCost, bucket: int, row: dict[int, float]
          ) -> tuple[float, float]:
    """(D₁, h) of a row: the shallowest and deepest positive depths' draft parts."""
    depths = sorted(s for s in row if s > 0)
    if len(depths) < 2:
        raise ConfigError(f"tree_candidates: pricing a tree needs the chain's cost at two "
                          f"positive depths in every round_cost row; a row has {sorted(row)}")
    lo, hi = depths[0], depths[-1]
    d_lo, d_hi = (draft_part(table, verify, row, bucket, s) for s in (lo, hi))
    h = (d_hi - d_lo) / (hi - lo)
    return d_lo - (lo - 1) * h, h


def draft_forward_cost(table: RoundCost, verify: VerifyCost, rows: int) -> tuple[float, bool]:
    """(seconds of one head forward over ``rows`` rows, extrapolated?): ``h(b)`` of each batch
    bucket (``_line``), linear in the rows between the buckets around ``rows``, past the
    largest bucket the line through the two largest extended (never below the largest's)."""
    if table.buckets is None:
        row = dict(table.rows[0])
        return _line(table, verify, rows, row)[1], False
    hs = [(b, _line(table, verify, b, dict(r))[1]) for b, r in zip(table.buckets, table.rows)]
    if rows <= hs[0][0]:
        return hs[0][1], False
    for (b0, h0), (b1, h1) in zip(hs, hs[1:]):
        if rows <= b1:
            return h0 + (h1 - h0) * (rows - b0) / (b1 - b0), False
    if len(hs) < 2:
        return hs[-1][1], True
    (b0, h0), (b1, h1) = hs[-2:]
    return max(h1, h1 + (h1 - h0) * (rows - b1) / (b1 - b0)), True


def tree_round_cost(table: RoundCost, verify: VerifyCost, steps: int, topk: int, tokens: int,
                    batch: int, overhead: float = 0.0) -> float:
    """Seconds of a tree round ``(S, K, N)`` at padded batch ``batch``:
    ``D₁(b) + (S - 1) h(b K) + verify(b N)`` (module docstring), ``b`` the row's bucket, plus
    ``overhead`` (goodput's ``tree_overhead``: what a tree round runs beyond a chain's)."""
    bucket, row = _row(table, batch)
    d1, _ = _line(table, verify, bucket, row)
    h, _ = draft_forward_cost(table, verify, bucket * topk)
    v, _ = verify_seconds(verify, bucket * tokens)
    return d1 + (steps - 1) * h + v + overhead


def chain_round_cost(table: RoundCost, steps: int, batch: int) -> float:
    """The table's own chain round (what a chain candidate is priced at)."""
    return _row(table, batch)[1][steps]


def derivation_check(table: RoundCost, verify: VerifyCost) -> list[dict[str, Any]]:
    """Per batch bucket and positive depth the table measured: the measured chain round against
    the one derived as a tree of top-k 1 (``D₁ + (S - 1) h(b) + verify(b (S + 1))``). The row's
    shallowest and deepest depths fit the line, so the depths between are the check."""
    out = []
    for i, raw in enumerate(table.rows):
        bucket = table.buckets[i] if table.buckets is not None else 1
        row = dict(raw)
        d1, h = _line(table, verify, bucket, row)
        for s in sorted(x for x in row if x > 0):
            derived = d1 + (s - 1) * h + verify_seconds(verify, bucket * (s + 1))[0]
            out.append({"batch": bucket, "steps": s, "measured": row[s], "derived": derived,
                        "error": derived / row[s] - 1.0})
    return out


# ---- expected accepted tokens ---------------------------------------------------------------
def tree_rate(p: float, coverage: float) -> float:
    """The per-level rate of a tree whose siblings cover ``coverage`` of the chain's misses:
    ``c = p + (1 - p) f``."""
    return p + (1.0 - p) * coverage


def chain_rate(c: float, coverage: float) -> float:
    """The chain-equivalent rate of a tree's measured per-level rate ``c``:
    ``(c - f) / (1 - f)``, held to [0, 1]."""
    return min(1.0, max(0.0, (c - coverage) / (1.0 - coverage)))


def expected_tree(p: float, steps: int, coverage: float) -> float:
    """Expected accepted draft tokens of a tree of ``steps`` steps at chain rate ``p``."""
    from adaptive_dist.policy.goodput import expected_accepted

    return expected_accepted(tree_rate(p, coverage), steps)


def shape_scores(cfg: Any, p: float, batch: int, table: RoundCost, verify: VerifyCost,
                 chain_scores: Sequence[float]) -> list[float]:
    """The scores of every candidate: the chains' (``chain_scores``, as goodput computes them)
    then every tree's ``(1 + E(c, S)) / tree_round_cost``."""
    out = list(chain_scores)
    for s, k, n, f in trees_of(cfg):
        out.append((1.0 + expected_tree(p, s, f))
                   / tree_round_cost(table, verify, s, k, n, batch, cfg.tree_overhead))
    return out


# ---- per-request trees (``per_request`` with ``tree_candidates``) ----------------------------
PER_REQUEST_TREE_CODE = 1 << 20
"""With per-request budgets the must-agree ``tokens`` column is the decided verify tokens ``T``
plus the tree's code times this (``T < 2**20``): a rank that would run another K or N, or a
chain where the others run a tree, differs there as one that would run another T does."""


def _level_rates(survival: Sequence[float], share: float, ran: float,
                 coverage: float) -> list[tuple[float, float]]:
    """Per position k of a request: (the chain's rate p(k), the tree's c(k) at ``coverage``).
    The observed conditional rate ``r(k) = s(k) / s(k - 1)`` of the tracker's calibrated
    survival ``s`` mixes rounds of both kinds: ``share`` of the request's recent drafted rounds
    were trees of coverage ``ran`` (their accepted depths measure a tree's per-level rate, not
    the chain's). The chain's rate is ``(1 - share) r + share chain_rate(r, ran)``; the tree's
    ``(1 - share) tree_rate(r, f) + share tree_rate((r - ran) / (1 - ran), f)`` (the second term
    unclamped inside, so a tree of the coverage that ran gets its observed rate back: a request
    whose trees miss is not lifted to ``f`` by the model), held to [0, 1]."""
    out, prev = [], 1.0
    for s in survival:
        r = s / prev if prev > 0 else 0.0
        prev = s
        if share > 0:
            raw = (r - ran) / (1.0 - ran)
            p = (1.0 - share) * r + share * min(1.0, max(0.0, raw))
            c = (1.0 - share) * tree_rate(r, coverage) + share * min(
                1.0, max(0.0, tree_rate(raw, coverage)))
        else:
            p, c = r, tree_rate(r, coverage)
        out.append((p, c))
    return out


def chain_survival(survival: Sequence[float], share: float = 0.0,
                   ran: float = 0.0) -> list[float]:
    """A request's chain survival ``s(1..)`` from the tracker's calibrated survival
    (``_level_rates``' chain rates multiplied; ``share`` 0: ``survival`` itself)."""
    if share <= 0:
        return list(survival)
    out, s = [], 1.0
    for p, _ in _level_rates(survival, share, ran, 0.0):
        s *= p
        out.append(s)
    return out


def tree_node_values(survival: Sequence[float], steps: int, topk: int, coverage: float,
                     tokens: int, share: float = 0.0, ran: float = 0.0) -> list[float]:
    """The estimated worth, in accepted tokens, of a request's ``N - 1`` verify nodes in a tree
    ``(S, K, N)``, in the order the device admits them (its best by cumulative draft
    log-probability), largest first.

    Per position k the request's chain rate ``p(k)`` and the tree's ``c(k) = p + (1 - p) f``
    (``_level_rates``: the per-batch trees' estimator, per request and position), ``s(k)`` and
    ``t(k)`` their running products: the chain's draft at depth k survives with ``s(k)``, and
    the tree holds the target's path at depth k with ``t(k)``, so its K - 1 siblings there share
    ``t(k) - s(k)``. The head ranks nodes by its own cumulative probability, which these stand
    in for: the chain's first draft first (the head's best node), then the other ``S K - 1``
    values sorted, the first ``N - 1`` kept (a sure head's chain comes first, an unsure head's
    siblings at the shallow levels before the deep chain). The kept siblings
    are then scaled so the whole tree is worth the per-batch estimator's ``E(c, S)`` (its ``f``
    is fitted per shape, the budget N included: the siblings a budget drops are in it), and the
    values sorted again."""
    rates = _level_rates(list(survival[:steps]) + [0.0] * (steps - len(survival)), share, ran,
                         coverage)
    nodes, s, t = [], 1.0, 1.0
    for p, c in rates:
        s *= p
        t *= c
        nodes.append((s, False))
        nodes.extend([(max(t - s, 0.0) / (topk - 1), True)] * (topk - 1))
    # the head's first choice at depth 1 outranks every other node (children never score above
    # their parents, siblings not above it): the device's first node whatever the estimates
    nodes = nodes[:1] + sorted(nodes[1:], key=lambda v: -v[0])
    kept = nodes[:tokens - 1]
    whole = expected_tree_rates(rates)
    mains = sum(v for v, sib in kept if not sib)
    sibs = sum(v for v, sib in kept if sib)
    scale = max(whole - mains, 0.0) / sibs if sibs > 0 else 1.0
    out = [kept[0][0]] + sorted((v * scale if sib else v for v, sib in kept[1:]), reverse=True)
    return _non_increasing(out) + [0.0] * (tokens - 1 - len(out))


def _non_increasing(values: Sequence[float]) -> list[float]:
    """``values`` made non-increasing with their sum and every prefix sum at a block's end
    kept: a run that rises is replaced by its mean (pool adjacent violators), so the fill, which
    admits a request's nodes in order, sees the head's first node at least as dear as what comes
    after it (it is the device's first whatever the estimates)."""
    blocks: list[list[float]] = []
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-1][0] / blocks[-1][1] > blocks[-2][0] / blocks[-2][1]:
            top = blocks.pop()
            blocks[-1][0] += top[0]
            blocks[-1][1] += top[1]
    out: list[float] = []
    for total, count in blocks:
        out.extend([total / count] * int(count))
    return out


def expected_tree_rates(rates: Sequence[tuple[float, float]]) -> float:
    """``E(c, S)`` at per-level tree rates (``_level_rates``' second terms)."""
    total, run = 0.0, 1.0
    for _, c in rates:
        run *= c
        total += run
    return total


class TreeBudgetRule:
    """Per-request budgets over chains and trees (``per_request`` with ``tree_candidates``): each
    request drafts a chain of its own depth, or verifies its own number of nodes ``N_i`` of the
    round's tree (0 .. N - 1: its ``N_i`` best by the head's cumulative log-probability, a
    subtree; 0: the root alone, the bonus token). The round's shape is agreed as for chains:
    candidate index ``i < len(candidate_steps)`` a chain of S draft forwards, ``len + j`` the
    tree ``j`` (S steps, top-k K, at most N tokens a request), and the verify tokens T, a rung.

    Where each part runs. On the host, from replica-shared data (the requests, their budgets and
    accepted depths, the shapes that ran): the estimates (``budgets.SurvivalTracker``), the node
    values (``tree_node_values``), the value curves, the shape and every request's ``N_i`` (the
    fill of ``budgets``, the same function as the chain's, over node values). On the device: the
    tree's drafting and which of its nodes are a request's ``N_i`` best (the head's cumulative
    log-probabilities never leave it); the host's node values stand in for them in the fill."""

    def __init__(self, config: Any, ladder: Sequence[int]) -> None:
        from adaptive_dist.policy.budgets import PerRequestRule

        self.config = config
        self.chains = PerRequestRule(config, ladder)   # the chain's rule and its tracker
        self.tracker = self.chains.tracker
        self.candidates = config.candidate_steps
        self.trees = trees_of(config)
        self.ladder = tuple(ladder)
        depth = max([max(self.candidates)] + [t[0] for t in self.trees] + [1])
        if depth > self.tracker.depth:
            from adaptive_dist.policy.budgets import SurvivalTracker

            self.tracker = self.chains.tracker = SurvivalTracker(depth)
        # per request: (decayed share of its drafted rounds that were trees, their coverage);
        # the rank's pooled counts (every request's prior) alike, per drafted round
        self.tree_share: dict[int, tuple[float, float]] = {}
        self.pool_share: tuple[float, float] = (0.0, 0.0)
        self._nodes: list[list[list[float]]] = []   # per tree: the round's requests' values

    @property
    def n_values(self) -> int:
        return (len(self.candidates) + len(self.trees)) * len(self.ladder)

    def survivals(self, rids: Sequence[int]) -> Any:
        """The chains' estimates (``budgets.Estimates``, taken back to the chain's rates where
        trees ran) and, kept for ``curve`` and ``budgets``, every tree's node values."""
        from adaptive_dist.policy.budgets import Estimates

        raw = self.chains.survivals(rids)
        chains, self._nodes = [], [[] for _ in self.trees]
        for rid, surv in zip(rids, raw):
            share, ran = self.tree_share.get(rid, self.pool_share)
            for j, (s, k, n, f) in enumerate(self.trees):
                self._nodes[j].append(tree_node_values(surv, s, k, f, n, share, ran))
            chains.append(chain_survival(surv, share, ran))
        return Estimates(chains, raw.due)

    def _tree_estimates(self, j: int, survivals: Any) -> Any:
        from adaptive_dist.policy.budgets import Estimates

        return Estimates(self._nodes[j], survivals.due)

    def curve(self, survivals: Any) -> tuple[int, ...]:
        """The chains' value curves (``budgets.value_curve``) then every tree's over its N - 1
        node places: ``(chains + trees) x rungs`` integers."""
        from adaptive_dist.policy.budgets import value_curve

        out = list(value_curve(survivals, self.candidates, self.ladder))
        for j, (s, k, n, f) in enumerate(self.trees):
            out.extend(value_curve(self._tree_estimates(j, survivals), [n - 1], self.ladder))
        return tuple(out)

    def shape_cost(self, index: int, tokens: int, batch: int) -> float:
        """Seconds of candidate ``index`` at ``tokens`` verify tokens and padded batch
        ``batch``: a chain's ``budgets.shape_cost``; a tree's ``D₁(b) + (S - 1) h(b K) +
        verify(T)`` (``tree_round_cost``'s terms with the verify at the round's rung)."""
        from adaptive_dist.policy.budgets import shape_cost

        cfg = self.config
        if index < len(self.candidates):
            return shape_cost(cfg.round_cost, cfg.verify_cost, self.candidates[index], tokens,
                              batch)
        s, k, _, _ = self.trees[index - len(self.candidates)]
        return tree_tokens_cost(cfg.round_cost, cfg.verify_cost, s, k, tokens, batch,
                                cfg.tree_overhead)

    def shape(self, state: Any, n_req_max: int) -> Any:
        """This round's shape: the candidate in force at the decided tokens, raised to the rung
        that holds the largest batch's own tokens; a tree's held to the rung of ``n_req_max N``
        (more places than every request's whole tree are worth nothing, and the worker's graphs
        of a bucket stop there)."""
        from adaptive_dist.policy.budgets import effective_tokens
        from adaptive_dist.shape import RoundShape

        if state.index < len(self.candidates):
            return self.chains.shape(state, n_req_max)
        s, k, n, _ = self.trees[state.index - len(self.candidates)]
        top = token_bucket(max(n_req_max, 1) * n, self.ladder)
        decided = state.tokens if state.tokens else top
        return RoundShape(s, max(min(decided, top), effective_tokens(1, n_req_max, s,
                                                                     self.ladder)), k, n)

    def code(self, state: Any) -> int:
        """The must-agree ``tokens`` column (``PER_REQUEST_TREE_CODE``)."""
        if state.index < len(self.candidates):
            return state.tokens
        _, k, n, _ = self.trees[state.index - len(self.candidates)]
        return state.tokens + tree_code(k, n) * PER_REQUEST_TREE_CODE

    def decide(self, state: Any, summed: Sequence[int], n_req_sum: int, n_req_max: int,
               batch: int) -> tuple[Any, Any]:
        """The next round's candidate and tokens: the most expected tokens per second over every
        candidate and every rung that holds ``n_req_max`` (ties: fewer tokens, then the lower
        index); an idle round keeps the shape."""
        from dataclasses import replace

        from adaptive_dist.policy.base import Decision
        from adaptive_dist.policy.budgets import VALUE_SCALE

        if n_req_sum <= 0:
            return state, Decision(False, False, None, state.index, state.index,
                                   tokens=state.tokens)
        width = len(self.ladder)
        best: Optional[tuple[float, int, int]] = None
        for a in range(len(self.candidates) + len(self.trees)):
            for b, t in enumerate(self.ladder):
                if t < n_req_max:
                    continue
                rate = summed[a * width + b] / VALUE_SCALE / self.shape_cost(a, t, batch)
                key = (rate, -t, -a)
                if best is None or key > best:
                    best = key
        if best is None:
            index, tokens, rate = 0, self.ladder[-1], 0.0
        else:
            rate, tokens, index = best[0], -best[1], -best[2]
        counted = state.counted + 1
        new = replace(state, counted=counted, tokens=tokens)
        if index != state.index:
            new = replace(new, index=index, last_switch=counted)
        return new, Decision(True, False, None, state.index, index, tokens=tokens, rate=rate)

    def budgets(self, survivals: Any, shape: Any) -> tuple[int, ...]:
        """Each request's draft tokens (a chain) or verify nodes ``N_i`` (a tree: the fill of
        ``budgets.fill_budgets`` over its node values, ``sum(N_i + 1) <= T``)."""
        from adaptive_dist.policy.budgets import fill_budgets
        from adaptive_dist.shape import RoundShape

        if shape.tree is None:
            return self.chains.budgets(survivals, shape)
        j = self.trees.index(next(t for t in self.trees if t[:3] == (
            shape.draft_forwards, shape.topk, shape.tree_tokens)))
        return fill_budgets(self._tree_estimates(j, survivals),
                            RoundShape(shape.tree_tokens - 1, shape.verify_tokens))

    def drafted(self, rids: Sequence[int], budgets: Sequence[int], shape: Any) -> list[int]:
        """The drafted depth of each request (what the tracker records: positions ``1 ..
        min(a + 1, d)`` reached) — a tree's ``min(N_i, S)`` — and each request's share of tree
        rounds moved (``budgets.DECAY`` per drafted round, as its counts; the pooled share by
        ``POOL_DECAY``). A tree round of ``N_i`` nodes is an observation at the coverage its
        nodes had, taken as ``f φ_i`` with ``φ_i = (N_i - 1) / (N - 2)`` (the nodes past the
        head's first, a share of the whole tree's; one node: the chain's draft): so a request kept
        to a small tree, whose deeper levels its few nodes cover less, is not read as one whose
        whole tree would do no better (the small tree's rate would otherwise shrink the next
        round's tree, and so on)."""
        from adaptive_dist.policy.budgets import DECAY, POOL_DECAY

        tree = shape.tree
        f = 0.0
        if tree is not None:
            f = next(t[3] for t in self.trees if t[:3] == (tree.steps, tree.topk, tree.tokens))
        seen, out = [], []
        for rid, d in zip(rids, budgets):
            if d <= 0:
                out.append(0)
                continue
            x, cover = 0.0, 0.0
            if tree is not None:   # the nodes past the head's first, a share of the tree's
                phi = (d - 1) / (tree.tokens - 2) if tree.tokens > 2 else 0.0
                x, cover = (1.0, f * phi) if phi > 0 else (0.0, 0.0)
            seen.append((x, cover))
            share, ran = self.tree_share.get(rid, self.pool_share)
            new = DECAY * share + (1.0 - DECAY) * x
            if new > 1e-6:
                self.tree_share[rid] = (new, (DECAY * share * ran + (1.0 - DECAY) * x * cover)
                                        / new)
            else:
                self.tree_share.pop(rid, None)
            out.append(min(d, tree.steps) if tree is not None else d)
        if seen:   # the pooled counts' share, as they decay
            share, ran = self.pool_share
            x = sum(v[0] for v in seen) / len(seen)
            cover = sum(v[0] * v[1] for v in seen) / len(seen)
            new = POOL_DECAY * share + (1.0 - POOL_DECAY) * x
            self.pool_share = ((new, (POOL_DECAY * share * ran + (1.0 - POOL_DECAY) * cover)
                                / new) if new > 1e-6 else (0.0, 0.0))
        if len(self.tree_share) > 4 * max(len(rids), 64):   # finished requests
            keep = set(rids)
            self.tree_share = {r: v for r, v in self.tree_share.items() if r in keep}
        return out


def tree_tokens_cost(table: RoundCost, verify: VerifyCost, steps: int, topk: int, tokens: int,
                     batch: int, overhead: float = 0.0) -> float:
    """Seconds of a tree round of ``steps`` steps at top-k ``topk`` verifying ``tokens`` packed
    tokens at padded batch ``batch``: ``D₁(b) + (S - 1) h(b K) + verify(tokens)`` (the price
    ``tree_round_cost`` gives a round whose every row verifies N, with the verify forward at
    the round's own tokens)."""
    bucket, row = _row(table, batch)
    d1, _ = _line(table, verify, bucket, row)
    h, _ = draft_forward_cost(table, verify, bucket * topk)
    v, _ = verify_seconds(verify, tokens)
    return d1 + (steps - 1) * h + v + overhead


def per_request_rule(config: Any, ladder: Sequence[int]) -> Any:
    """The per-request rule of a config: ``TreeBudgetRule`` with tree candidates, else
    ``budgets.PerRequestRule``."""
    from adaptive_dist.policy.budgets import PerRequestRule

    return TreeBudgetRule(config, ladder) if trees_of(config) else PerRequestRule(config, ladder)
