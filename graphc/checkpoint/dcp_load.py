"""Loading a graphc state dict in DCP form back into a Graph's state (See graphc/checkpoint/dcp.py
for the form: its entries, layouts and how saving lays each tensor out)."""
from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Optional

import torch

from ..errors import GraphcError
from ..sbp.layout import local_component
from .dcp import (ENTRIES, Layout, _key_and_layout, class_name, param_names, saved_keys, split_layouts,
                  user_prefix, zero_layouts)


# -- loading ----------------------------------------------------------------------------
def load_dcp_state_dict(state, sd: Mapping, strict: bool) -> Optional[int]:
    """Loads a graph.state_dict() (See NOTE: DCP state dict) into GraphState `state`: after
    dcp.load, a part of any layout; from graphc.load, this rank's file; or whole tensors. Every
    check runs before anything changes. Returns the checkpoint's base seed (None if absent)."""
    rank, prefix = state.rank, user_prefix(state.root)
    _check_entries(state, sd, strict)
    rng = _rank_rng(sd.get("rng", {}), rank)  # before the keys: another rank's part lacks ours
    tensors = state.tensors()   # into the float32 masters (NOTE: Master parameters)
    layouts = split_layouts(state)
    model = _check_model_keys(state, sd["model"], prefix, strict)
    values = {k: to_local(model[k[len(prefix):]], layouts.get(k), tensors[k], k[len(prefix):], rank)
              for k in saved_keys(state) if k[len(prefix):] in model}
    optim = None
    if state.optimizer is not None and "optim" in sd:
        optim = _optimizer_to_load(state, sd, layouts, prefix, strict)
    if optim is not None:
        load_into(state.optimizer, optim, "optimizer", rank)
    if state.lr_scheduler is not None and "lr_scheduler" in sd:
        load_into(state.lr_scheduler, sd["lr_scheduler"], "lr_scheduler", rank)
    with torch.no_grad():
        for k, v in values.items():
            tensors[k].copy_(v)
    if rng is not None:
        torch.set_rng_state(rng)
    state.steps = int(sd.get("steps", 0))
    seed = sd.get("rng", {}).get("base_seed")
    return None if seed is None else int(seed)


def _check_entries(state, sd: Mapping, strict: bool) -> None:
    unknown = sorted(set(sd) - set(ENTRIES))
    missing = [k for k, there in (("optim", state.optimizer), ("lr_scheduler", state.lr_scheduler))
               if there is not None and k not in sd]
    if strict and unknown:
        raise GraphcError(
            f"rank {state.rank}: the checkpoint has unknown entries {unknown[:5]}; a "
            f"graph.state_dict() holds only {list(ENTRIES)}. Fix: load what graph.state_dict() "
            "saved, or pass strict=False to ignore them.")
    if strict and missing:
        raise GraphcError(
            f"checkpoint for rank {state.rank} lacks {missing}; it was saved from a graph without "
            "that optimizer or LR scheduler. Fix: build the graph as when saving, or pass "
            "strict=False to keep the current optimizer and scheduler state.")


def _check_model_keys(state, model: Mapping, prefix: str, strict: bool) -> Mapping:
    """Names of other stages are fine (a whole checkpoint feeds every rank its part); names
    the model does not have, or names of this rank's part that are absent, are not."""
    known = {k[len(prefix):] for k in state.root.state_dict(keep_vars=True)}
    unexpected = sorted(set(model) - known)
    missing = [k[len(prefix):] for k in saved_keys(state) if k[len(prefix):] not in model]
    if strict and unexpected:
        raise GraphcError(
            f"rank {state.rank}: the checkpoint's 'model' holds {unexpected[:5]}, which the "
            f"model does not have (it has {sorted(known)[:5]}...); it was saved from a different "
            "model. Fix: load a checkpoint of the same model, or pass strict=False to load only "
            "the names that match.")
    if strict and missing:
        raise GraphcError(
            f"checkpoint for rank {state.rank} lacks {missing[:5]}; it was saved from a "
            "different model. Fix: load a checkpoint of the same graph, or pass strict=False to "
            "keep the current values of what it lacks.")
    return model


