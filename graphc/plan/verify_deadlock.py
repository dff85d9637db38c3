"""Check 3 of plan/verify.py: the union of all plans is acyclic, so no rank waits forever.

Sends are joined to their recvs and collectives across their ranks; a pointer walk over the
plans decides it in one pass, and a cycle is printed rank by rank with every instruction in
it marked (docs/design.md, Dependencies, says why not networkx).
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Dict, List, Tuple

from ..errors import PlanError
from .verify_collectives import is_collective
from .verify_failures import marked_listing


def check_acyclic(by_rank, pairs, hubs) -> None:
    """Fails if the wait-for graph of all plans has a cycle (a deadlock), rank by rank.

    Nodes are instructions, plus one node per collective that every member joins: it waits
    for each member's previous instruction and its members' collective instructions wait
    for it. Sends do not block (isend), so a send only makes its recv wait. Each rank's
    nodes form a chain, so the graph is acyclic exactly when walking every rank's pointer
    through its plan, passing a recv once its send is passed and a collective once every
    member has reached it, ends every plan: linear in the number of instructions.
    """
    walk = _Walk(by_rank, pairs, hubs)
    walk.run()
    if any(walk.pc[r] < len(p.instructions) for r, p in by_rank.items()):
        _fail_deadlock(by_rank, walk.cycle(), hubs)


class _Walk:
    """The pointer walk of check_acyclic: a worklist of ranks that may move on."""

    def __init__(self, by_rank, pairs, hubs):
        self.by_rank, self.hubs = by_rank, hubs
        self.pc = {r: 0 for r in by_rank}
        self.send_for = {r: {} for r in by_rank}     # rank -> recv index -> (rank, send index)
        for send, (r, i) in pairs:
            self.send_for[r][i] = send
        self.hub_at = {r: {} for r in by_rank}       # rank -> index -> collective (hub) number
        for k, members in enumerate(hubs):
            for r, i in members:
                self.hub_at[r][i] = k
        self.arrived = [0] * len(hubs)
        # sender -> its send's index -> the ranks whose recv waits on it
        self.woken_by: Dict[int, Dict[int, List[int]]] = {r: {} for r in by_rank}

    def run(self) -> None:
        ready = deque(self.by_rank)
        while ready:
            ready.extend(self._advance(ready.popleft()))

    def _advance(self, r: int) -> List[int]:
        """Moves rank r on until it must wait; returns the ranks its progress frees."""
        freed: List[int] = []
        n, sends, hub_at, pc = len(self.by_rank[r].instructions), self.send_for[r], self.hub_at[r], self.pc
        waiting = self.woken_by[r]   # no other rank moves while this one does: pc[r] is written on leaving
        i = pc[r]
        while i < n:
            send = sends.get(i)
            if send is not None and pc[send[0]] <= send[1]:
                self.woken_by[send[0]].setdefault(send[1], []).append(r)
                pc[r] = i
                return freed
            k = hub_at.get(i)
            if k is not None and self.arrived[k] < len(self.hubs[k]):
                self.arrived[k] += 1
                if self.arrived[k] < len(self.hubs[k]):
                    pc[r] = i
                    return freed
                freed += [m for m, _ in self.hubs[k] if m != r]   # the last member opens it
            if waiting and i in waiting:
                freed += waiting.pop(i)
            i += 1
        pc[r] = i
        return freed

    def _waits_on(self, r: int) -> Tuple[int, int, object]:
        """(rank, index it must pass, link) for a stuck rank r; link is a hub number or None."""
        i = self.pc[r]
        send = self.send_for[r].get(i)
        if send is not None and self.pc[send[0]] <= send[1]:
            return send[0], send[1], None
        k = self.hub_at[r][i]
        m, j = next((m, j) for m, j in self.hubs[k] if self.pc[m] < j)
        return m, j - 1, k

    def cycle(self) -> list:
        """The cycle among stuck ranks as wait-for graph nodes, in edge order."""
        r = next(r for r, p in self.by_rank.items() if self.pc[r] < len(p.instructions))
        order: List[int] = []
        while r not in order:
            order.append(r)
            r = self._waits_on(r)[0]
        ring = order[order.index(r):]          # ring[t] waits on ring[t + 1]
        nodes: list = []
        for t in reversed(range(len(ring))):   # each waited-on rank before its waiter
            rank, target, hub = self._waits_on(ring[t])
            nodes += [(rank, i) for i in self._segment(rank, target)]
            nodes += [("collective", hub)] if hub is not None else []
        return nodes

    def _segment(self, rank: int, target: int) -> List[int]:
        """Where a stuck rank waits, the collectives it must pass first, and `target`."""
        plan, start = self.by_rank[rank], self.pc[rank]
        between = [i for i in range(start + 1, target)
                   if is_collective(plan.instructions[i])]
        return [start] + between + ([target] if target > start else [])


def _fail_deadlock(by_rank, cycle, hubs) -> None:
    involved: Dict[int, set] = defaultdict(set)
    steps = []
    for node in cycle:
        if node[0] == "collective":
            members = hubs[node[1]]
            for r, i in members:
                involved[r].add(i)
            r, i = members[0]
            steps.append(f"`{by_rank[r].instructions[i]}` joined by "
                         + ", ".join(f"rank {r} #{i}" for r, i in members))
        else:
            involved[node[0]].add(node[1])
            steps.append(f"rank {node[0]} #{node[1]}")
    lines = [f"  rank {r}: " + ", ".join(f"#{i} `{by_rank[r].instructions[i]}`" for i in sorted(ix))
             for r, ix in sorted(involved.items())]
    first = min(involved)
    listings = "\n".join(marked_listing(by_rank[r], involved[r]) for r in sorted(involved))
    raise PlanError(
        f"plan verification failed on rank {first}, instruction #{min(involved[first])}: "
        f"deadlock: these instructions wait on each other in a cycle, rank by rank:\n"
        + "\n".join(lines) + "\n  cycle: " + " -> ".join(steps + steps[:1]) + "\n"
        "Fix: order the sends, recvs and collectives alike on every rank of a group.\n" + listings)
