"""graph.config's options that lay the step over more ranks: a searched or loaded layout, ZeRO,
sequence and context parallelism, expert capacity."""
from __future__ import annotations

from typing import Optional

from ..errors import GraphcError
from ..sbp.context_parallel import checked as checked_context_parallel
from .options import Options, is_count


class ParallelOptions(Options):
    """`graph.config`'s parallelism options (a base of GraphConfig)."""

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
        from ..auto.layout import Layout
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
        from ..auto.layout import AutoRequest
        self._check_open("enable_auto_parallel")
        if not isinstance(enabled, bool):
            raise GraphcError(f"enable_auto_parallel expects True or False, found {enabled!r}")
        if not isinstance(top, int) or top < 1:
            raise GraphcError(f"enable_auto_parallel: top must be a positive int, found {top!r}")
        if memory is not None and not (isinstance(memory, (int, float)) and memory > 0):
            raise GraphcError(f"enable_auto_parallel: memory is GiB per rank, a positive number; found {memory!r}")
        self.auto = AutoRequest(device, None if memory is None else float(memory), top, cache) if enabled else None

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
        if not is_count(shard_min_size):
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


def _per_stage(value, choices, what: str):
    """enable_zero's per-stage option: one value for every stage (stage -1) or {stage: value},
    as ((stage, value), ...)."""
    chosen = value.items() if isinstance(value, dict) else [(-1, value)]
    for stage, v in chosen:
        if v not in choices or isinstance(stage, bool) or not isinstance(stage, int):
            raise GraphcError(f"enable_zero: {what} must be one of {list(choices)} or a dict "
                              f"{{stage id: value}}, found {value!r}. Fix: e.g. {what}={choices[0]!r}.")
    return tuple((s, v) for s, v in chosen)
