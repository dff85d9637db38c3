"""Rank folding: one representative per class of ranks that share a timeline.

NOTE: Symmetric ranks
Ranks of one stage usually run the same instructions at the same times (data-parallel
replicas, tensor-parallel shards), so a thousand-rank plan has a few dozen distinct
timelines. Before running, the simulator partitions the ranks into classes that provably
share one timeline, and runs one representative per class (`Symmetry`):
  * start: ranks are alike when their instructions have the same labels and costs (every
    op's seconds, bytes on the wire, latency, group size) and their sends (and receives)
    are split among peers in the same pattern (the k-th send goes to the same peer as the
    j-th on one rank exactly when it does on the other);
  * refine until stable: ranks stay alike when, at every index, a send's receiver (a
    recv's sender) is alike and matches it at the same index of its own plan, and a
    collective's members, with the index at which each issues it, are alike as a multiset.
Every equation the simulation solves for a rank at an index (an end from its start and
cost; an arrival from the sender's link history; a collective's end from its members'
issue times) then reads the same (class, index) pairs for all ranks of a class, so
copying each representative's times to its class solves them all: the result is exact,
not an approximation. The representatives run as above, except that a representative's
send also feeds the links from the other ranks of its class to representatives (they
would send at the same time), and a collective waits for the representative of each
member's class to reach that member's index. Where the classes are as many as the ranks,
or the folded run cannot finish, every rank runs (and a plan that cannot finish is
reported as before).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .codes import COLLECTIVE, FANOUT, QCOLLECTIVE, RECV, SEND


def fold(sim, classes: List[List[int]]) -> None:
    """Runs one representative per class from now on (NOTE: Symmetric ranks)."""
    if len(classes) == len(sim.plans):
        return
    rep = {r: c[0] for c in classes for r in c}
    sim.running = [c[0] for c in classes]
    sim.rep = {r: q for r, q in rep.items() if r != q}
    fanout: Dict[Tuple[int, int], list] = {}
    for r, q in sim.rep.items():    # r's sends to representatives ride on q's sends
        for i, op in enumerate(sim.ops[r]):
            if op[0] == SEND and rep[op[2].dst] == op[2].dst:
                fanout.setdefault((q, i), []).append((r, op))
    index_of = collective_indices(sim)
    for q in sim.running:
        ops = sim.ops[q] = list(sim.ops[q])
        for i, op in enumerate(ops):
            if op[0] == SEND and (q, i) in fanout:
                ops[i] = (FANOUT,) + op[1:] + (tuple(fanout[(q, i)]),)
            elif op[0] == COLLECTIVE:
                deps = {(rep[m], j) for m, j in index_of[(q, i)]}
                ops[i] = (QCOLLECTIVE, tuple(sorted(deps)), op[2])


def collective_indices(sim) -> Optional[Dict[Tuple[int, int], tuple]]:
    """(rank, index of a collective) -> ((member, the index at which it issues the same
    call), ...); None where members issue a group's collectives unequally often."""
    if getattr(sim, "_coll_index", False) is not False:
        return sim._coll_index
    calls: Dict[int, Dict[int, List[int]]] = {}     # id(group) -> rank -> indices
    groups = {}
    for r, ops in sim.ops.items():
        for i, op in enumerate(ops):
            if op[0] == COLLECTIVE:
                groups[id(op[1])] = op[1]
                calls.setdefault(id(op[1]), {}).setdefault(r, []).append(i)
    out: Optional[Dict[Tuple[int, int], tuple]] = {}
    for gid, per_rank in calls.items():
        members = groups[gid].ranks
        counts = {len(per_rank.get(m, ())) for m in members}
        if len(counts) != 1 or len(per_rank) != len(members):
            out = None
            break
        for k in range(counts.pop()):
            call = tuple((m, per_rank[m][k]) for m in members)
            for m, i in call:
                out[(m, i)] = call
    sim._coll_index = out
    return out


class Symmetry:
    """Classes of ranks that share one simulated timeline (NOTE: Symmetric ranks)."""

    def __init__(self, sim):
        self.sim = sim
        self.ranks = sorted(sim.plans)

    def classes(self) -> List[List[int]]:
        alone = [[r] for r in self.ranks]
        match = self._matches()
        calls = collective_indices(self.sim)
        if match is None or calls is None:
            return alone
        keys, p2p, coll = {}, {}, {}
        for r in self.ranks:
            keys[r], p2p[r], coll[r] = self._describe(r, match, calls)
        colour = _number(keys)
        count = len(set(colour.values()))
        while count < len(self.ranks):
            refined = _number({r: (colour[r],
                                   tuple((colour[q], j) for q, j in p2p[r]),
                                   tuple(tuple(sorted((colour[m], j) for m, j in call))
                                         for call in coll[r]))
                               for r in self.ranks})
            new_count = len(set(refined.values()))
            colour = refined
            if new_count == count:
                break
            count = new_count
        classes: Dict[int, List[int]] = {}
        for r in self.ranks:
            classes.setdefault(colour[r], []).append(r)
        return sorted(classes.values())

    def _matches(self) -> Optional[Dict[Tuple[int, int], Tuple[int, int]]]:
        """(rank, index of a send or recv) -> (peer, index of the recv or send it meets)."""
        sends: Dict[Tuple[int, int], List[int]] = {}
        recvs: Dict[Tuple[int, int], List[int]] = {}
        for r in self.ranks:
            for i, op in enumerate(self.sim.ops[r]):
                if op[0] == SEND:
                    sends.setdefault((r, op[2].dst), []).append(i)
                elif op[0] == RECV:
                    recvs.setdefault((op[1].src, r), []).append(i)
        if sends.keys() != recvs.keys() or any(len(v) != len(recvs[k]) for k, v in sends.items()):
            return None
        match = {}
        for (a, b), at_a in sends.items():
            for i, j in zip(at_a, recvs[(a, b)]):
                match[(a, i)], match[(b, j)] = (b, j), (a, i)
        return match

    def _describe(self, r: int, match, calls):
        """A rank's key without peers (costs, labels, its peers' pattern), its sends' and
        recvs' (peer, peer's index) and its collectives' (member, member's index) calls."""
        key, p2p, coll = [], [], []
        to, frm = {}, {}
        for i, op in enumerate(self.sim.ops[r]):
            code = op[0]
            if code == SEND:
                key.append((code, op[1], op[3], op[4], to.setdefault(op[2].dst, len(to))))
                p2p.append(match[(r, i)])
            elif code == RECV:
                key.append((code, op[2], frm.setdefault(op[1].src, len(frm))))
                p2p.append(match[(r, i)])
            elif code == COLLECTIVE:
                key.append((code, op[1].size, op[2]))
                coll.append(calls[(r, i)])
            else:
                key.append(op)
        return (self.sim.shown[r], tuple(key)), p2p, coll


def _number(keys: Dict[int, object]) -> Dict[int, int]:
    """rank -> a small number per distinct key."""
    seen: Dict[object, int] = {}
    return {r: seen.setdefault(k, len(seen)) for r, k in keys.items()}
