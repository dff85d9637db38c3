"""note_stages: every plan notes the stages found from placements, unless they are the one
stage on every rank that a program without placements runs on (then plans are unchanged)."""
import torch
import torch.fx as fx
import torch.nn as nn

import graphc
from graphc import sbp
from graphc.meta import META_FOUND_STAGES, FoundStage
from graphc.passes.note_stages import note_stages, stages_note
from graphc.plan.plan import ExecutionPlan, StageInfo
from helpers import compile_graph

P = graphc.placement


class TwoPlaces(graphc.Graph):
    """Two linears declared on `first` and `second`; the activation moves between them with
    to_global, as a global program writes it (no set_stage)."""

    def __init__(self, first, second):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        self.second = second
        if first is not None:
            graphc.to_global(self.model[0], placement=first, sbp=sbp.broadcast)
            graphc.to_global(self.model[1], placement=second, sbp=sbp.broadcast)

    def build(self, x):
        h = self.model[0](x)
        if self.second is not None:
            h = graphc.to_global(h, placement=self.second, sbp=sbp.broadcast)
        return self.model[1](h).sum()


def gm_with(found):
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    gm.meta[META_FOUND_STAGES] = tuple(found)
    return gm


def test_two_placements_give_two_noted_stages_on_every_plan():
    cg = compile_graph(TwoPlaces(P("cpu", [0]), P("cpu", [1])), [torch.randn(3, 4)], 2)
    notes = {p.notes.get("stages") for p in cg.plans}
    assert len(notes) == 1
    note = notes.pop()
    assert note.startswith("stages found from placements: stage 0 = ranks [0] (parameter model.0.")
    assert ", stage 1 = ranks [1] (" in note
    assert f"# stages: {note}" in str(cg.plans[1]).splitlines()


def test_placements_that_name_every_rank_once_add_no_note():
    cg = compile_graph(TwoPlaces(P("cpu", [0, 1]), P("cpu", [0, 1])), [torch.randn(3, 4)], 2)
    assert all("stages" not in p.notes for p in cg.plans)


def test_a_program_without_placements_adds_no_note():
    cg = compile_graph(TwoPlaces(None, None), [torch.randn(3, 4)], 2)
    assert all("stages" not in p.notes for p in cg.plans)


def test_one_placement_on_part_of_the_world_is_noted():
    """One stage on rank 0 of a world of 2 is not the default stage on every rank."""
    found = [FoundStage(P("cpu", [0]), ("parameter w",))]
    assert stages_note(gm_with(found), 2) == "stages found from placements: stage 0 = ranks [0] (parameter w)"
    assert stages_note(gm_with(found), 1) == ""
    assert stages_note(gm_with([]), 2) == ""


def test_the_same_note_goes_on_every_plan_and_nothing_else_changes():
    found = [FoundStage(P("cpu", [0, 1]), ("input x", "a", "b", "c")), FoundStage(P("cpu", [2]), ("y",))]
    stages = (StageInfo(0, (0, 1)), StageInfo(1, (2,)))
    plans = [ExecutionPlan(r, 3, [], stages=stages) for r in range(3)]
    before = [p.instructions for p in plans]
    out = note_stages(plans, gm_with(found), 3)
    assert out is plans and [p.instructions for p in out] == before
    assert [p.notes for p in out] == [{"stages": "stages found from placements: stage 0 = ranks "
                                                 "[0, 1] (input x, a, b, ...), stage 1 = ranks [2] (y)"}] * 3
    assert note_stages(plans[:1], gm_with([]), 3)[0].notes["stages"].startswith("stages found")  # kept
