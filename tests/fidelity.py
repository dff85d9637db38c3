"""The fidelity probe's harness (NOTE: Fidelity probe): a user's program, written once, run by
graphc on a layout of the matrix (tests/layouts.py) and by plain eager PyTorch on the whole
batch, with the program's Python state changed between calls as its user changes it.

NOTE: Fidelity probe
graphc's promise is that a program means the same thing on every layout or is refused with a
GraphcError naming the user's line and the fix. A `Program` is what a user writes: how the
loss is computed from the host (the Graph, or a plain namespace in eager) and a batch, what
it sets up on the host, what it changes between calls (a Graph attribute, an optimizer's lr,
a Python int in the batch), the optimizer and the graph's options. `outcome(program, layout)`
runs it both ways and says `equal` (every returned value and the full state at 1e-10, float64),
`refused` (a GraphcError; its message is kept), `wrong` (the largest difference and where) or
`crash` (any other exception). tests/test_fidelity.py holds every program to its expected
outcome; `python tests/fidelity.py` prints the whole table.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

import graphc
from graphc.runtime.local_world import LocalWorld
from layouts import LAYOUTS, NPROC, Pair, declare, feed

ATOL = RTOL = 1e-10


def _nothing(host, model, opt, step):
    return None


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def regression(n: int = 3, rows: int = 8, d_in: int = 6, d_out: int = 4) -> List[tuple]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)) for _ in range(n)]


@dataclass
class Program:
    """A user's training program. `loss(host, *batch)` returns build()'s result (a loss, or a
    tuple whose first value is the loss); `host.model` is the model (graphc's wrapped module
    inside build(), the plain one in eager). `setup(host)` sets attributes on the host once;
    `between(host, model, opt, step)` runs before every call (model: the user's own module);
    `configure(graph)` sets graph options, `after_backward(model)` is what eager does for them
    (grad clipping)."""

    name: str
    loss: Callable[..., Any]
    make_model: Callable[[], nn.Module] = Pair
    batches: Callable[[], List[tuple]] = regression
    setup: Callable[[Any], None] = lambda host: None
    between: Callable[..., None] = _nothing
    make_opt: Callable = _sgd
    accumulation: int = 2
    configure: Callable[[graphc.Graph], None] = lambda graph: None
    after_backward: Callable[[nn.Module], None] = lambda model: None
    backward_inside: bool = False  # loss() calls backward itself (then reads or edits gradients)
    expect: str = "equal"          # what graphc must do on every layout: "equal" or "refused"
    refused_on: Tuple[str, ...] = ()   # layouts where it must refuse though others equal eager
    says: str = ""                 # a part of the refusal's message
    after: Optional[Callable[[Any, nn.Module, int], Any]] = None   # user code after each call (a
    # validation pass, an EMA teacher's update): its result is compared on every rank

    def expected(self, layout: str) -> str:
        return "refused" if layout in self.refused_on else self.expect


def _model(program: Program) -> nn.Module:
    torch.manual_seed(0)
    return program.make_model()


def eager(program: Program) -> Tuple[List[Any], Dict[str, torch.Tensor]]:
    """The program in plain PyTorch on whole batches: (each step's returned values, state)."""
    model = _model(program)
    host = SimpleNamespace(model=model)
    program.setup(host)
    opt = host.opt = program.make_opt(model.parameters())
    outs = []
    for step, batch in enumerate(program.batches()):
        program.between(host, model, opt, step)
        opt.zero_grad()
        out = program.loss(host, *batch)
        if not program.backward_inside:
            (out[0] if isinstance(out, tuple) else out).backward()
        program.after_backward(model)
        opt.step()
        outs.append(pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, out))
        if program.after is not None:
            outs.append(_detached(program.after(host, model, step)))
    return outs, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _detached(value):
    return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, value)


def _graph_class(program: Program):
    class Probe(graphc.Graph):
        def __init__(self, model, layout):
            super().__init__()
            self.model = model
            program.setup(self)
            declare(self, layout)
            self.config.set_gradient_accumulation_steps(program.accumulation)
            program.configure(self)
            self.opt = program.make_opt(model.parameters())
            self.add_optimizer(self.opt)

        def build(self, *batch):
            out = program.loss(self, *batch)
            if not program.backward_inside:
                (out[0] if isinstance(out, tuple) else out).backward()
            return out
    Probe.__name__ = Probe.__qualname__ = "Probe_" + program.name
    return Probe


