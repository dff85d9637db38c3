"""graph.state_dict() as torch.distributed.checkpoint (DCP) saves it, and loading it back.

NOTE: DCP state dict
`graph.state_dict()` returns, on every rank, the same top-level entries:

    {"format": "graphc.state/2",
     "model": {name: tensor or DTensor},      # the parameters and buffers this rank holds
     "optim": {"state": {name: {"exp_avg": ..., "step": ...}},
               "param_groups": [{"lr": ..., "params": [name, ...]}, ...]},
     "optimizer_class": "torch.optim.adam.Adam",
     "lr_scheduler": {...}, "steps": 7,
     "rng": RngStates: {"base_seed": 1234, "rank<r>": torch.get_rng_state()}}

Names are the user's: the keys of `model.state_dict()` when one module assigned to the Graph
holds all the state (else prefixed by the attribute name), as in full_state_dict(). A value
split over ranks is a DTensor with its global shape, so DCP writes each shard at its offset
and reads back whatever part another layout needs; a replicated value is a plain tensor,
which every rank of its stage offers and DCP writes once (its planner keeps one write per
key and offset). The optimizer part follows `get_optimizer_state_dict`: state by parameter
name, laid out like its parameter, and the optimizer's *global* param groups (every name of
each group, not only this rank's), so they are the same on every rank and in every layout.
`base_seed` (runtime/rng.py; NOTE: Replica-equal randomness) is shared, so a resumed run
draws the same dropout masks. Each rank's CPU RNG state: See NOTE: RNG states in checkpoints.

NOTE: RNG states in checkpoints
DCP loads only keys the checkpoint has, so an entry per rank ("rng.rank2") would make a
checkpoint of 2 ranks unloadable on 4. So "rng" is an RngStates: as a dict it is this
rank's part, {"base_seed", "rank<r>": state} (what graphc.save writes, one file per rank);
as DCP's Stateful, which dcp.save and dcp.load ask on every rank alike, it is
{"base_seed", "by_rank": (state of rank 0, state of rank 1, ...)}, gathered from every
rank of the default process group (a tuple: DCP keeps it one entry, "rng.by_rank", whatever
the world). Loading gives rank r the saved state of rank r; a rank the saved run did not
have starts from torch.Generator().manual_seed((base_seed + r) % 2**64)'s state, so a larger
world resumes, and the same way every time.

A fresh optimizer has no state yet, so nothing would tell dcp.load what to read: the
entries are then those its first step creates (taken from a step of a scratch copy on zero
gradients; the optimizer itself is untouched). A checkpoint saved at step 0 thus holds that
scratch state, and loading a step-0 checkpoint leaves the optimizer fresh, as it was.

NOTE: ZeRO state in checkpoints
Under config.enable_zero (See NOTE: ZeRO in runtime/zero.py) the optimizer holds, for each
sharded parameter, a shard parameter of this rank's rows [start, start + rows) of the
parameter's local component, and its state has those rows only. Its entries are still keyed
by the parameter's name and have the parameter's global shape: a DTensor whose local part is
a LocalShardsWrapper with one block, this rank's rows at their global offset (the parameter's
own shard offset plus `start` along dim 0; torch.chunk's rows, as DTensor's Shard(0) cuts).
So a checkpoint of a ZeRO run loads into any layout (DCP reads the rows each rank needs), and
a ZeRO run loads any checkpoint: to_local takes the rows of this rank's component of a whole
tensor or of a loaded DTensor. The parameters themselves are whole on every rank of the group
after the step's all-gather, and saved as the replicated values they are.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from .. import world
from ..errors import GraphcError
from ..placement import Broadcast, Split
from ..plan.instructions import ReduceScatter
from ..sbp.layout import Pieces, chunk_range, mesh_shape, shard_slices

DCP_FORMAT = "graphc.state/2"
ENTRIES = ("format", "model", "optim", "optimizer_class", "lr_scheduler", "steps", "rng",
           "grad_scaler")  # the loss scale and its growth tracker (graphc/amp.py), when set


@dataclass(frozen=True)
class Layout:
    """How a split tensor lies on this rank: its global shape, sbp and the mesh of the stage
    here; pieces (sbp.layout.Pieces) for a tensor stored in pieces (See NOTE: fused pieces); zero_rows=
    (start, rows) for ZeRO's optimizer state, those rows of the local component (See NOTE:
    ZeRO state in checkpoints)."""
    shape: tuple
    sbp: tuple
    mesh: tuple
    device_type: str
    pieces: Optional[Pieces] = None
    zero_rows: Optional[Tuple[int, int]] = None


def user_prefix(root: nn.Module) -> str:
    """The attribute name dropped from every key when a single assigned module holds all the
    state ('model.'), so names are the plain model's; '' otherwise."""
    holders = [name for name, m in root._modules.items() if m.state_dict()]
    return holders[0] + "." if len(holders) == 1 else ""


