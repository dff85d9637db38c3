"""ZeRO stage 3 with set_param_dtype(bf16) on data 2 (local world: every rank a thread of this
process, the runtime held bitwise to gloo): float32 master rows, bf16 gathers (See NOTE: ZeRO
with master parameters, graphc/runtime/zero.py).

The tolerance is derived, not chosen: stage 3 runs the ops of the replicated set_param_dtype
run in the same order. Each gather moves a rank's master rows rounded to bf16, which is what
the replicated run's copy_back rounds them to; each rank accumulates its micro-batches into
its masters' float32 .grad in order, and the reduce-scatter sums the two ranks' addends with
one float32 addition a_0 + a_1 (commutative, so whichever order the collective adds in, the
bits are the same) where the replicated run's all-reduce does; AdamW is per element, so
stepping this rank's rows gives those rows' values of the whole step. So stage 3 equals the
replicated run bit for bit (tolerance 0), with and without enable_amp, whole stage and per
unit, and with amp it equals eager doing the same casts (masters on each rank's rows,
tests/runtime/test_param_dtype_data_parallel.py) bit for bit. The plan's gathers say bf16:
half the bytes of float32.
"""
import os
import sys

import pytest
import torch

import graphc
import graphc.testing
from graphc.plan.instructions import AllGather, ReduceScatter
from helpers import run_world

# the masters' model, data and eager reference live beside the stage 1-2 tests
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from test_param_dtype_data_parallel import _eager_on_rank_rows   # noqa: E402
from test_param_dtype_zero import MIN_SIZE, WORLD, ZeroMasters, _batches, _make  # noqa: E402

pytestmark = pytest.mark.fp32


class Zero3Masters(ZeroMasters):
    def __init__(self, model, amp, zero, unit_bytes=0):
        super().__init__(model, amp, zero)
        if zero == 3:
            self.config.enable_zero(True, stage=3, shard_min_size=MIN_SIZE, unit_bytes=unit_bytes)


def _run(amp: bool, zero: int, unit_bytes: int = 0):
    """(losses, full state, rank 0's graph) of three steps."""
    def make(rank):
        graph, model, feed = _make(rank, WORLD, amp, 0)
        graph = Zero3Masters(model, amp, zero, unit_bytes) if zero else graph
        graph._feed, graph._model = feed, model
        return graph

    feeds = {}

    def inputs(rank, step):
        if rank not in feeds:
            feeds[rank] = _make(rank, WORLD, amp, 0)[2]
        return feeds[rank](*_batches()[step])

    run = graphc.testing.local_world(make, inputs, WORLD, steps=3)
    return run.losses, run.state, run.graphs[0]


@pytest.mark.parametrize("amp,unit_bytes", [(True, 0), (False, 1)])
def test_zero3_with_bf16_parameters_equals_replicated_masters_bitwise(amp, unit_bytes):
    old, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)     # as the eager reference's ranks (one thread each)
    try:
        want_losses, want_state, _ = _run(amp, 0)
        losses, state, graph = _run(amp, 3, unit_bytes)
        reference = _eager_on_rank_rows() if amp else None
    finally:
        torch.set_default_dtype(old)
        torch.set_num_threads(threads)
    assert losses == want_losses
    for k, v in want_state.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
    for k, v in (reference or {}).items():    # eager doing the same casts
        assert torch.equal(state["model." + k], v), k
    plan = graph.plan
    gathers = [t for i in plan.instructions if isinstance(i, AllGather) for t in i.tensors]
    scatters = [t for i in plan.instructions if isinstance(i, ReduceScatter) for t in i.tensors]
    assert {t.name for t in gathers} == {"model.l1.weight", "model.l2.weight"}
    assert {t.dtype for t in gathers} == {"bfloat16"} and {t.dtype for t in scatters} == {"float32"}
    shards = graph._runtime.zero.by_name.values()
    assert all(s.shard.dtype == torch.float32 and s.master.untyped_storage().nbytes() == 0 for s in shards)


def test_stage_3_gathers_in_bf16_move_half_the_bytes_of_float32():
    """Compiled here for 2 ranks (no process group): the same stage-3 plan with float32
    parameters and with set_param_dtype(bf16); its ALL_GATHERs' bytes (to_json) halve, its
    REDUCE_SCATTERs stay float32 (the masters' gradients)."""
    from graphc.executable import Executable, input_specs
    from graphc.graph_spec import compile_spec
    x, y = _batches()[0]
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        _, model, feed = _make(0, WORLD, True, 0)
        graph = Zero3Masters(model, True, 3)
        graph.config.set_param_dtype(dtype)     # float32: no masters
        plan = Executable.compile(compile_spec(graph), input_specs(feed(x, y)), WORLD).compiled.plans[0]
        ops = plan.to_json()["instructions"]
        moved[dtype] = {op: sum(d["bytes"] for d in ops if d["op"] == op) for op in ("all_gather", "reduce_scatter")}
        assert ("bf16[" in str(plan)) == (dtype == torch.bfloat16)
    assert moved[torch.float32]["all_gather"] > 0
    assert moved[torch.bfloat16]["all_gather"] * 2 == moved[torch.float32]["all_gather"]
    assert moved[torch.bfloat16]["reduce_scatter"] == moved[torch.float32]["reduce_scatter"]


def _on_rank(rank, world):
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    out = {}
    for zero in (0, 3):
        _, model, feed = _make(rank, world, True, 0)
        graph = Zero3Masters(model, True, zero)
        losses = [graph(*feed(*batch)).to_local().item() for batch in _batches()[:3]]
        out[zero] = (losses, graph.full_state_dict())
    return out


@pytest.mark.world
@pytest.mark.slow   # CI time: the local world above runs the same plans by default
def test_zero3_with_bf16_parameters_on_gloo_equals_replicated_masters_bitwise():
    for out in run_world(_on_rank, WORLD):
        assert out[3][0] == out[0][0]
        for k, v in out[0][1].items():
            assert torch.equal(out[3][1][k], v), k