def _rank_rng(rng: Mapping, rank: int) -> Optional[torch.Tensor]:
    """This rank's RNG state (See NOTE: RNG states in checkpoints); a file that holds another
    rank's only was saved by that rank."""
    if f"rank{rank}" in rng:
        return rng[f"rank{rank}"]
    if "by_rank" in rng:  # from dcp.load: every saved rank's
        if rank < len(rng["by_rank"]):
            return rng["by_rank"][rank]
        return torch.Generator().manual_seed((int(rng["base_seed"]) + rank) % 2 ** 64).get_state()
    others = sorted(k for k in rng if k.startswith("rank"))
    if others:
        saver = others[0].replace("rank", "rank ")
        raise GraphcError(
            f"this checkpoint was saved by {saver}, but is loaded on rank {rank}. A graphc.save "
            "file holds one rank's part of the graph; when several ranks save to the same path "
            f"they write the same file, and only the last writer's ({saver}'s) is left. Fix: "
            "give each rank its own path, e.g. graphc.save(graph.state_dict(), "
            "f\"ckpt/rank{rank}.pt\") with rank = torch.distributed.get_rank(), and load the "
            "file each rank saved itself; or save with torch.distributed.checkpoint "
            "(dcp.save(graph.state_dict(), checkpoint_id=d)), one checkpoint that any rank and "
            "layout can load.")
    return None


def _optimizer_to_load(state, sd: Mapping, layouts: Dict[str, Layout], prefix: str,
                       strict: bool) -> Dict[str, Any]:
    """The optimizer's own state_dict() form (by index, this rank's parameters) of the
    checkpoint's optimizer part (by name, global param groups)."""
    opt, rank = state.optimizer, state.rank
    saved_class, mine = sd.get("optimizer_class"), class_name(opt)
    if saved_class is not None and saved_class != mine:
        raise GraphcError(
            f"rank {rank}: the checkpoint's optimizer state comes from {saved_class}, but the "
            f"graph's optimizer is {mine}; its state would not fit. Fix: build the graph with a "
            f"{saved_class}, or delete the checkpoint's 'optim' and 'optimizer_class' entries and "
            "load with strict=False to start the optimizer afresh.")
    names = param_names(state)
    zero = zero_layouts(state, layouts)
    names.update({i: key for i, (key, _) in zero.items()})   # a ZeRO shard by its parameter's name
    saved_state = sd["optim"].get("state", {})
    groups = _param_groups(opt, sd["optim"].get("param_groups", []), names, prefix, rank)
    params = [p for group in opt.param_groups for p in group["params"]]
    out: Dict[int, dict] = {}
    lacking = []
    for i, p in enumerate(params):
        key, layout = _key_and_layout(p, names, layouts, zero)
        entry = saved_state.get(key[len(prefix):])
        if entry is None:
            lacking += [key[len(prefix):]] if saved_state and p.requires_grad else []
            continue
        out[i] = {n: _local_state_value(v, layout, p, f"optim.state.{key[len(prefix):]}.{n}", rank)
                  for n, v in entry.items()}
    if strict and lacking:
        raise GraphcError(
            f"checkpoint for rank {rank} has no optimizer state for {lacking[:5]}; it was saved "
            "from a different model or optimizer set-up. Fix: load a checkpoint of the same "
            "graph, or pass strict=False to start their state afresh.")
    if int(sd.get("steps", 0)) == 0:
        out = {}  # saved before the first step: what it holds is scratch (See NOTE: DCP state dict)
    return {"state": out, "param_groups": groups}


def _param_groups(opt, saved: list, names: Dict[int, str], prefix: str, rank: int) -> list:
    """The saved hyperparameters of each group, over this rank's members of it."""
    if len(saved) != len(opt.param_groups):
        raise GraphcError(
            f"rank {rank}: the checkpoint's optimizer has {len(saved)} parameter groups, the "
            f"graph's {len(opt.param_groups)}. Fix: build the optimizer with the same groups as "
            "when saving.")
    out, index = [], 0
    for i, (group, theirs) in enumerate(zip(opt.param_groups, saved)):
        mine = [names[id(p)][len(prefix):] for p in group["params"]]
        stray = [n for n in mine if n not in set(theirs.get("params", ()))]
        if stray:
            raise GraphcError(
                f"rank {rank}: the graph's optimizer has {stray[:3]} in parameter group {i}, but "
                f"the checkpoint's group {i} does not. Fix: build the optimizer with the same "
                "groups as when saving.")
        out.append({**{k: v for k, v in theirs.items() if k != "params"},
                    "params": list(range(index, index + len(mine)))})
        index += len(mine)
    return out


