"""How each op moves the batch's rows (see graphc/batch_rows/__init__.py); used by find_batch_dims.

`rows_of(ctx)` returns a node's value: a Rows for a tensor, a tuple or Each for sequences
of tensors, None for anything else. Rules are looked up by the op's name (torch.add,
Tensor.add, operator.add all read "add"; in-place "add_" reads "add") or module type.
An op without a rule keeps its first input's rows where its output keeps that input's
shape (or leading size); rows it does not keep, and a batch mean passed through it, count
as mixed (graphc cannot tell what the op did with them).
"""
from __future__ import annotations

import operator
from typing import Callable, Dict

import torch
import torch.fx as fx
import torch.nn as nn

from ..meta import META_TENSOR

from .context import Ctx, op_name
from .layers import (add_product, attention, class_loss, created, default, distance, einsum, embedding, like,
                     linear, matmul, multihead_attention, one_hot, outer_pairs, pointwise_loss, rnn)
from .indexing import (embedding_bag, gather, index_add, index_write, picks, put, repeat_interleave, scatter,
                       set_item)
from .shapes import (along, attribute, concat, diagonal, divide, elementwise, expand, getitem, identity,
                     movedim, multiply, normalize_last, pad, per_sample, permute, pieces, reduction,
                     reshape, reverse_dims, squeeze, stack, tile, transpose, triangle, unsqueeze)

__all__ = ["Ctx", "RULES", "MODULE_RULES", "default", "rows_of"]


# -- the tables -------------------------------------------------------------------------------
_LINEAR = ("add", "sub", "rsub", "neg", "positive", "clone", "contiguous", "detach", "to", "float",
           "double", "half", "bfloat16", "type", "requires_grad", "cpu", "cuda",
           "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
           "to_global_op", "sum_to_size", "real", "conj", "iadd", "isub", "radd")
_NONLINEAR = ("relu", "gelu", "silu", "sigmoid", "tanh", "exp", "exp2", "log", "log2", "log10",
              "log1p", "expm1", "sqrt", "rsqrt", "abs", "pow", "square", "sin", "cos", "clamp", "clip",
              "clamp_min", "clamp_max", "where", "maximum", "minimum", "fmax", "fmin", "masked_fill",
              "leaky_relu", "elu", "selu", "celu", "softplus", "mish", "hardtanh", "relu6",
              "hardswish", "hardsigmoid", "logsigmoid", "softsign", "tanhshrink", "threshold",
              "erf", "erfc", "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", "reciprocal",
              "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
              "logical_xor", "and", "or", "xor", "invert", "bitwise_not", "bitwise_and",
              "bitwise_or", "isnan", "isinf", "isfinite", "nan_to_num", "lerp", "floordiv",
              "floor_divide", "mod", "remainder", "fmod", "atan2", "float_power", "xlogy", "prelu",
              "rrelu", "silu", "logit", "sinh", "cosh", "asin", "acos", "atan", "tan", "addcmul",
              "addcdiv", "heaviside", "copysign", "polar",
              "hardshrink", "softshrink", "sigmoid", "bool", "glu")
_INTEGER_CASTS = ("long", "int", "short", "byte", "char")
_LINEAR_REDUCE = {"sum": 1, "mean": 1, "nansum": 1, "nanmean": 1}
_OTHER_REDUCE = {"prod": 1, "amax": 1, "amin": 1, "max": 1, "min": 1, "argmax": 1, "argmin": 1,
                 "logsumexp": 1, "std": 1, "var": 1, "median": 1, "nanmedian": 1, "mode": 1,
                 "all": 1, "any": 1, "count_nonzero": 1, "norm": 2, "vector_norm": 2,
                 "std_mean": 1, "var_mean": 1, "aminmax": 1}
_TUPLE_REDUCE = ("std_mean", "var_mean", "aminmax", "mode")

def integer_cast(ctx: Ctx):
    """A cast to an integer type truncates a floating value (nonlinear: a mean's parts
    truncated do not average to the mean truncated) but keeps an integer one (a count)."""
    source = ctx.arg(0, "input")
    meta = source.meta.get(META_TENSOR) if isinstance(source, fx.Node) else None
    exact = meta is not None and not getattr(torch, meta.dtype).is_floating_point \
        and not getattr(torch, meta.dtype).is_complex
    return elementwise(exact)(ctx)


