"""GraphState: which rank owns which parameters, the optimizer's view of them, checkpoints."""
from __future__ import annotations

from contextlib import contextmanager
import os
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from .. import world
from .dcp import DCP_FORMAT, class_name
from .dcp_load import load_dcp_state_dict, load_into
from ..errors import GraphcError
from ..global_tensor import declared_layout
from ..sbp.declared import declared_in
from ..placement import Split
from ..runtime.agreement import check_agreement, fingerprint_tensor, step_facts
from ..runtime.dist_env import timeout_seconds
from ..runtime.master_params import MasterParams
from ..runtime.zero_access import hold_elsewhere, release_elsewhere
from ..meta import META_PIECES
from ..sbp.layout import coord, flat, local_component, place_shard

STATE_FORMAT = "graphc.state/1"  # graphc.save files of older graphc: per rank, by index
# the entries of such a checkpoint; optimizer_class is absent from still older ones
_KEYS = ("format", "rank", "steps", "model", "optimizer", "optimizer_class", "lr_scheduler", "rng")


class GraphState:
    def __init__(self, root: nn.Module, compiled, rank: int, optimizer, lr_scheduler, param_dtype=None):
        self.root, self.compiled, self.rank = root, compiled, rank
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.param_dtype = param_dtype            # set_param_dtype's (NOTE: Master parameters)
        self.masters: Optional[MasterParams] = None
        self.steps = 0
        self.base_seed = None                     # a loaded checkpoint's (See NOTE: DCP state dict)
        self.holders = self._holders(compiled)    # state-dict key -> stages holding it
        self.owner = {k: s[0] for k, s in self.holders.items()}  # the first: full_state_dict's source
        local = set(compiled.plan_for(rank).local_stages)
        self.local_keys = [k for k, s in self.holders.items() if local & set(s)]

    def _holders(self, compiled) -> Dict[str, Tuple[int, ...]]:
        """Every stage of `compiled` whose program holds a tensor, under each of its names: a
        tied parameter is held by every stage that uses it (See NOTE: Tied parameters,
        insert_tie_sync.py)."""
        names: Dict[int, List[str]] = defaultdict(list)
        for k, t in self.root.state_dict(keep_vars=True).items():
            names[id(t)].append(k)
        holders: Dict[str, List[int]] = defaultdict(list)
        for prog in compiled.programs:
            for _, t in list(prog.module.named_parameters()) + list(prog.module.named_buffers()):
                for key in names.get(id(t), ()):
                    if prog.stage not in holders[key]:
                        holders[key].append(prog.stage)
        return {k: tuple(sorted(s)) for k, s in holders.items()}

    def take_ownership(self, device: torch.device) -> None:
        """Moves this rank's parameters to its device; the optimizer keeps only them."""
        tensors = self.root.state_dict(keep_vars=True)
        owned = {id(tensors[k]) for k in self.local_keys}
        self.shards = self._shard_split_tensors(tensors)
        self.device = device  # where full_state_dict's transfers run (nccl needs the GPU)
        if device.type != "cpu":
            for k in self.local_keys:
                tensors[k].data = tensors[k].data.to(device)
        hold_elsewhere(self._held_elsewhere(tensors))   # NOTE: Parameters held elsewhere
        if self.optimizer is None:
            return
        all_params = {id(p) for p in self.root.parameters()}
        self.group_params = [list(group["params"]) for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in all_params:
                    raise GraphcError(
                        f"the optimizer holds a parameter of shape {list(p.shape)} that no module "
                        "of the graph owns. Fix: build the optimizer from the parameters of the "
                        "modules assigned to the Graph (e.g. model.parameters()).")
            group["params"] = [p for p in group["params"] if id(p) in owned]
        if self.param_dtype is not None:  # after sharding and the device move: masters of the local values
            self.masters = MasterParams.take([tensors[k] for k in self.local_keys
                                              if isinstance(tensors[k], nn.Parameter)],
                                             self.optimizer, self.param_dtype)

    def _held_elsewhere(self, tensors) -> Dict[str, Tuple[nn.Parameter, str]]:
        """The parameters this rank does not hold whole after the plans (See NOTE: Parameters
        held elsewhere): a stage another rank runs, or a part of a split one."""
        local, found = set(self.local_keys), {}
        for k, t in tensors.items():
            if not isinstance(t, nn.Parameter) or k not in self.holders:
                continue
            if k not in local:
                ranks = sorted({r for s in self.holders[k] for r in self.compiled.stages[s].ranks})
                found[k] = (t, f"it is trained on rank(s) {ranks} (stage {list(self.holders[k])}), not on rank "
                               f"{self.rank}, whose copy keeps the value the model started with")
            elif k in self.shards:
                found[k] = (t, f"rank {self.rank} holds a part of it ({list(t.shape)} of {list(self.shards[k][0])}: "
                               "a split parameter)")
        return found

    def adopt(self, compiled, device: torch.device) -> None:
        """Another plan of the graph (NOTE: Guards) may use parameters the first did not: an
        adapter peft's set_adapter made active, a layer unfrozen that build() skipped. Those
        the new plan places on this rank join its keys and go back into the optimizer's
        groups, where the user put them (parameters no plan used were left out of both)."""
        new = {k: s for k, s in self._holders(compiled).items() if k not in self.holders}
        if not new:
            return
        local = set(compiled.plan_for(self.rank).local_stages)
        mine = [k for k, s in new.items() if local & set(s)]
        tensors = self.root.state_dict(keep_vars=True)
        if mine and (self.masters is not None or getattr(self, "shards", {})):
            raise GraphcError(
                f"this call's plan trains {mine[:3]}, which no earlier plan of the graph used, "
                "with set_param_dtype or split parameters: graphc cannot add them to the "
                "masters and shards it made at the first call. Fix: call every module (every "
                "adapter) in the first step, or build a new Graph after the change.")
        self.holders.update(new)
        self.owner.update({k: s[0] for k, s in new.items()})
        self.local_keys += mine
        release_elsewhere(tensors[k] for k in mine)
        hold_elsewhere({k: v for k, v in self._held_elsewhere(tensors).items() if k in new})
        adopted = {id(tensors[k]) for k in mine}
        if device.type != "cpu":
            for k in mine:
                tensors[k].data = tensors[k].data.to(device)
        if self.optimizer is None or not adopted:
            return
        for group, members in zip(self.optimizer.param_groups, self.group_params):
            held = {id(p) for p in group["params"]} | adopted
            group["params"] = [p for p in members if id(p) in held]

    def tensors(self) -> Dict[str, torch.Tensor]:
        """root.state_dict(keep_vars=True) with each parameter stored in a low dtype replaced by
        its float32 master: what checkpoints save and load (NOTE: Master parameters)."""
        tensors = self.root.state_dict(keep_vars=True)
        if self.masters is None:
            return tensors
        return {k: self.masters.master_of(t) for k, t in tensors.items()}

    # -- checkpoints -------------------------------------------------------------------
    def agree(self, compiled, options, what: str, tag: str, with_parameters: bool) -> None:
        """Every rank runs the same plans from equal replicas (See NOTE: Rank agreement):
        the step facts, and (the first time) this rank's replicated parameters."""
        facts = step_facts(compiled, options, self.steps, self.rank)
        holders: Dict[str, List[int]] = {}
        if with_parameters:
            tensors = self.root.state_dict(keep_vars=True)
            split = getattr(self, "shards", {})
            for key in self.local_keys:
                if key in split or not isinstance(tensors[key], nn.Parameter):
                    continue
                facts["param:" + key] = fingerprint_tensor(tensors[key])
                holders[key] = sorted({r for s in self.holders[key] for r in compiled.stages[s].ranks})
        check_agreement(facts, holders, what, tag, timeout_seconds(), plan=compiled.plan_for(self.rank))

    def load(self, sd: Dict[str, Any], strict: bool = True) -> None:
        """Loads a graph.state_dict(); every check runs before anything changes."""
        check_state_dict(sd)
        if sd["format"] == DCP_FORMAT:
            self.base_seed = load_dcp_state_dict(self, sd, strict)
            self._masters_to_params()
            return
        # an older graphc's per-rank checkpoint (STATE_FORMAT)
        if sd.get("rank") != self.rank:
            raise GraphcError(f"this checkpoint was saved by rank {sd.get('rank')}, but is loaded "
                              f"on rank {self.rank}. Fix: load the file each rank saved itself.")
        keys = self._check_keys(sd, strict)
        tensors = self.tensors()
        for k in keys:
            _check_shape(k, sd["model"][k], tensors[k], self.rank)
        self._load_optimizer(sd)
        with torch.no_grad():
            for k in keys:
                tensors[k].copy_(sd["model"][k])
        if "rng" in sd:
            torch.set_rng_state(sd["rng"])
        self.steps = sd.get("steps", 0)
        self._masters_to_params()

    def _masters_to_params(self) -> None:
        """After a load into the masters: the parameters are their values in the low dtype."""
        if self.masters is not None:
            self.masters.copy_back()

    def _check_keys(self, sd: Dict[str, Any], strict: bool) -> list:
        """The model keys to load; with strict, unknown or missing entries are errors."""
        unknown = sorted(set(sd) - set(_KEYS))
        unexpected = sorted(set(sd["model"]) - set(self.local_keys))
        missing = [k for k in self.local_keys if k not in sd["model"]]
        missing += [k for k, there in (("optimizer", self.optimizer), ("lr_scheduler", self.lr_scheduler))
                    if there is not None and k not in sd]
        if strict and unknown:
            raise GraphcError(
                f"rank {self.rank}: the checkpoint has unknown entries {unknown[:5]}; a "
                f"graph.state_dict() holds only {list(_KEYS)}. Fix: load what graph.state_dict() "
                "saved, or pass strict=False to ignore them.")
        if strict and unexpected:
            raise GraphcError(
                f"rank {self.rank}: the checkpoint's 'model' holds {unexpected[:5]}, which this "
                f"rank's part of the graph does not have (it has {self.local_keys[:5]}); it was "
                "saved from a different model or stage layout. Fix: load a checkpoint of the same "
                "model and layout, or pass strict=False to load only the keys that match.")
        if strict and missing:
            raise GraphcError(
                f"checkpoint for rank {self.rank} lacks {missing[:5]}; it was saved from a "
                "different model, stage layout or optimizer set-up. Fix: load a checkpoint of the "
                "same graph, or pass strict=False to keep the current values of what it lacks.")
        return [k for k in self.local_keys if k in sd["model"]]

    def _load_optimizer(self, sd: Dict[str, Any]) -> None:
        if self.optimizer is not None and "optimizer" in sd:
            saved, mine = sd.get("optimizer_class"), class_name(self.optimizer)
            if saved is not None and saved != mine:
                raise GraphcError(
                    f"rank {self.rank}: the checkpoint's optimizer state comes from {saved}, but "
                    f"the graph's optimizer is {mine}; its state would not fit. Fix: build the "
                    f"graph with a {saved}, or delete the checkpoint's 'optimizer' and "
                    "'optimizer_class' entries and load with strict=False to start the optimizer "
                    "afresh.")
            load_into(self.optimizer, sd["optimizer"], "optimizer", self.rank)
        if self.lr_scheduler is not None and "lr_scheduler" in sd:
            load_into(self.lr_scheduler, sd["lr_scheduler"], "lr_scheduler", self.rank)

    def _shard_split_tensors(self, tensors) -> Dict[str, tuple]:
        """Keeps only this rank's shard of every split parameter or buffer it owns.

        Returns key -> (global shape, sbp, mesh) for every split one on any stage: all ranks
        know them, so full_state_dict issues the same collectives everywhere.
        """
        shards = {}
        pieces = stored_pieces(self.compiled.gm)
        self.pieces = {k: pieces[id(tensors[k])] for k in self.owner if id(tensors[k]) in pieces}
        whole: Dict[int, tuple] = {}  # id -> global shape: the names of a tied one shard it once
        declared = declared_in(self.compiled.gm)   # what the compile read (a loaded layout's too)
        for k in self.owner:
            t = tensors[k]
            layout = declared.of(k) or declared_layout(t)
            if layout is None or not any(isinstance(s, Split) for s in layout.sbp):
                continue
            mesh = self.compiled.meshes[self.owner[k]]
            if id(t) not in whole:
                whole[id(t)] = tuple(t.shape)
                if k in self.local_keys:  # a tied copy is sharded over the mesh of the stage here
                    local = set(self.compiled.plan_for(self.rank).local_stages)
                    here = self.compiled.meshes[next(s for s in self.holders[k] if s in local)]
                    t.data = local_component(t.data, layout.sbp, here, self.rank, self.pieces.get(k)).clone()
            shards[k] = (whole[id(t)], layout.sbp, mesh)
        return shards

    @contextmanager
    def global_shapes(self):
        """Within the block, this rank's split tensors have their global shapes again (values
        undefined), so a later compile (a new input shape) sees the model as the first did."""
        tensors = self.root.state_dict(keep_vars=True)
        held = {}
        for k, (shape, _, _) in getattr(self, "shards", {}).items():
            t = tensors[k]
            if k in self.local_keys and id(t) not in held and tuple(t.shape) != tuple(shape):
                held[id(t)] = (t, t.data)
                t.data = torch.empty(shape, dtype=t.dtype, device=t.device)
        try:
            yield
        finally:
            for t, local in held.values():
                t.data = local

    def full_state_dict(self, rank0_only: bool = False, cpu_offload: bool = True) -> Dict[str, torch.Tensor]:
        """Collective over the world: every tensor comes from the first rank of its (first)
        stage; every name of a tied tensor gets that one value, as in model.state_dict().
        With rank0_only, rank 0 alone receives (point to point from each source) and every
        other rank returns {}; with cpu_offload the tensors returned are on the CPU."""
        out: Dict[str, torch.Tensor] = {}
        done: Dict[int, torch.Tensor] = {}
        live = world.multi() is not None
        device = getattr(self, "device", torch.device("cpu"))
        for k, t in self.tensors().items():
            if id(t) in done:  # another name of a tied tensor (the same on every rank)
                out[k] = done[id(t)]
                continue
            value = t.detach().to(device if live else t.device, copy=True)
            if live and k in getattr(self, "shards", {}):
                value = self._gather_shards(k, value, rank0_only)
            elif live and k in self.owner:
                self._from_owner(k, value, rank0_only)
            out[k] = done[id(t)] = value.cpu() if cpu_offload else value
        return {} if rank0_only and self.rank != 0 else out

    def _from_owner(self, k: str, value: torch.Tensor, rank0_only: bool) -> None:
        """Collective: `value` becomes the first rank of its owner stage's (on rank 0 alone
        with rank0_only)."""
        src = self.compiled.stages[self.owner[k]].ranks[0]
        if not rank0_only:
            world.current().broadcast(value, src)
        elif src != 0 and self.rank == src:
            world.current().send(value, 0)
        elif src != 0 and self.rank == 0:
            world.current().recv(value, src)

    def _gather_shards(self, k: str, value: torch.Tensor, rank0_only: bool) -> torch.Tensor:
        """Collective: the full tensor from its shards, one copy of each (from the first rank
        on the mesh's broadcast axes): summed over the world, or sent to rank 0 alone."""
        shape, sbp, mesh = self.shards[k]
        pieces = self.pieces.get(k)
        # the ranks of the owner stage's mesh (whose value is that stage's shard) at 0 on B axes
        sources = [r for r in flat(mesh)
                   if all(d == 0 for d, s in zip(coord(mesh, r), sbp) if not isinstance(s, Split))]
        full = torch.zeros(shape, dtype=value.dtype, device=value.device) \
            if not rank0_only or self.rank == 0 else None
        if not rank0_only:
            if self.rank in sources:
                place_shard(full, value, sbp, mesh, self.rank, pieces)
            world.current().all_reduce(full)
            return full
        if self.rank != 0:
            if self.rank in sources:
                world.current().send(value.contiguous(), 0)
            return value
        for r in sources:
            part = value
            if r != 0:
                part = torch.empty(local_component(torch.empty(shape, device="meta"), sbp, mesh, r,
                                                   pieces).shape, dtype=value.dtype, device=value.device)
                world.current().recv(part, r)
            place_shard(full, part, sbp, mesh, r, pieces)
        return full


def stored_pieces(gm) -> Dict[int, tuple]:
    """id(parameter) -> its Pieces, for the parameters stored in pieces (See NOTE: fused pieces)."""
    return {id(gm.get_parameter(n.target)): n.meta[META_PIECES] for n in gm.graph.nodes
            if n.op == "get_attr" and META_PIECES in n.meta}


def check_state_dict(sd) -> None:
    """What load_state_dict checks at once, before the graph is compiled: the structure."""
    if isinstance(sd, (str, bytes, os.PathLike)):
        raise GraphcError(
            f"load_state_dict expects the dict graph.state_dict() returned, found the path {sd!r}. "
            f"Fix: graph.load_state_dict(graphc.load({str(sd)!r})).")
    if not isinstance(sd, Mapping):
        raise GraphcError(
            f"load_state_dict expects the dict graph.state_dict() returned, found "
            f"{type(sd).__name__}. Fix: pass graphc.load(path) of a file graphc.save wrote.")
    if sd.get("format") not in (DCP_FORMAT, STATE_FORMAT):
        raise GraphcError(f"load_state_dict expects a graph.state_dict() ({DCP_FORMAT}), "
                          f"found format {sd.get('format')!r}. Fix: load a plain model state dict "
                          "into the model before building the Graph instead")
    if not isinstance(sd.get("model"), Mapping):
        raise GraphcError(
            f"this checkpoint ({sd['format']}) has no 'model' entry (found entries "
            f"{sorted(sd)}), so it holds no parameters. Fix: save graph.state_dict() whole and "
            "load that.")


def _check_shape(key: str, saved, mine: torch.Tensor, rank: int) -> None:
    if not isinstance(saved, torch.Tensor):
        raise GraphcError(f"rank {rank}: checkpoint key '{key}' holds a {type(saved).__name__}, "
                          "expected a tensor. Fix: load what graph.state_dict() saved.")
    if saved.shape != mine.shape:  # copy_ would broadcast a smaller tensor silently
        raise GraphcError(
            f"rank {rank}: checkpoint key '{key}' has shape {list(saved.shape)}, but the graph's "
            f"'{key}' has shape {list(mine.shape)} (this rank's component); the checkpoint was "
            "saved from a model of other sizes or another layout. Fix: build the same model and "
            "layout as when saving, or load a matching checkpoint.")
