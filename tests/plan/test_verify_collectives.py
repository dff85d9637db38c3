"""The plan verifier pairs collectives across their groups and finds cross-rank deadlocks.

Plans come from compiling small graphs for a world size, then one rank's plan is edited.
"""
import dataclasses

import pytest
import torch
import torch.nn as nn

import graphc
from graphc import GraphcError, sbp
from graphc.plan.instructions import AllReduce, Collective, Send, TensorSpec
from graphc.plan.verify import verify_plans
from helpers import compile_graph, global_input


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class TwoStageTP(graphc.Graph):
    """Stage 0 on ranks [0, 1], stage 1 on [2, 3], both tensor-parallel: boxing collectives."""

    def __init__(self, acc: int):
        super().__init__()
        net = Net()
        p0, p1 = graphc.placement("cpu", ranks=[0, 1]), graphc.placement("cpu", ranks=[2, 3])
        graphc.to_global(net.a, placement=p0, sbp=sbp.split(0))
        graphc.to_global(net.b.weight, placement=p1, sbp=sbp.split(1))
        self.m = net
        self.m.a.config.set_stage(0, p0)
        self.m.b.config.set_stage(1, p1)
        self.config.set_gradient_accumulation_steps(acc)

    def build(self, x):
        loss = self.m(x).square().mean()
        loss.backward()
        return loss


class DataParallel(graphc.Graph):
    """One stage over two ranks, batch split: gradient buckets (ALL_REDUCE) before the step."""

    def __init__(self):
        super().__init__()
        self.m = Net()
        self.config.set_gradient_bucket_size(64)        # several buckets

    def build(self, x):
        loss = self.m(x).square().mean()
        loss.backward()
        return loss


@pytest.fixture(scope="module")
def tp_plans():
    return compile_graph(TwoStageTP(4), [torch.randn(16, 8)], 4).plans


@pytest.fixture(scope="module")
def dp_plans():
    p01 = graphc.placement("cpu", ranks=[0, 1])
    return compile_graph(DataParallel(), [global_input(torch.randn(8, 8), p01, sbp.split(0))], 2).plans


def _copy(plans):
    return [dataclasses.replace(p, instructions=list(p.instructions)) for p in plans]


def _indices(plan, cls):
    return [i for i, ins in enumerate(plan.instructions) if isinstance(ins, cls)]


def test_compiled_plans_verify(tp_plans, dp_plans):
    assert _indices(tp_plans[2], Collective) and _indices(dp_plans[0], AllReduce)
    verify_plans(tp_plans)
    verify_plans(dp_plans)


def test_collective_missing_on_one_rank(tp_plans):
    bad = _copy(tp_plans)
    k = _indices(bad[3], Collective)[1]
    gone = bad[3].instructions.pop(k)
    with pytest.raises(GraphcError, match="collective missing on rank 3") as e:
        verify_plans(bad)
    msg = str(e.value)
    assert "rank 2, instruction" in msg and str(gone) in msg and "<-- ERROR HERE" in msg


def test_two_collectives_swapped_on_one_rank(tp_plans):
    bad = _copy(tp_plans)
    i, j = _indices(bad[2], Collective)[:2]
    ins = bad[2].instructions
    ins[i], ins[j] = ins[j], ins[i]
    with pytest.raises(GraphcError, match="collectives swapped on rank [23]") as e:
        verify_plans(bad)
    msg = str(e.value)     # two ranks disagree: either may be the one named first
    assert "rank 2" in msg and "rank 3" in msg and f"#{i}" in msg and "<-- ERROR HERE" in msg


def test_gradient_bucket_of_the_wrong_size(dp_plans):
    bad = _copy(dp_plans)
    k = _indices(bad[1], AllReduce)[0]
    bucket = bad[1].instructions[k]
    t = bucket.tensors[0]
    wrong = (TensorSpec(t.name, (t.shape[0] + 1,) + t.shape[1:], t.dtype),) + bucket.tensors[1:]
    bad[1].instructions[k] = dataclasses.replace(bucket, tensors=wrong)
    with pytest.raises(GraphcError, match=f"rank 1, instruction #{k}") as e:
        verify_plans(bad)
    msg = str(e.value)
    assert "differs from rank 0" in msg and str(wrong[0]) in msg and str(t) in msg


def test_send_between_collectives_crosses_ranks(tp_plans):
    # rank 3 holds its gradient sends of micro-batches 0 and 1 back until after micro-batch
    # 2's forward collective with rank 2; rank 1 waits for the first of them before it sends
    # micro-batch 2 to rank 3: a cycle through rank 1, rank 3 and the collective
    bad = _copy(tp_plans)
    ins = bad[3].instructions
    held = [x for x in ins if isinstance(x, Send) and x.microbatch < 2]
    ins[:] = [x for x in ins if x not in held]
    c = next(i for i, x in enumerate(ins) if isinstance(x, Collective) and x.microbatch == 2)
    ins[c + 1:c + 1] = held
    with pytest.raises(GraphcError, match="deadlock") as e:
        verify_plans(bad)
    msg = str(e.value)
    assert "rank 1:" in msg and "rank 3:" in msg and "<-- ERROR HERE" in msg


def test_deadlock_through_a_collective_only():
    # each rank's recv waits for the peer's send, issued after a collective the recv blocks
    text = ["# graphc plan: rank {r} of 2, schedule=1f1b, microbatches=1, stages=[0], training",
            "0RECV_F0 from={p} stage=0 [x:f32[2]]",
            "ALL_REDUCE ranks=[0, 1] [g:f32[2]]",
            "0SEND_F0 to={p} stage=0 [x:f32[2]]"]
    from graphc.plan.plan import ExecutionPlan
    plans = [ExecutionPlan.parse("\n".join(f"{i:4d}  {l}" if i else l for i, l in enumerate(
        line.format(r=r, p=1 - r) for line in text))) for r in (0, 1)]
    with pytest.raises(GraphcError, match="deadlock") as e:
        verify_plans(plans)
    assert "ALL_REDUCE ranks=[0, 1]" in str(e.value)
