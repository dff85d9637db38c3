"""Names of the annotations passes leave in `node.meta`, and their value types."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

META_STAGE = "graphc_stage"          # int: pipeline stage the node runs on (annotate_stages)
META_STAGE_WHY = "graphc_stage_why"  # str: which rule gave the stage, for printing
META_INPUT_STAGES = "graphc_input_stages"  # tuple: the stages an input's placement holds, when several (place_inputs)
META_TENSOR = "graphc_tensor"        # TensorMeta | None: per-micro-batch value (propagate_shapes)
META_BATCHED = "graphc_batched"      # bool: placeholder split into micro-batches along dim 0
META_ROWS = "graphc_rows"            # RowsMeta: where the value holds the batch's rows (find_batch_dims)
META_WHOLE_SUM = "graphc_whole_sum"  # bool: a sum over the batch every micro-batch takes whole (NOTE: Whole-batch sums)
META_GRAD_ENABLED = "graphc_grad_enabled"  # bool: grad mode build() traced the node in (no_grad regions)
META_OUTPUT_TREE = "graphc_output_tree"  # gm.meta: pytree spec of build()'s result when fx holds its leaves (NOTE: Output trees)
META_AUTOCAST = "graphc_autocast"    # ((device type, dtype), ...): autocast regions the node was traced in
META_PLACEMENT = "graphc_placement"  # placement: where the op runs without set_stage (place_by_layout)
META_FOUND_STAGES = "graphc_found_stages"  # gm.meta: tuple[FoundStage], stages in data-flow order (place_by_layout)

BACKWARD_TARGET = "backward"         # call_method target of `loss.backward()` in build()


def is_backward(node) -> bool:
    """Is fx node `node` the `loss.backward()` of build()?"""
    return node.op == "call_method" and node.target == BACKWARD_TARGET


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and autograd flag of one micro-batch's value of a node."""

    shape: Tuple[int, ...]
    dtype: str
    requires_grad: bool

    @staticmethod
    def of(t) -> "TensorMeta":
        return TensorMeta(tuple(t.shape), str(t.dtype).replace("torch.", ""), bool(t.requires_grad))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}{' grad' if self.requires_grad else ''}"


@dataclass(frozen=True)
class RowsMeta:
    """Where a value holds the batch's rows: `dim` indexes them (None: no batch dim), and
    `reduced` says it is a sum or mean over them (a micro-batch holds one part of it), and
    `summed` which of the two, for build()'s outputs and the loss (find_batch_dims: NOTE:
    Batch sums)."""

    dim: Optional[int]
    reduced: bool
    summed: bool = False  # a reduced value that is a sum over the rows (micro-batches add up)

    def __str__(self) -> str:
        if self.dim is not None:
            return f"rows@{self.dim}"
        return ("rows-sum" if self.summed else "rows-mean") if self.reduced else "whole"


@dataclass(frozen=True)
class FoundStage:
    """A pipeline stage found from placements: the placement, and what the program placed
    there (parameters, inputs, to_global targets), for printing."""

    placement: object            # graphc.placement
    sources: Tuple[str, ...]

    def __str__(self) -> str:
        shown = ", ".join(self.sources[:3]) + (", ..." if len(self.sources) > 3 else "")
        ranks = [list(r) if isinstance(r, tuple) else r for r in self.placement.ranks]
        return f"ranks {ranks} ({shown})"


# -- SBP (infer_sbp, insert_boxing); see docs/sbp.md ---------------------------------------
META_SBP = "graphc_sbp"              # SbpSignature: the node's layout and what it needs of its inputs
META_GRAD_PARTIAL = "graphc_grad_partial"  # tuple[int]: mesh axes where a parameter's grad is partial_sum
META_BOXING = "graphc_boxing"        # BoxingInfo on a conversion node inserted by insert_boxing
META_ARRIVAL = "graphc_arrival"      # {stage: (sbp, mesh)}: how a value arrives on a stage of another
                                     # mesh shape (insert_boxing; see NOTE: Reshard pieces)
META_CONTEXT_PARALLEL = "graphc_context_parallel"  # ContextParallel on an attention call whose
                                     # sequence may split (NOTE: Context parallel)
META_PIECES = "graphc_pieces"        # sbp.layout.Pieces: a split parameter stored in pieces along a dim, each
                                     # split alike (fused q/k/v; see NOTE: fused pieces, docs/sbp.md)


@dataclass(frozen=True)
class SbpSignature:
    """Where a node runs (mesh: placement ranks, nested for 2-D) and how its value is laid out.

    `out` has one SBP per mesh axis; `ins` maps each tensor input's name to the SBP the op
    needs it in; `fallback` marks an op without a rule, run on gathered (broadcast) inputs.
    """

    mesh: tuple
    out: tuple
    ins: Tuple[Tuple[str, tuple], ...] = ()
    fallback: bool = False

    def needs(self, name: str) -> Optional[tuple]:
        return dict(self.ins).get(name)


@dataclass(frozen=True)
class BoxingInfo:
    """One conversion on one mesh axis: a collective (or local op) and its backward."""

    kind: str                  # all_reduce, reduce_scatter, all_gather, all_to_all, slice, ...
    src: tuple                 # nd-SBP before
    dst: tuple                 # nd-SBP after
    groups: tuple              # the rank groups along the axis
    nbytes: int                # bytes each rank sends per micro-batch (forward + backward)
    note: str = ""             # e.g. "fallback: <op>" when it feeds an op without an SBP rule
    axis: int = 0              # the mesh axis it converts
