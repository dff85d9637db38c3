"""More of the fidelity probe's programs (NOTE: Fidelity probe, tests/fidelity.py): habits in
build() (zero_grad, a gradient penalty), the optimizer's groups changed, losses that mix the
batch's rows (refused under accumulation, equal without), the user's code after each call on
the model (a validation pass, a logged weight norm, an EMA teacher); then every program of
both files in the groups tests/test_fidelity.py holds them to (PROGRAMS: all of them)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

import fidelity_programs as base
from fidelity import Program, regression
from fidelity_programs import BETWEEN_CALLS, NOT_WHOLE, _plain, classes, mse
from layouts import Pair


def _zero_grad_habit(host, x, y):
    host.model.zero_grad()
    host.opt.zero_grad()
    return mse(host.model(x), y)


def _gradient_penalty(host, x, y):
    x = x.clone().requires_grad_(True)
    out = host.model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return mse(out, y) + 0.1 * g.pow(2).sum(1).mean()


def _a_only(params):
    params = list(params)
    return torch.optim.SGD(params[:2], lr=0.1)


def _unfreeze_b(host, model, opt, step):
    """Progressive unfreezing: b frozen and outside the optimizer, then trained with its own lr."""
    if step == 0:
        model.b.requires_grad_(False)
    if step == 1:
        model.b.requires_grad_(True)
        opt.add_param_group({"params": list(model.b.parameters()), "lr": 0.05})


def _add_b_group(host, model, opt, step):
    """b trains outside the optimizer at step 0 (its .grad accumulates in eager), then joins it."""
    if step == 1:
        opt.add_param_group({"params": list(model.b.parameters()), "lr": 0.05})


def _smaller_last(n: int = 3):
    data = regression(n)
    x, y = data[-1]
    return data[:-1] + [(x[:4], y[:4])]


class Smoothed(Pair):
    def __init__(self):
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=0.0)


def _module_loss(host, x, y):
    return host.model.loss_fn(host.model(x), y)


def _smoothing_schedule(host, model, opt, step):
    model.loss_fn.label_smoothing = (0.0, 0.2, 0.1)[step]


PROBES = [
    Program("zero_grad_in_build", _zero_grad_habit),
    Program("gradient_penalty", _gradient_penalty),
    Program("param_group_added", _plain, make_opt=_a_only, between=_unfreeze_b),
    Program("param_group_added_after_grads_accumulated", _plain, make_opt=_a_only, between=_add_b_group),
    Program("smaller_last_batch", _plain, batches=_smaller_last),
    Program("label_smoothing_schedule", _module_loss, make_model=Smoothed, batches=lambda: classes(),
            between=_smoothing_schedule),
]


def _over_detached(host, x, y):
    loss = mse(host.model(x), y)
    return loss / loss.detach().clamp(min=0.5)


def _dynamic_weights(host, x, y):
    out = host.model(x)
    l1, l2 = mse(out, y), out.abs().mean()
    w = l1.detach() / (l1.detach() + l2.detach())
    return w * l1 + (1 - w) * l2


def _ohem(host, x, y):
    per = ((host.model(x) - y) ** 2).mean(1)
    return per.topk(x.shape[0] // 2).values.mean()


def _first_half(host, x, y):
    per = ((host.model(x) - y) ** 2).mean(1)
    return per[: x.shape[0] // 2].mean()


def _mixup_flip(host, x, y):
    lam = 0.7
    xm, ym = lam * x + (1 - lam) * x.flip(0), lam * y + (1 - lam) * y.flip(0)
    return mse(host.model(xm), ym)


PROBES += [
    Program("loss_over_its_detached_value", _over_detached),
    Program("dynamic_loss_weights", _dynamic_weights),
    Program("hard_example_topk", _ohem),
    Program("first_half_of_batch", _first_half),
    Program("mixup_with_flipped_batch", _mixup_flip),
]
# the same, without micro-batches: the ops that mix the batch's rows run on a split batch
PROBES += [Program(p.name + "_acc1", p.loss, accumulation=1) for p in PROBES[-5:]]


# -- the user's code after each call, on the user's own model ------------------------------
_VALIDATION = torch.Generator().manual_seed(7)
X_VAL = torch.randn(5, 6, generator=_VALIDATION, dtype=torch.float64)


def _validate(host, model, step):
    with torch.no_grad():
        return model(X_VAL.to(torch.get_default_dtype()))


def _weight_norm(host, model, step):
    return sum(p.detach().pow(2).sum() for p in model.parameters())


class Teacher:
    """An EMA teacher updated after every call, as graphc's refusal of an EMA inside build() says."""

    def __init__(self):
        self.params = None

    def update(self, model):
        with torch.no_grad():
            if self.params is None:
                self.params = [p.detach().clone() for p in model.parameters()]
            for t, p in zip(self.params, model.parameters()):
                t.mul_(0.9).add_(p, alpha=0.1)
        return [t.clone() for t in self.params]


def _ema_after(host, model, step):
    if not hasattr(host, "teacher"):
        host.teacher = Teacher()
    return host.teacher.update(model)


PROBES += [
    Program("validation_on_the_model_between_calls", _plain, after=_validate),
    Program("weight_norm_logged_between_calls", _plain, after=_weight_norm),
    Program("ema_teacher_after_each_call", _plain, after=_ema_after),
]


# -- every program, in the groups tests/test_fidelity.py holds them to ----------------------
def _as(name: str, **expected) -> Program:
    return dataclasses.replace(next(p for p in PROBES if p.name == name), **expected)


_COUPLED = dict(expect="refused", says="couples rows of the batch")
STATE = base.STATE
BUILD = base.BUILD + [_as("zero_grad_in_build"), _as("gradient_penalty", **_COUPLED)]
OPTIMIZER = base.OPTIMIZER + [_as("param_group_added")]
MODEL = base.MODEL + [_as("label_smoothing_schedule")]
REDUCTIONS = base.REDUCTIONS + [_as("smaller_last_batch")] + \
    [_as(name, **_COUPLED) for name in ("loss_over_its_detached_value", "dynamic_loss_weights", "hard_example_topk",
                                        "first_half_of_batch", "mixup_with_flipped_batch")] + \
    [_as(name + "_acc1") for name in ("loss_over_its_detached_value", "dynamic_loss_weights", "hard_example_topk",
                                      "first_half_of_batch", "mixup_with_flipped_batch")]
AFTER = [_as(name, refused_on=NOT_WHOLE, says=BETWEEN_CALLS)   # the user's code after each call
         for name in ("validation_on_the_model_between_calls", "weight_norm_logged_between_calls",
                      "ema_teacher_after_each_call")]
KNOWN = base.KNOWN + [_as("param_group_added_after_grads_accumulated")]
PROGRAMS = STATE + OPTIMIZER + MODEL + BUILD + REDUCTIONS + AFTER + KNOWN
