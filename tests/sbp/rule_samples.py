"""Samples of the SBP rule table for the rule checker (See NOTE: SBP rule check): each RULES
key on inputs of small random shapes (sizes 1 to 5, so dims too small to split and
uneven shards both occur). NOT_SAMPLED names the keys left out and why; a key in neither
fails tests/sbp/test_rule_table.py, so a new rule comes with a sample."""
from __future__ import annotations

import operator
import random

import torch
import torch.nn.functional as F

from graphc.sbp import local_ops
from graphc.sbp.experts import moe_experts
from rule_check import Sample


def dims(rng: random.Random, k: int, lo: int = 1, hi: int = 5):
    return tuple(rng.randint(lo, hi) for _ in range(k))


def randn(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def one(shape_of):
    """Inputs: one float64 tensor of the shape shape_of(rng) gives."""
    return lambda rng: (randn(*shape_of(rng)),)


def _rank(rng):
    return dims(rng, rng.randint(1, 4))


def _matmul_shapes(rng):
    b, m, k, n = dims(rng, 4)
    form = rng.choice(["2x2", "3x2", "3x3", "1x2", "2x1"])
    a = {"2x2": (m, k), "3x2": (b, m, k), "3x3": (b, m, k), "1x2": (k,), "2x1": (m, k)}[form]
    w = {"2x2": (k, n), "3x2": (k, n), "3x3": (b, k, n), "1x2": (k, n), "2x1": (k,)}[form]
    return randn(*a), randn(*w)


def _two_broadcasting(rng):
    shape = _rank(rng)
    other = tuple(s if rng.random() < 0.7 else 1 for s in shape[rng.randint(0, len(shape) - 1):])
    return randn(*shape), randn(*other)


def _linear(rng):
    b, t, i, o = dims(rng, 4)
    return randn(b, t, i), randn(o, i), randn(o)


def _cat(rng):
    shape = list(dims(rng, 3))
    other = list(shape)
    other[rng.randrange(3)] += rng.randint(1, 2)   # the cat dim: where the shapes differ
    return randn(*shape), randn(*other)


def _cat_call(ts, s):
    return ([ts[0], ts[1]], next(d for d in range(3) if s[0][d] != s[1][d])), {}


def _with_mask(rng):
    x, other = _two_broadcasting(rng)
    return x, other > 0


def _cross_entropy(rng):
    n, c = dims(rng, 2, 1, 5)
    return randn(n, c), torch.randint(0, c, (n,))


def _embedding(rng):
    v, e, b, t = dims(rng, 4, 2)
    return torch.randint(0, v, (b, t)), randn(v, e)


def _attention(rng):
    b, h, lq, lk, e = dims(rng, 5)
    return randn(b, h, lq, e), randn(b, h, lk, e), randn(b, h, lk, e)


def _conv(rng):
    n, cin, cout = dims(rng, 3)
    return randn(n, cin, 6, 6), randn(cout, cin, 3, 3), randn(cout)


def _pool_input(rng):
    n, c = dims(rng, 2)
    return (randn(n, c, 6, 6),)


def _pool1_input(rng):
    n, c = dims(rng, 2)
    return (randn(n, c, 6),)


def _bn_input(rng):
    n, c, h = dims(rng, 3)
    return randn(n, c, h), randn(c), randn(c).abs() + 0.5, randn(c), randn(c)


def _stats_input(rng):
    n, c, h = dims(rng, 3)
    x = randn(n, c, h)
    return x, local_ops.batch_norm_sum(x)


def _apply_input(rng):
    n, c, h = dims(rng, 3)
    x = randn(n, c, h)
    stats = local_ops.batch_norm_stats(x, local_ops.batch_norm_sum(x), n * h)
    return x, stats, randn(c), randn(c)


def _reshape_pair(rng):
    """A shape and a reshape of it that keeps, merges or cuts dims."""
    a, b, c = dims(rng, 3)
    shape = (a, b, c)
    target = rng.choice([(a * b, c), (a, b * c), (a, b, c, 1), (a * b * c,), (a, c, b)])
    return shape, target


def first_and(*constants, **kwargs):
    """A call passing the first tensor, then `constants` (dims, sizes), then `kwargs`."""
    return lambda ts, s: ((ts[0], *constants), kwargs)


def all_tensors(**kwargs):
    """A call passing every input tensor in order, then `kwargs`."""
    return lambda ts, s: (tuple(ts), kwargs)


ANY_RANK = one(_rank)
THREE_D = one(lambda rng: dims(rng, 3))


def _at_least(low):
    return one(lambda rng: dims(rng, rng.randint(low, 4)))


def _where(rng):
    x, mask = _with_mask(rng)
    return mask, x, randn(*x.shape)


def _mm(rng):
    m, k, n = dims(rng, 3)
    return randn(m, k), randn(k, n)


def _bmm(rng):
    b, m, k, n = dims(rng, 4)
    return randn(b, m, k), randn(b, k, n)


def _addmm(bias_rows: bool):
    def make(rng):
        m, k, n = dims(rng, 3)
        return randn(*((m, n) if bias_rows else (n,))), randn(m, k), randn(k, n)
    return make


def _layer_norm(rng):
    shape = dims(rng, 3)
    return randn(*shape), randn(shape[-1]), randn(shape[-1])


def _same_shape_pair(rng):
    shape = dims(rng, 2)
    return randn(*shape), randn(*shape)


def _conv1d(rng):
    n, cin, cout = dims(rng, 3)
    return randn(n, cin, 6), randn(cout, cin, 3)


def _conv3d(rng):
    n, cin, cout = dims(rng, 3)
    return randn(n, cin, 3, 3, 3), randn(cout, cin, 2, 2, 2)


def _group_norm(rng):
    n, h = dims(rng, 2)
    return randn(n, 4, h), randn(4), randn(4)


def _set_item_value(rng):
    shape = dims(rng, 3)
    return randn(*shape), randn(shape[0], 1)


def _set_item_mask(rng):
    shape = dims(rng, 2)
    return randn(*shape), randn(*shape) > 0


def _bn_count(ts, s):
    return s[0][0] * s[0][2]   # values per channel of x [N, C, H]


def _reshape_sample(key, label=""):
    state = {}

    def make(rng):
        shape, target = _reshape_pair(rng)
        state["target"] = target
        return (randn(*shape),)
    return Sample(key, make, lambda ts, s: ((ts[0], state["target"]), {}), label)


UNARY_FUNCTIONS = [F.relu, torch.relu, F.gelu, F.silu, torch.tanh, torch.sigmoid,
                   torch.exp, F.sigmoid, F.tanh, torch.neg, operator.neg, torch.rsqrt, torch.sqrt,
                   torch.abs, F.relu6, F.leaky_relu, F.elu, F.hardtanh, F.hardswish, F.softplus,
                   F.mish, F.selu, F.celu, F.hardsigmoid, F.logsigmoid, F.softsign, F.tanhshrink,
                   torch.logical_not, torch.zeros_like, torch.ones_like, torch.detach]
UNARY_METHODS = ["relu", "tanh", "sigmoid", "exp", "neg", "contiguous", "clone", "detach", "logical_not",
                 "rsqrt", "sqrt", "abs", "float", "double"]
BINARY = [operator.add, operator.sub, torch.add, torch.sub, "add", "sub", operator.mul,
          operator.truediv, torch.mul, torch.div, "mul", "div", operator.eq, operator.ne,
          operator.lt, operator.le, operator.gt, operator.ge, torch.eq, torch.ne, torch.lt,
          torch.le, torch.gt, torch.ge, "eq", "ne", "lt", "le", "gt", "ge", "pow", torch.pow,
          operator.pow]

SAMPLES = [Sample(k, _at_least(1)) for k in UNARY_FUNCTIONS + UNARY_METHODS]
SAMPLES += [Sample(k, _at_least(2)) for k in (torch.tril, torch.triu, "tril", "triu")]
SAMPLES += [Sample(F.dropout, ANY_RANK, first_and(p=0.5, training=False), "eval"),
            Sample(F.threshold, ANY_RANK, first_and(0.1, 2.0))]
SAMPLES += [Sample(k, _two_broadcasting) for k in BINARY]
SAMPLES += [Sample(operator.add, ANY_RANK, first_and(1.5), "scalar"),
            Sample(operator.mul, ANY_RANK, first_and(1.5), "scalar"),
            Sample(operator.invert, lambda rng: (randn(*_rank(rng)) > 0,)),
            Sample(torch.where, _where)]
SAMPLES += [Sample(k, _with_mask, lambda ts, s: ((ts[0], ts[1], -1.0), {}))
            for k in ("masked_fill", "masked_fill_", torch.masked_fill)]
SAMPLES += [Sample(k, _matmul_shapes) for k in (torch.matmul, operator.matmul, "matmul")]
SAMPLES += [Sample(k, _mm) for k in (torch.mm, "mm")] + [Sample(k, _bmm) for k in (torch.bmm, "bmm")]
SAMPLES += [Sample(F.linear, _linear),
            Sample(F.linear, lambda rng: _linear(rng)[:2], label="no bias"),
            Sample(torch.addmm, _addmm(bias_rows=False)),
            Sample(torch.addmm, _addmm(bias_rows=True), label="2-D bias")]
SAMPLES += [Sample(k, ANY_RANK, first_and(-1))
            for k in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, "softmax", "log_softmax")]
