"""Where tracing's errors point: the user's line that recorded a node, or that is calling
now, skipping the frames of torch and graphc (the Graph's own file first, when known).
Used by trace_build, its tracer and the checks that run while it traces, and by the passes
whose errors name the line that made a node (verify_graph, place_by_layout)."""
from __future__ import annotations

import os
import traceback
from typing import Optional

import torch
import torch.fx as fx

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
GRAPHC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def node_line(node: fx.Node) -> str:
    """'File ..., line n, in f: code' of the user's line that recorded `node`."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return f"{trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else node.format_node()


def caller_line(source_file: Optional[str]) -> str:
    """'file:line: code' of the user's frame that is calling now (see deepest_user_frame)."""
    return deepest_user_frame(source_file, traceback.extract_stack())


def traceback_line(source_file: Optional[str], tb) -> str:
    """'file:line: code' of the user's frame in a traceback (see deepest_user_frame)."""
    return deepest_user_frame(source_file, traceback.extract_tb(tb))


def deepest_user_frame(source_file: Optional[str], frames) -> str:
    """The deepest frame of the user's Graph file (source_file), else of any file outside
    torch and graphc."""
    mine = [f for f in frames if f.filename == source_file] or \
        [f for f in frames if not f.filename.startswith((TORCH_DIR, GRAPHC_DIR))]
    if not mine:
        return "build()"
    f = mine[-1]
    return f"{f.filename}:{f.lineno}: {f.line}"
