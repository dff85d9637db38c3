"""The layout matrix of the semantics tests (NOTE: Layout matrix).

NOTE: Layout matrix
A Python effect of a user's program (a hook, a frozen layer, a counter, a count passed in)
that holds in one process but not on a data-, tensor- or pipeline-parallel stage is the
bug class users hit: the same program must mean the same thing on every layout. So a
semantics test is written once against this module and runs over LAYOUTS in the local
world (every rank a thread, graphc/runtime/local_world.py), compared with plain eager
PyTorch on the whole batch (float64, 1e-10):

- the model is a `Pair` (or any module with submodules `a` and `b`, `a` a Linear, `b` a
  Linear or a module whose first Linear is `b.fc`): `declare(graph, layout)` puts
  graph.model on the layout: pp2 puts `a` on rank 0 and `b` on rank 1; dp2 the whole model on ranks
  0-1 with the batch split; tp2 splits `a` by output rows and `b` by input columns
  (Megatron's pair); pp2xdp2 is pp2 with two data ranks a stage; zero3 is dp2 with ZeRO
  stage 3;
- `feed(layout, batches)` gives each rank its call arguments (the batch split over the
  data ranks of the stage that reads it; a dict's or list's tensors as a tensor in its place);
- `train(layout, make_graph, batches)` runs the steps and returns (losses, state).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

import graphc
from graphc.checking.first_step import _first_scalar
from graphc.passes.infer_sbp import gathering_fallbacks
from graphc.runtime.local_world import LocalWorld
from graphc.tools.replicated import replicated_compute
from helpers import assert_close

LAYOUTS = ("one", "pp2", "dp2", "tp2", "pp2xdp2", "zero3")
NPROC = {"one": 1, "pp2": 2, "dp2": 2, "tp2": 2, "pp2xdp2": 4, "zero3": 2}
# the data ranks of the stage that reads the inputs, per input position (first stage, last stage)
_READERS = {"dp2": ([0, 1], [0, 1]), "zero3": ([0, 1], [0, 1]), "pp2xdp2": ([0, 1], [2, 3])}

every_layout = pytest.mark.parametrize("layout", LAYOUTS)


def every_layout_slow_on(*slow: str):
    """every_layout, with the layouts `slow` run under -m slow (CI time): the test says, beside
    it, which default test still covers them."""
    return pytest.mark.parametrize("layout", [pytest.param(lay, marks=pytest.mark.slow) if lay in slow else lay
                                              for lay in LAYOUTS])


class Pair(nn.Module):
    """Two Linears with a tanh between: x (B, d_in) -> (B, d_out)."""

    def __init__(self, d_in: int = 6, hidden: int = 8, d_out: int = 4):
        super().__init__()
        self.a = nn.Linear(d_in, hidden)
        self.b = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _b_linear(model):
    return model.b if isinstance(model.b.origin, nn.Linear) else model.b.fc


def declare(graph: graphc.Graph, layout: str, name: str = "model") -> None:
    """Puts the graph's module `name` (submodules a and b, already assigned to the graph) on
    `layout` (see NOTE: Layout matrix)."""
    cpu = graphc.placement
    model = getattr(graph, name)
    if layout in ("pp2", "pp2xdp2"):
        dp = 2 if layout == "pp2xdp2" else 1
        model.a.config.set_stage(0, cpu("cpu", list(range(dp))))
        model.b.config.set_stage(1, cpu("cpu", list(range(dp, 2 * dp))))
    elif layout in ("dp2", "zero3"):
        model.config.set_stage(0, cpu("cpu", [0, 1]))
        if layout == "zero3":
            graph.config.enable_zero(True, stage=3, shard_min_size=1)
    elif layout == "tp2":
        p = cpu("cpu", [0, 1])
        model.config.set_stage(0, p)
        graphc.to_global(model.a.weight, placement=p, sbp=graphc.sbp.split(0))
        graphc.to_global(model.a.bias, placement=p, sbp=graphc.sbp.split(0))
        graphc.to_global(_b_linear(model).weight, placement=p, sbp=graphc.sbp.split(1))
    elif layout != "one":
        raise ValueError(layout)


def feed(layout: str, batches: Sequence[tuple]):
    """Each rank's call arguments per step: tensors with a batch dim split over the data
    ranks of the stage reading them (the first input on the first stage, the others on the
    last), everything else as it is."""
    if layout not in _READERS:
        return list(batches)
    first, last = _READERS[layout]

    def split(t, ranks: List[int], rank: int):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        k = ranks.index(rank) if rank in ranks else 0
        return graphc.to_global(t.chunk(2)[k], placement=graphc.placement("cpu", ranks), sbp=graphc.sbp.split(0))

    def inputs(rank: int, step: int):
        # a dict's tensors go where a tensor in its position would (a batch dict: the first stage's)
        return tuple(pytree.tree_map(lambda t: split(t, first if i == 0 else last, rank), arg)
                     for i, arg in enumerate(batches[step]))
    return inputs


def train(layout: str, make_graph: Callable[[str], graphc.Graph], batches: Sequence[tuple],
          between: Optional[Callable[[graphc.Graph, int], None]] = None, graphs: Optional[list] = None
          ) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """`make_graph(layout)` trained on `batches` in a local world of the layout's ranks; returns
    the losses and the full state. `between(graph, step)` runs on every rank before each call
    (what a user does between steps: freeze a layer, switch an adapter); `graphs`, when given,
    receives each rank's Graph (their recompiles)."""
    args = feed(layout, batches)

    def rank_main(rank: int):
        graph = make_graph(layout)
        outs = []
        for step in range(len(batches)):
            if between is not None:
                between(graph, step)
            outs.append(graph(*(args(rank, step) if callable(args) else args[step])))
        return outs, graph.full_state_dict(rank0_only=True), graph

    results = LocalWorld(NPROC[layout]).run(rank_main)
    if graphs is not None:
        graphs.extend(graph for _, _, graph in results)
    losses = [next(v for v in (_scalar(outs[step]) for outs, _, _ in results) if v is not None)
              for step in range(len(batches))]
    return losses, results[0][1]


