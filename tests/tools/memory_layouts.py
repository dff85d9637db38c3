"""Layouts of a small GPT (tests/gpt_block_models.py) run in the local world with a memory
probe on every rank (NOTE: Measured peak memory): each rank's predicted peak and its
measured one, for tests/tools/test_memory_measured.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

import graphc
from graphc import sbp
from graphc.runtime.local_world import LocalWorld
from graphc.tools.costs import device_costs
from graphc.tools.simulate import MemoryPeak, memory_peak, model_inputs
from graphc.tools.simulate.memory_measured import MemoryProbe
from gpt_block_models import BlockStack, TokenLossGraph, megatron
from helpers import compile_graph, global_input

# layout -> ranks; pp: stage 0 = the input layer and the first half of the blocks
LAYOUTS = {"dp2": 2, "zero1": 2, "zero2": 2, "zero3": 2, "zero3units": 2, "pp2": 2,
           "pp2ckpt": 2, "pp2xdp2": 4, "tp2": 2, "pp2xdp2zero3": 4, "pp2xdp2zero1": 4}
BATCH, T, C, LAYERS, D_IN, CLASSES = 8, 16, 32, 2, 16, 8
MICROBATCHES = 4


@dataclass(frozen=True)
class RankPeak:
    """A rank's predicted and measured peak bytes and the instructions holding them."""

    rank: int
    predicted: int
    measured: int
    predicted_at: str
    measured_at: str
    series: tuple = ()     # (instruction index, predicted bytes, measured bytes) after each

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured

    def __str__(self) -> str:
        return (f"rank {self.rank}: predicted {self.predicted / 2**20:.3f} MiB at {self.predicted_at}; "
                f"measured {self.measured / 2**20:.3f} MiB at {self.measured_at} "
                f"(ratio {self.ratio:.4f}, {self.predicted - self.measured:+d} B)")


class Gpt(TokenLossGraph):
    def __init__(self, layout: str):
        torch.manual_seed(0)
        model = BlockStack(LAYERS, C, heads=4, block=T, d_in=D_IN, classes=CLASSES, fused=False).double()
        super().__init__(model, torch.optim.Adam(model.parameters(), lr=1e-3))
        _declare(self, layout)


def _declare(graph: Gpt, layout: str) -> None:
    cpu = graphc.placement
    if layout.startswith("pp2"):
        first, last = ([0, 1], [2, 3]) if layout.startswith("pp2xdp2") else ([0], [1])
        graph.model.inp.config.set_stage(0, cpu("cpu", first))
        for i, block in enumerate(graph.model.blocks):
            s = int(i >= LAYERS // 2)
            block.config.set_stage(s, cpu("cpu", last if s else first))
        graph.model.ln_f.config.set_stage(1, cpu("cpu", last))
        graph.model.head.config.set_stage(1, cpu("cpu", last))
        graph.config.set_gradient_accumulation_steps(MICROBATCHES)
        if layout == "pp2ckpt":
            graph.config.set_activation_checkpointing("always")
    elif layout == "tp2":
        megatron(graph.model, cpu("cpu", [0, 1]))
    else:
        graph.model.config.set_stage(0, cpu("cpu", [0, 1]))
    if "zero" in layout:
        stage = int(layout[layout.index("zero") + 4])
        graph.config.enable_zero(True, stage=stage, shard_min_size=256,
                                 unit_bytes=2 ** 14 if layout == "zero3units" else 0)


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, T, D_IN, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (BATCH, T), generator=g))


def _inputs(layout: str, rank=None):
    """The call's arguments on `rank` (None: as a one-process compile reads them)."""
    x, y = _batch()
    readers = {"dp2": ([0, 1], [0, 1]), "pp2xdp2": ([0, 1], [2, 3])}
    readers = readers.get("dp2" if layout.startswith("zero") else layout.split("zero")[0])
    if readers is None:
        return x, y
    if rank is None:
        return tuple(global_input(t, graphc.placement("cpu", ranks), sbp.split(0))
                     for t, ranks in zip((x, y), readers))
    # a rank's own rows, a tensor of their own (as a data loader gives them), not a view of
    # the whole batch, which the probe would count whole
    return tuple(graphc.to_global(t.chunk(len(ranks))[ranks.index(rank) if rank in ranks else 0].clone(),
                                  placement=graphc.placement("cpu", ranks), sbp=sbp.split(0))
                 for t, ranks in zip((x, y), readers))


def predicted_peaks(layout: str, transport: str = "local") -> Dict[int, MemoryPeak]:
    """Each rank's predicted peak, from a one-process compile (what `graphc plan --simulate`
    reads: the whole parameters, no process group)."""
    graph = Gpt(layout)
    compiled = compile_graph(graph, _inputs(layout), LAYOUTS[layout])
    model, costs = model_inputs(compiled, graph._optimizer), device_costs(compiled, "h100")
    return {p.rank: memory_peak(p, model.params[p.rank], costs, transport=transport,
                                batch=model.batch[p.rank]) for p in compiled.plans}


def measured_peak(layout: str, rank: int, steps: int) -> Tuple[int, str, tuple]:
    """(peak, instruction, (index, bytes) after each instruction) over the last of `steps`
    steps, measured on this running rank by a MemoryProbe attached after the first."""
    graph = Gpt(layout)
    graph(*_inputs(layout, rank))
    probe = MemoryProbe.attach(graph)
    for _ in range(steps - 1):
        graph(*_inputs(layout, rank))
    return probe.peak, probe.at, tuple(probe.series)


def rank_peaks(layout: str, steps: int = 3) -> List[RankPeak]:
    """Every rank's predicted peak and the one measured, in the local world."""
    measured = LocalWorld(LAYOUTS[layout]).run(lambda rank: measured_peak(layout, rank, steps))
    return _compared(predicted_peaks(layout, "local"), measured)


def gloo_rank_peaks(layout: str, steps: int = 2) -> List[RankPeak]:
    """The same on gloo processes (tests/helpers.py run_world)."""
    from helpers import run_world
    measured = run_world(_gloo_rank, LAYOUTS[layout], layout, steps)
    return _compared(predicted_peaks(layout, "gloo"), measured)


def _gloo_rank(rank: int, world: int, layout: str, steps: int):
    return measured_peak(layout, rank, steps)


def _compared(predicted: Dict[int, MemoryPeak], measured) -> List[RankPeak]:
    out = []
    for rank, (peak, at, series) in enumerate(measured):
        mine = predicted[rank]
        rows = tuple((i, mine.series[i], b) for i, b in series)
        out.append(RankPeak(rank, mine.between, peak, mine.between_at, at, rows))
    return out


if __name__ == "__main__":
    import sys
    for name in [a for a in sys.argv[1:] if a != "-v"] or LAYOUTS:
        for peak in rank_peaks(name):
            print(name, peak, flush=True)
            if "-v" in sys.argv[1:]:
                for i, p, m in peak.series:
                    print(f"   {p / 2**20:8.3f} {m / 2**20:8.3f} {p - m:+9d}  instruction {i}")
