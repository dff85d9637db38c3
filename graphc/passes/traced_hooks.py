"""Module hooks while tracing (NOTE: Module hooks): a module's forward pre-hooks and forward
hooks run as Module.__call__ runs them, on traced values, so their ops are in the graph;
backward hooks and torch's global module hooks are refused, naming the line and the fix.

NOTE: Module hooks
A hook is part of the program: eager runs `module.register_forward_hook(fn)`'s fn on every
call of the module, and its return value replaces the output. fx traces a user's own
module through Module.__call__, which runs the hooks on the proxies, but keeps torch's
layers (Linear, LayerNorm, ...) as call_module leaves that ran the hooks only when the
leaf was later called whole: on a one-rank stage, never on a data- or tensor-parallel one,
whose layers decompose_modules rewrites into functional ops. So a hooked leaf is traced as
__call__ runs it: its pre-hooks on the traced arguments, the call_module node, its hooks on
the node's value (`run_forward_hooks`). The node then names a copy of the layer without
forward hooks (`without_forward_hooks`: the same parameters and buffers, installed in the
traced GraphModule by trace_build), so a stage that runs the layer whole does not run them
twice. The hook dicts of every module are guarded (guards.hook_guards): registering or
removing a hook after the first call compiles another plan.
Backward hooks fire on gradients a stage sees per micro-batch and per shard, not eager's
whole-batch gradients, and torch's global module hooks would run on graphc's own stage
programs: both are refused while tracing.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional

import torch.fx as fx
import torch.nn as nn
from torch.nn.modules import module as torch_module

from ..errors import GraphcError, defined_at
from ..guards import BACKWARD_HOOK_TABLES, FORWARD_HOOK_TABLES, GLOBAL_HOOK_TABLES


def has_forward_hooks(m: nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._forward_hooks)


def run_forward_hooks(m: nn.Module, forward: Callable, args: tuple, kwargs: Dict[str, Any]):
    """forward(*args, **kwargs) between m's forward pre-hooks and forward hooks, with their
    results replacing the arguments and the output as Module.__call__ does."""
    for key, hook in list(m._forward_pre_hooks.items()):
        if key in m._forward_pre_hooks_with_kwargs:
            result = hook(m, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise GraphcError(f"a forward pre-hook (with_kwargs=True) of {type(m).__name__} "
                                      f"returned {type(result).__name__}, not None or (args, kwargs), "
                                      "as torch requires. Fix: return (new_args, new_kwargs) or None.")
                args, kwargs = result
        else:
            result = hook(m, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    out = forward(*args, **kwargs)
    for key, hook in list(m._forward_hooks.items()):
        result = hook(m, args, kwargs, out) if key in m._forward_hooks_with_kwargs else hook(m, args, out)
        if result is not None:
            out = result
    return out


def without_forward_hooks(m: nn.Module) -> nn.Module:
    """A shallow copy of m without forward hooks: it shares m's parameter, buffer and child
    tables (so a parameter replaced in m is replaced in it), m keeps its hooks."""
    bare = copy.copy(m)
    for table in FORWARD_HOOK_TABLES:
        bare.__dict__[table] = OrderedDict()
    return bare


def install_modules(gm: fx.GraphModule, root: nn.Module, modules: Dict[str, nn.Module]) -> None:
    """gm's submodule at each qualified name becomes the given module. A container on the way
    that is the user's own module (not one fx made) is copied first: the user's stays as it is."""
    for path, module in modules.items():
        *prefix, name = path.split(".")
        parent = gm
        for item in prefix:
            child = getattr(parent, item)
            if any(child is m for m in root.modules()):
                child = copy.copy(child)
                child.__dict__["_modules"] = dict(child._modules)
                parent._modules[item] = child
            parent = child
        parent._modules[name] = module


def check_backward_hooks(m: nn.Module, name: str, line: Callable[[], str]) -> None:
    """Refuses a module build() calls that has backward hooks (NOTE: Module hooks). `line()`
    gives the user's calling line, read only for the error: the stack walk it takes cost more
    than the trace of a small module, on every module call."""
    hooks = [fn for t in BACKWARD_HOOK_TABLES for fn in (m.__dict__.get(t) or {}).values()]
    if hooks:
        raise GraphcError(
            f"module '{name}' ({type(m).__name__}), called by build() at {line()}, has a backward "
            f"hook ({defined_at(hooks[0])}; register_full_backward_hook, "
            "register_full_backward_pre_hook or register_backward_hook). graphc runs the backward per micro-batch and, on data- and "
            "tensor-parallel stages, per shard, so the hook would see partial gradients, not "
            "eager's. Fix: remove the hook; to read or change a parameter's whole gradient use "
            "param.register_post_accumulate_grad_hook(fn), which graphc calls once per step; to "
            "change an activation's gradient, call a torch.autograd.Function in build().")


def check_global_hooks(line: Optional[str] = None) -> None:
    """Refuses torch's global module hooks (NOTE: Module hooks)."""
    found = [t for t in GLOBAL_HOOK_TABLES if getattr(torch_module, t)]
    if found:
        raise GraphcError(
            f"torch has global module hooks ({', '.join(found)}, e.g. from "
            "torch.nn.modules.module.register_module_forward_hook) while graphc traces build()"
            f"{' at ' + line if line else ''}. They run on every module call, graphc's own stage "
            "programs included, so the compiled step could not run them as eager does. Fix: "
            "remove them (handle.remove()) before the Graph's first call and register the hooks "
            "on the modules that need them (module.register_forward_hook(fn)), which graphc traces.")
