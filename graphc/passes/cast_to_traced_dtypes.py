"""cast_to_traced_dtypes: every arithmetic node of a stage program computes in the dtype the
trace gave it.

Invariant: in every stage program, an elementwise add, sub or mul whose traced dtype
(META_TENSOR, what eager computed) differs from what type promotion of its inputs' traced
dtypes gives reads its inputs cast to the traced dtype, so the value it makes, and every
transfer or collective of it, has the dtype the plan lists.
Why: the trace runs build()'s own ops, so there the two agree; they part only where a pass
split one op into several and gave the pieces the whole op's annotation. A row-parallel
nn.Linear with a bias (decompose_modules: its bias added after the partial product) is the
case: under autocast eager's F.linear casts the bias to bf16 inside the op, and the add of
a bf16 product and the float32 bias would otherwise promote to float32, making the
all-reduce after it move twice the bytes its plan lists in float32 (NOTE: Autocast regions).
Requires: split_stages (node metadata copied into the stage programs).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import List

import torch
import torch.fx as fx

from ..meta import META_SBP, META_STAGE, META_TENSOR
from ..plan.program import StageProgram

_ARITHMETIC = (operator.add, operator.sub, operator.mul, torch.add, torch.sub, torch.mul)


def cast_to_traced_dtypes(programs: List[StageProgram]) -> List[StageProgram]:
    for program in programs:
        if _cast(program.module.graph):
            program.module.recompile()
    return programs


def _cast(graph: fx.Graph) -> bool:
    changed = False
    for node in list(graph.nodes):
        want = _traced_dtype(node)
        if node.op != "call_function" or node.target not in _ARITHMETIC or want is None:
            continue
        inputs = [a for a in node.args if _traced_dtype(a) is not None]
        if len(inputs) != 2 or _promoted(*inputs) == want:
            continue
        for a in inputs:
            if _traced_dtype(a) != want:
                node.replace_input_with(a, _cast_node(graph, a, want, node))
        changed = True
    return changed


def _traced_dtype(value):
    meta = value.meta.get(META_TENSOR) if isinstance(value, fx.Node) else None
    return getattr(torch, meta.dtype) if meta is not None else None


def _promoted(a: fx.Node, b: fx.Node) -> torch.dtype:
    """torch's result dtype for tensors of a's and b's traced dtypes and shapes (a 0-dim
    tensor promotes like a scalar)."""
    def like(n):
        meta = n.meta[META_TENSOR]
        return torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device="meta")
    return torch.result_type(like(a), like(b))


def _cast_node(graph: fx.Graph, value: fx.Node, dtype: torch.dtype, consumer: fx.Node) -> fx.Node:
    """`value.to(dtype)` just before `consumer`, annotated as value is, in the new dtype."""
    with graph.inserting_before(consumer):
        cast = graph.call_method("to", (value, dtype))
    meta = value.meta[META_TENSOR]
    cast.meta[META_TENSOR] = dataclasses.replace(meta, dtype=str(dtype).removeprefix("torch."))
    for key in (META_STAGE, META_SBP):
        if key in value.meta:
            cast.meta[key] = value.meta[key]
    return cast
