"""The SBP-rule checker: every candidate a rule claims, run on shards, against the op on the
whole tensor (See NOTE: SBP rule check).

# NOTE: SBP rule check
# A rule (graphc/sbp/rules.py) claims signatures: with its inputs laid out so (split,
# broadcast, partial on one mesh axis of n ranks), each rank's op on its local components
# gives its local component of the output laid out so. Nothing at compile time runs that
# claim, so a wrong rule compiled and failed mid-run with a raw size mismatch. Here a
# Sample gives an op of the table and inputs of small random shapes; for each n and each
# candidate the rule returns, the op is built as a one-node fx graph, annotated as
# infer_sbp would annotate it, made local by localize_ops (global sizes read locally),
# and run on every rank's components: split inputs cut as the runtime cuts them (uneven
# shards included, sbp/layout.local_component), partial ones as random addends. Each
# rank's result must have the shape sbp/layout.local_shape gives and the values of the
# whole op's output laid out as claimed (float64, 1e-10 of 1 + |whole|; exact for
# integers and booleans).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from graphc.ops.conversions import shapes_only
from graphc.meta import META_SBP, META_TENSOR, SbpSignature, TensorMeta
from graphc.passes.localize_ops import localize_ops
from graphc.placement import Broadcast, PartialSum, Split
from graphc.sbp.layout import local_component, local_shape
from graphc.sbp.rules import RuleCtx, rule_for

TOLERANCE = 1e-10   # float64: |local - whole| <= TOLERANCE * (1 + |whole|)
B = Broadcast()


@dataclass(frozen=True)
class Sample:
    """One op of the rule table on random inputs: `make(rng)` returns the input tensors and
    `call(tensors, shapes)` the op's (args, kwargs) given those tensors (or their fx nodes)
    and their shapes (sizes an op names, e.g. layer_norm's normalized_shape)."""

    key: object                 # the RULES key: a function, or a method's name
    make: Callable[[random.Random], Tuple[torch.Tensor, ...]]
    call: Callable[[Sequence, list], Tuple[tuple, dict]] = lambda ts, s: (tuple(ts), {})
    label: str = ""

    @property
    def name(self) -> str:
        key = self.key if isinstance(self.key, str) else getattr(self.key, "__name__", str(self.key))
        return f"{key}{'[' + self.label + ']' if self.label else ''}"

    def arguments(self, inputs: Sequence, tensors: Sequence[torch.Tensor]):
        return self.call(inputs, [tuple(t.shape) for t in tensors])

    def run(self, tensors: Sequence):
        args, kwargs = self.arguments(tensors, tensors)
        if isinstance(self.key, str):
            return getattr(args[0], self.key)(*args[1:], **kwargs)
        return self.key(*args, **kwargs)


def one_op_graph(sample: Sample, tensors: Sequence[torch.Tensor], whole) -> Tuple[fx.Graph, fx.Node]:
    """The sample's op as a graph of placeholders, one node and its output, with META_TENSOR
    (`whole`: the op's output on the whole inputs)."""
    g = fx.Graph()
    phs = [g.placeholder(f"x{i}") for i in range(len(tensors))]
    args, kwargs = sample.arguments(phs, tensors)
    kind = g.call_method if isinstance(sample.key, str) else g.call_function
    node = kind(sample.key, args, kwargs)
    g.output(node)
    for ph, t in zip(phs, tensors):
        ph.meta[META_TENSOR] = TensorMeta.of(t)
    node.meta[META_TENSOR] = TensorMeta.of(whole) if isinstance(whole, torch.Tensor) else None
    return g, node


def candidates(sample: Sample, tensors, whole, n: int, rule=None):
    """What the rule claims for the op on `n` ranks, every input's producer broadcast."""
    _, node = one_op_graph(sample, tensors, whole)
    rule = rule or rule_for(node)
    prod = {a: B for a in node.all_input_nodes}
    return rule(RuleCtx(node, n, prod)) or []


def check_candidate(sample: Sample, tensors, whole, n: int, required: Dict[str, object], out,
                    seed: int = 0) -> Optional[str]:
    """None if the claim holds; else what each rank computed against what it should.
    `required`: placeholder name -> its layout (B where not named)."""
    g, node = one_op_graph(sample, tensors, whole)
    mesh = tuple(range(n))
    layouts = {ph.name: required.get(ph.name, B) for ph in node.all_input_nodes}
    node.meta[META_SBP] = SbpSignature(mesh, (out,), tuple((k, (v,)) for k, v in layouts.items()))
    local = localize_ops(fx.GraphModule(torch.nn.Module(), g))
    names = [f"x{i}" for i in range(len(tensors))]
    parts = {name: _components(t, layouts.get(name, B), mesh, seed) for name, t in zip(names, tensors)}
    results = []
    for k in range(n):   # shapes_only(k): ops that read their mesh coordinate see rank k
        try:
            with shapes_only(k):
                results.append(local(*(parts[name][k] for name in names)))
        except Exception as e:   # the op refuses its local components: the claim is wrong
            shapes = [tuple(parts[name][k].shape) for name in names]
            first_line = str(e).splitlines()[0] if str(e) else ""
            return f"rank {k} raised on local inputs {shapes}: {type(e).__name__}: {first_line}"
    return _compare(whole, results, out, mesh)


def _components(t: torch.Tensor, layout, mesh: tuple, seed: int) -> List[torch.Tensor]:
    """Every rank's local component of `t` laid out as `layout` on a 1-D mesh."""
    n = len(mesh)
    if isinstance(layout, PartialSum):
        g = torch.Generator().manual_seed(seed)
        addends = [torch.randn(t.shape, generator=g, dtype=t.dtype) for _ in range(n - 1)]
        return addends + [t - sum(addends)]
    return [local_component(t, (layout,), mesh, k) for k in range(n)]


def _compare(whole, results: list, out, mesh: tuple) -> Optional[str]:
    """None if the ranks' results are the whole output laid out as `out`, else why not."""
    if isinstance(whole, (tuple, list)):   # split/chunk: every piece laid out alike
        for i, w in enumerate(whole):
            bad = _compare(w, [r[i] for r in results], out, mesh)
            if bad:
                return f"element {i}: {bad}"
        return None
    if not isinstance(whole, torch.Tensor):   # a host value (a size): the same on every rank
        wrong = [k for k, r in enumerate(results) if r != whole]
        return f"ranks {wrong} computed {[results[k] for k in wrong]}, whole {whole}" if wrong else None
    if isinstance(out, PartialSum):
        return _compare_partial(whole, results)
    return _compare_components(whole, results, out, mesh)


def _shapes(tensors) -> list:
    return [tuple(t.shape) for t in tensors]


def _compare_partial(whole: torch.Tensor, results: list) -> Optional[str]:
    if any(r.shape != whole.shape for r in results):
        return f"partial results of shapes {_shapes(results)}, whole {tuple(whole.shape)}"
    return _differs(sum(results), whole, "the sum over ranks")


def _compare_components(whole: torch.Tensor, results: list, out, mesh: tuple) -> Optional[str]:
    """Each rank's result is its component of `whole` laid out as `out` (S or B): shape first."""
    if isinstance(out, Split) and out.dim >= whole.dim():
        return f"claims {out} of a {whole.dim()}-D output (ranks computed shapes {_shapes(results)})"
    for k, r in enumerate(results):
        want = whole if isinstance(out, Broadcast) else local_component(whole, (out,), mesh, k)
        shape = local_shape(whole.shape, (out,), mesh, k)
        if tuple(r.shape) != tuple(shape):
            return (f"rank {k} computed shape {tuple(r.shape)}, its {out} component of "
                    f"{tuple(whole.shape)} is {shape}")
        bad = _differs(r, want, f"rank {k}")
        if bad:
            return bad
    return None


def _differs(got: torch.Tensor, want: torch.Tensor, who: str) -> Optional[str]:
    if want.dtype.is_floating_point:
        err = ((got - want).abs() / (1 + want.abs())).nan_to_num(0.0)
        same_nan = torch.equal(got.isnan(), want.isnan())
        if same_nan and (err.numel() == 0 or err.max() <= TOLERANCE):
            return None
        worst = err.max().item() if err.numel() else 0.0
        return f"{who} differs from the whole op's by {worst:.2e} (nan alike: {same_nan})"
    return None if torch.equal(got, want) else f"{who} differs from the whole op's"


def check_sample(sample: Sample, seed: int, ranks=(2, 3), rule=None) -> List[str]:
    """Every candidate the rule claims for `sample` on random shapes (`seed`), on 2 and 3
    ranks: a list of failures, each naming the op, shapes, ranks and signature."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tensors = sample.make(rng)
    whole = sample.run(tensors)
    failures = []
    for n in ranks:
        for required, out in candidates(sample, tensors, whole, n, rule):
            named = {a.name: s for a, s in required.items()}
            bad = check_candidate(sample, tensors, whole, n, named, out, seed)
            if bad:
                shapes = [tuple(t.shape) for t in tensors]
                failures.append(f"{sample.name} on {n} ranks, inputs {shapes} laid out "
                                f"{named} -> {out}: {bad}")
    return failures
