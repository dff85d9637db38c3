"""How often each rank waits when the ranks run one at a time (See NOTE: Shared cores).

A local world runs one rank at a time: a rank runs until it must wait, for a receive whose
data no rank has sent yet or for a collective some member has not joined, and then another
rank that can go on runs (NOTE: Local world, graphc/runtime/local_world.py). Each such wait
hands the core over, which costs `CostModel.handoff`; a send never waits there, and a
receive whose data was sent earlier does not either. This walk counts the waits: it runs
every rank's plan from a first-in, first-out list, each until it waits, messages matched in
order per directed pair of ranks and collectives in order per group (as the simulator's
engine matches them), and the Prologues' all-reduces joined at each step's start (NOTE:
Prologue costs). No time is kept: only the order decides who waits.
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Dict, List, Sequence, Tuple

from ..plan.plan import ExecutionPlan
from .cost_model import CostModel

_SEND, _RECV, _JOIN = 0, 1, 2


def waits_one_at_a_time(plans: Sequence[ExecutionPlan], costs: CostModel, steps: int = 2) -> Dict[int, int]:
    """rank -> how many times it waits in the last of `steps` steps run back to back (the
    first step's start, where every rank begins at once, is not steady)."""
    ops = {p.rank: _blocking_ops(p, costs) for p in plans}
    walk = _Walk(ops, steps)
    walk.run()
    return walk.waits


def _blocking_ops(plan: ExecutionPlan, costs: CostModel) -> List[Tuple[int, tuple]]:
    """A step's operations that may wait or let another rank go on, in plan order."""
    out = []
    for s in plan.local_stages:     # the Prologue's all-reduces, before the plan
        pro = costs.prologue.get(s)
        for groups, _ in (pro.reduces if pro is not None else ()):
            group = next((g for g in groups if plan.rank in g), None)
            if group is not None and len(group) > 1:
                out.append((_JOIN, tuple(sorted(group))))
    for ins in plan.instructions:
        if ins.runs == "send":
            out.append((_SEND, (plan.rank, ins.peer)))
        elif ins.runs == "recv":
            out.append((_RECV, (ins.peer, plan.rank)))
        elif ins.joins and len(ins.ranks) > 1:
            out.append((_JOIN, tuple(sorted(ins.ranks))))
    return out


class _Walk:
    def __init__(self, ops: Dict[int, List[Tuple[int, tuple]]], steps: int):
        self.ops, self.steps = ops, steps
        self.pc = {r: 0 for r in ops}
        self.sent: Dict[tuple, int] = defaultdict(int)      # (src, dst) -> messages posted
        self.taken: Dict[tuple, int] = defaultdict(int)     # (src, dst) -> messages received
        self.joined: Dict[tuple, int] = defaultdict(int)    # (group, k) -> members arrived
        self.calls: Dict[tuple, int] = defaultdict(int)     # (group, rank) -> its joins so far
        self.blocked: Dict[tuple, List[int]] = defaultdict(list)   # what -> ranks waiting on it
        self.waits = {r: 0 for r in ops}

    def run(self) -> None:
        ready = deque(sorted(self.ops))
        while ready:
            ready.extend(self._advance(ready.popleft()))

    def _advance(self, rank: int) -> List[int]:
        """Runs `rank` until it waits or is done; returns the ranks it let go on."""
        ops, freed = self.ops[rank], []
        total = len(ops) * self.steps
        while self.pc[rank] < total:
            step, index = divmod(self.pc[rank], len(ops))
            code, key = ops[index]
            if code == _SEND:
                self.sent[key] += 1
                freed += self.blocked.pop(("link", key), [])
            elif code == _RECV:
                if self.taken[key] >= self.sent[key]:
                    return freed + self._wait(rank, ("link", key), step)
                self.taken[key] += 1
            elif not self._joined(rank, key, step, freed):
                return freed
            self.pc[rank] += 1
        return freed

    def _joined(self, rank: int, group: tuple, step: int, freed: List[int]) -> bool:
        """Whether `rank` is through its next collective on `group` (the last member to
        join goes on; the others wait, once, and are let go by it)."""
        k = self.calls[(group, rank)]
        slot = (group, k)
        if ("done", slot) in self.blocked:      # woken: the others joined meanwhile
            self.blocked[("done", slot)].remove(rank)
            if not self.blocked[("done", slot)]:
                del self.blocked[("done", slot)]
            self.calls[(group, rank)] = k + 1
            return True
        self.joined[slot] += 1
        if self.joined[slot] < len(group):
            self._wait(rank, ("join", slot), step)
            return False
        waiting = self.blocked.pop(("join", slot), [])
        if waiting:
            self.blocked[("done", slot)] = list(waiting)
        freed += waiting
        del self.joined[slot]
        self.calls[(group, rank)] = k + 1
        return True

    def _wait(self, rank: int, what: tuple, step: int) -> List[int]:
        self.blocked[what].append(rank)
        if step == self.steps - 1:
            self.waits[rank] += 1
        return []
