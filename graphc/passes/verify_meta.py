"""verify_meta: every node annotation a compile step left has the shape its META_* key promises.

Invariant (checked, nothing changes; GRAPHC_DEBUG=5 runs it after every step of compile()):
- each META_* key of graphc/meta.py in a node's meta holds a value of its schema (SCHEMAS:
  META_STAGE an int in the stages' range, META_TENSOR a TensorMeta or None, META_SBP an SbpSignature
  whose `out` has one SBP per mesh axis, ...);
- the nodes a step promised to annotate (ESTABLISHED_BY: annotate_stages gives every node
  but the output META_STAGE, ...) all carry the key after it, and for the LASTING keys
  after every later step too (a node a later pass adds included);
- a key a node carried before a step still is there after it (no pass drops another's
  annotation).
A violation raises AnnotationError naming the step, the node and the key, with the graph
printed and the node marked `<-- ERROR HERE`: a bug in a pass, never in the user's program.
Requires: the graphs a step produced, or else those it read (compile() passes graphs_in of
its result, or of its arguments: the traced graph, or the stage programs' modules); the
stage count once the stages are final (MetaVerifier.stage_count).

NOTE: Annotation verifier. The schema of a key lives here, beside the one table of which step
establishes it; graphc/meta.py names the keys and their value types. A new META_* key gets a
schema here (tests/passes/test_verify_meta.py checks every node key of meta.py has one), and
a pass that annotates every node gets a row of ESTABLISHED_BY.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch.fx as fx

from ..meta import (META_ARRIVAL, META_AUTOCAST, META_BATCHED, META_BOXING, META_CONTEXT_PARALLEL,
                    META_GRAD_ENABLED, META_GRAD_PARTIAL, META_PIECES, META_PLACEMENT, META_ROWS, META_SBP, META_STAGE,
                    META_STAGE_WHY, META_TENSOR, META_INPUT_STAGES, META_WHOLE_SUM, BoxingInfo, RowsMeta, SbpSignature, TensorMeta,
                    is_backward)
from ..placement import Broadcast, PartialSum, Split, mesh_shape, placement
from ..sbp.layout import Pieces
from ..ops.conversions import box
from ..sbp.context_parallel import ContextParallel
from ..plan.program import StageProgram

Problem = Optional[str]   # what is wrong with a value, or None


class AnnotationError(RuntimeError):
    """A compile step left a node annotation that breaks its schema (See NOTE: Annotation
    verifier): a bug in graphc's passes, not in the user's program."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _of_type(*types) -> Callable:
    names = " or ".join("None" if t is type(None) else t.__name__ for t in types)
    return lambda v, ctx: None if isinstance(v, types) else f"expected {names}"


def _stage(v, ctx: "MetaVerifier") -> Problem:
    if not _is_int(v) or v < 0:
        return "expected a stage index, an int >= 0"
    if ctx.stage_count is not None and v >= ctx.stage_count:
        return f"expected a stage index below the {ctx.stage_count} stage(s)"
    return None


def _tensor(v, ctx) -> Problem:
    if v is None:
        return None
    if not isinstance(v, TensorMeta):
        return "expected a TensorMeta or None"
    if not (isinstance(v.shape, tuple) and all(_is_int(d) and d >= 0 for d in v.shape)):
        return "expected a TensorMeta whose shape is a tuple of ints >= 0"
    return None


def _rows(v, ctx) -> Problem:
    if not isinstance(v, RowsMeta):
        return "expected a RowsMeta"
    if v.dim is not None and not _is_int(v.dim):
        return "expected a RowsMeta whose dim is an int or None"
    return None


def _sbp_of(sbp, axes: int) -> bool:
    """Is `sbp` an nd-SBP of `axes` mesh axes (split(int), broadcast or partial_sum each)?"""
    return isinstance(sbp, tuple) and len(sbp) == axes and all(
        isinstance(s, (Broadcast, PartialSum)) or (isinstance(s, Split) and _is_int(s.dim)) for s in sbp)


