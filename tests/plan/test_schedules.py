"""Compute orders of the pipeline schedules: golden ones, torch's, valid programs, plans.

torch.distributed.pipelining is the oracle where it has the schedule: each order must be
the compute torch's schedule of the record's `torch_class` runs, action for action (torch's
idle slots and REDUCE_GRAD dropped). Every other check goes over every registered schedule
(See NOTE: Schedule registry); tests/plan/test_schedule_registry.py shows a toy picked up.
"""
import logging
from collections import defaultdict
from unittest import mock

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
from torch.distributed.pipelining.stage import PipelineStage

from graphc.errors import GraphcError
from graphc.passes.lower_plan import lower_plan
from graphc.plan.instructions import (Backward, BackwardInput, BackwardWeight, Forward,
                                      OverlapFB, TensorSpec)
from graphc.plan.plan import StageInfo
from graphc.plan.program import StageProgram
from graphc.plan.schedules import (SCHEDULES, accepts, check_schedule, compute_order, layout,
                                   peak_live)
from graphc.plan.verify import verify_plans

WITH_TORCH = sorted(name for name, s in SCHEDULES.items() if s.torch_class)


def chunk_counts(schedule):
    """The chunks per rank `schedule` runs with: what its layout fixes, else 1 and 2."""
    fixed = SCHEDULES[schedule].family.num_stages(1)
    return (fixed,) if fixed else (1, 2)


def order(schedule, stage, p, m):
    return " ".join(str(i)[len(str(stage)):] for i in compute_order(schedule, stage, p, p, m))


def test_1f1b_p4_m8_matches_the_canonical_order():
    assert order("1f1b", 0, 4, 8) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert order("1f1b", 1, 4, 8) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert order("1f1b", 2, 4, 8) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert order("1f1b", 3, 4, 8) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


def test_gpipe_p4_m8():
    for s in range(4):
        assert order("gpipe", s, 4, 8) == " ".join([f"F{i}" for i in range(8)] + [f"B{i}" for i in range(8)])


@pytest.mark.parametrize("m,stage0,stage1", [
    (1, "F0 B0", "F0 B0"),
    (2, "F0 F1 B0 B1", "F0 B0 F1 B1"),
    (3, "F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"),
])
def test_1f1b_p2_small_m(m, stage0, stage1):
    assert order("1f1b", 0, 2, m) == stage0
    assert order("1f1b", 1, 2, m) == stage1


@pytest.mark.parametrize("m", [1, 2, 3])
def test_gpipe_p2_small_m(m):
    expect = " ".join([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    assert order("gpipe", 0, 2, m) == expect == order("gpipe", 1, 2, m)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 3), (4, 8), (4, 2), (8, 3)])
def test_1f1b_holds_at_most_min_p_minus_s_m(p, m):
    for s in range(p):
        assert peak_live(compute_order("1f1b", s, p, p, m)) == min(p - s, m)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 3), (4, 8), (8, 3)])
def test_gpipe_holds_every_microbatch(p, m):
    for s in range(p):
        assert peak_live(compute_order("gpipe", s, p, p, m)) == m


def test_unknown_schedule_is_a_user_error():
    with pytest.raises(GraphcError, match="unknown pipeline schedule 'zb'"):
        compute_order("zb", 0, 2, 2, 2)


# --- torch.distributed.pipelining as the oracle ---

def torch_order(schedule, p, m, v):
    """Per pipeline rank, the compute torch runs under `schedule`, printed as graphc prints it."""
    cls = get_schedule_class(SCHEDULES[schedule].torch_class)
    if v == 1 and issubclass(cls, PipelineScheduleMulti):
        ops = _one_chunk_per_rank(cls, p, m)
    else:
        ops = get_schedule_ops(SCHEDULES[schedule].torch_class, p, m, num_stages_per_rank=v)
    return [[str(a) for a in rank if a is not None and a.is_compute_op] for rank in ops]