def run_graphc(program: Program, layout: str) -> Tuple[List[Any], Dict[str, torch.Tensor]]:
    """The program as a Graph on `layout` in the local world: (rank 0's view of each step's
    returned values, the full state)."""
    data = program.batches()
    args = feed(layout, data)
    make = _graph_class(program)

    def rank_main(rank: int):
        model = _model(program)
        graph = make(model, layout)
        outs, seen = [], []
        for step in range(len(data)):
            program.between(graph, model, graph.opt, step)
            outs.append(_local(graph(*(args(rank, step) if callable(args) else args[step]))))
            if program.after is not None:
                seen.append(_detached(program.after(graph, model, step)))
        return outs, graph.full_state_dict(rank0_only=True), seen

    results = LocalWorld(NPROC[layout]).run(rank_main)
    outs = []
    for step in range(len(data)):
        # a returned value lives on its stage's ranks: take it from the first rank that holds it
        outs.append(_first_held([r[0][step] for r in results]))
        if program.after is not None:   # what the user's code after the call saw, on every rank
            outs.append(tuple(r[2][step] for r in results))
    return outs, results[0][1]


def _local(out):
    return pytree.tree_map(lambda v: v.to_local().detach().clone() if isinstance(v, graphc.GlobalTensor)
                           else (v.detach().clone() if isinstance(v, torch.Tensor) else v), out)


def _first_held(candidates):
    def held(out):
        return all(not (isinstance(v, torch.Tensor) and v.numel() == 0 and v.dim() == 1)
                   for v in pytree.tree_leaves(out))
    return next((c for c in candidates if held(c)), candidates[0])


def _differences(got, want, ranks: int, observed: bool) -> List[str]:
    outs, state = got
    want_outs, want_state = want
    if observed:   # each rank's view of the user's code after the call, against eager's one
        want_outs = [w if i % 2 == 0 else (w,) * ranks for i, w in enumerate(want_outs)]
    found = []
    for step, (a, b) in enumerate(zip(outs, want_outs)):
        for i, (x, y) in enumerate(zip(pytree.tree_leaves(a), pytree.tree_leaves(b))):
            found += _compare(x, y, f"step {step} output {i}")
    for k in want_state:
        if k not in state:
            found.append(f"{k} missing")
        else:
            found += _compare(state[k], want_state[k], k)
    return found


def _compare(x, y, where: str) -> List[str]:
    if not isinstance(y, torch.Tensor):
        return [] if x == y else [f"{where}: {x!r} vs {y!r}"]
    x = torch.as_tensor(x)
    if x.shape != y.shape:
        return [f"{where}: shape {tuple(x.shape)} vs {tuple(y.shape)}"]
    if torch.allclose(x.double(), y.double(), atol=ATOL, rtol=RTOL):
        return []
    return [f"{where}: differs by {(x.double() - y.double()).abs().max().item():.3g}"]


@dataclass
class Outcome:
    kind: str  # equal | refused | wrong | crash
    detail: str = ""

    def __str__(self):
        return self.kind


def outcome(program: Program, layout: str) -> Outcome:
    """Runs `program` on `layout` and against eager (see NOTE: Fidelity probe)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        want = eager(program)
        try:
            got = run_graphc(program, layout)
        except graphc.GraphcError as e:
            return Outcome("refused", str(e))
        except Exception as e:  # noqa: BLE001 - the probe reports any other failure as a crash
            return Outcome("crash", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}")
        found = _differences(got, want, NPROC[layout], program.after is not None)
        return Outcome("wrong", "; ".join(found[:4])) if found else Outcome("equal")
    finally:
        torch.set_default_dtype(before)


def table(programs: Sequence[Program], layouts: Sequence[str] = LAYOUTS, verbose: bool = False) -> str:
    """The markdown table program x layout -> outcome (verbose: each non-equal's detail below)."""
    rows = ["| program | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts)]
    notes = []
    for program in programs:
        cells = []
        for layout in layouts:
            got = outcome(program, layout)
            cells.append(got.kind)
            if verbose and got.kind != "equal":
                notes.append(f"{program.name} [{layout}] {got.kind}: {got.detail[:1500]}")
        rows.append(f"| {program.name} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    return "\n".join(rows + [""] + notes)


if __name__ == "__main__":
    import sys
    from fidelity_probes import PROGRAMS
    chosen = [p for p in PROGRAMS if len(sys.argv) < 2 or p.name in sys.argv[1:]]
    print(table(chosen, verbose=True))
