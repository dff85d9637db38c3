"""insert_grad_modes: in every stage program of a training graph each node runs in the grad
mode build() traced it in, a `_set_grad_enabled` call sits wherever the mode changes, and
the program ends in grad mode; inference programs are left as they are."""
import copy
import types

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.meta import META_GRAD_ENABLED
from graphc.passes.insert_grad_modes import insert_grad_modes
from helpers import assert_same_as_eager, compile_graph, eager_train, graphc_train

SWITCH = torch._C._set_grad_enabled


def modes(gm: fx.GraphModule):
    """[(node, the grad mode it runs in)] walking the program as Python runs it (grad mode
    on at entry, as the executor calls it), and the mode at its output."""
    mode, out = True, []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is SWITCH:
            mode = node.args[0]
        elif node.op == "output":
            return out, mode
        elif node.op not in ("placeholder", "get_attr"):
            out.append((node, mode))
    return out, mode


def switches(gm: fx.GraphModule):
    return [n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target is SWITCH]


def program_of(traced_modes):
    """A one-input program whose k-th relu was traced in grad mode traced_modes[k] (None:
    a node graphc inserted, without a recorded mode)."""
    g = fx.Graph()
    h = g.placeholder("x")
    for mode in traced_modes:
        h = g.call_function(torch.relu, (h,))
        if mode is not None:
            h.meta[META_GRAD_ENABLED] = mode
    g.output(h)
    return types.SimpleNamespace(module=fx.GraphModule(nn.Module(), g))


def test_a_switch_where_the_mode_changes_and_grad_mode_at_the_output():
    prog = program_of([True, False, False, True, False])
    insert_grad_modes([prog], training=True)
    assert switches(prog.module) == [False, True, False, True]
    ran, last = modes(prog.module)
    assert [mode for _, mode in ran] == [True, False, False, True, False] and last is True
    assert "torch._C._set_grad_enabled(False)" in prog.module.code


def test_inserted_nodes_run_in_the_mode_of_the_node_before_them():
    prog = program_of([False, None, True, None])
    insert_grad_modes([prog], training=True)
    assert switches(prog.module) == [False, True]
    assert [mode for _, mode in modes(prog.module)[0]] == [False, False, True, True]


def test_a_program_all_in_grad_mode_and_inference_programs_are_unchanged():
    plain = program_of([True, True])
    inference = program_of([False, True, False])
    code = inference.module.code
    insert_grad_modes([plain], training=True)
    insert_grad_modes([inference], training=False)
    assert switches(plain.module) == [] and switches(inference.module) == []
    assert inference.module.code == code


class Teacher(graphc.Graph):
    """A frozen teacher (no_grad) and a student; on two stages the second holds the head and
    a no_grad statistic of its output, so a region shows up on both stages."""

    def __init__(self, stages: bool, model=None):
        super().__init__()
        self.model = model or teacher_and_student()
        if stages:
            for name, sid in (("teacher", 0), ("student", 0), ("head", 1)):
                self.model[name].config.set_stage(sid, graphc.placement("cpu", [sid]))
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = teacher_loss(self.model, x, y)
        loss.backward()
        return loss


def teacher_and_student():
    return nn.ModuleDict({"teacher": nn.Linear(4, 4), "student": nn.Linear(4, 4), "head": nn.Linear(4, 3)})


class Eager(nn.Module):
    """The same step in eager PyTorch: forward((x, y)) is the loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        return teacher_loss(self.model, *batch)


def teacher_loss(model, x, y):
    with torch.no_grad():
        t = torch.tanh(model["teacher"](x))
    out = model["head"](model["student"](x) + t)
    with torch.no_grad():
        scale = 1 + out.abs().mean()
    return F.cross_entropy(out, y) * scale


def test_regions_on_each_stage_of_a_pipeline():
    cg = compile_graph(Teacher(stages=True), [torch.randn(6, 4), torch.randint(0, 3, (6,))], 2)
    for prog in cg.programs:
        ran, last = modes(prog.module)
        assert last is True, prog.code
        for node, mode in ran:
            assert mode == node.meta.get(META_GRAD_ENABLED, mode), (node.name, prog.code)
    stage0, stage1 = (dict((n.name, m) for n, m in modes(p.module)[0]) for p in cg.programs)
    assert stage0["model_teacher"] is False and stage0["tanh"] is False
    assert stage0["model_student"] is True
    assert stage1["model_head"] is True and stage1["cross_entropy"] is True
    assert stage1["abs_1"] is False and stage1["mean"] is False
    assert switches(cg.programs[0].module) == [False, True]
    assert switches(cg.programs[1].module) == [False, True]


def test_the_frozen_teacher_stays_as_in_eager():
    """One process, three SGD steps: the student and head train as in eager, the teacher
    (no_grad) keeps its initial weights (float64, the oracle's 1e-10)."""
    torch.manual_seed(0)
    model = teacher_and_student()
    ref = copy.deepcopy(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]
    losses, state = graphc_train(Teacher(stages=False, model=model), batches)
    ref_losses, ref_state = eager_train(Eager(ref), lambda p: torch.optim.SGD(p, lr=0.1), None,
                                        lambda loss, _: loss, [(b, None) for b in batches], 3)
    ref_state = {k.removeprefix("model."): v for k, v in ref_state.items()}   # full_state_dict's names
    assert_same_as_eager(losses, state, ref_losses, ref_state, "teacher and student")
    assert torch.equal(state["teacher.weight"], before["teacher.weight"])
    assert not torch.equal(state["student.weight"], before["student.weight"])
