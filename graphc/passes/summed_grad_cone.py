"""Whole values with a summed gradient (See NOTE: Whole values with a summed gradient below):
the parameters, and the whole ops between them and sharded reads, whose gradient is a
rank's addend, marked for insert_boxing (infer_sbp's last step)."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.fx as fx

from ..meta import META_GRAD_PARTIAL, META_SBP, META_STAGE, META_TENSOR, SbpSignature, is_backward
from ..placement import Broadcast, PartialSum, Split


def _fetch(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _mark_grad_partial(gm: fx.GraphModule) -> None:
    """A broadcast parameter read only by ops whose output is sharded (S or P) on an axis has
    a partial_sum gradient there: the data-parallel case, synchronised after backward.

    Decided per parameter object and stage, over all its reads: the names of a tied
    parameter (an embedding and its LM head) share one .grad, so it is partial only if
    every use is; otherwise each sharded use reduces its own part (insert_boxing)."""
    reads: Dict[tuple, List[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and META_SBP in node.meta:
            reads.setdefault((id(_fetch(gm, str(node.target))), node.meta[META_STAGE]), []).append(node)
    for nodes in reads.values():
        axes, cones = [], {}
        for axis, s in enumerate(nodes[0].meta[META_SBP].out):
            views = [v for n in nodes for v in _piece_views(n)]
            users = [(u, v) for v in views for u in v.users if META_SBP in u.meta]
            if not isinstance(s, Broadcast) or not users:
                continue
            if all(sharded_use(u, v, axis) for u, v in users):
                axes.append(axis)
                continue
            cone = _whole_cone(views, axis)   # NOTE: Whole values with a summed gradient
            if cone:
                axes.append(axis)
                for c in cone:
                    cones.setdefault(c, []).append(axis)
        for node in nodes:
            for view in [node] + _piece_views(node):
                view.meta[META_GRAD_PARTIAL] = tuple(axes)
        for c, c_axes in cones.items():
            c.meta[META_GRAD_PARTIAL] = tuple(c_axes)


# NOTE: Whole values with a summed gradient
# A broadcast parameter read by sharded ops has a partial_sum gradient, all-reduced once a
# step with the data-parallel buckets. One read first by ops that keep it whole (T5's
# relative position bias: a lookup of its table, a permute, the mask added) and only then by
# sharded ops (the heads of tensor parallel: the bias sliced to each rank's heads; a split
# batch added to it) is the same case one step later: every gradient that reaches those
# whole ops is a rank's addend (a slice's gradient zero-padded, B -> S read as the local
# `slice_summed_grad`; a sharded op's gradient of its whole input), and backward is linear
# in the gradient, so the parameter's gradient is partial_sum too. The whole ops between
# (the cone) carry META_GRAD_PARTIAL: insert_boxing gives them no grad_all_reduce and slices
# them with that box, and the parameter is synchronised after backward. Before, each slice
# all-gathered its gradient every micro-batch (T5 on tensor 2: one all-gather per attention
# stack), each whole input of a sharded op all-reduced its own. A cone must end only in such
# reads (not in an output, a partial read or backward()), read no other value that needs a
# gradient, and stay small (CONE_LIMIT ops: the residual stream of a tensor-parallel model
# is whole and reaches the loss; it is no cone).
CONE_LIMIT = 32


def _whole_cone(starts: List[fx.Node], axis: int) -> Optional[List[fx.Node]]:
    """The ops computing whole values on `axis` from `starts` (a parameter's reads), when every
    other reader of them reads sharded or converts them to a split; else None (See NOTE:
    Whole values with a summed gradient)."""
    cone, todo = [], list(starts)
    members = set(starts)
    stage = starts[0].meta.get(META_STAGE)
    while todo:
        v = todo.pop()
        for u in v.users:
            sig = u.meta.get(META_SBP)
            need = sig.needs(v.name) if sig is not None else None
            if need is None or sig.fallback or isinstance(need[axis], PartialSum) \
                    or u.meta.get(META_STAGE) != stage:   # another stage's mesh: its own axes
                return None
            if isinstance(need[axis], Split) or sharded_use(u, v, axis):
                continue
            if not _whole_step(u, axis, members):
                return None
            if u not in members:
                members.add(u)
                cone.append(u)
                todo.append(u)
            if len(cone) > CONE_LIMIT:
                return None
    return cone


def _whole_step(u: fx.Node, axis: int, members: set) -> bool:
    """Does op u compute a whole value from the cone, reading nothing else that needs a gradient?"""
    sig, meta = u.meta[META_SBP], u.meta.get(META_TENSOR)
    if u.op not in ("call_function", "call_method") or meta is None or not meta.requires_grad \
            or not isinstance(sig.out[axis], Broadcast) or is_backward(u):
        return False
    return all(a in members or not (a.meta.get(META_TENSOR) and a.meta[META_TENSOR].requires_grad)
               for a in u.all_input_nodes)


def _piece_views(param: fx.Node) -> List[fx.Node]:
    """The nodes through which ops read a parameter: itself, or for one read only through
    torch.split the pieces (one stored in pieces, See NOTE: fused pieces; a whole one cut
    alike, as MultiheadAttention's in_proj into q, k and v), whose gradients make up its
    gradient: a piece read by sharded ops is synchronised with the parameter after backward,
    not reduced on its own."""
    if not param.users or any(c.target is not torch.split for c in param.users):
        return [param]
    return [g for c in param.users for g in c.users]


def sharded_use(user: fx.Node, a: fx.Node, axis: int) -> bool:
    """Does `user` read `a` whole (broadcast) on `axis` while computing a sharded output?
    Then a's gradient from this use is partial_sum on that axis."""
    sig: SbpSignature = user.meta[META_SBP]
    need: Optional[tuple] = sig.needs(a.name)
    return (need is not None and isinstance(need[axis], Broadcast)
            and not isinstance(sig.out[axis], Broadcast))
