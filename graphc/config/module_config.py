"""`graph.<module>.config`: one module's settings, set by the user in Graph.__init__."""
from __future__ import annotations

from typing import Optional

from ..errors import GraphcError
from ..placement import placement as Placement


class ModuleConfig:
    """`graph.<module>.config`: the pipeline stage of one module.

    Example:
        self.model.stage0.config.set_stage(stage_id=0, placement=P0)
    """

    def __init__(self, qualname: str, graph):
        self._qualname = qualname
        self._graph = graph
        self.stage_id: Optional[int] = None
        self.placement: Optional[Placement] = None
        self.activation_checkpointing = False

    def set_stage(self, stage_id: int, placement: Placement) -> None:
        """Runs this module (and everything inside it) as pipeline stage `stage_id` on `placement`."""
        if self._graph._compiled is not None:
            raise GraphcError(
                f"module '{self._qualname}': set_stage was called after the graph was compiled; "
                "stages are fixed at the first call. Call set_stage in the Graph's __init__.")
        if not isinstance(stage_id, int) or isinstance(stage_id, bool) or stage_id < 0:
            raise GraphcError(f"module '{self._qualname}': stage_id must be an int >= 0, found {stage_id!r}")
        if not isinstance(placement, Placement):
            raise GraphcError(f"module '{self._qualname}': set_stage needs a graphc.placement, "
                              f"found {placement!r}; use graphc.placement(\"cpu\", ranks=[...])")
        self.stage_id = stage_id
        self.placement = placement

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recomputes this module's forward in its backward instead of keeping its activations
        (OneFlow's per-module switch): its stage keeps only the module's inputs per micro-batch.
        Numbers are those of no checkpointing (random masks are replayed, running statistics
        are not updated twice). See NOTE: Activation checkpointing (runtime/executor.py)."""
        if self._graph._compiled is not None:
            raise GraphcError(f"module '{self._qualname}': set_activation_checkpointing was called "
                              "after the graph was compiled. Call it in the Graph's __init__.")
        if not isinstance(enabled, bool):
            raise GraphcError(f"module '{self._qualname}': set_activation_checkpointing expects "
                              f"True or False, found {enabled!r}")
        self.activation_checkpointing = enabled

    def __repr__(self) -> str:
        return f"ModuleConfig({self._qualname!r}, stage_id={self.stage_id}, placement={self.placement})"
