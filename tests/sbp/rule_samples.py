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


SAMPLES = []
UNARY_FUNCTIONS = [F.relu, torch.relu, F.gelu, F.silu, torch.tanh, torch.sigmoid,
                   torch.exp, F.sigmoid, F.tanh, torch.neg, operator.neg, torch.rsqrt, torch.sqrt,
                   torch.abs, F.relu6, F.leaky_relu, F.elu, F.hardtanh, F.hardswish, F.softplus,
                   F.mish, F.selu, F.celu, F.hardsigmoid, F.logsigmoid, F.softsign, F.tanhshrink,
                   torch.logical_not, torch.tril, torch.triu, torch.zeros_like, torch.ones_like]
UNARY_METHODS = ["relu", "tanh", "sigmoid", "exp", "neg", "contiguous", "clone", "logical_not",
                 "rsqrt", "sqrt", "abs", "tril", "triu", "float", "double"]
for fn in UNARY_FUNCTIONS:
    low = 2 if fn in (torch.tril, torch.triu) else 1
    SAMPLES.append(Sample(fn, one(lambda rng, low=low: dims(rng, rng.randint(low, 4)))))
for name in UNARY_METHODS:
    low = 2 if name in ("tril", "triu") else 1
    SAMPLES.append(Sample(name, one(lambda rng, low=low: dims(rng, rng.randint(low, 4)))))
SAMPLES += [Sample(F.dropout, one(_rank), lambda ts, s: ((ts[0],), {"p": 0.5, "training": False}), "eval")]
SAMPLES += [Sample(F.threshold, one(_rank), lambda ts, s: ((ts[0], 0.1, 2.0), {}))]

BINARY = [operator.add, operator.sub, torch.add, torch.sub, "add", "sub", operator.mul,
          operator.truediv, torch.mul, torch.div, "mul", "div", operator.eq, operator.ne,
          operator.lt, operator.le, operator.gt, operator.ge, torch.eq, torch.ne, torch.lt,
          torch.le, torch.gt, torch.ge, "eq", "ne", "lt", "le", "gt", "ge", "pow", torch.pow,
          operator.pow]
SAMPLES += [Sample(k, _two_broadcasting) for k in BINARY]
SAMPLES += [Sample(operator.add, one(_rank), lambda ts, s: ((ts[0], 1.5), {}), "scalar"),
            Sample(operator.mul, one(_rank), lambda ts, s: ((ts[0], 1.5), {}), "scalar"),
            Sample(operator.invert, lambda rng: (randn(*_rank(rng)) > 0,))]
SAMPLES += [Sample(torch.where, lambda rng: (lambda x, m: (m, x, randn(*x.shape)))(*_with_mask(rng)))]
SAMPLES += [Sample(k, _with_mask, lambda ts, s: ((ts[0], ts[1], -1.0), {}))
            for k in ("masked_fill", "masked_fill_", torch.masked_fill)]
SAMPLES += [Sample(k, _matmul_shapes) for k in (torch.matmul, operator.matmul, "matmul")]
SAMPLES += [Sample(k, lambda rng: (lambda m, k_, n: (randn(m, k_), randn(k_, n)))(*dims(rng, 3)))
            for k in (torch.mm, "mm")]
SAMPLES += [Sample(k, lambda rng: (lambda b, m, k_, n: (randn(b, m, k_), randn(b, k_, n)))(*dims(rng, 4)))
            for k in (torch.bmm, "bmm")]
SAMPLES += [Sample(F.linear, _linear),
            Sample(F.linear, lambda rng: _linear(rng)[:2], label="no bias"),
            Sample(torch.addmm, lambda rng: (lambda m, k_, n: (randn(n), randn(m, k_), randn(k_, n)))(*dims(rng, 3))),
            Sample(torch.addmm, lambda rng: (lambda m, k_, n: (randn(m, n), randn(m, k_), randn(k_, n)))(*dims(rng, 3)), label="2-D bias")]
for k in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, "softmax", "log_softmax"):
    SAMPLES.append(Sample(k, one(_rank), lambda ts, s: ((ts[0], -1), {})))
SAMPLES += [Sample(F.layer_norm, lambda rng: (lambda s: (randn(*s), randn(s[-1]), randn(s[-1])))(dims(rng, 3)),
                   lambda ts, s: ((ts[0], (s[0][-1],), ts[1], ts[2]), {}))]
