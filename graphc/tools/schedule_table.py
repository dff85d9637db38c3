"""docs/schedules.md's table of schedules, made from the registry (See NOTE: Schedule registry).

    python -m graphc.tools.schedule_table

One row per registered schedule: what its record states (torch class, preconditions,
peak-live formula), what its layout family says rank r holds, and what its orders show:
the backward kinds it runs and `peak_live` on each rank at p = 4, m = 16 (v = 2 where the
layout takes chunks). tests/tools/test_schedule_table.py checks the docs' copy is this.
"""
from __future__ import annotations

import argparse
from typing import List

from ..plan.instructions import Backward, BackwardInput, BackwardWeight, OverlapFB
from ..plan.schedules import SCHEDULES, accepts, compute_order, peak_live, stage_count

DEFAULT_SCHEDULE = "1f1b"   # Config.pipeline_schedule's default (the plan IR does not read the API)
EXAMPLE = (4, 2, 16)        # p, v, m of the peak-live column
HEADER = ("| schedule | torch class | rank r holds | backward | needs (`check_schedule`) | "
          "peak live on rank r | p=4, v=2 (1 where the layout fixes it), m=16 |")
BACKWARD_KINDS = ((Backward, "B"), (OverlapFB, "OVERLAP_F_B"), (BackwardInput, "I"),
                  (BackwardWeight, "W"))


def backward_kinds(schedule: str, p: int = 2, m: int = 8) -> str:
    """The backward instructions `schedule` runs (B; I, W; ...), read from its orders."""
    n = stage_count(schedule, p)
    kinds = {type(ins) for r in range(p) for ins in compute_order(schedule, r, p, n, m)}
    return ", ".join(letter for kind, letter in BACKWARD_KINDS if kind in kinds)


def example_peaks(schedule: str) -> str:
    """peak_live on each rank at EXAMPLE, or what the schedule refuses there."""
    p, v, m = EXAMPLE
    n = stage_count(schedule, p, v)
    if not accepts(schedule, p, n, m):
        return "(refuses this size)"
    return ", ".join(str(peak_live(compute_order(schedule, r, p, n, m))) for r in range(p))


def row(schedule: str) -> str:
    s = SCHEDULES[schedule]
    name = f"`{s.name}`" + (" (default)" if s.name == DEFAULT_SCHEDULE else "")
    torch_class = f"Schedule{s.torch_class}" if s.torch_class else "(none)"
    cells = (name, torch_class, s.family.holds, backward_kinds(schedule), s.needs, s.peak,
             example_peaks(schedule))
    return "| " + " | ".join(cells) + " |"


def table() -> str:
    """The markdown table, every registered schedule in name order."""
    lines: List[str] = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    return "\n".join(lines + [row(name) for name in sorted(SCHEDULES)])


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m graphc.tools.schedule_table",
                            description=__doc__.split("\n\n")[0]).parse_args(argv)
    print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
