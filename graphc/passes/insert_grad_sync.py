"""insert_grad_sync: all-reduces exactly the gradients that SBP says are partial_sum.

Invariant: in a training plan, every rank holding a parameter whose gradient is
partial_sum on a mesh axis (META_GRAD_PARTIAL: a broadcast parameter read by sharded
ops, i.e. data parallelism) issues, before its optimizer step, all_reduce instructions
over that axis's group covering the parameter, in buckets of at most `bucket_bytes` (the
first at most 1 MiB, as DDP does) in backward order (last-used parameters first). The runtime launches each bucket as soon as
its gradients are final during the last micro-batch's backward; the instruction waits.
No other gradient is reduced. Each bucket's TensorSpecs carry the dtype the sum travels
in: the gradient's own, or config.set_grad_reduce_dtype's (the runtime casts each rank's
addend down to it and the sum back, NOTE: Gradient reduce dtype in runtime/collectives.py),
so the plan prints and counts the bytes that move.
Requires: infer_sbp, lower_plan.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..meta import META_GRAD_PARTIAL, META_SBP, META_TENSOR
from ..plan.instructions import AllReduce, OptimizerStep, TensorSpec
from ..plan.plan import DEFAULT_BUCKET_BYTES, ExecutionPlan
from ..sbp.layout import axis_groups, flat, local_shape

FIRST_BUCKET_BYTES = 2 ** 20  # small, so the first all-reduce starts early in the backward


def insert_grad_sync(plans: Sequence[ExecutionPlan], gm: fx.GraphModule,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     reduce_dtype: Optional[torch.dtype] = None,
                     grad_dtype: Optional[torch.dtype] = None) -> List[ExecutionPlan]:
    per_rank = _partial_grads(gm, reduce_dtype, grad_dtype)
    for plan in plans:
        wanted = per_rank.get(plan.rank)
        if not wanted or not plan.training:
            continue
        syncs = [AllReduce(group, tuple(bucket)) for group, specs in wanted.items()
                 for bucket in _buckets(specs, bucket_bytes)]
        at = next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, OptimizerStep))
        plan.instructions[at:at] = syncs
    return list(plans)


def _partial_grads(gm: fx.GraphModule, reduce_dtype: Optional[torch.dtype],
                   grad_dtype: Optional[torch.dtype] = None
                   ) -> Dict[int, Dict[Tuple[int, ...], List[TensorSpec]]]:
    """rank -> group -> gradient specs (local shapes, the dtype they are summed in), in
    backward order. `grad_dtype`: the dtype floating gradients are held in when it is not
    their parameter's (set_param_dtype: the float32 masters')."""
    out: Dict[int, Dict[Tuple[int, ...], List[TensorSpec]]] = defaultdict(lambda: defaultdict(list))
    # (parameter, ranks): a tied parameter's names share one .grad, reduced once; so do two
    # chunks on the same ranks that use it
    seen = set()
    for node in reversed(list(gm.graph.nodes)):
        axes = node.meta.get(META_GRAD_PARTIAL, ()) if node.op == "get_attr" else ()
        meta = node.meta.get(META_TENSOR)
        key = (id(gm.get_parameter(str(node.target))), tuple(sorted(flat(node.meta[META_SBP].mesh)))) \
            if axes and meta is not None and meta.requires_grad else None
        if key is None or key in seen:
            continue
        seen.add(key)
        sig = node.meta[META_SBP]
        for axis in axes:
            for group in axis_groups(sig.mesh, axis):
                # the group's ranks hold shards of one shape (uneven splits differ by group)
                spec = TensorSpec(str(node.target), local_shape(meta.shape, sig.out, sig.mesh, group[0]),
                                  _reduced_in(held_in(meta.dtype, grad_dtype), reduce_dtype))
                if len(group) > 1:
                    for r in group:
                        out[r][group].append(spec)
    return out


def held_in(param_dtype: str, grad_dtype: Optional[torch.dtype]) -> str:
    """The dtype (torch name) a parameter of `param_dtype` has its gradient in: `grad_dtype`
    for a floating one when given (NOTE: Master parameters in runtime/master_params.py)."""
    if grad_dtype is None or not getattr(torch, param_dtype).is_floating_point:
        return param_dtype
    return str(grad_dtype).removeprefix("torch.")


def _reduced_in(grad_dtype: str, reduce_dtype: Optional[torch.dtype]) -> str:
    """The dtype (torch name) a gradient of `grad_dtype` is summed in over its ranks."""
    if reduce_dtype is None or not getattr(torch, grad_dtype).is_floating_point:
        return grad_dtype
    return str(reduce_dtype).removeprefix("torch.")


def _buckets(specs: List[TensorSpec], limit: int) -> List[List[TensorSpec]]:
    buckets: List[List[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        cap = min(limit, FIRST_BUCKET_BYTES) if len(buckets) == 1 else limit
        if buckets[-1] and size + s.nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(s)
        size += s.nbytes
    return [b for b in buckets if b]
