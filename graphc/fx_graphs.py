"""Small operations on fx graphs that passes and the runtime share: a value's ancestors, and
a piece of a graph copied out as a GraphModule of its own."""
from __future__ import annotations

from typing import Dict, Iterable, List, Sequence

import torch.fx as fx


def ancestors(values: Iterable) -> set:
    """The nodes among `values` (other values skipped) and every node they read, transitively."""
    out, todo = set(), [v for v in values if isinstance(v, fx.Node)]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(n.all_input_nodes)
    return out


def copy_subgraph(owner: fx.GraphModule, nodes: List[fx.Node], inputs: Sequence[fx.Node],
                  outputs: Sequence) -> fx.GraphModule:
    """`nodes` (in order) copied into a GraphModule of `owner`'s attributes, `inputs` its
    placeholders (their meta kept), returning the tuple of `outputs` (non-nodes as they are)."""
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    return fx.GraphModule(owner, graph)
