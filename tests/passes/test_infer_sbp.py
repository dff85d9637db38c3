"""infer_sbp in one process: graphs compiled for 2 ranks without a process group."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import compiler, sbp
from graphc.meta import META_GRAD_PARTIAL, META_SBP
from graphc.placement import Broadcast, PartialSum, Split
from helpers import assert_close, run_world

P01 = graphc.placement("cpu", [0, 1])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class LossGraph(graphc.Graph):
    def __init__(self, model, body=None):
        super().__init__()
        self.model = model
        self.body = body
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x, y):
        out = self.body(self.model(x)) if self.body else self.model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss


def compile_for(graph, x_sbp=None, y_sbp=None, world=2, batch=8, features=8):
    x, y = torch.randn(batch, features), torch.randint(0, 4, (batch,))
    layouts = [(P01, x_sbp) if x_sbp else None, (P01, y_sbp) if y_sbp else None]
    return compiler.compile(graph, [x, y], world, layouts)


def sig_of(cg, predicate):
    return [n.meta[META_SBP] for n in cg.gm.graph.nodes if predicate(n) and META_SBP in n.meta]


def test_data_parallel_splits_the_batch_and_marks_gradients_partial():
    model = graphc.to_global(Net(), placement=P01, sbp=sbp.broadcast)
    cg = compile_for(LossGraph(model), sbp.split(0), sbp.split(0))
    linears = sig_of(cg, lambda n: n.target is F.linear)
    assert [s.out for s in linears] == [(Split(0),), (Split(0),)]
    params = [n for n in cg.gm.graph.nodes if n.op == "get_attr"]
    assert params and all(n.meta[META_GRAD_PARTIAL] == (0,) for n in params)
    loss = [n for n in cg.gm.graph.nodes if "cross_entropy" in n.name][0]
    assert loss.meta[META_SBP].out == (PartialSum(),)  # local sum / global batch


def test_megatron_column_then_row_gives_partial_without_gradient_sync():
    model = graphc.to_global(Net(), placement=P01, sbp=sbp.broadcast)
    graphc.to_global(model.fc1, placement=P01, sbp=sbp.split(0))
    graphc.to_global(model.fc2.weight, placement=P01, sbp=sbp.split(1))
    cg = compile_for(LossGraph(model))
    linears = sig_of(cg, lambda n: n.target is F.linear)
    assert linears[0].out == (Split(1),)          # column-parallel: output features split
    assert linears[1].out == (PartialSum(),)      # row-parallel: partial sums
    split = {n.target: n.meta.get(META_GRAD_PARTIAL) for n in cg.gm.graph.nodes if n.op == "get_attr"}
    assert split["model.fc1.weight"] == () and split["model.fc2.weight"] == ()
    synced = [t.name for ins in cg.plans[0].instructions if ins.op == "all_reduce"
              and hasattr(ins, "tensors") for t in ins.tensors]
    assert not [name for name in synced if "fc1" in name or "fc2.weight" in name]


def test_no_layout_means_everything_broadcast_and_no_collectives():
    cg = compile_for(LossGraph(Net()))
    assert all(s.out == (Broadcast(),) for s in sig_of(cg, lambda n: True))
    assert all(ins.op in ("forward", "backward", "optimizer_step") for ins in cg.plans[0].instructions)


def test_op_without_rule_is_a_visible_fallback():
    model = graphc.to_global(Net(), placement=P01, sbp=sbp.broadcast)
    cg = compile_for(LossGraph(model, body=lambda h: torch.logcumsumexp(h, 1)), sbp.split(0), sbp.split(0))
    op = sig_of(cg, lambda n: n.target is torch.logcumsumexp)[0]
    assert op.fallback and op.out == (Broadcast(),)
    text = str(cg.plans[0])
    assert "ALL_GATHER" in text and "fallback: logcumsumexp" in text


def test_a_fallback_gathering_split_values_is_a_logged_warning(capsys):
    model = graphc.to_global(Net(), placement=P01, sbp=sbp.broadcast)
    capsys.readouterr()
    compile_for(LossGraph(model, body=lambda h: torch.logcumsumexp(h, 1)), sbp.split(0), sbp.split(0))
    err = capsys.readouterr().err
    assert "1 op(s) have no SBP rule and gather split or partial values" in err and "'logcumsumexp'" in err
    assert "test_infer_sbp.py" in err  # the user's line


class ActivationNet(nn.Module):
    """MobileNetV2's habit: activation modules (ReLU6, Hardswish, ...) between layers."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.acts = nn.Sequential(nn.ReLU6(), nn.Hardswish(), nn.LeakyReLU(0.2), nn.ELU(), nn.Softplus(),
                                  nn.Hardtanh(-2.0, 2.0), nn.SELU(), nn.Mish())
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.acts(self.fc1(x)))


