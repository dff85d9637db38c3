"""What compiler.compile reads of a Graph, taken when it compiles: `compile_spec(graph)`.

The one place that turns the user's Graph (its root, config, per-module settings and the
layouts to_global declared) into the compiler's input value, a CompileSpec; below the
Graph class (graph.py calls it), above the settings and tensors it reads (config.py,
global_tensor.py), so neither of those needs the compiler.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from .compiler import CompileSpec, ModuleSpec
from .errors import GraphcError
from .passes.insert_zero_units import UnitOptions
from .global_tensor import declared_layout
from .sbp.declared import DeclaredLayouts


def compile_spec(graph):
    """What compiler.compile reads of a Graph, taken now (NOTE in compiler.CompileSpec): the
    traced root, the options and per-module settings, and a snapshot of what to_global
    declared for its parameters and buffers, by every name each has (a tied weight under
    each)."""
    root, cfg = graph._root, graph.config
    named = (list(root.named_parameters(remove_duplicate=False))
             + list(root.named_buffers(remove_duplicate=False)))
    declared = DeclaredLayouts({name: layout for name, t in named for layout in [declared_layout(t)] if layout})
    modules = {name: ModuleSpec(c.stage_id, c.placement, c.activation_checkpointing)
               for name, c in graph._module_configs.items()}
    return CompileSpec(
        name=type(graph).__name__, source_file=_source_file(type(graph)), root=root,
        modules=modules, declared=declared,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        pipeline_schedule=cfg.pipeline_schedule, deferred_batch_norm=cfg.deferred_batch_norm,
        gradient_bucket_bytes=cfg.gradient_bucket_bytes, grad_clip_norm=cfg.grad_clip_norm,
        activation_checkpointing=cfg.activation_checkpointing, whole_inputs=cfg.whole_inputs,
        amp_dtype=cfg.amp_dtype, zero_stage=cfg.zero_stage,
        zero_shard_min_size=cfg.zero_shard_min_size,
        zero_units=UnitOptions(cfg.zero_unit_bytes, cfg.zero_reshard_after_forward, cfg.zero_gather_per_step),
        grad_reduce_dtype=cfg.grad_reduce_dtype,
        param_dtype=checked_param_dtype(graph), sequence_parallel=cfg.sequence_parallel,
        context_parallel=cfg.context_parallel, expert_capacity=cfg.expert_capacity)


def checked_param_dtype(graph) -> Optional[torch.dtype]:
    """config.set_param_dtype's dtype, once what it needs is known (the first compile)."""
    cfg = graph.config
    if cfg.param_dtype is None:
        return None
    if graph._optimizer is None:
        raise GraphcError(
            f"{type(graph).__name__}: config.set_param_dtype keeps the float32 master copy in "
            "the optimizer, but the graph has none. Fix: call self.add_optimizer(...) in "
            "__init__, or cast the model yourself (model.to(torch.bfloat16)) for inference.")
    if graph._compiled is None:
        odd = sorted({str(p.dtype) for p in graph._root.parameters()
                      if p.is_floating_point() and p.dtype != torch.float32})
        if odd:
            raise GraphcError(
                f"{type(graph).__name__}: config.set_param_dtype needs float32 parameters (they "
                f"become the masters), found {odd}. Fix: build the model in float32 "
                "(model.float()) and let set_param_dtype store it in the low dtype.")
    return cfg.param_dtype


def _source_file(cls: type):
    """The file defining the Graph class, for error messages pointing into it (None when
    Python knows none: a built-in, or a class typed at the interpreter)."""
    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None