def _one_chunk_per_rank(cls, p, m):
    """The visualizer takes v >= 2 for multi-stage schedules; this builds one with v = 1 as it
    does, from a stand-in stage (the schedule reads only its rank, group size and count)."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p
    return [cls([stage], m).pipeline_order[r] for r in range(p)]


def _grid(schedules):
    for schedule in schedules:
        for p in (2, 4):
            for v in chunk_counts(schedule):
                for m in (p, 2 * p, 4 * p):
                    if accepts(schedule, p, p * v, m):   # (torch refuses dualpipev's m < 2p too)
                        yield schedule, p, v, m


GRID = list(_grid(sorted(SCHEDULES)))
TORCH_GRID = list(_grid(WITH_TORCH))


@pytest.fixture(autouse=True)
def _quiet_torch():
    # torch's zero bubble logs a warning per schedule it pads with idle slots
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("schedule,p,v,m", TORCH_GRID)
def test_order_is_torchs(schedule, p, v, m):
    want = torch_order(schedule, p, m, v)
    got = [[str(i) for i in compute_order(schedule, r, p, p * v, m)] for r in range(p)]
    if schedule == "1f1b":
        # the visualizer numbers the last rank's forwards from 1 (1F1..1F4 for p = m = 4): an
        # off-by-one of Schedule1F1B's drawing, not of its run. The goldens above check that rank.
        got, want = got[:-1], want[:-1]
    assert got == want


# --- every order is a program: F, then B or I then W, once per (stage, micro-batch) ---

PASS = {Forward: "F", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}


def passes_run(order):
    """(stage, micro-batch) -> the passes run on it, in order, e.g. 'FIW'."""
    ran = defaultdict(str)
    for ins in order:
        for part in (ins.forward, ins.backward) if isinstance(ins, OverlapFB) else (ins,):
            ran[part.stage, part.microbatch] += PASS[type(part)]
    return ran


def _accepted(schedule, p, v, m):
    return accepts(schedule, p, p * v, m)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_rank_runs_a_valid_program(schedule):
    check_every_rank_runs_a_valid_program(schedule)


def check_every_rank_runs_a_valid_program(schedule):
    for p in (1, 2, 3, 4, 5):
        for v in (1, 2, 3):
            for m in range(1, 3 * p + 2):
                if not _accepted(schedule, p, v, m):
                    continue
                chunks = layout(schedule, p, p * v)
                for r in range(p):
                    ran = passes_run(compute_order(schedule, r, p, p * v, m))
                    where = f"{schedule} p={p} v={v} m={m} rank {r}"
                    assert set(ran) == {(s, i) for s in chunks[r] for i in range(m)}, where
                    assert {k: x for k, x in ran.items() if x not in ("FB", "FIW")} == {}, where


# --- preconditions: torch's, as GraphcErrors that say what to change ---

@pytest.mark.parametrize("schedule", sorted(set(WITH_TORCH) - {"1f1b"}))
@pytest.mark.parametrize("p", [2, 3])
def test_accepts_the_microbatch_counts_torch_accepts(schedule, p):
    v = chunk_counts(schedule)[-1]
    for m in range(1, 4 * p + 2):
        try:
            torch_order(schedule, p, m, v)
            torch_ok = True
        except ValueError:
            torch_ok = False
        assert _accepted(schedule, p, v, m) == torch_ok, (schedule, p, m)


def test_1f1b_takes_fewer_microbatches_than_ranks():
    # torch's Schedule1F1B needs m >= p; graphc's warm-up of min(p - s, m) does not
    check_schedule("1f1b", 4, 4, 1)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_rounds_must_divide_the_microbatches(schedule):
    with pytest.raises(GraphcError, match=rf"'{schedule}' with 4 pipeline ranks runs micro-batches "
                       r"in .* found 9 micro-batches, which do not split into 2 equal rounds.*"
                       r"set_gradient_accumulation_steps\(8\) or \(10\)"):
        compute_order(schedule, 0, 4, 8, 9)


def test_dualpipev_needs_a_microbatch_per_stage():
    with pytest.raises(GraphcError, match=r"'dualpipev' with 2 pipeline ranks needs at least .* 4; "
                       r"found 3\. Fix: .*set_gradient_accumulation_steps\(4\).*'zbv'"):
        compute_order("dualpipev", 1, 2, 4, 3)


@pytest.mark.parametrize("schedule,p,n,match", [
    ("1f1b", 2, 4, r"'1f1b' with 2 pipeline ranks runs one stage per rank; found 4 stages"),
    ("interleaved_1f1b", 2, 5, r"same number of stages on every rank .* found 5 stages\. "
                               r"Fix: split the model into 4 or 6 stages"),
    ("zbv", 2, 6, r"'zbv' .* exactly two stages per rank, 4 in all; found 6"),
    ("dualpipev", 3, 4, r"'dualpipev' .* exactly two stages per rank, 6 in all; found 4"),
])
def test_stages_per_rank_are_checked(schedule, p, n, match):
    with pytest.raises(GraphcError, match=match):
        check_schedule(schedule, p, n, 4 * p)


def test_inference_orders_are_not_checked():
    # forward_only runs any micro-batch count
    assert len(compute_order("dualpipev", 0, 2, 4, 1, training=False)) == 2


# --- plans lowered from every schedule verify ---

SPEC = TensorSpec("h", (4, 8), "float32")


def _chain(schedule, p, v):
    """Programs and stages of a chain of p*v stages, each sending one tensor to the next,
    laid out as `schedule` needs (one rank per pipeline rank)."""
    n = p * v
    progs = [StageProgram(s, None, [], [], {}, {s - 1: [SPEC]} if s else {},
                          {s + 1: [SPEC]} if s < n - 1 else {}, {"h": True}) for s in range(n)]
    rank_of = {s: r for r, chunks in enumerate(layout(schedule, p, n)) for s in chunks}
    return progs, [StageInfo(s, (rank_of[s],)) for s in range(n)]


def chain_plans(schedule, p, v, m):
    """The chain's training plans, lowered as the compiler lowers them."""
    return lower_plan(*_chain(schedule, p, v), schedule, m, True, p)


