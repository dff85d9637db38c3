"""Expert-parallel exchanges priced by a recorded routing (`graphc plan --simulate --routing
DIR`; See NOTE: Routing log, graphc/ops/routing_log.py).

A plan lists each expert layer's token exchanges with the balanced estimate of their bytes
(every rank sends its pairs evenly over the experts: list_collectives). A real router is
seldom balanced, and an all-to-all ends when its busiest member has sent and received its
rows. With the counts a real step recorded (rank -> layer -> micro-batch -> tokens per
expert), each exchange of layer l, micro-batch b on group G takes

    nbytes * busiest / balanced,   busiest = max over members r of max(rows r sends to the
    other members' experts, rows r receives for its own), balanced = pairs * (n - 1) / n

(the same in the backward, which sends the same rows back), so the simulator's collective
cost sees the measured load. The table gives tokens per expert per step and each layer's
busiest member against the balanced load.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

from ..errors import GraphcError
from ..plan.instructions import Collective
from ..plan.plan import ExecutionPlan

Routing = Dict[int, Dict[str, Dict[int, List[int]]]]   # rank -> layer -> micro-batch -> counts
_NOTE = "expert parallel "


def read_routing(folder: str) -> Routing:
    """The rank files a run with GRAPHC_ROUTING_OUT=folder wrote."""
    files = sorted(glob.glob(os.path.join(folder, "routing_rank*.json")))
    if not files:
        raise GraphcError(f"graphc plan --routing {folder}: no routing_rank<r>.json there. Record a "
                          f"step's routing first: GRAPHC_ROUTING_OUT={folder} with the training script "
                          "(torchrun, or graphc check), then simulate with --routing.")
    out: Routing = {}
    for path in files:
        with open(path) as f:
            log = json.load(f)
        out[int(log["rank"])] = {layer: {int(mb): counts for mb, counts in per_mb.items()}
                                 for layer, per_mb in log["layers"].items()}
    return out


def _exchange(ins) -> Tuple[str, str]:
    """(layer, what) of an expert layer's exchange, or ("", "")."""
    if not isinstance(ins, Collective) or _NOTE not in ins.note:
        return "", ""
    layer, what = ins.note.split(_NOTE, 1)[1].rsplit(": ", 1)
    return layer, what


def load_factor(routing: Routing, layer: str, microbatch: int, group: Sequence[int]) -> float:
    """The busiest member's rows over the balanced load, for one exchange of `layer`."""
    counts = [routing.get(r, {}).get(layer, {}).get(microbatch) for r in group]
    if any(c is None for c in counts):
        missing = [r for r, c in zip(group, counts) if c is None]
        raise GraphcError(f"graphc plan --routing: no recorded counts of '{layer}' micro-batch "
                          f"{microbatch} on rank(s) {missing}; record the same job (world, layout, "
                          "accumulation) the plan is for.")
    n, experts = len(group), len(counts[0])
    per = experts // n
    sent = [[sum(c[d * per:(d + 1) * per]) for d in range(n)] for c in counts]   # [from][to] rows
    busiest = max(max(sum(sent[r]) - sent[r][r], sum(sent[s][r] for s in range(n)) - sent[r][r])
                  for r in range(n))
    balanced = sum(counts[0]) * (n - 1) / n
    return busiest / balanced if balanced else 1.0


def routed_plans(plans: Sequence[ExecutionPlan], routing: Routing) -> List[ExecutionPlan]:
    """Copies of the plans whose expert exchanges (tokens and back, both directions) carry
    the bytes of the recorded routing."""
    out = []
    for plan in plans:
        instructions = []
        for ins in plan.instructions:
            layer, what = _exchange(ins)
            if what in ("tokens", "back"):
                factor = load_factor(routing, layer, ins.microbatch, ins.ranks)
                ins = replace(ins, nbytes=int(round(ins.nbytes * factor)))
            instructions.append(ins)
        out.append(replace(plan, instructions=instructions))
    return out


def routing_table(plans: Sequence[ExecutionPlan], routing: Routing, source: str) -> str:
    """Tokens per expert per step (every rank and micro-batch), and per layer the busiest
    member of its exchanges against the balanced load (the mean over micro-batches)."""
    layers: Dict[str, List[int]] = {}
    for per_layer in routing.values():
        for layer, per_mb in per_layer.items():
            for counts in per_mb.values():
                total = layers.setdefault(layer, [0] * len(counts))
                for e, c in enumerate(counts):
                    total[e] += c
    factors: Dict[str, List[float]] = {}
    for ins in plans[0].instructions if plans else ():
        layer, what = _exchange(ins)
        if what == "tokens" and ins.direction == "F":
            factors.setdefault(layer, []).append(load_factor(routing, layer, ins.microbatch, ins.ranks))
    lines = [f"# routing recorded by a real step ({source}): tokens (token-slot pairs) per expert per step",
             f"{'layer':<40} {'tokens per expert':<32} {'busiest / balanced exchange':>27}"]
    for layer, total in sorted(layers.items()):
        mean = sum(factors[layer]) / len(factors[layer]) if factors.get(layer) else float("nan")
        lines.append(f"{layer:<40} {' '.join(map(str, total)):<32} {mean:>27.2f}")
    return "\n".join(lines)
