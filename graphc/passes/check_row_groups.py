"""check_row_groups: under accumulation, every input that carries the batch's rows groups
them into micro-batches alike.

Invariant (checked, nothing changes): with accumulation m > 1, the inputs split into
micro-batches (find_batch_dims' batched inputs) are split over the same number of shards
along their rows.

NOTE: Row groups
A rank splits its own rows of a batched input into m chunks, so micro-batch k is the k-th
chunk of every shard: over 2 shards of 8 rows, micro-batch 0 is rows {0, 1, 4, 5}; over 1
shard (the whole batch on each rank) it is rows {0, 1, 2, 3}. Two batched inputs split over
different numbers of shards (x split(0) over ranks [0, 1], its targets y whole or split over
[2, 3, 4]) would pair x's rows of one micro-batch with other rows of y: training would run
and compute something else. Such programs are refused; with accumulation 1 the micro-batch
is the whole batch and any layouts pair alike. Shards count along dim 0 over every mesh axis
that splits it (a 2 x 2 mesh's (split(0), broadcast) is 2 shards, (split(0), split(0)) 4, in
mesh order: the same rows as split(0) over 4 ranks).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..errors import GraphcError
from ..placement import Layout, Split, mesh_shape


def check_row_groups(names: Sequence[str], batched: Sequence[bool], input_layouts: Sequence,
                     num_microbatches: int) -> None:
    """Raises GraphcError when two batched inputs split their rows over different shard counts.

    Args:
        names: build()'s argument names, in order.
        batched: per argument, whether it is split into micro-batches.
        input_layouts: per argument, None (every rank passes the whole tensor) or the
            Layout of a GlobalTensor input.
        num_microbatches: the accumulation steps.
    """
    if num_microbatches <= 1:
        return
    layouts = list(input_layouts) + [None] * (len(batched) - len(input_layouts))
    shards = {name: row_shards(layout) for name, is_batched, layout in zip(names, batched, layouts)
              if is_batched}
    if len(set(shards.values())) <= 1:
        return
    (a, na), (b, nb) = _two_that_differ(shards)
    raise GraphcError(
        f"with gradient accumulation {num_microbatches}, input '{a}' splits the batch's rows "
        f"over {na} shard(s) ({_describe(layouts[list(names).index(a)])}) but input '{b}' over "
        f"{nb} ({_describe(layouts[list(names).index(b)])}); each rank cuts its own rows into "
        f"{num_microbatches} micro-batches, so micro-batch k would pair rows of '{a}' with other "
        f"rows of '{b}' and train on something else (NOTE: Row groups, "
        "graphc/passes/check_row_groups.py). Fix: split both over the same number of ranks "
        f"(e.g. '{b}' split(0) over as many ranks as '{a}', on its own stage's placement), or "
        "use config.set_gradient_accumulation_steps(1).")


def row_shards(layout) -> int:
    """How many shards dim 0 is cut into by `layout` (None: 1, every rank has it whole)."""
    if layout is None:
        return 1
    sbp = layout.sbp if isinstance(layout.sbp, (tuple, list)) else (layout.sbp,)
    out = 1
    for size, s in zip(mesh_shape(layout.placement.ranks), sbp):
        if isinstance(s, Split) and s.dim == 0:
            out *= size
    return out


def _two_that_differ(shards) -> List[tuple]:
    items = list(shards.items())
    first = items[0]
    return [first, next(item for item in items if item[1] != first[1])]


def _describe(layout: Optional[Layout]) -> str:
    if layout is None:
        return "passed whole on every rank"
    return f"{layout.sbp} on {layout.placement}"
