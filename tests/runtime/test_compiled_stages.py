"""config.set_compile_stages (NOTE: Compiled stages): stage programs cut into Inductor-compiled
pieces between graphc's communication and random ops, autocast regions compiled, checkpointing
recomputed inside the compiled backward (NOTE: Recompute in compiled pieces), zero-bubble
schedules' input and weight gradients compiled apart (NOTE: Split compiled backward).

Tolerance: Inductor fuses and reorders floating-point operations, so a compiled stage is not
bitwise eager; in float64 it differs by rounding alone (~1e-15 relative measured), and every
test holds it to the repository's oracle, eager PyTorch on the whole batch at 1e-10 (check
mode, NOTE: Checked steps). bf16 autocast is held to torch.compile's own distance from eager
autocast on the same model (test_autocast_regions_compiled_as_torch_compile). Each layout runs
in a local world (threads); compiling dominates the time (seconds per piece on a loaded 2-core
machine, less from Inductor's disk cache, and the first compile of a process imports Inductor:
~8 s), so the default run has one 2-rank zero-bubble check with a checkpointed module
(and the unit checks that compile nothing); the layouts of the issue, ZeRO-3, what each piece
saves under checkpointing, what I and W each compute, and the bf16 comparison are slow.
"""
import operator
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
from graphc.ops.checkpointed_region import CheckpointedRegion
from graphc.runtime.compiled_recompute import inline_checkpoints, recompute_in_backward
from graphc.runtime.compiled_split import SplitPiece, input_gradients_only
from graphc.runtime.compiled_stages import CHECKPOINTED, GRAPHC_OPS, RANDOM_OPS, compile_program
from graphc.runtime.weight_grads import WeightGroups

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "local"))
import sweep  # noqa: E402
from models import SkipNet  # noqa: E402

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


@pytest.mark.slow
def test_tensor_parallel_stage_compiled_between_its_all_reduces():
    """A tensor-parallel stage (an all-reduce box inside its program) runs
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
    """Graphc ops and random ops run as traced, each counted under its reason; ops inside an
    autocast region compile (its set_autocast calls cut the pieces); the compiled program has
    the interface and parameters of the original."""
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
    compiled, record = compile_program(module, 0)
    assert record.eager == {RANDOM_OPS: 1, GRAPHC_OPS: 2}
    assert record.pieces == 3     # lin before the dropout, the region, + 1 after it
    assert {id(p) for p in compiled.parameters()} == {id(p) for p in module.parameters()}


class _Checkpointed(nn.Module):
    """A stage program as insert_checkpoints leaves it: fc1, a checkpointed region (fc2, tanh),
    fc3."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def program(self) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        h = g.call_module("fc1", (g.placeholder("x"),))
        body = torch.fx.Graph()
        b = body.call_function(torch.tanh, (body.call_module("fc2", (body.placeholder("h"),)),))
        body.output((b,))
        self.region = CheckpointedRegion(torch.fx.GraphModule(self, body), "block")
        r = g.call_function(operator.getitem, (g.call_module("region", (h,)), 0))
        g.output((g.call_module("fc3", (torch.fx.Proxy(r).sin().node,)),))
        return torch.fx.GraphModule(self, g)


@pytest.mark.slow
def test_checkpointed_region_recomputed_inside_the_compiled_backward():
    """A CheckpointedRegion's body is inlined into the piece, tagged for recompute: the compiled
    piece saves what the region reads, not what it computes, and a checkpointed micro-batch
    (recompute_in_backward) saves only the piece's input; gradients are eager's at 1e-10."""
    torch.manual_seed(0)
    net = _Checkpointed().double()
    module = net.program()
    inlined = inline_checkpoints(module)
    tagged = [n for n in inlined.graph.nodes if "recompute" in n.meta]
    assert [n.target for n in tagged] == ["fc2", torch.tanh]
    compiled, record = compile_program(module, 0)
    assert record.pieces == 1 and CHECKPOINTED not in record.eager
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    want = _eager_grads(net, x)
    with torch.no_grad():
        pre = net.fc2(net.fc1(x))
        region_values = [pre, torch.tanh(pre)]
    fixed = {t.data_ptr() for t in [x] + list(net.parameters())}
    for whole_stage in (False, True):
        with recompute_in_backward(whole_stage):   # compiled outside the hooks: Inductor's cache
            compiled(x)[0].sum().backward()         # bypasses a trace under saved-tensor hooks
        for t in [x] + list(net.parameters()):
            t.grad = None
        saved = []
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
        with hooks, recompute_in_backward(whole_stage):
            out, = compiled(x)
        kept = [t for t in saved if t.data_ptr() not in fixed]
        assert not any(t.shape == v.shape and torch.allclose(t, v) for t in kept for v in region_values)
        assert kept if not whole_stage else not kept   # a checkpointed micro-batch: its input only
        out.square().sum().backward()
        for got, t in zip(want, [x] + list(net.parameters())):
            torch.testing.assert_close(t.grad, got, atol=1e-10, rtol=1e-10)
            t.grad = None


