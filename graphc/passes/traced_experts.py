"""Hugging Face experts modules traced as one `moe_experts` call (See NOTE: Expert parallel,
graphc/ops/experts.py).

transformers' `@use_experts_implementation` classes (Mixtral's, Qwen3-MoE's experts) pick
their forward by `config._experts_implementation`: grouped_mm (the default where the device
supports it), batched_mm or the eager loop. The loop's shapes depend on which experts the
tokens hit, and torch's fake kernel of grouped_mm takes bfloat16 only, so neither traces;
all three compute one function, which graphc records as `moe_experts(hidden, top_k_index,
top_k_weights, gate_up_proj, down_proj, act)`: one node, with an SBP rule that keeps the
tokens split and splits the experts over a mesh axis. Only the layout the three forms share
is recognised (gated, concatenated [gate; up], not transposed, no bias, no post-expert norm,
transformers' default gate, an activation of ACTIVATIONS); any other experts module is
traced as written.
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from ..sbp.experts import moe_experts

_ARGS = ("hidden_states", "top_k_index", "top_k_weights")
_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
           "has_post_expert_norm": False}


def experts_activation(m: nn.Module) -> Optional[str]:
    """The activation's name if `m` is a transformers experts module of the shared layout, else None."""
    if any(getattr(m, k, None) is not v for k, v in _LAYOUT.items()):
        return None
    gate = getattr(type(m), "_apply_gate", None)
    if gate is None or gate.__name__ != "_default_apply_gate" or getattr(m, "_is_expert_parallel", True):
        return None
    params = dict(m.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or params["gate_up_proj"].dim() != 3:
        return None
    return _activation_name(getattr(m, "act_fn", None))


def _activation_name(act) -> Optional[str]:
    name = type(act).__name__.lower()
    if name in ("siluactivation", "silu"):
        return "silu"
    if name in ("geluactivation", "gelu") and getattr(act, "approximate", "none") == "none":
        return "gelu"
    if name in ("relu",):
        return "relu"
    return None


def traced_experts_call(tracer, path: str, act: str, args, kwargs):
    """The module's call as one moe_experts node, reading its two weights by qualified name."""
    given = dict(zip(_ARGS, args), **kwargs)
    if set(given) != set(_ARGS):
        return None
    gate_up = tracer.create_proxy("get_attr", f"{path}.gate_up_proj", (), {})
    down = tracer.create_proxy("get_attr", f"{path}.down_proj", (), {})
    return tracer.create_proxy("call_function", moe_experts,
                               tuple(given[k] for k in _ARGS) + (gate_up, down), {"act": act})

