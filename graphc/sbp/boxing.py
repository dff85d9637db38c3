"""The boxing table: every SBP conversion of one mesh axis, its collective, dual and cost.

One home for these facts (STYLE 13): insert_boxing picks a conversion's kind here
(`kind_of`) and costs it, infer_sbp minimises `sbp/cost.py`'s conversion_cost built from
it, list_collectives lists the collectives it names, and `ops/conversions.py: box` runs the
kind forward and its dual backward. A kind added here without its `ops/conversions` runner
fails `tests/sbp/test_boxing_table.py`.

The dual is the conversion the gradient goes through in backward, under graphc's gradient
convention (NOTE: gradient layouts, docs/sbp.md): the gradient of a broadcast value is
whole on every rank, of a split value split the same way, of a partial_sum value whole
on every rank. It runs with the split dims swapped (src <-> dst).

    kind            forward (SBP)        collective    backward (dual)
    all_reduce      P -> B               all_reduce    identity
    reduce_scatter  P -> S               reduce_scat.  all_gather
    all_gather      S -> B               all_gather    slice (local)
    all_to_all      S(i) -> S(j)         all_to_all    all_to_all S(j) -> S(i)
    slice           B -> S               (local)       all_gather
    slice_summed_grad B -> S             (local)       split_partial (a gradient summed later:
                                                       NOTE: Whole values with a summed gradient)
    to_partial      B -> P, rank 0 keeps (local)       identity
    split_partial   S -> P, zero-pad     (local)       slice (local)
    grad_all_reduce B -> B, identity     (none)        all_reduce (the B input of a sharded op)
    gather_scatter  S -> B               all_gather    reduce_scatter (an all_gather whose only
                                                       reader is a grad_all_reduce: the two fused,
                                                       NOTE: Sequence parallel)
    redeal          S(d) -> S(d), dealt  all_gather    redeal back (a split changing its dealing:
                    anew                               contiguous <-> zig-zag, NOTE: Zig-zag dealing)

Costs, with n ranks on the axis and T the global value's bytes: `sent` is what each rank
sends with ring algorithms (2(n-1)/n T for an all-reduce); `total` is OneFlow's copy-cost
model, the bytes over all ranks, which infer_sbp compares (local conversions cost LOCAL T,
so that "no conversion" wins ties).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from ..placement import Broadcast, PartialSum, Split

LOCAL = 1e-3  # a local slice or zero-fill: no bytes move, but it is not free either


@dataclass(frozen=True)
class Boxing:
    """One row of the table (see the module docstring)."""

    kind: str
    sbp: str                            # the conversion, as docs and listings write it
    collective: Optional[str]           # what the forward launches; None: local (or identity)
    dual: Optional[str]                 # the kind the gradient's conversion is; None: identity
    sent: Callable[[int], float]        # bytes each rank sends, per byte of the value (n ranks)
    total: Callable[[int], float]       # copy cost over all ranks, per byte of the value
    partial_grad: bool = False          # its gradient arrives partial_sum (read by sharded ops)


def _nothing(n: int) -> float:
    return 0.0


def _local(n: int) -> float:
    return LOCAL


BOXINGS: Dict[str, Boxing] = {b.kind: b for b in (
    Boxing("all_reduce", "P -> B", "all_reduce", None,
           lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    Boxing("reduce_scatter", "P -> S", "reduce_scatter", "all_gather",
           lambda n: (n - 1) / n, lambda n: n - 1),
    Boxing("all_gather", "S -> B", "all_gather", "slice",
           lambda n: (n - 1) / n, lambda n: n - 1),
    Boxing("all_to_all", "S(i) -> S(j)", "all_to_all", "all_to_all",
           lambda n: (n - 1) / (n * n), lambda n: (n - 1) / n),
    Boxing("slice", "B -> S", None, "all_gather", _nothing, _local),
    Boxing("slice_summed_grad", "B -> S", None, "split_partial", _nothing, _local),
    Boxing("to_partial", "B -> P", None, None, _nothing, _local),
    Boxing("split_partial", "S -> P", None, "slice", _nothing, _local),
    Boxing("grad_all_reduce", "B -> B", None, "all_reduce", _nothing, _nothing, partial_grad=True),
    Boxing("gather_scatter", "S -> B", "all_gather", "reduce_scatter",
           lambda n: (n - 1) / n, lambda n: n - 1, partial_grad=True),
    Boxing("redeal", "S -> S (dealt anew)", "all_gather", "redeal",
           lambda n: (n - 1) / n, lambda n: n - 1),
)}


def kind_of(src, dst) -> str:
    """The conversion of one mesh axis from `src` to `dst` SBP (src != dst)."""
    if isinstance(src, PartialSum):
        return "all_reduce" if isinstance(dst, Broadcast) else "reduce_scatter"
    if isinstance(src, Split):
        if isinstance(dst, Broadcast):
            return "all_gather"
        return "all_to_all" if isinstance(dst, Split) else "split_partial"
    return "slice" if isinstance(dst, Split) else "to_partial"


def backward_collective(kind: str) -> Optional[str]:
    """The collective a conversion's backward launches (None: local or nothing)."""
    dual = BOXINGS[kind].dual
    return BOXINGS[dual].collective if dual is not None else None
