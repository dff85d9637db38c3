"""place_inputs: with set_stage, a GlobalTensor input starts on the stage of its placement
(API.md: ranks outside an input's placement pass values that are not read), in one process."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import compiler, sbp
from graphc.errors import GraphcError
from graphc.meta import META_STAGE, META_STAGE_WHY
from graphc.plan.instructions import Send


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class G(graphc.Graph):
    def __init__(self, p0, p1):
        super().__init__()
        self.m = Net()
        self.m.a.config.set_stage(0, p0)
        self.m.b.config.set_stage(1, p1)
        self.add_optimizer(torch.optim.SGD(self.m.parameters(), lr=0.1))

    def build(self, x, y):
        loss = F.mse_loss(self.m(x), y)
        loss.backward()
        return loss


P0, P1 = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3, 4])


def _compile(y_on):
    return compiler.compile(G(P0, P1), [torch.empty(12, 4), torch.empty(12, 3)], 5,
                            [(P0, (sbp.split(0),)), (y_on, (sbp.split(0),))])


def test_targets_declared_on_the_first_stage_start_there_and_travel():
    """y on [0, 1] is read by the loss on [2, 3, 4]: it is placed on stage 0, not taken from
    ranks 2-4 (whose y values are not read), and sent with the activations."""
    compiled = _compile(P0)
    y = next(n for n in compiled.gm.graph.nodes if n.op == "placeholder" and n.name == "y")
    assert (y.meta[META_STAGE], y.meta[META_STAGE_WHY]) == (0, "input")
    assert compiled.programs[0].user_inputs == {"x": 0, "y": 1}
    assert compiled.programs[1].user_inputs == {}
    sent = {t.name for ins in compiled.plan_for(0).instructions if isinstance(ins, Send)
            for t in ins.tensors}
    assert "y" in sent, str(compiled.plan_for(0))


def test_targets_declared_on_the_last_stage_stay_there():
    compiled = _compile(P1)
    assert compiled.programs[1].user_inputs == {"y": 1}


def test_an_input_on_ranks_without_a_stage_is_refused():
    with pytest.raises(GraphcError, match=r"input 'y' is a GlobalTensor on ranks \[0\], which "
                       r"hold no pipeline stage \(stage 0 on \[0, 1\], stage 1 on \[2, 3, 4\]\)"):
        _compile(graphc.placement("cpu", [0]))
