"""The nn.Module traced for a Graph's build(): its class's forward is the Graph's build, its
children the modules assigned in the Graph's __init__ (graph.py makes one class per Graph)."""
from __future__ import annotations

import torch.nn as nn

from .guards import class_value, current_log


class BuildRoot(nn.Module):
    """The nn.Module traced for build(): holds the user's modules under their names.

    Attribute lookups that are not modules fall back to the Graph, so build() can use
    the Graph's other attributes and helper methods.
    """

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            graph = self.__dict__.get("_graphc_graph")
            if graph is None:
                raise
            value = getattr(graph, name)
            log = current_log()
            if log is not None and (name in graph.__dict__ or class_value(graph, name, value)):
                # baked into the trace: guarded (NOTE: Guards)
                log.note(graph, name, value, prefix="self")
            return value