SAMPLES += [Sample(F.layer_norm, _layer_norm, lambda ts, s: ((ts[0], (s[0][-1],), ts[1], ts[2]), {})),
            Sample(F.embedding, _embedding)]
for k in (torch.sum, torch.mean, "sum", "mean"):
    SAMPLES += [Sample(k, THREE_D, first_and(), "all"), Sample(k, THREE_D, first_and(1), "dim 1"),
                Sample(k, THREE_D, first_and((0, 2), True), "dims 0, 2 keepdim")]
for k in (torch.argmax, torch.argmin, torch.amax, torch.amin, "argmax", "argmin", "amax", "amin"):
    SAMPLES += [Sample(k, THREE_D, first_and(1), "dim 1"),
                Sample(k, THREE_D, first_and(-1, True), "dim -1 keepdim")]
SAMPLES += [Sample(F.cross_entropy, _cross_entropy),
            Sample(F.cross_entropy, _cross_entropy, all_tensors(reduction="sum"), "sum"),
            Sample(F.mse_loss, _same_shape_pair),
            Sample(F.mse_loss, _same_shape_pair, all_tensors(reduction="none"), "none")]
SAMPLES += [_reshape_sample(torch.reshape), _reshape_sample("view"), _reshape_sample("reshape"),
            Sample(torch.flatten, THREE_D, first_and(1)),
            Sample("flatten", THREE_D),
            Sample(torch.unflatten, one(lambda rng: (rng.randint(1, 4), 6)), first_and(1, (2, 3))),
            Sample("unflatten", one(lambda rng: (rng.randint(1, 4), 6)), first_and(1, (3, 2)))]