# -- saving -----------------------------------------------------------------------------
def dcp_state_dict(state, base_seed: int) -> Dict[str, Any]:
    """This rank's part of the checkpoint (See NOTE: DCP state dict). `state` is a GraphState."""
    prefix = user_prefix(state.root)
    layouts = split_layouts(state)
    tensors = state.tensors()   # a parameter stored in bf16 saves its float32 master
    sd: Dict[str, Any] = {"format": DCP_FORMAT, "model": {
        k[len(prefix):]: to_global(tensors[k].detach().clone(), layouts.get(k), state.rank)
        for k in saved_keys(state)}}
    if state.optimizer is not None:
        sd["optim"] = _optimizer_state(state, layouts, prefix)
        sd["optimizer_class"] = class_name(state.optimizer)
    if state.lr_scheduler is not None:
        sd["lr_scheduler"] = copy.deepcopy(state.lr_scheduler.state_dict())
    sd["steps"] = state.steps
    sd["rng"] = RngStates(base_seed, state.rank, torch.get_rng_state())
    return sd


class RngStates(dict):
    """The "rng" entry of graph.state_dict() (See NOTE: RNG states in checkpoints).

    A dict of this rank's part, {"base_seed": s, "rank<r>": state}; to dcp.save and dcp.load
    (DCP's Stateful protocol), every rank's states in one entry.
    """

    def __init__(self, base_seed: int, rank: int, rng_state: torch.Tensor):
        super().__init__({"base_seed": base_seed, f"rank{rank}": rng_state})
        self.rank = rank

    def state_dict(self) -> Dict[str, Any]:
        """Collective over the default process group: dcp.save and dcp.load call it on
        every rank."""
        return {"base_seed": self["base_seed"], "by_rank": _gather(self[f"rank{self.rank}"])}

    def load_state_dict(self, loaded: Mapping) -> None:
        """What dcp.load read: kept here for graph.load_state_dict, which applies it."""
        self.clear()
        self.update(loaded)

    def __reduce__(self):
        # torch.save of a graph.state_dict() pickles it as an OrderedDict, which
        # torch.load(weights_only=True) reads, as it read the plain dict this once was
        return OrderedDict, (list(self.items()),)

    def __deepcopy__(self, memo) -> "RngStates":
        twin = RngStates.__new__(RngStates)
        twin.update(copy.deepcopy(dict(self), memo))
        twin.rank = self.rank
        return twin


def _gather(rng_state: torch.Tensor) -> tuple:
    everyone = world.multi()
    if everyone is None:
        return (rng_state,)
    return tuple(everyone.all_gather_object(rng_state))


def saved_keys(state) -> List[str]:
    """The keys this rank saves and loads: those its stages hold, and those no stage holds
    (parameters build() never uses: every rank keeps them as they are, so the checkpoint
    still has every name of model.state_dict())."""
    return [k for k in state.root.state_dict(keep_vars=True)
            if k in state.local_keys or k not in state.holders]


def split_layouts(state) -> Dict[str, Layout]:
    """Layout of every split tensor this rank holds a shard of (the mesh of a stage here:
    a tied copy is sharded over the mesh of the stage that holds it on this rank)."""
    local = set(state.compiled.plan_for(state.rank).local_stages)
    out = {}
    for k, (shape, sbp, _) in getattr(state, "shards", {}).items():
        if k not in state.local_keys:
            continue
        stage = next(s for s in state.holders[k] if s in local)
        out[k] = Layout(tuple(shape), tuple(sbp), state.compiled.meshes[stage],
                        state.compiled.stages[stage].device_type, state.pieces.get(k))
    return out