RULES: Dict[str, Callable] = {}
RULES.update({n: elementwise(True) for n in _LINEAR})
RULES.update({n: elementwise(False) for n in _NONLINEAR})
RULES.update({n: integer_cast for n in _INTEGER_CASTS})
RULES.update({n: reduction(at, True) for n, at in _LINEAR_REDUCE.items()})
RULES.update({n: reduction(at, False, n in _TUPLE_REDUCE) for n, at in _OTHER_REDUCE.items()})
RULES["histc"] = reduction(9, True)   # counts every entry (it takes no dim): a batch sum
RULES.update({
    "mul": multiply, "imul": multiply, "truediv": divide, "div": divide, "divide": divide,
    "true_divide": divide, "itruediv": divide,
    "softmax": along(1, None), "log_softmax": along(1, None), "softmin": along(1, None),
    "cumsum": along(1, None, linear=True), "cumprod": along(1, None), "logcumsumexp": along(1, None),
    "cummax": along(1, None, tuple_out=True), "cummin": along(1, None, tuple_out=True),
    "sort": along(1, -1, tuple_out=True), "argsort": along(1, -1), "flip": along(1, None, linear=True),
    "roll": along(2, None, linear=True), "normalize": along(2, 1), "topk": along(2, -1, tuple_out=True),
    "kthvalue": along(2, -1, tuple_out=True), "diff": along(2, -1, linear=True),
    "layer_norm": normalize_last(1, "normalized_shape"), "rms_norm": normalize_last(1, "normalized_shape"),
    "group_norm": per_sample(1), "instance_norm": per_sample(2),
    # BatchNorm in training mode normalises over the batch: see the BatchNorm row of issue 14
    # (deferred batch norm); here it keeps rows like any per-row op
    "batch_norm": identity,
    "conv1d": per_sample(1), "conv2d": per_sample(1), "conv3d": per_sample(1),
    "conv_transpose1d": per_sample(1), "conv_transpose2d": per_sample(1),
    "conv_transpose3d": per_sample(1), "max_pool1d": per_sample(1), "max_pool2d": per_sample(1),
    "max_pool3d": per_sample(1), "avg_pool1d": per_sample(1), "avg_pool2d": per_sample(1),
    "avg_pool3d": per_sample(1), "adaptive_avg_pool1d": per_sample(1),
    "adaptive_avg_pool2d": per_sample(1), "adaptive_max_pool2d": per_sample(1),
    "interpolate": per_sample(1),
    "view": reshape, "reshape": reshape, "flatten": reshape, "unflatten": reshape,
    "view_as": reshape, "reshape_as": reshape, "ravel": reshape,
    "transpose": transpose, "swapaxes": transpose, "swapdims": transpose, "permute": permute,
    "movedim": movedim, "moveaxis": movedim, "t": reverse_dims,
    "getattr": attribute, "getitem": getitem,
    "unsqueeze": unsqueeze, "squeeze": squeeze, "expand": expand, "expand_as": expand,
    "broadcast_to": expand, "repeat": tile, "tile": tile,
    "type_as": identity,
    "cat": concat, "concat": concat, "concatenate": concat, "stack": stack,
    "chunk": pieces(2), "split": pieces(2), "tensor_split": pieces(2), "split_with_sizes": pieces(2),
    "unbind": pieces(1, drop=True),
    "select": picks(1, True), "narrow": picks(1, False), "index_select": picks(1, False),
    "gather": gather, "take_along_dim": gather, "pad": pad,
    "scatter": scatter, "scatter_add": scatter, "scatter_reduce": scatter, "index_add": index_add,
    "index_fill": index_write, "index_copy": index_write, "index_put": put, "masked_scatter": put,
    "set_item": set_item,
    "repeat_interleave": repeat_interleave, "embedding_bag": embedding_bag,  # See NOTE: Indexing along a dim
    "tril": triangle, "triu": triangle, "diag": diagonal, "diagonal": diagonal,
    "diag_embed": diagonal, "trace": diagonal,
    "matmul": matmul, "mm": matmul, "bmm": matmul, "mv": matmul, "dot": matmul, "inner": matmul,
    "addmm": add_product, "addmv": add_product, "baddbmm": add_product,
    "linear": linear, "einsum": einsum, "scaled_dot_product_attention": attention,
    "embedding": embedding, "one_hot": one_hot,
    "cosine_similarity": distance(2, 1), "pairwise_distance": distance(4, -1),
    "cdist": outer_pairs, "outer": outer_pairs,
    "cross_entropy": class_loss, "nll_loss": class_loss,
    "arange": created, "zeros": created, "ones": created, "full": created, "empty": created,
    "rand": created, "randn": created, "randint": created, "eye": created, "linspace": created,
    "tensor": created, "new_zeros": created, "new_ones": created, "new_full": created,
    "new_empty": created, "new_tensor": created, "scalar_tensor": created,
    "zeros_like": like, "ones_like": like, "full_like": like, "empty_like": like,
    "rand_like": like, "randn_like": like, "randint_like": like,
})
for _loss in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
              "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss", "poisson_nll_loss",
              "gaussian_nll_loss", "hinge_embedding_loss", "margin_ranking_loss",
              "multilabel_soft_margin_loss"):
    RULES[_loss] = pointwise_loss