SAMPLES += [Sample(F.embedding, _embedding)]
for k in (torch.sum, torch.mean, "sum", "mean"):
    SAMPLES += [Sample(k, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0],), {}), "all"),
                Sample(k, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], 1), {}), "dim 1"),
                Sample(k, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], (0, 2), True), {}), "dims 0, 2 keepdim")]
for k in (torch.argmax, torch.argmin, torch.amax, torch.amin, "argmax", "argmin", "amax", "amin"):
    SAMPLES += [Sample(k, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], 1), {}), "dim 1"),
                Sample(k, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], -1, True), {}), "dim -1 keepdim")]
SAMPLES += [Sample(F.cross_entropy, _cross_entropy),
            Sample(F.cross_entropy, _cross_entropy, lambda ts, s: (tuple(ts), {"reduction": "sum"}), "sum"),
            Sample(F.mse_loss, lambda rng: (lambda s: (randn(*s), randn(*s)))(dims(rng, 2))),
            Sample(F.mse_loss, lambda rng: (lambda s: (randn(*s), randn(*s)))(dims(rng, 2)),
                   lambda ts, s: (tuple(ts), {"reduction": "none"}), "none")]


def _reshape_sample(key, label=""):
    state = {}

    def make(rng):
        shape, target = _reshape_pair(rng)
        state["target"] = target
        return (randn(*shape),)
    return Sample(key, make, lambda ts, s: ((ts[0], state["target"]), {}), label)


SAMPLES += [_reshape_sample(torch.reshape), _reshape_sample("view"), _reshape_sample("reshape"),
            Sample(torch.flatten, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], 1), {})),
            Sample("flatten", one(lambda rng: dims(rng, 3))),
            Sample(torch.unflatten, one(lambda rng: (rng.randint(1, 4), 6)), lambda ts, s: ((ts[0], 1, (2, 3)), {})),
            Sample("unflatten", one(lambda rng: (rng.randint(1, 4), 6)), lambda ts, s: ((ts[0], 1, (3, 2)), {}))]
SAMPLES += [Sample(k, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], 0, 2), {})) for k in (torch.transpose, "transpose")]
SAMPLES += [Sample(torch.permute, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], (2, 0, 1)), {})),
            Sample("permute", one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], 1, 2, 0), {})),
            Sample("t", one(lambda rng: dims(rng, 2)))]
SAMPLES += [Sample(torch.cat, _cat, _cat_call)]
SAMPLES += [Sample(k, one(lambda rng: dims(rng, 3, 2)), lambda ts, s: ((ts[0], 1, 1), {})) for k in (torch.split, "split")]
SAMPLES += [Sample(k, one(lambda rng: dims(rng, 3, 2)), lambda ts, s: ((ts[0], 2, 2), {})) for k in (torch.chunk, "chunk")]
SAMPLES += [Sample(F.scaled_dot_product_attention, _attention),
            Sample(F.scaled_dot_product_attention, _attention, lambda ts, s: (tuple(ts), {"is_causal": True}), "causal")]
SAMPLES += [Sample("expand", one(lambda rng: (rng.randint(1, 4), 1, rng.randint(1, 4))),
                   lambda ts, s: ((ts[0], 2, -1, 3, -1), {}))]
SAMPLES += [Sample(k, one(lambda rng: (rng.randint(1, 2), 1)), lambda ts, s: ((ts[0], (3, 2, 4)), {}))
            for k in (torch.broadcast_to, "broadcast_to")]
SAMPLES += [Sample(local_ops.set_item, lambda rng: (lambda s: (randn(*s), randn(s[0], 1)))(dims(rng, 3)),
                   lambda ts, s: ((ts[0], (slice(None), 0), ts[1]), {})),
            Sample(local_ops.set_item, lambda rng: (lambda s: (randn(*s), randn(*s) > 0))(dims(rng, 2)),
                   lambda ts, s: ((ts[0], ts[1], 0.5), {}), "mask")]
SAMPLES += [Sample(k, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], [1]), {})) for k in (torch.flip, "flip")]
SAMPLES += [Sample(F.pad, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], (1, 2)), {})),
            Sample(F.pad, one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], (0, 1), "constant", 3.0), {}), "value")]
