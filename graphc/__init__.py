"""graphc: a static-graph compiler for distributed training on PyTorch.

Public API (see README.md, "The API by example"): Graph, placement, sbp, to_global,
GlobalTensor, GraphcError, ExecutionPlan.
"""
from . import amp
from .checkpoint import load, save
from .errors import GraphcError, PlanError, RankFailedError
from .global_tensor import GlobalTensor, to_global
from .graph import Graph
from .placement import placement, sbp
from .plan.plan import ExecutionPlan

__version__ = "0.1.0"

_ON_FIRST_USE = ("testing",)   # graphc.testing: checking code, loaded only when a program reads it


def __getattr__(name: str):
    """`graphc.testing` after `import graphc` alone (README: Checking a job in one process)."""
    if name in _ON_FIRST_USE:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'graphc' has no attribute {name!r}")

__all__ = ["Graph", "GlobalTensor", "GraphcError", "PlanError", "RankFailedError",
           "ExecutionPlan", "placement", "sbp", "to_global", "save", "load", "amp", "__version__"]
