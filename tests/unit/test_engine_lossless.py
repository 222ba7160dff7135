"""Greedy speculative decoding is lossless: token for token the output of plain greedy decoding.

Checked with continuous batching (more prompts than the batch holds, so requests join and leave
between rounds), stop tokens (accepted tokens past the stop are dropped), at every candidate tier,
in adaptive mode, and with a different tier forced on every round. The tiny random pair (float64,
so no near-tie can flip an argmax) accepts every length from 0 to steps; the bundled pair (float32,
as a user runs it) is checked on prompts that are not in the repository.
"""
from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from adaptive_dist.config import AdaptiveConfig
from adaptive_dist.coordinator import RoundPlan, RoundReport, RoundStats
from engine_fixtures import (LOSSLESS_STOP, check_pages_back, engine_for, lossless_params,
                             random_prompts, tiny_pair)
from workers.runtime_state import RuntimeStatePool
from workers.sampling import SamplingParams

STOP = LOSSLESS_STOP


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(16, vocab=64, seed=7)


_params = lossless_params


@pytest.fixture(scope="module")
def reference(pair, prompts) -> list[list[int]]:
    engine = engine_for(pair[0], None, "nospec")
    return [r.output_ids for r in engine.generate(prompts, _params(len(prompts)))]


_check_pages_back = check_pages_back


def test_reference_exercises_stops_and_lengths(reference) -> None:
    stopped = [out for out in reference if out[-1] == STOP]
    assert stopped and any(len(out) < 8 + 7 * 4 for out in stopped)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("steps", [1, 3, 7])
