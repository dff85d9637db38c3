"""Point-to-point transports on real processes: shared-memory rings and gloo agree."""
import glob
import os

import pytest
import torch
import torch.distributed as dist

from graphc.plan.instructions import ACT, Send, TensorSpec
from graphc.plan.plan import ExecutionPlan, StageInfo
from graphc.runtime.comm import P2P
from graphc.runtime.dist_env import ensure_process_group
from helpers import run_world

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

SPECS = [TensorSpec("a", (3, 5), "float32"), TensorSpec("b", (), "int64"),
         TensorSpec("c", (7,), "bool"), TensorSpec("d", (2, 2, 2), "float64")]
ROUNDS = 4


def _payload(round_: int):
    g = torch.Generator().manual_seed(round_)
    return [torch.randn(3, 5, dtype=torch.float32, generator=g), torch.tensor(round_ * 11),
            torch.rand(7, generator=g) > 0.5, torch.randn(2, 2, 2, dtype=torch.float64, generator=g)]


def _plans():
    stages = (StageInfo(0, (0,)), StageInfo(1, (1,)))
    sends = [Send(0, mb, 1, ACT, 1, tuple(SPECS)) for mb in range(ROUNDS)]
    back = [Send(1, mb, 0, ACT, 0, tuple(SPECS)) for mb in range(ROUNDS)]
    return [ExecutionPlan(0, 2, sends, stages=stages), ExecutionPlan(1, 2, back, stages=stages)]


def _exchange(rank, world, mode, before=()):
    os.environ["GRAPHC_P2P"] = mode
    ensure_process_group()
    p2p = P2P(rank, _plans())
    peer = 1 - rank
    got, tag = [], 0
    for r in range(ROUNDS):
        bufs = [torch.empty(s.shape, dtype=getattr(torch, s.dtype)) for s in SPECS]
        sends, recvs = [], []
        payload = _payload(r * 2 + rank)  # ranks send different data
        for t, b in zip(payload, bufs):
            sends.append(p2p.isend(t, peer, tag))  # the work and tensor live until done
            recvs.append(p2p.irecv(b, peer, tag))
            tag += 1
        for w in recvs + sends:
            w.wait()
        got.append(bufs)
    dist.barrier()
    return {"got": got, "kinds": p2p.kinds, "left": sorted(set(glob.glob("/dev/shm/graphc-*")) - set(before))}


@pytest.mark.parametrize("mode", ["shm", "gloo"])
def test_transport_delivers_every_dtype_in_order(mode):
    before = tuple(glob.glob("/dev/shm/graphc-*"))  # a file a killed job left is not this run's
    results = run_world(_exchange, 2, mode, before)
    for rank in (0, 1):
        peer = 1 - rank
        for r, bufs in enumerate(results[rank]["got"]):
            for got, want in zip(bufs, _payload(r * 2 + peer)):
                assert torch.equal(got, want), f"{mode}: rank {rank} round {r}"
        kinds = results[rank]["kinds"]
        assert (kinds.get((0, 1)) == "shm") == (mode == "shm")
        assert results[rank]["left"] == [], "shared-memory files must be unlinked after set-up"
