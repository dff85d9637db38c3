"""The weight half of a split backward without walking the input path again.

NOTE: Weight gradients
A split backward runs I (gradients of the stage's inputs, sent upstream at once) and later W
(the parameters' gradients). A plain W would differentiate the stage's outputs again with
respect to the parameters, repeating every node I already ran (the activation gradients
between layers). Instead, before I runs, `WeightGroups.find` walks the autograd graph once:

  * the input closure: every node from which an input leaf that needs a gradient is
    reached (the nodes I runs);
  * for each parameter, the nodes of the input closure where a branch that leads to the
    parameter (and to no input) leaves it: its *intermediates*. For y = x @ W.T that is
    the matmul's backward node: I runs it for x's gradient, W runs it again only for
    W's edge.

I registers a pre-hook on every intermediate that keeps the gradient flowing into it
(its grad_outputs). W then runs, per group of parameters that share intermediates,
`torch.autograd.backward` from those intermediates (GradientEdge roots) with the kept
gradients, `inputs=` the group's parameters: autograd runs only the nodes that lead to
them, and accumulates into `.grad` as a whole backward would (post-accumulate hooks fire,
so the gradient sync counts the accumulation). Where one intermediate of a group lies
below another (a layer applied twice), the flow from the upper one into the lower one
would add to the lower one's kept gradient, which is already the whole gradient: a
pre-hook on each intermediate replaces what arrives with what I kept. Parameters whose
branch leaves the graph above the input closure (a stage whose inputs need no gradient,
or a branch that hangs off an output) take the stage's outputs as roots as well.
The result is the whole backward's gradient, summed in the same places; float64 tests
compare it with a whole backward (tests/runtime/test_weight_grads.py).

An intermediate whose backward already gave I every gradient of its parameter branches (a
piece compiled whole: one kernel program computes them all, NOTE: Compiled stages) is not run
again: a post-hook keeps what it gave, and W starts from its edges into those branches with
those gradients. An eager node computes only what I asked for, so W runs it as above; so
does a compiled piece whose backward is split, which gives its parameters nothing in I and
runs only its weight part in W (NOTE: Split compiled backward).
"""
from __future__ import annotations

from collections import deque
from typing import Dict, List, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


class WeightGroups:
    """What W needs, found before I runs, and the gradients I leaves for it."""

    def __init__(self, groups: List[Tuple[List[Node], List[torch.Tensor], bool]], closure: Set[Node] = frozenset()):
        self.groups = groups     # (intermediates, parameters, also from the outputs)
        self.closure = closure   # the input closure: the nodes I runs
        self.kept: Dict[Node, Tuple] = {}
        self.given: Dict[Node, Tuple] = {}   # what an intermediate computed in I, per next edge
        self._handles: list = []

    @staticmethod
    def find(roots: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor],
             params: Sequence[torch.Tensor]) -> "WeightGroups":
        parents, nodes = _reverse_edges(roots)
        inputs = _closure([get_gradient_edge(t).node for t in leaves if t.requires_grad], parents)
        by_param: List[Tuple[torch.Tensor, Set[Node], bool]] = []
        for p in params:
            node = get_gradient_edge(p).node
            if node not in nodes:
                continue        # no root leads to it: it gets no gradient
            met, top = _meet(node, parents, inputs)
            by_param.append((p, met, top))
        return WeightGroups(_group(by_param), inputs)

    def keep(self) -> None:
        """Registers the pre-hooks that keep each intermediate's incoming gradient during I."""
        for inter, _, _ in self.groups:
            for node in inter:
                self._handles.append(node.register_prehook(self._keeper(node)))
                self._handles.append(node.register_hook(self._catcher(node)))

    def _keeper(self, node: Node):
        def hook(grad_outputs):
            self.kept[node] = tuple(grad_outputs)
        return hook

    def _catcher(self, node: Node):
        def hook(grad_inputs, _grad_outputs):
            self.given[node] = tuple(grad_inputs)
        return hook

    def _branches(self, node: Node):
        """The parameters' branches below `node` with the gradients I already computed for
        them: a compiled piece's backward (NOTE: Compiled stages) computes every input's
        gradient, so W need not run it again. None where I left one out (an eager node
        computes only the gradients asked for)."""
        given = self.given.get(node)
        if given is None:
            return None
        out = []
        for (nxt, nr), g in zip(node.next_functions, given):
            if nxt is None or nxt in self.closure:
                continue
            if g is None:
                return None
            out.append((GradientEdge(nxt, nr), g))
        return out

    def release(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def run(self, roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor]) -> None:
        """W: each group's parameters' gradients, accumulated into .grad."""
        self.release()
        for inter, params, from_outputs in self.groups:
            edges, grads, rerun = [], [], []
            for node in inter:
                branches = self._branches(node)
                if branches is not None:    # start below it, from what I computed
                    edges += [e for e, _ in branches]
                    grads += [g for _, g in branches]
                    continue
                rerun.append(node)
                for i, g in enumerate(self.kept.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if from_outputs:
                edges += list(roots)
                grads += list(root_grads)
            if not edges:
                continue
            clamps = [node.register_prehook(lambda _, kept=self.kept.get(node): kept)
                      for node in rerun if len(edges) > 1 and node in self.kept]
            try:
                torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
            finally:
                for h in clamps:
                    h.remove()
        self.kept, self.given = {}, {}


def _reverse_edges(roots: Sequence[torch.Tensor]) -> Tuple[Dict[Node, List[Node]], Set[Node]]:
    """node -> the nodes whose backward feeds it (its parents toward the outputs), and every
    node the roots reach."""
    parents: Dict[Node, List[Node]] = {}
    start = [r.grad_fn for r in roots if r.grad_fn is not None]
    seen: Set[Node] = set(start)
    todo = deque(start)
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            parents.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return parents, seen


def _closure(start: Sequence[Node], parents: Dict[Node, List[Node]]) -> Set[Node]:
    """Every node from which one of `start` is reached (start included)."""
    out: Set[Node] = set(start)
    todo = deque(start)
    while todo:
        for up in parents.get(todo.popleft(), ()):
            if up not in out:
                out.add(up)
                todo.append(up)
    return out


def _meet(param_node: Node, parents, inputs: Set[Node]) -> Tuple[Set[Node], bool]:
    """The input-closure nodes a parameter's branch leaves from, and whether the branch also
    reaches a root (a node no other node feeds) outside the input closure."""
    met: Set[Node] = set()
    top = False
    seen = {param_node}
    todo = deque([param_node])
    while todo:
        node = todo.popleft()
        ups = parents.get(node, ())
        if not ups:
            top = True
        for up in ups:
            if up in inputs:
                met.add(up)
            elif up not in seen:
                seen.add(up)
                todo.append(up)
    return met, top


def _group(by_param) -> List[Tuple[List[Node], List[torch.Tensor], bool]]:
    """Parameters sharing an intermediate (or both hanging off the outputs) form one group."""
    groups: List[list] = []     # [set of nodes, params, from_outputs]
    for p, met, top in by_param:
        joined = [g for g in groups if g[0] & met or (top and g[2])]
        merged = [set(met), [p], top]
        for g in joined:
            merged[0] |= g[0]
            merged[1] = g[1] + merged[1]
            merged[2] = merged[2] or g[2]
            groups.remove(g)
        groups.append(merged)
    return [(list(nodes), params, top) for nodes, params, top in groups]
