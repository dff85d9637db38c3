"""Stage programs moved to the device their rank runs them on.

NOTE: CUDA placement
graphc traces build() on CPU stand-ins of the inputs (InputSpec.example), also for a stage
placed on "cuda": tracing needs no GPU, and `graphc plan` compiles a cuda program on a
machine without one; a model already on its GPU is traced on CPU fakes of its parameters
and buffers too (passes/build_tracer.py: cpu_fake). What a trace reads of a value's device
is therefore the CPU: GPT's
`torch.arange(t, device=idx.device)` becomes a tensor constant on the CPU (fx's
`_tensor_constant0`, a buffer of the stage program), and a call that passes `x.device`
keeps `device=cpu` as an argument. The parameters and the buffers of the user's state
dict are moved by GraphState.take_ownership; a non-persistent buffer (a rotary embedding's
`inv_freq`) is not in the state dict and was left on the CPU too. Before a rank runs a
stage program on its GPU, `place_program` moves every buffer and tensor constant the
program reads to that device (as Module.to does: in place through `.data` where the
two tensor types allow it, CPU to CUDA, so a module holding it keeps its object) and
rewrites each `torch.device("cpu")` argument to the rank's device, so the program runs as
build() does in eager PyTorch on the GPU: every value on the device of its inputs.

The one program this changes is one that puts a value on the CPU on purpose with a
`torch.device("cpu")` object inside build(); `.cpu()` and `.to("cpu")` (a string) are kept.
Values build() moves to the CPU are host reads inside a training step, which graphc's
one-stream plan does not overlap anyway; write them outside build().
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.fx as fx

from ..plan.program import StageProgram

def place_programs(programs: Iterable[StageProgram], device: torch.device) -> None:
    """Every program of this rank placed on `device` (NOTE: CUDA placement); a no-op on the CPU."""
    if device.type == "cpu":
        return
    for prog in programs:
        place_program(prog.module, device)
        if prog.prologue is not None:
            place_program(prog.prologue.module, device)


def place_program(module: fx.GraphModule, device: torch.device) -> None:
    """One stage program's buffers, tensor constants and device arguments on `device`."""
    moved: Dict[int, torch.Tensor] = {}   # a tensor held under two names stays one tensor
    for name, t in _constants(module):
        if t.device == device:
            continue
        new = moved.setdefault(id(t), t.to(device))
        if torch._has_compatible_shallow_copy_type(t, new):   # CPU -> CUDA: the same object
            t.data = new
            continue
        owner, attr = _owner(module, name)   # e.g. the meta device: the holder gets the new one
        if attr in owner._buffers:
            owner._buffers[attr] = new
        else:
            setattr(owner, attr, new)
    changed = [n for n in module.graph.nodes
               if n.op in ("call_function", "call_method", "call_module") and _reads_cpu(n)]
    for node in changed:
        node.args = fx.node.map_aggregate(node.args, lambda a: device if _is_cpu(a) else a)
        node.kwargs = fx.node.map_aggregate(node.kwargs, lambda a: device if _is_cpu(a) else a)
    if changed:
        module.recompile()


def _constants(module: fx.GraphModule) -> List[Tuple[str, torch.Tensor]]:
    """(qualified name, tensor) of what a program reads that is no parameter: its buffers
    (persistent or not) and the tensors its get_attr nodes fetch."""
    found = dict(module.named_buffers(remove_duplicate=False))
    for node in module.graph.nodes:
        if node.op == "get_attr" and node.target not in found:
            owner, attr = _owner(module, node.target)
            t = getattr(owner, attr, None)
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                found[node.target] = t
    return list(found.items())


def _owner(module: torch.nn.Module, target: str) -> Tuple[torch.nn.Module, str]:
    *path, attr = target.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def _reads_cpu(node: fx.Node) -> bool:
    found = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.append(a) if _is_cpu(a) else a)
    return bool(found)


def _is_cpu(arg) -> bool:
    return isinstance(arg, torch.device) and arg.type == "cpu"
