"""ZeRO at run time: the optimizer steps on this rank's rows of each sharded parameter.

NOTE: ZeRO
config.enable_zero(True, stage=1|2, shard_min_size) shards data parallelism's replicated
model state over the data-parallel axis (ZeRO, DeepSpeed; OneFlow's enable_zero):
- which parameters: those whose gradient is partial_sum on one or more mesh axes (a
  broadcast parameter read by ops split over the batch, or over the batch and the sequence),
  held by one stage (a tied one is summed over its stages afterwards, so it stays whole),
  whose local component has a dim 0 and at least shard_min_size elements
  (passes/insert_zero_sync.py). Each is split(0) over the joint group of those axes (See
  NOTE: ZeRO over joint axes), torch.chunk's sizes (sbp/layout.py chunk_range): rank k of
  d holds rows [k*c, min((k+1)*c, n)) with c = ceil(n/d), maybe none;
- the optimizer holds, for each, a shard parameter: a view of this rank's rows of the
  parameter (its state is created for those rows alone, 1/d of the replicated run's);
- gradients are reduce-scattered (REDUCE_SCATTER), once per step, as soon as the last
  micro-batch's backward made a bucket final (GradSync's hooks): a bucket is packed rank by
  rank, each tensor's part padded to c rows so the parts are equal (gloo and NCCL need it),
  and each rank receives the sum of its rows, which become its shard parameters' .grad.
  The full gradient is dropped once packed. Stage 1 keeps the packed buckets between steps
  (DDP keeps its buckets too), writes each rank's sum into its own row of its bucket and
  makes the shards' gradients views of that row (Megatron's layout: no gradient buffer of
  their own); stage 2 frees them after the reduce-scatter;
- the optimizer steps on the shards, which writes this rank's rows of the parameters;
  ALL_GATHER after OPTIMIZER_STEP brings every rank's rows to every rank.
At stages 2 and 3 on a gloo group both run rank by rank on views, without a packed bucket
(See NOTE: ZeRO rows in place, zero_rows.py).
A reduce-scatter and an all-gather send what one all-reduce sends ((d-1)/d of the bucket
each, in a ring), so the bytes per step equal data parallel's. Gradient clipping counts each
shard's gradient on its own rank (insert_grad_clip) and scales the shards'.

NOTE: ZeRO over joint axes
A gradient partial over several mesh axes is summed over all of them; ZeRO reduce-scatters it
once over their joint group (the ranks that differ only along those axes, sbp/layout.py
joint_groups; torchtitan's FSDP over the flattened dp_shard x cp mesh) and all-gathers its
rows over that group, so each of the d = d_1 x d_2 ranks steps 1/d of it and holds 1/d of its
optimizer state; before, it stayed whole and was all-reduced axis by axis. Per step a rank
sends 2 (d-1)/d of the gradient (a reduce-scatter and an all-gather), where the per-axis
all-reduces sent 2 (d_1-1)/d_1 + 2 (d_2-1)/d_2 (dp2 x cp2: 1.5x against 2x). The sum runs in
another order than the per-axis one (a 4-rank reduce against two 2-rank ones): equal at
float64's 1e-10, not bit for bit. Which cases take it, one path for all:
- data x context parallel (rows over one axis, the sequence over the other, set_context_parallel):
  every parameter, over the whole 2-D mesh;
- data x expert parallel (a 2-D mesh whose batch is split over both axes, the experts
  split(0) over one): the non-expert parameters over the whole mesh, the experts over the
  data axis alone (their gradient is partial there only);
- a gradient partial on one axis (plain data parallel, data x tensor parallel): that axis's
  group, as before.
Stage 3 gathers before use over the same group (whole stage or unit by unit), and the
verifier refuses a plan that reduces a sharded gradient over anything but its one group
(plan/verify_zero.py). What stays whole: parameters below shard_min_size and tied ones.

NOTE: ZeRO step overlap
An all-gather after one optimizer.step() would have nothing to run beside it. So under ZeRO
OPTIMIZER_STEP steps the optimizer once per ALL_GATHER bucket (ZeroShards.step): the bucket's
shard parameters show their gradients, every other parameter none (torch's optimizers skip a
parameter without a gradient, as one unused in a step), and the bucket's gather is launched
(asynchronous on gloo and NCCL) before the next bucket steps; the replicated parameters step
last. Each ALL_GATHER instruction waits for its bucket and unpacks it, so the parameters are
whole when the call returns, as before. Every parameter steps once on its own gradient, so an
optimizer whose update is per parameter (SGD, Adam, AdamW, ...: what ZeRO's row shards already
need) gives the numbers of one step; step hooks run once per bucket, and an LR scheduler
still steps once per call.

NOTE: ZeRO stage 3
At stage 3 the parameters are sharded between uses too. Each shard parameter owns its rows
(a copy, not a view), and the whole parameter's storage is freed (resized to 0 bytes: the
tensor, its shape, and every reference to it, in the stage program and in autograd's saved
tensors, stay valid) by a RELEASE after the computes that read it. An ALL_GATHER before those
computes gives the storage back and fills it with every rank's rows; it is launched
asynchronously before the compute that precedes it on this rank (prefetch), so the gather
runs while that compute does. The optimizer steps on the shards, and no ALL_GATHER follows
the step: the next step's first use gathers. When (insert_zero_sync): a rank holding one
stage gathers it once per step, before its first compute, and releases it after its last;
a rank holding several chunks gathers and releases around each compute, so one chunk at a
time is whole. Between steps a rank holds 1/d of the parameters (torch.chunk's rows).
Anything else that reads the parameters collectively (graph.state_dict(),
load_state_dict(), full_state_dict(), a plan with no gathers of them, e.g. a forward-only
graph sharing the model) reads them inside whole_parameters(): gathered, then released
again, any rows written kept in the shards. A parameter whose storage holds anything else
(a view into another tensor) cannot be freed alone and is refused.

NOTE: ZeRO with master parameters
With config.set_param_dtype (NOTE: Master parameters, master_params.py) at stages 1 and 2,
ZeRO shards the float32 masters, Megatron's distributed-optimizer layout: per rank a bf16
parameter (2 B) and the whole float32 gradient (4 B: the master's .grad that the parameter's
post-accumulate hook fills), and only this rank's rows of the master and of Adam's state.
- the shard parameter the optimizer steps owns a copy of this rank's rows of the master
  (not a view); the whole master's storage is then freed (resized to 0 bytes: its shape
  stays, so the hook can still set its whole .grad), and MasterParams.copy_back leaves its
  parameter alone (hold_rows);
- the REDUCE_SCATTER packs the masters' float32 gradients (set_grad_reduce_dtype's dtype
  when given), as the replicated run's ALL_REDUCE would sum them;
- the ALL_GATHER after the step packs this rank's stepped rows rounded to the parameter's
  dtype (as copy_back rounds) and unpacks them into the bf16 parameters: the plan's
  ALL_GATHER says bf16, half the bytes of float32;
- whatever reads the masters whole (graph.state_dict(), load_state_dict(),
  full_state_dict(): GraphState.tensors() hands out the masters) runs inside
  whole_parameters(), which gathers every rank's float32 rows into the master for the
  block, then keeps this rank's rows in the shard, rounds the master into the parameter and
  frees it again. The optimizer's state is saved as row shards (NOTE: ZeRO state in
  checkpoints, checkpoint/dcp.py).
At stage 3 the bf16 parameters are freed between uses as well, beside the master rows:
every ALL_GATHER before a use (whole stage or unit) moves this rank's float32 rows rounded to
the parameter's dtype (what copy_back rounds them to) into the bf16 parameter, so the plan's
gathers say bf16, half the bytes of float32; the gradients reach the
masters' float32 .grad through the hook and are reduce-scattered in float32 (or
set_grad_reduce_dtype's dtype); no gather follows the step. whole_parameters() keeps a
master's rows from the gathered master, never from the parameter's rounding. Same ops in the
same order as the replicated set_param_dtype run: equal to it bit for bit at 2 ranks
(tests/zero/test_zero3_param_dtype.py).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import GraphcError
from ..plan.instructions import COMPUTE_RUNS, AllGather, OptimizerStep, ReduceScatter, ReleaseParams
from ..plan.plan import ZERO_NOTE
from ..sbp.layout import chunk_range
from .zero_packed import in_place, launch_into, launch_rows, reduce_scatter
from .zero_rows import ReducedRows, in_place_group, launch_broadcast_rows, row_grad
from .zero_shard import Shard
from .zero_whole import any_held, held, hold_seen, released_in, whole_parameters

# what other modules import from here: ZeroShards and prefetches, and the names that lived here
# before a shard (zero_shard.py) and the whole-parameter block (zero_whole.py) had files of their own
__all__ = ["Shard", "ZeroShards", "any_held", "released_in", "whole_parameters", "prefetches"]


class ZeroShards:
    """This rank's shards of its ZeRO parameters, by name, and the collectives on them."""

    def __init__(self, rank: int, stage: int, shards: Dict[str, Shard], after_step: List[AllGather]):
        self.rank, self.stage, self.by_name = rank, stage, shards
        self.after_step = after_step                  # the ALL_GATHERs after the step (stages 1, 2)
        self.gathering: Dict[AllGather, tuple] = {}   # launched: (work, packed, this rank's rows)
        self.max_whole_bytes = 0   # stage 3: the most bytes of whole parameters held at once

    @staticmethod
    def from_plan(plan, programs, optimizer, masters=None) -> Optional["ZeroShards"]:
        """The shards the plan's REDUCE_SCATTERs name (None: no ZeRO here); the optimizer is
        made to hold them instead of the whole parameters (or their float32 masters:
        `masters`, set_param_dtype's MasterParams; See NOTE: ZeRO with master parameters)."""
        scatters = [ins for ins in plan.instructions if isinstance(ins, ReduceScatter)]
        if not scatters:
            return None
        if optimizer is None:
            raise GraphcError(
                "config.enable_zero shards the optimizer's state, but this graph has no optimizer. "
                "Fix: call self.add_optimizer(...) in the Graph's __init__, or drop enable_zero.")
        params: Dict[str, torch.nn.Parameter] = {}
        for prog in programs:
            for name, p in prog.module.named_parameters(remove_duplicate=False):
                params.setdefault(name, p)
        made = _made_shards(optimizer)
        stage = int(plan.notes.get(ZERO_NOTE, "stage 2").split()[1].rstrip(";"))
        shards: Dict[str, Shard] = {}
        for ins in scatters:
            ranks = tuple(sorted(ins.ranks))
            k = ranks.index(plan.rank)
            for spec in ins.tensors:
                p = params[spec.name]
                master = masters.master_of(p) if masters is not None else p
                master = None if master is p else master
                n = p.shape[0]
                start, rows = chunk_range(n, len(ranks), k)
                shard = made.get(id(p))
                if shard is None:
                    shard = made[id(p)] = _shard_parameter(spec.name, p, master, start, rows, stage)
                s = Shard(spec.name, p, ranks, start, rows, -(-n // len(ranks)), shard,
                          owns=stage == 3, master=master)
                shards[spec.name] = s
                if stage == 3 and held(p) is None:
                    p._graphc_zero3 = s
                    hold_seen()
                if master is not None:
                    masters.hold_rows(master)
                    p._graphc_zero_master = s
        step = next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, OptimizerStep))
        zero = ZeroShards(plan.rank, stage, shards,
                          [ins for ins in plan.instructions[step:] if isinstance(ins, AllGather)])
        zero.hold_shards(optimizer)
        return zero

    def hold_shards(self, optimizer) -> None:
        """The optimizer's groups hold each sharded parameter's shard instead of it; state it
        already has for the whole parameter (a checkpoint loaded before the first call) is
        cut to this rank's rows."""
        by_param = {id(s.master if s.master is not None else s.param): s for s in self.by_name.values()}
        for group in optimizer.param_groups:
            held = []
            for p in group["params"]:
                s = by_param.get(id(p))
                if s is None:
                    held.append(p)
                    continue
                s.refresh()
                state = optimizer.state.pop(p, None)
                if state:
                    optimizer.state[s.shard] = {
                        k: v[s.start:s.start + s.rows].clone()
                        if torch.is_tensor(v) and v.dim() and v.shape == p.shape else v
                        for k, v in state.items()}
                held.append(s.shard)
            group["params"] = held

    def refresh(self) -> None:
        for s in self.by_name.values():
            s.refresh()

    # -- the collectives -----------------------------------------------------------------
    def scatter(self, ins: ReduceScatter, params: List[torch.nn.Parameter],
                keep: Optional[torch.Tensor], started: Optional[ReducedRows] = None
                ) -> Tuple[object, torch.Tensor, torch.Tensor]:
        """Launches the reduce-scatter of a bucket (async where the world can): returns (work,
        this rank's summed part, the packed bucket, reusable by stage 1). `started`: the
        bucket's reduces rank by rank, its first parameters launched already (NOTE: ZeRO rows
        as gradients are final)."""
        shards = [self.by_name[t.name] for t in ins.tensors]
        d = len(shards[0].ranks)
        width = sum(s.part_numel for s in shards)
        first = next((p.grad for p in params if p.grad is not None), params[0])
        dtype = getattr(torch, ins.tensors[0].dtype)   # summed in (NOTE: Gradient reduce dtype)
        if self.reduces_rows(ins, params):   # rank by rank on the gradients (NOTE: ZeRO rows in place)
            rows = started if started is not None else self.start_rows(ins, params)
            for p in params[rows.launched:]:
                rows.launch_next(row_grad(p))
            return rows, rows.out, None
        if keep is None and in_place(shards, params[0].grad, dtype):
            # one tensor, even rows: its gradient is the packed bucket already (no copy)
            packed = params[0].grad.view(d, width)
            params[0].grad = None
            out = torch.empty(width, dtype=packed.dtype, device=packed.device)
            # stage 3 reduces inside the backward, where scratch is the peak: the lean form
            return reduce_scatter(out, packed, shards[0].ranks, flat=self.stage != 3), out, packed
        packed = keep
        if packed is None or packed.shape != (d, width) or packed.dtype != dtype \
                or packed.device != first.device:
            packed = torch.empty((d, width), dtype=dtype, device=first.device)
        at = 0
        for s, p in zip(shards, params):
            part = packed[:, at:at + s.part_numel]
            if p.grad is None:           # unused this step: a zero addend
                part.zero_()
            else:
                s.pack(p.grad, part)
                p.grad = None            # ZeRO keeps the gradient only as this rank's rows
            at += s.part_numel
        out = torch.empty(width, dtype=packed.dtype, device=packed.device)
        work = reduce_scatter(out, packed, shards[0].ranks)
        return work, out, packed

    def _rows_in_place(self, shards: List[Shard]) -> bool:
        """Stages 2 and 3 on a gloo group: the bucket's collectives run rank by rank on views
        (See NOTE: ZeRO rows in place in zero_rows.py)."""
        return self.stage in (2, 3) and in_place_group(shards[0].ranks)

    def reduces_rows(self, ins: ReduceScatter, params: List[torch.nn.Parameter]) -> bool:
        """Whether the bucket is reduced rank by rank in its gradients: a gloo group at stages
        2 and 3, gradients summed in their own dtype (the plan's choice, every rank's)."""
        dtype = getattr(torch, ins.tensors[0].dtype)
        return self._rows_in_place([self.by_name[ins.tensors[0].name]]) \
            and all(p.dtype == dtype for p in params)

    def start_rows(self, ins: ReduceScatter, params: List[torch.nn.Parameter]) -> ReducedRows:
        """The bucket's reduces rank by rank, none launched yet (reduces_rows)."""
        shards = [self.by_name[t.name] for t in ins.tensors]
        out = torch.empty(sum(s.part_numel for s in shards), dtype=params[0].dtype, device=params[0].device)
        return ReducedRows(shards, out)

    def take_grads(self, ins: ReduceScatter, out: torch.Tensor) -> None:
        """This rank's summed rows (`out`) become the shard parameters' gradients (views)."""
        at = 0
        for t in ins.tensors:
            s = self.by_name[t.name]
            g = out[at:at + s.rows * s.row_numel].view((s.rows,) + tuple(s.param.shape[1:]))
            g = g.to(s.shard.dtype)      # the sum back in the gradient's dtype, if reduced in another
            s.shard.grad = g if s.shard.grad is None else s.shard.grad + g
            at += s.part_numel

    def step(self, optimizer, gathers: List[AllGather]) -> None:
        """optimizer.step(), bucket by bucket: each ALL_GATHER's shards step, then its gather is
        launched (asynchronous where the world can), so it runs while the next bucket's shards
        step; the parameters no gather names (replicated ones) step last. Every parameter steps
        once, on its own gradient, as in one step (See NOTE: ZeRO step overlap)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        rest = set(range(len(params)))
        try:
            for ins in gathers:
                mine = {id(self.by_name[t.name].shard) for t in ins.tensors}
                now = {i for i, p in enumerate(params) if id(p) in mine}
                _step_on(optimizer, params, grads, now)
                rest -= now
                self.launch_gather(ins)
            _step_on(optimizer, params, grads, rest)
        finally:
            for p, g in zip(params, grads):
                p.grad = g

    def step_reduced(self, optimizer, ins: ReduceScatter) -> None:
        """The bucket's shards step now, on their reduced gradients, which are then dropped
        (gathered per unit, without clipping or loss scaling: See NOTE: ZeRO units); the
        step's OPTIMIZER_STEP skips them (no gradient)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        mine = {id(self.by_name[t.name].shard) for t in ins.tensors}
        now = {i for i, p in enumerate(params) if id(p) in mine}
        try:
            _step_on(optimizer, params, grads, now)
        finally:
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if i in now else g

    def launch_gather(self, ins: AllGather) -> None:
        """Starts gathering every rank's rows of the bucket's parameters (after the optimizer
        stepped on them); gather() waits for it."""
        shards = [self.by_name[t.name] for t in ins.tensors]
        ref = shards[0].param
        if self._rows_in_place(shards):   # straight into the parameters (NOTE: ZeRO rows in place)
            self.gathering[ins] = launch_broadcast_rows(shards), None, None
            return
        if self.stage == 3 and all(in_place([s], s.param, s.param.dtype) for s in shards):
            self.gathering[ins] = launch_into(shards)
            return
        self.gathering[ins] = launch_rows(shards, ref.dtype, ref.device)

    def gather(self, ins: AllGather) -> None:
        """Waits for the bucket's all-gather (launching it first if step() or a prefetch did
        not: a skipped step under loss scaling) and writes every rank's rows into the
        parameters (at stage 3 into their storage, given back first)."""
        if ins not in self.gathering:
            self.launch_gather(ins)
        work, packed, _ = self.gathering.pop(ins)
        if isinstance(work, list):   # gathered into the parameters themselves (launch_into, rows)
            for w in work:
                if w is not None:
                    w.wait()
            self._note_whole()
            return
        if work is not None:
            work.wait()
        at = 0
        for s in (self.by_name[t.name] for t in ins.tensors):
            s.materialize()
            s.unpack(packed[:, at:at + s.part_numel])
            at += s.part_numel
        self._note_whole()

    def _note_whole(self) -> None:
        if self.stage == 3:
            self.max_whole_bytes = max(self.max_whole_bytes, self.whole_bytes())

    def whole_bytes(self) -> int:
        """Stage 3: the bytes of the whole parameters held now (gathered, not yet released)."""
        whole = {id(s.param): s.param for s in self.by_name.values() if s.owns and not s.released}
        return sum(p.numel() * p.element_size() for p in whole.values())

    def release(self, ins: ReleaseParams) -> None:
        """Stage 3: the whole copies of the named parameters freed (See NOTE: ZeRO stage 3)."""
        for t in ins.tensors:
            self.by_name[t.name].release()


