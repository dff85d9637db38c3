"""GraphState: which rank owns which parameters, the optimizer's view of them, checkpoints."""
from __future__ import annotations

import copy
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import GraphcError
from .global_tensor import declared_layout
from .placement import Split
from .sbp.layout import coord, local_component, shard_slices

STATE_FORMAT = "graphc.state/1"


class GraphState:
    def __init__(self, root: nn.Module, compiled, rank: int, optimizer, lr_scheduler):
        self.root, self.compiled, self.rank = root, compiled, rank
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.steps = 0
        self.owner = self._owners()               # state-dict key -> stage index
        local = compiled.plan_for(rank).local_stages
        self.local_keys = [k for k, s in self.owner.items() if s in local]

    def _owners(self) -> Dict[str, int]:
        owner: Dict[str, int] = {}
        by_id: Dict[int, str] = {id(t): k for k, t in self.root.state_dict(keep_vars=True).items()}
        for prog in self.compiled.programs:
            for _, t in list(prog.module.named_parameters()) + list(prog.module.named_buffers()):
                key = by_id.get(id(t))
                if key is None:
                    continue
                if key in owner and owner[key] != prog.stage:
                    raise GraphcError(
                        f"'{key}' is used by stage {owner[key]} and by stage {prog.stage}; a "
                        "parameter shared across pipeline stages is not supported yet. Fix: "
                        "keep the modules that share it in one stage.")
                owner[key] = prog.stage
        return owner

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
        if self.lr_scheduler is not None:
            sd["lr_scheduler"] = copy.deepcopy(self.lr_scheduler.state_dict())
        sd["rng"] = torch.get_rng_state()  # dropout and friends resume on the same stream
        return sd

    def load(self, sd: Dict[str, Any]) -> None:
        if sd.get("format") != STATE_FORMAT:
            raise GraphcError(f"load_state_dict expects a graph.state_dict() ({STATE_FORMAT}), "
                              f"found format {sd.get('format')!r}; load a plain model state dict "
                              "into the model before building the Graph instead")
        if sd.get("rank") != self.rank:
            raise GraphcError(f"this checkpoint was saved by rank {sd.get('rank')}, but is loaded "
                              f"on rank {self.rank}. Fix: load the file each rank saved itself.")
        tensors = self.root.state_dict(keep_vars=True)
        missing = [k for k in self.local_keys if k not in sd["model"]]
        if missing:
            raise GraphcError(f"checkpoint for rank {self.rank} lacks {missing[:5]}; it was saved "
                              "from a different model or stage layout")
        with torch.no_grad():
            for k in self.local_keys:
                tensors[k].copy_(sd["model"][k])
        if self.optimizer is not None and "optimizer" in sd:
            self.optimizer.load_state_dict(sd["optimizer"])
        if self.lr_scheduler is not None and "lr_scheduler" in sd:
            self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        if "rng" in sd:
            torch.set_rng_state(sd["rng"])
        self.steps = sd.get("steps", 0)

    def _shard_split_tensors(self, tensors) -> Dict[str, tuple]:
        """Keeps only this rank's shard of every split parameter or buffer it owns.

        Returns key -> (global shape, sbp, mesh) for every split one on any stage: all ranks
        know them, so full_state_dict issues the same collectives everywhere.
        """
        shards = {}
        for k in self.owner:
            t = tensors[k]
            layout = declared_layout(t)
            if layout is None or not any(isinstance(s, Split) for s in layout[1]):
                continue
            mesh = self.compiled.meshes[self.owner[k]]
            shards[k] = (tuple(t.shape), layout[1], mesh)
            if k in self.local_keys:
                t.data = local_component(t.data, layout[1], mesh, self.rank).clone()
        return shards

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Collective over the world: every tensor comes from the first rank of its stage."""
        out: Dict[str, torch.Tensor] = {}
        live = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        for k, t in self.root.state_dict().items():
            value = t.detach().cpu().clone()
            if live and k in getattr(self, "shards", {}):
                value = self._gather_shards(k, value)
            elif live and k in self.owner:
                src = self.compiled.stages[self.owner[k]].ranks[0]
                dist.broadcast(value, src)
            out[k] = value
        return out

    def _gather_shards(self, k: str, value: torch.Tensor) -> torch.Tensor:
        """Collective: the full tensor from its shards (each written once, then summed)."""
        shape, sbp, mesh = self.shards[k]
        full = torch.zeros(shape, dtype=value.dtype)
        where = [d for d, s in zip(coord(mesh, self.rank), sbp) if not isinstance(s, Split)] \
            if self.owner[k] in self.compiled.plan_for(self.rank).local_stages else [1]
        if all(d == 0 for d in where):  # one copy of each shard: the first rank on B axes
            full[shard_slices(shape, sbp, mesh, self.rank)] = value
        dist.all_reduce(full)
        return full
