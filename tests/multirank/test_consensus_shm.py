"""The round's reduction through shared memory within a host (issue 37, ``collectives.shm``): the
same integer sums and maxima as gloo's recursive doubling, bit for bit; a refused mismatch of the
transport; no segment file left behind; two torchrun "nodes" on one host, one leader per node
exchanging over gloo. The dead-peer cases are in test_reliability.py (both transports)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from collectives import free_port
from multirank import run_ranks

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "shm_job.py"


def equal_job(rank: int, world: int, rounds: int) -> dict:
    import torch
    import collectives as C
    from adaptive_dist import consensus
    from adaptive_dist.config import AdaptiveConfig
    from adaptive_dist.policy import depth_policy
    from shm_job import random_vectors

    ctx = C.init_distributed(timeout_s=30.0, backend="gloo", record=True, keep_log=True)
    group = ctx.layout().group("world")
    cfg = AdaptiveConfig.from_dict({"policy": "goodput", "reducer": "mixture",
                                    "candidate_steps": [0, 1, 3, 7],
                                    "round_cost": {"0": 1.0, "1": 1.2, "3": 1.6, "7": 2.4}})
    pol = depth_policy(cfg)
    layout = consensus.ReducedLayout(pol.reducer.needs, cfg.candidate_steps, pol.expected, 5)
    shm_ch = consensus.ReduceChannel(group, layout, "shm")
    auto_ch = consensus.ReduceChannel(group, layout)          # every rank here: one host
    gloo_ch = consensus.ReduceChannel(group, layout, "doubling")
    path_gone = shm_ch.host.path is not None and not os.path.exists(shm_ch.host.path)
    same, decoded = [], []
    for vecs in random_vectors(world, rounds, seed=world):
        a, b, c = shm_ch.reduce(vecs[rank]), auto_ch.reduce(vecs[rank]), gloo_ch.reduce(vecs[rank])
        same.append(a == b == c)
        enc = [layout.encode(v) for v in vecs]                  # the reference: Python ints
        want = [sum(col) for col in zip(*(e[:layout.n_sum] for e in enc))] + \
               [max(col) for col in zip(*(e[layout.n_sum:] for e in enc))]
        decoded.append(a == want and layout.decode(a) == layout.decode(want))
    # a raw vector with large limbs and negatives
    rng = random.Random(rank)
    t = torch.tensor([rng.randint(-2 ** 50, 2 ** 50) for _ in range(layout.size)],
                     dtype=torch.int64)
    u = t.clone()
    shm_ch.host.all_reduce_sum_max(t)
    C.ops.all_reduce_sum_max(u, group, layout.n_sum, "doubling")
    ops_seen = sorted({e.op for e in ctx.recorder.log if e.op.startswith("all_reduce")})
    setup = [e.op for e in ctx.recorder.log if not e.op.startswith("all_reduce")]
    ctx.shutdown()
    return {"same": all(same), "decoded": all(decoded), "raw": t.tolist() == u.tolist(),
            "algorithms": [shm_ch.algorithm, auto_ch.algorithm, gloo_ch.algorithm],
            "path_gone": path_gone, "ops": ops_seen, "setup": setup,
            "futex": shm_ch.host._futex is not None, "waits": shm_ch.host.waits}


@pytest.mark.parametrize("world", [2, 4])
def test_shm_equals_gloo_doubling_bit_for_bit(world):
    res = run_ranks(equal_job, world, world, 40, timeout=150)
    for r in res:
        v = r.value
        assert v["same"] and v["decoded"] and v["raw"], v
        assert v["algorithms"] == ["shm", "shm", "doubling"]
        assert v["path_gone"]                                  # unlinked once mapped
        assert v["futex"]                                      # waits block (Linux x86-64)
        assert v["ops"] == ["all_reduce.sum_max.doubling.control",
                            "all_reduce.sum_max.shm.control"]
        # set-up, recorded (a peer lost there is diagnosed by the guard): per channel the
        # transport's agreement, and the segment's exchange for the two shm ones
        assert v["setup"] == ["all_gather_object.consensus_transport.control",
                              "all_gather_object.consensus_segment.control",
                              "all_gather_object.consensus_segment.control"] * 2 + \
            ["all_gather_object.consensus_transport.control"]


def staggered_job(rank: int, world: int, rounds: int, gap_s: float, early: bool) -> dict:
    import time

    import torch
    import torch.distributed as dist
    import collectives as C
    from collectives import shm

    os.environ[shm.SPIN_ENV] = "0"            # every early member blocks in the kernel at once
    os.environ[shm.EARLY_WAKE_ENV] = "1" if early else "0"
    ctx = C.init_distributed(timeout_s=30.0, backend="gloo")
    group = ctx.layout().group("world")
    n_sum = 3
    _, host = shm.setup(group, 5, n_sum, "shm")
    sums = []
    for r in range(rounds):
        dist.barrier(group=group.control_pg)
        time.sleep(rank * gap_s)              # rank 0 first, then one member every gap_s
        t = torch.tensor([rank, 1, r, rank, -rank], dtype=torch.int64)
        host.all_reduce_sum_max(t)
        sums.append(t.tolist())
    out = {"sums": sums, "waits": host.waits, "slept": host.slept, "blocks": host.blocks,
           "spin_max_us": host.spin_max_s * 1e6,
           "liveness_checks": int(host.waited_s / shm.LIVENESS_S) + rounds}
    host.close()
    ctx.shutdown()
    return out


@pytest.mark.parametrize("early", [False, True], ids=["last-wakes", "early-wake"])
def test_only_the_last_arrival_wakes_the_sleepers(early):
    """Members arrive one at a time, 10 ms apart, with no spin: every early member blocks in the
    kernel once a round and is woken by the last arrival only (an arrival that woke every
    sleeper would wake rank 0 three times a round, and each woken member would block again).
    With the early wake, the last but one arrival wakes them too: ranks 0 and 1 block again
    after it while the last is still 10 ms away — unless the scheduler runs a woken member only
    after the last arrival (a loaded machine: the fresh-clone suite saw 11 blocks for 12 once),
    so each blocks once to twice a round, and at least one such second block is seen."""
    world, rounds = 4, 6
    res = run_ranks(staggered_job, world, world, rounds, 0.01, early, timeout=150)
    for r in res:
        v = r.value
        assert v["sums"] == [[sum(range(world)), world, world * i, world - 1, 0]
                             for i in range(rounds)], v
        assert v["spin_max_us"] == 0.0
    waiting = [res[i].value for i in range(world - 1)]     # every member but the last
    for i, v in enumerate(waiting):
        assert v["waits"] == v["slept"] == rounds, waiting
        # its blocks a round, and one more per liveness check (every 50 ms of a wait); a member
        # may re-check once when an arrival lands between its read of the counter and the
        # kernel's (the kernel then returns at once)
        most = 2 * rounds if early and i < world - 2 else rounds
        assert rounds <= v["blocks"] <= most + v["liveness_checks"] + 2, waiting
        assert v["blocks"] < most + rounds, waiting
    if early:   # the early wake happened: a member woken before the round was complete
        assert sum(v["blocks"] - rounds for v in waiting[:world - 2]) >= 1, waiting


def bad_spin_job(rank: int) -> str:
    import collectives as C
    from adaptive_dist import consensus
    from adaptive_dist.config import AdaptiveConfig
    from adaptive_dist.policy import depth_policy

    if rank == 1:
        os.environ["ADAPTIVE_DIST_SHM_SPIN_US"] = "fast"
    ctx = C.init_distributed(timeout_s=20.0, backend="gloo")
    group = ctx.layout().group("world")
    layout = consensus.ReducedLayout(depth_policy(AdaptiveConfig()).reducer.needs)
    try:
        consensus.ReduceChannel(group, layout, "shm")
    except C.StartupError as exc:
        return str(exc)
    finally:
        ctx.shutdown()
    return "no error"


def test_a_bad_wait_setting_is_refused_on_every_rank_naming_the_rank():
    res = run_ranks(bad_spin_job, 2, timeout=90)
    assert {r.value for r in res} == {
        "consensus transport 'shm' on group 'world': rank 1: ADAPTIVE_DIST_SHM_SPIN_US='fast': "
        "microseconds from 0 to 10000"}, [r.value for r in res]


def mismatch_job(rank: int) -> str:
    import collectives as C
    from adaptive_dist import consensus
    from adaptive_dist.config import AdaptiveConfig
    from adaptive_dist.policy import depth_policy

    ctx = C.init_distributed(timeout_s=20.0, backend="gloo")
    group = ctx.layout().group("world")
    layout = consensus.ReducedLayout(depth_policy(AdaptiveConfig()).reducer.needs)
    try:
        consensus.ReduceChannel(group, layout, "shm" if rank == 0 else "doubling")
    except C.StartupError as exc:
        return str(exc)
    finally:
        ctx.shutdown()
    return "no error"


def test_a_mismatched_transport_is_refused_by_name_on_every_rank():
    res = run_ranks(mismatch_job, 2, timeout=90)
    msgs = {r.value for r in res}
    assert msgs == {"consensus transport on group 'world': ranks disagree on the algorithm "
                    "(ranks [0] have 'shm', ranks [1] have 'doubling'); start every rank with "
                    "the same one"}, msgs


def test_a_bad_transport_name_is_refused(monkeypatch):
    from adaptive_dist import consensus
    from collectives import Group

    layout = consensus.ReducedLayout(())
    with pytest.raises(ValueError, match=r"consensus algorithm='tcp'; allowed: auto, shm"):
        consensus.ReduceChannel(Group.single(), layout, "tcp")
    monkeypatch.setenv(consensus.TRANSPORT_ENV, "nvlink")
    with pytest.raises(ValueError, match=r"ADAPTIVE_DIST_CONSENSUS_TRANSPORT='nvlink'"):
        consensus.ReduceChannel(Group.single(), layout)


def test_two_torchrun_nodes_on_one_host_one_leader_each(tmp_path):
    """``--nnodes 2 --nproc-per-node 2``: torchrun sets GROUP_RANK 0/1 and LOCAL_WORLD_SIZE 2, so
    the group spans two "hosts"; each node's first rank exchanges over gloo, the other reads the
    result from its node's segment; the sums equal gloo's doubling over all four ranks."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK")}
    env.update(OMP_NUM_THREADS="1", SHM_JOB_OUT=str(tmp_path), PYTHONPATH=str(REPO))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(JOB)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for node in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(g["group_rank"], g["local_rank"], g["local_world_size"]) for g in got] == \
        [("0", "0", "2"), ("0", "1", "2"), ("1", "0", "2"), ("1", "1", "2")]
    assert [g["n_hosts"] for g in got] == [2] * 4
    assert [g["leader"] for g in got] == [True, False, True, False]
    assert all(g["same"] and g["algorithm"] == "shm" and g["auto"] == "doubling" for g in got)


def test_a_segment_open_to_others_or_of_another_size_is_refused(tmp_path):
    """An opener maps only a file of this uid with no group/other permissions, of the expected
    size, not through a symbolic link (no other user can read or forge a rank's vector)."""
    from collectives.shm import HostReducer

    seg = tmp_path / "seg"
    seg.write_bytes(b"\0" * 64)
    opener = object.__new__(HostReducer)
    os.chmod(seg, 0o644)
    with pytest.raises(ValueError, match="with mode 644: not this job's segment"):
        opener._open(str(seg), 8)
    os.chmod(seg, 0o600)
    with pytest.raises(ValueError, match="has 64 bytes, expected 72"):
        opener._open(str(seg), 9)
    (tmp_path / "link").symlink_to(seg)
    with pytest.raises(OSError):
        opener._open(str(tmp_path / "link"), 8)
    opener._open(str(seg), 8)
    opener._mm.close()