SAMPLES += [Sample(torch.full_like, one(_rank), lambda ts, s: ((ts[0], 2.5), {}))]
SAMPLES += [Sample("new_zeros", one(_rank), lambda ts, s: ((ts[0], (2, 3)), {})),
            Sample("new_ones", one(_rank), lambda ts, s: ((ts[0], (3,)), {})),
            Sample("new_full", one(_rank), lambda ts, s: ((ts[0], (2,), 1.5), {})),
            Sample("new_empty", one(_rank), lambda ts, s: ((ts[0], (0,)), {}))]
SAMPLES += [Sample("half", one(_rank)), Sample("bfloat16", one(_rank)),
            Sample("to", one(_rank), lambda ts, s: ((ts[0], torch.float32), {})),
            Sample("type", one(_rank), lambda ts, s: ((ts[0], torch.float32), {})),
            Sample("type_as", lambda rng: (randn(*_rank(rng)), torch.zeros(1, dtype=torch.float32)))]
SAMPLES += [Sample(k, one(_rank)) for k in ("size", "dim", "numel", "nelement", "ndimension")]
SAMPLES += [Sample("size", one(lambda rng: dims(rng, 3)), lambda ts, s: ((ts[0], 0), {}), "dim 0")]
SAMPLES += [Sample(F.conv2d, _conv),
            Sample(F.conv2d, lambda rng: _conv(rng)[:2], label="no bias"),
            Sample(F.conv1d, lambda rng: (lambda n, ci, co: (randn(n, ci, 6), randn(co, ci, 3)))(*dims(rng, 3))),
            Sample(F.conv3d, lambda rng: (lambda n, ci, co: (randn(n, ci, 3, 3, 3), randn(co, ci, 2, 2, 2)))(*dims(rng, 3)))]
SAMPLES += [Sample(k, _pool_input, lambda ts, s: ((ts[0], 2), {})) for k in (F.max_pool2d, F.avg_pool2d)]
SAMPLES += [Sample(k, _pool_input, lambda ts, s: ((ts[0], (2, 3)), {})) for k in (F.adaptive_max_pool2d, F.adaptive_avg_pool2d)]
SAMPLES += [Sample(k, _pool1_input, lambda ts, s: ((ts[0], 2), {}))
            for k in (F.max_pool1d, F.avg_pool1d, F.adaptive_max_pool1d, F.adaptive_avg_pool1d)]
SAMPLES += [Sample(F.group_norm, lambda rng: (lambda n, h: (randn(n, 4, h), randn(4), randn(4)))(*dims(rng, 2)),
                   lambda ts, s: ((ts[0], 2, ts[1], ts[2]), {}))]
SAMPLES += [Sample(F.batch_norm, _bn_input, lambda ts, s: ((ts[0], ts[1], ts[2], ts[3], ts[4], False), {})),
            Sample(local_ops.batch_norm_sum, lambda rng: _stats_input(rng)[:1]),
            Sample(local_ops.batch_norm_stats, _stats_input,
                   lambda ts, s: ((ts[0], ts[1], s[0][0] * s[0][2]), {})),
            Sample(local_ops.batch_norm_apply, _apply_input,
                   lambda ts, s: ((ts[0], ts[1], s[0][0] * s[0][2], ts[2], ts[3]), {}))]
SAMPLES += [Sample(operator.getitem, one(lambda rng: dims(rng, 3)),
                   lambda ts, s: ((ts[0], (slice(None), 0, None, Ellipsis)), {}), "basic"),
            Sample(operator.getitem, one(lambda rng: dims(rng, 3)),
                   lambda ts, s: ((ts[0], (Ellipsis, slice(1, None))), {}), "slice")]

NOT_SAMPLED = {
    # in-place running-statistics updates graphc inserts; their rule claims nothing sharded
    local_ops.batch_norm_update_: "replicated: claims no sharded signature",
    local_ops.batch_norm_deferred_update_: "replicated: claims no sharded signature",
    # the dtype/device reads take no tensor arguments the rule lays out
    "get_device": "reads the device only (metadata: claims the input's layout, a host result)",
    torch.empty_like: "its values are unset; zeros_like and ones_like sample the rule (filled_like)",
}
