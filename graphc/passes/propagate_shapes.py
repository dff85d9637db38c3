"""propagate_shapes: records every node's per-micro-batch shape, dtype and requires_grad.

Invariant: every node producing a tensor has node.meta[META_TENSOR] (a TensorMeta for
one micro-batch); other nodes have None. Placeholders split into micro-batches carry
META_BATCHED. Runs on fake tensors, so no real compute or memory is spent, and every
receive buffer's shape is known at compile time (no step ever exchanges shapes).
Parameters and buffers are read as fakes and modules run on fakes of their own state, so
compiling changes nothing the user owns (BatchNorm's running statistics and counter).
Each node runs in the grad mode build() traced it in (META_GRAD_ENABLED), so a value
computed under torch.no_grad() does not require grad.
Requires: trace_build.

NOTE: Planning meta models
A model built under `with torch.device("meta"):` has shapes and no memory, so `graphc plan`
(and `--auto`) can plan one far larger than the machine: its parameters are read as fakes
on the CPU (build_tracer.cpu_fake, as a model already on its GPU: NOTE: CUDA placement), so
ops mixing them with the CPU inputs run; the simulator and the
memory model read only shapes. Such a graph cannot train (no values): plan mode only.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager

from typing import Optional, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import GraphcError
from ..meta import META_AUTOCAST, META_BATCHED, META_GRAD_ENABLED, META_TENSOR, TensorMeta, is_backward
from .build_tracer import CompileFakes, cpu_fake, run_module_on_fakes
from .trace_build import microbatch_shape


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor],
                     num_microbatches: int, fakes: Optional[CompileFakes] = None) -> fx.GraphModule:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise GraphcError(f"{type(gm).__name__}.build() takes {len(placeholders)} inputs "
                          f"({', '.join(p.name for p in placeholders)}), found {len(example_inputs)}")
    fakes = _Fakes(gm, CompileFakes() if fakes is None else fakes)   # NOTE: One fake mode per compile
    mode = fakes.mode
    env = {}
    with mode:
        for node, value in zip(placeholders, example_inputs):
            env[node] = _microbatch_fake(node, value, num_microbatches)
        interp = fx.Interpreter(gm)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                pass
            elif is_backward(node):
                env[node] = None
            elif node.op == "output":
                continue
            else:
                with torch.set_grad_enabled(node.meta.get(META_GRAD_ENABLED, True)), \
                        _autocast(node.meta.get(META_AUTOCAST, ())):
                    env[node] = _run_node(interp, node, env, fakes)
            node.meta[META_TENSOR] = TensorMeta.of(env[node]) if isinstance(env[node], torch.Tensor) else None
    return gm


@contextmanager
def _autocast(state):
    """The node's autocast regions (NOTE: Autocast regions), so its dtype is eager's."""
    if not state:
        yield
        return
    with ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, getattr(torch, dtype)))
        yield


def _microbatch_fake(node, value: torch.Tensor, m: int):
    batched = node.meta.get(META_BATCHED, value.dim() >= 1)  # trace_build decided it
    node.meta[META_BATCHED] = batched
    shape = microbatch_shape(value.shape, m, batched, node.name)
    return torch.empty(shape, dtype=value.dtype)  # fake: created under the FakeTensorMode


class _Fakes:
    """Fakes of the graph's parameters and buffers (one per real tensor, so ties stay tied)."""

    def __init__(self, gm: fx.GraphModule, compile_fakes: CompileFakes):
        self.gm, self.mode, self.parameters = gm, compile_fakes.mode, compile_fakes.parameters
        self.stand_ins: dict = {}   # cpu_fake's memo

    def of(self, value):
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            return cpu_fake(self.mode, value, self.stand_ins, self.parameters)   # on the CPU (NOTE: CUDA placement)
        return value

    def attr(self, target: str):
        value = self.gm
        for part in target.split("."):
            value = getattr(value, part)
        return self.of(value)

    def call_module(self, target: str, args, kwargs):
        return run_module_on_fakes(self.gm.get_submodule(target), args, kwargs, self.of)


def _run_node(interp: fx.Interpreter, node: fx.Node, env, fakes: _Fakes):
    args = fx.node.map_aggregate(fx.node.map_arg(node.args, lambda n: env[n]), fakes.of)
    kwargs = fx.node.map_aggregate(fx.node.map_arg(node.kwargs, lambda n: env[n]), fakes.of)
    try:
        if node.op == "get_attr":
            return fakes.attr(node.target)
        if node.op == "call_module":
            return fakes.call_module(node.target, args, kwargs)
        return getattr(interp, node.op)(node.target, args, kwargs)
    except GraphcError:
        raise
    except Exception as e:
        where = node.meta.get("stack_trace", "").strip().splitlines()
        line = where[-2].strip() + " " + where[-1].strip() if len(where) >= 2 else node.format_node()
        shapes = [f"{a.name}: {a.meta.get(META_TENSOR)}" for a in node.all_input_nodes]
        raise GraphcError(
            f"node '{node.name}' ({node.op} {node.target}) fails on one micro-batch's shapes "
            f"[{'; '.join(shapes)}]\n  at {line}\n  found: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}\n  Fix: check the shapes the module "
            "expects; with gradient accumulation each call of build() sees batch / steps rows.") from e