def _shard_parameter(name: str, p: torch.nn.Parameter, master: Optional[torch.nn.Parameter],
                     start: int, rows: int, stage: int) -> torch.nn.Parameter:
    """The parameter the optimizer steps for `p`: a view of its rows (stages 1, 2), a copy of
    them (stage 3), or a copy of its float32 master's rows, whose whole storage is then freed
    (See NOTE: ZeRO with master parameters)."""
    if stage == 3:
        _own_storage(name, p)
    if master is not None:
        _own_storage(name, master)
        shard = torch.nn.Parameter(master.data[start:start + rows].clone(), requires_grad=master.requires_grad)
        master.data.untyped_storage().resize_(0)
        return shard
    rows_now = p.data[start:start + rows]
    return torch.nn.Parameter(rows_now.clone() if stage == 3 else rows_now, requires_grad=p.requires_grad)


def _own_storage(name: str, p: torch.nn.Parameter) -> None:
    """Stage 3 frees a parameter's storage: it must hold that parameter alone, and be one
    that can be resized (a storage torch did not allocate, e.g. one a collective or another
    process wrote, cannot: the parameter gets a copy, before any compute refers to it)."""
    storage = p.data.untyped_storage()
    if not storage.resizable() and storage.nbytes() == p.numel() * p.element_size():
        p.data = p.data.clone()
        storage = p.data.untyped_storage()
    if p.data.storage_offset() != 0 or not p.data.is_contiguous() \
            or storage.nbytes() != p.numel() * p.element_size():
        raise GraphcError(
            f"config.enable_zero(stage=3): the parameter '{name}' is a view into a larger tensor "
            f"({storage.nbytes()} bytes of storage for its {p.numel() * p.element_size()}), so "
            "its whole copy cannot be freed between uses. Fix: make it a parameter of its own "
            "(e.g. nn.Parameter(t.clone())), or use stage=2.")