_ACTIVATION_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU,
                       nn.CELU, nn.Softplus, nn.Mish, nn.Hardtanh, nn.ReLU6, nn.Hardswish,
                       nn.Hardsigmoid, nn.LogSigmoid, nn.PReLU, nn.Softsign, nn.Tanhshrink,
                       nn.Threshold, nn.GLU)
MODULE_RULES: Dict[type, Callable] = {
    nn.Linear: linear, nn.Embedding: embedding, nn.EmbeddingBag: embedding_bag, nn.Identity: identity,
    nn.Dropout: elementwise(True), nn.Dropout1d: elementwise(True), nn.Dropout2d: elementwise(True),
    nn.Dropout3d: elementwise(True), nn.AlphaDropout: elementwise(True),
    nn.LayerNorm: normalize_last(1, ""), nn.RMSNorm: normalize_last(1, ""),
    nn.GroupNorm: per_sample(1), nn.InstanceNorm1d: per_sample(2), nn.InstanceNorm2d: per_sample(2),
    nn.InstanceNorm3d: per_sample(2),
    nn.BatchNorm1d: identity, nn.BatchNorm2d: identity, nn.BatchNorm3d: identity,  # see batch_norm
    nn.Conv1d: per_sample(1), nn.Conv2d: per_sample(1), nn.Conv3d: per_sample(1),
    nn.ConvTranspose1d: per_sample(1), nn.ConvTranspose2d: per_sample(1),
    nn.MaxPool1d: per_sample(1), nn.MaxPool2d: per_sample(1), nn.AvgPool1d: per_sample(1),
    nn.AvgPool2d: per_sample(1), nn.AdaptiveAvgPool1d: per_sample(1),
    nn.AdaptiveAvgPool2d: per_sample(1), nn.Upsample: per_sample(1),
    nn.Flatten: reshape, nn.Unflatten: reshape,
    nn.CrossEntropyLoss: class_loss, nn.NLLLoss: class_loss,
    nn.RNN: rnn, nn.LSTM: rnn, nn.GRU: rnn, nn.MultiheadAttention: multihead_attention,
}
MODULE_RULES.update({m: elementwise(False) for m in _ACTIVATION_MODULES})
for _m in (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
           nn.KLDivLoss, nn.SoftMarginLoss, nn.PoissonNLLLoss, nn.GaussianNLLLoss,
           nn.HingeEmbeddingLoss, nn.MarginRankingLoss, nn.MultiLabelSoftMarginLoss):
    MODULE_RULES[_m] = pointwise_loss


for _m in (nn.Softmax, nn.LogSoftmax, nn.Softmin):  # dim from the module (None: torch's legacy rule)
    MODULE_RULES[_m] = lambda ctx: along(99, ctx.module.dim)(ctx)


def rows_of(ctx: Ctx):
    """The node's value as Rows (or a tuple / Each of them), by its op's rule."""
    node = ctx.node
    if node.op == "call_module":
        rule = MODULE_RULES.get(type(ctx.module), default)
    elif node.op in ("call_function", "call_method"):
        rule = RULES.get(op_name(ctx), default)
        if node.target is operator.matmul:
            rule = matmul
    else:
        return None
    return rule(ctx)
