"""A checkpoint of ZeRO stage 3 (parameters held as row shards between steps, See NOTE: ZeRO
stage 3 in graphc/runtime/zero.py) saved through torch.distributed.checkpoint by data 2 (data
4: slow) loads into one process and into a pipeline of 2, and both end where eager PyTorch on
the whole batch ends (float64, 1e-10; the oracle and steps of tests/zero/test_zero_dcp.py).
"""
import pytest
import torch
import torch.distributed.checkpoint as dcp

import graphc
from helpers import assert_same_as_eager, run_world
from test_zero_dcp import K, N, Train, eager, load, make, steps
from test_zero_numerics import Net, batches


def _save(rank, world, path):
    graph, feed = make(rank, world, zero=3)
    losses = steps(graph, feed, 0, K)
    dcp.save(graph.state_dict(), checkpoint_id=path)
    return {"losses": losses}


class PipeTrain(Train):
    def __init__(self, model):
        super().__init__(model, zero=0)
        for name, stage in (("fc1", 0), ("norm", 0), ("fc2", 1), ("head", 1)):
            getattr(self.model, name).config.set_stage(stage, graphc.placement("cpu", [stage]))


def _pipeline(rank, world, path):
    torch.manual_seed(1)
    graph = PipeTrain(Net())
    feed = lambda x, y: (x, y)   # noqa: E731 - whole tensors: each stage is one rank
    load(graph, feed, path, K)
    data = batches(N)
    losses = [graph(*data[step]).to_local() for step in range(K, N)]   # empty on stage 0's rank
    return {"losses": [l.item() for l in losses if l.numel()], "state": graph.full_state_dict()}


@pytest.mark.world
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_zero_3_checkpoint_loads_into_one_process_and_a_pipeline(world, tmp_path):
    path = str(tmp_path / "z3")
    ref_losses, ref_state = eager()
    for rank, got in enumerate(run_world(_save, world, path)):
        assert_same_as_eager(got["losses"], {}, ref_losses[:K], {}, f"zero 3 data {world} rank {rank}")
    graph, feed = make(0, 1, zero=0, seed=1)     # one process, from stage 3's row shards
    load(graph, feed, path, K)
    assert_same_as_eager(steps(graph, feed, K, N), graph.full_state_dict(), ref_losses[K:], ref_state,
                         f"one process resumed from ZeRO stage 3 on data {world}")
    for rank, got in enumerate(run_world(_pipeline, 2, path)):
        assert_same_as_eager(got["losses"], got["state"],
                             ref_losses[K:] if rank == 1 else [], ref_state,
                             f"pipeline 2 resumed from ZeRO stage 3 on data {world}, rank {rank}")