def _step_on(optimizer, params: List[torch.nn.Parameter], grads: list, which) -> None:
    """optimizer.step() on params[i] for i in `which`: every other one shows no gradient, which
    torch's optimizers skip (as a parameter unused in a step)."""
    if not any(grads[i] is not None for i in which):
        return
    for i, p in enumerate(params):
        p.grad = grads[i] if i in which else None
    optimizer.step()


def _made_shards(optimizer) -> Dict[int, torch.nn.Parameter]:
    """id(parameter) -> its shard parameter, kept on the optimizer: every executable of a graph
    (one per input signature) steps the same shards, so their state is one."""
    made = getattr(optimizer, "_graphc_zero_shards", None)
    if made is None:
        made = {}
        optimizer._graphc_zero_shards = made
    return made


def prefetches(instructions) -> Dict[int, List[AllGather]]:
    """Position -> the ZeRO stage-3 ALL_GATHERs to launch just before the instruction there:
    each before the compute that precedes it (the step's first: at the step's start, beside
    the receives it waits for), unless a RELEASE of its parameters lies between (then where it
    stands). See NOTE: ZeRO stage 3 in zero.py."""
    out: Dict[int, List[AllGather]] = defaultdict(list)
    last_compute, released_since = 0, set()
    for i, ins in enumerate(instructions):   # by run entry: a unit event runs inside its compute
        if ins.runs in COMPUTE_RUNS:
            last_compute, released_since = i, set()
        elif ins.runs == ReleaseParams.runs:
            released_since |= {t.name for t in ins.tensors}
        elif ins.runs == AllGather.runs and not released_since & {t.name for t in ins.tensors}:
            out[last_compute].append(ins)
        elif ins.runs == OptimizerStep.runs:
            break
    return dict(out)
