"""set_param_dtype(bf16) with enable_zero stages 1 and 2 on data 2 (gloo ranks): Megatron's
distributed-optimizer layout (NOTE: ZeRO with master parameters, graphc/runtime/zero.py).

Same ops, same order as set_param_dtype without ZeRO: each rank's micro-batches accumulate
into its masters' float32 .grad in order, and a ZeRO parameter's gradient is then
reduce-scattered where the replicated run all-reduces it. Over 2 ranks each element of the
sum is one float32 addition a_0 + a_1 (or a_1 + a_0: IEEE addition is commutative, so
whichever order gloo's reduce-scatter and all-reduce add in, the bits are the same). AdamW is
per element, so stepping this rank's rows of the master gives those rows' values of the whole
step, and the bf16 ALL_GATHER moves each row rounded as copy_back would round it. So:
  - with and without enable_amp, accumulation 2, stages 1 and 2 equal the replicated
    set_param_dtype run bit for bit (losses, float32 masters, bf16 parameters);
  - with enable_amp they equal eager with masters on each rank's rows bit for bit, which is
    within the data-parallel bound of eager with masters on the whole batch
    (tests/runtime/test_param_dtype_data_parallel.py, which checks that bound);
  - each rank holds only its rows of a sharded master (the whole master's storage freed);
  - a dcp.save of the ZeRO graph loads into a one-process graph (whole float32 masters, Adam's
    state whole), whose dcp.save loads back into a fresh ZeRO graph that ends where the
    unbroken run ends (slow).
"""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import graphc
from helpers import run_world
from test_param_dtype_data_parallel import B, MLP, _batches, _eager_on_rank_rows

pytestmark = pytest.mark.fp32   # each test that spawns ranks is marked world
M, WORLD, K = 2, 2, 2
MIN_SIZE = 64   # l1.weight (32 x 16) and l2.weight (5 x 32: 3 rows and 2) sharded; the rest whole


class ZeroMasters(graphc.Graph):
    def __init__(self, model, amp, zero):
        super().__init__()
        self.model = model
        if amp:
            self.config.enable_amp(True, dtype=torch.bfloat16)
        self.config.set_param_dtype(torch.bfloat16)
        self.config.set_gradient_accumulation_steps(M)
        if zero:
            self.config.enable_zero(True, stage=zero, shard_min_size=MIN_SIZE)
        self.add_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _make(rank, world, amp, zero, seed=0):
    """(graph, model, feed) on data `world` (world 1: plain tensors). Without enable_amp the
    model computes in bf16, so its input is bf16 (as eager on model.to(torch.bfloat16))."""
    torch.manual_seed(seed)
    cast = (lambda x: x) if amp else (lambda x: x.bfloat16())
    if world == 1:
        model = MLP()
        return ZeroMasters(model, amp, zero), model, lambda x, y: (cast(x), y)
    where = graphc.placement("cpu", list(range(world)))
    model = graphc.to_global(MLP(), placement=where, sbp=graphc.sbp.broadcast)
    rows = B // world
    return ZeroMasters(model, amp, zero), model, lambda x, y: tuple(
        graphc.to_global(t[rank * rows:(rank + 1) * rows], placement=where, sbp=graphc.sbp.split(0))
        for t in (cast(x), y))


def _steps(graph, feed, first, last):
    return [graph(*feed(*batch)).to_local().item() for batch in _batches()[first:last]]


def _params(model):
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _held_rows(graph):
    """Per sharded master: (bytes of the whole master's storage, rows the optimizer steps)."""
    return {s.name: (s.master.untyped_storage().nbytes(), s.shard.shape[0], s.shard.dtype)
            for s in graph._runtime.zero.by_name.values()}


def _numerics(rank, world):
    torch.set_num_threads(1)
    out = {"reference": _eager_on_rank_rows()}
    for amp in (False, True):
        for zero in (0, 1, 2):
            graph, model, feed = _make(rank, world, amp, zero)
            losses = _steps(graph, feed, 0, 3)
            out[(amp, zero)] = (losses, graph.full_state_dict(), _params(model),
                                _held_rows(graph) if zero else None)
    return out


@pytest.fixture(scope="module")
def numerics():
    old = torch.get_default_dtype()   # module-scoped: before the fp32 mark sets it
    torch.set_default_dtype(torch.float32)
    try:
        return run_world(_numerics, WORLD)
    finally:
        torch.set_default_dtype(old)


