"""A rank of the shared-memory consensus tests (tests/multirank/test_consensus_shm.py), also run
as a script under torchrun (two "nodes" on one host): the reduction through shared memory
within each node and one gloo hop between the nodes' leaders equals gloo's recursive doubling
over every rank, bit for bit. Writes ``$SHM_JOB_OUT/rank<R>.json``."""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def random_vectors(world: int, rounds: int, seed: int) -> list:
    """``rounds`` lists of ``world`` random round vectors (the same on every rank)."""
    from adaptive_dist import consensus

    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        vecs = []
        for _ in range(world):
            w = rng.choice([0, 1, 3, 250])
            vecs.append(consensus.RoundVector(
                round=9, n_req=rng.randint(0, 70), num_tokens=rng.randint(0, 900),
                n_extend=rng.randint(0, 5), can_graph=rng.random() > 0.2,
                done=rng.random() > 0.7, seq=rng.randint(0, 40), leave=rng.random() > 0.9,
                prev_n_req=rng.randint(0, 9), ema=rng.choice([rng.random() * 7, 0.8 ** 900]),
                weight=w, steps=3, counted=4, last_switch=-1, config_hash=0xABCDEF123456,
                prev_plan_hash=0x123, ema_fail=rng.random(),
                period=rng.choice([-1.0, rng.random() / 100]), extend_len=rng.randint(0, 300),
                values=tuple(rng.randint(0, 2 ** 40) for _ in range(5))))
        out.append(vecs)
    return out


def main() -> None:
    import collectives as C
    from adaptive_dist import consensus
    from adaptive_dist.config import AdaptiveConfig
    from adaptive_dist.policy import depth_policy

    ctx = C.init_distributed(timeout_s=60.0, backend="gloo")
    group = ctx.layout().group("world")
    pol = depth_policy(AdaptiveConfig())
    layout = consensus.ReducedLayout(pol.reducer.needs, n_values=5)
    auto = consensus.ReduceChannel(group, layout)               # two hosts: gloo doubling
    shm_ch = consensus.ReduceChannel(group, layout, "shm")       # hierarchical
    same = True
    for vecs in random_vectors(ctx.world_size, 30, seed=5):
        same &= shm_ch.reduce(vecs[ctx.rank]) == auto.reduce(vecs[ctx.rank])
    host = shm_ch.host
    out = {"rank": ctx.rank, "group_rank": os.environ.get("GROUP_RANK"),
           "local_rank": os.environ.get("LOCAL_RANK"),
           "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"), "same": bool(same),
           "algorithm": shm_ch.algorithm, "auto": auto.algorithm, "n_hosts": host.n_hosts,
           "leader": host.leaders is not None}
    Path(os.environ["SHM_JOB_OUT"], f"rank{ctx.rank}.json").write_text(json.dumps(out))
    ctx.shutdown()


if __name__ == "__main__":
    main()
