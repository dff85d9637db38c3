"""Names of the annotations passes leave in `node.meta`, and their value types."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

META_STAGE = "graphc_stage"          # int: pipeline stage the node runs on (annotate_stages)
META_STAGE_WHY = "graphc_stage_why"  # str: which rule gave the stage, for printing
META_TENSOR = "graphc_tensor"        # TensorMeta | None: per-micro-batch value (propagate_shapes)
META_BATCHED = "graphc_batched"      # bool: placeholder split into micro-batches along dim 0

BACKWARD_TARGET = "backward"         # call_method target of `loss.backward()` in build()


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


def tensor_meta(node) -> Optional[TensorMeta]:
    return node.meta.get(META_TENSOR)
