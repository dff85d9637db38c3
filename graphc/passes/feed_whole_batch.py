"""feed_whole_batch: what each micro-batch needs of the whole batch.

Invariant: each stage program lists in `whole_inputs` the user inputs without a batch
dim (META_BATCHED false: every micro-batch receives them whole), and every mean class
loss whose denominator depends on the data (cross_entropy / nll_loss with class-index
targets: the count of targets not equal to ignore_index, weighted by class weights)
computes its sum divided by the whole batch's count (graphc/ops/loss.py). The count is a
program input that the stage's Prologue computes once per step, before any micro-batch,
from the targets of every micro-batch (the target's computation copied from the
program), summed over the ranks the targets are split across. This runs only when it
matters: with accumulation > 1, or when the loss's targets are split over ranks.
Requires: split_stages (programs), localize_ops (cross_entropy_partial on split rows).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..errors import GraphcError
from ..ops.loss import cross_entropy_over_batch, nll_loss_over_batch, target_count
from ..meta import META_BATCHED, META_SBP, META_TENSOR, TensorMeta
from ..placement import Split
from ..plan.program import Prologue, StageProgram
from ..sbp.layout import coord, flat
from ..sbp.local_ops import cross_entropy_partial

_OVER_BATCH = {F.cross_entropy: cross_entropy_over_batch, cross_entropy_partial: cross_entropy_over_batch,
               F.nll_loss: nll_loss_over_batch, nn.CrossEntropyLoss: cross_entropy_over_batch,
               nn.NLLLoss: nll_loss_over_batch}
# arguments after (input, target) when passed by position
_POSITIONAL = {F.cross_entropy: ("weight", "size_average", "ignore_index", "reduce", "reduction",
                                 "label_smoothing"),
               F.nll_loss: ("weight", "size_average", "ignore_index", "reduce", "reduction")}


def feed_whole_batch(programs: Sequence[StageProgram], gm: fx.GraphModule,
                     num_microbatches: int) -> List[StageProgram]:
    unsplit = {n.name for n in gm.graph.nodes
               if n.op == "placeholder" and not n.meta.get(META_BATCHED, True)}
    for prog in programs:
        prog.whole_inputs = tuple(name for name in prog.user_inputs if name in unsplit)
        losses = [n for n in prog.module.graph.nodes if _needs_whole_count(prog, n, num_microbatches)]
        if losses:
            _normalise_by_batch(prog, losses, num_microbatches)
    return list(programs)


def _loss_kind(prog: StageProgram, node: fx.Node):
    if node.op == "call_function":
        return node.target if node.target in _OVER_BATCH else None
    if node.op == "call_module":
        kind = type(prog.module.get_submodule(node.target))
        return kind if kind in _OVER_BATCH else None
    return None


def _needs_whole_count(prog: StageProgram, node: fx.Node, m: int) -> bool:
    kind = _loss_kind(prog, node)
    if kind is None or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
        return False
    settings = _settings(prog, node)
    target = node.args[1].meta.get(META_TENSOR)
    class_indices = target is not None and not getattr(torch, target.dtype).is_floating_point
    legacy = settings.get("size_average") is not None or settings.get("reduce") is not None
    return (settings["reduction"] == "mean" and not legacy and class_indices
            and (m > 1 or kind is cross_entropy_partial))


def _settings(prog: StageProgram, node: fx.Node) -> Dict[str, object]:
    """reduction, ignore_index, weight (a node or None) and label_smoothing of the loss."""
    if node.op == "call_module":
        mod = prog.module.get_submodule(node.target)
        out = {"reduction": mod.reduction, "ignore_index": mod.ignore_index,
               "weight": None if mod.weight is None else f"{node.target}.weight"}
        if isinstance(mod, nn.CrossEntropyLoss):
            out["label_smoothing"] = mod.label_smoothing
        return out
    kw = dict(zip(_POSITIONAL.get(node.target, ()), node.args[2:]))
    kw.update(node.kwargs)
    kw.setdefault("reduction", "mean")
    kw.setdefault("ignore_index", -100)
    kw.setdefault("weight", None)
    return kw


def _normalise_by_batch(prog: StageProgram, losses: List[fx.Node], m: int) -> None:
    pro = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    inputs: List[str] = []
    outputs, counts, groups = [], [], []
    for node in losses:
        target, settings = node.args[1], _settings(prog, node)
        _copy_chain(prog, node, target, pro, env, inputs)
        weight = settings["weight"]
        if isinstance(weight, str):
            weight = pro.get_attr(weight)
        elif isinstance(weight, fx.Node):
            weight = _copy_chain(prog, node, weight, pro, env, inputs)
        dtype = getattr(torch, node.args[0].meta[META_TENSOR].dtype)
        counts.append(pro.call_function(target_count, (env[target], settings["ignore_index"], weight, dtype)))
        outputs.append(f"graphc_count_{node.name}")
        groups.append(_split_groups(node, target))
    pro.output(tuple(counts))
    prog.prologue = Prologue(fx.GraphModule(prog.module, pro, class_name=f"Stage{prog.stage}Prologue"),
                             inputs, outputs, groups)
    for node, name in zip(losses, outputs):
        dtype = node.args[0].meta[META_TENSOR].dtype
        _rewrite(prog, node, add_step_input(prog, name, TensorMeta((), dtype, False)), m)
    prog.module.graph.lint()
    prog.module.recompile()


def _copy_chain(prog: StageProgram, loss: fx.Node, value: fx.Node, pro: fx.Graph, env, inputs) -> fx.Node:
    """Copies into the prologue the program's computation of `value` from user inputs."""
    if value in env:
        return env[value]
    if value.op == "placeholder":
        if value.name not in prog.user_inputs:
            raise _not_from_inputs(loss, value, f"'{value.name}', a value received from another stage")
        env[value] = pro.placeholder(value.name)
        inputs.append(value.name)
        return env[value]
    if value.op in ("get_attr", "call_module") and _trained(prog, value):
        raise _not_from_inputs(loss, value, f"the parameters of '{value.target}'")
    for a in value.all_input_nodes:
        _copy_chain(prog, loss, a, pro, env, inputs)
    env[value] = pro.node_copy(value, lambda a: env[a])
    return env[value]


