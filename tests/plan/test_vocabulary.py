"""Each instruction class owns its vocabulary (graphc/plan/instructions.py): one sample of
every class in INSTRUCTIONS prints, parses and serialises back to itself, its JSON is read by
that class alone, and its timeline kind, count word and label come from the class."""
import pytest

from graphc.plan.instructions import (INSIDE_COMPUTE, INSTRUCTIONS, STAGE_COMPUTES, AllReduce, Backward,
                                      BackwardInput, BackwardWeight, ClipGradNorm, Collective,
                                      Forward, OptimizerStep, OutputAllReduce, OverlapFB, PrePass, Recv, Send, TensorSpec,
                                      TieAllReduce, instruction_from_json, parse_instruction,
                                      AllGather, ReduceScatter, ReleaseParams, UnitGather, UnitRelease)
from graphc.runtime.trace import COMPUTE_KINDS, KINDS

H = TensorSpec("h", (4, 8), "float64")
SAMPLES = [Forward(1, 3), Backward(1, 3), BackwardInput(0, 2), BackwardWeight(0, 2),
           OverlapFB(Forward(2, 3), Backward(1, 1)), PrePass(0, 1),
           Send(0, 3, 1, "F", 1, (H,)), Recv(1, 3, 0, "F", 0, (H,)),
           Collective("all_gather", 1, 0, "F", (0, 1), "box_1", "S(0)", "B", 128, "fallback: x"),
           AllReduce((0, 1), (H,)), TieAllReduce((0, 3), (H,), ("lm_head.weight",)),
           ClipGradNorm((0, 1), (TensorSpec("grad_norm_sq", (), "float64"),), 0.5, ("w",)),
           OutputAllReduce((0, 1), (TensorSpec("loss", (4,), "float64"),)),
           OptimizerStep(), ReduceScatter((0, 1), (H,)), AllGather((0, 1), (H,)), ReleaseParams((H,)),
           UnitGather((0, 1), (H,), 1, 2, "B", 3), UnitRelease((H,), 1, 2, "F", 3),
           Send(0, 1, 1, "P", 1, (H,))]   # a pre-pass's values (NOTE: Whole-batch sums)


def test_one_sample_of_every_class():
    assert list(dict.fromkeys(type(s) for s in SAMPLES)) == list(INSTRUCTIONS)


@pytest.mark.parametrize("ins", SAMPLES, ids=lambda i: type(i).__name__)
def test_prints_parses_and_serialises_back(ins):
    assert parse_instruction(str(ins)) == ins and str(parse_instruction(str(ins))) == str(ins)
    assert instruction_from_json(ins.to_json()) == ins
    assert [cls for cls in INSTRUCTIONS if cls.reads_json(ins.to_json())] == [type(ins)]
    assert str(ins).split(" ", 1)[0] == ins.label
    assert ins.span_kind in KINDS and ins.word


def test_kinds_and_letters_come_from_the_classes():
    assert COMPUTE_KINDS == ("forward", "backward", "backward_input", "backward_weight", "overlap", "pre_pass")
    assert [c.letter for c in STAGE_COMPUTES] == ["F", "B", "I", "W"]
    assert [c.word for c in STAGE_COMPUTES] == ["F", "B", "I", "W"]
    assert OverlapFB(Forward(2, 3), Backward(1, 1)).caption == "F3|B1"
    assert Collective("all_reduce", 0, 0, "B", (0, 1), "n", "P", "B", 8).span_kind == "collective"


def test_every_class_names_its_run_entry():
    """The runtime runs each kind through the entry its class names, `Runtime._run_<runs>`:
    a subclass (AllGather, ClipGradNorm under AllReduce) is told apart by its own entry, not
    by where an isinstance chain tests it."""
    from graphc.runtime.actors import Runtime
    for cls in INSTRUCTIONS:
        assert callable(getattr(Runtime, f"_run_{cls.runs}", None)), cls.__name__
    assert {c.runs for c in (Collective, UnitGather, UnitRelease)} == {INSIDE_COMPUTE}
    assert len({AllReduce.runs, AllGather.runs, ClipGradNorm.runs}) == 3
    assert ReduceScatter.runs == TieAllReduce.runs == AllReduce.runs


def test_every_collective_names_what_it_joins():
    """Verification pairs a collective with its group's by what its class `joins`: every such
    entry has a signature and a difference in plan/verify_collectives.py, and exactly the kinds whose
    every member issues them together join something (a unit release, which runs inside its
    compute like a unit gather, joins nothing)."""
    from graphc.plan import verify, verify_collectives
    joined = {cls.__name__ for cls in INSTRUCTIONS if cls.joins}
    assert joined == {"Collective", "AllReduce", "TieAllReduce", "ClipGradNorm", "OutputAllReduce",
                      "ReduceScatter", "AllGather", "UnitGather"}
    for cls in INSTRUCTIONS:
        assert cls.joins in ("", *verify_collectives._SIGNATURES) and (
            not cls.joins or cls.joins in verify_collectives._DIFFERENCES)
    assert verify.signature(SAMPLES[8])[0] == "collective"
    assert verify.signature(SAMPLES[11]) == ("ClipGradNorm", (0, 1), SAMPLES[11].tensors, 0.5)
