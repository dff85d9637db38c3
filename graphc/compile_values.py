"""What compile() reads and what it produces, as values (compiler.py holds the pass order).

CompileSpec: everything compile() reads of a Graph, taken when it compiles (graph_spec.py);
CompiledGraph: the annotated graph, the stage programs and the plans it made.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from .errors import GraphcError
from .guards import GuardSet
from .history import PassRecord
from .passes.insert_grad_sync import DEFAULT_BUCKET_BYTES
from .passes.insert_zero_units import UnitOptions
from .plan.plan import ExecutionPlan, StageInfo
from .plan.program import StageProgram
from .sbp.context_parallel import ContextParallel
from .sbp.declared import DeclaredLayouts

if TYPE_CHECKING:
    from .passes.trace_build import TraceText
    from .plan_cache import CompileKey


@dataclass(frozen=True)
class ModuleSpec:
    """What the compiler reads of one module's config: its set_stage and checkpointing."""

    stage_id: Optional[int] = None
    placement: Any = None  # a graphc.placement, or None
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class CompileSpec:
    """Everything compile() reads of a Graph, taken when it compiles (graph_spec.compile_spec):
    the module traced for build(), the Graph's options and per-module settings, and the
    layouts to_global declared for its parameters and buffers.

    The compiler reads nothing of the Graph itself; attributes build() reads from the Graph
    go through `root`'s fallback while tracing and are recorded on the Graph's side.
    """

    name: str                          # the Graph's class name, in messages and logs
    source_file: Optional[str]         # the file defining it: error messages point into it
    root: torch.nn.Module              # build() as forward, the user's modules as children
    modules: Dict[str, ModuleSpec]     # per configured module (qualified name), in config order
    declared: DeclaredLayouts          # to_global's layouts of parameters and buffers, by name
    gradient_accumulation_steps: int = 1
    pipeline_schedule: str = "1f1b"
    deferred_batch_norm: bool = False
    gradient_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    grad_clip_norm: Optional[float] = None
    activation_checkpointing: str = "never"
    whole_inputs: Tuple[str, ...] = ()  # build() arguments never split into micro-batches
    amp_dtype: Optional[torch.dtype] = None  # enable_amp: build() under autocast to this dtype
    zero_stage: int = 0                # enable_zero: 0 off, 1, 2 or 3 (NOTE: ZeRO, runtime/zero.py)
    zero_shard_min_size: int = 1024    # parameters with fewer elements stay replicated
    zero_units: UnitOptions = UnitOptions()  # stage 3 gathered per unit (NOTE: ZeRO units)
    grad_reduce_dtype: Optional[torch.dtype] = None  # gradient buckets' dtype (None: the grads')
    param_dtype: Optional[torch.dtype] = None  # set_param_dtype: parameters stored in it, float32 masters
    sequence_parallel: bool = False    # enable_sequence_parallel (NOTE: Sequence parallel)
    context_parallel: Optional[ContextParallel] = None  # set_context_parallel (NOTE: Context parallel)
    expert_capacity: Optional[float] = None  # set_expert_capacity (NOTE: Expert capacity)


@dataclass
class CompiledGraph:
    """Everything compile() produced: the annotated graph, stage programs, every rank's plan."""

    gm: fx.GraphModule
    stages: List[StageInfo]
    programs: List[StageProgram]
    plans: Sequence[ExecutionPlan]    # by rank; a whole world's may be a PlanWorld (NOTE: Plan templates)
    training: bool
    num_microbatches: int
    input_meta: List[tuple]
    history: List[PassRecord] = field(default_factory=list)
    meshes: List[tuple] = field(default_factory=list)  # per stage: placement ranks (2-D nested)
    guards: GuardSet = field(default_factory=GuardSet)  # the Python values it was built from (NOTE: Guards)
    trace: Optional["TraceText"] = None  # build()'s traced graph as text (NOTE: Retrace check)
    world_size: int = 0                # the ranks of the job; `plans` may hold only some of them
    key: Optional["CompileKey"] = None  # what the plans were compiled from (NOTE: Plan cache)
    # with accumulation, where the whole batch's trace (traced first) and the plan's micro-batch
    # trace run other ops: both, op by op (NOTE: Writes of the first call); else None
    traces_differ: Optional[tuple] = None

    def __post_init__(self):
        self.world_size = self.world_size or len(self.plans)

    @property
    def whole_world(self) -> bool:
        """Whether `plans` holds every rank's plan (graphc plan), not only some (a rank's own)."""
        return len(self.plans) == self.world_size

    def plan_for(self, rank: int) -> ExecutionPlan:
        plans = self.plans
        if rank < len(plans) and plans[rank].rank == rank:   # the whole world's, by rank
            return plans[rank]
        plan = next((p for p in plans if p.rank == rank), None)
        if plan is None:
            raise GraphcError(f"internal: rank {rank}'s plan was not compiled here (this compile "
                              f"lowered ranks {[p.rank for p in plans][:8]} of {self.world_size})")
        return plan
