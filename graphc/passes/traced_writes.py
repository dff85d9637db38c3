"""Item writes while tracing: `x[index] = value` in build() as an out-of-place node.

# NOTE: Item writes
fx records calls, not assignments: `h[:, 0] = 0.0` on a traced tensor has no node to
become ("'Proxy' object does not support item assignment"). graphc records it as
`h = set_item(h, index, value)`, a copy of h with the entries written, and points the
Python object `h` the user holds at the new node, so every later read of `h` sees the write
and the graph stays a data flow the row, shape and SBP passes read like any op
(graphc/batch_rows/indexing.py: set_item). That equals eager's in-place write as long as nothing
else reads the old storage afterwards: a view of h taken before the write (`a = h[0]`,
`h.view(...)`), or the base h when the write goes through a view (`h[0][1] = v`), would
see the write in eager and the old value here. So every node that shares storage with the
written tensor at the write is noted, and a read of one of them after the write is refused
naming both lines (check_item_writes). Writing into a parameter or buffer is refused too
(assign the buffer whole, `self.buf = ...`, which graphc copies into it). A write into an
input of build() does not reach the caller's tensor, which eager's would.

# NOTE: In-place methods
`h.add_(x)`, `h.clamp_(0)`, `h += x` (NOTE: Augmented assignment) on a traced tensor are item
writes of the whole tensor, recorded the same way: `h = h.add(x)` cast back to h's dtype (an
in-place op keeps its tensor's dtype: a float32 loss stays float32 when a float64 term is
added into it), the Python object h pointed at the new node, so every name bound to that
object (`r = h`) reads the write, and a read after the write of another node sharing h's
storage (a view taken before it) is refused, as for item writes. Recorded in place instead,
the write would be one node among others to the SBP passes: a split or partial value
gathered into a whole copy for an op without a rule (add_ had none) takes the write on the
copy, and a name for the value before it keeps the value unwritten -- on data, tensor and
pipeline layouts, while one process agrees with eager. Left in place: a write into a
parameter or buffer, or into a view of one (traced_tensors.refuse_parameter_write, the
buffer updates of modules), and a method without an out-of-place twin computing the same
write (uniform_, zero_, unsqueeze_, bernoulli_: traced_writes._NOT_TWINS).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.fx as fx

from ..errors import GraphcError
from ..sbp.local_ops import set_item


def write_item(tracer, proxy: fx.Proxy, index, value, where: str) -> None:
    """Records `proxy[index] = value` as set_item and points `proxy` at its result."""
    old = proxy.node
    if old.op == "get_attr":
        raise GraphcError(
            f"build() writes into the parameter or buffer '{old.target}' with an item assignment "
            f"at {where}; graphc records build() as a data flow and this write would not reach "
            "the module's tensor. Fix: assign the buffer whole (self.buf = torch.where(...) or a "
            "written copy), which graphc copies into it, or write under torch.no_grad() outside "
            "build().")
    aliases = _sharing_storage(tracer.graph, old, tracer.node_fake)
    new = tracer.create_proxy("call_function", set_item, (proxy, index, value), {})
    tracer.item_writes.append((new.node, aliases, where))
    proxy.node = new.node


def write_in_place(tracer, proxy: fx.Proxy, method: str, where: str, *args, **kwargs) -> fx.Proxy:
    """Records `proxy.<method>(*args)` (an in-place method, See NOTE: In-place methods) as its
    out-of-place twin in proxy's dtype and points `proxy` at the result; returns `proxy`, as
    the in-place method returns its tensor."""
    old = proxy.node
    aliases = _sharing_storage(tracer.graph, old, tracer.node_fake)
    if any(a.op == "get_attr" for a in aliases):   # a parameter's or buffer's own write
        return tracer.create_proxy("call_method", method, (proxy,) + args, kwargs)
    before = tracer.node_fake(old)
    new = tracer.create_proxy("call_method", method[:-1], (proxy,) + args, kwargs)
    after = tracer.node_fake(new.node)
    if isinstance(after, torch.Tensor) and tuple(after.shape) != tuple(before.shape):
        raise GraphcError(
            f"build() writes {method} into a tensor of shape {tuple(before.shape)} at {where}, but "
            f"the result has shape {tuple(after.shape)}: eager raises here (an in-place op cannot "
            "change its tensor's shape). Fix: write it out of place, h = h.{method[:-1]}(...).")
    if isinstance(after, torch.Tensor) and after.dtype != before.dtype:
        new = tracer.create_proxy("call_method", "to", (new, before.dtype), {})
    tracer.item_writes.append((new.node, aliases, where))
    proxy.node = new.node
    return proxy


# in-place methods whose twin is not the same write: views changing the tensor's own shape
# (h.unsqueeze_(0) is legal in eager) and bernoulli_ (its twin reads the tensor as probabilities)
_NOT_TWINS = frozenset({"as_strided_", "resize_as_", "squeeze_", "unsqueeze_", "swapaxes_", "swapdims_",
                        "t_", "transpose_", "bernoulli_"})


def in_place_twin(method: str) -> bool:
    """Has the in-place tensor method an out-of-place twin computing the same write (add_ -> add)?"""
    return method.endswith("_") and not method.startswith("_") and method not in _NOT_TWINS \
        and hasattr(torch.Tensor, method[:-1])


def check_item_writes(graph: fx.Graph, writes: List[Tuple[fx.Node, List[fx.Node], str]],
                      line_of: Callable[[fx.Node], str]) -> None:
    """Refuses a read, after an item write, of a tensor that shared storage with the written
    one (See NOTE: Item writes): eager would read the written entries."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for write, aliases, where in writes:
        for alias in aliases:
            late = [u for u in alias.users if order[u] > order[write] and not _writes_back(u, alias, write)]
            if late:
                raise GraphcError(
                    f"build() writes into a tensor (x[index] = value, or an in-place method) at "
                    f"{where}, and then reads '{alias.name}', "
                    f"which shares memory with the written tensor (a view of it, or the tensor "
                    f"it is a view of), at {line_of(late[0])}. In eager that read sees the "
                    "write; graphc records the write as a new value. Fix: take the view after "
                    "the write, or write into the tensor itself and not through a view.")


def _writes_back(user: fx.Node, base: fx.Node, write: fx.Node) -> bool:
    """`h[i] += v` is h.__setitem__(i, h[i].__iadd__(v)): the view's write (`write`) stored
    back into its base by the set_item right after, which is then what h reads (eager's write
    through the view, whole)."""
    return user.target is set_item and user.args[0] is base and user.args[2] is write


def _sharing_storage(graph: fx.Graph, node: fx.Node, fake: Callable[[fx.Node], Optional[object]]) -> List[fx.Node]:
    target = fake(node)
    if not isinstance(target, torch.Tensor):
        return [node]
    storage = _storage(target)
    return [n for n in graph.nodes if n is node or
            (isinstance(fake(n), torch.Tensor) and _storage(fake(n)) == storage)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