@pytest.mark.parametrize("schedule,p,v,m", GRID)
def test_lowered_plans_verify(schedule, p, v, m):
    # with two chunks per rank a channel carries activations and gradients, in an order
    # lower_plan must make the sender's and the receiver's alike
    verify_plans(chain_plans(schedule, p, v, m))


def test_a_bad_microbatch_count_fails_when_lowering():
    with pytest.raises(GraphcError, match="'dualpipev' .* needs at least"):
        chain_plans("dualpipev", 2, 2, 2)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_inference_runs_the_schedules_layout(schedule):
    check_inference_runs_the_schedules_layout(schedule)


def check_inference_runs_the_schedules_layout(schedule):
    p, v = 2, chunk_counts(schedule)[-1]
    chunks = layout(schedule, p, p * v)
    for r in range(p):
        order = compute_order(schedule, r, p, p * v, 3, training=False)
        assert [str(i) for i in order] == [f"{s}F{i}" for s in chunks[r] for i in range(3)]
    plans = lower_plan(*_chain(schedule, p, v), schedule, 3, False, p)
    verify_plans(plans)


PEAK = {  # rank r's peak live chunk-micro-batches, as the docstrings state (k: round size)
    "interleaved_1f1b": lambda p, v, m, k, r: min((v - 1) * k + 2 * (p - r) - 1, v * m),
    "looped_bfs": lambda p, v, m, k, r: v * m,
    "zero_bubble": lambda p, v, m, k, r: min((v - 1) * k + p, v * m),
    "zbv": lambda p, v, m, k, r: min(2 * p, 2 * m, m + r + 1),
    "dualpipev": lambda p, v, m, k, r: 2 * p + 1,
}


@pytest.mark.parametrize("schedule", sorted(PEAK))
def test_peak_live_of_the_multi_chunk_schedules(schedule):
    for p in (1, 2, 3, 4):
        for v in ((2,) if SCHEDULES[schedule].family.num_stages(1) == 2 else (1, 2, 3)):
            for m in range(1, 4 * p + 1):
                if _accepted(schedule, p, v, m):
                    k = m // max(1, m // p)
                    got = [peak_live(compute_order(schedule, r, p, p * v, m)) for r in range(p)]
                    assert got == [PEAK[schedule](p, v, m, k, r) for r in range(p)], (p, v, m)
