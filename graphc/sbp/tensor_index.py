"""SBP of advanced indexing by several index tensors: `x[i0, i1, ...]` (Hugging Face's padding
mask read as `padding_mask[batch_idx, kv_idx]` when it builds a 4-D attention mask).

The output is x gathered at the broadcast index tensors, then x's dims that no tensor indexes.
Indices whole (broadcast), the gather is linear in a floating x (P -> P), and a dim of x that
no tensor indexes keeps its split after the index's dims. Anything else (an index tensor split, a dim
indexed while split) reads positions another rank holds: its inputs are then gathered, by
this rule's whole-inputs signature rather than as an op without a rule.
"""
from __future__ import annotations

from typing import List, Optional

import torch.fx as fx

from .context import Candidate, RuleCtx
from .layout import B, P, S

_INTEGER = ("int64", "int32", "int16", "int8", "uint8")


def index_by_tensors(ctx: RuleCtx, x: fx.Node, items: tuple) -> Optional[List[Candidate]]:
    """x[t0, ..., tm-1, :, ...]: m leading integer index tensors, the rest of x taken whole;
    None for other mixes of tensors and basic indices (no rule)."""
    mx, out = ctx.meta(x), ctx.out
    tensors = [i for i in items if isinstance(i, fx.Node)]
    m = len(tensors)
    if mx is None or out is None or list(items[:m]) != tensors or \
            any(i != slice(None) for i in items[m:]):
        return None
    if any(ctx.meta(t) is None or ctx.meta(t).dtype not in _INTEGER for t in tensors):
        return None
    whole = {t: B for t in tensors}
    ahead = len(out.shape) - (len(mx.shape) - m)   # the output dims the index tensors make
    # linear in x: a partial x gives a partial result (floating x only: a mask or an index is
    # never a sum of addends)
    cands: List[Candidate] = [({x: P, **whole}, P)] if mx.dtype.startswith(("float", "bfloat")) else []
    cands += [({x: S(d), **whole}, S(ahead + d - m)) for d in range(m, len(mx.shape)) if ctx.splits(mx.shape[d])]
    return cands
