"""Where tracing's errors point: the user's line that recorded a node, or that is calling
now, skipping the frames of torch and graphc (the Graph's own file first, when known).
Used by trace_build, its tracer and the checks that run while it traces, and by the passes
whose errors name the line that made a node (verify_graph, place_by_layout)."""
from __future__ import annotations

import os
import sys
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


# NOTE: Recorded user lines
# Every traced node keeps the user's frames that made it (node.meta["stack_trace"], fx's
# text: errors, plan printouts and the fx code name the user's line from it). fx would
# capture and symbolise the whole stack per node, pytest's and torch's frames included,
# reading a source line for each (most of the cost of recording a node); only the frames inside the
# innermost fx `trace` that are neither torch's nor graphc's are kept (fx's own filter keeps
# frames from the first `forward` on, which drops build() itself). They are picked off
# the live frames first and only they are looked up and formatted: the same text.
_FX_DIR = TORCH_DIR + "fx" + os.sep


def user_stack_trace(frame) -> str:
    """fx's stack_trace text of the user's frames from `frame` outward up to the innermost fx
    trace() (NOTE: Recorded user lines); '' when there are none."""
    kept = []
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if code.co_name == "trace" and filename.startswith(_FX_DIR):
            break
        if not filename.startswith((TORCH_DIR, GRAPHC_DIR)):
            kept.append(traceback.FrameSummary(filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    if not kept:
        return ""
    return "".join(traceback.StackSummary.from_list(kept[::-1]).format()).strip()


def live_frames(frame=None) -> traceback.StackSummary:
    """traceback.extract_stack() from `frame` (default: the caller's), each source line read
    only when asked for (deepest_user_frame reads one)."""
    stack = traceback.StackSummary.extract(traceback.walk_stack(frame or sys._getframe(1)), lookup_lines=False)
    stack.reverse()
    return stack


def caller_line(source_file: Optional[str]) -> str:
    """'file:line: code' of the user's frame that is calling now (see deepest_user_frame)."""
    return deepest_user_frame(source_file, live_frames(sys._getframe(1)))


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
