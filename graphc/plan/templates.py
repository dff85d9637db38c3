"""Plan templates: the whole world's plans from one row of replicas, instantiated on demand.

NOTE: Plan templates
A world of thousands of ranks is mostly copies: the same pipeline on every data-parallel
replica. `graphc plan` (compile with ranks=None) therefore lowers and verifies one row of
the world and stands for the rest by renaming, when the layout has this symmetry
(passes/find_plan_symmetry.py says when, and why not otherwise).

The symmetry. The stages' meshes are pairwise equal or disjoint and all of one shape D x T
(a 1-D mesh of n ranks is n x 1), D >= 2. Row d is every mesh's row d; the template row is
row 0, and the class of a rank is its (mesh, column): one template per pipeline position and
tensor-parallel coordinate, whatever D is. The renaming rho_d swaps row 0 and row d in every
mesh (M[0][t] <-> M[d][t]) and fixes every other rank, idle ones included. Rank M[d][t]'s plan
is rho_d applied to the template of M[0][t]: each Send/Recv's peer renamed, each collective's
group renamed as a set; its compute instructions are the template's own objects.

What is assumed, and what checks it. (A) Lowering commutes with rho_d: rank M[d][t]'s lowered
plan is rho_d(the plan lowered for M[0][t]). The lowering reads a rank's replica index only to
pick the same replica of a neighbour stage (equal mesh shapes: replica k talks to replica k),
the groups of its mesh axes that contain it, and its local shapes, which are the same on every
row when every split along axis 0 divides evenly and ZeRO (which cuts flat shards by data rank)
is off: find_plan_symmetry refuses the symmetry otherwise. compile() also lowers row D-1 for
real and compares it with its instances, field by field (a pass that treats row 0 apart, as
clipping's per-rank parameter lists do, shows there; then every rank is lowered), and
tests/plan/test_templates.py and tests/passes/test_lower_plan.py compare every rank's instance
with the plan lowered for it alone or with every rank (data x tensor x pipeline, ties). (B) check_quotient, on the templates: every peer of a template is in
row 0 (transfers stay within a row), and every group is either inside row 0 or a union of whole
columns {M[*][t]} (then rho_d maps it onto itself and its instance keeps the template's tuple).

Why verifying the templates verifies the world. verify_plans(quotient=True) checks the
templates as a world of their own in which a group's members are its members in row 0 (and
idle ranks). Map every world instruction (r, i) to (template of r, i). Each edge of the
world's wait-for graph (plan/verify_deadlock.py check_acyclic) maps to an edge of the templates' graph:
program order to program order; a send on M[d][t] to its peer M[d][t'] in the same row (B)
pairs, by renaming, exactly as the template's send to M[0][t'] pairs; a collective over a group
G of row d maps to the template's group rho_d(G) inside row 0, one over a union of columns to
itself, and each member's k-th collective there sits at its template's index. So a cycle in the
world maps to a closed walk, hence a cycle, in the templates: acyclic templates make an acyclic
world. Pairing carries over alike: a channel's two ends are renamed copies of a template channel
that pairs, and the members of a group of columns list the template's own collectives (same
ranks, same tensors). Compute order is unchanged by renaming. A fault planted in a template is a
fault of all of its class, and the template check names it (tests/plan/test_templates.py); plans
given one by one (verify_plans on concrete plans) are checked in full as before.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

from .instructions import Instruction
from .plan import ExecutionPlan


@dataclasses.dataclass(frozen=True)
class RowSymmetry:
    """The stages' distinct meshes, each as D rows of T ranks (NOTE: Plan templates)."""

    meshes: Tuple[Tuple[Tuple[int, ...], ...], ...]

    @property
    def rows(self) -> int:
        return len(self.meshes[0])

    def __str__(self) -> str:
        return (f"{self.rows} rows of replicas over {len(self.meshes)} mesh(es) of "
                f"{self.rows} x {len(self.meshes[0][0])}: row 0's ranks are the templates")

    def where(self) -> Dict[int, Tuple[int, int, int]]:
        """rank -> (mesh, row, column), for every rank of a mesh."""
        return {r: (j, d, t) for j, mesh in enumerate(self.meshes) for d, row in enumerate(mesh)
                for t, r in enumerate(row)}

    def row(self, d: int) -> List[int]:
        return sorted(r for mesh in self.meshes for r in mesh[d])

    def template_ranks(self, world_size: int) -> List[int]:
        """Row 0 and every rank outside the meshes (idle ranks are their own templates)."""
        where = self.where()
        return sorted(r for r in range(world_size) if r not in where or where[r][1] == 0)

    def columns(self) -> Dict[int, int]:
        """rank -> its column's number (mesh, column), for counting whole columns."""
        return {r: j * len(mesh[0]) + t for j, mesh in enumerate(self.meshes) for row in mesh
                for t, r in enumerate(row)}


