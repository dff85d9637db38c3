"""insert_checkpoints: a module marked set_activation_checkpointing(True) runs, in every stage
program, as one CheckpointedRegion per call (its traced nodes moved there in order, one
`graphc_checkpoint_<k>` node in their place), keeps only the region's inputs, and changes no
number: losses, parameters and BatchNorm statistics are those of the unmarked program bit
for bit (the recompute re-enters the micro-batch's random draw and the forward's buffers).
A region that communicates is refused. One process, float64."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
import graphc.testing
from graphc import sbp
from graphc.errors import GraphcError
from graphc.meta import META_BOXING
from graphc.passes.insert_checkpoints import CheckpointedRegion
from helpers import assert_same_as_eager, compile_graph, eager_train, graphc_train

STEPS, BATCH = 3, 8
P01 = graphc.placement("cpu", [0, 1])


class Block(nn.Module):
    """A residual block with a buffer (BatchNorm's running statistics) and a random op."""

    def __init__(self, p=0.0):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(p)

    def forward(self, h):
        return self.drop(F.gelu(self.bn(self.fc(h)))) + h


def make_model(p=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(p), nn.Linear(16, 4))


class Net(graphc.Graph):
    """make_model() trained with SGD; `marked` names the modules checkpointed, `twice` calls
    the block a second time (one region per call)."""

    def __init__(self, model, marked=("model.1",), accumulation=1, twice=False, train=True):
        super().__init__()
        self.model = model
        for name in marked:  # "model.<i>": reached through the Graph (a ModuleBlock has .config)
            self.model[int(name.split(".")[1])].config.set_activation_checkpointing(True)
        self.twice, self.train_ = twice, train
        self.config.set_gradient_accumulation_steps(accumulation)
        self.config.set_memory_stats(True)   # max_live_bytes: what checkpointing keeps
        if train:
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x, y):
        h = self.model[1](self.model[0](x))
        h = self.model[1](h) if self.twice else h
        loss = F.cross_entropy(self.model[2](h), y)
        if self.train_:
            loss.backward()
        return loss


def batches():
    torch.manual_seed(1)
    return [(torch.randn(BATCH, 8), torch.randint(0, 4, (BATCH,))) for _ in range(STEPS)]


def owned_by(node, name):
    return any(path == name for path, _ in (node.meta.get("nn_module_stack") or {}).values())


def regions(prog):
    return [(n, prog.module.get_submodule(n.target)) for n in prog.module.graph.nodes
            if n.op == "call_module" and n.target.startswith("graphc_checkpoint_")]


def signature(nodes):
    return [(n.op, str(n.target)) for n in nodes if n.op not in ("placeholder", "output")]


def test_a_marked_module_becomes_one_region_holding_its_nodes_in_order():
    x, y = batches()[0]
    plain = compile_graph(Net(make_model(), marked=()), [x, y], 1).programs[0]
    prog = compile_graph(Net(make_model()), [x, y], 1).programs[0]
    (call, region), = regions(prog)
    assert call.target == "graphc_checkpoint_0" and isinstance(region, CheckpointedRegion)
    assert region.module_name == "model.1"
    # outside the region only the region's call and the getitems of its results remain
    left = [n for n in prog.module.graph.nodes if owned_by(n, "model.1")]
    assert all(n is call or n.args[0] is call for n in left), [n.name for n in left]
    assert signature(region.body.graph.nodes) == signature(n for n in plain.module.graph.nodes
                                                           if owned_by(n, "model.1"))
    assert not regions(plain)


def test_each_call_of_a_marked_module_is_its_own_region():
    x, y = batches()[0]
    prog = compile_graph(Net(make_model(), twice=True), [x, y], 1).programs[0]
    found = regions(prog)
    assert [n.target for n, _ in found] == ["graphc_checkpoint_0", "graphc_checkpoint_1"]
    assert {r.module_name for _, r in found} == {"model.1"}
    assert signature(found[0][1].body.graph.nodes) == signature(found[1][1].body.graph.nodes)


def test_inference_and_unmarked_graphs_are_left_as_they_are():
    x, y = batches()[0]
    assert not regions(compile_graph(Net(make_model(), train=False), [x, y], 1).programs[0])
    assert not regions(compile_graph(Net(make_model(), marked=()), [x, y], 1).programs[0])


