"""The round coordinator: the round's one collective, its pre-flight check, the agreed shapes and
serving fields, and the depth a ``DepthPolicy`` (``adaptive_dist.policy``) decides.

Round protocol (every rank of the group, idle ones too):

    plan = coordinator.begin_round(RoundReport(num_requests, num_tokens, can_graph, ...))
    ... apply plan.steps if plan.switched, run the round with plan.shape (draft forwards, verify
        tokens) / plan.budgets / plan.use_graph / plan.batch_bucket / plan.batch_pad /
        plan.extend_tokens ...
    coordinator.ran(executed)          # what this rank launched (local)
    coordinator.end_round(accepts)     # its accept lengths (local)

``begin_round`` reduces every rank's report and statistics (one all-reduce of sums and maxima,
``consensus.ReducedLayout``; ``scheme="gather"``: the former all-gather of the vectors), checks
the shared columns, has the policy decide on the previous round's statistics (that decision belongs to the
previous round: "made at round r, applied between r and r+1"), then agrees the graph path and
padded shapes of the new round. The coordinator decides; whoever runs the model applies the
depth (a worker swaps a pre-built runtime state) and reports what it ran.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Sequence

from collectives import Group, LockstepGuard
from adaptive_dist import consensus
from adaptive_dist.config import AdaptiveConfig
from adaptive_dist.policy import (
    INITIAL_EMA_FAIL,
    Decision,
    depth_policy,
    pick_bucket,
)
from adaptive_dist.policy.base import evolve
from adaptive_dist.policy.budgets import PerRequestRule, effective_tokens
from adaptive_dist.policy.tree import (
    candidate_steps_of,
    candidate_tree,
    per_request_rule,
    tree_code,
)
from adaptive_dist.shape import RoundShape, token_ladder


@dataclass(frozen=True)
class Executed:
    """What a rank's worker launched for a round: its shape, graph or eager, padded bucket."""

    shape: RoundShape
    use_graph: bool
    batch_bucket: Optional[int]

    def hash(self) -> int:
        return consensus.plan_hash(self.shape.draft_forwards, shape_tokens(self.shape),
                                   self.use_graph, self.batch_bucket)


_INTS = frozenset((int,))   # an accept length's one type (bool is not an int here)


def shape_tokens(shape: RoundShape) -> int:
    """A shape's verify tokens as the plan hash reads them: a tree's with its top-k and tokens
    per request (``policy.tree.tree_code``) above bit 32, so ranks that would run trees of the
    same token count but another K or N hash apart."""
    return shape.verify_tokens + (tree_code(shape.topk, shape.tree_tokens) << 32)


@dataclass(frozen=True)
class RoundReport:
    """What one rank brings to a round's consensus: its view of the coming round."""

    num_requests: int             # requests it runs this round
    num_tokens: int = 0           # tokens of its extend (prefill) forward
    can_graph: bool = True        # it could run the round through CUDA graphs
    done: bool = False            # it has no work now and will get none
    num_extend: int = 0           # requests of its extend forward
    seq: int = 0                  # serving: the highest request-message sequence number received
    leave: bool = False           # serving: it wants the cluster to stop after this round
    extend_len: int = 0           # the longest prompt of its extend forward
    requests: tuple[int, ...] = ()   # per-request budgets: its requests' ids, in round order


@dataclass(frozen=True)
class RoundPlan:
    """What every rank runs this round (identical on every rank)."""

    round: int
    steps: int
    use_graph: bool
    batch_bucket: Optional[int]   # padded batch when use_graph, else None
    batch_pad: int                # rows of every forward of the round: the bucket, or the
                                  # cluster-wide largest batch when eager
    extend_tokens: int            # cluster-wide largest extend (prefill) forward, in tokens
    extend_requests: int          # cluster-wide most requests in an extend forward
    cluster_requests: int
    switched: bool                # the steps changed before this round
    all_done: bool                # every rank reported done
    seq: int = 0                  # serving: messages up to here reached every rank
    leave: bool = False           # serving: some rank asked the cluster to stop
    extend_width: int = 0         # cluster-wide longest prompt in an extend forward
    # draft forwards (= steps) and padded verify tokens (None: a full chain at steps over the
    # padded batch, as a worker runs it by default)
    shape: Optional[RoundShape] = None
    # this rank's own part (not the cluster's): its requests and each one's draft tokens (empty
    # budgets: every request drafts shape.draft_forwards); identical on a DP replica's ranks
    requests: tuple[int, ...] = ()
    budgets: tuple[int, ...] = ()

    def budget_of(self) -> dict[int, int]:
        """Each request's draft tokens by id."""
        if not self.budgets:
            return {r: self.steps for r in self.requests}
        return dict(zip(self.requests, self.budgets))


