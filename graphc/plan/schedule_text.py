"""A pipeline schedule given as text: each pipeline rank's compute order, one line a rank, as
torchtitan reads a schedule from a CSV, in the instructions graphc prints (`0F0`, `1B2`,
`0I3`, `0W3`, `(0F3;3B1)OVERLAP_F_B`), comma separated; empty cells (idle slots) and `#`
lines are skipped.

    text = schedule_text("1f1b", 2, 2, 4)            # a built-in's orders, to start from
    register_schedule(schedule_from_text("my_1f1b", text))
    self.config.set_pipeline_schedule("my_1f1b")     # in the Graph's __init__

A text schedule is checked as the built-in ones are (See NOTE: Schedule registry): when
read, every rank must hold the stages of one layout family and run each of its (stage,
micro-batch) pairs F, then B or I then W, once; when compiled, its plans are lowered and
verified like any schedule's (verify_plans: sends paired with receives, no deadlock); it
runs only at the ranks, stages and micro-batches it was written for.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ..errors import GraphcError
from .instructions import (COMPUTE, Backward, BackwardInput, BackwardWeight, Forward, Instruction,
                           parse_instruction)
from .schedules import (INTERLEAVED_LAYOUT, ONE_STAGE_LAYOUT, V_LAYOUT, LayoutFamily, Schedule,
                        compute_order)

FAMILIES = (ONE_STAGE_LAYOUT, INTERLEAVED_LAYOUT, V_LAYOUT)
_PASS = {Forward: "F", Backward: "B", BackwardInput: "I", BackwardWeight: "W"}


def schedule_text(schedule: str, num_ranks: int, num_stages: int, num_microbatches: int) -> str:
    """`schedule`'s orders as text, one line per pipeline rank (schedule_from_text reads it)."""
    return "\n".join(",".join(str(ins) for ins in compute_order(schedule, r, num_ranks, num_stages,
                                                                num_microbatches))
                     for r in range(num_ranks))


def schedule_from_text(name: str, text: str) -> Schedule:
    """A Schedule record from per-rank orders written as text (module docstring), checked.

    Raises GraphcError naming the rank, the action's position and what is wrong.
    """
    orders = _parse(name, text)
    p = len(orders)
    pairs = {(part.stage, part.microbatch) for order in orders for ins in order for part in ins.parts}
    n = max(s for s, _ in pairs) + 1
    m = max(i for _, i in pairs) + 1
    family = _family(name, orders, p, n)
    for rank, order in enumerate(orders):
        _check_rank(name, rank, order, family.layout(p, n)[rank], m)

    def order(rank: int, num_ranks: int, num_stages: int, num_microbatches: int) -> List[Instruction]:
        if (num_ranks, num_stages, num_microbatches) != (p, n, m):
            raise GraphcError(f"pipeline schedule {name!r} was written for {p} pipeline ranks, "
                              f"{n} stages and {m} micro-batches; found {num_ranks}, {num_stages} "
                              f"and {num_microbatches}. Fix: run it at the sizes it was written for "
                              f"(config.set_gradient_accumulation_steps({m})), or write its orders "
                              "for these sizes")
        return list(orders[rank])

    def check(where: str, num_ranks: int, num_microbatches: int) -> None:
        if (num_ranks, num_microbatches) != (p, m):
            raise GraphcError(f"{where} was written for {p} pipeline ranks and {m} micro-batches; "
                              f"found {num_microbatches} micro-batches. Fix: "
                              f"config.set_gradient_accumulation_steps({m}), or write its orders "
                              "for these sizes")

    return Schedule(name, order, family, check, needs=f"as written: p = {p}, n = {n}, m = {m}",
                    peak="(from the text)")


def _parse(name: str, text: str) -> List[List[Instruction]]:
    orders = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        order = []
        for k, cell in enumerate(c.strip() for c in line.split(",")):
            if not cell:
                continue   # an idle slot
            where = f"pipeline schedule {name!r}, rank {len(orders)}, action #{k} {cell!r}"
            try:
                ins = parse_instruction(cell)
            except GraphcError:
                raise GraphcError(f"{where}: not an instruction. Fix: write compute as graphc prints "
                                  "it: 0F3 (stage 0 forward of micro-batch 3), 0B3, 0I3, 0W3, "
                                  "(0F3;3B1)OVERLAP_F_B") from None
            if not isinstance(ins, COMPUTE):
                raise GraphcError(f"{where}: only compute goes in a schedule; the sends, receives "
                                  "and collectives are added when the plan is lowered. Fix: leave it out")
            order.append(ins)
        orders.append(order)
    if not orders or not any(orders):
        raise GraphcError(f"pipeline schedule {name!r}: the text names no compute. Fix: one line "
                          "per pipeline rank, e.g. '0F0,0F1,0B0,0B1'")
    return orders


def _family(name: str, orders, p: int, n: int) -> LayoutFamily:
    """The layout family whose layout gives each rank the stages its order runs."""
    held = [sorted({part.stage for ins in order for part in ins.parts}) for order in orders]
    for family in FAMILIES:
        if family.num_stages(p) in (None, n) and n % p == 0 and family.layout(p, n) == held:
            return family
    found = ", ".join(f"rank {r}: stages {h}" for r, h in enumerate(held))
    raise GraphcError(f"pipeline schedule {name!r}: no layout family places the stages so ({found}). "
                      "Fix: one stage per rank (stage r on rank r), interleaved (stage s on rank "
                      "s mod p) or a V (stages r and 2p-1-r on rank r)")


def _check_rank(name: str, rank: int, order: Sequence[Instruction], stages: Sequence[int],
                m: int) -> None:
    """Each (stage, micro-batch) of the rank runs F, then B or I then W, once."""
    ran: Dict[Tuple[int, int], str] = {}
    for k, ins in enumerate(order):
        for part in ins.parts:
            key = (part.stage, part.microbatch)
            done = ran.get(key, "") + _PASS[type(part)]
            if not ("FIW".startswith(done) or done == "FB"):
                raise GraphcError(f"pipeline schedule {name!r}, rank {rank}, action #{k} `{ins}`: "
                                  f"stage {part.stage} micro-batch {part.microbatch} would run "
                                  f"{' then '.join(done)}; each runs F, then B or I then W, once")
            ran[key] = done
    missing = sorted({(s, i) for s in stages for i in range(m)} - set(ran))
    unfinished = sorted(k for k, done in ran.items() if done not in ("FB", "FIW"))
    if missing or unfinished:
        what = (f"never runs {', '.join(f'{s}F{i}' for s, i in missing[:4])}" if missing else
                f"leaves {', '.join(f'stage {s} micro-batch {i} after {ran[s, i]}' for s, i in unfinished[:4])}")
        raise GraphcError(f"pipeline schedule {name!r}, rank {rank} {what}. Fix: every stage the "
                          f"rank holds ({list(stages)}) runs each of the {m} micro-batches forward "
                          "and backward")
