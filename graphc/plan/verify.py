"""Verifies a set of per-rank plans before anything runs.

Every rank can compute every rank's plan, so one process checks that:
  1. each send meets a recv on its peer, in the same order, with equal payload specs;
  2. each collective is issued by exactly its ranks, in the same order on all of them;
  3. the union of all plans, with sends joined to their recvs and collectives joined
     across ranks, is acyclic (so no rank can wait forever on another).
A failure raises PlanError naming the rank and instruction, with the plan listing marked.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import networkx as nx

from ..errors import PlanError
from .instructions import AllReduce, Instruction, Recv, Send
from .plan import ExecutionPlan


def verify_plans(plans: Sequence[ExecutionPlan]) -> None:
    """Raises PlanError if the plans cannot run together to completion."""
    by_rank = {p.rank: p for p in plans}
    pairs = _pair_p2p(by_rank)
    groups = _pair_collectives(by_rank)
    _check_acyclic(by_rank, pairs, groups)


def _fail(plan: ExecutionPlan, index: int, why: str) -> None:
    raise PlanError(f"plan verification failed on rank {plan.rank}, instruction #{index} "
                    f"`{plan.instructions[index]}`: {why}\n{plan.format(mark=index)}")


def _p2p_queues(by_rank) -> Dict[Tuple[int, int], Dict[str, List[Tuple[int, Instruction]]]]:
    """(src, dst) -> {'send': [(idx, Send)...] on src, 'recv': [(idx, Recv)...] on dst}."""
    queues = defaultdict(lambda: {"send": [], "recv": []})
    for rank, plan in by_rank.items():
        for i, ins in enumerate(plan.instructions):
            if isinstance(ins, Send):
                if ins.peer not in by_rank:
                    _fail(plan, i, f"peer rank {ins.peer} is outside the world of {len(by_rank)} ranks")
                queues[(rank, ins.peer)]["send"].append((i, ins))
            elif isinstance(ins, Recv):
                if ins.peer not in by_rank:
                    _fail(plan, i, f"peer rank {ins.peer} is outside the world of {len(by_rank)} ranks")
                queues[(ins.peer, rank)]["recv"].append((i, ins))
    return queues


def _pair_p2p(by_rank) -> List[Tuple[Tuple[int, int], Tuple[int, int]]]:
    pairs = []
    for (src, dst), q in sorted(_p2p_queues(by_rank).items()):
        sends, recvs = q["send"], q["recv"]
        for k in range(max(len(sends), len(recvs))):
            if k < len(sends) and k < len(recvs) and _same_transfer(sends[k][1], recvs[k][1]):
                (i, s), (j, r) = sends[k], recvs[k]
                if s.tensors != r.tensors:
                    _fail(by_rank[dst], j, f"payload mismatch with rank {src} #{i}: sent "
                          f"[{' '.join(map(str, s.tensors))}], expected [{' '.join(map(str, r.tensors))}]")
                pairs.append(((src, i), (dst, j)))
                continue
            counts = f"rank {src} sends {len(sends)} to rank {dst}, which posts {len(recvs)} recvs"
            if len(sends) > len(recvs):
                _fail(by_rank[src], sends[k][0], f"no matching recv on rank {dst} ({counts})")
            if len(recvs) > len(sends):
                _fail(by_rank[dst], recvs[k][0], f"no matching send on rank {src} ({counts})")
            (i, s), (j, r) = sends[k], recvs[k]
            _fail(by_rank[dst], j, f"out of order: the {k}-th transfer from rank {src} is "
                  f"`{s}` (rank {src} #{i}) but rank {dst} expects `{r}`")
    return pairs


def _same_transfer(s: Send, r: Recv) -> bool:
    return (s.microbatch == r.microbatch and s.direction == r.direction
            and s.stage == r.peer_stage and s.peer_stage == r.stage)


def _pair_collectives(by_rank) -> List[List[Tuple[int, int]]]:
    """Groups each collective's instances across its ranks, checking order and membership."""
    seqs: Dict[Tuple[int, ...], Dict[int, List[Tuple[int, Instruction]]]] = defaultdict(dict)
    for rank, plan in by_rank.items():
        for i, ins in enumerate(plan.instructions):
            if isinstance(ins, AllReduce):
                if rank not in ins.ranks:
                    _fail(plan, i, f"rank {rank} issues a collective over ranks {list(ins.ranks)} "
                          "that it is not part of")
                seqs[ins.ranks].setdefault(rank, []).append((i, ins))
    groups = []
    for ranks, per_rank in seqs.items():
        counts = {r: len(per_rank.get(r, [])) for r in ranks}
        if len(set(counts.values())) != 1:
            short = min(counts, key=counts.get)
            long_ = max(counts, key=counts.get)
            i, ins = per_rank[long_][counts[short]]
            _fail(by_rank[long_], i, f"collective missing on rank {short}: ranks {list(ranks)} "
                  f"issue {counts} collectives over this group")
        for k in range(counts[ranks[0]]):
            first_rank = ranks[0]
            i0, ins0 = per_rank[first_rank][k]
            for r in ranks[1:]:
                i, ins = per_rank[r][k]
                if ins != ins0:
                    _fail(by_rank[r], i, f"collective order differs: rank {first_rank} issues "
                          f"`{ins0}` (#{i0}) at this point")
            groups.append([(r, per_rank[r][k][0]) for r in ranks])
    return groups


def _check_acyclic(by_rank, pairs, groups) -> None:
    g = nx.DiGraph()
    for rank, plan in by_rank.items():
        nodes = [(rank, i) for i in range(len(plan.instructions))]
        g.add_nodes_from(nodes)
        g.add_edges_from(zip(nodes, nodes[1:]))
    g.add_edges_from(pairs)
    for k, members in enumerate(groups):
        hub = ("collective", k)
        for member in members:
            # a collective completes on no rank before every member has issued it
            g.add_edge((member[0], member[1] - 1) if member[1] > 0 else ("start", member[0]), hub)
            g.add_edge(hub, member)
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return
    waits = [n for edge in cycle for n in edge if isinstance(n[0], int) and n[0] in by_rank]
    rank, i = waits[0]
    path = " -> ".join(f"rank {r} #{j} `{by_rank[r].instructions[j]}`" for r, j in
                       dict.fromkeys(waits))
    _fail(by_rank[rank], i, f"deadlock: these instructions wait on each other in a cycle: {path}")