def test_static_tier_equals_plain_greedy(pair, prompts, reference, steps: int,
                                         overlap: bool) -> None:
    engine = engine_for(*pair, "static", steps=steps, overlap=overlap)
    out = engine.generate(prompts, _params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    hist = engine.stats.accept_histogram
    assert hist[0] > 0 and hist[steps] > 0, f"accept paths not all exercised: {hist}"
    assert set(engine.stats.steps_timeline) == {(0, steps)} and engine.stats.switches == 0
    _check_pages_back(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_adaptive_equals_plain_greedy_and_switches(pair, prompts, reference, overlap) -> None:
    config = AdaptiveConfig(warmup_batches=1, update_interval=1, ema_alpha=0.6, initial_steps=7)
    engine = engine_for(*pair, "ema", config=config, overlap=overlap)
    out = engine.generate(prompts, _params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    assert engine.stats.switches >= 1
    assert engine.planner.stats.switches == engine.stats.switches
    _check_pages_back(engine)


class RandomTierPlanner:
    """Plans a random tier (different from the last) for every round; the engine applies it."""

    def __init__(self, candidates: tuple[int, ...], seed: int) -> None:
        self.candidates, self.rng = candidates, random.Random(seed)
        self.steps = candidates[0]
        self.seen: Counter = Counter()
        self.round, self.stats = 0, RoundStats()

    def begin_round(self, report: RoundReport) -> RoundPlan:
        others = [s for s in self.candidates if s != self.steps]
        self.steps = self.rng.choice(others)
        self.seen[self.steps] += 1
        return RoundPlan(round=0, steps=self.steps, use_graph=False, batch_bucket=None,
                         batch_pad=report.num_requests, extend_tokens=report.num_tokens,
                         extend_requests=report.num_extend, cluster_requests=report.num_requests,
                         switched=True, all_done=report.done, extend_width=report.extend_len)

    def ran(self, executed) -> None:
        assert executed.shape.draft_forwards == self.steps   # launched right after its plan

    def end_round(self, accepts, plan=None, shadow=None, requests=None,
                  shadow_rows=None) -> None:
        # with overlap the results of a round arrive after the next round was planned
        steps = plan.steps if plan is not None else self.steps
        assert all(0 <= a <= steps for a in accepts)
        if accepts:   # a round this rank ran: every plan is a switch
            self.stats.switches += plan.switched


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_forced_random_tier_switch_every_round(pair, prompts, reference, overlap) -> None:
    engine = engine_for(*pair, "static", steps=7, overlap=overlap)
    planner = RandomTierPlanner((1, 2, 3, 5, 7), seed=3)
    engine.planner = planner
    engine.pool = RuntimeStatePool(engine.worker, planner.candidates)
    out = engine.generate(prompts, _params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    assert engine.stats.switches == engine.stats.rounds > 20
    assert set(planner.seen) == {1, 2, 3, 5, 7}
    _check_pages_back(engine)


def test_switch_is_a_reference_swap(pair) -> None:
    """Applying a pre-built state allocates nothing: the buffers in force are the pre-built ones."""
    engine = engine_for(*pair, "static", steps=7)
    pool = engine.pool
    for steps, state in pool.states.items():
        pool.apply(steps)
        assert engine.worker.state is state
        top = engine.worker.slots.round_rows.shape[0]   # every batch slot and the dummy one
        assert engine.worker.state.payload.tokens.shape == (top, steps + 1)
    assert pool.nbytes == sum(s.nbytes for s in pool.states.values()) > 0


# ---- the bundled pair, float32, prompts not in the repository -------------------------------

BUNDLED = Path(__file__).resolve().parents[2] / "workers" / "assets" / "tiny_pair"
FRESH_PROMPTS = [
    "def merge_intervals(spans):\n    ",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "    checksum = \"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "The lighthouse keeper wrote in her log that the storm",
    "for idx, (name, val) in enumerate(sorted(table.items())):\n",
    "KEY = \"QmFzZTY0IGlzIG5vdCBlbmNyeXB0aW9uLg==",
]


def test_bundled_pair_float32_lossless_at_every_tier_and_adaptive() -> None:
    from workers.loading import encode_prompt, load_pair

    target, head = load_pair(BUNDLED)
    prompts = [encode_prompt(p, target.config) for p in FRESH_PROMPTS]
    params = SamplingParams(max_new_tokens=48, stop_token_ids=target.config.eos_token_ids)
    reference = [r.output_ids for r in engine_for(target, None, "nospec").generate(prompts, params)]
    for steps in (1, 3, 7):
        out = engine_for(target, head, "static", steps=steps).generate(prompts, params)
        assert [r.output_ids for r in out] == reference, f"steps={steps}"
    config = AdaptiveConfig(warmup_batches=2, update_interval=2)
    out = engine_for(target, head, "ema", config=config).generate(prompts, params)
    assert [r.output_ids for r in out] == reference, "adaptive"


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_abort_frees_kv_and_leaves_the_others_intact(pair, prompts, reference, overlap) -> None:
    engine = engine_for(*pair, "static", steps=3, overlap=overlap)
    reqs = [engine.add(p, sp) for p, sp in zip(prompts, _params(len(prompts)))]
    engine.step()
    engine.step()
    running, waiting = engine.scheduler.running[0], engine.scheduler.waiting[0]
    assert engine.abort(running.rid) and engine.abort(waiting.rid)
    assert not engine.abort(running.rid)  # already finished
    while engine.scheduler.has_work:
        engine.step()
    engine.drain()
    for req, ref in zip(reqs, reference):
        if req in (running, waiting):
            assert req.finish_reason == "abort" and ref[:len(req.output_ids)] == req.output_ids
        else:
            assert req.output_ids == ref
    _check_pages_back(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_goodput_with_a_depth_0_tier_equals_plain_greedy(pair, prompts, reference,
                                                         overlap) -> None:
    """The goodput policy measures its round costs at start-up and may pick depth 0 (plain decode,
    the draft cache kept current) and come back; the tokens are plain greedy's. Where it goes
    with the measured table depends on this machine's timings; a given table (deeper rounds
    dearer than their tokens at first, so it drops to depth 0 and probes out) makes it switch."""
    config = AdaptiveConfig(policy="goodput", candidate_steps=(0, 1, 3, 7), initial_steps=1,
                            warmup_batches=1, update_interval=1, probe_every=2)
    engine = engine_for(*pair, "ema", config=config, overlap=overlap)
    costs = engine.planner.config.round_cost
    assert costs is not None and engine.config.spec.round_cost == costs
    out = engine.generate(prompts, _params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    _check_pages_back(engine)
    given = config.replace(round_cost={"0": 1.0, "1": 1.9, "3": 3.5, "7": 7.5})
    engine = engine_for(*pair, "ema", config=given, overlap=overlap)
    out = engine.generate(prompts, _params(len(prompts)))
    assert [r.output_ids for r in out] == reference
    stats = engine.planner.stats
    # out of depth 0 by a probe or by the catch-up's shadow checks: the probe waits for the
    # first of those (catch-up every 32 depth-0 rounds: ceil(34 / update_interval 1) points)
    assert engine.config.spec.probe_every == 34 == engine.planner.config.probe_every
    assert stats.rounds_at_steps[0] > 0 and stats.switches >= 2
    assert stats.probes + stats.shadow_rounds >= 1
    _check_pages_back(engine)
