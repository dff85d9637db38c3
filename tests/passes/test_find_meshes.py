"""find_meshes: one mesh per stage, 2-D where any declared placement (set_stage, to_global on
a parameter, a GlobalTensor input, to_global inside build()) names the stage's ranks as a
2-D mesh, else the stage's flat ranks."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import graphc
from graphc import sbp
from graphc.compiler import CompileSpec, ModuleSpec
from graphc.errors import GraphcError
from graphc.placement import Layout
from graphc.passes.find_meshes import find_meshes
from graphc.plan.plan import StageInfo
from graphc.sbp.declared import DeclaredLayouts, encode_sbp, to_global_op
from helpers import compile_graph, global_input

P = graphc.placement
FLAT = P("cpu", [0, 1, 2, 3])
MESH = P("cpu", [[0, 1], [2, 3]])
OTHER_MESH = P("cpu", [[0, 2], [1, 3]])
ONE_STAGE = [StageInfo(0, (0, 1, 2, 3))]
B = sbp.broadcast


def spec(modules=None):
    return CompileSpec(name="G", source_file=None, root=nn.Linear(2, 2),
                       modules={k: ModuleSpec(*v) for k, v in (modules or {}).items()},
                       declared=DeclaredLayouts())


def gm_moving_to(*placements):
    """A graph with one to_global inside build() per placement."""
    g = fx.Graph()
    x = g.placeholder("x")
    for where in placements:
        x = g.call_function(to_global_op, (x,), {"placement": (where.type, where.ranks),
                                                 "sbp": encode_sbp((B,) * where.ndim)})
    g.output(x)
    return fx.GraphModule(nn.Module(), g)


def test_flat_ranks_where_nothing_is_2d():
    declared = DeclaredLayouts({"w": (FLAT, (B,))})
    assert find_meshes(ONE_STAGE, spec(), gm_moving_to(FLAT), [Layout(FLAT, (B,))], declared) == [(0, 1, 2, 3)]


@pytest.mark.parametrize("where", ["parameter", "input", "build", "set_stage"])
def test_any_declared_2d_placement_makes_the_stage_2d(where):
    declared = DeclaredLayouts({"w": (MESH, (B, B))} if where == "parameter" else {})
    layouts = [None, Layout(MESH, (sbp.split(0), B))] if where == "input" else [None]
    gm = gm_moving_to(MESH) if where == "build" else gm_moving_to()
    s = spec({"model": (0, MESH)} if where == "set_stage" else {})
    assert find_meshes(ONE_STAGE, s, gm, layouts, declared) == [((0, 1), (2, 3))]


def test_each_stage_takes_the_mesh_that_names_its_ranks():
    stages = [StageInfo(0, (0, 1, 2, 3)), StageInfo(1, (4, 5))]
    declared = DeclaredLayouts({"a": (MESH, (B, B)), "b": (P("cpu", [4, 5]), (B,))})
    assert find_meshes(stages, spec(), gm_moving_to(), [], declared) == [((0, 1), (2, 3)), (4, 5)]


def test_two_different_2d_meshes_for_one_stage_are_refused():
    declared = DeclaredLayouts({"a": (MESH, (B, B)), "b": (OTHER_MESH, (B, B))})
    with pytest.raises(GraphcError, match=r"stage 0 is given two 2-D meshes, \(\(0, 1\), \(2, 3\)\) "
                                          r"and \(\(0, 2\), \(1, 3\)\)"):
        find_meshes(ONE_STAGE, spec(), gm_moving_to(), [], declared)


class Rows(graphc.Graph):
    def __init__(self):
        super().__init__()
        self.model = nn.Linear(4, 2)

    def build(self, x):
        return self.model(x).sum()


def test_compile_records_the_meshes_in_its_history():
    """A 2-D input on a world of 4: the one stage's mesh is the input's (declared_meshes)."""
    cg = compile_graph(Rows(), [global_input(torch.randn(4, 4), MESH, (sbp.split(0), B))], 4)
    assert cg.meshes == [((0, 1), (2, 3))]
    step = next(r for r in cg.history if r.name == "declared_meshes")
    assert "((0, 1), (2, 3))" in step.text, step.text
