"""The compilation history: what each step of compile() produced, as text to read afterwards.

Each step's record is stamped `# Constructed by <step> (took <ms>)`, as lightning-thunder
stamps its traces, and shows the step's result in the form a reader needs:

- a traced or annotated graph: its Python code with each node's annotations from
  `node.meta` (stage, shape, rows, placement, SBP, boxing) as a comment beside its line,
  so annotate_stages, propagate_shapes and infer_sbp show what they added;
- stage programs: each program's interface and annotated code;
- execution plans: `str(plan)` of every rank, or of the first rank of each stage when there
  are more than PLANS_SHOWN_UP_TO ranks (a stage's ranks differ only in peers and groups);
- anything else (the stages, the meshes): its `str`, one item a line.

A compile of some ranks' plans (a rank's own, at startup) keeps each step's name and time
without its text (See NOTE: History of a rank's compile, compiler.py).
"""
from __future__ import annotations

import dataclasses
import re
import weakref
from contextvars import ContextVar
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch.fx as fx

from .meta import (META_BOXING, META_GRAD_ENABLED, META_GRAD_PARTIAL, META_PIECES, META_PLACEMENT,
                   META_ROWS, META_SBP, META_STAGE, META_STAGE_WHY, META_TENSOR)
from .plan.plan import ExecutionPlan
from .plan.program import StageProgram
from .sbp.layout import fmt

PLANS_SHOWN_UP_TO = 8   # worlds this small show every rank's plan; larger ones a rank per stage


class PassRecord:
    """One step of compile(): its name, its time and its result as text (see describe)."""

    def __init__(self, name: str, seconds: float, text: Union[str, Callable[[], str]]):
        self.name, self.seconds, self._text = name, seconds, text

    @property
    def text(self) -> str:
        if callable(self._text):     # written when first read (plans: see record)
            self._text = self._text()
        return self._text

    def __repr__(self) -> str:
        return f"PassRecord({self.name!r}, {self.seconds:.4f})"


def record(name: str, seconds: float, out: Any) -> PassRecord:
    head = f"# Constructed by {name} (took {seconds * 1e3:.1f} ms)"
    if _is_plans(out):
        # plans are printed when first read (graphc plan's passes.txt, or never), from a copy of
        # the shown ones as they are now: later steps add notes to the same objects
        shown = [dataclasses.replace(p, instructions=list(p.instructions), notes=dict(p.notes))
                 for p in shown_plans(out)]
        return PassRecord(name, seconds, lambda: f"{head}\n" + _plans_text(shown))
    body = describe(out)
    return PassRecord(name, seconds, f"{head}\n{body}" if body else head)


# while history_text runs: id(instruction) -> (it, its text)
_LINES: ContextVar[Optional[Dict[int, Tuple[Any, str]]]] = ContextVar("graphc_history_lines", default=None)


def history_text(records: List[PassRecord]) -> str:
    """Every record's text, as passes.txt shows them. The plan-level steps' records print
    mostly the same instruction objects (frozen: a step that adds an instruction keeps the
    others), so each is formatted once here: at 8192 ranks, 9 steps of 32 plans."""
    token = _LINES.set({})
    try:
        return "\n\n".join(r.text for r in records)
    finally:
        _LINES.reset(token)


def _plans_text(plans: List[ExecutionPlan]) -> str:
    lines = _LINES.get()
    if lines is None:
        return "\n\n".join(str(p) for p in plans)

    def text_of(ins) -> str:
        known = lines.get(id(ins))
        if known is None:      # the object is kept with its text: its id is never reused here
            known = lines[id(ins)] = (ins, str(ins))
        return known[1]
    return "\n\n".join(p.listing(text_of) for p in plans)


def _is_plans(out: Any) -> bool:
    return isinstance(out, list) and bool(out) and all(isinstance(p, ExecutionPlan) for p in out)


def describe(out: Any) -> str:
    """The text of one step's result (module docstring); '' for a step that returns nothing."""
    if out is None:
        return ""
    if isinstance(out, fx.GraphModule):
        return annotated_code(out)
    if isinstance(out, list) and out and all(isinstance(p, StageProgram) for p in out):
        return "\n\n".join(describe_program(p) for p in out)
    if _is_plans(out):
        return "\n\n".join(str(p) for p in shown_plans(out))
    if isinstance(out, (list, tuple)) and not all(isinstance(v, (bool, int, float, str)) for v in out):
        return "\n".join(f"# {item}" for item in out)
    return "\n".join(f"# {line}" for line in str(out).splitlines())