def zero_layouts(state, layouts: Dict[str, Layout]) -> Dict[int, Tuple[str, Layout]]:
    """id(shard parameter) -> (its parameter's key, the layout of its optimizer state), for
    every parameter ZeRO shards on this rank (See NOTE: ZeRO state in checkpoints)."""
    made = getattr(state.optimizer, "_graphc_zero_shards", None)   # runtime/zero.py
    if not made:
        return {}
    names = first_names(state.root)
    local = set(state.compiled.plan_for(state.rank).local_stages)
    params: Dict[str, nn.Parameter] = {}
    for prog in state.compiled.programs:
        if prog.stage in local:
            for name, p in prog.module.named_parameters(remove_duplicate=False):
                params.setdefault(name, p)
    out = {}
    for ins in state.compiled.plan_for(state.rank).instructions:
        if not isinstance(ins, ReduceScatter):
            continue
        ranks = sorted(ins.ranks)
        for spec in ins.tensors:
            p = params[spec.name]
            key = names[id(p)]
            start, rows = chunk_range(p.shape[0], len(ranks), ranks.index(state.rank))
            layout = layouts.get(key) or _whole_layout(state, key, p)
            if layout.pieces:
                raise GraphcError(
                    f"graph.state_dict(): '{key}' is stored in pieces (a fused projection split "
                    "by heads) and sharded by config.enable_zero; the optimizer state of such a "
                    "parameter cannot be checkpointed yet. Fix: raise enable_zero's "
                    "shard_min_size above its size, or save with graphc.save.")
            out[id(made[id(p)])] = (key, replace(layout, zero_rows=(start, rows)))
    return out


def _whole_layout(state, key: str, p: torch.Tensor) -> Layout:
    """The layout of a parameter whole on every rank of the stage that holds it here."""
    local = set(state.compiled.plan_for(state.rank).local_stages)
    stage = next(s for s in state.holders[key] if s in local)
    mesh = state.compiled.meshes[stage]
    return Layout(tuple(p.shape), (Broadcast(),) * len(mesh_shape(mesh)), mesh,
                  state.compiled.stages[stage].device_type)


def to_global(local: torch.Tensor, layout: Optional[Layout], rank: int):
    """A DTensor of `layout`'s global shape whose local part is `local`; `local` itself when
    it is whole (not split, or split over one rank)."""
    if layout is None or (tuple(local.shape) == layout.shape and not layout.zero_rows):
        return local
    # imported here: DTensor and DCP load slowly and only checkpoints need them
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    placements = []
    for s in layout.sbp:
        if not isinstance(s, (Split, Broadcast)):
            raise GraphcError(f"a parameter or buffer laid out as {layout.sbp} on {layout.mesh} "
                              f"cannot be checkpointed: {s} is not a layout of stored state. Fix: "
                              "declare parameters and buffers split or broadcast.")
        placements.append(Shard(s.dim) if isinstance(s, Split) else Replicate())
    # the mesh only describes where shards lie (DCP reads coordinates and sizes from it), so
    # it creates no process groups: state_dict() stays local, as DCP expects
    mesh = DeviceMesh(layout.device_type, torch.tensor(layout.mesh), _init_backend=False)
    if layout.pieces:
        local = _pieces_wrapper(local, layout, rank)
    elif layout.zero_rows:
        local = _zero_rows_wrapper(local, layout, rank)
    stride = torch.empty(layout.shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(layout.shape),
                              stride=stride)


def _pieces_wrapper(local: torch.Tensor, layout: Layout, rank: int):
    """A tensor stored in pieces (See NOTE: fused pieces) is no single block of the global
    one: this rank holds one block per piece. torch's LocalShardsWrapper (the local part
    DCP accepts with several blocks, each at its global offset) carries them."""
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
    pieces = layout.pieces
    blocks = local.split(pieces.local_sizes(layout.shape, layout.sbp, layout.mesh, rank), pieces.dim)
    offsets, at = [], 0
    for size in pieces.sizes:
        piece = [size if d == pieces.dim else n for d, n in enumerate(layout.shape)]
        start = [s.start for s in shard_slices(piece, layout.sbp, layout.mesh, rank)]
        start[pieces.dim] += at
        offsets.append(tuple(start))
        at += size
    return LocalShardsWrapper(list(blocks), offsets)


