"""list_collectives: after each forward (backward) of a stage the plan lists one Collective
per communicating SBP conversion that compute runs, in the order it runs them (reversed in
the backward), with its kind, node, SBP before and after, group, dtype and bytes; local
conversions are not listed; members of a group share the Collective objects."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.meta import META_BOXING
from graphc.passes.list_collectives import list_collectives
from graphc.plan.instructions import Backward, Collective, Forward
from helpers import compile_graph
from models import PipelineGraph, SkipNet

P01 = graphc.placement("cpu", [0, 1])
ROWS, M = 6, 2   # 3 rows per micro-batch


class Megatron(graphc.Graph):
    """A broadcast linear, then `pairs` Megatron MLPs (column- then row-parallel) on 2 ranks:
    each pair all-reduces its output forward (g) and its input's gradient backward (f)."""

    def __init__(self, pairs=1):
        super().__init__()
        layers = [nn.Linear(8, 8)]
        for _ in range(pairs):
            layers += [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)]
        model = graphc.to_global(nn.Sequential(*layers), placement=P01, sbp=sbp.broadcast)
        for k in range(pairs):
            graphc.to_global(model[1 + 3 * k], placement=P01, sbp=sbp.split(0))
            graphc.to_global(model[3 + 3 * k].weight, placement=P01, sbp=sbp.split(1))
        self.model = model
        self.config.set_gradient_accumulation_steps(M)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def compiled(pairs=1):
    return compile_graph(Megatron(pairs), [torch.randn(ROWS, 8), torch.randint(0, 8, (ROWS,))], 2)


def boxes(cg):
    """(node name, boxing kind) of every conversion, in program order."""
    return [(n.name, n.meta[META_BOXING].kind) for n in cg.gm.graph.nodes if META_BOXING in n.meta]


def test_each_collective_follows_the_compute_that_issues_it():
    cg = compiled()
    assert boxes(cg) == [("box", "grad_all_reduce"), ("box_1", "to_partial"), ("box_2", "all_reduce")]
    for plan in cg.plans:
        shown = [(type(i).__name__, i.microbatch, getattr(i, "node", None), getattr(i, "direction", None))
                 for i in plan.instructions[:-1]]
        assert shown == [("Forward", 0, None, None), ("Collective", 0, "box_2", "F"),
                         ("Backward", 0, None, None), ("Collective", 0, "box", "B"),
                         ("Forward", 1, None, None), ("Collective", 1, "box_2", "F"),
                         ("Backward", 1, None, None), ("Collective", 1, "box", "B")]


def test_a_collective_says_what_it_converts_and_what_it_sends():
    plan = compiled().plans[0]
    fwd, bwd = [i for i in plan.instructions if isinstance(i, Collective)][:2]
    # forward: the row-parallel output (3 x 8 float64) partial -> broadcast: a ring all-reduce
    # over 2 ranks sends 2 (n-1) / n of it: all of its 192 bytes
    assert (fwd.kind, fwd.node, fwd.sbp_in, fwd.sbp_out, fwd.ranks, fwd.dtype, fwd.nbytes) == \
        ("all_reduce", "box_2", "partial_sum", "broadcast", (0, 1), "float64", 3 * 8 * 8)
    # backward: grad_all_reduce's dual, on the gradient of the column-parallel input
    assert (bwd.kind, bwd.node, bwd.sbp_in, bwd.sbp_out, bwd.ranks, bwd.dtype, bwd.nbytes) == \
        ("all_reduce", "box", "grad:partial_sum", "grad:broadcast", (0, 1), "float64", 3 * 8 * 8)
    assert str(fwd) == "0F0.ALL_REDUCE box_2:f64 partial_sum->broadcast ranks=[0, 1] bytes=192"


def test_local_conversions_are_not_listed():
    """to_partial (the row-parallel bias added once) moves nothing."""
    cg = compiled()
    listed = {i.node for p in cg.plans for i in p.instructions if isinstance(i, Collective)}
    assert listed == {"box", "box_2"}


def test_backward_lists_the_conversions_in_reverse():
    cg = compiled(pairs=2)
    g = [name for name, kind in boxes(cg) if kind == "all_reduce"]
    f = [name for name, kind in boxes(cg) if kind == "grad_all_reduce"]
    assert len(g) == len(f) == 2
    plan = cg.plans[0]
    after = {}
    for i, ins in enumerate(plan.instructions):
        if isinstance(ins, (Forward, Backward)):
            run = []
            for nxt in plan.instructions[i + 1:]:
                if not isinstance(nxt, Collective):
                    break
                run.append(nxt.node)
            after[(type(ins).__name__, ins.microbatch)] = run
    for mb in range(M):
        assert after[("Forward", mb)] == g
        assert after[("Backward", mb)] == f[::-1]


def test_members_of_a_group_share_the_collective_objects():
    cg = compiled()
    mine, theirs = ([i for i in p.instructions if isinstance(i, Collective)] for p in cg.plans)
    assert len(mine) == 4 and all(a is b for a, b in zip(mine, theirs))


def test_plans_without_conversions_are_left_as_they_are():
    cg = compile_graph(PipelineGraph(SkipNet(2), None, accumulation=2), [torch.randn(8, 16),
                                                                          torch.randint(0, 5, (8,))], 2)
    before = [list(p.instructions) for p in cg.plans]
    assert not any(isinstance(i, Collective) for plan in before for i in plan)
    assert [p.instructions for p in list_collectives(cg.plans, cg.programs)] == before
