"""GraphState: which rank owns which parameters, the optimizer's view of them, checkpoints."""
from __future__ import annotations

import copy
from contextlib import contextmanager
import os
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import GraphcError
from .global_tensor import declared_layout
from .placement import Split
from .meta import META_PIECES
from .sbp.layout import coord, local_component, place_shard

STATE_FORMAT = "graphc.state/1"
# the entries of a local_state_dict(); optimizer_class is absent from older checkpoints
_KEYS = ("format", "rank", "steps", "model", "optimizer", "optimizer_class", "lr_scheduler", "rng")


class GraphState:
    def __init__(self, root: nn.Module, compiled, rank: int, optimizer, lr_scheduler):
        self.root, self.compiled, self.rank = root, compiled, rank
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.steps = 0
        self.holders = self._holders()            # state-dict key -> stages holding it
        self.owner = {k: s[0] for k, s in self.holders.items()}  # the first: full_state_dict's source
        local = set(compiled.plan_for(rank).local_stages)
        self.local_keys = [k for k, s in self.holders.items() if local & set(s)]

    def _holders(self) -> Dict[str, Tuple[int, ...]]:
        """Every stage whose program holds a tensor, under each of its names: a tied parameter
        is held by every stage that uses it (See NOTE: Tied parameters, insert_tie_sync.py)."""
        names: Dict[int, List[str]] = defaultdict(list)
        for k, t in self.root.state_dict(keep_vars=True).items():
            names[id(t)].append(k)
        holders: Dict[str, List[int]] = defaultdict(list)
        for prog in self.compiled.programs:
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
        if device.type != "cpu":
            for k in self.local_keys:
                tensors[k].data = tensors[k].data.to(device)
        if self.optimizer is None:
            return
        all_params = {id(p) for p in self.root.parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in all_params:
                    raise GraphcError(
                        f"the optimizer holds a parameter of shape {list(p.shape)} that no module "
                        "of the graph owns. Fix: build the optimizer from the parameters of the "
                        "modules assigned to the Graph (e.g. model.parameters()).")
            group["params"] = [p for p in group["params"] if id(p) in owned]

    # -- checkpoints -------------------------------------------------------------------
    def local_state_dict(self) -> Dict[str, Any]:
        tensors = self.root.state_dict(keep_vars=True)
        sd: Dict[str, Any] = {
            "format": STATE_FORMAT, "rank": self.rank, "steps": self.steps,
            "model": {k: tensors[k].detach().clone() for k in self.local_keys},
        }
        if self.optimizer is not None:  # a copy: the live state keeps changing in place
            sd["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
            sd["optimizer_class"] = _class_name(self.optimizer)
        if self.lr_scheduler is not None:
            sd["lr_scheduler"] = copy.deepcopy(self.lr_scheduler.state_dict())
        sd["rng"] = torch.get_rng_state()  # dropout and friends resume on the same stream
        return sd

    def load(self, sd: Dict[str, Any], strict: bool = True) -> None:
        """Loads a local_state_dict() of this rank; every check runs before anything changes."""
        check_state_dict(sd)
        if sd.get("rank") != self.rank:
            raise GraphcError(f"this checkpoint was saved by rank {sd.get('rank')}, but is loaded "
                              f"on rank {self.rank}. Fix: load the file each rank saved itself.")
        keys = self._check_keys(sd, strict)
        tensors = self.root.state_dict(keep_vars=True)
        for k in keys:
            _check_shape(k, sd["model"][k], tensors[k], self.rank)
        self._load_optimizer(sd)
        with torch.no_grad():
            for k in keys:
                tensors[k].copy_(sd["model"][k])
        if "rng" in sd:
            torch.set_rng_state(sd["rng"])
        self.steps = sd.get("steps", 0)

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
            saved, mine = sd.get("optimizer_class"), _class_name(self.optimizer)
            if saved is not None and saved != mine:
                raise GraphcError(
                    f"rank {self.rank}: the checkpoint's optimizer state comes from {saved}, but "
                    f"the graph's optimizer is {mine}; its state would not fit. Fix: build the "
                    f"graph with a {saved}, or delete the checkpoint's 'optimizer' and "
                    "'optimizer_class' entries and load with strict=False to start the optimizer "
                    "afresh.")
            _load_into(self.optimizer, sd["optimizer"], "optimizer", self.rank)
        if self.lr_scheduler is not None and "lr_scheduler" in sd:
            _load_into(self.lr_scheduler, sd["lr_scheduler"], "lr_scheduler", self.rank)

    def _shard_split_tensors(self, tensors) -> Dict[str, tuple]:
        """Keeps only this rank's shard of every split parameter or buffer it owns.

        Returns key -> (global shape, sbp, mesh) for every split one on any stage: all ranks
        know them, so full_state_dict issues the same collectives everywhere.
        """
        shards = {}
        pieces = stored_pieces(self.compiled.gm)
        self.pieces = {k: pieces[id(tensors[k])] for k in self.owner if id(tensors[k]) in pieces}
        whole: Dict[int, tuple] = {}  # id -> global shape: the names of a tied one shard it once
        for k in self.owner:
            t = tensors[k]
            layout = declared_layout(t)
            if layout is None or not any(isinstance(s, Split) for s in layout[1]):
                continue
            mesh = self.compiled.meshes[self.owner[k]]
            if id(t) not in whole:
                whole[id(t)] = tuple(t.shape)
                if k in self.local_keys:  # a tied copy is sharded over the mesh of the stage here
                    local = set(self.compiled.plan_for(self.rank).local_stages)
                    here = self.compiled.meshes[next(s for s in self.holders[k] if s in local)]
                    t.data = local_component(t.data, layout[1], here, self.rank, self.pieces.get(k)).clone()
            shards[k] = (whole[id(t)], layout[1], mesh)
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

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Collective over the world: every tensor comes from the first rank of its (first)
        stage; every name of a tied tensor gets that one value, as in model.state_dict()."""
        out: Dict[str, torch.Tensor] = {}
        done: Dict[int, torch.Tensor] = {}
        live = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        for k, t in self.root.state_dict(keep_vars=True).items():
            if id(t) in done:  # another name of a tied tensor (the same on every rank)
                out[k] = done[id(t)]
                continue
            value = t.detach().cpu().clone()
            if live and k in getattr(self, "shards", {}):
                value = self._gather_shards(k, value)
            elif live and k in self.owner:
                src = self.compiled.stages[self.owner[k]].ranks[0]
                dist.broadcast(value, src)
            out[k] = done[id(t)] = value
        return out

    def _gather_shards(self, k: str, value: torch.Tensor) -> torch.Tensor:
        """Collective: the full tensor from its shards (each written once, then summed)."""
        shape, sbp, mesh = self.shards[k]
        full = torch.zeros(shape, dtype=value.dtype)
        where = [d for d, s in zip(coord(mesh, self.rank), sbp) if not isinstance(s, Split)] \
            if self.owner[k] in self.compiled.plan_for(self.rank).local_stages else [1]
        if all(d == 0 for d in where):  # one copy of each shard: the first rank on B axes
            place_shard(full, value, sbp, mesh, self.rank, self.pieces.get(k))
        dist.all_reduce(full)
        return full


def stored_pieces(gm) -> Dict[int, tuple]:
    """id(parameter) -> (k, dim) for the parameters stored in pieces (See NOTE: fused pieces)."""
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
    if sd.get("format") != STATE_FORMAT:
        raise GraphcError(f"load_state_dict expects a graph.state_dict() ({STATE_FORMAT}), "
                          f"found format {sd.get('format')!r}. Fix: load a plain model state dict "
                          "into the model before building the Graph instead")
    if not isinstance(sd.get("model"), Mapping):
        raise GraphcError(
            f"this checkpoint ({STATE_FORMAT}) has no 'model' entry (found entries "
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


def _load_into(obj, state, what: str, rank: int) -> None:
    try:
        obj.load_state_dict(state)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise GraphcError(
            f"rank {rank}: the checkpoint's '{what}' does not fit the graph's "
            f"{type(obj).__name__} ({type(e).__name__}: {e}); it was saved with other "
            f"parameter groups or another {what}. Fix: build the same {what} as when saving.") from e


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
