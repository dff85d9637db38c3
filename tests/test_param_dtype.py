"""config.set_param_dtype (NOTE: Master parameters, graphc/runtime/master_params.py): bf16
parameters, float32 masters held by the optimizer, float32 gradient accumulation.

CPU bf16 kernels are deterministic, so graphc equals an eager reference that does the same
casts (the model in bf16, a float32 master per parameter stepped by AdamW, each micro-batch's
bf16 gradient added into the master's float32 .grad in order, the masters rounded into the
parameters after the step) bit for bit: in one process, with and without enable_amp, and on
a 2-stage pipeline of real gloo ranks. Checkpoints hold the float32 masters."""
import pytest
import torch
import torch.nn.functional as F

import graphc
from helpers import run_world
from test_amp import M, AmpGraph, Net, _batches   # the same model, graph and data

pytestmark = pytest.mark.fp32


class MasterGraph(AmpGraph):
    def __init__(self, model, opt, amp=True, pipeline=False, param_dtype=torch.bfloat16):
        super().__init__(model, opt, pipeline, amp, param_dtype)


def eager_with_masters(model, batches, amp):
    """The reference: the model in bf16, AdamW on float32 masters; each micro-batch's forward
    (under autocast with amp), backward of loss/M, its bf16 gradients added into the masters'
    float32 .grad in micro-batch order; after the step the masters rounded into the model.
    Returns (losses, the masters by name)."""
    names = [k for k, _ in model.named_parameters()]
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-2)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        parts = []
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(model(xs if amp else xs.bfloat16()), ys)
            (loss / M).backward()
            parts.append(loss.detach())
            for p, m in zip(model.parameters(), masters):
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
        losses.append(torch.stack(parts).mean())
    return losses, {k: m.detach().clone() for k, m in zip(names, masters)}


def _graphc(rank, world, amp, pipeline):
    """graphc's run; on ranks (one thread each: bf16 kernels block by thread count) eager's
    reference beside it."""
    torch.manual_seed(0)
    reference = eager_with_masters(Net(), _batches(), amp) if pipeline else None
    torch.manual_seed(0)
    model = Net()
    graph = MasterGraph(model, torch.optim.AdamW(model.parameters(), lr=1e-2), amp, pipeline)
    losses = [graph(x if amp else x.bfloat16(), y).to_local().clone() for x, y in _batches()]
    held = {p.dtype for ex in graph._runtime.executors.values() for p in ex.program.module.parameters()}
    stepped = {p.dtype for group in graph._optimizer.param_groups for p in group["params"]}
    state = {k: v.clone() for k, v in graph.full_state_dict().items()}
    return losses, state, (held, stepped), str(graph.plan), reference


def _check(losses, state, want_losses, want_state):
    for got, want in zip(losses, want_losses):
        if got.numel():
            assert torch.equal(got.float(), want.float()), (got, want)
    for k, v in want_state.items():
        assert state[k].dtype == torch.float32 and torch.equal(state[k], v), k


@pytest.mark.parametrize("amp", [True, False], ids=["amp", "bf16-compute"])
def test_param_dtype_equals_eager_with_float32_masters_bitwise(amp):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    want_losses, want_state = eager_with_masters(Net(), _batches(), amp)
    losses, state, (held, stepped), _, _ = _graphc(0, 1, amp, False)
    assert held == {torch.bfloat16} and stepped == {torch.float32}
    _check(losses, state, want_losses, want_state)


def test_param_dtype_differs_from_float32_parameters():
    """Not enable_amp under another name: LayerNorm's gradient is rounded to bf16 on its way to
    the master (it computes in float32 under autocast, its parameters are bf16)."""
    torch.set_num_threads(1)
    _, state, _, _, _ = _graphc(0, 1, True, False)
    torch.manual_seed(0)
    model = Net()

    class Amp(MasterGraph):
        def __init__(self, model, opt):
            super().__init__(model, opt, param_dtype=torch.float32)   # float32: off
    graph = Amp(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in _batches():
        graph(x, y)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not torch.equal(graph.full_state_dict()["stage0.2.weight"], state["stage0.2.weight"])


@pytest.mark.world
def test_param_dtype_on_a_pipeline_equals_eager_bitwise():
    results = run_world(_graphc, 2, True, True)
    assert all(any(l.numel() for l in r[0]) for r in results[1:])
    for losses, state, (held, stepped), plan, (want_losses, want_state) in results:
        assert held == {torch.bfloat16} and stepped == {torch.float32}
        _check(losses, state, want_losses, want_state)
    assert "bf16" in results[0][3]


def test_checkpoints_hold_the_float32_masters(tmp_path):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    graph = MasterGraph(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batches = _batches()
    graph(*batches[0])
    sd = graph.state_dict()
    assert {v.dtype for v in sd["model"].values()} == {torch.float32}
    assert {v["exp_avg"].dtype for v in sd["optim"]["state"].values()} == {torch.float32}
    path = str(tmp_path / "rank0.pt")
    graphc.save(sd, path)
    torch.manual_seed(1)
    fresh = Net()
    resumed = MasterGraph(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    resumed.load_state_dict(graphc.load(path))
    for x, y in batches[1:]:
        assert torch.equal(resumed(x, y).to_local(), graph(x, y).to_local())
    for k, v in graph.full_state_dict().items():
        assert torch.equal(resumed.full_state_dict()[k], v), k
    # the bf16 parameters are their masters rounded
    assert torch.equal(fresh.stage1[2].weight, graph.full_state_dict()["stage1.2.weight"].bfloat16())


def test_param_dtype_plan_reduces_in_float32():
    """Data parallel on 2 ranks (compiled here, no process group): the gradient buckets are
    float32 (the masters'), unless set_grad_reduce_dtype asks for bf16; compiling leaves the
    parameters float32 (they are cast when the graph takes them)."""
    from graphc.graph_spec import compile_spec
    from graphc.executable import Executable, input_specs
    where = graphc.placement("cpu", [0, 1])
    x, y = _batches()[0]
    inputs = [graphc.to_global(t[:4], placement=where, sbp=graphc.sbp.split(0)) for t in (x, y)]
    for reduce, want in ((None, {"float32"}), (torch.bfloat16, {"bfloat16"})):
        torch.manual_seed(0)
        model = graphc.to_global(Net(), placement=where, sbp=graphc.sbp.broadcast)
        graph = MasterGraph(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        if reduce is not None:
            graph.config.set_grad_reduce_dtype(reduce)
        plan = Executable.compile(compile_spec(graph), input_specs(inputs), 2).compiled.plans[0]
        buckets = [d for d in plan.to_json()["instructions"]   # (not the loss's sum: an output's)
                   if d["op"] == "all_reduce" and "node" not in d and d.get("purpose") != "output"]
        assert buckets and {t["dtype"] for d in buckets for t in d["tensors"]} == want
        assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_param_dtype_refusals():
    with pytest.raises(graphc.GraphcError, match="set_param_dtype: dtype must be"):
        graphc.Graph().config.set_param_dtype(torch.float64)
    x, y = _batches()[0]   # with enable_zero at any stage: tests/runtime/test_param_dtype_zero.py, tests/zero
    with pytest.raises(graphc.GraphcError, match="needs float32 parameters"):
        model = Net().double()
        MasterGraph(model, torch.optim.AdamW(model.parameters(), lr=1e-2))(x.double(), y)
    with pytest.raises(graphc.GraphcError, match="add_optimizer"):
        MasterGraph(Net(), None)(x, y)