# a round's vector and plan built without the frozen __init__'s one object.__setattr__ per
# field (every field by name; the same instance: consensus.frozen_by_name)
_new_vector = consensus.frozen_by_name(consensus.RoundVector)
_new_plan = consensus.frozen_by_name(RoundPlan)


@dataclass(frozen=True)
class RoundOutcome:
    """The decision made at the end of a round, known at the next ``begin_round``."""

    round: int
    steps: int
    use_graph: bool
    local_ema: float
    decision: Decision
    local_ema_fail: float = INITIAL_EMA_FAIL
    batch_pad: int = 0            # the round's padded batch (picks the goodput round_cost row)


_new_outcome = consensus.frozen_positional(RoundOutcome)


@dataclass
class RoundStats:
    """The run's record of the rounds and the depth: the one owner of the switch count and the
    steps timeline (an engine's ``EngineStats`` reads them here and adds what only the engine
    knows: the accept lengths it ran, its tokens and times)."""

    rounds: int = 0
    counted_rounds: int = 0
    switches: int = 0
    probes: int = 0         # goodput: switches that were probes out of depth 0 (in `switches`)
    shadow_rounds: int = 0  # goodput: depth-0 rounds whose shadow checks updated the EMAs
    resets: int = 0         # goodput: rounds whose surprise restarted this rank's EMAs
    steps_timeline: list = field(default_factory=list)   # (round, steps) at start and every switch
    rounds_at_steps: Counter = field(default_factory=Counter)
    # rounds that ran requests, per (steps, padded batch, verify tokens): what a cost table prices
    rounds_at_shape: Counter = field(default_factory=Counter)
    timed_rounds: int = 0   # rounds whose time the policy took (goodput, cost_alpha > 0)
    # the latest timed rounds (round, steps, padded batch, slowest rank's seconds), for diagnosis
    timed_samples: deque = field(default_factory=lambda: deque(maxlen=4096))
    # speculation as vLLM's spec-decode metrics count it, from the accept lengths reported to
    # end_round: a draft is one request's round at depth > 0 (``steps`` draft tokens), of which
    # the first ``accept`` were accepted (positions 0 .. accept - 1)
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)
    # per-request budgets: the estimates against what happened, per tenth of predicted survival:
    # [sum of predicted s(k), positions that survived, positions drafted] of every drafted
    # position (``policy.budgets``)
    calibration: list = field(default_factory=lambda: [[0.0, 0, 0] for _ in range(10)])

    def count_drafts(self, accepts: Sequence[int], steps: int,
                     budgets: Optional[Sequence[int]] = None) -> None:
        """Add one round's drafts at depth ``steps`` (``budgets``: each request's draft tokens,
        default ``steps``); a request that drafted nothing is no draft."""
        if steps <= 0 or not accepts:
            return
        if budgets is None:
            drafted = accepts
            self.draft_tokens += steps * len(accepts)
        else:
            drafted = [a for a, d in zip(accepts, budgets) if d > 0]
            self.draft_tokens += sum(d for d in budgets[:len(accepts)] if d > 0)
        per_pos = self.accepted_per_pos
        if len(per_pos) < steps:
            per_pos.extend([0] * (steps - len(per_pos)))
        if not drafted:
            return
        self.drafts += len(drafted)
        self.accepted_tokens += sum(drafted)
        top = max(drafted)   # at most steps (end_round checks)
        if type(drafted) is not list and type(drafted) is not tuple:
            drafted = list(drafted)
        # position i was accepted by every draft that accepted more than i: the drafts that
        # accepted exactly i + 1 (list.count, a scan in C), summed from the longest down
        reached = 0
        for i in range(top - 1, -1, -1):
            reached += drafted.count(i + 1)
            per_pos[i] += reached

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (the counters as they are)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class RoundCoordinator:
    """One rank's side of every round; ``group`` is the group the consensus runs over.

    It holds the depth policy (``self.policy``), the state every rank shares (``self.state``),
    this rank's estimate (``self.local``: its EMAs and weight) and the statistics of the run.
    A policy's measured start-up inputs (``DepthPolicy.start_up_needs``; goodput's ``round_cost``)
    must be in ``config``: an engine measures and agrees them with ``adaptive_dist.startup.prepare``
    before building the coordinator."""

    def __init__(self, config: AdaptiveConfig, group: Group, *,
                 guard: Optional[LockstepGuard] = None, channel: str = "control",
                 clock: Optional[Callable[[], float]] = time.perf_counter,
                 scheme: str = "reduce", algorithm: str = "auto",
                 verify_ladder: Optional[Sequence[int]] = None) -> None:
        if config.start_up_needs:
            needs = config.start_up_needs
            raise ValueError(f"the {config.policy} policy needs {' and '.join(needs)}: measure "
                             f"and agree them over the ranks (adaptive_dist.startup.prepare: "
                             f"{', '.join('agree_' + n for n in needs)}), or set them in the "
                             f"config")
        # the verify forward's token rungs (the engine's; every rank the same): a chain's round
        # verifies the rung that holds its tokens, a per-request round any of them
        self.ladder = tuple(verify_ladder) if verify_ladder is not None else None
        self._ladders: dict[int, tuple[int, ...]] = {}   # no ladder: the chain's, by its top
        # per candidate index: (draft forwards, tree or None, the tree's code); the config is
        # frozen, so a candidate's are read from it once
        self._candidates: dict[int, tuple[int, Optional[tuple[int, int, int, float]], int]] = {}
        # a chain round's shape by (steps, largest batch): the same frozen RoundShape every round
        self._chain_shapes: dict[tuple[int, int], RoundShape] = {}
        self.rule: Optional[PerRequestRule] = None   # or policy.tree.TreeBudgetRule
        if config.per_request:
            if self.ladder is None:
                raise ValueError("per-request budgets need the engine's verify_ladder")
            self.rule = per_request_rule(config, self.ladder)
        self._survivals: list[list[float]] = []
        self._predicted: dict[int, dict[int, list[float]]] = {}   # round -> rid -> s(1..K)
        self.config = config
        self.group = group
        self.guard = guard
        self._clock = clock     # None: rounds are not timed (consensus-only replay)
        self._last_begin: Optional[float] = None
        self.policy = depth_policy(config)
        # what the policy decides on that timed rounds move (goodput: its live cost table)
        self.costs = self.policy.live_costs()
        self.state = self.policy.initial_state()   # shared: identical on every rank
        self.local = self.policy.initial_estimate()   # this rank's EMAs and weight
        self.round = 0
        self._config_hash = consensus.hash48(config.digest())
        self._prev_n_req = 0
        self._prev_plan: Optional[RoundPlan] = None
        self._prev_plan_hash = 0
        self._digest = 0
        self.last_outcome: Optional[RoundOutcome] = None
        self.stats = RoundStats()
        if scheme not in consensus.SCHEMES:
            raise ValueError(f"consensus scheme={scheme!r}; allowed: "
                             f"{', '.join(consensus.SCHEMES)}")
        self.scheme = scheme
        # the gather channel: the whole round (scheme "gather"), or the reduce scheme's slow
        # path (a failed check: name the ranks that differ)
        n_values = self.rule.n_values if self.rule is not None else 0
        self._channel = consensus.ConsensusChannel(group, channel, n_values)
        self._reduced = None
        if scheme == "reduce":
            if channel != "control":
                raise ValueError("consensus scheme 'reduce' runs on the control channel")
            mixes = self.policy.reducer.mixes
            layout = consensus.ReducedLayout(
                self.policy.reducer.needs, config.candidate_steps if mixes else (),
                self.policy.expected if mixes else None, n_values)
            # algorithm "auto": shared memory when every member is on this host (issue 37)
            self._reduced = consensus.ReduceChannel(
                group, layout, algorithm, guard.timeout_s if guard is not None else None)
        self.stats.steps_timeline.append((0, self.steps))

    def _candidate(self) -> tuple[int, Optional[tuple[int, int, int, float]], int]:
        """The candidate in force: (draft forwards, tree or None, the tree's code; 0: a chain)."""
        index = self.state.index
        got = self._candidates.get(index)
        if got is None:
            tree = candidate_tree(self.config, index)
            got = self._candidates[index] = (
                candidate_steps_of(self.config, index), tree,
                tree_code(tree[1], tree[2]) if tree is not None else 0)
        return got

    @property
    def steps(self) -> int:
        """Draft forwards of the candidate in force (a chain's depth, a tree's steps)."""
        return self._candidate()[0]

    @property
    def tree(self) -> Optional[tuple[int, int, int, float]]:
        """The tree candidate in force, (S, K, N, coverage); None: a chain."""
        return self._candidate()[1]

    @property
    def shape_code(self) -> int:
        """The round vector's must-agree ``tokens`` column: per-request budgets' decided verify
        tokens, or the tree in force's code (``policy.tree.tree_code``; 0: a chain)."""
        if self.rule is not None:   # with trees: the tree's code too (TreeBudgetRule.code)
            code = getattr(self.rule, "code", None)
            return code(self.state) if code is not None else self.state.tokens
        return self._candidate()[2]

    @property
    def round_cost(self) -> Any:
        """The cost table the policy's decisions read now (goodput; None: none)."""
        return self.costs.table if self.costs is not None else None

    @property
    def cost_offsets(self) -> tuple[float, ...]:
        """Per row of the cost table, what timed rounds moved it by (``()``: no table)."""
        return self.costs.offsets if self.costs is not None else ()

    @property
    def ema(self) -> float:
        """This rank's EMA of accepted draft tokens per request."""
        return self.local.ema

    @property
    def ema_fail(self) -> float:
        """This rank's EMA of the share of its requests that rejected a draft token."""
        return self.local.ema_fail

    @property
    def weight(self) -> int:
        """The requests this rank reported since the last decision point."""
        return self.local.weight

    def begin_round(self, report: RoundReport) -> RoundPlan:
        """Agree this round's plan (one collective over the group) after deciding on the previous
        round's statistics. Every member must call it every round, with its ``report``.

        With per-request budgets the collective also sums the ranks' value curves of this
        round's requests; every rank picks the next round's shape from them, and this round runs
        the shape decided at the round before (a must-agree field of this round's vector, so a
        rank that would run another shape is caught here, before any device collective)."""
        r = report
        if min(r.num_requests, r.num_tokens, r.num_extend, r.extend_len) < 0:
            raise ValueError(f"begin_round: num_requests={r.num_requests}, "
                             f"num_tokens={r.num_tokens}, num_extend={r.num_extend}, "
                             f"extend_len={r.extend_len} must be >= 0")
        values: tuple[int, ...] = ()
        if self.rule is not None:
            if len(r.requests) != r.num_requests:
                raise ValueError(f"begin_round: {len(r.requests)} request ids for "
                                 f"num_requests={r.num_requests} (per-request budgets need "
                                 f"every request's id)")
            self._survivals = self.rule.survivals(r.requests)
            values = self.rule.curve(self._survivals)
            self._predicted[self.round] = dict(zip(r.requests, self._survivals))
        now = self._clock() if self._clock is not None else None
        period = -1.0 if now is None or self._last_begin is None else now - self._last_begin
        self._last_begin = now
        local, state = self.local, self.state
        steps, _, code = self._candidate()
        tokens = self.shape_code if self.rule is not None else code
        cluster = None
        reduced = self._reduced
        if reduced is not None:
            # the round's fields straight into the reduced vector (no RoundVector: one is built
            # below only when the check fails and the gather names the ranks)
            layout = reduced.layout
            red = reduced.reduce_encoded(layout.encode_round(
                r.num_requests, r.num_tokens, r.num_extend, r.extend_len, r.can_graph, r.done,
                r.seq, r.leave, self._prev_n_req, local.ema, local.ema_fail, local.weight,
                period, (self.round, steps, tokens, state.counted, state.last_switch,
                         self._config_hash, self._prev_plan_hash), values), self.round)
            if layout.agreed(red):
                cluster = layout.decode(red)
        if cluster is None:
            cluster = self._gathered(_new_vector(
                round=self.round, n_req=r.num_requests, num_tokens=r.num_tokens,
                n_extend=r.num_extend, extend_len=r.extend_len, can_graph=r.can_graph,
                seq=r.seq, leave=r.leave, done=r.done, prev_n_req=self._prev_n_req,
                ema=local.ema, ema_fail=local.ema_fail, weight=local.weight, steps=steps,
                counted=state.counted, last_switch=state.last_switch,
                config_hash=self._config_hash, prev_plan_hash=self._prev_plan_hash,
                period=period, tokens=tokens, values=values))
        self._time_previous(cluster)
        if self.rule is None:
            self.last_outcome = self._decide_previous(cluster)
            switched = bool(self.last_outcome and self.last_outcome.decision.switched)
            plan = self._plan(cluster, switched, r.requests)
        else:
            prev_steps = self._prev_plan.steps if self._prev_plan is not None else self.steps
            plan = self._plan(cluster, self.steps != prev_steps, r.requests)
            self.last_outcome = self._decide_shape(cluster, plan)
        self._prev_plan = plan
        # until end_round reports what this rank actually ran, assume it followed the plan
        self._prev_plan_hash = consensus.plan_hash(plan.shape.draft_forwards,
                                                   shape_tokens(plan.shape), plan.use_graph,
                                                   plan.batch_bucket)   # Executed(...).hash()

        self._digest = consensus.hash48(self._digest, plan.round, self._prev_plan_hash)
        if self.guard is not None:
            # NOTE: a decision is compared across the ranks before it takes effect: every
            # decision point is also a lockstep check (one small control-group exchange every
            # update_interval counted rounds), so a rank whose decision strays (a policy that
            # reads only its own EMA, say) is an error before the forwards of the round diverge.
            # A per-request shape takes effect a round after it is decided, checked in that
            # round's pre-flight: no exchange of its own.
            point = self.last_outcome is not None and self.last_outcome.decision.decision_point
            if point:
                self.guard.check(plan.round, self._digest)
            else:
                self.guard.maybe_check(plan.round, self._digest)
        self.round += 1
        self.stats.rounds += 1
        self.stats.rounds_at_steps[plan.steps] += 1
        if plan.cluster_requests:   # a tree's key adds its top-k and tokens per request
            key = (plan.steps, plan.batch_pad, plan.shape.verify_tokens)
            if plan.shape.topk > 1:
                key += (plan.shape.topk, plan.shape.tree_tokens)
            self.stats.rounds_at_shape[key] += 1
        return plan

    def _agree(self, vec: consensus.RoundVector) -> consensus.ClusterRound:
        """The round's one collective and its pre-flight check: the reduction, and only when a
        check fails (or a sum could not be exact) the gather, on every rank alike (every rank
        holds the same reduced values), which names the ranks that differ. (``begin_round``
        encodes its fields without a vector and calls ``_gathered`` itself.)"""
        if self._reduced is not None:
            red = self._reduced.reduce(vec)
            layout = self._reduced.layout
            if layout.agreed(red):
                return layout.decode(red)
        return self._gathered(vec)

    def _gathered(self, vec: consensus.RoundVector) -> consensus.ClusterRound:
        """The gather (scheme "gather", or the reduce scheme's failed check): every rank's
        vector, the pre-flight check naming the ranks that differ, the cluster's round."""
        matrix = self._channel.gather(vec)
        try:
            consensus.preflight(matrix, self.group)
        except Exception:
            if self.guard is not None:
                self.guard.publish_log()  # let peers stuck elsewhere name the divergence
            raise
        return consensus.ClusterRound.from_matrix(matrix, self.policy.pooled)

    def ran(self, executed: Executed) -> None:
        """What this rank's worker launched for the round begun last (its shape, graph or eager,
        bucket). Local; its hash travels in the next round's vector, so the next pre-flight
        check catches a rank whose worker strayed from the agreed plan. An engine that reads a
        round's results later (overlap) reports this at launch."""
        self._prev_plan_hash = executed.hash()

    def end_round(self, accepts: Sequence[int], plan: Optional[RoundPlan] = None,
                  shadow: Optional[tuple[int, int, int]] = None,
                  requests: Optional[Sequence[int]] = None,
                  shadow_rows: Optional[Sequence[tuple[int, int]]] = None) -> None:
        """Record this rank's accept lengths (draft tokens accepted, bonus excluded). Local only.

        ``plan``: the round these results belong to (default: the last one begun). An engine
        that overlaps rounds reports round r after beginning round r+1; its decisions then read
        statistics one round older, the same on every rank.

        The depth policy turns them into this rank's estimate (``DepthPolicy.observe``): the
        EMAs of the accepted tokens and of the share of requests that rejected a draft token
        (``accept < steps``), and the weight. At a depth where the policy measures nothing
        (goodput at depth 0) the requests still count the round, and only ``shadow`` =
        (hits, checks, rows) moves them: the draft head's greedy guesses checked against
        committed tokens (the worker's catch-up).
        ``requests``: the ids of the requests ``accepts`` belong to (default: the plan's; an
        engine that drops rows of requests that finished before passes the rest), whose budgets
        the plan holds; ``shadow_rows``: each one's (hits, checks). With per-request budgets
        they update each request's estimate (``policy.budgets.SurvivalTracker``).
        What the rank ran is ``ran``'s to report.
        """
        plan = plan if plan is not None else self._prev_plan
        steps = plan.steps if plan is not None else self.steps
        if accepts and (not _INTS.issuperset(map(type, accepts))
                        or min(accepts) < 0 or max(accepts) > steps):
            for a in accepts:
                if type(a) is not int or not 0 <= a <= steps:  # bool is not an int here
                    raise ValueError(f"accept length {a!r} outside [0, {steps}] (steps in force)")
        budgets = None
        if plan is not None and plan.requests:
            rids = tuple(requests) if requests is not None else plan.requests
            if len(rids) != len(accepts):
                raise ValueError(f"end_round: {len(accepts)} accept lengths for {len(rids)} "
                                 f"requests")
            of = plan.budget_of()
            budgets = [of[rid] for rid in rids]
            if self.rule is not None:
                # a tree's budgets are verify nodes: the tracker takes its drafted depths
                drafted = getattr(self.rule, "drafted", None)
                depths = (drafted(rids, budgets, plan.shape) if drafted is not None
                          else budgets)
                self._calibrate(plan.round, rids, depths, accepts)
                self.rule.tracker.observe(rids, depths, accepts)
                if shadow_rows is not None:
                    self.rule.tracker.observe_shadow(rids, shadow_rows)
        self.stats.count_drafts(accepts, steps, budgets)
        self.local, observed = self.policy.observe(self.local, accepts, steps, shadow)
        self.stats.resets += observed.reset
        self.stats.shadow_rounds += observed.shadow
        self._prev_n_req = len(accepts)

    def _calibrate(self, round_: int, rids: Sequence[int], budgets: Sequence[int],
                   accepts: Sequence[int]) -> None:
        """Every drafted position of round ``round_`` against its predicted survival (the
        estimates the round's budgets were filled from; rounds reported before are dropped)."""
        predicted = self._predicted.pop(round_, None)
        for old in [r for r in self._predicted if r < round_]:
            del self._predicted[old]
        if predicted is None:
            return
        bins = self.stats.calibration
        for rid, d, a in zip(rids, budgets, accepts):
            surv = predicted.get(rid)
            if surv is None:
                continue
            for k in range(min(d, len(surv))):
                cell = bins[min(int(surv[k] * 10), 9)]
                cell[0] += surv[k]
                cell[1] += int(k < a)
                cell[2] += 1

    def _time_previous(self, cluster: consensus.ClusterRound) -> None:
        """A policy that times rounds (``DepthPolicy.times_rounds``; goodput with ``cost_alpha``
        > 0) gets the previous round's time, the slowest rank's (``round_timed``: goodput moves
        that batch row's offset toward it less its depth's agreed cost), identical on every rank:
        every input is an agreed cluster value or the agreed plan. Only a steady decode round
        counts — it and this round run requests and neither prefills — so idle time and
        prefills stay out."""
        prev = self._prev_plan
        if not self.policy.times_rounds or prev is None or self.costs is None:
            return
        if prev.cluster_requests <= 0 or prev.extend_tokens > 0:
            return
        if cluster.n_req_sum <= 0 or cluster.tokens_max > 0:
            return
        if cluster.untimed:
            return
        slowest = cluster.period_max
        self.costs = self.policy.round_timed(self.costs, prev.batch_pad, prev.steps, slowest)
        self.stats.timed_rounds += 1
        self.stats.timed_samples.append((prev.round, prev.steps, prev.batch_pad, slowest))

    def _decide_previous(self, cluster: consensus.ClusterRound) -> Optional[RoundOutcome]:
        prev = self._prev_plan
        if prev is None:
            return None
        local_ema, local_fail = self.ema, self.ema_fail
        self.state, decision = self.policy.decide_pooled(
            self.state, cluster.prev_n_req_sum, cluster.pooled, batch=prev.batch_pad,
            table=self.round_cost)
        if decision.decision_point:
            self.local = evolve(self.local, weight=0)
        if decision.counted:
            self.stats.counted_rounds += 1
        if decision.switched:
            convert = getattr(self.policy, "convert_estimate", None)
            if convert is not None:   # the EMAs measured the old shape: carried to the new
                self.local = convert(self.local, decision.old_index, decision.new_index)
            self.stats.switches += 1
            self.stats.probes += decision.probe
            self.stats.steps_timeline.append((self.round, self.steps))
        return _new_outcome(prev.round, prev.steps, prev.use_graph, local_ema, decision,
                            local_fail, prev.batch_pad)

    def _decide_shape(self, cluster: consensus.ClusterRound,
                      plan: RoundPlan) -> RoundOutcome:
        """Per-request budgets: the next round's shape from this round's summed value curves
        (``PerRequestRule.decide``; every rank alike)."""
        local_ema, local_fail = self.ema, self.ema_fail
        self.state, decision = self.rule.decide(self.state, cluster.values_sum,
                                                cluster.n_req_sum, cluster.n_req_max,
                                                plan.batch_pad)
        if decision.counted:
            self.stats.counted_rounds += 1
        if decision.switched:
            self.stats.switches += 1
            self.stats.steps_timeline.append((self.round + 1, self.steps))
        return RoundOutcome(plan.round, plan.steps, plan.use_graph, local_ema, decision,
                            local_fail, plan.batch_pad)

    def _plan(self, c: consensus.ClusterRound, switched: bool,
              requests: Sequence[int] = ()) -> RoundPlan:
        bucket = pick_bucket(c.n_req_max, self.config.graph_buckets) if c.all_graph else None
        use_graph = bucket is not None
        steps, tree, _ = self._candidate()   # (after the decision: the candidate now in force)
        budgets: tuple[int, ...] = ()
        if self.rule is not None:
            shape = self.rule.shape(self.state, c.n_req_max)
            budgets = self.rule.budgets(self._survivals, shape)
        else:
            if tree is None:
                shape = self._chain_shapes.get((steps, c.n_req_max))
                if shape is None:
                    shape = self._chain_shapes[(steps, c.n_req_max)] = self._chain_shape(
                        steps, c.n_req_max)
            else:   # every row its tree of N tokens: B_pad * N verify tokens
                rows = bucket if use_graph else c.n_req_max
                shape = RoundShape(steps, max(rows, 1) * tree[2], tree[1], tree[2])
        return _new_plan(
            round=self.round, steps=steps, use_graph=use_graph,
            batch_bucket=bucket if use_graph else None,
            batch_pad=bucket if use_graph else c.n_req_max,
            extend_tokens=c.tokens_max, extend_requests=c.extend_max,
            cluster_requests=c.n_req_sum, switched=switched, all_done=c.all_done,
            seq=c.seq_min, leave=c.any_leave, extend_width=c.extend_len_max,
            shape=shape, requests=tuple(requests), budgets=budgets,
        )

    def _chain_shape(self, steps: int, n_req_max: int) -> RoundShape:
        """A chain round's shape: ``steps`` draft forwards, the verify rung that holds the
        largest batch's tokens (the engine's ladder, or the chain's own up to its top)."""
        ladder = self.ladder
        if not ladder:
            top = max(n_req_max, 1) * (steps + 1)
            ladder = self._ladders.get(top)
            if ladder is None:
                ladder = self._ladders[top] = token_ladder(top)
        return RoundShape(steps, effective_tokens(0, n_req_max, steps, ladder))

    def decision_digest(self) -> int:
        """A rolling digest of every plan so far (for comparing ranks at the end of a run)."""
        return self._digest