@pytest.mark.filterwarnings("ignore:BatchNorm 'model.1.bn' trains under gradient accumulation")
@pytest.mark.parametrize("accumulation,p", [(1, 0.0), (2, 0.0), (2, 0.3)])
def test_checkpointing_changes_no_number(accumulation, p):
    """Bit for bit the unmarked graph's losses and state (running statistics included, so the
    recompute updated none twice; dropout's masks, so it drew the forward's), and with one
    micro-batch and no dropout eager PyTorch's within 1e-10."""
    data = batches()
    plain = graphc_train(Net(make_model(p), marked=(), accumulation=accumulation), data)
    marked = graphc_train(Net(make_model(p), accumulation=accumulation), data)
    assert plain[0] == marked[0]
    assert plain[1].keys() == marked[1].keys()
    for k in plain[1]:
        assert torch.equal(plain[1][k], marked[1][k]), k
    if accumulation == 1 and p == 0.0:
        ref = eager_train(make_model(), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), None,
                          nn.CrossEntropyLoss(), data, STEPS)
        assert_same_as_eager(*marked, *ref, "checkpointed block")


def test_a_checkpointed_module_keeps_only_its_inputs():
    data = batches()
    peaks = []
    for marked in ((), ("model.1",)):
        graph = Net(make_model(), marked=marked)
        graphc_train(graph, data, 1)
        peaks.append(graph.last_stats.max_live_bytes[0])
    assert peaks[1] < peaks[0], peaks


class Communicating(graphc.Graph):
    """A checkpointed block whose column-parallel linear is followed by a softmax over the
    split features: the block itself must gather them."""

    def __init__(self):
        super().__init__()
        self.model = graphc.to_global(nn.Sequential(nn.Linear(8, 16), nn.Softmax(-1), nn.Linear(16, 4)),
                                      placement=P01, sbp=sbp.broadcast)
        graphc.to_global(self.model[0], placement=P01, sbp=sbp.split(0))
        self.model.config.set_activation_checkpointing(True)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def test_a_region_that_communicates_is_refused():
    x, y = batches()[0]
    with pytest.raises(GraphcError, match=r"module 'model' is marked set_activation_checkpointing\(True\), "
                                          r"but its forward communicates \(SBP conversions \[.+\]\); "
                                          r"recomputing it would run those collectives again\. Fix: "):
        compile_graph(Communicating(), [x, y], 2)


class Megatron(graphc.Graph):
    """A checkpointed column- then row-parallel pair on 2 ranks: inside the block only local
    conversions (the row-parallel bias made partial, decompose_modules), its partial result
    all-reduced by the loss outside it."""

    def __init__(self, model):
        super().__init__()
        self.model = graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
        graphc.to_global(self.model[0], placement=P01, sbp=sbp.split(0))
        graphc.to_global(self.model[2].weight, placement=P01, sbp=sbp.split(1))
        self.model.config.set_activation_checkpointing(True)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def megatron_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_a_local_conversion_inside_a_call_recomputes_and_a_collective_after_it_stays_outside():
    """One region per rank holding the local to_partial (inserted between the block's nodes,
    it does not cut the call in two); the all-reduce after the block is outside it. Two
    ranks of a local world (threads of this process) train like eager at 1e-10."""
    data = batches()
    x, y = data[0]
    for prog in compile_graph(Megatron(megatron_model()), [x, y], 2).programs:
        (call, region), = regions(prog)
        inside = [n.meta[META_BOXING].kind for n in region.body.graph.nodes if META_BOXING in n.meta]
        outside = [n.meta[META_BOXING].kind for n in prog.module.graph.nodes if META_BOXING in n.meta]
        assert inside == ["to_partial"] and outside == ["all_reduce"], (inside, outside)
    run = graphc.testing.local_world(lambda: Megatron(megatron_model()), data, 2)
    ref = eager_train(megatron_model(), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), None,
                      nn.CrossEntropyLoss(), data, STEPS)
    assert_same_as_eager(run.losses, run.state, *ref, "checkpointed Megatron pair, local world 2")
