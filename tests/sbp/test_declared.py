"""Declared layouts as the compiler reads them: a snapshot of the Graph's parameters'
to_global declarations, on the traced graph and in the compile history, and a registry
entry that dies with its tensor (sbp/declared.py)."""
import gc

import torch
import torch.nn as nn

import graphc
from graphc.graph_spec import compile_spec
from graphc import compiler, global_tensor, sbp
from graphc.placement import Broadcast, Layout, Split
from graphc.sbp.declared import META_DECLARED, DeclaredLayouts
from transformer_models import GPTGraph, TinyGPT, token_batches

P01 = graphc.placement("cpu", [0, 1])


class Net(graphc.Graph):
    def __init__(self, fc=None):
        super().__init__()
        self.fc = fc if fc is not None else nn.Linear(4, 4)

    def build(self, x):
        return self.fc(x)


def test_the_compiled_graph_carries_the_declarations_made_before_and_after_assignment():
    g = Net(graphc.to_global(nn.Linear(4, 4), placement=P01, sbp=sbp.broadcast))
    graphc.to_global(g.fc.weight, placement=P01, sbp=sbp.split(0))   # after assignment: it wins
    cg = compiler.compile(g, [torch.randn(2, 4)], 2)
    declared = cg.gm.meta[META_DECLARED]
    assert declared.of("fc.weight") == Layout(P01, (Split(0),)) and declared.of("fc.bias") == Layout(P01, (Broadcast(),))
    record = next(r for r in cg.history if r.name == "declared_layouts")
    assert "# fc.weight: split(0) on placement" in record.text


def test_a_tied_weight_is_declared_under_each_of_its_names():
    model = TinyGPT(layers=2)
    graphc.to_global(model.wte.weight, placement=graphc.placement("cpu", [0]), sbp=sbp.broadcast)
    graph = GPTGraph(model, None, [graphc.placement("cpu", [r]) for r in range(2)])
    declared = compile_spec(graph).declared
    assert declared.of("model.wte.weight") == declared.of("model.lm_head.weight") is not None


def test_nothing_declared_is_an_empty_snapshot():
    assert compiler.compile(Net(), [torch.randn(2, 4)], 1).gm.meta[META_DECLARED] == DeclaredLayouts()


def test_a_declaration_dies_with_its_tensor():
    p = nn.Parameter(torch.randn(4, 4))
    graphc.to_global(p, placement=P01, sbp=sbp.split(0))
    key = id(p)
    assert key in global_tensor._DECLARED and global_tensor.declared_layout(p) == Layout(P01, (Split(0),))
    del p
    gc.collect()
    assert key not in global_tensor._DECLARED


def test_to_global_on_a_submodule_reached_through_the_graph():
    g = Net(nn.Sequential(nn.Linear(4, 4)))
    assert graphc.to_global(g.fc[0], placement=P01, sbp=sbp.split(0)) is not None  # a ModuleBlock
    cg = compiler.compile(g, [torch.randn(2, 4)], 2)
    declared = cg.gm.meta[META_DECLARED]
    assert declared.of("fc.0.weight") == declared.of("fc.0.bias") == Layout(P01, (Split(0),))


def test_a_layout_is_one_value_wherever_it_comes_from():
    """A GlobalTensor input, a declaration and a (placement, sbp) pair given to compile() or
    DeclaredLayouts are the same frozen Layout (hashable, compared by value)."""
    x = graphc.to_global(torch.randn(2, 4), placement=P01, sbp=sbp.split(0), shape=(4, 4))
    assert x.layout == Layout(P01, (Split(0),)) == Layout.of((P01, (Split(0),)))
    layout = x.layout
    assert Layout.of(layout) is layout and Layout.of(None) is None
    assert DeclaredLayouts({"w": (P01, (Split(0),))}).of("w") == x.layout
    assert len({x.layout, Layout(P01, (Split(0),))}) == 1
