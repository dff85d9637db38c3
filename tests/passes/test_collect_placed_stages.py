"""collect_placed_stages: one StageInfo per placement place_by_layout found, numbered in its
data-flow order, each inside the world and no two sharing a rank; [] when nothing is placed."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import graphc
from graphc import sbp
from graphc.errors import GraphcError
from graphc.meta import META_FOUND_STAGES, FoundStage
from graphc.passes.collect_placed_stages import collect_placed_stages
from graphc.plan.plan import StageInfo
from helpers import compile_graph, global_input

P = graphc.placement


def gm_found(*placements):
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    gm.meta[META_FOUND_STAGES] = tuple(FoundStage(p, (f"parameter w{i}",)) for i, p in enumerate(placements))
    return gm


def test_one_stage_per_found_placement_in_its_order():
    gm = gm_found(P("cpu", [2, 3]), P("cpu", [[0, 1], [4, 5]]), P("cuda", [6]))
    assert collect_placed_stages(gm, "1f1b", 7) == [StageInfo(0, (2, 3), "cpu"), StageInfo(1, (0, 1, 4, 5), "cpu"),
                                                    StageInfo(2, (6,), "cuda")]


def test_nothing_placed_gives_no_stages():
    assert collect_placed_stages(gm_found(), "1f1b", 2) == []


def test_a_rank_outside_the_world_names_what_placed_it():
    with pytest.raises(GraphcError, match=r"parameter w1: placement .* names rank\(s\) \[2\], but the world "
                                          r"has 2 rank\(s\)"):
        collect_placed_stages(gm_found(P("cpu", [0]), P("cpu", [1, 2])), "1f1b", 2)


def test_placements_that_overlap_without_being_equal_are_refused():
    with pytest.raises(GraphcError, match=r"stage 1 runs on ranks \[1, 2\], which overlap"):
        collect_placed_stages(gm_found(P("cpu", [0, 1]), P("cpu", [1, 2])), "1f1b", 3)


class Moved(graphc.Graph):
    """The input on ranks 2, 3; a linear declared there; its output moved to rank 0."""

    def __init__(self):
        super().__init__()
        self.model = graphc.to_global(nn.Linear(4, 4), placement=P("cpu", [2, 3]), sbp=sbp.broadcast)

    def build(self, x):
        h = self.model(x)
        return graphc.to_global(h, placement=P("cpu", [0]), sbp=sbp.broadcast).sum()


def test_compile_numbers_the_stages_as_the_data_flows():
    """Ranks [2, 3] come first (the input and the linear), then rank [0] (the move's target)."""
    cg = compile_graph(Moved(), [global_input(torch.randn(4, 4), P("cpu", [2, 3]), sbp.split(0))], 4)
    assert cg.stages == [StageInfo(0, (2, 3), "cpu"), StageInfo(1, (0,), "cpu")]
    step = next(r for r in cg.history if r.name == "placed_stages")
    assert "(2, 3)" in step.text and "(0,)" in step.text, step.text
