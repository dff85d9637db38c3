"""How a failed plan check shows the plan: the rank's listing with the bad instruction marked.

Every check of plan/verify.py and its parts (verify_collectives.py, verify_deadlock.py,
verify_zero.py) fails through `fail`, so a PlanError always names the rank and instruction
and prints the listing marked `<-- ERROR HERE`; `dtype_clash` words a payload mismatch that
is only a dtype.
"""
from __future__ import annotations

from ..errors import PlanError
from .plan import ExecutionPlan


def fail(plan: ExecutionPlan, index: int, why: str) -> None:
    raise PlanError(f"plan verification failed on rank {plan.rank}, instruction #{index} "
                    f"`{plan.instructions[index]}`: {why}\n{plan.format(mark=index)}")


def marked_listing(plan: ExecutionPlan, marks, context: int = 3) -> str:
    """The rank's listing around the marked instructions, each flagged `<-- ERROR HERE`."""
    lines = str(plan).splitlines()
    head = len(lines) - len(plan.instructions)   # the header, stages and notes lines
    keep = set(range(head)) | {j for i in marks for j in range(i + head - context, i + head + 1 + context)
                               if head <= j < len(lines)}
    out, last = [], 0
    for j in sorted(keep):
        if j > last + 1:
            out.append("   ...")
        out.append(lines[j] + ("   <-- ERROR HERE" if j - head in marks else ""))
        last = j
    if last < len(lines) - 1:
        out.append("   ...")
    return "\n".join(out)


def dtype_clash(a, b) -> str:
    """'dtype' when two payloads differ only in their tensors' dtypes, else ''."""
    same_shapes = len(a) == len(b) and all((x.name, x.shape) == (y.name, y.shape) for x, y in zip(a, b))
    return "dtype" if same_shapes and any(x.dtype != y.dtype for x, y in zip(a, b)) else ""
