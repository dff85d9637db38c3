"""What trace_build records cheaply, checked against what it stands for: each node's user
lines (NOTE: Recorded user lines, passes/user_lines.py) and one compile's fakes of its
parameters (NOTE: One fake mode per compile, compiler.py). One process, no ranks.
"""
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.meta import META_TENSOR
from graphc.passes.build_tracer import CompileFakes
from graphc.passes.propagate_shapes import propagate_shapes
from graphc.passes.trace_build import trace_build


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(6, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.norm(self.fc(x))
        return h.view(x.shape[0], 2, 2).sum(-1)


class NetGraph(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _line_of(fn, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _inputs():
    return [torch.randn(8, 6), torch.randn(8, 2)]


def test_a_node_records_the_users_frames_from_build_down_as_fx_writes_them():
    gm = trace_build(NetGraph(Net())._root, _inputs())
    (view,) = [n for n in gm.graph.nodes if n.target == "view"]
    here = __file__
    assert view.meta["stack_trace"] == (
        f'File "{here}", line {_line_of(NetGraph.build, "loss = F.mse_loss")}, in build\n'
        "    loss = F.mse_loss(self.model(x), y)\n"
        f'  File "{here}", line {_line_of(Net.forward, "return h.view")}, in forward\n'
        "    return h.view(x.shape[0], 2, 2).sum(-1)")
    # a node made by torch's or graphc's own code keeps only the user's frames above it
    assert all("site-packages" not in n.meta.get("stack_trace", "") for n in gm.graph.nodes)


def test_a_compile_fakes_each_parameter_once_and_propagates_the_same_shapes():
    root = NetGraph(Net())._root
    fakes = CompileFakes()
    # the passes of a compile with accumulation 2: the whole batch, then a micro-batch
    whole = propagate_shapes(trace_build(root, _inputs(), 1, fakes=fakes), _inputs(), 1, fakes)
    micro = propagate_shapes(trace_build(root, _inputs(), 2, fakes=fakes), _inputs(), 2, fakes)
    params = {id(p) for p in root.parameters()}
    assert set(fakes.parameters) == params   # one fake each, buffers faked by every pass
    assert all(fake.shape == p.shape and fake.requires_grad for p, fake in fakes.parameters.values())
    for shared, m in ((whole, 1), (micro, 2)):   # each pass alone, on its own fakes
        alone = propagate_shapes(trace_build(root, _inputs(), m), _inputs(), m)
        assert [n.meta.get(META_TENSOR) for n in shared.graph.nodes] == \
            [n.meta.get(META_TENSOR) for n in alone.graph.nodes]