def test_activation_modules_keep_the_batch_split(capsys):
    """They were run whole after an all-gather of the batch (a silent 'fallback' in the plan)."""
    model = graphc.to_global(ActivationNet(), placement=P01, sbp=sbp.broadcast)
    capsys.readouterr()
    cg = compile_for(LossGraph(model), sbp.split(0), sbp.split(0))
    assert not any(s.fallback for s in sig_of(cg, lambda n: True))
    assert "fallback" not in str(cg.plans[0]) and "ALL_GATHER" not in str(cg.plans[0])
    assert "no SBP rule" not in capsys.readouterr().err


def _activation_dp(rank, world):
    torch.manual_seed(0)
    model = ActivationNet()
    ref = copy.deepcopy(model)
    graph = LossGraph(graphc.to_global(model, placement=P01, sbp=sbp.broadcast))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    rows = slice(4 * rank, 4 * rank + 4)
    loss = graph(graphc.to_global(x[rows], placement=P01, sbp=sbp.split(0)),
                 graphc.to_global(y[rows], placement=P01, sbp=sbp.split(0))).to_local()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = F.cross_entropy(ref(x), y)
    opt.zero_grad(), want.backward(), opt.step()
    return loss, want.detach(), graph.full_state_dict(), ref.state_dict()


@pytest.mark.world
def test_activation_modules_on_data_parallel_equal_eager():
    for loss, want, state, want_state in run_world(_activation_dp, 2):
        assert_close(loss, want, "loss")
        for k, v in want_state.items():
            assert_close(state[k], v, k)


def test_view_and_mean_rules_remap_split_dims():
    from graphc.sbp.rules import RuleCtx, rule_for
    import torch.fx as fx
    from graphc.meta import META_TENSOR, TensorMeta

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[META_TENSOR] = TensorMeta((4, 6, 8), "float32", True)
    v = g.call_method("view", (x, 4, 6, 2, 4))
    v.meta[META_TENSOR] = TensorMeta((4, 6, 2, 4), "float32", True)
    m = g.call_method("mean", (x, 1))
    m.meta[META_TENSOR] = TensorMeta((4, 8), "float32", True)
    view = dict((str(out), req[x]) for req, out in rule_for(v)(RuleCtx(v, 2, {x: Split(0)})))
    assert view["split(0)"] == Split(0) and view["split(1)"] == Split(1)
    assert view["split(2)"] == Split(2)           # 8 -> (2, 4): the leading factor splits
    mean = [(req[x], out) for req, out in rule_for(m)(RuleCtx(m, 2, {x: Split(0)}))]
    assert (Split(1), PartialSum()) in mean       # the reduced dim split: partial
    assert (Split(2), Split(1)) in mean           # a kept dim after it moves down


def test_uneven_split_keeps_its_layout():
    """16 rows over 3 ranks hold 6, 6 and 4 (NOTE: Uneven splits): no longer an error, and
    the column-parallel linear still runs on the shards."""
    p012 = graphc.placement("cpu", [0, 1, 2])
    model = graphc.to_global(Net(), placement=p012, sbp=sbp.broadcast)
    graphc.to_global(model.fc1.weight, placement=p012, sbp=sbp.split(0))  # 16 rows on 3 ranks
    graphc.to_global(model.fc1.bias, placement=p012, sbp=sbp.split(0))
    cg = compile_for(LossGraph(model), world=3)
    assert [s.out for s in sig_of(cg, lambda n: n.target is F.linear)][0] == (Split(1),)


def test_parameter_declared_outside_the_world_is_a_user_error():
    model = graphc.to_global(Net(), placement=graphc.placement("cpu", [0, 1, 2]), sbp=sbp.broadcast)
    with pytest.raises(graphc.GraphcError, match=r"model.fc1.weight.*names rank\(s\) \[2\].*world has 2"):
        compile_for(LossGraph(model), world=2)


def test_partial_or_wrong_arity_parameter_declarations_are_user_errors():
    with pytest.raises(graphc.GraphcError, match="cannot be partial_sum"):
        graphc.to_global(Net(), placement=P01, sbp=sbp.partial_sum)
    mesh = graphc.placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(graphc.GraphcError, match="needs 2 sbp"):
        graphc.to_global(Net().fc1.weight, placement=mesh, sbp=sbp.split(0))
