"""ZeRO's optimizer step runs bucket by bucket, each bucket's all-gather launched before the
next bucket steps (See NOTE: ZeRO step overlap, graphc/runtime/zero.py), and the numbers stay
eager's: a local world (one process) of data 2 with small buckets (three ZeRO buckets), Adam,
accumulation 4 and clipping, float64 at 1e-10."""
import torch

import graphc
import graphc.testing
from graphc.plan.instructions import AllGather
from graphc.runtime.local_world import LocalRank
from helpers import assert_same_as_eager
from models import OPTIMIZERS
from test_zero_numerics import Net, ZeroGraph, batches, eager, rows


def test_each_bucket_is_gathered_while_the_next_steps(monkeypatch):
    world, events = 2, []
    where = graphc.placement("cpu", list(range(world)))
    data = batches()
    gather = LocalRank.all_gather

    def spy(self, parts, t, *args, **kwargs):
        if self.rank == 0:
            events.append(("gather", t.numel()))
        return gather(self, parts, t, *args, **kwargs)

    monkeypatch.setattr(LocalRank, "all_gather", spy)

    def make():
        torch.manual_seed(0)
        model = graphc.to_global(Net(), placement=where, sbp=graphc.sbp.broadcast)
        opt = OPTIMIZERS["adam"](model.parameters())
        graph = ZeroGraph(model, opt, 2, 4, True)
        graph.config.set_gradient_bucket_size(1000)     # one weight per bucket
        if graphc.world.current().rank == 0:
            opt.register_step_post_hook(lambda o, *_: events.append(
                ("step", sum(p.grad is not None for g in o.param_groups for p in g["params"]))))
        return graph

    def inputs(rank, step):
        x, y = data[step]
        return (graphc.to_global(rows(x, rank, world), placement=where, sbp=graphc.sbp.split(0)),
                graphc.to_global(rows(y, rank, world), placement=where, sbp=graphc.sbp.split(0)))

    run = graphc.testing.local_world(make, inputs, world, steps=len(data))
    ref_losses, ref_state = eager("adam", True)
    assert_same_as_eager(run.losses, run.state, ref_losses, ref_state, "zero 2, bucket by bucket")

    gathers = [i for i in run.graphs[0].plan.instructions if isinstance(i, AllGather)]
    assert len(gathers) == 3
    # per step: each bucket's one weight steps, then its gather starts; the 5 replicated
    # parameters (the 3 biases, the norm's 2) step last
    one_step = [e for g in gathers for e in (("step", 1), ("gather", None))] + [("step", 5)]
    got = [(kind, None if kind == "gather" else n) for kind, n in events]
    assert got == one_step * len(data)
