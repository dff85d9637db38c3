"""Per-module and per-graph configuration, set by the user in Graph.__init__."""
from __future__ import annotations

from typing import Optional

import torch

from .errors import GraphcError
from .placement import placement as Placement
from .plan.plan import CHECKPOINT_MODES, DEFAULT_BUCKET_BYTES
from .runtime.options import RunOptions
from .sbp.context_parallel import checked as checked_context_parallel


_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


class GraphConfig:
    """`graph.config`: options of the whole graph."""

    def __init__(self, graph):
        self._graph = graph
        self.gradient_accumulation_steps = 1
        self.pipeline_schedule = "1f1b"
        self.recv_window = 2
        self.cuda_graphs = False            # set_cuda_graphs (NOTE: CUDA graphs, runtime/cuda_graphs.py)
        self.compile_stages = False         # set_compile_stages (NOTE: Compiled stages, runtime/compiled_stages.py)
        self.memory_stats = False           # set_memory_stats: graph.last_stats.max_live_bytes
        self.gradient_bucket_bytes = DEFAULT_BUCKET_BYTES
        self.trace_path: Optional[str] = None
        self.trace_steps = 5
        self.grad_clip_norm: Optional[float] = None
        self.deferred_batch_norm = False
        self.activation_checkpointing = "never"
        self.whole_inputs: tuple = ()
        self.check_microbatching = False
        self.amp_dtype: Optional[torch.dtype] = None
        self.zero_stage = 0                 # enable_zero: 0 (off), 1, 2, 3 (See NOTE: ZeRO)
        self.zero_shard_min_size = 1024
        self.zero_unit_bytes = 0            # stage 3 per unit (See NOTE: ZeRO units), 0: whole stage
        self.zero_reshard_after_forward = ((-1, True),)   # per stage ((stage, bool), ...), -1: all
        self.zero_gather_per_step = ((-1, False),)
        self.grad_reduce_dtype: Optional[torch.dtype] = None   # None: each gradient's own dtype
        self.param_dtype: Optional[torch.dtype] = None  # set_param_dtype (None: the model's own)
        self.sequence_parallel = False      # enable_sequence_parallel (NOTE: Sequence parallel)
        self.context_parallel = None        # set_context_parallel: a ContextParallel (NOTE: Context parallel)
        self.expert_capacity = None         # set_expert_capacity: a factor, None dropless (NOTE: Expert capacity)
        self.layout = None                  # load_layout: a graphc.auto.Layout (NOTE: Auto layouts)
        self.auto = None                    # enable_auto_parallel: an AutoRequest (NOTE: Run-time search)

    def _set_switch(self, what: str, attr: str, enabled) -> None:
        """An on/off option: checked open and a bool, then set."""
        self._check_open(what)
        if not isinstance(enabled, bool):
            raise GraphcError(f"{what} expects True or False, found {enabled!r}")
        setattr(self, attr, enabled)

    def _check_open(self, what: str) -> None:
        if self._graph._compiled is not None:
            raise GraphcError(f"graph.config.{what} was called after the graph was compiled; "
                              "set options in the Graph's __init__")

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Splits each batch into `steps` micro-batches; the optimizer steps once per call."""
        self._check_open("set_gradient_accumulation_steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise GraphcError(f"gradient accumulation steps must be an int >= 1, found {steps!r}")
        self.gradient_accumulation_steps = steps

    def set_pipeline_schedule(self, name: str) -> None:
        """The order each pipeline rank runs its forwards and backwards in: "1f1b" (default)
        or "gpipe" with one stage per rank; "interleaved_1f1b", "looped_bfs", "zero_bubble"
        with stage s on the ranks of stage s mod p; "zbv", "dualpipev" with stages s and
        2p-1-s on one rank. See docs/schedules.md."""
        from .plan.schedules import SCHEDULES
        self._check_open("set_pipeline_schedule")
        if not isinstance(name, str) or name not in SCHEDULES:
            raise GraphcError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
        self.pipeline_schedule = name

    def set_trace(self, path: str, steps: int = 5) -> None:
        """Writes the first `steps` steps of every rank's instruction timeline to `path`.

        One Chrome-trace / Perfetto JSON file, merged on rank 0 (see graphc/runtime/trace.py);
        the environment variable GRAPHC_TRACE=path does the same without code changes.
        """
        self._check_open("set_trace")
        if not isinstance(path, str) or not path or path in ("0", "1"):
            raise GraphcError(f"set_trace needs a file path such as \"trace.json\", found {path!r}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise GraphcError(f"set_trace: steps must be an int >= 1, found {steps!r}")
        self.trace_path, self.trace_steps = path, steps

    def set_gradient_bucket_size(self, nbytes: int) -> None:
        """Gradients of data-parallel parameters are all-reduced in buckets of about `nbytes`."""
        self._check_open("set_gradient_bucket_size")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
            raise GraphcError(f"gradient bucket size must be an int number of bytes >= 1, found {nbytes!r}")
        self.gradient_bucket_bytes = nbytes

    def set_grad_clip_norm(self, max_norm: float) -> None:
        """Clips gradients by their global 2-norm before each optimizer step.

        The norm is taken over every parameter gradient of the whole model, across every
        stage and shard: a replicated parameter counts once, a split parameter's shards
        together, a tied parameter once. When it exceeds `max_norm`, every gradient is
        scaled by max_norm / (norm + 1e-6), exactly as torch.nn.utils.clip_grad_norm_ on
        the eager model. It costs one scalar all-reduce per step over the training ranks,
        listed in the plan as CLIP_GRAD_NORM.

        Args:
            max_norm: the largest global gradient norm allowed, a number > 0.

        Example:
            self.config.set_grad_clip_norm(1.0)   # in the Graph's __init__
        """
        self._check_open("set_grad_clip_norm")
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0 \
                or max_norm == float("inf"):
            raise GraphcError(f"set_grad_clip_norm: max_norm must be a finite number > 0, found "
                              f"{max_norm!r}. Fix: pass e.g. self.config.set_grad_clip_norm(1.0).")
        self.grad_clip_norm = float(max_norm)

    def set_deferred_batch_norm(self, enabled: bool = True) -> None:
        """BatchNorm's running statistics of the whole mini-batch, updated once per step.

        With gradient accumulation every micro-batch is normalised with its own batch
        statistics, as in eager accumulation, and by default also updates the running
        statistics (m updates per step). Deferred (torchgpipe's `deferred_batch_norm`), the
        micro-batches' sums are accumulated and the running mean and variance take one
        update per step, with the statistics of the whole mini-batch: what eager PyTorch
        on the whole batch stores. num_batches_tracked then counts steps.

        Example:
            self.config.set_deferred_batch_norm(True)   # in the Graph's __init__
        """
        self._set_switch("set_deferred_batch_norm", "deferred_batch_norm", enabled)

    def set_activation_checkpointing(self, mode: str) -> None:
        """Which micro-batches recompute their forward in their backward, on every stage
        (torchgpipe's Pipe `checkpoint`): "always", "except_last" (every micro-batch but the
        last, whose backward follows its forward soonest) or "never" (default). A
        checkpointed micro-batch keeps only its stage inputs; numbers are those of no
        checkpointing.

        Example:
            self.config.set_activation_checkpointing("except_last")   # in the Graph's __init__
        """
        self._check_open("set_activation_checkpointing")
        if mode not in CHECKPOINT_MODES:
            raise GraphcError(f"set_activation_checkpointing: mode must be one of "
                              f"{list(CHECKPOINT_MODES)}, found {mode!r}. For one module, use "
                              "module.config.set_activation_checkpointing(True).")
        self.activation_checkpointing = mode

    def load_layout(self, layout) -> None:
        """Trains on a whole parallel layout: the `layout.json` that `graphc plan --auto`
        wrote (a path), or a graphc.auto.Layout. It places the model's layers on pipeline
        stages, splits their Megatron pairs over tensor-parallel ranks and the batch over
        data-parallel ranks, and sets the schedule, micro-batches, ZeRO stage and
        checkpointing; set_stage and to_global declarations of the model are replaced. Pass
        the whole batch on every rank as plain tensors: each rank takes its rows (See NOTE:
        Auto layouts in graphc/auto/layout.py).

        Example:
            self.config.load_layout("plans/layout.json")
        """
        from .auto.layout import Layout
        self._check_open("load_layout")
        self.layout = layout if isinstance(layout, Layout) else Layout.load(layout)

    def enable_auto_parallel(self, enabled: bool = True, device: str = "h100",
                             memory: Optional[float] = None, top: int = 8,
                             cache: Optional[str] = None) -> None:
        """Trains on the layout graphc searches for this model and world: pipeline stages,
        tensor and data degrees, ZeRO, schedule, micro-batches and checkpointing, as `graphc
        plan --auto` would choose them (See NOTE: Run-time search in graphc/auto/layout.py).

        At the first call, rank 0 finds the layout (in the search cache, or by a search of
        some seconds to a minute) and every rank trains on it; pass the whole batch on every
        rank as plain tensors, as with load_layout.

        Args:
            enabled: True to search; False to train as declared.
            device: the device preset the search models ("h100", "h200", "a100", "cpu").
            memory: GiB per rank every layout must fit (default: the device's memory).
            top: how many of the best estimates are compiled and simulated.
            cache: the folder of searched layouts (default GRAPHC_AUTO_CACHE, else
                ~/.cache/graphc/auto); a search is kept per model, inputs, world and device.

        Example:
            self.config.enable_auto_parallel(True, device="h100", memory=40)
        """
        from .auto.layout import AutoRequest
        self._check_open("enable_auto_parallel")
        if not isinstance(enabled, bool):
            raise GraphcError(f"enable_auto_parallel expects True or False, found {enabled!r}")
        if not isinstance(top, int) or top < 1:
            raise GraphcError(f"enable_auto_parallel: top must be a positive int, found {top!r}")
        if memory is not None and not (isinstance(memory, (int, float)) and memory > 0):
            raise GraphcError(f"enable_auto_parallel: memory is GiB per rank, a positive number; found {memory!r}")
        self.auto = AutoRequest(device, None if memory is None else float(memory), top, cache) if enabled else None

    def set_whole_inputs(self, *names: str) -> None:
        """build() arguments passed whole to every micro-batch under gradient accumulation.

        Every other input whose dim 0 equals the batch size (dim 0 of build()'s first
        input) is split into the micro-batches along dim 0; an input of another length is
        passed whole anyway. Name an input here when its dim 0 only happens to equal the
        batch size (a [B, B] matrix, a table of B entries). graphc checks the choice against
        how build() uses each input and refuses a conflict, naming the input and the op
        (docs/errors.md).

        Args:
            names: build()'s argument names, as in its signature.

        Example:
            self.config.set_whole_inputs("prototypes")   # build(self, x, y, prototypes)
        """
        self._check_open("set_whole_inputs")
        bad = [n for n in names if not isinstance(n, str) or not n]
        if bad:
            raise GraphcError(f"set_whole_inputs takes build()'s argument names as strings, found "
                              f"{bad!r}. Fix: e.g. self.config.set_whole_inputs(\"prototypes\").")
        self.whole_inputs = tuple(dict.fromkeys(self.whole_inputs + tuple(names)))

    def set_check_microbatching(self, enabled: bool = True) -> None:
        """On the first call, also run the step eagerly on the whole batch and compare.

        Rank 0 runs build() on a copy of the model and the whole batch, steps a copy of the
        optimizer, and compares the loss and every parameter with graphc's first step; a
        difference beyond rounding (1e-9 relative in float64, 1e-4 in float32) is a
        GraphcError on every rank naming the values that differ (NOTE: Checked first step,
        graphc/checking/first_step.py). A safety net for a new model or layout; it costs one eager
        step and two gathers of the model's state, once. Plans with random ops (dropout)
        are not compared (a warning says so).

        Example:
            self.config.set_check_microbatching(True)   # in the Graph's __init__
        """
        self._set_switch("set_check_microbatching", "check_microbatching", enabled)

    def enable_amp(self, enabled: bool = True, dtype: torch.dtype = torch.bfloat16) -> None:
        """Automatic mixed precision (OneFlow's name): build() runs under torch.autocast.

        Every op of build() runs as it would inside `with torch.autocast(device, dtype):`
        (matmuls and convolutions in `dtype`, reductions, norms and losses in float32, by
        torch's autocast lists for the placements' device type), and `loss.backward()` runs
        outside it, as the eager recipe does. Parameters and optimizer state stay float32
        (the master weights), gradients are float32 and accumulate in float32 over the
        micro-batches, and gradient all-reduces run in float32. Values crossing stages
        travel in the dtype autocast gave them (half the bytes for bf16). On CPU the result
        equals eager autocast bit for bit (docs/design.md, NOTE: Autocast regions).

        Args:
            enabled: True to run build() under autocast.
            dtype: torch.bfloat16 or torch.float16.

        Example:
            self.config.enable_amp(True, dtype=torch.bfloat16)   # in the Graph's __init__
        """
        self._check_open("enable_amp")
        if not isinstance(enabled, bool):
            raise GraphcError(f"enable_amp expects True or False, found {enabled!r}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise GraphcError(f"enable_amp: dtype must be torch.bfloat16 or torch.float16, found "
                              f"{dtype!r}. Fix: self.config.enable_amp(True, dtype=torch.bfloat16).")
        self.amp_dtype = dtype if enabled else None

    def set_grad_reduce_dtype(self, dtype: torch.dtype = torch.float32) -> None:
        """The dtype data-parallel gradients are all-reduced in. torch.float32 (the default)
        reduces each gradient in its own dtype: float32 for float32 parameters, amp included.

        torch.bfloat16 or torch.float16 halves the bytes of every gradient bucket: each rank
        casts its float32 gradient (its addend of the sum) down before the all-reduce and the
        sum back up to float32 after it, as torch DDP's bf16_compress_hook does. Gradients
        still accumulate in float32 over the micro-batches, and parameters and optimizer
        state stay float32; only the sum over ranks is rounded. The plan's ALL_REDUCE lists
        the gradients in this dtype and counts its bytes. Ties between stages and the
        gradient clipping norm are summed in float32 whatever this says.

        Args:
            dtype: torch.float32, torch.bfloat16 or torch.float16.

        Example:
            self.config.enable_amp(True, dtype=torch.bfloat16)
            self.config.set_grad_reduce_dtype(torch.bfloat16)   # half the bytes per bucket
        """
        self._check_open("set_grad_reduce_dtype")
        if dtype not in _REDUCE_DTYPES:
            raise GraphcError(f"set_grad_reduce_dtype: dtype must be one of "
                              f"{', '.join(map(str, _REDUCE_DTYPES))}, found {dtype!r}. Fix: "
                              "self.config.set_grad_reduce_dtype(torch.bfloat16).")
        self.grad_reduce_dtype = None if dtype == torch.float32 else dtype

    def set_param_dtype(self, dtype: torch.dtype) -> None:
        """Stores the model's parameters in `dtype` with a float32 master copy of each, held
        by the optimizer (Megatron's layout; See NOTE: Master parameters in
        graphc/runtime/master_params.py).

        The stage programs read bfloat16 (or float16) parameters: with enable_amp autocast's
        lists decide each op's dtype, without it every op computes in `dtype`, as eager on
        `model.to(dtype)`. Each micro-batch's gradient is added into its master's float32
        .grad, so gradients accumulate, are all-reduced (unless set_grad_reduce_dtype says
        otherwise), unscaled and clipped in float32; the optimizer steps on the masters and
        each parameter becomes its master rounded to `dtype`. state_dict() and
        full_state_dict() hold the float32 masters. Needs float32 parameters and an optimizer.
        With enable_zero stages 1 and 2 each rank holds only its rows of the masters and of
        the optimizer's state, and the parameters are all-gathered in `dtype` after the step
        (See NOTE: ZeRO with master parameters in graphc/runtime/zero.py); stage 3 is not
        available with it yet. torch.float32 turns it off.

        Args:
            dtype: torch.bfloat16, torch.float16, or torch.float32 (off).

        Example:
            self.config.enable_amp(True, dtype=torch.bfloat16)
            self.config.set_param_dtype(torch.bfloat16)   # 18 bytes per parameter with Adam
        """
        self._check_open("set_param_dtype")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise GraphcError(f"set_param_dtype: dtype must be torch.bfloat16, torch.float16 or "
                              f"torch.float32 (off), found {dtype!r}. Fix: "
                              "self.config.set_param_dtype(torch.bfloat16).")
        self.param_dtype = None if dtype == torch.float32 else dtype

    def enable_zero(self, enabled: bool = True, stage: int = 2, shard_min_size: int = 1024,
                    unit_bytes: int = 0, reshard_after_forward=True, gather_per="microbatch") -> None:
        """Sharded data parallelism (ZeRO; OneFlow's name and arguments).

        On every stage whose parameters are replicated over a data-parallel mesh axis (their
        gradients partial_sum), each parameter of at least `shard_min_size` elements is
        split(0) over that axis for the optimizer (See NOTE: ZeRO in graphc/runtime/zero.py);
        over several axes at once where its gradient is partial over several (data x context
        parallel: the whole dp x cp group, See NOTE: ZeRO over joint axes):
          stage 1: the optimizer holds only this rank's rows of it (its state 1/d of the
                   replicated run's); gradients are reduce-scattered once per step (after the
                   last micro-batch's backward) into this rank's rows, the optimizer steps on
                   them, and the parameter is all-gathered after the step;
          stage 2: as 1, and the full-size gradient buckets are freed once reduce-scattered
                   (stage 1 keeps them between steps, as DDP does);
          stage 3: as 2, and the parameters are held as this rank's rows between uses: each
                   stage's are all-gathered before the computes that read them (prefetched
                   while the compute before runs) and freed after (See NOTE: ZeRO stage 3).
                   A rank holding one stage gathers once per step; one holding several chunks
                   per compute. graph.state_dict(), load_state_dict() and full_state_dict()
                   gather them for the call. With `unit_bytes` the stage is gathered unit
                   by unit inside its forward and backward (See NOTE: ZeRO units in
                   graphc/runtime/zero_units.py): a unit is a module's parameters, or
                   consecutive modules' up to unit_bytes, gathered just before its first
                   use with the next one prefetched, freed after its last use in the forward
                   (`reshard_after_forward`), regathered for the backward in reverse order
                   and freed once its backward is done; each unit's gradient is reduce-
                   scattered as soon as it is final. The plan lists each unit's gather and
                   release after the compute that runs it (`0F1.GATHER u2`), and its
                   zero note the choices.
        Bytes moved per step at stages 1 and 2 equal data parallel's (a reduce-scatter and an
        all-gather move what one all-reduce does); at stage 3 (c+1)/2 of it for c gathers of a
        stage's parameters per step (1 once per step; 2m+1 per compute of m micro-batches'
        forwards and backwards). The plan lists each REDUCE_SCATTER, ALL_GATHER and RELEASE
        with its tensors and bytes. Smaller parameters, and parameters held by several stages
        (tied), stay replicated and all-reduced. Numbers equal the replicated run's.

        Args:
            enabled: True to shard.
            stage: 1, 2 or 3.
            shard_min_size: parameters with fewer elements (of their local component) stay
                replicated.
            unit_bytes: stage 3: gather per unit of about this many bytes (0: the whole
                stage once per step). A rank holding several chunks, or running a zero-bubble
                schedule, keeps the whole-stage gathers.
            reshard_after_forward: stage 3 units: free each unit after its forward (True,
                FSDP's default) or keep it whole to its backward (False: fewer gathers, a
                higher peak); a bool, or {stage id: bool}.
            gather_per: stage 3 units: "microbatch" (each micro-batch's backward frees the
                units it used) or "step" (units stay whole across the micro-batches' backwards
                until the step's last); a string, or {stage id: string}.

        Example:
            self.config.enable_zero(True, stage=2)   # in the Graph's __init__
        """
        self._check_open("enable_zero")
        if not isinstance(enabled, bool):
            raise GraphcError(f"enable_zero expects True or False, found {enabled!r}")
        if stage not in (1, 2, 3) or isinstance(stage, bool):
            raise GraphcError(f"enable_zero: stage must be 1, 2 or 3, found {stage!r}. "
                              "Fix: self.config.enable_zero(True, stage=2).")
        if not isinstance(shard_min_size, int) or isinstance(shard_min_size, bool) or shard_min_size < 1:
            raise GraphcError(f"enable_zero: shard_min_size must be an int >= 1 (elements), found "
                              f"{shard_min_size!r}. Fix: e.g. shard_min_size=1024.")
        if not isinstance(unit_bytes, int) or isinstance(unit_bytes, bool) or unit_bytes < 0:
            raise GraphcError(f"enable_zero: unit_bytes must be an int >= 0 (bytes; 0: the whole "
                              f"stage), found {unit_bytes!r}. Fix: e.g. unit_bytes=2**22.")
        if unit_bytes and stage != 3:
            raise GraphcError(f"enable_zero: unit_bytes gathers stage 3's parameters per unit, but "
                              f"stage={stage}. Fix: enable_zero(True, stage=3, unit_bytes=...).")
        self.zero_stage = stage if enabled else 0
        self.zero_shard_min_size = shard_min_size
        self.zero_unit_bytes = unit_bytes
        self.zero_reshard_after_forward = _per_stage(reshard_after_forward, (True, False),
                                                     "reshard_after_forward")
        self.zero_gather_per_step = tuple(
            (s, v == "step") for s, v in _per_stage(gather_per, ("microbatch", "step"), "gather_per"))

    def set_cuda_graphs(self, enabled: bool = True) -> None:
        """Captures each step's compute in a CUDA graph and replays it (NOTE: CUDA graphs).

        The first call runs uncaptured (warm-up), the second captures the rank's forwards and
        backwards of every stage and micro-batch and replays them; the optimizer step runs
        after, uncaptured. The numbers are the uncaptured step's, bit for bit. A graph that
        cannot be captured is a GraphcError at its first call naming why: placements on the
        CPU, several ranks (transfers and collectives), random ops such as dropout, a
        GradScaler, or training without an optimizer.

        Args:
            enabled: True to capture; False (the default) runs every step uncaptured.

        Example:
            model.to("cuda")
            self.config.set_cuda_graphs(True)
        """
        self._set_switch("set_cuda_graphs", "cuda_graphs", enabled)

    def set_compile_stages(self, enabled: bool = True) -> None:
        """Compiles each stage program's compute with Inductor (NOTE: Compiled stages).

        The plan and its schedule do not change: each forward (and through AOTAutograd its
        backward) runs Inductor's kernels for the runs of plain torch ops between graphc's
        communication, random ops and autocast regions, which run as traced. Pieces compile
        at the first step that needs them (the time is logged and in
        `graph.last_stats.compile_seconds`) and are reused by every later step of the plan;
        Inductor's disk cache serves a later process. The numbers are Inductor's: in float64
        equal to eager to ~1e-15 relative, not bit for bit. ZeRO stage 3 runs uncompiled,
        with a warning.

        Args:
            enabled: True to compile; False (the default) runs the programs as traced.

        Example:
            self.config.set_compile_stages(True)   # in the Graph's __init__
        """
        self._set_switch("set_compile_stages", "compile_stages", enabled)

    def set_memory_stats(self, enabled: bool = True) -> None:
        """Counts the bytes of activations each stage keeps for its backward, per step.

        graph.last_stats.max_live_bytes then holds each local stage's peak over the step
        (every tensor autograd saves, counted once by storage, until its backward frees it;
        a checkpointed micro-batch's kept inputs). Off by default: counting runs a Python hook
        on every saved tensor (~2% of a step); max_live_bytes is then empty. The number of
        live micro-batches (max_live_activations) is counted either way.

        Example:
            self.config.set_memory_stats(True)
            ...; graph(x, y); print(graph.last_stats.max_live_bytes)   # {0: 1048576}
        """
        self._set_switch("set_memory_stats", "memory_stats", enabled)

    def enable_sequence_parallel(self, enabled: bool = True) -> None:
        """Sequence parallelism with tensor parallelism (Megatron's `sequence_parallel`).

        On every stage whose parameters are split over a mesh axis (Megatron's column- and
        row-parallel Linears), the activations between the split matmuls (layer norms,
        dropout, residual adds: values [B, T, ...]) are split along the sequence, dim 1, over
        that axis instead of held whole on each of its n ranks (See NOTE: Sequence parallel
        in graphc/sbp/sequence_parallel.py). The all-reduce after a row-parallel Linear
        becomes a reduce-scatter (partial_sum -> split(1)) and the input of a column-parallel
        Linear an all-gather (split(1) -> broadcast), with the duals in backward: the same
        bytes per layer, and 1/n of those regions' activations per rank. The plan lists each
        REDUCE_SCATTER and ALL_GATHER. Numbers equal the run without it. Parameters read by
        the split regions (layer norms, biases) have their gradients all-reduced over the axis
        after backward, as data parallel's are.

        Args:
            enabled: True to split the tensor-parallel activations along the sequence.

        Example:
            self.config.enable_sequence_parallel(True)   # in the Graph's __init__
        """
        self._set_switch("enable_sequence_parallel", "sequence_parallel", enabled)

    def set_context_parallel(self, method: str = "ring", load_balance: bool = False) -> None:
        """Context parallelism: attention over a sequence split across ranks.

        Inputs laid out split along the sequence (`graphc.to_global(ids_shard, placement=P,
        sbp=sbp.split(1))`) keep every op but attention on its shard of positions;
        scaled_dot_product_attention (and Hugging Face's sdpa attention, which calls it) then
        runs on the split sequence too, never gathering it on a rank (See NOTE: Context
        parallel in graphc/sbp/context_parallel.py). The plan lists every exchange.

        Args:
            method: "ring" (keys and values passed around the ranks, n-1 exchanges per
                attention, an online log-sum-exp merge; backward a ring too) or "all_to_all"
                (Ulysses: sequence shards traded for head shards and back; heads divisible
                by the ranks).
            load_balance: True deals the sequence zig-zag inside the step: cut into 2n
                chunks, rank i computes on chunks i and 2n-1-i, so that under a causal mask
                (is_causal or an explicit one, as Hugging Face's) every rank computes the
                same number of scores. Inputs are still passed as contiguous shards and
                split outputs come back so; each input split along the sequence is redealt
                once (an all_gather). The sequence length must divide by 2n (See NOTE:
                Zig-zag dealing in graphc/sbp/layout.py).

        Example:
            self.config.set_context_parallel(method="ring")   # in the Graph's __init__
        """
        self._check_open("set_context_parallel")
        self.context_parallel = checked_context_parallel(method, load_balance)

    def set_expert_capacity(self, factor: Optional[float]) -> None:
        """Expert parallelism with a capacity factor instead of dropless exchanges.

        Each rank sends every expert exactly C = ceil(factor * pairs / E) rows per micro-batch
        (its token-slot pairs beyond C, in token order, are dropped: their result is zero),
        so every exchange has a fixed shape (no counts exchanged first; CUDA graphs can hold
        it). This differs from eager PyTorch whenever a pair is dropped: its oracle is eager
        with the same drops. Drops are counted (See NOTE: Expert capacity, ops/expert_capacity.py).

        Args:
            factor: > 0; None (the default) is dropless, equal to eager.

        Example:
            self.config.set_expert_capacity(1.25)   # in the Graph's __init__
        """
        self._check_open("set_expert_capacity")
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
            raise GraphcError(f"set_expert_capacity: factor must be a number > 0 or None (dropless), "
                              f"found {factor!r}. Fix: e.g. set_expert_capacity(1.25).")
        self.expert_capacity = None if factor is None else float(factor)

    def set_recv_window(self, n: int) -> None:
        """How many receives per peer the runtime posts ahead of the compute that needs them."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise GraphcError(f"recv window must be an int >= 1, found {n!r}")
        self.recv_window = n

    def run_options(self) -> RunOptions:
        """The settings a rank's runtime, tracer and agreement read, as one value."""
        return RunOptions(type(self._graph).__name__, self.gradient_accumulation_steps,
                          self.pipeline_schedule, self.recv_window, self.trace_path, self.trace_steps,
                          self.cuda_graphs, self.memory_stats, self.compile_stages)


def _per_stage(value, choices, what: str):
    """enable_zero's per-stage option: one value for every stage (stage -1) or {stage: value},
    as ((stage, value), ...)."""
    chosen = value.items() if isinstance(value, dict) else [(-1, value)]
    for stage, v in chosen:
        if v not in choices or isinstance(stage, bool) or not isinstance(stage, int):
            raise GraphcError(f"enable_zero: {what} must be one of {list(choices)} or a dict "
                              f"{{stage id: value}}, found {value!r}. Fix: e.g. {what}={choices[0]!r}.")
    return tuple((s, v) for s, v in chosen)