def _eager_grads(net, x):
    out = net.fc3(torch.tanh(net.fc2(net.fc1(x))).sin())
    out.square().sum().backward()
    grads = [t.grad.clone() for t in [x] + list(net.parameters())]
    for t in [x] + list(net.parameters()):
        t.grad = None
    return grads


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


@pytest.mark.slow
def test_split_backward_compiles_input_and_weight_gradients_apart():
    """Zero bubble's I and W over a compiled piece: I (input_gradients_only) runs its compiled
    input part and gives the parameters nothing, W runs its compiled weight part from what I
    kept; input and parameter gradients are a whole eager backward's at 1e-10 (NOTE: Split
    compiled backward, NOTE: Weight gradients)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    program, _ = compile_program(torch.fx.symbolic_trace(net), 0, keeps_graph=True)
    x = torch.randn(3, 4, requires_grad=True)
    y = program(x)
    assert isinstance(next(iter(program.piece_0.variants.values())), SplitPiece)
    weights = WeightGroups.find([y], [x], list(net.parameters()))
    weights.keep()
    with input_gradients_only():
        gx, = torch.autograd.grad([y], [x], [torch.ones_like(y)], retain_graph=True)   # I
    weights.release()
    assert all(p.grad is None for p in net.parameters())
    weights.run([y], [torch.ones_like(y)])                                          # W
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    x_eager = x.detach().requires_grad_(True)
    net(x_eager).backward(torch.ones(3, 2))
    torch.testing.assert_close(gx, x_eager.grad, atol=1e-10, rtol=1e-10)
    for g, p in zip(grads, net.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-10, rtol=1e-10)


def _compiled(config, checkpoint_block=None, compile_stages=True):
    make, inputs = sweep.BUILD[config.model](config)

    def make_compiled():
        graph = make()
        graph.config.set_compile_stages(compile_stages)
        if checkpoint_block is not None:
            graph.model.blocks[checkpoint_block].config.set_activation_checkpointing(True)
        return graph
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = graphc.testing.local_world(make_compiled, inputs, config.nproc, steps=sweep.STEPS, check=True)
    return run, [str(w.message) for w in caught]


def _pieces(run):
    """Every compiled piece of every rank's stages."""
    return [p for g in run.graphs for ex in g._runtime.executors.values()
            for n, p in ex.compute.named_children() if n.startswith("piece_")]


def test_zero_bubble_split_and_checkpointed_compiled_equal_eager():
    """The default check: a 2-rank zero-bubble pipeline (split backward) with block 0 a
    checkpointed module, compiled, every step equal to eager at 1e-10 (float64); each piece's
    backward compiled as an input and a weight part (the region recomputed in the input part),
    and nothing left uncompiled but the loss. Checkpointed micro-batches (a variant of each
    piece more to compile) are in the slow layouts."""
    config = sweep.Config("skip", pp=2, schedule="zero_bubble", acc=4)
    run, warned = _compiled(config, checkpoint_block=0)
    assert run.ok, run.text()
    assert not [w for w in warned if "set_compile_stages" in w]
    pieces = _pieces(run)   # each reads parameters
    assert pieces and all(isinstance(v, SplitPiece) for p in pieces for key, v in p.variants.items() if key[0])
    assert all(set(r.eager) <= {GRAPHC_OPS} for g in run.graphs for r in g._runtime.compiled.values())


LAYOUTS = [sweep.Config("gpt"), sweep.Config("gpt", pp=2, acc=2), sweep.Config("gpt", dp=2, acc=2),
           sweep.Config("gpt", tp=2, acc=2), sweep.Config("skip", pp=2, schedule="zbv", acc=4),
           sweep.Config("skip", pp=2, acc=2, checkpointing="always"),
           sweep.Config("skip", pp=2, schedule="zero_bubble", acc=4, checkpointing="except_last"),
           # a split backward over pieces whose backward donates buffers, between boxes
           sweep.Config("gpt", pp=2, tp=2, schedule="zero_bubble", acc=2)]


