"""The calls build() makes that tracing answers itself, patched while trace_build traces
(`patched_calls`): isinstance on a traced value (NOTE: isinstance while tracing), custom
autograd Functions (kept as opaque calls), torch's random factories (recorded as nodes,
drawn on every step), `module.buf = value` in a forward (recorded as ops.buffers.assign_buffer;
other attribute writes are checked, NOTE: Attribute writes in traced_attributes.py),
and the calls build() may not make (clip_grad_norm_, GradScaler, Python's random, seeding a
generator: refused, naming the user's line and the fix)."""
from __future__ import annotations

import builtins
import random
import sys
from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.modules.transformer as transformer_layers

from ..errors import GraphcError
from ..ops.buffers import assign_buffer
from .build_tracer import FAKE, BuildTracer, ShapeProxy
from .traced_tensors import writes_in_place
from .traced_attributes import check_attribute_write
from .user_lines import caller_line

# calls that must not happen inside build(): they act on real gradients the trace never has
_REFUSED_CALLS = {
    "clip_grad_norm_": "gradient clipping runs on gradients after backward; build() only sees "
                       "symbolic tensors, so this call would clip nothing. Fix: remove it and set "
                       "self.config.set_grad_clip_norm(max_norm) in the Graph's __init__ (the "
                       "global norm over every stage and shard, equal to clip_grad_norm_ on the "
                       "whole model).",
    "clip_grad_value_": "gradient clipping runs on gradients after backward; build() only sees "
                        "symbolic tensors, so this call would clip nothing. Fix: remove it; clip by "
                        "norm with self.config.set_grad_clip_norm(max_norm), or clip values in "
                        "the optimizer.",
}


# random factories take no tensor input, so fx would run them once while tracing and bake
# the draw into the graph as a constant; they are recorded as nodes instead
_RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial",
                     "poisson", "rand_like", "randn_like", "randint_like")


_SCALER_WHY = ("loss scaling is automatic mixed precision (AMP) state that lives across steps "
               "(the scale, the inf/nan check over every rank and stage, the skipped step), which "
               "a traced build() cannot hold; traced, the scaled gradients would reach the "
               "optimizer unscaled. Fix: remove the GradScaler from build() and give the graph "
               "its own in __init__: self.config.enable_amp(True, dtype=torch.float16); "
               "self.set_grad_scaler(graphc.amp.GradScaler()) (bfloat16 autocast needs no loss "
               "scaling).")
_RANDOM_WHY = ("build() is traced once, so the number drawn while tracing would be a constant of "
               "the plan (every step would, e.g., drop the same layer), unlike eager, which draws "
               "anew on every call. Fix: draw with torch (p = torch.rand(()); use "
               "torch.where(p < drop_prob, h, layer(h)) to skip a layer), which graphc records as "
               "a random op drawn on every step; or draw outside build() and pass the result as "
               "an input.")
# Python's own random draws: a draw while tracing would be frozen into the plan (refused)
_PYTHON_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample",
                  "shuffle", "gauss", "normalvariate", "betavariate", "expovariate")
_SEED_WHY = ("build() is traced once, so the seed would be set only while tracing: the random ops "
             "graphc records draw from its own per-step generators (seeded by the step, the "
             "micro-batch and the shard where a value has replicas or shards, else from the "
             "rank's own generator, which this seed set once), so eager's repeated draw after "
             "the seed would become a fresh draw on every step. Fix: seed once before the first "
             "graph call; for noise that must repeat, draw it outside build() (with "
             "torch.Generator().manual_seed(s)) and pass it in as an input.")