class PlanWorld(Sequence):
    """Every rank's plan, by rank: templates, and instances made when first asked for.

    A Sequence of ExecutionPlan (CompiledGraph.plans of a whole-world compile): `world[r]` is
    rank r's plan; instances are kept once made, and the instances of one row share renamed
    instruction objects (as list_collectives shares a group's Collective objects)."""

    def __init__(self, templates: Sequence[ExecutionPlan], symmetry: RowSymmetry, world_size: int):
        self.templates = {p.rank: p for p in templates}
        self.symmetry, self.world_size = symmetry, world_size
        self._where = symmetry.where()
        self._columns = symmetry.columns()
        self._made: Dict[int, ExecutionPlan] = {}
        self._replaced: Dict[int, ExecutionPlan] = {}
        self._renamed: Dict[int, Dict[int, Instruction]] = {}   # row -> id(template ins) -> instance
        self._kinds: Dict[Tuple[int, ...], str] = {}             # group -> group_kind

    def __len__(self) -> int:
        return self.world_size

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(self.world_size))]
        if rank < 0:
            rank += self.world_size
        if not 0 <= rank < self.world_size:
            raise IndexError(rank)
        if rank in self._replaced:
            return self._replaced[rank]
        if rank not in self._made:
            self._made[rank] = self.templates.get(rank) or self._instance(rank)
        return self._made[rank]

    def __setitem__(self, rank: int, plan: ExecutionPlan) -> None:
        """Replaces rank's plan alone (its template, if it is one, still stands for its class)."""
        self._replaced[rank % self.world_size] = plan

    def __add__(self, other) -> list:
        return list(self) + list(other)

    def plan_or_template(self, rank: int) -> ExecutionPlan:
        """Rank's plan where it was replaced, else its template: the same instruction labels,
        counts and payloads as its instance, which need not be made to read them."""
        return self._replaced.get(rank) or self.template_of(rank)

    def template_of(self, rank: int) -> ExecutionPlan:
        """The plan whose renaming is rank's."""
        if rank in self.templates:
            return self.templates[rank]
        j, _, t = self._where[rank]
        return self.templates[self.symmetry.meshes[j][0][t]]

    def class_of(self, template: int) -> List[int]:
        """The ranks a template's plan stands for, in rank order: its column of its mesh's
        rows (M[*][t]), or itself (an idle rank)."""
        if template not in self._where:
            return [template]
        j, _, t = self._where[template]
        return sorted(row[t] for row in self.symmetry.meshes[j])

    def row_of(self, rank: int) -> int:
        """The row of replicas `rank` is in (an idle rank: 0, its own template)."""
        return self._where[rank][1] if rank in self._where else 0

    def renaming(self, d: int):
        """rho_d, rank -> rank, on the ranks that templates name (row 0's; others are fixed)."""
        return self._rho(d)

    def keeps_group(self, group: Tuple[int, ...]) -> bool:
        """Whether every rho_d maps `group` onto itself (a union of whole columns)."""
        return self._invariant(group)

    @property
    def instances_made(self) -> int:
        """How many ranks' plans were made from their templates so far (tools that read
        the templates alone make none: NOTE: Simulated classes)."""
        return sum(1 for r in self._made if r not in self.templates)

    @property
    def replaced_ranks(self) -> List[int]:
        """Ranks whose plan was replaced alone (__setitem__): no template stands for them."""
        return sorted(self._replaced)

    def _instance(self, rank: int) -> ExecutionPlan:
        d = self._where[rank][1]
        template = self.template_of(rank)
        renamed, rho = self._renamed.setdefault(d, {}), self._rho(d)
        instrs = []
        for ins in template.instructions:
            new = renamed.get(id(ins))
            if new is None:
                new = renamed[id(ins)] = rename(ins, rho, self._invariant)
            instrs.append(new)
        return dataclasses.replace(template, rank=rank, instructions=instrs, notes=dict(template.notes))

    def _rho(self, d: int):
        """rho_d on the ranks of row 0 (the only ranks templates name, besides whole columns)."""
        def to_row(r: int) -> int:
            j, row, t = self._where.get(r, (None, None, None))
            return r if j is None or row != 0 else self.symmetry.meshes[j][d][t]
        return to_row

    def _invariant(self, group: Tuple[int, ...]) -> bool:
        if group not in self._kinds:
            self._kinds[group] = group_kind(group, self._columns, self.symmetry.rows)
        return self._kinds[group] == "columns"