def _local_state_value(v, layout: Optional[Layout], param: torch.Tensor, key: str, rank: int):
    if not isinstance(v, torch.Tensor) or (v.dim() == 0 and not _is_dtensor(v)):
        return v
    if layout is None and not _is_dtensor(v):
        return v  # state of a whole parameter, whatever its shape
    return to_local(v, layout, param, key, rank)


def _is_dtensor(v) -> bool:
    return "torch.distributed.tensor" in sys.modules and \
        isinstance(v, sys.modules["torch.distributed.tensor"].DTensor)


def load_into(obj, state, what: str, rank: int) -> None:
    """obj.load_state_dict(state), whose failures name the rank and the fix."""
    try:
        obj.load_state_dict(state)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise GraphcError(
            f"rank {rank}: the checkpoint's '{what}' does not fit the graph's "
            f"{type(obj).__name__} ({type(e).__name__}: {e}); it was saved with other "
            f"parameter groups or another {what}. Fix: build the same {what} as when saving.") from e


def to_local(value, layout: Optional[Layout], mine: torch.Tensor, key: str, rank: int) -> torch.Tensor:
    """This rank's part of a loaded value: a DTensor's local part, a whole (full) tensor's
    shard, or a tensor that already has this rank's local shape (graphc.save files)."""
    from torch.distributed.tensor import DTensor
    if isinstance(value, DTensor):
        if layout is not None and tuple(value.shape) != layout.shape:
            _wrong_shape(key, value, layout.shape, "global ", rank)
        value = local_part(value)
    if not isinstance(value, torch.Tensor):
        raise GraphcError(f"rank {rank}: checkpoint key '{key}' holds a {type(value).__name__}, "
                          "expected a tensor. Fix: load what graph.state_dict() saved.")
    if layout is not None and tuple(value.shape) == layout.shape != tuple(mine.shape):
        value = local_component(value, layout.sbp, layout.mesh, rank, layout.pieces)
    if layout is not None and layout.zero_rows and value.dim() and value.shape != mine.shape \
            and value.shape[1:] == mine.shape[1:]:   # the whole component: ZeRO's rows of it
        start, rows = layout.zero_rows
        value = value[start:start + rows]
    if value.shape != mine.shape:  # copy_ would broadcast a smaller tensor silently
        _wrong_shape(key, value, tuple(mine.shape), "", rank)
    return value


def local_part(value) -> torch.Tensor:
    """A DTensor's local part as one tensor (the blocks of a pieced one concatenated)."""
    local = value.to_local()
    if not hasattr(local, "local_shards"):
        return local
    # a LocalShardsWrapper: one block per piece, at offsets that differ along the pieces' dim
    blocks, offsets = local.local_shards(), local.local_offsets()
    if len(blocks) == 1:
        return blocks[0]
    dim = next(d for d, (a, b) in enumerate(zip(offsets[0], offsets[1])) if a != b)
    return torch.cat(blocks, dim)


def _wrong_shape(key: str, value, want: tuple, what: str, rank: int):
    raise GraphcError(
        f"rank {rank}: checkpoint key '{key}' has {what}shape {list(value.shape)}, but the graph's "
        f"'{key}' has {what}shape {list(want)}"
        + (" (this rank's component)" if not what else "")
        + "; the checkpoint was saved from a model of other sizes or another layout. Fix: build "
        "the same model, or load a checkpoint of it (torch.distributed.checkpoint reshards to "
        "any layout: sd = graph.state_dict(); dcp.load(sd, checkpoint_id=d); "
        "graph.load_state_dict(sd)).")


def to_local_form(obj):
    """`obj` with every DTensor replaced by this rank's local part (graphc.save's files hold
    plain tensors, one file per rank)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist: nothing to do
        return obj
    from torch.distributed.tensor import DTensor
    if isinstance(obj, DTensor):
        return local_part(obj)
    if isinstance(obj, Mapping):
        return {k: to_local_form(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_local_form(v) for v in obj)
    return obj


def unprefixed(root, sd: Dict[str, Any]) -> Dict[str, Any]:
    """Drops the attribute prefix when a single assigned module holds all the state (so
    full_state_dict is keyed like the user's model.state_dict())."""
    prefix = user_prefix(root)
    return {k[len(prefix):]: v for k, v in sd.items()}