def _seed_setters() -> List[Tuple[Any, str]]:
    """(owner, name) of each call that seeds a global generator (torch's, CUDA's, Python's,
    NumPy's): inside build() the seed would be set while tracing only, not on every call."""
    found = [(torch, "manual_seed"), (torch, "seed"), (torch.random, "manual_seed"), (torch.random, "seed"),
             (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all"), (random, "seed")]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        found.append((numpy.random, "seed"))
    return found


# NOTE: isinstance while tracing. A model (or a library: transformers' masking_utils) that
# asks `isinstance(x, torch.Tensor)` of a traced value must take eager's branch, where x is
# a tensor. While tracing, Python's isinstance answers True for a ShapeProxy whose value is
# a tensor. It is the builtin that changes, not the proxy's __class__: torch's C++ argument
# parser also consults __class__, took such a proxy for a real tensor and crashed
# (torch.pow(x, 3.0) in GPT-2's gelu_new: a segfault).
_ISINSTANCE = builtins.isinstance


def _tensor_class(cls) -> bool:
    if cls is torch.Tensor:
        return True
    return type(cls) is tuple and any(c is torch.Tensor for c in cls)


def _traced_isinstance(obj, cls):
    if type(obj) is ShapeProxy and _tensor_class(cls) and _ISINSTANCE(obj.node.meta.get(FAKE), torch.Tensor):
        return True
    return _ISINSTANCE(obj, cls)


@contextmanager
def patched_calls(tracer: BuildTracer, source_file: Optional[str]):
    """While tracing: custom autograd Functions stay opaque calls; refused calls raise."""
    original_apply = torch.autograd.Function.__dict__["apply"]  # the classmethod itself

    def apply(cls, *args, **kwargs):
        proxies = []
        fx.node.map_aggregate((args, kwargs), lambda a: proxies.append(a) if isinstance(a, fx.Proxy) else a)
        if not proxies:
            return original_apply.__func__(cls, *args, **kwargs)
        return tracer.create_proxy("call_function", _function_apply(cls), args, kwargs)

    def refusal(what: str, why: str):
        def call(*args, **kwargs):
            raise GraphcError(f"build() calls {what} at {caller_line(source_file)}: {why}")
        return call

    scaler_methods = [(torch.amp.GradScaler, name, torch.amp.GradScaler.__dict__[name])
                      for name in ("scale", "unscale_", "step", "update")]
    original_setattr = torch.nn.Module.__setattr__

    def module_setattr(module, name, value):
        buffers = module.__dict__.get("_buffers")
        if isinstance(value, fx.Proxy) and buffers is not None and name in buffers:
            return _assign_buffer(tracer, source_file, module, name, value)
        check_attribute_write(tracer, module, name, value)  # NOTE: Attribute writes
        return original_setattr(module, name, value)

    def recorded(name, fn):
        def call(*args, **kwargs):  # a fresh draw on every step, not a constant of the trace
            if tracer.running_fake:
                return fn(*args, **kwargs)
            return tracer.create_proxy("call_function", fn, args, kwargs)
        call.__name__ = name
        return call

    factories = [(torch, name, getattr(torch, name)) for name in _RANDOM_FACTORIES]
    python_random = [(random, name, getattr(random, name)) for name in _PYTHON_RANDOM]
    seeds = [(owner, name, getattr(owner, name)) for owner, name in _seed_setters()]

    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad
    saved = [(obj, name, getattr(obj, name)) for obj in (nn_utils, clip_grad) for name in _REFUSED_CALLS]
    torch.autograd.Function.apply = classmethod(apply)
    builtins.isinstance = _traced_isinstance  # NOTE: isinstance while tracing
    torch.nn.Module.__setattr__ = module_setattr
    for obj, name, fn in factories:
        setattr(obj, name, recorded(name, fn))
    for obj, name, _ in python_random:
        setattr(obj, name, refusal(f"Python's random.{name}()", _RANDOM_WHY))
    for obj, name, _ in seeds:
        setattr(obj, name, refusal(f"{obj.__name__}.{name}()", _SEED_WHY))
    for obj, name, _ in scaler_methods:
        setattr(obj, name, refusal(f"GradScaler.{name}()", _SCALER_WHY))
    for obj, name, _ in saved:
        setattr(obj, name, refusal(f"torch.nn.utils.{name}", _REFUSED_CALLS[name]))
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # NOTE: Composite torch layers (build_tracer.py)
    detect_causal = transformer_layers._detect_is_causal_mask
    transformer_layers._detect_is_causal_mask = _given_is_causal
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        transformer_layers._detect_is_causal_mask = detect_causal
        builtins.isinstance = _ISINSTANCE
        torch.autograd.Function.apply = original_apply
        torch.nn.Module.__setattr__ = original_setattr
        for obj, name, fn in factories + python_random + seeds + scaler_methods:
            setattr(obj, name, fn)
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def _given_is_causal(mask, is_causal=None, size=None) -> bool:
    """torch's _detect_is_causal_mask while tracing: is_causal as given (comparing the mask
    with the causal one reads its values)."""
    return bool(is_causal)


def _assign_buffer(tracer: BuildTracer, source_file: Optional[str], module, name: str, value: fx.Proxy) -> None:
    """`self.buf += 1` is in place already (recorded); `self.buf = expr` copies into the buffer."""
    node = value.node
    first = node.args[0] if node.args else None
    in_place = str(node.target).endswith(("iadd", "isub", "imul", "itruediv")) or \
        (node.op == "call_method" and writes_in_place(str(node.target)))   # NOTE: Augmented assignment
    if isinstance(first, fx.Node) and first.op == "get_attr" and in_place:
        return
    fake = node.meta.get(FAKE)
    if isinstance(fake, torch.Tensor) and fake.requires_grad:
        raise GraphcError(
            f"build() assigns a value that requires grad to the buffer '{name}' of "
            f"{type(module).__name__} at {caller_line(source_file)}; the buffer would carry this "
            "step's autograd graph into the next step. Fix: assign value.detach(), or update it "
            "under torch.no_grad().")
    holder = tracer.path_of_module(module)
    target = f"{holder}.{name}" if holder else name
    buffer = tracer.create_proxy("get_attr", target, (), {})
    tracer.create_proxy("call_function", assign_buffer, (buffer, value), {})


_APPLY_CACHE: Dict[type, Any] = {}


def _function_apply(cls):
    """A named callable for `cls.apply`, so the fx code reads `MyFn_apply(x)` and pickles."""
    fn = _APPLY_CACHE.get(cls)
    if fn is None:
        def fn(*args, **kwargs):
            return cls.apply(*args, **kwargs)
        fn.__name__ = f"{cls.__name__}_apply"
        fn.__qualname__ = fn.__name__
        fn.graphc_autograd_function = cls
        _APPLY_CACHE[cls] = fn
    return fn
