"""The parallel layout and the typed collective ops: validation, group membership, and every op
on every named group of real gloo process groups (4 ranks)."""
from __future__ import annotations

import pytest
import torch

import collectives as C
from collectives.layout import member_ranks
from multirank import run_ranks
import rank_jobs


@pytest.mark.parametrize("world,dp,tp,needle", [
    (4, 3, 4, "dp=3 must divide tp=4"),
    (4, 1, 2, "tp=2 must equal the world size 4"),
    (4, 0, 4, "dp=0 must be a positive integer"),
    (2, 1, True, "tp=True must be a positive integer"),
])
def test_bad_degrees_name_the_numbers(world, dp, tp, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        C.check_degrees(world, dp, tp)


def test_member_sets_of_a_dp_attention_layout():
    # world 4, dp 2 -> attn_tp 2: replicas {0,1} and {2,3}; DP groups stride 2
    assert member_ranks("attn_tp", 3, 4, 2, 4) == (2, 3)
    assert member_ranks("dp", 3, 4, 2, 4) == (1, 3)
    assert member_ranks("dp", 0, 4, 2, 4) == (0, 2)
    assert member_ranks("tp", 1, 4, 2, 4) == (0, 1, 2, 3)
    with pytest.raises(KeyError, match="unknown group 'pp'"):
        member_ranks("pp", 0, 4, 2, 4)


def test_ops_are_no_ops_at_size_one():
    g = C.Group.single()
    x = torch.ones(3)
    assert C.ops.all_reduce(x, g) is x
    assert C.ops.all_gather(x, g) is x
    assert C.ops.reduce_scatter(x, g) is x
    assert C.ops.broadcast(x, g) is x


def test_single_process_context_builds_size_one_groups():
    ctx = C.init_distributed(timeout_s=5)
    layout = ctx.layout()
    assert not ctx.distributed and layout.group("world").size == 1
    with pytest.raises(KeyError, match="unknown group"):
        layout.group("pipeline")
    with pytest.raises(ValueError, match="timeout_s"):
        C.init_distributed(timeout_s=0)


@pytest.mark.multirank
def test_every_op_on_every_group_with_four_ranks():
    res = [r.value for r in run_ranks(rank_jobs.layout_ops_job, 4, 2, timeout=120)]
    for rank, r in enumerate(res):
        assert r["attn_tp_degree"] == 2
        for name in C.GROUP_NAMES:
            g = r[name]
            members = g["ranks"]
            vals = [m + 1.0 for m in members]
            assert g["all_reduce"] == sum(vals)
            assert g["all_reduce_max"] == max(vals)
            assert g["all_gather0"] == [v for v in vals for _ in range(2)]
            assert g["all_gather1"] == [v for v in vals for _ in range(4)]
            n = len(members)
            full = torch.arange(4.0 * n).reshape(2 * n, 2) * sum(vals)
            assert g["reduce_scatter"] == full[2 * g["index"]: 2 * g["index"] + 2].tolist()
            assert g["broadcast"] == vals[-1]
            assert g["reduce_scatter_input_kept"]  # the caller's tensor is not overwritten
    assert all(r["log"] == res[0]["log"] for r in res)  # the same collective history everywhere
    assert {tuple(r["dp"]["ranks"]) for r in res} == {(0, 2), (1, 3)}
