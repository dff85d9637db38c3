"""trace_build: turns the user's Graph.build() into an fx graph.

Invariant: the result holds one node per op of build(), `loss.backward()` as a
call_method node with target "backward", user modules as call_module nodes whose
targets are the user's qualified names (e.g. "model.stage0.linear0").
Requires: every module build() calls was assigned to the Graph in __init__.
"""
from __future__ import annotations

import inspect
import os
import traceback

import torch

import torch.fx as fx

from ..errors import GraphcError


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GRAPHC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class _BuildTracer(fx.Tracer):
    def __init__(self):
        super().__init__()
        self.record_stack_traces = True

    def _filter_traceback_frames(self, summary: traceback.StackSummary) -> traceback.StackSummary:
        """The user's frames from build() down, so errors can point at the user's line.

        fx's own filter keeps frames from the first `forward` on, which drops build() itself.
        """
        starts = [i for i, f in enumerate(summary) if f.filename.startswith(_TORCH_DIR + "fx" + os.sep)
                  and f.name == "trace"]
        frames = summary[starts[-1] + 1:] if starts else summary
        return traceback.StackSummary.from_list(
            [f for f in frames if not f.filename.startswith((_TORCH_DIR, _GRAPHC_DIR))])


def trace_build(graph_obj) -> fx.GraphModule:
    root = graph_obj._root
    tracer = _BuildTracer()
    try:
        g = tracer.trace(root)
    except GraphcError:
        raise
    except Exception as e:  # fx raises TraceError, TypeError, ... on untraceable user code
        raise GraphcError(_explain_trace_failure(graph_obj, e)) from e
    return fx.GraphModule(root, g, class_name=type(root).__name__)


def _user_line(graph_obj, tb) -> str:
    """'file:line: code' of the deepest frame of the user's Graph file in a traceback."""
    try:
        user_file = inspect.getsourcefile(type(graph_obj))
    except TypeError:
        user_file = None
    frames = [f for f in traceback.extract_tb(tb) if f.filename == user_file]
    if not frames:
        return "build()"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {f.line}"


def _explain_trace_failure(graph_obj, e: Exception) -> str:
    where = _user_line(graph_obj, e.__traceback__)
    msg = str(e)
    if "control flow" in msg or "iteration" in msg or "bool" in msg.lower():
        fix = ("build() is traced once into a static graph, so Python control flow on a tensor's "
               "value (if/while/for over a tensor, bool(), .item() in a condition) cannot be "
               "recorded. Fix: compute the condition outside build(), or use tensor ops such as "
               "torch.where instead of `if`.")
    else:
        fix = ("Fix: build() may only call modules assigned to the Graph in __init__, torch "
               "functions and tensor methods on its inputs.")
    return (f"graphc could not trace {type(graph_obj).__name__}.build() at {where}\n"
            f"  found: {type(e).__name__}: {msg.splitlines()[0] if msg else ''}\n  {fix}")
