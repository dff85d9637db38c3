"""The fidelity probe's programs (NOTE: Fidelity probe, tests/fidelity.py): small training
programs as users write them, each changing its Python state between calls; grouped with
those of tests/fidelity_probes.py there."""
from __future__ import annotations

import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from fidelity import Program, regression
from layouts import Pair


def mse(out, y):
    return ((out - y) ** 2).mean()


def classes(n: int = 3, rows: int = 8, d_in: int = 6, k: int = 4, ignore_rows=()):
    """(x, labels) batches, labels -100 on `ignore_rows` of each step (uneven over halves)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(n):
        y = torch.randint(0, k, (rows,), generator=g)
        for r in ignore_rows:
            y[(r + step) % rows] = -100
        out.append((torch.randn(rows, d_in, generator=g), y))
    return out


# -- Python values changed between calls --------------------------------------------------

def _temperature(host, x, y):
    return mse(host.model(x) / host.temperature, y)


def _set_attr(name, values):
    def between(host, model, opt, step):
        setattr(host, name, values[step])
    return between


def _coef_l2(host, x, y):
    l2 = sum(p.pow(2).sum() for p in host.model.parameters())
    return mse(host.model(x), y) + host.coef * l2


SCHEDULE = {"w": 0.1}


def _global_dict(host, x, y):
    return mse(host.model(x), y) * SCHEDULE["w"]


def _set_global_dict(host, model, opt, step):
    SCHEDULE["w"] = (0.1, 0.7, 0.3)[step]


def _aux(out, w=0.1):
    return w * out.pow(2).mean()


def _defaults(host, x, y):
    out = host.model(x)
    return mse(out, y) + _aux(out)


def _set_defaults(host, model, opt, step):
    _aux.__defaults__ = ((0.1, 0.9, 0.4)[step],)


def _weights_list(host, x, y):
    w = torch.tensor(host.weights)
    return (((host.model(x) - y) ** 2) * w).mean()


def _edit_list(host, model, opt, step):
    host.weights[step % 4] = 3.0 + step


def _python_arg(host, x, y, scale):
    return mse(host.model(x), y) * scale


def _python_arg_batches():
    return [(x, y, 1.0 + step) for step, (x, y) in enumerate(regression())]


def _dict_batch(host, batch):
    return mse(host.model(batch["x"]), batch["y"]) * batch["scale"]


def _dict_batches():
    return [({"x": x, "y": y, "scale": 1 + step},) for step, (x, y) in enumerate(regression())]


def _scalar_tensor_arg(host, x, y, coef):
    return mse(host.model(x), y) * coef


def _scalar_tensor_batches():
    return [(x, y, torch.tensor(0.5 + step)) for step, (x, y) in enumerate(regression())]


# -- the optimizer changed between calls -------------------------------------------------

def _plain(host, x, y):
    return mse(host.model(x), y)


def _lr_sweep(host, model, opt, step):
    for group in opt.param_groups:
        group["lr"] = (0.1, 0.02, 0.3)[step]


def _wd_change(host, model, opt, step):
    for group in opt.param_groups:
        group["weight_decay"] = (0.0, 0.5, 0.1)[step]


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _two_groups(params):
    params = list(params)
    return torch.optim.SGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.01}], lr=0.1)


def _lr_group_one(host, model, opt, step):
    opt.param_groups[1]["lr"] = (0.01, 0.2, 0.05)[step]


# -- the model changed between calls ------------------------------------------------------

class Dropped(Pair):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


def _dropout_p(host, model, opt, step):
    model.drop.p = (0.0, 1.0, 0.0)[step]


class Activated(Pair):
    def __init__(self):
        super().__init__()
        self.act = nn.Tanh()

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def _swap_activation(host, model, opt, step):
    if step == 1:
        model.act = nn.ReLU()


def _clamp_between(host, model, opt, step):
    with torch.no_grad():
        model.a.weight.mul_(0.5)


def _freeze_bias(host, model, opt, step):
    model.b.bias.requires_grad_(step != 1)


class Gained(Pair):
    def __init__(self):
        super().__init__()
        self.gain = {"g": 1.0}
        self.b.register_forward_hook(lambda m, args, out: out * self.gain["g"])


def _hook_gain(host, model, opt, step):
    model.gain["g"] = (1.0, 2.0, 0.5)[step]


class Counting(Pair):
    """A buffer counting the rows seen and a running mean of the hidden features."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("running", torch.zeros(8))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.training:
            with torch.no_grad():
                self.seen += x.shape[0]
                self.running.mul_(0.9).add_(0.1 * h.mean(0))
        return self.b(h)