@pytest.mark.world
@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_masters_equals_replicated_masters_bitwise(numerics, amp, zero):
    for out in numerics:
        losses, state, params, _ = out[(amp, zero)]
        want_losses, want_state, want_params, _ = out[(amp, 0)]
        assert losses == want_losses
        for k, v in want_state.items():
            assert state[k].dtype == torch.float32 and torch.equal(state[k], v), k
        for k, v in want_params.items():
            assert params[k].dtype == torch.bfloat16 and torch.equal(params[k], v), k


@pytest.mark.world
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_masters_and_amp_equals_eager_with_masters_bitwise(numerics, zero):
    for out in numerics:
        _, state, _, _ = out[(True, zero)]
        for k, v in out["reference"].items():
            assert torch.equal(state[k], v), k


@pytest.mark.world
def test_each_rank_holds_only_its_rows_of_the_sharded_masters(numerics):
    for rank, out in enumerate(numerics):
        for zero in (1, 2):
            held = out[(True, zero)][3]
            assert held == {"model.l1.weight": (0, 16, torch.float32),
                            "model.l2.weight": (0, (3, 2)[rank], torch.float32)}, (rank, zero)


def test_plan_gathers_bf16_parameters_and_scatters_float32_gradients():
    """Compiled here for 2 ranks (no process group): the ALL_GATHER after the step moves the
    bf16 parameters (half the bytes of float32), the REDUCE_SCATTER the masters' float32
    gradients (bf16 with set_grad_reduce_dtype)."""
    from graphc.graph_spec import compile_spec
    from graphc.executable import Executable, input_specs
    x, y = _batches()[0]
    for reduce, want in ((None, "float32"), (torch.bfloat16, "bfloat16")):
        graph, model, feed = _make(0, WORLD, amp=True, zero=1)
        if reduce is not None:
            graph.config.set_grad_reduce_dtype(reduce)
        plan = Executable.compile(compile_spec(graph), input_specs(feed(x, y)), WORLD).compiled.plans[0]
        ops = plan.to_json()["instructions"]
        gathers = [t for d in ops if d["op"] == "all_gather" for t in d["tensors"]]
        scatters = [t for d in ops if d["op"] == "reduce_scatter" for t in d["tensors"]]
        assert sorted(t["name"] for t in gathers) == ["model.l1.weight", "model.l2.weight"]
        assert {t["dtype"] for t in gathers} == {"bfloat16"}
        assert {t["dtype"] for t in scatters} == {want}
        listing = str(plan)
        assert "ALL_GATHER" in listing and "bf16" in listing


# -- checkpoints: ZeRO (data 2) -> one process -> ZeRO (data 2) ---------------------------
def _save(rank, world, a):
    torch.set_num_threads(1)
    graph, _, feed = _make(rank, world, amp=True, zero=2)
    _steps(graph, feed, 0, K)
    at_k = graph.full_state_dict()
    dcp.save(graph.state_dict(), checkpoint_id=a)
    _steps(graph, feed, K, 3)
    return {"at_k": at_k, "end": graph.full_state_dict()}


def _one_process(rank, world, a, b):
    graph, _, feed = _make(rank, world, amp=True, zero=0, seed=1)
    graph.compile(*feed(*_batches()[K]))
    sd = graph.state_dict()
    dcp.load(sd, checkpoint_id=a)
    graph.load_state_dict(sd)
    loaded = graph.full_state_dict()
    dcp.save(graph.state_dict(), checkpoint_id=b)
    return {"loaded": loaded, "adam": graph.state_dict()["optim"]["state"]}


def _resume(rank, world, b):
    torch.set_num_threads(1)
    graph, model, feed = _make(rank, world, amp=True, zero=2, seed=2)
    graph.compile(*feed(*_batches()[K]))
    sd = graph.state_dict()
    dcp.load(sd, checkpoint_id=b)
    graph.load_state_dict(sd)
    _steps(graph, feed, K, 3)
    return {"end": graph.full_state_dict()}


@pytest.mark.world
@pytest.mark.slow
def test_dcp_round_trip_through_one_process_ends_where_the_unbroken_run_ends(tmp_path):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        a, b = os.fspath(tmp_path / "a"), os.fspath(tmp_path / "b")
        saved = run_world(_save, WORLD, a)
        one = run_world(_one_process, 1, a, b)[0]
        resumed = run_world(_resume, WORLD, b)
    finally:
        torch.set_default_dtype(old)
    for k, v in saved[0]["at_k"].items():
        assert one["loaded"][k].dtype == torch.float32 and torch.equal(one["loaded"][k], v), k
    assert set(one["adam"]) == {k.removeprefix("model.") for k in saved[0]["at_k"]}
    for rank in range(WORLD):
        for k, v in saved[rank]["end"].items():
            assert torch.equal(resumed[rank]["end"][k], v), (rank, k)
