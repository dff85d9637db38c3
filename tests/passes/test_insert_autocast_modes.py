"""insert_autocast_modes: in every stage program each node runs in the autocast state build()
traced it in (NOTE: Autocast regions), a `set_autocast(state)` call sits wherever the state
changes, and the program leaves every region before its output."""
import types

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import graphc
from graphc.meta import META_AUTOCAST
from graphc.passes.insert_autocast_modes import insert_autocast_modes
from graphc.ops.autocast import set_autocast
from helpers import compile_graph

BF16 = (("cpu", "bfloat16"),)
BOTH = (("cpu", "bfloat16"), ("cuda", "float16"))


def states(gm: fx.GraphModule):
    """[(node, the autocast state it runs in)] as Python runs the program (entered outside
    every region), and the state at its output."""
    state, out = (), []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is set_autocast:
            state = node.args[0]
        elif node.op == "output":
            return out, state
        elif node.op not in ("placeholder", "get_attr"):
            out.append((node, state))
    return out, state


def switches(gm: fx.GraphModule):
    return [n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target is set_autocast]


def program_of(traced):
    """A one-input program whose k-th relu was traced in autocast state traced[k] (None: a
    node graphc inserted, without a recorded state)."""
    g = fx.Graph()
    h = g.placeholder("x")
    for state in traced:
        h = g.call_function(torch.relu, (h,))
        if state is not None:
            h.meta[META_AUTOCAST] = state
    g.output(h)
    return types.SimpleNamespace(module=fx.GraphModule(nn.Module(), g))


def test_a_switch_where_the_state_changes_and_none_at_the_output():
    prog = program_of([(), BF16, BF16, BOTH, ()])
    insert_autocast_modes([prog])
    assert switches(prog.module) == [BF16, BOTH, ()]
    ran, last = states(prog.module)
    assert [s for _, s in ran] == [(), BF16, BF16, BOTH, ()] and last == ()


def test_a_program_ending_in_a_region_leaves_it_before_its_output():
    prog = program_of([BF16, None])
    insert_autocast_modes([prog])
    assert switches(prog.module) == [BF16, ()]
    assert [s for _, s in states(prog.module)[0]] == [BF16, BF16]   # inserted: the state before
    assert list(prog.module.graph.nodes)[-2].target is set_autocast


def test_a_program_outside_autocast_is_unchanged():
    prog = program_of([(), None, ()])
    code = prog.module.code
    insert_autocast_modes([prog])
    assert switches(prog.module) == [] and prog.module.code == code


class Region(graphc.Graph):
    """The first linear in a bfloat16 region, the second outside it; inference."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return forward(self.model, x)


def forward(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.relu(model[0](x))
    return model[1](h.float())


@pytest.mark.fp32
def test_a_compiled_program_runs_the_region_as_eager_does():
    """CPU autocast to bfloat16 is deterministic: the stage program equals eager bit for bit,
    and leaves autocast off behind it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    cg = compile_graph(Region(model), [x], 1)
    prog = cg.programs[0]
    ran, last = states(prog.module)
    by_name = {n.name: s for n, s in ran}
    assert by_name["model_0"] == BF16 and by_name["relu"] == BF16 and by_name["model_1"] == ()
    assert last == () and switches(prog.module) == [BF16, ()]
    got = prog.module(x)
    assert not torch.is_autocast_enabled("cpu")
    got = got[0] if isinstance(got, (tuple, list)) else got
    want = forward(model, x)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
