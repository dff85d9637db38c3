"""feed_whole_batch: a token-mean loss divides by the whole batch's count, computed by the
stage's prologue; plan level, compiled in one process (numerics: tests/runtime/test_whole_batch.py)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.compiler import compile as compile_graph

B, D, C = 8, 6, 5
P0, P1 = graphc.placement("cpu", [0]), graphc.placement("cpu", [1])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage0, self.stage1 = nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x):
        return self.stage1(torch.tanh(self.stage0(x)))


class LossGraph(graphc.Graph):
    def __init__(self, loss, accumulation=2, stages=True, model=None):
        super().__init__()
        self.model, self.loss = model or Net(), loss
        if stages:
            self.model.stage0.config.set_stage(0, P0)
            self.model.stage1.config.set_stage(1, P1)
        self.config.set_gradient_accumulation_steps(accumulation)

    def build(self, x, y):
        loss = self.loss(self.model, x, y)
        loss.backward()
        return loss


def token_mean(model, x, y):
    return F.cross_entropy(model(x), y, ignore_index=-1)


def summed(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum")


def soft_targets(model, x, y):
    return F.cross_entropy(model(x), F.one_hot(y, C).double())


def targets_from_the_model(model, x, y):
    guess = model.stage0(x)[:, :C].argmax(-1)
    return F.cross_entropy(model(x), guess)


def _example():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)]


def test_token_mean_loss_gets_a_whole_batch_count():
    compiled = compile_graph(LossGraph(token_mean), _example(), 2)
    prog = compiled.programs[1]
    assert prog.inputs[-1] == "graphc_count_cross_entropy" and prog.prologue is not None
    assert prog.prologue.inputs == ["y"] and prog.prologue.groups == [()]
    assert "cross_entropy_over_batch" in prog.code and "prologue" in str(prog)
    assert compiled.programs[0].prologue is None


@pytest.mark.parametrize("loss, accumulation", [(token_mean, 1), (summed, 2), (soft_targets, 2)])
def test_counts_only_where_they_matter(loss, accumulation):
    """One micro-batch, a sum, probability targets: the plain loss is already eager's."""
    compiled = compile_graph(LossGraph(loss, accumulation), _example(), 2)
    assert all(p.prologue is None for p in compiled.programs)


@pytest.mark.parametrize("stages, source", [(True, "a value received from another stage"),
                                            (False, "the parameters of 'model.stage0'")])
def test_targets_known_only_inside_the_step_are_refused(stages, source):
    with pytest.raises(graphc.GraphcError) as info:
        compile_graph(LossGraph(targets_from_the_model, stages=stages), _example(), 2 if stages else 1)
    msg = str(info.value)
    for part in ("test_feed_whole_batch.py", "return F.cross_entropy(model(x), guess)", source,
                 "known only while the micro-batches run", "set_gradient_accumulation_steps(1)"):
        assert part in msg, (part, msg)


def test_targets_split_over_ranks_add_their_counts():
    """Data parallel, accumulation 1: each rank counts its rows, the counts are all-reduced."""
    where = graphc.placement("cpu", [0, 1])
    model = graphc.to_global(Net(), placement=where, sbp=sbp.broadcast)
    graph = LossGraph(token_mean, accumulation=1, stages=False, model=model)
    layout = (where, (sbp.split(0),))
    compiled = compile_graph(graph, _example(), 2, [layout, layout])
    prog = compiled.programs[0]
    assert prog.prologue is not None and prog.prologue.groups == [((0, 1),)]