SAMPLES += [Sample(k, THREE_D, first_and(0, 2)) for k in (torch.transpose, "transpose")]
SAMPLES += [Sample(torch.permute, THREE_D, first_and((2, 0, 1))),
            Sample("permute", THREE_D, first_and(1, 2, 0)),
            Sample("t", one(lambda rng: dims(rng, 2))),
            Sample(torch.cat, _cat, _cat_call)]
SAMPLES += [Sample(k, one(lambda rng: dims(rng, 3, 2)), first_and(1, 1)) for k in (torch.split, "split")]
SAMPLES += [Sample(k, one(lambda rng: dims(rng, 3, 2)), first_and(2, 2)) for k in (torch.chunk, "chunk")]
SAMPLES += [Sample(F.scaled_dot_product_attention, _attention),
            Sample(F.scaled_dot_product_attention, _attention, all_tensors(is_causal=True), "causal"),
            Sample("expand", one(lambda rng: (rng.randint(1, 4), 1, rng.randint(1, 4))),
                   first_and(2, -1, 3, -1))]
SAMPLES += [Sample(k, one(lambda rng: (rng.randint(1, 2), 1)), first_and((3, 2, 4)))
            for k in (torch.broadcast_to, "broadcast_to")]
SAMPLES += [Sample(local_ops.set_item, _set_item_value, lambda ts, s: ((ts[0], (slice(None), 0), ts[1]), {})),
            Sample(local_ops.set_item, _set_item_mask, lambda ts, s: ((ts[0], ts[1], 0.5), {}), "mask")]