def group_kind(group: Tuple[int, ...], columns: Dict[int, int], rows: int) -> str:
    """'columns' (a union of whole columns, and idle ranks), 'row' (mesh ranks of one row's
    columns, at most one per column), or 'mixed' (neither: the symmetry does not hold)."""
    counts = Counter(columns[r] for r in group if r in columns)
    if all(c == rows for c in counts.values()):
        return "columns"
    return "row" if all(c == 1 for c in counts.values()) else "mixed"


def rename(ins: Instruction, rho, invariant) -> Instruction:
    """`ins` with its peer and group renamed by rho (a group of whole columns kept as is)."""
    if hasattr(ins, "peer"):
        return _with(ins, "peer", rho(ins.peer))
    if hasattr(ins, "ranks") and not invariant(ins.ranks):
        return _with(ins, "ranks", tuple(rho(r) for r in ins.ranks))
    return ins


def _with(ins: Instruction, name: str, value) -> Instruction:
    """A copy of the frozen `ins` with one field changed. dataclasses.replace would run its
    __init__ again (instructions have no __post_init__): 3x slower, at 10^5 per row."""
    new = object.__new__(type(ins))
    new.__dict__.update(ins.__dict__)
    object.__setattr__(new, name, value)
    return new


def same_as_printed(a: ExecutionPlan, b: ExecutionPlan) -> bool:
    """Whether two plans print alike, without printing them: == and the fields == leaves out
    (a piece's offsets, a clip's per-rank parameters)."""
    return a == b and all(x is y or _uncompared(x) == _uncompared(y)
                          for x, y in zip(a.instructions, b.instructions))


@functools.lru_cache(maxsize=None)
def _uncompared_fields(cls) -> Tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if not f.compare)


def _uncompared(ins: Instruction) -> tuple:
    return (tuple(getattr(ins, name) for name in _uncompared_fields(type(ins))),
            tuple((t.at, t.of) for t in getattr(ins, "tensors", ())))


def check_quotient(templates: Sequence[ExecutionPlan], symmetry: RowSymmetry) -> Optional[str]:
    """Why the templates do not stand for the world (NOTE: Plan templates, (B)), or None."""
    where, columns = symmetry.where(), symmetry.columns()
    seen = set()
    for plan in templates:
        for i, ins in enumerate(plan.instructions):
            if hasattr(ins, "peer") and where.get(ins.peer, (0, 0))[1] != 0:
                return f"rank {plan.rank} #{i} `{ins}` talks to rank {ins.peer} of another row"
            group = getattr(ins, "ranks", None)
            if group is None or group in seen:
                continue
            seen.add(group)
            kind = group_kind(group, columns, symmetry.rows)
            if kind == "mixed" or (kind == "row" and any(where[r][1] != 0 for r in group if r in where)):
                return f"rank {plan.rank} #{i} `{ins}`: its group is neither in one row nor whole columns"
    return None