@pytest.mark.slow
@pytest.mark.parametrize("config", LAYOUTS, ids=lambda c: c.id)
def test_layouts_compiled_equal_eager(config):
    """The issue's layouts: one process, pp2, dp2, tp2, ZBV, checkpointing, every step at
    1e-10; under a split backward every piece recording autograd is a SplitPiece."""
    run, warned = _compiled(config)
    assert run.ok, run.text()
    assert all(r.pieces for g in run.graphs if g._runtime.compiled for r in g._runtime.compiled.values())
    assert not [w for w in warned if "set_compile_stages" in w]
    split = config.schedule in ("zbv", "zero_bubble")
    recording = [(v, any(True for _ in p.piece.parameters())) for p in _pieces(run)
                 for key, v in p.variants.items() if key[0]]
    assert recording and all(isinstance(v, SplitPiece) == (split and params) for v, params in recording)


@pytest.mark.slow
@pytest.mark.fp32      # autocast leaves float64 ops as they are
def test_autocast_regions_compiled_as_torch_compile():
    """bf16 autocast (enable_amp) compiled: every op of the region compiles, and graphc's
    distance from eager autocast on the whole batch is within twice the larger of the two
    floors measured here on the same model and batches: torch.compile's own distance from
    eager autocast (Inductor's fused kernels round elsewhere) and uncompiled graphc's (the
    micro-batches and stages cut the bf16 roundings elsewhere, first_step.amp_bound)."""
    config = sweep.Config("skip", pp=2, acc=2, amp=True)
    run, warned = _compiled(config)
    assert run.ok, run.text()
    assert all(r.pieces and not r.eager.keys() - {GRAPHC_OPS} for g in run.graphs
               for r in g._runtime.compiled.values())
    uncompiled, _ = _compiled(config, compile_stages=False)
    compiled_d, uncompiled_d = _distance(run), _distance(uncompiled)
    torch_compile_d = _torch_compile_distance(config)
    floor = [max(a, b) for a, b in zip(torch_compile_d, uncompiled_d)]
    print(f"bf16 autocast, (|dloss|, |dparam|) from eager: graphc compiled {compiled_d}, "
          f"torch.compile {torch_compile_d}, graphc uncompiled {uncompiled_d}")
    assert all(d <= 2 * f for d, f in zip(compiled_d, floor)), (compiled_d, torch_compile_d, uncompiled_d)


def _distance(run):
    """(largest |loss difference|, largest |parameter difference|) from eager over the steps."""
    rows = run.reports[0].rows
    return max(r.dloss for r in rows), max(r.dparam for r in rows)


def _torch_compile_distance(config):
    """torch.compile of the eager model against the eager model, both under the same bf16
    autocast (backward outside it) on the whole batch, with graphc's optimizer and schedule."""
    _, batches = sweep.BUILD[config.model](config)
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)   # the model sweep's SkipGraph trains
        model = SkipNet(config.pp * sweep.chunks(config.schedule), d=8)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        run = torch.compile(model, backend="inductor", fullgraph=True) if compiled else model
        losses = []
        for x, y in batches:
            with torch.autocast("cpu", torch.bfloat16):
                loss = F.cross_entropy(run(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l0, p0), (l1, p1) = results
    return (max(abs(a - b) for a, b in zip(l0, l1)),
            max((a - b).abs().max().item() for a, b in zip(p0, p1)))


ZERO_3 = [(sweep.Config("skip", dp=2, acc=2, zero=3), 0, "never"),     # the whole stage
          (sweep.Config("skip", pp=2, dp=2, schedule="zbv", acc=4, zero=3), 0, "never"),
          (sweep.Config("skip", dp=2, acc=2, zero=3), 300, "always"),     # per unit
          (sweep.Config("skip", pp=2, dp=2, schedule="zbv", acc=4, zero=3), 300, "never")]


@pytest.mark.slow
@pytest.mark.parametrize("config,unit_bytes,checkpointing", ZERO_3,
                         ids=lambda v: v.id if isinstance(v, sweep.Config) else str(v))
def test_zero_stage_3_compiled_equal_eager(config, unit_bytes, checkpointing):
    """ZeRO stage 3 frees and gives back each parameter's storage in place, so the compiled
    pieces' saved parameters are whole again when their backward reads them: every step equal
    to eager at 1e-10, gathered per stage or per unit, under ZBV's split backward and with
    checkpointing."""
    make, inputs = sweep.BUILD[config.model](config)

    def make_compiled():
        graph = make()
        graph.config.set_compile_stages(True)
        graph.config.enable_zero(True, stage=3, shard_min_size=1, unit_bytes=unit_bytes)
        graph.config.set_activation_checkpointing(checkpointing)
        return graph
    run = graphc.testing.local_world(make_compiled, inputs, config.nproc, steps=sweep.STEPS, check=True)
    assert run.ok, run.text()
    assert all(r.pieces for g in run.graphs for r in g._runtime.compiled.values())
    assert all((ex.units is not None) == bool(unit_bytes)
               for g in run.graphs for ex in g._runtime.executors.values())