SAMPLES += [Sample(k, THREE_D, first_and([1])) for k in (torch.flip, "flip")]
SAMPLES += [Sample(F.pad, THREE_D, first_and((1, 2))),
            Sample(F.pad, THREE_D, first_and((0, 1), "constant", 3.0), "value"),
            Sample(torch.full_like, ANY_RANK, first_and(2.5))]
SAMPLES += [Sample("new_zeros", ANY_RANK, first_and((2, 3))), Sample("new_ones", ANY_RANK, first_and((3,))),
            Sample("new_full", ANY_RANK, first_and((2,), 1.5)),
            Sample("new_empty", ANY_RANK, first_and((0,)))]
SAMPLES += [Sample("half", ANY_RANK), Sample("bfloat16", ANY_RANK),
            Sample("to", ANY_RANK, first_and(torch.float32)),
            Sample("type", ANY_RANK, first_and(torch.float32)),
            Sample("type_as", lambda rng: (randn(*_rank(rng)), torch.zeros(1, dtype=torch.float32)))]
SAMPLES += [Sample(k, ANY_RANK) for k in ("size", "dim", "numel", "nelement", "ndimension")]
SAMPLES += [Sample("size", THREE_D, first_and(0), "dim 0")]
SAMPLES += [Sample(F.conv2d, _conv),
            Sample(F.conv2d, lambda rng: _conv(rng)[:2], label="no bias"),
            Sample(F.conv1d, _conv1d),
            Sample(F.conv3d, _conv3d)]
SAMPLES += [Sample(k, _pool_input, first_and(2)) for k in (F.max_pool2d, F.avg_pool2d)]
SAMPLES += [Sample(k, _pool_input, first_and((2, 3))) for k in (F.adaptive_max_pool2d, F.adaptive_avg_pool2d)]
SAMPLES += [Sample(k, _pool1_input, first_and(2))
            for k in (F.max_pool1d, F.avg_pool1d, F.adaptive_max_pool1d, F.adaptive_avg_pool1d)]
SAMPLES += [Sample(F.group_norm, _group_norm, lambda ts, s: ((ts[0], 2, ts[1], ts[2]), {})),
            Sample(F.batch_norm, _bn_input, lambda ts, s: ((*ts, False), {})),
            Sample(local_ops.batch_norm_sum, lambda rng: _stats_input(rng)[:1]),
            Sample(local_ops.batch_norm_stats, _stats_input,
                   lambda ts, s: ((ts[0], ts[1], _bn_count(ts, s)), {})),
            Sample(local_ops.batch_norm_apply, _apply_input,
                   lambda ts, s: ((ts[0], ts[1], _bn_count(ts, s), ts[2], ts[3]), {}))]
SAMPLES += [Sample(operator.getitem, THREE_D, first_and((slice(None), 0, None, Ellipsis)), "basic"),
            Sample(operator.getitem, THREE_D, first_and((Ellipsis, slice(1, None))), "slice")]


# routing and indexing (graphc/sbp/routing.py, See NOTE: Routing keeps the batch split)
def _ints(high, *shape):
    return torch.randint(0, high, shape)


