"""`graph.config`: options of the whole graph, set by the user in Graph.__init__; the
parallelism and precision options are its bases' (parallel_options.py, precision_options.py)."""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import GraphcError
from ..plan.plan import CHECKPOINT_MODES, DEFAULT_BUCKET_BYTES
from ..runtime.options import RunOptions
from .options import is_count
from .parallel_options import ParallelOptions
from .precision_options import PrecisionOptions


class GraphConfig(ParallelOptions, PrecisionOptions):
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

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Splits each batch into `steps` micro-batches; the optimizer steps once per call."""
        self._check_open("set_gradient_accumulation_steps")
        if not is_count(steps):
            raise GraphcError(f"gradient accumulation steps must be an int >= 1, found {steps!r}")
        self.gradient_accumulation_steps = steps

    def set_pipeline_schedule(self, name: str) -> None:
        """The order each pipeline rank runs its forwards and backwards in: "1f1b" (default)
        or "gpipe" with one stage per rank; "interleaved_1f1b", "looped_bfs", "zero_bubble"
        with stage s on the ranks of stage s mod p; "zbv", "dualpipev" with stages s and
        2p-1-s on one rank. See docs/schedules.md."""
        from ..plan.schedules import SCHEDULES
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
        if not is_count(steps):
            raise GraphcError(f"set_trace: steps must be an int >= 1, found {steps!r}")
        self.trace_path, self.trace_steps = path, steps

    def set_gradient_bucket_size(self, nbytes: int) -> None:
        """Gradients of data-parallel parameters are all-reduced in buckets of about `nbytes`."""
        self._check_open("set_gradient_bucket_size")
        if not is_count(nbytes):
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

    def set_recv_window(self, n: int) -> None:
        """How many receives per peer the runtime posts ahead of the compute that needs them."""
        if not is_count(n):
            raise GraphcError(f"recv window must be an int >= 1, found {n!r}")
        self.recv_window = n

    def run_options(self) -> RunOptions:
        """The settings a rank's runtime, tracer and agreement read, as one value."""
        return RunOptions(type(self._graph).__name__, self.gradient_accumulation_steps,
                          self.pipeline_schedule, self.recv_window, self.trace_path, self.trace_steps,
                          self.cuda_graphs, self.memory_stats, self.compile_stages)