def _signature(v, ctx) -> Problem:
    if not isinstance(v, SbpSignature):
        return "expected an SbpSignature"
    axes = len(mesh_shape(v.mesh)) if isinstance(v.mesh, tuple) and v.mesh else 0
    if not axes:
        return "expected an SbpSignature on a mesh of ranks"
    if not _sbp_of(v.out, axes):
        return f"expected an SbpSignature whose out has one SBP per mesh axis ({axes})"
    if not all(isinstance(name, str) and _sbp_of(sbp, axes) for name, sbp in v.ins):
        return "expected an SbpSignature whose ins are (input name, one SBP per mesh axis) pairs"
    return None


def _autocast(v, ctx) -> Problem:
    if isinstance(v, tuple) and all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(s, str) for s in p)
                                    for p in v):
        return None
    return "expected a tuple of (device type, dtype name) pairs of str"


def _axes(v, ctx) -> Problem:
    return None if isinstance(v, tuple) and all(_is_int(a) and a >= 0 for a in v) else \
        "expected a tuple of mesh axes (ints >= 0)"


def _arrival(v, ctx) -> Problem:
    if isinstance(v, dict) and all(_is_int(s) and isinstance(a, tuple) and len(a) == 2 for s, a in v.items()):
        return None
    return "expected a dict {stage: (sbp, mesh)}"


def _pieces(v, ctx) -> Problem:
    return None if isinstance(v, Pieces) and all(_is_int(x) for x in v.sizes + (v.dim,)) else \
        "expected sbp.layout.Pieces(sizes, dim) of ints"


def _input_stages(v, ctx) -> Problem:
    return None if isinstance(v, tuple) and len(v) > 1 and all(_is_int(s) for s in v) else \
        "expected a tuple of two or more stage ids"


# The schema of every node annotation: key -> check(value, verifier) -> what is wrong, or None.
SCHEMAS: Dict[str, Callable] = {
    META_STAGE: _stage,
    META_STAGE_WHY: _of_type(str),
    META_INPUT_STAGES: _input_stages,
    META_TENSOR: _tensor,
    META_BATCHED: _of_type(bool),
    META_ROWS: _rows,
    META_GRAD_ENABLED: _of_type(bool),
    META_AUTOCAST: _autocast,
    META_PLACEMENT: _of_type(placement, type(None)),
    META_SBP: _signature,
    META_GRAD_PARTIAL: _axes,
    META_BOXING: _of_type(BoxingInfo),
    META_ARRIVAL: _arrival,
    META_PIECES: _pieces,
    META_CONTEXT_PARALLEL: _of_type(ContextParallel),
    META_WHOLE_SUM: _of_type(bool),
}


# Which nodes a step's promise covers.
def _every(n: fx.Node) -> bool:
    return True


def _not_output(n: fx.Node) -> bool:
    return n.op != "output"


def _traced_op(n: fx.Node) -> bool:
    """What build() ran: placeholders and calls (not constants fx made, not the output)."""
    return n.op not in ("output", "get_attr")


def _has_layout(n: fx.Node) -> bool:
    return n.op != "output" and not is_backward(n)


