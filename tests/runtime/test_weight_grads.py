"""The W half of a split backward (runtime/weight_grads.py, NOTE: Weight gradients) gives a
whole backward's parameter gradients and input gradients without running the input path's
nodes again. One process, float64, exact up to rounding (1e-12)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphc.runtime.weight_grads import WeightGroups


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 6)

    def forward(self, x):
        return (self.b(F.gelu(self.a(x))),)


class Twice(nn.Module):        # one layer applied twice: two intermediates, one below the other
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x):
        return (self.a(torch.tanh(self.a(x))),)


class OffTheOutputs(nn.Module):  # a parameter on no path from the input, and one on both
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.p = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.a(x) * self.p, self.p.sin() * 3


class Tied(nn.Module):           # embedding and head share a weight; the ids need no gradient
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.mix = nn.Linear(6, 6)

    def forward(self, ids, h):
        e = self.emb(ids) + self.mix(h)
        return (e @ self.emb.weight.T,)


def _inputs(model):
    g = torch.Generator().manual_seed(1)
    if isinstance(model, Tied):
        return [torch.randint(0, 10, (4,), generator=g), torch.randn(4, 6, generator=g, requires_grad=True)]
    return [torch.randn(4, 6, generator=g, requires_grad=True)]


def _whole(model, grads):
    model.zero_grad(set_to_none=True)
    xs = _inputs(model)
    outs = model(*xs)
    torch.autograd.backward(outs, grads)
    return ({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            [x.grad.clone() for x in xs if x.requires_grad])


def _split(model, grads):
    model.zero_grad(set_to_none=True)
    xs = _inputs(model)
    outs = model(*xs)
    leaves = [x for x in xs if x.requires_grad]
    params = list(model.parameters())
    weights = WeightGroups.find(outs, leaves, params)
    weights.keep()
    got = torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
    weights.release()
    assert all(p.grad is None for p in params), "I must leave the parameters' gradients to W"
    runs = {}
    gelu = [n for n in _nodes(outs) if "Gelu" in type(n).__name__ or "Tanh" in type(n).__name__]
    handles = [n.register_prehook(lambda g, n=n: runs.__setitem__(n, runs.get(n, 0) + 1)) for n in gelu]
    weights.run(outs, grads)
    for h in handles:
        h.remove()
    return ({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            list(got), runs)


def _nodes(outs):
    seen, todo = set(), [o.grad_fn for o in outs if o.grad_fn is not None]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo += [m for m, _ in n.next_functions if m is not None]
    return seen


def _check(model):
    torch.manual_seed(0)
    outs = model(*_inputs(model))
    grads = [torch.randn_like(o) for o in outs]
    ref_params, ref_inputs = _whole(model, grads)
    got_params, got_inputs, runs = _split(model, grads)
    assert got_params.keys() == ref_params.keys()
    for n in ref_params:
        torch.testing.assert_close(got_params[n], ref_params[n], atol=1e-12, rtol=1e-12, msg=n)
    for a, b in zip(got_inputs, ref_inputs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    return runs


def test_mlp_weights_without_walking_the_activation_path_again():
    runs = _check(MLP())
    assert runs == {}, "W re-ran the GELU between the layers, which only I needs"


def test_a_layer_applied_twice_counts_each_use_once():
    # its two uses form one group: W runs from both, the flow between them (through tanh)
    # is replaced by what I kept, so each use counts once
    _check(Twice())


def test_parameters_off_the_input_path_take_the_outputs_as_roots():
    _check(OffTheOutputs())


def test_tied_embedding_and_head_with_ids_that_need_no_gradient():
    _check(Tied())


def test_a_stage_whose_inputs_need_no_gradient():
    model = MLP()
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    out = model(x)[0]
    g = torch.randn_like(out)
    weights = WeightGroups.find([out], [], list(model.parameters()))
    weights.run([out], [g])
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(x)[0].backward(g)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-12, rtol=1e-12)