def _gather(rng):
    a, b, c, k = dims(rng, 4)
    return randn(a, b, c), _ints(c, a, b, k)


def _index_add(rng):
    a, b, c, k = dims(rng, 4)
    return randn(a, b, c), _ints(c, k), randn(a, b, k)


def _lookup(rng):
    rows, c, a, b = dims(rng, 4)
    return randn(rows, c), _ints(rows, a, b)


def _with_a_one(rng):
    return (randn(rng.randint(1, 4), 1, rng.randint(1, 4)),)


SAMPLES += [Sample(k, THREE_D, first_and(1)) for k in (torch.topk, "topk")]
SAMPLES += [Sample(torch.topk, THREE_D, first_and(1, 0), "dim 0")]
SAMPLES += [Sample(k, THREE_D, first_and(-1)) for k in (torch.sort, "sort", torch.argsort, "argsort")]
SAMPLES += [Sample(k, THREE_D, first_and(1)) for k in (torch.cumsum, "cumsum", torch.cumprod, "cumprod")]
SAMPLES += [Sample(k, THREE_D, first_and(2, 0)) for k in (torch.repeat_interleave, "repeat_interleave")]
SAMPLES += [Sample("repeat_interleave", THREE_D, first_and(3, 2), "dim 2")]
SAMPLES += [Sample(k, THREE_D, first_and(1)) for k in (torch.unsqueeze, "unsqueeze")]
SAMPLES += [Sample(k, _with_a_one, first_and(1)) for k in (torch.squeeze, "squeeze")]
SAMPLES += [Sample("squeeze", _with_a_one, label="every 1")]
SAMPLES += [Sample(F.one_hot, lambda rng: (_ints(4, *dims(rng, 2)),), first_and(4))]
SAMPLES += [Sample(k, _gather, lambda ts, s: ((ts[0], 2, ts[1]), {})) for k in (torch.gather, "gather")]
SAMPLES += [Sample(k, _index_add, lambda ts, s: ((ts[0], 2, ts[1], ts[2]), {})) for k in (torch.index_add, "index_add")]
def _experts(rng):
    tokens, hidden, inner, experts = dims(rng, 4)
    experts += 1   # two slots a token, two experts at least
    return (randn(tokens, hidden), _ints(experts, tokens, 2), randn(tokens, 2),
            randn(experts, 2 * inner, hidden), randn(experts, hidden, inner))


def _histc(rng):
    return (randn(*_rank(rng)),)


SAMPLES += [Sample(moe_experts, _experts)]
SAMPLES += [Sample(k, _histc, lambda ts, s: ((ts[0], 5, -2.0, 2.0), {})) for k in (torch.histc, "histc")]
def _two_indices(rng):
    rows, cols, c, a, b = dims(rng, 5)
    return randn(rows, cols, c), _ints(rows, a, 1), _ints(cols, 1, b)


SAMPLES += [Sample("__getitem__", _lookup), Sample(operator.getitem, _lookup, label="index tensor")]
SAMPLES += [Sample(operator.getitem, _two_indices, lambda ts, s: ((ts[0], (ts[1], ts[2])), {}),
                   "index tensors")]   # sbp/tensor_index.py
SAMPLES += [Sample(k, ANY_RANK) for k in ("long", "int", "short", "bool")]
SAMPLES += [Sample("byte", lambda rng: (randn(*_rank(rng)).abs() * 10,))]

NOT_SAMPLED = {
    # in-place running-statistics updates graphc inserts; their rule claims nothing sharded
    local_ops.batch_norm_update_: "replicated: claims no sharded signature",
    local_ops.batch_norm_deferred_update_: "replicated: claims no sharded signature",
    # the dtype/device reads take no tensor arguments the rule lays out
    "get_device": "reads the device only (metadata: claims the input's layout, a host result)",
    torch.empty_like: "its values are unset; zeros_like and ones_like sample the rule (filled_like)",
}
