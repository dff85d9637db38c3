"""A call's inputs under config.load_layout: this rank's rows of each batched input, on the
stage that reads it (NOTE: Auto layouts). Graph.__call__ lays its inputs out here first."""
from __future__ import annotations

import inspect
import os

from torch.utils import _pytree as pytree

from .. import modes, world
from ..errors import GraphcError
from ..executable import _as_traced, flatten_call
from ..global_tensor import GlobalTensor, to_global
from ..graph_spec import compile_spec
from ..runtime.dist_env import ensure_process_group
from .layout import batch_layouts, batched_inputs, input_stages, named_searcher


def laid_out(graph, inputs):
    """Under config.load_layout with data parallelism, plain tensor inputs (the whole batch
    on every rank) become this rank's rows as GlobalTensors on the stage that reads each
    (NOTE: Auto layouts); inputs the user made global, or no layout, are left alone. Where
    each input goes is found once per graph (graph._input_layouts)."""
    if graph.config.auto is not None and graph.config.layout is None:
        graph.config.layout = searched_layout(graph, inputs)   # NOTE: Run-time search
    layout = graph.config.layout
    if layout is None or layout.dp == 1:
        return inputs
    leaves, treedef = pytree.tree_flatten(tuple(inputs), is_leaf=lambda x: isinstance(x, GlobalTensor))
    if any(isinstance(x, GlobalTensor) for x in leaves):
        return inputs
    if graph._input_layouts is None:
        build = type(graph).build
        specs, tree = flatten_call(inputs, build)
        names = tree.names if tree is not None else \
            [p for p in list(inspect.signature(build).parameters)[1:]]
        batched = batched_inputs(leaves, names, graph.config.whole_inputs)
        spec = compile_spec(graph)
        with _as_traced(spec, tree):
            stages = input_stages(spec, [s.example() for s in specs], layout)
        object.__setattr__(graph, "_input_layouts", batch_layouts(layout, leaves, batched, stages))
    # before the first compile makes the process group, torchrun's RANK names this rank
    rank = world.rank() if world.current() is not None else int(os.environ.get("RANK", "0"))
    return tuple(pytree.tree_unflatten(_local_rows(layout, rank, leaves, graph._input_layouts), treedef))


def searched_layout(graph, inputs):
    """The layout enable_auto_parallel asked for, the same on every rank: rank 0's, from the
    search cache or a search, broadcast (See NOTE: Run-time search in layout.py)."""
    mode = modes.active_plan()
    if mode is not None and mode.auto is not None:
        return None          # graphc plan --auto searches with its own options
    specs, tree = flatten_call(inputs, type(graph).build)
    spec = compile_spec(graph)
    examples = [s.example() for s in specs]
    names = tree.names if tree is not None else list(inspect.signature(type(graph).build).parameters)[1:]
    batched = batched_inputs(examples, names, spec.whole_inputs)
    rank, nproc = (0, mode.nproc) if mode is not None else ensure_process_group({"cpu"})

    def search():
        with _as_traced(spec, tree):
            return named_searcher()(spec, examples, nproc, batched, graph._optimizer, graph.config.auto)
    if mode is not None or world.current() is None:
        return search()
    if rank != 0:
        found = world.current().broadcast_object(None, 0)
    else:
        try:
            found = world.current().broadcast_object(search(), 0)
        except GraphcError as exc:   # the other ranks raise it too, not wait for a layout
            world.current().broadcast_object(str(exc), 0)
            raise
    if isinstance(found, str):
        raise GraphcError(f"rank {rank}: enable_auto_parallel: rank 0's search failed: {found}")
    return found


def _local_rows(layout, rank: int, inputs, laid) -> list:
    """This rank's call arguments under a loaded layout (`laid`: batch_layouts'): each split
    input cut to the rows of the rank's data-parallel coordinate and made a GlobalTensor on its
    placement (a rank outside it passes the first coordinate's rows: they are not read)."""
    out = []
    for t, where in zip(inputs, laid):
        if where is None:
            out.append(t)
            continue
        ranks = list(where.placement.flat_ranks)
        row = ranks.index(rank) // layout.tp if rank in ranks else 0
        out.append(to_global(t.chunk(layout.dp)[row], placement=where.placement, sbp=where.sbp))
    return out