def shown_plans(plans: List[ExecutionPlan]) -> List[ExecutionPlan]:
    """Every plan in a small world, else the first rank's plan of each stage (and of idle ranks, none)."""
    if len(plans) <= PLANS_SHOWN_UP_TO:
        return list(plans)
    firsts = sorted({min(s.ranks) for s in plans[0].stages if s.ranks})
    by_rank = {p.rank: p for p in plans}
    return [by_rank[r] for r in firsts if r in by_rank] or list(plans[:1])


def describe_program(prog: StageProgram) -> str:
    """str(prog) (interface, prologue, code) with the code annotated."""
    text = str(prog)
    interface = text[:len(text) - len(prog.module.code.strip())]
    return interface + annotated_code(prog.module)


_ASSIGN = re.compile(r"^(\s+)(\w+) = (.*)$")
_DELETES = re.compile(r";  (\w+ = )+None$")   # fx's `;  x = y = None`: frees values, noise here


def annotated_code(gm: fx.GraphModule) -> str:
    """gm's Python code with each node's annotations as a comment beside its line; the
    placeholders' annotations follow the `def` line, one a line."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for line in _python_code(gm.graph).strip().splitlines():
        line = _DELETES.sub("", line)
        m = _ASSIGN.match(line)
        note = node_note(nodes[m.group(2)]) if m and m.group(2) in nodes else ""
        out.append(f"{line}  # {note}" if note else line)
        if line.startswith("def "):
            out += [f"    # {n.name}: {node_note(n)}" for n in gm.graph.nodes
                    if n.op == "placeholder" and node_note(n)]
    return "\n".join(out)


# NOTE: History code cache
# Every step's record prints its graphs' code, and fx writes code in Python, argument by
# argument: a boxing node's rank groups (every group of a mesh axis) cost most of a compile
# at thousands of ranks, printed again after each of ~20 steps for the graph and each of its
# stage programs, most of which a step left as they were (it annotated node.meta, which the
# notes beside the code print fresh). So a graph's code is kept with what it was written
# from: each node's name, op, target, arguments (fx's containers are immutable, so a change
# is a new object), type and the meta fx prints; equal (compared by identity first) means
# the same code.
_CODE: "weakref.WeakKeyDictionary[fx.Graph, tuple]" = weakref.WeakKeyDictionary()


def _python_code(graph: fx.Graph) -> str:
    """graph.python_code("self").src, from the cache when nothing it is written from changed."""
    written_from = (graph._codegen,) + tuple(
        (n, n.name, n.op, n.target, n.args, n.kwargs, n.type, n.meta.get("stack_trace"), n.meta.get("custom"))
        for n in graph.nodes)
    kept = _CODE.get(graph)
    if kept is not None and kept[0] == written_from:
        return kept[1]
    src = graph.python_code("self").src
    _CODE[graph] = (written_from, src)
    return src


def node_note(node: fx.Node) -> str:
    """A node's annotations in one line: `stage 1 (module) | float32[4, 16] grad | rows@0 | sbp
    split(0) on (0, 1)`; '' when no pass has annotated it."""
    meta = node.meta
    parts = []
    if META_STAGE in meta:
        why = meta.get(META_STAGE_WHY)
        parts.append(f"stage {meta[META_STAGE]}" + (f" ({why})" if why else ""))
    if meta.get(META_PLACEMENT) is not None:
        parts.append(f"placed {meta[META_PLACEMENT]}")
    if meta.get(META_TENSOR) is not None:
        parts.append(str(meta[META_TENSOR]))
    if meta.get(META_ROWS) is not None:
        parts.append(str(meta[META_ROWS]))
    if meta.get(META_GRAD_ENABLED) is False:
        parts.append("no_grad")
    if meta.get(META_SBP) is not None:
        sig = meta[META_SBP]
        parts.append(f"sbp {fmt(sig.out)} on {sig.mesh}" + (" fallback" if sig.fallback else ""))
    if meta.get(META_GRAD_PARTIAL):
        parts.append(f"grad partial_sum on axes {list(meta[META_GRAD_PARTIAL])}")
    if meta.get(META_PIECES):
        parts.append(str(meta[META_PIECES]))
    if meta.get(META_BOXING) is not None:
        box = meta[META_BOXING]
        parts.append(f"boxing {box.kind} {fmt(box.src)}->{fmt(box.dst)} axis {box.axis}"
                     + (f" ({box.note})" if box.note else ""))
    return " | ".join(parts)
