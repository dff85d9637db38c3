"""config.set_compile_stages (NOTE: Compiled stages): stage programs cut into Inductor-compiled
pieces between graphc's communication, random ops and autocast regions, equal to eager.

Tolerance: Inductor fuses and reorders floating-point operations, so a compiled stage is not
bitwise eager; in float64 it differs by rounding alone (~1e-15 relative measured), and every
test holds it to the repository's oracle, eager PyTorch on the whole batch at 1e-10 (check
mode, NOTE: Checked steps). Each layout runs in a local world (threads); compiling dominates
the time (seconds per piece on a loaded 2-core machine, less from Inductor's disk cache), so
the default run has one 2-rank tensor-parallel check (and the cheap refusals: nothing
compiles there) and the layouts of the issue are slow.
"""
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
import graphc.testing
from graphc import sbp
from graphc.ops.autocast import set_autocast
from graphc.runtime.compiled_stages import GRAPHC_OPS, RANDOM_OPS, compile_program
from graphc.runtime.weight_grads import WeightGroups

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "local"))
import sweep  # noqa: E402

STEPS = 2
D = 8


class MegatronMLP(nn.Module):
    """fc1 column-parallel, fc2 row-parallel: an all-reduce inside the stage program."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.Linear(D, 3)

    def forward(self, x):
        return self.head(torch.tanh(x + self.fc2(F.gelu(self.fc1(x)))))


class MLPGraph(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        where = graphc.placement("cpu", [0, 1])
        graphc.to_global(model, placement=where, sbp=sbp.broadcast)
        graphc.to_global(model.fc1, placement=where, sbp=sbp.split(0))
        graphc.to_global(model.fc2.weight, placement=where, sbp=sbp.split(1))
        self.model = model
        self.config.set_gradient_accumulation_steps(2)
        self.config.set_compile_stages(True)
        self.add_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _mlp_graph():
    torch.manual_seed(0)
    return MLPGraph(MegatronMLP())


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, D, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]


def test_tensor_parallel_stage_compiled_between_its_all_reduces():
    """The default check: a tensor-parallel stage (an all-reduce box inside its program) runs
    compiled pieces around the box, forward and backward, equal to eager at 1e-10; compiled
    once, at the first step, and reused by the next."""
    run = graphc.testing.local_world(_mlp_graph, _batches(), 2, steps=STEPS, check=True)
    assert run.ok, run.text()
    for graph in run.graphs:
        records = graph._runtime.compiled
        assert records[0].pieces >= 2 and records[0].eager.get(GRAPHC_OPS, 0) >= 1
        assert records[0].seconds > 0
        assert graph.last_stats.compile_seconds == {}   # the second step compiled nothing
        assert all(isinstance(p, torch.nn.Module) and p.variants for n, p in
                   graph._runtime.executor.compute.named_children() if n.startswith("piece_"))


def test_eager_nodes_named_by_why():
    """Graphc ops, random ops and ops inside an autocast region run as traced, each counted
    under its reason; the compiled program has the interface and parameters of the original."""
    net = nn.Module()
    net.lin = nn.Linear(4, 4)
    g = torch.fx.Graph()     # as a stage program: set_autocast calls where the state changes
    x = g.placeholder("x")
    h = g.call_function(F.dropout, (g.call_module("lin", (x,)), 0.5))
    g.call_function(set_autocast, ((("cpu", "bfloat16"),),))
    h = g.call_function(torch.mul, (h, 2.0))
    g.call_function(set_autocast, ((),))
    g.output((g.call_function(torch.add, (h, 1.0)),))
    module = torch.fx.GraphModule(net, g)
    with pytest.warns(UserWarning, match="stage 0 runs 1 op.s. inside torch.autocast uncompiled"):
        compiled, record = compile_program(module, 0)
    assert record.eager == {RANDOM_OPS: 1, GRAPHC_OPS: 2, AUTOCAST: 1}
    assert record.pieces == 2     # lin before the dropout, + 1 after the region
    assert {id(p) for p in compiled.parameters()} == {id(p) for p in module.parameters()}


def test_a_piece_inductor_fails_on_runs_as_traced(monkeypatch):
    """Inductor raising on a piece (its own limits) leaves that piece as traced, with a
    warning naming it; the program's numbers are then eager's exactly."""
    from graphc.runtime import compiled_stages

    def fails(piece, args, keeps_graph):
        raise RuntimeError("an op Inductor has no lowering for")
    monkeypatch.setattr(compiled_stages, "_inductor", fails)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    module = torch.fx.symbolic_trace(net)
    compiled, record = compile_program(module, 3)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="stage 3 piece_0 .* runs uncompiled: Inductor failed .RuntimeError"):
        out = compiled(x)
    assert torch.equal(out, net(x)) and record.pieces == 1


def test_split_backward_runs_a_compiled_piece_once():
    """Zero bubble's I and W over a compiled piece: its backward runs once (in I, giving the
    parameters' gradients too), W accumulates them, and input and parameter gradients are a
    whole eager backward's at 1e-10 (NOTE: Weight gradients)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    program, _ = compile_program(torch.fx.symbolic_trace(net), 0, keeps_graph=True)
    x = torch.randn(3, 4, requires_grad=True)
    y = program(x)
    runs = []
    y.grad_fn.register_prehook(lambda grads: runs.append(1))
    weights = WeightGroups.find([y], [x], list(net.parameters()))
    weights.keep()
    gx, = torch.autograd.grad([y], [x], [torch.ones_like(y)], retain_graph=True)   # I
    weights.release()
    weights.run([y], [torch.ones_like(y)])                                          # W
    assert len(runs) == 1
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    x_eager = x.detach().requires_grad_(True)
    net(x_eager).backward(torch.ones(3, 2))
    torch.testing.assert_close(gx, x_eager.grad, atol=1e-10, rtol=1e-10)
    for g, p in zip(grads, net.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-10, rtol=1e-10)


