"""simulate_classes(): a world of plan templates simulated by its templates alone.

NOTE: Simulated classes
A whole world compiled as templates (NOTE: Plan templates, plan/templates.py) is simulated
on its templates, one timeline per class (a template and the ranks its plan stands for),
without making the other ranks' plans: at 8192 ranks, 128 plans instead of 8192.

Why the step is the same. The simulation (simulate/__init__.py) solves one equation per
(rank, instruction, step): an end is a start plus a cost; a start is the previous end; a
send's arrival follows the sender's link history; a recv ends after its link's k-th arrival;
a collective ends its cost after the last member issues it. The plans are free of deadlock,
so the equations have one solution, which the engine finds. Let rho_d be the renaming that
swaps row 0 and row d (NOTE: Plan templates). Rank rho_d(r)'s plan is r's renamed, and the
costs are alike under rho_d when (checked by `renamed_costs_differ`, else every rank is
simulated): (1) a rank's compute costs are its template's (CostModel.compute reads the
instruction's stage and the rank's stage for its optimizer); (2) the link rho_d(a) ->
rho_d(b) costs what a -> b costs, for every link a template sends on; (3) a collective over
rho_d(G) costs what it costs over G (CostModel.collective reads the group only through its
size and its slowest link, so one instruction per group is compared). Then rho_d maps the
equations onto themselves, so it maps the solution onto a solution, the same one: every rank
of a class has its template's times. Restricted to the templates, the equations are closed:
a template's peers are in row 0 (NOTE: Plan templates, (B)), so its links' histories are
templates' sends; a group inside row 0 has templates as its members; a group of whole
columns waits for its last member, whose issue time is that of the member of row 0 in its
column, so waiting for the members in row 0 (the engine's `members`) gives the same time.
The step time (the latest end over ranks) and each rank's summary are therefore the
templates', exactly: the same floating-point operations on the same values. The `cores`
stretch counts every computing rank of the world. tests/tools/test_simulate_classes.py
compares the two simulations rank by rank on small worlds, and costs that differ by row
(a network whose nodes cut one row of replicas) fall back to the whole world.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Dict, Iterator, List, Optional

from ...log import get_logger
from ...plan.instructions import Send
from ...plan.plan import ExecutionPlan
from ...plan.templates import PlanWorld, rename
from ...runtime.trace import Span
from ..cost_model import CostModel
from .engine import _Simulation
from .peak import memory_peak
from .memory_walk import instruction_label
from .model_state import model_state
from .result import SimResult, SimTimeline

_log = get_logger("simulate")


def simulate_classes(world: PlanWorld, costs: CostModel, steps: int = 1, cores: Optional[int] = None,
                     model=None) -> Optional[SimResult]:
    """The simulation of every rank of `world`, run on its templates (NOTE: Simulated
    classes); None (said in the log) where the costs differ between rows."""
    why = renamed_costs_differ(world, costs)
    if why is not None:
        _log.info("simulating every rank's plan: %s", why)
        return None
    templates = [world.templates[r] for r in sorted(world.templates)]
    kept = set(world.templates)
    computing = sum(len(world.class_of(p.rank)) for p in templates if p.local_stages)
    sim = _Simulation(templates, costs, steps, cores, members=lambda group: tuple(r for r in group if r in kept),
                      computing=computing)
    sim.run()
    part = sim.result()
    if model is not None:
        add_model_state(part, world.templates, model, costs)
    return _whole_world(world, part)


def add_model_state(result: SimResult, plans: Dict[int, ExecutionPlan], model, costs: CostModel) -> None:
    """Each summarised rank's model-state bytes and predicted peak (NOTE: Model-state bytes),
    from its plan in `plans` (rank -> plan) and its parameters and inputs in `model`."""
    for r in result.ranks:
        params = model.params.get(r.rank, ())
        r.model_state = model_state(plans[r.rank], params)
        r.memory = memory_peak(plans[r.rank], params, costs, batch=model.batch.get(r.rank, 0))
    result.model_note = model.optimizer


def renamed_costs_differ(world: PlanWorld, costs: CostModel) -> Optional[str]:
    """Why some rank's costs are not its template's renamed (conditions (1)-(3) of NOTE:
    Simulated classes), or None."""
    if world.replaced_ranks:
        return f"rank(s) {world.replaced_ranks[:4]} were given plans of their own"
    for t in world.templates:
        stage = costs.stage_of_rank.get(t)
        odd = next((r for r in world.class_of(t) if costs.stage_of_rank.get(r) != stage), None)
        if odd is not None:
            return f"rank {odd}'s optimizer costs are not rank {t}'s"
    links, groups = _links_and_groups(world)
    for d in range(1, world.symmetry.rows):
        rho = world.renaming(d)
        for a, b in links:
            if costs.link(rho(a), rho(b)) != costs.link(a, b):
                return f"the link {rho(a)}->{rho(b)} costs other than {a}->{b}"
        for ins in groups:
            moved = rename(ins, rho, world.keeps_group)
            if costs.collective(moved) != costs.collective(ins):
                return f"a collective over {sorted(moved.ranks)[:8]} costs other than over {sorted(ins.ranks)[:8]}"
    return None


def _links_and_groups(world: PlanWorld):
    """The links the templates send on, and one collective per group they issue over that
    the renamings move (groups of whole columns stay)."""
    links, groups = set(), {}
    for plan in world.templates.values():
        for ins in plan.instructions:
            if isinstance(ins, Send):
                links.add((plan.rank, ins.peer))
            elif hasattr(ins, "ranks") and not world.keeps_group(ins.ranks):
                groups.setdefault(ins.ranks, ins)
    return sorted(links), list(groups.values())


def _whole_world(world: PlanWorld, part: SimResult) -> SimResult:
    """The templates' result as every rank's: each rank's summary and timeline its template's."""
    template_of = {r: t for t in world.templates for r in world.class_of(t)}
    by_template = {s.rank: s for s in part.ranks}
    ranks = [_as_rank(by_template[template_of[r]], r, world) for r in range(world.world_size)]
    timeline = ClassTimeline(part.timeline, template_of)
    classes = {t: world.class_of(t) for t in sorted(world.templates)}
    return SimResult(timeline, part.step_time, ranks, part.step_ends, part.steps, part.model_note,
                     classes=classes)


def _as_rank(summary, rank: int, world: PlanWorld):
    """A template's summary as another rank's of its class: its memory peak names the
    rank's own instruction there (the template's renamed: its peer or group)."""
    if rank == summary.rank:
        return summary
    memory = summary.memory
    if memory is not None:
        template, rho = world.templates[summary.rank], world.renaming(world.row_of(rank))

        def renamed(label: str) -> str:
            index, sep, _ = label.partition(": ")
            if not (sep and index.isdigit()):     # not an instruction ("step start")
                return label
            ins = rename(template.instructions[int(index)], rho, world.keeps_group)
            return instruction_label(int(index), ins)
        memory = dataclasses.replace(memory, rank=rank, at=renamed(memory.at),
                                     between_at=renamed(memory.between_at))
    return dataclasses.replace(summary, rank=rank, memory=memory)


class ClassTimeline(Mapping):
    """rank -> its Spans: its template's times, under its own rank (NOTE: Simulated classes)."""

    def __init__(self, templates: SimTimeline, template_of: Dict[int, int]):
        self._templates, self._template_of = templates, template_of
        self._signatures: Dict[int, tuple] = {}

    def __getitem__(self, rank: int) -> List[Span]:
        return self._templates.spans(self._template_of[rank], shown_as=rank)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._template_of))

    def __len__(self) -> int:
        return len(self._template_of)

    def signature(self, rank: int) -> tuple:
        """The template's signature (SimTimeline.signature), worked out once per class."""
        t = self._template_of[rank]
        if t not in self._signatures:
            self._signatures[t] = self._templates.signature(t)
        return self._signatures[t]
