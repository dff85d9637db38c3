"""The simulator's ring attention: each step's transfer beside its block's compute.

NOTE: Ring overlap
A ring step posts the next block's k, v transfer before the rank computes on the block it
holds and waits for it after (graphc/ops/context_parallel.py), so the transfer costs the step
only what that compute does not hide. The plan lists each step as a `send_recv` Collective
after the compute that issues it; the simulator times a step
  forward:   max(0, t(k, v) - b)
  backward:  max(0, t(k, v) - 2 b) + bytes(dk, dv) / bandwidth
where t(x) = latency + bytes(x) / bandwidth, b is one block's forward on this rank (CostModel
.ring_blocks, by stage and attention node) and the backward's block is twice it (the
convention device_costs uses for a whole stage); dk and dv are sent once the block has added
to them, so they are not hidden, and neither is the step that hands them home. The split of a
backward step's bytes is exchanges' (sbp/context_parallel.py): k, v in their own dtype, their
gradients in float32 or wider. b comes from the block's FLOPs (sbp/context_parallel.py
ring_block_flops) at the device's rate: device_costs fills ring_blocks; measured costs time a
stage whole, not its blocks, and leave it empty, and the steps are then timed in turn as
before (a step's whole transfer after the compute).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..plan.instructions import Collective
from ..sbp.context_parallel import ring_block_flops
from .network import collective_seconds

RING_STEP = "ring step"   # the note exchanges gives a step that overlaps a block


def overlaps(ins: Collective) -> bool:
    """Whether `ins` is a ring step whose transfer runs beside a block's compute."""
    return ins.kind == "send_recv" and ins.note.startswith(RING_STEP)


def ring_step_seconds(ins: Collective, block: float, link: Tuple[float, float]) -> float:
    """Seconds a ring step adds after its compute, `block` the forward seconds of one block
    on this rank (See NOTE: Ring overlap)."""
    bandwidth, latency = link
    if ins.direction == "F":
        return max(0.0, collective_seconds("send_recv", ins.nbytes, 0, 2, link) - block)
    kv = _kv_bytes(ins)
    return max(0.0, collective_seconds("send_recv", kv, 0, 2, link) - 2 * block) + (ins.nbytes - kv) / bandwidth


def _kv_bytes(ins: Collective) -> int:
    """A backward step's k, v bytes: its gradients travel in float32 or wider (NOTE: Ring
    precision), k and v in `ins.dtype`."""
    itemsize = getattr(torch, ins.dtype).itemsize if ins.dtype else 4
    return ins.nbytes * itemsize // (itemsize + max(itemsize, 4))


def ring_blocks(compiled, low_flops_per_s: float, full_flops_per_s: float) -> Dict[Tuple[int, str], float]:
    """(stage, attention node) -> forward seconds of one ring block on a rank, for every ring
    attention of the compiled stage programs, at the rate of its dtype."""
    from ..ops.context_parallel import context_parallel_attention
    from ..meta import META_TENSOR
    out = {}
    for prog in compiled.programs:
        for node in prog.module.graph.nodes:
            if node.op != "call_function" or node.target is not context_parallel_attention or node.args[5] != "ring":
                continue
            groups = [g for g in node.args[4] if len(g) > 1]
            if not groups:
                continue
            dtype = node.meta[META_TENSOR].dtype
            rate = low_flops_per_s if dtype in ("bfloat16", "float16") else full_flops_per_s
            out[(prog.stage, node.name)] = ring_block_flops(node, len(groups[0])) / rate
    return out
