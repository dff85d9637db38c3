"""insert_zero_units: ZeRO stage 3 gathered unit by unit inside each stage program.

Invariant: on a training plan at ZeRO stage 3 computed by Forward and Backward instructions
(whole, split into BackwardInput and BackwardWeight, or paired in DualPipeV's OverlapFB) over
one data-parallel group (a rank holding one stage, or several chunks: each of its
stages alike), the whole-stage ALL_GATHER and RELEASE are gone; the stage's sharded
parameters are cut into units (consecutive modules, in order of
first use, each closed once it reaches `unit_bytes`); each compute is followed by the unit
gathers and releases it runs (`0F1.GATHER u2`), in the order it runs them (an overlapped
pair: its forward's, then its backward's, as the pair runs them); the stage program calls
zero_unit_begin(k) before unit k's first use and zero_unit_end(k) after its last (views
followed); the group's REDUCE_SCATTERs are one per unit, in backward order (a chunk whose
last backward runs later, later). Any other stage-3
plan keeps insert_zero_sync's whole-stage gathers (the plan's zero note says which).
See NOTE: ZeRO units in graphc/runtime/zero_units.py.
Requires: insert_zero_sync (stage 3).
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch.fx as fx

from ..ops.zero_units import zero_unit_begin, zero_unit_end
from ..meta import META_TENSOR
from ..plan.instructions import (COMPUTE, AllGather, Backward, BackwardInput, BackwardWeight, Forward,
                                 OverlapFB, PrePass, ReduceScatter, ReleaseParams, TensorSpec,
                                 UnitGather, UnitRelease)
from ..plan.plan import ZERO_NOTE, ExecutionPlan, checkpointed_microbatches
from ..plan.program import StageProgram


@dataclass(frozen=True)
class UnitOptions:
    """How stage 3 gathers per unit (config.enable_zero): the unit size, and per stage whether a
    unit is freed after its forward and whether it is kept whole across micro-batches."""

    unit_bytes: int = 0                      # 0: units off (the whole stage, once per step)
    reshard_after_forward: Tuple[Tuple[int, bool], ...] = ()   # (stage, on), stage -1: every stage; absent: on
    gather_per_step: Tuple[Tuple[int, bool], ...] = ()         # (stage, per step); absent: per micro-batch

    def reshard(self, stage: int) -> bool:
        chosen = dict(self.reshard_after_forward)
        return chosen.get(stage, chosen.get(-1, True))

    def per_step(self, stage: int) -> bool:
        chosen = dict(self.gather_per_step)
        return chosen.get(stage, chosen.get(-1, False))


def insert_zero_units(plans: Sequence[ExecutionPlan], programs: Sequence[StageProgram],
                      options: UnitOptions) -> List[ExecutionPlan]:
    if not options.unit_bytes:
        return list(plans)
    by_stage = {p.stage: p for p in programs}
    placed: Dict[int, PlacedUnits] = {}   # stage -> its units (fx nodes placed once)
    for plan in plans:
        if not _unit_plan(plan):
            _warn_pre_pass(plan)
            continue
        gathers = [ins for ins in plan.instructions if type(ins) is AllGather]
        mine = _specs_by_stage(gathers, by_stage, plan.local_stages)
        for stage, specs in mine.items():
            if stage not in placed:
                placed[stage] = place_units(by_stage[stage].module, specs, options.unit_bytes)
        _rewrite(plan, gathers[0].ranks, {s: placed[s] for s in mine}, options)
    return list(plans)


# a whole backward, or a split backward's halves: each reads the units' parameters autograd
# saved (a weight half runs the nodes that lead to the parameters again, which unpack them)
BACKWARDS = (Backward, BackwardInput, BackwardWeight)


def _unit_plan(plan: ExecutionPlan) -> bool:
    """Whether this plan's stage-3 parameters can be gathered per unit: stage 3, forwards and
    backwards (whole, split, or an overlapped pair of a forward and a whole backward), one
    data-parallel group (one local stage or several chunks)."""
    if not plan.training or not plan.notes.get(ZERO_NOTE, "").startswith("stage 3"):
        return False
    if any(isinstance(part, COMPUTE) and type(part) not in (Forward,) + BACKWARDS
           for ins in plan.instructions for part in _halves(ins)):
        return False
    groups = {tuple(ins.ranks) for ins in plan.instructions if type(ins) is AllGather}
    return len(groups) == 1


def _warn_pre_pass(plan: ExecutionPlan) -> None:
    """A pre-pass (NOTE: Whole-batch sums) reads the parameters outside the units' calls."""
    pre = next((ins for ins in plan.instructions if isinstance(ins, PrePass)), None)
    if pre is not None and plan.notes.get(ZERO_NOTE, "").startswith("stage 3"):
        logging.getLogger("graphc").warning(
            "rank %d: enable_zero(unit_bytes=...) gathers stage %d whole once per step instead of unit "
            "by unit: its pre-pass for whole-batch sums (%s, See NOTE: Whole-batch sums) reads the "
            "parameters outside the units. Fix: set_gradient_accumulation_steps(1) or no auxiliary "
            "loss for units", plan.rank, pre.stage, pre)