# -- what build() does -------------------------------------------------------------------

def _python_random(host, x, y):
    return mse(host.model(x), y) * (1.0 + 0.0 * random.random())


def _seeded_noise(host, x, y):
    torch.manual_seed(1234)
    noise = 0.1 * torch.randn(x.shape)
    return mse(host.model(x + noise), y)


def _item_branch(host, x, y):
    loss = mse(host.model(x), y)
    return loss * 2 if loss.item() > 100 else loss


def _tolist(host, x, y):
    out = host.model(x)
    scales = out.detach().abs().max(1).values.tolist()
    return mse(out, y) * (1 + 0 * len(scales))


def _numpy_round_trip(host, x, y):
    out = host.model(x)
    w = torch.from_numpy(out.detach().numpy()).abs().mean()
    return mse(out, y) * w


def _mask_index(host, x, y):
    out = host.model(x)
    keep = y[:, 0] > 0
    return ((out[keep] - y[keep]) ** 2).mean()


def _weight_clip_in_build(host, x, y):
    loss = mse(host.model(x), y)
    loss.backward()
    host.model.a.weight.data.clamp_(-0.2, 0.2)
    return loss


def _grad_read(host, x, y):
    loss = mse(host.model(x), y)
    loss.backward()
    norm = sum(p.grad.pow(2).sum() for p in host.model.parameters())
    return loss, norm


