"""Simulated bubbles of every schedule on a chain of equal stages (docs/schedules.md table).

    python -m graphc.tools.bubbles [--ranks 4] [--chunks 2] [--microbatches 8 16]

Each rank's work per micro-batch is one forward F and one backward B of equal cost (F = B,
and a split backward's halves I = W = B / 2); with v chunks a rank holds v stages, each of
cost F / v. Communication is free, so what is left of the step beyond the compute is the
schedule's bubble. The table gives each schedule's step time over the ideal (m (F + B), no
bubble) and its mean bubble fraction, next to the textbook values: 1F1B and GPipe
(p - 1) / m of ideal; interleaved (p - 1) / (v m); zero bubble a third of 1F1B's at equal
F, B, W (Qi et al. 2023, ZB-H1) and ZBV about none.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List, Sequence

from ..passes.lower_plan import lower_plan
from ..plan.instructions import TensorSpec
from ..plan.plan import StageInfo
from ..plan.program import StageProgram
from ..plan.schedules import SCHEDULES, layout, stage_count
from .cost_model import CostModel
from .simulate import simulate

SPEC = TensorSpec("h", (1,), "float32")


@dataclass
class Bubble:
    schedule: str
    ranks: int
    chunks: int
    microbatches: int
    step: float            # simulated step time, in units of one micro-batch's F + B
    ideal: float           # m: the step without a bubble
    bubble_fraction: float  # mean over ranks of 1 - busy / step

    @property
    def over_ideal(self) -> float:
        """The bubble as a fraction of the ideal step: step / ideal - 1."""
        return self.step / self.ideal - 1


def chain_plans(schedule: str, p: int, v: int, m: int):
    """Plans of n = v p chained stages laid out as `schedule` lays them out."""
    n = stage_count(schedule, p, v)
    rank_of = {s: r for r, held in enumerate(layout(schedule, p, n)) for s in held}
    programs = [StageProgram(s, None, [], [], {}, {s - 1: [SPEC]} if s else {},
                             {s + 1: [SPEC]} if s < n - 1 else {}, {"h": True}) for s in range(n)]
    stages = [StageInfo(s, (rank_of[s],)) for s in range(n)]
    return lower_plan(programs, stages, schedule, m, True, p), n


def bubble(schedule: str, p: int, v: int, m: int, backward: float = 1.0) -> Bubble:
    """`backward`: B / F (1: F = B and I = W = F / 2; 2: F = I = W, the zero-bubble paper's)."""
    plans, n = chain_plans(schedule, p, v, m)
    chunks = n // p
    forward = 1.0 / ((1 + backward) * chunks)  # a rank's F + B per micro-batch is 1
    costs = CostModel.uniform(n, forward=forward, backward=backward * forward)
    result = simulate(plans, costs)
    return Bubble(schedule, p, chunks, m, result.step_time, float(m), result.bubble_fraction)


def table(p: int = 4, v: int = 2, microbatches: Sequence[int] = (8, 16),
          backward: float = 1.0) -> List[Bubble]:
    """Every registered schedule (See NOTE: Schedule registry) at each micro-batch count, v
    chunks where its layout takes them."""
    return [bubble(name, p, v, m, backward) for m in microbatches for name in SCHEDULES]


def render(rows: Sequence[Bubble]) -> str:
    lines = [f"{'schedule':<18} {'p':>2} {'v':>2} {'m':>3} {'step / ideal':>12} "
             f"{'bubble / ideal':>14} {'textbook':>9} {'mean bubble':>11}"]
    for b in rows:
        lines.append(f"{b.schedule:<18} {b.ranks:>2} {b.chunks:>2} {b.microbatches:>3} "
                     f"{b.step / b.ideal:>12.3f} {b.over_ideal:>14.3f} {textbook(b):>9} "
                     f"{b.bubble_fraction:>11.1%}")
    return "\n".join(lines)


SETTINGS = ((8, 1.0, "m = 8, F = B, I = W"), (8, 2.0, "m = 8, F = I = W"), (16, 2.0, "m = 16, F = I = W"))


def markdown(p: int = 4, v: int = 2) -> str:
    """docs/schedules.md's bubble table: each registered schedule's bubble over the ideal step
    at SETTINGS, and the formula its record's `textbook` gives (See NOTE: Schedule registry)."""
    lines = ["| schedule | " + " | ".join(label for _, _, label in SETTINGS) + " | paper |",
             "|---|" + "---|" * len(SETTINGS) + "---|"]
    for name in sorted(SCHEDULES):
        cells = [f"{bubble(name, p, v, m, backward).over_ideal:.3f}" for m, backward, _ in SETTINGS]
        formula = SCHEDULES[name].textbook
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {formula.__doc__ if formula else ''} |")
    return "\n".join(lines)


def textbook(b: Bubble) -> str:
    """The bubble over ideal the literature gives (any B / F), or '' where it gives none."""
    formula = SCHEDULES[b.schedule].textbook
    return "" if formula is None else f"{formula(b.ranks, b.chunks, b.microbatches):.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m graphc.tools.bubbles", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--backward", type=float, default=1.0,
                    help="B / F: 1 (F = B, I = W = F/2, default) or 2 (F = I = W)")
    ap.add_argument("--markdown", action="store_true", help="docs/schedules.md's table instead")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.ranks, args.chunks))
        return 0
    print(render(table(args.ranks, args.chunks, args.microbatches, args.backward)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
