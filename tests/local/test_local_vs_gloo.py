"""The local world runs what real ranks run (issue 24): for the same plans, the losses and
every parameter after training are bit-identical between the local world (threads,
in-memory transfers) and real gloo processes: pipeline, data, tensor and hybrid layouts
at 2 and 4 ranks, ZeRO stage 2 on data 2, and bf16 autocast (enable_amp, in float32) on
pipeline 2, data 2 and pipeline 2 x data 2.

Bit-identical holds where every reduction is over groups of 2 (a + b is b + a); the local
world sums a group in rank order, gloo's ring in its own order, which for 3+ ranks can
differ by rounding (NOTE: Local world).
"""
import pytest
import torch

import graphc.testing
from helpers import run_world
import sweep

pytestmark = pytest.mark.world  # spawns gloo ranks (tests/test_world_marker.py)

CONFIGS = [sweep.Config("skip", pp=2, schedule="1f1b", acc=2),
           sweep.Config("skip", pp=2, schedule="zbv", acc=2),
           sweep.Config("skip", dp=2, acc=2),
           sweep.Config("skip", dp=2, acc=2, zero=2),
           sweep.Config("gpt", tp=2, acc=2),
           sweep.Config("skip", pp=2, dp=2, schedule="interleaved_1f1b", acc=4),
           sweep.Config("gpt", pp=2, tp=2, acc=2),
           sweep.Config("gpt", tp=2, dp=2, acc=1),
           sweep.Config("llama", pp=2, acc=2)]


def _real_rank(rank, world, configs):
    out = []
    for c in configs:
        make, inputs = sweep.BUILD[c.model](c)
        graph = make()
        losses = []
        for step in range(sweep.STEPS):
            args = inputs(rank, step) if callable(inputs) else inputs[step]
            losses.append(graph(*args).to_local().clone())
        out.append((losses, graph.full_state_dict()))
    return out


def _local(c):
    make, inputs = sweep.BUILD[c.model](c)
    run = graphc.testing.local_world(make, inputs, c.nproc, steps=sweep.STEPS)
    losses = [[out if not isinstance(out, graphc.GlobalTensor) else out.to_local() for out in outs]
              for outs in run.outputs]
    return losses, run.graphs, run.state


AMP = [sweep.Config("skip", pp=2, schedule="1f1b", acc=2, amp=True),
       sweep.Config("skip", dp=2, acc=2, amp=True),
       sweep.Config("skip", pp=2, dp=2, schedule="1f1b", acc=2, amp=True)]


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])   # CI time: 2 ranks show the seam
def test_local_world_is_bitwise_gloo(nproc):
    _compare([c for c in CONFIGS if c.nproc == nproc], nproc)


@pytest.mark.fp32
@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_local_world_is_bitwise_gloo_under_amp(nproc):   # CI time: the float64 case above runs by default
    """bf16 autocast needs float32 values (autocast leaves float64 alone)."""
    graphs = _compare([c for c in AMP if c.nproc == nproc], nproc)
    assert torch.get_default_dtype() == torch.float32
    assert all("bfloat16" in str(g[0]) for g in graphs)  # the stage programs run bf16 autocast regions


def _compare(configs, nproc):
    real = run_world(_real_rank, nproc, configs, timeout=400)
    graphs = []
    for i, c in enumerate(configs):
        losses, local_graphs, state = _local(c)
        graphs.append(local_graphs)
        for rank in range(nproc):
            for step in range(sweep.STEPS):
                want, got = real[rank][i][0][step], losses[rank][step]
                assert want.shape == got.shape and torch.equal(want, got), (c.id, rank, step, want, got)
        want_state = real[0][i][1]
        assert want_state.keys() == state.keys(), c.id
        for k in state:
            assert torch.equal(want_state[k], state[k]), (c.id, k, (want_state[k] - state[k]).abs().max())
    return graphs
