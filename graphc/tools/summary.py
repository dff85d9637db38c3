"""stage_summary(): a compact account of every stage's plans, for `graphc plan`'s stages.txt.

Ranks of one stage run the same program: their plans list the same instructions in the
same order and differ only in peers (which replica a transfer goes to) and groups (which
ranks a collective joins). So one listing per stage, plus what varies, describes a
thousand-rank job. For each stage the summary gives its ranks, whether they all run one
instruction sequence (else the variants and their ranks), the count of each kind of
instruction in one step, the bytes sent and received per step and the peers' stages,
the collectives by kind and group size, on a stage of several ranks how much of it runs
replicated after an op without an SBP rule (See NOTE: Replicated compute, replicated.py),
and which rank<r>.txt files were written.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Sequence

from ..plan.instructions import INSTRUCTIONS, AllReduce, Collective, Instruction, Recv, Send
from .replicated import replicated_compute
from .rows import ranges


def stage_summary(name: str, compiled, written: Sequence[int] = ()) -> str:
    """The text of stages.txt for one compiled graph (see the module docstring).

    Args:
        name: the graph's class name, for the header.
        compiled: a CompiledGraph.
        written: the ranks whose rank<r>.json / .txt files were written.
    """
    plans, stages = compiled.plans, compiled.stages
    head = plans[0]
    lines = [f"# graphc plan summary: {name}, {len(plans)} rank(s), {len(stages)} stage(s), "
             f"schedule={head.schedule}, {compiled.num_microbatches} micro-batch(es), "
             f"{'training' if compiled.training else 'inference'}",
             "# per stage: one step of one rank; ranks of a stage differ only in peers and "
             "groups unless variants are listed"]
    labels: Dict[int, str] = {}           # id(instruction) -> label: objects are shared
    seen = set()
    replicated = replicated_compute(compiled)
    for info in stages:
        ranks = list(info.ranks)
        if tuple(ranks) in seen:          # a rank holding several stages (chunks): once
            continue
        seen.add(tuple(ranks))
        held = [s.stage_id for s in stages if tuple(s.ranks) == tuple(ranks)]
        block = _stage_lines(held, ranks, plans, labels, set(written))
        block[-1:-1] = [f"  {replicated[s]}" for s in held if s in replicated]  # before "plans written"
        lines += block
    staged = {r for s in stages for r in s.ranks}
    idle = [r for r in range(len(plans)) if r not in staged]
    if idle:
        lines.append(f"idle: ranks {ranges(idle)} hold no stage")
    return "\n".join(lines)


def _stage_lines(held: List[int], ranks: List[int], plans, labels, written) -> List[str]:
    what = "stage" if len(held) == 1 else "stages"
    out = [f"{what} {', '.join(map(str, held))}: ranks {ranges(ranks)} ({len(ranks)} rank(s))"]
    variants: Dict[tuple, List[int]] = {}
    # of a world of templates, each rank's template: the same labels (NOTE: Plan templates),
    # read once per template
    labelled = getattr(plans, "plan_or_template", plans.__getitem__)
    shapes: Dict[int, tuple] = {}
    for r in ranks:
        plan = labelled(r)
        shape = shapes.get(id(plan))
        if shape is None:
            shape = shapes[id(plan)] = tuple(labels.get(id(i)) or labels.setdefault(id(i), i.label)
                                             for i in plan.instructions)
        variants.setdefault(shape, []).append(r)
    if len(variants) > 1:
        out.append(f"  {len(variants)} instruction sequences: " + "; ".join(
            f"ranks {ranges(rs)}" for rs in variants.values()))
    for rs in variants.values():
        plan = plans[rs[0]]
        prefix = "  " if len(variants) == 1 else f"  ranks {ranges(rs)}: "
        out.append(prefix + _counts(plan.instructions))
        out += [f"    {line}" for line in _traffic(plan.instructions, plans[rs[0]].stages)]
    files = [r for r in ranks if r in written]
    out.append(f"  plans written: {', '.join(f'rank{r}.txt' for r in files)}" if files else
               "  plans written: none (choose with --ranks)")
    return out


def _counts(instructions: Sequence[Instruction]) -> str:
    kinds = Counter(i.word for i in instructions)
    parts = [f"{kinds[cls.word]} {cls.word}" for cls in INSTRUCTIONS if kinds[cls.word]]
    return f"{len(instructions)} instructions a step: " + ", ".join(parts)


# the kinds that reduce (or gather) gradients over a group: AllReduce and every kind built on it
_GRADIENT_COLLECTIVES = frozenset(cls for cls in INSTRUCTIONS if issubclass(cls, AllReduce))


def _traffic(instructions: Sequence[Instruction], stages) -> List[str]:
    """Bytes sent and received per peer stage, and collectives by kind and group size."""
    sent, got, colls, count = Counter(), Counter(), Counter(), Counter()
    for ins in instructions:   # by kind exactly
        kind = type(ins)
        if kind is Send:
            sent[ins.peer_stage] += ins.nbytes
        elif kind is Recv:
            got[ins.peer_stage] += ins.nbytes
        elif kind is Collective:      # a conversion: the bytes this rank sends
            key = (ins.kind, len(ins.ranks), "sent")
            colls[key] += ins.nbytes
            count[key] += 1
        elif kind in _GRADIENT_COLLECTIVES:   # gradients (tie, clip, ZeRO): the buffer reduced
            key = (ins.word.lower(), len(ins.ranks), "reduced")
            colls[key] += sum(t.nbytes for t in ins.tensors)
            count[key] += 1
    out = []
    if sent or got:
        out.append("transfers a step: " + ", ".join(
            [f"sends {_mib(b)} to stage {s}" for s, b in sorted(sent.items())] +
            [f"receives {_mib(b)} from stage {s}" for s, b in sorted(got.items())]))
    if colls:
        out.append("collectives a step: " + ", ".join(
            f"{count[k]} {k[0]} over {k[1]} ranks ({_mib(b)} {k[2]})" for k, b in sorted(colls.items())))
    return out


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3f} MiB"
