"""verify_traced / verify_annotated / warn_unused_parameters: a traced or annotated graph
that breaks a rule of build() (a host sync, backward() twice or with arguments, a value
flowing to an earlier stage, a stage nothing runs on, a loss that is not a scalar or needs
no gradient) is refused with a GraphcError naming the node, the user's line (here: this
file's, found by its `# LINE:` marker) and the fix; a well-formed step passes both checks
unchanged. A module with parameters that build() never calls is a warning, not an error.
Real traced graphs, one process, nothing run."""
import copy
import os
import re
import warnings

import pytest
import torch
import torch.nn as nn

import graphc
from graphc.errors import GraphcError
from graphc.meta import META_STAGE
from graphc.passes.user_lines import node_line
from graphc.passes.verify_graph import verify_annotated, verify_traced, warn_unused_parameters
from helpers import compile_graph

X = torch.randn(4, 8)
HERE = os.path.abspath(__file__)


def line(marker):
    """'test_verify_graph.py", line N' of the line carrying `# LINE: marker`."""
    with open(HERE) as f:
        n = next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# LINE: {marker}"))
    return f'{os.path.basename(HERE)}", line {n}'


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)


class Step(graphc.Graph):
    """`body(self, x)` is build(); stages maps a layer name to (stage id, ranks)."""

    def __init__(self, body, stages=None, spare=False):
        super().__init__()
        self.model = TwoLayers()
        if spare:
            self.spare = nn.Linear(8, 2)
        for name, (sid, ranks) in (stages or {}).items():
            getattr(self.model, name).config.set_stage(sid, graphc.placement("cpu", ranks))
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))
        self.body = body

    def build(self, x):
        return self.body(self, x)


def good(self, x):
    loss = self.model.b(self.model.a(x)).sum()  # LINE: good
    loss.backward()
    return loss


def refused(body, *fragments, world=1, **kw):
    with pytest.raises(GraphcError) as info:
        compile_graph(Step(body, **kw), [X], world)
    for f in fragments:
        assert f in str(info.value), f"{f!r} not in:\n{info.value}"


def test_a_well_formed_step_passes_both_checks_unchanged():
    cg = compile_graph(Step(good, stages={"a": (0, [0]), "b": (1, [1])}), [X], 2)
    names = [r.name for r in cg.history]
    assert names.index("verify_traced") < names.index("verify_annotated")
    before = str(cg.gm.graph)
    verify_traced(cg.gm)
    verify_annotated(cg.gm, {"model.a": 0, "model.b": 1}, 2)
    assert str(cg.gm.graph) == before
    summed = next(n for n in cg.gm.graph.nodes if n.target == "sum")
    assert line("good") in node_line(summed) and "self.model.b(self.model.a(x)).sum()" in node_line(summed)


def item(self, x):
    loss = self.model.a(x).sum()
    scale = loss.item()  # LINE: item
    loss.backward()
    return loss * scale


def tolist(self, x):
    loss = self.model.a(x).sum()
    values = self.model.a(x).tolist()  # LINE: tolist
    loss.backward()
    return loss, values


@pytest.mark.parametrize("body", [item, tolist], ids=["item", "tolist"])
def test_a_host_sync_is_refused_at_its_line(body):
    refused(body, f"build() calls .{body.__name__}() at", line(body.__name__),
            "tensors are symbolic", f"Fix: return the tensor from build() and call "
            f".to_local().{body.__name__}() on the result")


def twice(self, x):
    a = self.model.a(x).sum()
    a.backward()
    b = self.model.b(x).sum()
    b.backward()  # LINE: twice
    return a + b


def with_gradient(self, x):
    loss = self.model.a(x).sum()
    loss.backward(torch.ones(()))  # LINE: gradient
    return loss


def test_backward_twice_names_the_second_call():
    refused(twice, "build() calls backward() 2 times (at", line("twice"), "b.backward()",
            "Fix: sum the losses and call backward() once")


def test_backward_with_arguments_is_refused():
    refused(with_gradient, "backward() at", line("gradient"), "takes no arguments in build()",
            "graphc scales the loss for gradient accumulation itself")


def reversed_stages(self, x):
    loss = self.model.b(self.model.a(x)).sum()  # LINE: reversed
    loss.backward()
    return loss


def test_a_value_flowing_to_an_earlier_stage_names_both_nodes():
    refused(reversed_stages, "runs on stage 0 but uses", "computed on the later stage 1", line("reversed"),
            "Fix: give the stages ids in the order build() calls them",
            stages={"a": (1, [1]), "b": (0, [0])}, world=2)


def only_a(self, x):
    loss = self.model.a(x).sum()
    loss.backward()
    return loss


@pytest.mark.filterwarnings("ignore:graphc. module")  # the layers it leaves unused
def test_a_stage_nothing_runs_on_names_its_module():
    refused(only_a, "module 'model.b' is set to stage 1 but build() never runs anything on that stage",
            "Fix: call the module in build(), or remove its set_stage",
            stages={"a": (0, [0]), "b": (1, [1])}, world=2)


def not_scalar(self, x):
    out = self.model.a(x)
    out.backward()  # LINE: not scalar
    return out


def no_grad_loss(self, x):
    loss = (x * 2).sum()
    loss.backward()  # LINE: no grad
    return loss


@pytest.mark.filterwarnings("ignore:graphc. module")  # the layers it leaves unused
def test_the_loss_must_be_a_scalar_that_needs_a_gradient():
    refused(not_scalar, "backward() is called on 'model_a' with shape [4, 8]", line("not scalar"),
            "it must be a scalar loss. Fix: reduce it first")
    refused(no_grad_loss, "does not depend on any parameter that requires grad", line("no grad"),
            "Fix: check that the loss is computed from the model's output")


def test_a_node_left_without_a_stage_is_an_internal_error():
    gm = copy.deepcopy(compile_graph(Step(good), [X], 1).gm)
    node = next(n for n in gm.graph.nodes if n.target == "sum")
    del node.meta[META_STAGE]
    with pytest.raises(GraphcError, match=f"internal: annotate_stages left node '{node.name}' without a stage"):
        verify_annotated(gm, {}, 1)


def test_a_module_build_never_calls_warns_and_compiles():
    with pytest.warns(UserWarning, match=re.escape("module(s) ['spare'] of Step have parameters but "
                                                   "build() never uses them")):
        cg = compile_graph(Step(good, spare=True), [X], 1)
    assert cg.plans
    with warnings.catch_warnings():  # every module used: nothing to say
        warnings.simplefilter("error")
        graph = Step(good)
        warn_unused_parameters(graph._compile_spec().root, compile_graph(graph, [X], 1).gm)
