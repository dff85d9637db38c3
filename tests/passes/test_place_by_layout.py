"""place_by_layout in one process: stages found from placements, compiled without processes."""
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import GraphcError, compiler, sbp
from graphc.meta import META_PLACEMENT, META_STAGE, META_STAGE_WHY
from graphc.placement import Layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import global_tensors as seed  # noqa: E402

P = graphc.placement
P01, P23 = seed.P01, seed.P23
SEED_LAYOUTS = [Layout(P01, (sbp.split(0),)), Layout(P23, (sbp.split(0),))]


def compile_seed(program, accumulation=1):
    torch.manual_seed(0)
    model = seed.ModuleModel()
    graph = program(model, torch.optim.SGD(model.parameters(), lr=0.05), accumulation)
    return compiler.compile(graph, [torch.randn(4, 5), torch.randn(4, 3)], 4, SEED_LAYOUTS)


def node(cg, name):
    return next(n for n in cg.gm.graph.nodes if n.name == name)


def test_seed_program_without_set_stage_finds_two_stages_in_data_flow_order():
    cg = compile_seed(seed.GlobalProgram)
    assert [(s.stage_id, s.ranks) for s in cg.stages] == [(0, (0, 1)), (1, (2, 3))]
    assert node(cg, "matmul").meta[META_PLACEMENT] == P01
    for name in ("to_global_op", "matmul_1", "y"):  # after the move, and the targets: ranks 2, 3
        assert node(cg, name).meta[META_STAGE] == 1, name
    assert node(cg, "matmul_1").meta[META_STAGE_WHY] == "placement"
    note = cg.plans[0].notes["stages"]
    assert note.startswith("stages found from placements: stage 0 = ranks [0, 1] (")
    assert "parameter model.m_stage0.w" in note and "stage 1 = ranks [2, 3] (" in note


@pytest.mark.parametrize("accumulation", [1, 2])
def test_seed_program_pipelines_as_if_set_stage_were_written(accumulation):
    found = compile_seed(seed.GlobalProgram, accumulation)
    named = compile_seed(seed.GraphModel, accumulation)
    assert [str(p) for p in found.programs] == [str(p) for p in named.programs]
    assert [p.instructions for p in found.plans] == [p.instructions for p in named.plans]
    assert "stages" not in named.plans[0].notes


class Chain(nn.Module):
    """Two Linears (leaf modules), a relu between them after the move."""

    def __init__(self, first=None, second=None):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        for mod, where in ((self.a, first), (self.b, second)):
            if where is not None:
                graphc.to_global(mod, placement=where, sbp=sbp.broadcast)

    def forward(self, x, move_to=None):
        h = self.a(x)
        if move_to is not None:
            h = graphc.to_global(h, placement=move_to, sbp=sbp.broadcast)
        return self.b(F.relu(h))


class Train(graphc.Graph):
    def __init__(self, model, move_to=None):
        super().__init__()
        self.model = model
        self.move_to = move_to
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = F.mse_loss(self.model(x, self.move_to), y)
        loss.backward()
        return loss


def compile_chain(model, move_to=None, world=4):
    return compiler.compile(Train(model, move_to), [torch.randn(4, 8), torch.randn(4, 4)], world)


def test_ops_after_a_move_and_plain_inputs_run_where_their_values_are():
    cg = compile_chain(Chain(P01, P23), move_to=P23)
    assert [s.ranks for s in cg.stages] == [(0, 1), (2, 3)]
    stage = {n.name: n.meta[META_STAGE] for n in cg.gm.graph.nodes if META_STAGE in n.meta}
    assert stage["relu"] == 1          # no parameter: it runs where its input was moved
    assert stage["x"] == 0 and stage["y"] == 1   # plain inputs: with their first user


def test_every_parameter_on_all_ranks_compiles_to_one_stage_as_without_placements():
    placed = compile_chain(Chain(P("cpu", [0, 1, 2, 3]), P("cpu", [0, 1, 2, 3])))
    plain = compile_chain(Chain())
    assert [s.ranks for s in placed.stages] == [s.ranks for s in plain.stages] == [(0, 1, 2, 3)]
    assert [p.instructions for p in placed.plans] == [p.instructions for p in plain.plans]
    assert not placed.plans[0].notes


def test_one_placement_on_part_of_the_world_is_its_one_stage():
    cg = compile_chain(Chain(P01))
    assert [s.ranks for s in cg.stages] == [(0, 1)]
    assert not cg.plans[2].local_stages and not cg.plans[3].local_stages


def test_inputs_on_two_placements_are_refused_naming_the_op_both_placements_and_the_fix():
    with pytest.raises(GraphcError) as e:
        compile_chain(Chain(P01, P23))      # no to_global between the Linears
    msg = str(e.value)
    for part in ("module 'model.b'", "test_place_by_layout.py", "on placement(type=\"cpu\", ranks=[0, 1])",
                 "on placement(type=\"cpu\", ranks=[2, 3])", "its parameter model.b.weight",
                 "Fix:", "graphc.to_global("):
        assert part in msg, msg


def test_a_module_with_parameters_on_two_placements_is_refused():
    model = Chain(P01, P23)
    graphc.to_global(model.b.bias, placement=P01, sbp=sbp.broadcast)
    with pytest.raises(GraphcError, match=r"module 'model.b' \(Linear\) has parameter model.b.weight"):
        compile_chain(model, move_to=P23)


def test_placements_sharing_some_ranks_are_refused():
    with pytest.raises(GraphcError, match=r"share rank\(s\) \[1\] without being the same ranks"):
        compile_chain(Chain(P01, P("cpu", [1, 2])), move_to=P("cpu", [1, 2]))


class Back(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = graphc.to_global(nn.Linear(8, 8), placement=P01, sbp=sbp.broadcast)
        self.b = graphc.to_global(nn.Linear(8, 8), placement=P23, sbp=sbp.broadcast)

    def forward(self, x, move_to=None):
        h = self.b(graphc.to_global(self.a(x), placement=P23, sbp=sbp.broadcast))
        return self.a(graphc.to_global(h, placement=P01, sbp=sbp.broadcast))[:, :4]


def test_values_sent_back_to_an_earlier_placement_are_refused():
    with pytest.raises(GraphcError, match="in both directions"):
        compile_chain(Back())


def test_placement_outside_the_world_names_what_was_placed():
    with pytest.raises(GraphcError, match=r"to_global at to_global_op: placement .* names rank\(s\) \[3\]"):
        compile_chain(Chain(P01, P("cpu", [2, 3])), move_to=P("cpu", [2, 3]), world=3)
