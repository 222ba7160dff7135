"""The one graph table: typed phases (`GraphPhase`), keys (`GraphKey`) and their names, on the
CPU (`CudaGraphRunner` without CUDA: a replay runs the captured body)."""
from __future__ import annotations

import json

import pytest
import torch

from workers.cuda_graphs import CudaGraphRunner
from workers.worker.graph_table import GraphKey, GraphPhase, GraphTable
from workers.worker.phases import RoundPhases, phase_key, round_phases
from workers.worker.prefill import PrefillRunner


def test_phases_print_and_serialize_as_their_names() -> None:
    assert [str(p) for p in GraphPhase] == ["draft", "target", "accept", "extend", "catchup",
                                            "pending", "tree", "prefill"]
    assert f"{GraphPhase.ACCEPT}" == "accept"
    assert json.loads(json.dumps({GraphPhase.DRAFT: [GraphPhase.TREE]})) == {"draft": ["tree"]}
    assert round_phases(0) == (GraphPhase.TARGET, GraphPhase.ACCEPT)
    assert round_phases(3) == (GraphPhase.DRAFT, GraphPhase.TARGET, GraphPhase.ACCEPT,
                               GraphPhase.EXTEND)


def test_a_key_holds_a_phase_and_refuses_a_bad_one_by_name() -> None:
    assert GraphKey("draft", batch=2).phase is GraphPhase.DRAFT   # a spelling is converted
    assert GraphKey("draft", batch=2) == GraphKey(GraphPhase.DRAFT, batch=2)
    with pytest.raises(ValueError, match=r"graph phase 'verify'; allowed: draft, target"):
        GraphKey("verify")
    with pytest.raises(ValueError, match="only the prefill runs without the head"):
        GraphKey(GraphPhase.CATCHUP, batch=4, head=False)


def test_names_keep_their_spellings() -> None:
    """The names the start-up counts group captures by (`scripts.bench.startup.family`)."""
    names = {
        GraphKey(GraphPhase.DRAFT, batch=4, steps=3, greedy=False):
            "draft/batch=4/steps=3/greedy=False",
        GraphKey(GraphPhase.TARGET, tokens=12): "target/tokens=12",
        GraphKey(GraphPhase.ACCEPT, batch=2, steps=0, processed=True):
            "accept/batch=2/steps=0/greedy=True/processed",
        GraphKey(GraphPhase.EXTEND, batch=8, steps=1): "extend/batch=8/steps=1",
        GraphKey(GraphPhase.CATCHUP, batch=4): "catchup/batch=4",
        GraphKey(GraphPhase.PENDING, batch=4, tokens=64): "pending/batch=4/tokens=64",
        GraphKey(GraphPhase.TREE, batch=1, steps=3): "tree/batch=1/steps=3/greedy=True",
        PrefillRunner.key(16, 32, False): "prefill/rows=16/width=32/greedy=False",
        PrefillRunner.key(16, 32, True, defer=True):
            "prefill/rows=16/width=32/greedy=True/deferred",
    }
    assert {k.name: v for k, v in names.items()} == {v: v for v in names.values()}
    # the chain round's keys: the target by tokens alone, draft-extend greedy, processed the
    # acceptance's only
    assert phase_key(GraphPhase.TARGET, 4, 3, 12, False, True) == GraphKey(GraphPhase.TARGET,
                                                                           tokens=12)
    assert phase_key(GraphPhase.EXTEND, 4, 3, 12, False, True) == GraphKey(
        GraphPhase.EXTEND, batch=4, steps=3)
    assert phase_key(GraphPhase.DRAFT, 4, 3, 12, False, True) == GraphKey(
        GraphPhase.DRAFT, batch=4, steps=3, greedy=False)
    assert phase_key(GraphPhase.ACCEPT, 4, 3, 12, False, True).processed


def test_the_table_captures_once_replays_and_selects_phases() -> None:
    runner = CudaGraphRunner(torch.device("cpu"))
    table = GraphTable(runner)
    calls: list[str] = []
    keys = [GraphKey(GraphPhase.TARGET, tokens=4), PrefillRunner.key(2, 32, True),
            PrefillRunner.key(2, 32, True, defer=True), GraphKey(GraphPhase.CATCHUP, batch=2)]
    for key in keys:
        table.capture(key, lambda k=key: calls.append(k.name) or k.name)
    table.capture(keys[0], lambda: calls.append("again"))   # a key captured before keeps its own
    assert len(table) == len(runner.entries) == 4 and list(table) == keys
    assert table.replay(keys[1]) == keys[1].name and calls == [keys[1].name]
    assert list(table.of(GraphPhase.PREFILL)) == keys[1:3]
    assert list(table.of(GraphPhase.CATCHUP, GraphPhase.TARGET)) == [keys[0], keys[3]]
    assert table.get(PrefillRunner.key(4, 32, True)) is None
    with pytest.raises(RuntimeError, match="no CUDA graph prefill/rows=4/width=32"):
        table.replay(PrefillRunner.key(4, 32, True))


def test_round_bodies_refuse_the_phases_they_do_not_own() -> None:
    phases = RoundPhases(None, None, None, None)   # type: ignore[arg-type]
    for key in (GraphKey(GraphPhase.TREE, batch=1, steps=1), PrefillRunner.key(1, 32, True),
                GraphKey(GraphPhase.PENDING, batch=1, tokens=32)):
        with pytest.raises(ValueError, match=f"no round body for phase {key.phase}"):
            phases.body(key, None, 1)