def _specs_by_stage(gathers: List[AllGather], by_stage: Dict[int, StageProgram],
                    local_stages) -> Dict[int, List[TensorSpec]]:
    """Each local stage's sharded parameters (those of its program that the gathers name),
    in the gathers' order; stages with none left out."""
    out: Dict[int, List[TensorSpec]] = {}
    for stage in local_stages:
        names = {n for n, _ in by_stage[stage].module.named_parameters(remove_duplicate=False)}
        specs = list({t.name: t for ins in gathers for t in ins.tensors if t.name in names}.values())
        if specs:
            out[stage] = specs
    return out


# -- units in the stage program ----------------------------------------------------------
# ops whose result may share its input's storage: a unit is in use while any such result is
_VIEWS = {"t", "view", "reshape", "transpose", "permute", "expand", "contiguous", "to", "type_as",
          "unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "split", "chunk", "unbind",
          "detach", "as_strided", "view_as", "expand_as", "movedim", "float", "double", "half",
          "bfloat16", "getitem", "__getitem__", "select", "slice", "T", "mT", "swapaxes",
          "transpose_", "t_", "real", "imag", "diagonal", "unfold", "alias"}


def _is_view(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return target is operator.getitem or name in _VIEWS


def _readers(param: fx.Node) -> List[fx.Node]:
    """The nodes that read `param`'s storage: its users, and through views theirs."""
    seen, todo = [], list(param.users)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.append(node)
        if _is_view(node):
            todo.extend(node.users)
    return seen


def _group_units(order: List[str], nbytes: Dict[str, int], unit_bytes: int) -> List[List[str]]:
    """Parameters in order of first use cut into units: a module's parameters stay together,
    consecutive modules join a unit until it holds `unit_bytes`."""
    units, current, size, owner = [], [], 0, None
    for name in order:
        module = name.rsplit(".", 1)[0]
        if current and module != owner and size >= unit_bytes:
            units.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes[name]
        owner = module
    if current:
        units.append(current)
    return units


# ops whose backward needs a parameter only for the gradient of their other inputs
_LINEAR_IN_WEIGHT = {"linear", "conv1d", "conv2d", "conv3d", "embedding", "matmul", "mm", "addmm", "bmm"}
_WEIGHT_SECOND = {"linear", "conv1d", "conv2d", "conv3d", "embedding"}   # f(input, weight, bias, ...)


def _requires_grad(node) -> bool:
    tensor = node.meta.get(META_TENSOR) if isinstance(node, fx.Node) else None
    return isinstance(node, fx.Node) and (tensor is None or bool(getattr(tensor, "requires_grad", True)))


def _read_in_backward(readers: List[fx.Node], params: List[fx.Node]) -> bool:
    """Whether autograd keeps a unit's parameters for the backward: it does not when every
    reader is linear in them and no other input of it needs a gradient (the first layer on
    the batch: its weight's gradient reads only the input). A wrong guess costs a gather
    made when the backward reads it (NOTE: ZeRO units), not a wrong number."""
    for r in readers:
        name = r.target if isinstance(r.target, str) else getattr(r.target, "__name__", "")
        if name in _WEIGHT_SECOND and len(r.args) > 1 and r.args[1] in params:
            others = [r.args[0]]     # (input, weight, bias): the bias's gradient reads no weight
        else:
            others = [a for a in r.all_input_nodes if a not in params]
        if name not in _LINEAR_IN_WEIGHT or any(_requires_grad(a) for a in others):
            return True
    return False


def place_units(gm: fx.GraphModule, specs: List[TensorSpec], unit_bytes: int) -> "PlacedUnits":
    """Cuts `specs` (the stage's sharded parameters) into units and puts zero_unit_begin(k)
    before unit k's first reader and zero_unit_end(k) after its last in `gm`. Returns the
    units, in forward order, and whether each is read in the backward."""
    by_name = {t.name: t for t in specs}
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    readers: Dict[str, List[fx.Node]] = {}
    param_nodes: Dict[str, List[fx.Node]] = {}
    for node in nodes:
        if node.op == "get_attr" and str(node.target) in by_name:
            readers.setdefault(str(node.target), []).extend(_readers(node))
            param_nodes.setdefault(str(node.target), []).append(node)
    order = sorted(readers, key=lambda n: min((position[r] for r in readers[n]), default=len(nodes)))
    names = _group_units(order, {n: by_name[n].nbytes for n in order}, unit_bytes)
    for k, unit in enumerate(names):
        used = [r for n in unit for r in readers[n]]
        first = min(used, key=position.__getitem__)
        last = max(used, key=position.__getitem__)
        with gm.graph.inserting_before(first):
            gm.graph.call_function(zero_unit_begin, (k,))
        if last.op != "output":   # a parameter returned as is stays whole to the backward
            with gm.graph.inserting_after(last):
                gm.graph.call_function(zero_unit_end, (k,))
    gm.recompile()
    unused = [t for t in specs if t.name not in readers]   # read by no op: gathered with the first unit
    units = [[by_name[n] for n in unit] for unit in names]
    backward = [_read_in_backward([r for n in unit for r in readers[n]],
                                  [p for n in unit for p in param_nodes[n]]) for unit in names]
    if unused:
        units = [unused + units[0]] + units[1:] if units else [unused]
        backward = backward or [False]
    return PlacedUnits(units, backward)


@dataclass(frozen=True)
class PlacedUnits:
    units: List[List[TensorSpec]]        # in forward order
    read_in_backward: List[bool]         # per unit: autograd keeps its parameters


# -- the plan ----------------------------------------------------------------------------
def unit_events(computes, units: int, reshard: bool, per_step: bool,
                read_in_backward: Optional[List[bool]] = None,
                recomputed=frozenset()) -> Dict[int, List[Tuple[str, int]]]:
    """Compute index -> the unit gathers ("G", k) and releases ("R", k) it runs, in order: a
    forward gathers what is not whole in forward order and, with `reshard`, releases each
    after its last use; a backward gathers in reverse order (those it reads) and releases each
    once done, except that `per_step` keeps them whole until the step's last backward, which
    releases every unit (the step makes a whole copy stale). A recomputed micro-batch's
    backward first runs its forward again, unit by unit, releasing each after its last use but
    the last (the backward's first), then gathers the rest again in reverse as a backward does;
    kept whole per step, it gathers every unit in forward order and keeps them."""
    read = read_in_backward or [True] * units
    whole, pinned, out = set(), set(), {}
    last_backward = max(i for i, ins in enumerate(computes) if isinstance(ins, BACKWARDS))
    for i, ins in enumerate(computes):
        events: List[Tuple[str, int]] = []

        def gather(k):
            if k not in whole:
                events.append(("G", k))
                whole.add(k)

        def release(k):
            if k in whole:
                events.append(("R", k))
                whole.discard(k)

        kept = per_step and i != last_backward
        # the recompute runs in a whole backward or a split one's input half
        again = isinstance(ins, (Backward, BackwardInput)) and ins.microbatch in recomputed
        if isinstance(ins, Forward):
            for k in range(units):
                gather(k)
                if reshard and k not in pinned:
                    release(k)
        elif again and kept:         # the forward again, every unit kept whole for the step
            for k in range(units):
                gather(k)
            pinned.update(range(units))
        else:
            if again:                # the forward again, unit by unit
                for k in range(units):
                    gather(k)
                    if k < units - 1:
                        release(k)
            for k in reversed(range(units)):
                if read[k]:
                    gather(k)
                if kept:
                    pinned.add(k)
                else:
                    release(k)
        out[i] = events
    return out


def _rewrite(plan: ExecutionPlan, ranks: Tuple[int, ...], placed: Dict[int, "PlacedUnits"],
             options: UnitOptions) -> None:
    """Each stage of `placed` gathered per unit: its computes followed by their unit events,
    the group's REDUCE_SCATTERs one per unit, where the first was, in the order the units'
    gradients become final (a later chunk's last backward runs first)."""
    computes = [part for ins in plan.instructions for part in _halves(ins)
                if isinstance(part, (Forward,) + BACKWARDS)]
    recomputed = checkpointed_microbatches(plan.checkpointing, plan.num_microbatches)
    events: Dict[int, List[Tuple[str, int]]] = {}
    for stage, units in placed.items():
        mine = [ins for ins in computes if ins.stage == stage]
        found = unit_events(mine, len(units.units), options.reshard(stage), options.per_step(stage),
                            units.read_in_backward, recomputed)
        events.update({id(ins): found[i] for i, ins in enumerate(mine)})
    last_backward = {ins.stage: i for i, ins in enumerate(computes) if isinstance(ins, BACKWARDS)}
    in_order = sorted(placed, key=lambda s: last_backward.get(s, -1))
    scattered = {t.name: t for ins in plan.instructions
                 if type(ins) is ReduceScatter and tuple(ins.ranks) == tuple(ranks) for t in ins.tensors}
    out = []
    for ins in plan.instructions:
        if type(ins) in (AllGather, ReleaseParams):
            continue                            # the whole stage's: gathered per unit instead
        if type(ins) is ReduceScatter and tuple(ins.ranks) == tuple(ranks):
            if scattered:                       # one per unit, in backward order, where the first was
                out.extend(ReduceScatter(ranks, tuple(scattered[t.name] for t in u))
                           for s in in_order for u in reversed(placed[s].units))
                scattered = {}
            continue
        out.append(ins)
        for part in _halves(ins):       # a pair's forward's events, then its backward's
            if id(part) in events:
                out.extend(_listed(part, events[id(part)], ranks, placed[part.stage].units))
    plan.instructions[:] = out
    plan.notes[ZERO_NOTE] = plan.notes[ZERO_NOTE].split("; parameters gathered")[0] + "".join(
        _unit_note(stage, len(placed[stage].units), options) for stage in sorted(placed))


def _halves(ins) -> tuple:
    """The computes an instruction runs one after the other: an OverlapFB's forward, then its
    backward (as the runtime runs the pair); any other instruction is itself."""
    return (ins.forward, ins.backward) if isinstance(ins, OverlapFB) else (ins,)


def _unit_note(stage: int, units: int, options: UnitOptions) -> str:
    reshard = "on" if options.reshard(stage) else "off"
    per = "once per step" if options.per_step(stage) else "per micro-batch"
    return (f"; stage {stage} gathered per unit: {units} unit(s) of <= {options.unit_bytes} bytes "
            f"or one module, reshard after forward {reshard}, gathered {per}")


def _listed(ins, events: List[Tuple[str, int]], ranks, units) -> list:
    """The unit gathers and releases a compute runs, in the order it runs them."""
    direction = ins.letter    # F, B, or a split backward's I or W: `0W1.GATHER u2`
    return [UnitGather(ranks, tuple(units[k]), ins.stage, ins.microbatch, direction, k) if kind == "G"
            else UnitRelease(tuple(units[k]), ins.stage, ins.microbatch, direction, k)
            for kind, k in events]
