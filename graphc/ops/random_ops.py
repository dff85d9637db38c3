"""Random ops that draw from a stream chosen by their layout, not from each rank's RNG.

A stage program calls `seeded` (graphc/ops/__init__.py: why stage-program functions have
their own package); the runtime sets the step and micro-batch (`drawing`) and agrees the
base seed (runtime/rng.py: agree_base_seed).

NOTE: Replica-equal randomness
`seeded(op, key, coords, *args)` is the op `passes/seed_random_ops.py` puts in place of
every random op (dropout, scaled_dot_product_attention with dropout_p, torch.rand and
friends). It runs the original op with the global generator(s) seeded, inside
`torch.random.fork_rng` (so the user's own RNG stream is left as it was), from

    (base seed, step, micro-batch, node key, this rank's coordinates)

`coords` maps each rank of the node's placement to its index along the mesh axes where
the node's output is *split*: shards draw their own numbers; along broadcast (and
partial_sum) axes the coordinate is left out, so every replica draws the same numbers
and replicas stay bit-identical. The base seed is rank 0's `torch.initial_seed()`,
agreed once per graph through the c10d store (`agree_base_seed`); the step and
micro-batch come from the executor (`drawing`). Everything is a pure function of those,
so a resumed run (a checkpoint saves the step) replays the same masks. Running the
original kernel keeps its numbers: dropout with p=0, or in eval, is exactly eager.
"""
from __future__ import annotations

import contextvars
import hashlib
from contextlib import contextmanager
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import world

# the random ops seeded, by the name the rewritten node carries (fx cannot print a function
# as an argument); call_method targets as "Tensor.<name>"
RANDOM_FUNCTIONS: Dict[str, Callable] = {
    "dropout": F.dropout, "dropout1d": F.dropout1d, "dropout2d": F.dropout2d,
    "dropout3d": F.dropout3d, "alpha_dropout": F.alpha_dropout,
    "feature_alpha_dropout": F.feature_alpha_dropout, "torch.dropout": torch.dropout,
    "scaled_dot_product_attention": F.scaled_dot_product_attention,
    "rand": torch.rand, "randn": torch.randn, "randint": torch.randint, "randperm": torch.randperm,
    "normal": torch.normal, "bernoulli": torch.bernoulli, "multinomial": torch.multinomial,
    "poisson": torch.poisson, "rand_like": torch.rand_like, "randn_like": torch.randn_like,
    "randint_like": torch.randint_like,
}
RANDOM_METHODS = ("bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                  "geometric_", "log_normal_", "cauchy_", "multinomial")

# (base seed, step, micro-batch) of the forward running now; None outside the runtime
_DRAW: contextvars.ContextVar[Optional[Tuple[int, int, int]]] = contextvars.ContextVar(
    "graphc_draw", default=None)


@contextmanager
def drawing(base_seed: int, step: int, microbatch: int):
    """Random ops run inside draw for (step, micro-batch) of the graph seeded by base_seed."""
    token = _DRAW.set((base_seed, step, microbatch))
    try:
        yield
    finally:
        _DRAW.reset(token)


def current_draw() -> Optional[Tuple[int, int, int]]:
    """(base seed, step, micro-batch) of the forward running now; None outside the runtime."""
    return _DRAW.get()


def seeded(op: str, key: str, coords: tuple, *args, **kwargs):
    """Runs random op `op` (a RANDOM_FUNCTIONS name or "Tensor.<method>") on a generator
    seeded for this node (`key`), step, micro-batch and this rank's shard (`coords`:
    (rank, coordinate) pairs; empty for a value replicated on every rank)."""
    base, step, mb = _DRAW.get() or (torch.initial_seed(), 0, 0)
    rank = world.rank()
    shard = dict(coords).get(rank, ())
    digest = hashlib.sha256(repr((base, step, mb, key, shard)).encode()).digest()
    seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    cuda = _on_cuda(args, kwargs)
    devices = [torch.cuda.current_device()] if cuda else []
    with world.RNG_LOCK, torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        if op.startswith("Tensor."):
            return getattr(args[0], op[len("Tensor."):])(*args[1:], **kwargs)
        return RANDOM_FUNCTIONS[op](*args, **kwargs)


def _on_cuda(args, kwargs) -> bool:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_cuda:
            return True
        if isinstance(a, (torch.device, str)) and str(a).startswith("cuda"):
            return True
    return False