def _compiled(config):
    make, inputs = sweep.BUILD[config.model](config)

    def make_compiled():
        graph = make()
        graph.config.set_compile_stages(True)
        return graph
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = graphc.testing.local_world(make_compiled, inputs, config.nproc, steps=sweep.STEPS, check=True)
    return run, [str(w.message) for w in caught]


LAYOUTS = [sweep.Config("gpt"), sweep.Config("gpt", pp=2, acc=2), sweep.Config("gpt", dp=2, acc=2),
           sweep.Config("gpt", tp=2, acc=2), sweep.Config("skip", pp=2, schedule="zbv", acc=4),
           sweep.Config("skip", pp=2, acc=2, checkpointing="always"),
           sweep.Config("skip", pp=2, schedule="zero_bubble", acc=4, checkpointing="except_last"),
           # a split backward over pieces whose backward donates buffers, between boxes
           sweep.Config("gpt", pp=2, tp=2, schedule="zero_bubble", acc=2)]


@pytest.mark.slow
@pytest.mark.parametrize("config", LAYOUTS, ids=lambda c: c.id)
def test_layouts_compiled_equal_eager(config):
    """The issue's layouts: one process, pp2, dp2, tp2, ZBV, checkpointing (under 1F1B, and
    under zero bubble's split backward), every step at 1e-10; a split backward says what it
    moves."""
    run, warned = _compiled(config)
    assert run.ok, run.text()
    assert all(r.pieces for g in run.graphs if g._runtime.compiled for r in g._runtime.compiled.values())
    split = config.schedule in ("zbv", "zero_bubble")
    assert split == any("computes a compiled piece's parameter gradients in I" in w for w in warned)


def test_autocast_regions_run_uncompiled_with_a_warning():
    """Under enable_amp every op sits in an autocast region: nothing compiles, the numbers
    are eager autocast's, and a warning says which ops and why."""
    run, warned = _compiled(sweep.Config("skip", pp=2, acc=2, amp=True))
    assert run.ok, run.text()
    assert any("inside torch.autocast uncompiled" in w for w in warned)
    assert all(r.pieces == 0 for g in run.graphs for r in g._runtime.compiled.values())


def test_zero_stage_3_runs_uncompiled_with_a_warning():
    """ZeRO stage 3 regathers parameters into new storage: the stages run as traced, and a
    warning says so (nothing is compiled, so these two checks are cheap and run by default)."""
    run, warned = _compiled(sweep.Config("skip", dp=2, acc=2, zero=3))
    assert run.ok, run.text()
    assert any("ZeRO stage 3" in w and "run uncompiled" in w for w in warned)
    assert all(g._runtime.compiled == {} for g in run.graphs)