def _conversion(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is box


# The one table of promises: step name (as compile() records it) -> (key, the nodes that
# carry it after the step). Steps not named here promise no annotation on every node.
ESTABLISHED_BY: Dict[str, Tuple[Tuple[str, Callable], ...]] = {
    "trace_build (whole batch)": ((META_GRAD_ENABLED, _traced_op), (META_AUTOCAST, _traced_op)),
    "propagate_shapes (whole batch)": ((META_TENSOR, _not_output),),
    "find_batch_dims (whole batch)": ((META_ROWS, _every),),
    "trace_build": ((META_GRAD_ENABLED, _traced_op), (META_AUTOCAST, _traced_op)),
    "annotate_stages": ((META_STAGE, _not_output), (META_STAGE_WHY, _not_output)),
    "propagate_shapes": ((META_TENSOR, _not_output),),
    "find_batch_dims": ((META_ROWS, _every),),
    "infer_sbp": ((META_SBP, _has_layout),),
    "insert_boxing": ((META_SBP, _has_layout), (META_BOXING, _conversion)),
}

# Promises that last: from their step on, every later step keeps the key on every node it
# covers, nodes it adds included (insert_boxing, decompose_modules and localize_ops give new
# nodes a stage, a shape and a signature). The others hold right after their step only: a
# boxing node has no grad mode or autocast state of its own (it runs in its neighbours'),
# and a decomposed layer's new nodes carry no rows (find_batch_dims has run).
LASTING = frozenset({META_STAGE, META_TENSOR, META_SBP, META_BOXING})

WINDOW = 15   # nodes shown either side of the bad one


def graphs_in(value) -> List[fx.GraphModule]:
    """The fx graphs a step's result or argument holds: the graph itself, or each stage
    program's module (node metadata is copied into them by split_stages)."""
    if isinstance(value, fx.GraphModule):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, StageProgram) for p in value):
        return [p.module for p in value]
    return []


class MetaVerifier:
    """The annotation checks of one compile() (module docstring), run after each step."""

    def __init__(self) -> None:
        self.stage_count: Optional[int] = None   # set by compile() once the stages are final
        self._seen: Dict[fx.Node, frozenset] = {}  # node -> its graphc keys after the last check
        self._lasting: Dict[fx.GraphModule, list] = {}  # graph -> (key, covers, step) kept since

    def check(self, step: str, gm: fx.GraphModule) -> None:
        """Raises AnnotationError for the first annotation of gm that `step` left broken."""
        promised = [(key, covers, step) for key, covers in ESTABLISHED_BY.get(step, ())]
        lasting = self._lasting.setdefault(gm, [])
        kept = [p for p in lasting if p[0] not in {key for key, _, _ in promised}]
        for node in gm.graph.nodes:
            for key in self._seen.get(node, ()):
                if key not in node.meta:
                    self._fail(step, gm, node, key, "dropped: the node carried it before this step")
            for key, covers, origin in promised + kept:
                if key not in node.meta and covers(node):
                    why = "the step promises it on this node" if origin == step else \
                        f"'{origin}' gave it to nodes like this one, and every later step keeps it"
                    self._fail(step, gm, node, key, f"missing: {why}")
            for key, value in node.meta.items():
                if key in SCHEMAS:
                    problem = SCHEMAS[key](value, self)
                    if problem:
                        self._fail(step, gm, node, key, f"{problem}, found {value!r}")
        self._seen.update({n: frozenset(k for k in n.meta if k in SCHEMAS) for n in gm.graph.nodes})
        lasting[:] = kept + [p for p in promised if p[0] in LASTING]

    def _fail(self, step: str, gm: fx.GraphModule, node: fx.Node, key: str, problem: str) -> None:
        raise AnnotationError(
            f"compile step '{step}' broke annotation {key} of node '{node.name}': {problem}. This "
            f"is a bug in graphc's pass '{step}' (GRAPHC_DEBUG=5 checks annotations after every "
            f"step; See NOTE: Annotation verifier in graphc/passes/verify_meta.py).\n"
            + marked_graph(gm, node))


def marked_graph(gm: fx.GraphModule, bad: fx.Node) -> str:
    """The graph's nodes, one a line, the bad one marked `<-- ERROR HERE` (WINDOW either side)."""
    nodes: List[fx.Node] = list(gm.graph.nodes)
    at = nodes.index(bad)
    lo, hi = max(0, at - WINDOW), min(len(nodes), at + WINDOW + 1)
    lines = [f"    ... {lo} node(s) above"] if lo else []
    for n in nodes[lo:hi]:
        lines.append(f"    {n.format_node()}" + ("    <-- ERROR HERE" if n is bad else ""))
    if hi < len(nodes):
        lines.append(f"    ... {len(nodes) - hi} node(s) below")
    return "graph:\n" + "\n".join(lines)
