"""graphc/tools/replicated.py (See NOTE: Replicated compute): the share of a stage of several
ranks that runs whole on every rank after an op without an SBP rule, and the fallback
collectives, as `graphc plan`'s stages.txt prints them. One process, no process group."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import compiler, sbp
from graphc.tools.replicated import replicated_compute
from graphc.tools.summary import stage_summary

P01 = graphc.placement("cpu", [0, 1])


class Net(nn.Module):
    """fc1 [8, 16] -> body -> fc2 [8, 4]."""

    def __init__(self, body):
        super().__init__()
        self.fc1, self.fc2, self.body = nn.Linear(8, 16), nn.Linear(16, 4), body

    def forward(self, x):
        return self.fc2(self.body(F.relu(self.fc1(x))))


class LossGraph(graphc.Graph):
    def __init__(self, body):
        super().__init__()
        self.model = graphc.to_global(Net(body), placement=P01, sbp=sbp.broadcast)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _compiled(body):
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    return compiler.compile(LossGraph(body), [x, y], 2, [(P01, sbp.split(0)), (P01, sbp.split(0))])


def test_ops_after_a_gathering_fallback_count_as_replicated():
    """logcumsumexp has no rule: it gathers the batch, and it and everything after it that
    stays whole (fc2, the loss) runs on every rank: [8, 16] + [8, 4] (fc2's linear) + the
    loss's 1 element, of the stage's relu, linears, logcumsumexp and loss."""
    compiled = _compiled(lambda h: torch.logcumsumexp(h, 1))
    share = replicated_compute(compiled)[0]
    assert share.elements == 8 * 16 + 8 * 4 + 1, share
    assert share.total == 3 * 8 * 16 + 8 * 4 + 1, share
    assert share.fallback_collectives == 1   # the batch all-gathered (its gradient: a local slice)
    text = stage_summary("LossGraph", compiled)
    assert f"  {share}" in text.splitlines() and "replicated compute: 38.6%" in text   # 161 / 417


def test_a_rule_for_every_op_leaves_nothing_replicated():
    compiled = _compiled(lambda h: torch.cumsum(h, 1))
    share = replicated_compute(compiled)[0]
    assert share.elements == 0 and share.fallback_collectives == 0 and share.total > 0
    assert "replicated compute: 0.0% of its ops' output elements" in stage_summary("LossGraph", compiled)