def _clip_value(host, x, y):
    loss = mse(host.model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_value_(host.model.parameters(), 0.01)
    return loss


def _grad_scaled(host, x, y):
    loss = mse(host.model(x), y)
    loss.backward()
    for p in host.model.parameters():
        p.grad.mul_(0.5)
    return loss


def _no_grad_target(host, x, y):
    with torch.no_grad():
        target = host.model(x * 0.5)
    with torch.enable_grad():
        out = host.model(x)
    return mse(out, y) + 0.1 * mse(out, target)


def _detached(host, x, y):
    h = torch.tanh(host.model.a(x))
    return mse(host.model.b(h), y) + 0.1 * (h * h.detach()).mean()


def _sum_loss(host, x, y):
    return ((host.model(x) - y) ** 2).sum()


def _per_batch_size(host, x, y):
    return ((host.model(x) - y) ** 2).sum() / x.shape[0]


def _fixed_batch_size(host, x, y):
    return ((host.model(x) - y) ** 2).sum() / 8


def _mse_sum(host, x, y):
    return F.mse_loss(host.model(x), y, reduction="sum")


def _row_weights(host, x, y):
    w = torch.arange(x.shape[0], dtype=x.dtype) / x.shape[0]
    return (w[:, None] * (host.model(x) - y) ** 2).mean()


def _ce_smoothing(host, x, y):
    return F.cross_entropy(host.model(x), y, ignore_index=-100, label_smoothing=0.1)


def _ce_ignore(host, x, y):
    return F.cross_entropy(host.model(x), y, ignore_index=-100)


def _masked_mean(host, x, y):
    per = F.cross_entropy(host.model(x), y.clamp(min=0), reduction="none")
    mask = (y != -100).to(per.dtype)
    return (per * mask).sum() / mask.sum()


def _centred(host, x, y):
    out = host.model(x)
    return mse(out - out.mean(0), y)


def _where_batch_stat(host, x, y):
    err = ((host.model(x) - y) ** 2).mean(1)
    return torch.where(err > err.mean(), 2 * err, err).mean()


def _metric_list(host, x, y):
    loss = mse(host.model(x), y)
    host.history.append(loss.detach())
    return loss


def _weight_numel(host, x, y):
    w = host.model.a.weight
    return mse(host.model(x), y) + w.pow(2).sum() / w.numel() + 0 * w.shape[0]


def _eval_toggle(host, model, opt, step):
    model.train(step != 1)


def _training_branch(host, x, y):
    out = host.model(x)
    return mse(out, y) + (0.5 * out.pow(2).mean() if host.model.training else 0.0)


def _clip_norm(graph):
    graph.config.set_grad_clip_norm(0.05)


def _eager_clip(model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def _kwargs_default(host, x, y, weight=0.5):
    return mse(host.model(x), y) * weight


def _set_kwargs_default(host, model, opt, step):
    _kwargs_default.__defaults__ = ((0.5, 2.0, 1.0)[step],)


def _history(host):
    host.history = []


def _penalty_per_row(host, x, y):
    l2 = sum(p.pow(2).sum() for p in host.model.parameters())
    return mse(host.model(x), y) + 0.01 * l2 / x.shape[0]


def _ones_weights(host, x, y):
    w = torch.ones(x.shape[0], 1) * 0.5
    return (w * (host.model(x) - y) ** 2).mean()


def _gather_rows(host, x, y):
    logp = torch.log_softmax(host.model(x), -1)
    return -logp[torch.arange(x.shape[0]), y].mean()


def _expanded_bias(host, x, y):
    shift = torch.linspace(0, 1, 4).expand(x.shape[0], 4)
    return mse(host.model(x) + shift, y)


def _attribute_grad(host, x, y):
    loss = mse(host.model(x), y)
    loss.backward()
    return loss, host.model.a.weight.grad.norm()


# -- tensors the program holds, changed between calls ---------------------------------------

def _class_weighted(host, x, y):
    return F.cross_entropy(host.model(x), y, weight=host.class_weights)


def _set_class_weights(host):
    host.class_weights = torch.tensor([1.0, 2.0, 0.5, 1.0])


def _edit_class_weights(host, model, opt, step):
    host.class_weights.mul_(1.5)


def _replace_class_weights(host, model, opt, step):
    host.class_weights = torch.tensor([1.0, 2.0, 0.5, 1.0]) * (1 + step)


class Scaled(Pair):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        return super().forward(x) * self.scale


def _fill_buffer(host, model, opt, step):
    model.scale.fill_((1.0, 2.0, 0.5)[step])


_SAVED = {}


def _reload_weights(host, model, opt, step):
    if step == 0:
        _SAVED[id(host)] = {k: v.clone() for k, v in model.state_dict().items()}
        _SAVED["shifted"] = {k: v * 0.5 for k, v in model.state_dict().items()}
    if step == 1:
        model.load_state_dict(_SAVED["shifted"])


def _replace_data(host, model, opt, step):
    if step == 1:
        model.b.weight.data = model.b.weight.data * 0.5


def _ce_class_weights_ignore(host, x, y):
    w = torch.tensor([1.0, 3.0, 0.5, 2.0])
    return F.cross_entropy(host.model(x), y, weight=w, ignore_index=-100)


def _output_with_float(host, x, y):
    loss = mse(host.model(x), y)
    return loss, {"scale": host.temperature, "rows": x.shape[0]}


# -- the programs, by what they change or do (tests/test_fidelity.py: one test a group) --------
BETWEEN_CALLS = "between graph calls"   # (a part of every refusal of a parameter read between calls)
NOT_WHOLE = ("pp2", "tp2", "pp2xdp2", "zero3")   # where some rank does not hold every parameter whole
STATE = [   # Python values changed between calls
    Program("graph_attribute", _temperature, setup=lambda host: setattr(host, "temperature", 1.0),
            between=_set_attr("temperature", (1.0, 2.0, 0.5))),
    Program("coefficient_schedule", _coef_l2, setup=lambda host: setattr(host, "coef", 0.0),
            between=_set_attr("coef", (0.0, 0.01, 0.05))),
    Program("global_dict_edited", _global_dict, between=_set_global_dict),
    Program("function_defaults_edited", _defaults, between=_set_defaults),
    Program("kwargs_default", _kwargs_default, between=_set_kwargs_default),
    Program("tensor_from_list", _weights_list, setup=lambda host: setattr(host, "weights", [1.0, 1.0, 1.0, 1.0]),
            between=_edit_list),
    Program("python_float_argument", _python_arg, batches=_python_arg_batches, expect="refused",
            says="graph inputs must be tensors"),
    Program("dict_batch_python_int", _dict_batch, batches=_dict_batches, expect="refused",
            says="graph inputs must be tensors"),
    Program("scalar_tensor_argument", _scalar_tensor_arg, batches=_scalar_tensor_batches),
    Program("class_weights_edited_in_place", _class_weighted, batches=lambda: classes(),
            setup=_set_class_weights, between=_edit_class_weights),
    Program("class_weights_replaced", _class_weighted, batches=lambda: classes(),
            setup=_set_class_weights, between=_replace_class_weights),
    Program("output_with_python_values", _output_with_float, setup=lambda host: setattr(host, "temperature", 2.0)),
]
OPTIMIZER = [   # the optimizer changed between calls
    Program("lr_sweep", _plain, between=_lr_sweep),
    Program("weight_decay_changed", _plain, between=_wd_change),
    Program("adamw_lr_sweep", _plain, between=_lr_sweep, make_opt=_adamw),
    Program("param_group_lr", _plain, between=_lr_group_one, make_opt=_two_groups),
    Program("grad_clip_norm", _plain, configure=_clip_norm, after_backward=_eager_clip),
]
MODEL = [   # the model changed between calls
    Program("dropout_p_changed", _plain, make_model=Dropped, between=_dropout_p),
    Program("submodule_replaced", _plain, make_model=Activated, between=_swap_activation, expect="refused",
            says="was replaced by another ReLU after the graph compiled"),
    Program("weight_edited_between_calls", _plain, between=_clamp_between, refused_on=("zero3",),
            says=BETWEEN_CALLS),
    Program("weight_data_replaced", _plain, between=_replace_data, refused_on=NOT_WHOLE, says=BETWEEN_CALLS),
    Program("bias_frozen_for_a_call", _plain, between=_freeze_bias),
    Program("hook_gain_edited", _plain, make_model=Gained, between=_hook_gain),
    Program("buffers_updated_in_forward", _plain, make_model=Counting, accumulation=1),
    Program("buffer_filled_between_calls", _plain, make_model=Scaled, between=_fill_buffer),
    Program("eval_toggled", _training_branch, between=_eval_toggle),
]
BUILD = [   # what build() does
    Program("python_random", _python_random, expect="refused", says="Python's random.random()"),
    Program("manual_seed_in_build", _seeded_noise, expect="refused", says="torch.manual_seed()"),
    Program("item_in_control_flow", _item_branch, expect="refused", says="control flow on a tensor's value"),
    Program("tolist", _tolist, expect="refused", says="build() calls .tolist() at"),
    Program("numpy_round_trip", _numpy_round_trip, expect="refused", says="build() calls .numpy() at"),
    Program("boolean_mask_index", _mask_index, expect="refused", says="depends on the values"),
    Program("weight_clip_data_in_build", _weight_clip_in_build, backward_inside=True, expect="refused",
            says="writes into the parameter 'model.a.weight' in place"),
    Program("grad_read_in_build", _grad_read, backward_inside=True, expect="refused", says="(.grad)"),
    Program("grad_of_attribute_in_build", _attribute_grad, backward_inside=True, expect="refused", says="(.grad)"),
    Program("clip_grad_value_in_build", _clip_value, backward_inside=True, expect="refused",
            says="clip_grad_value_"),
    Program("grad_scaled_in_build", _grad_scaled, backward_inside=True, expect="refused", says="(.grad)"),
    Program("no_grad_target", _no_grad_target),
    Program("detach_of_sharded", _detached),
    Program("metric_list_on_graph", _metric_list, setup=_history, expect="refused",
            says="put a traced value into self.history"),
    Program("weight_numel", _weight_numel),
]
REDUCTIONS = [   # what the loss reduces over the batch, and the batch's size read in build()
    Program("sum_loss", _sum_loss),
    Program("sum_over_x_shape", _per_batch_size),
    Program("sum_over_fixed_batch_size", _fixed_batch_size),
    Program("mse_reduction_sum", _mse_sum),
    Program("cross_entropy_smoothing_ignore", _ce_smoothing, batches=lambda: classes(ignore_rows=(0, 1, 2))),
    Program("cross_entropy_ignore", _ce_ignore, batches=lambda: classes(ignore_rows=(0, 1, 2))),
    Program("cross_entropy_class_weights", _ce_class_weights_ignore, batches=lambda: classes(ignore_rows=(0, 1, 2))),
    Program("masked_mean_valid_tokens", _masked_mean, batches=lambda: classes(ignore_rows=(0, 1, 2))),
    Program("centred_by_batch_mean", _centred, expect="refused", says="couples rows of the batch"),
    Program("where_on_batch_statistic", _where_batch_stat, expect="refused", says="couples rows of the batch"),
    Program("row_weights_from_arange", _row_weights, expect="refused", says="makes a tensor of the batch's length"),
    Program("penalty_over_x_shape", _penalty_per_row, expect="refused", says="reads the batch's size as a number"),
    Program("ones_row_weights", _ones_weights),
    Program("arange_row_index", _gather_rows, batches=lambda: classes()),
    Program("expanded_constant", _expanded_bias),
    Program("load_state_dict_between_calls", _plain, between=_reload_weights),
]
# left as they are (the table shows them; no test holds them): on tp2 the model holds its
# shards and torch's load_state_dict refuses the whole tensors (size mismatch); on ZeRO-3 the
# refusal of a read between calls comes wrapped in torch's RuntimeError
KNOWN = [REDUCTIONS.pop()]
PROGRAMS = STATE + OPTIMIZER + MODEL + BUILD + REDUCTIONS + KNOWN