def _scalar(out):
    loss = _first_scalar(out)
    return None if loss is None else float(loss)


def assert_same(got: Tuple[List[float], Dict[str, torch.Tensor]],
                want: Tuple[List[float], Dict[str, torch.Tensor]], layout: str) -> None:
    """graphc's (losses, state) equal eager's at 1e-10 (helpers.assert_close)."""
    losses, state = got
    want_losses, want_state = want
    assert len(losses) == len(want_losses), f"{layout}: {losses} vs {want_losses}"
    for i, (a, b) in enumerate(zip(losses, want_losses)):
        assert_close(torch.tensor(a), torch.tensor(b), f"{layout}: loss at step {i}")
    assert set(state) == set(want_state), f"{layout}: {sorted(state)} vs {sorted(want_state)}"
    for k in want_state:
        assert_close(state[k], want_state[k], f"{layout}: {k}")


# -- the matrix's usual program: a squared-error regression, trained by graphc and by eager ----

def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def batches(n: int = 3, d_in: int = 6, d_out: int = 4, rows: int = 8) -> List[tuple]:
    """n (x, y) batches for a Pair-shaped model, the same every call."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)) for _ in range(n)]


class SquaredError(graphc.Graph):
    """graph.model trained on ((model(x) - y) ** 2).mean(), put on `layout` by declare()."""

    def __init__(self, model, layout: str, make_opt=sgd, accumulation: int = 2):
        super().__init__()
        self.model = model
        declare(self, layout)
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(make_opt(model.parameters()))

    def build(self, x, y):
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        return loss


def eager(model, data: Sequence[tuple], make_opt=sgd,
          between: Optional[Callable[[nn.Module, int], None]] = None) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """The oracle for SquaredError: plain eager PyTorch on the whole batches, `between(model,
    step)` before each step as train() runs it; returns (losses, state)."""
    opt = make_opt(model.parameters())
    losses = []
    for step, (x, y) in enumerate(data):
        if between is not None:
            between(model, step)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def fallbacks(graph) -> List[str]:
    """The ops of a graph's plan (a Graph called, or a CompiledGraph) without an SBP rule that
    gather split or partial inputs to run whole on a stage of several ranks (the slow path
    infer_sbp warns of)."""
    return [n.name for n in gathering_fallbacks(_compiled(graph).gm)]


def replicated(graph) -> Dict[int, float]:
    """Per stage of several ranks of a graph's plan (a Graph called, or a CompiledGraph), the
    share of its ops that runs whole on every rank after a gathering fallback (See NOTE:
    Replicated compute)."""
    return {stage: share.fraction for stage, share in replicated_compute(_compiled(graph)).items()}


def _compiled(graph):
    return graph.compiled if isinstance(graph, graphc.Graph) else graph


class Computing(graphc.Graph):
    """A Pair on a layout whose build() returns what `compute(out, y)` returns (out the Pair's
    output), after the backward of its last value, the loss; SGD at lr 0.1."""

    def __init__(self, layout: str, compute: Callable, accumulation: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.model, self.compute = Pair(), compute
        declare(self, layout)
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        values = self.compute(self.model(x), y)
        values[-1].backward()
        return values