def _zero_rows_wrapper(local: torch.Tensor, layout: Layout, rank: int):
    """ZeRO's rows of this rank's component are one block of the global tensor, at the
    component's offset moved down by their start (See NOTE: ZeRO state in checkpoints)."""
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
    start = [s.start for s in shard_slices(layout.shape, layout.sbp, layout.mesh, rank)]
    start[0] += layout.zero_rows[0]
    return LocalShardsWrapper([local], [tuple(start)])


def _optimizer_state(state, layouts: Dict[str, Layout], prefix: str) -> Dict[str, Any]:
    opt = state.optimizer
    names = param_names(state)
    zero = zero_layouts(state, layouts)
    params = [p for group in opt.param_groups for p in group["params"]]
    by_index = copy.deepcopy(opt.state_dict()["state"]) or first_step_state(opt)
    entries = {}
    for i, values in by_index.items():
        key, layout = _key_and_layout(params[i], names, layouts, zero)
        entries[key[len(prefix):]] = {
            name: _state_value(v, layout, params[i], key, name, state.rank) for name, v in values.items()}
    groups = []
    for group, members in zip(opt.param_groups, state.group_params):
        hyper = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
        groups.append({**hyper, "params": [names[id(p)][len(prefix):] for p in members]})
    return {"state": entries, "param_groups": groups}


def _key_and_layout(p, names: Dict[int, str], layouts: Dict[str, Layout],
                    zero: Dict[int, Tuple[str, Layout]]) -> Tuple[str, Optional[Layout]]:
    """The name an optimizer parameter's state is saved under, and that state's layout: a ZeRO
    shard's are its parameter's name and its rows (See NOTE: ZeRO state in checkpoints)."""
    if id(p) in zero:
        return zero[id(p)]
    return names[id(p)], layouts.get(names[id(p)])


def _state_value(v, layout: Optional[Layout], param: torch.Tensor, key: str, name: str, rank: int):
    """An optimizer state value laid out like its parameter (exp_avg, momentum_buffer);
    a scalar (Adam's step) is the same on every shard."""
    if not isinstance(v, torch.Tensor) or layout is None or v.dim() == 0:
        return v
    if v.shape != param.shape:
        raise GraphcError(
            f"rank {rank}: the optimizer's state '{name}' of '{key}' has shape {list(v.shape)}, "
            f"neither a scalar nor its parameter's local shape {list(param.shape)}, and the "
            f"parameter is split over {layout.mesh}; such state cannot be resharded. Fix: use an "
            "optimizer whose state is per element (SGD, Adam, AdamW, ...), or save with "
            "graphc.save, which keeps each rank's state as it is.")
    return to_global(v, layout, rank)


def first_step_state(opt: torch.optim.Optimizer) -> Dict[int, dict]:
    """The state `opt`'s first step creates, by parameter index, from a copy of `opt` on
    scratch parameters with zero gradients (See NOTE: DCP state dict)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    scratch = {id(p): torch.zeros_like(p, requires_grad=p.requires_grad) for p in params}
    twin = copy.deepcopy(opt, memo=dict(scratch))
    for p in scratch.values():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    type(opt).step(twin)  # the class's step: an LR scheduler wraps the instance's (and counts it)
    return twin.state_dict()["state"]


def first_names(root: nn.Module) -> Dict[int, str]:
    """id(tensor) -> its first name in root.state_dict() (a tied one has several)."""
    out: Dict[int, str] = {}
    for k, t in root.state_dict(keep_vars=True).items():
        out.setdefault(id(t), k)
    return out


def param_names(state) -> Dict[int, str]:
    """first_names of the graph's tensors, and of the float32 masters the optimizer holds in
    their place (NOTE: Master parameters in runtime/master_params.py)."""
    names = first_names(state.root)
    for k, t in state.tensors().items():
        names.setdefault(id(t), k)
    return names


def class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