def _trained(prog: StageProgram, node: fx.Node) -> bool:
    """Does a get_attr or module call read a parameter that requires grad?"""
    if node.op == "call_module":
        return any(p.requires_grad for p in prog.module.get_submodule(node.target).parameters())
    params = dict(prog.module.named_parameters())
    return node.target in params and params[node.target].requires_grad


def _split_groups(node: fx.Node, target: fx.Node) -> tuple:
    """The rank groups over which the loss's targets are split: their counts add up."""
    sig = node.meta.get(META_SBP)
    need: Optional[tuple] = sig.needs(target.name) if sig is not None else None
    if not need or not any(isinstance(s, Split) for s in need):
        return ()
    whole_axes = [a for a, s in enumerate(need) if not isinstance(s, Split)]
    by_key: Dict[tuple, List[int]] = {}
    for r in flat(sig.mesh):
        by_key.setdefault(tuple(coord(sig.mesh, r)[a] for a in whole_axes), []).append(r)
    return tuple(tuple(g) for g in by_key.values())


def add_step_input(prog: StageProgram, name: str, meta: TensorMeta) -> fx.Node:
    """A new program input, after the others (inputs are positional, in placeholder order):
    a value the stage's Prologue computes once per step."""
    graph = prog.module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # a value received from another stage may be a placeholder after computing nodes (the
    # router logits a MoE aux loss reads); placeholders take no input, so gather them first
    first_compute = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for ph in placeholders:
        if first_compute is not None:
            first_compute.prepend(ph)
    last = placeholders[-1]
    with graph.inserting_after(last):
        ph = graph.placeholder(name)
    ph.meta[META_TENSOR] = meta
    prog.inputs.append(name)
    return ph


def _rewrite(prog: StageProgram, node: fx.Node, count: fx.Node, m: int) -> None:
    settings = _settings(prog, node)
    fn = _OVER_BATCH[_loss_kind(prog, node)]
    kwargs = {k: v for k, v in settings.items() if k not in ("reduction", "weight", "size_average", "reduce")}
    weight = settings["weight"]
    if isinstance(weight, str):  # a loss module's class weights: read them in the program
        with prog.module.graph.inserting_before(node):
            weight = prog.module.graph.get_attr(weight)
    if weight is not None:
        kwargs["weight"] = weight
    node.op, node.target = "call_function", fn
    node.args, node.kwargs = (node.args[0], node.args[1], count, m), kwargs


def _not_from_inputs(loss: fx.Node, value: fx.Node, what: str) -> GraphcError:
    trace = loss.meta.get("stack_trace", "").strip().splitlines()
    where = f"{trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else loss.format_node()
    return GraphcError(
        f"the loss at {where} (node '{loss.name}') is a mean over its targets that are not "
        "ignore_index (weighted by class weights); micro-batches hold different numbers of "
        "them, so graphc divides by the whole batch's count, computed from the targets before "
        f"any micro-batch runs. But its targets depend on {what}, known only while the "
        "micro-batches run. Fix: compute the targets outside build() and pass them as an "
        "input used only by the loss, or use self.config.set_gradient_accumulation_steps(1).")
