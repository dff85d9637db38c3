"""The measured side of the peak memory model: the bytes of tensors a running rank holds.

NOTE: Measured peak memory
What `memory_peak` (NOTE: Peak memory model) predicts is measured on a running rank by a
MemoryProbe: after each instruction of its plan, the bytes of every distinct tensor storage
the rank's runtime holds, found by walking what it holds, not what the plan says:
  * the stage programs' parameters and buffers, each parameter's .grad, the optimizer's
    parameters, gradients and state;
  * the runtime's own objects (gradient buckets, ZeRO shards and gather buffers, the step's
    received, produced and pending values, tensors in flight to a peer);
  * every activation autograd saved in a forward (a weak reference taken by the executor's
    saved-tensor hook), for as long as it lives.
A storage is counted once by address, whole (a view of a bucket is the bucket), and not at
all once resized to 0 bytes (a released ZeRO stage-3 parameter). The measured peak is the
highest of these sums over a step, named by its instruction. Both sides therefore count the
same tensors at the same points: what an instruction allocates and frees inside itself (an
op's temporaries, the gradient flowing between two layers, the recomputed forward of a
checkpointed micro-batch inside its backward, a transport's own copies) is in neither.
RSS would count those, and the allocator's caching, the Python heap and the other threads of
a local world: on a CPU it moves by more than the 5% the model is held to.
tests/tools/test_memory_measured.py compares the two per rank (tolerance stated there).
"""
from __future__ import annotations

from collections import deque
from typing import Dict, List, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# graphc objects the walk does not enter: the plan (no tensors, and large), the transports
# (a local world's mailboxes hold the other ranks' tensors) and the watchdog
_NOT_WALKED = ("graphc.plan.instructions", "graphc.plan.plan", "graphc.runtime.local_world",
               "graphc.world", "graphc.runtime.comm", "graphc.runtime.watchdog",
               "graphc.runtime.trace", "graphc.runtime.shm")


class MemoryProbe:
    """Measures, after each instruction, the bytes of the tensors one rank's runtime holds
    (See NOTE: Measured peak memory).

    Example:
        graph(x); probe = MemoryProbe.attach(graph); graph(x)
        print(probe.peak, probe.at)        # the last step's measured peak and its instruction
    """

    def __init__(self, runtime, optimizer=None):
        self.runtime, self.optimizer = runtime, optimizer
        self.saved: Dict[int, Tuple[StorageWeakRef, int]] = {}   # address -> (storage, bytes)
        self.series: List[Tuple[int, int]] = []   # this step's (instruction index, bytes)
        self.step = None      # the running step's values
        self.now = 0          # the running instruction
        runtime.probe = self
        for ex in runtime.executors.values():
            ex.count_bytes = True
            ex.watch_saved, ex.recomputed = self._saw, self._inside

    @classmethod
    def attach(cls, graph) -> "MemoryProbe":
        """A probe on a compiled, started graph's runtime (after its first call)."""
        return cls(graph._runtime, graph._optimizer)

    @property
    def peak(self) -> int:
        return max((b for _, b in self.series), default=0)

    @property
    def at(self) -> str:
        """The instruction whose end holds the peak, as memory_peak names it."""
        i, _ = max(self.series, key=lambda ib: ib[1])   # the first of equal ones
        return f"{i}: {self.runtime.plan.instructions[i]}"[:80]

    def _saw(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self.saved[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())

    def before(self, i: int, step) -> None:
        if i == 0:
            self.series = []
        self.step, self.now = step, i

    def after(self, i: int, step) -> None:
        self.series.append((i, self.held_bytes(step)))

    def _inside(self) -> None:
        """A point inside the running instruction (a checkpointed micro-batch recomputed)."""
        self.series.append((self.now, self.held_bytes(self.step)))

    def held_bytes(self, step=None) -> int:
        """Bytes of the distinct live storages this rank holds now."""
        storages = held_storages([self.runtime, self.optimizer, step])
        for ptr, (ref, nbytes) in list(self.saved.items()):
            if ref.expired():
                del self.saved[ptr]
            elif ptr not in storages:
                storages[ptr] = nbytes
        return sum(storages.values())


def held_storages(roots) -> Dict[int, int]:
    """address -> bytes of every non-empty tensor storage reachable from `roots` through
    containers, graphc objects, modules and optimizers (not through functions or autograd
    graphs)."""
    out: Dict[int, int] = {}
    seen = set()
    todo = deque(roots)
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            _count(obj, out)
            todo.extend(_tensor_children(obj))
        elif isinstance(obj, torch.nn.Module):
            todo.extend(obj._parameters.values())
            todo.extend(obj._buffers.values())
            todo.extend(obj._modules.values())
            todo.extend(v for v in vars(obj).values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.optim.Optimizer):
            todo.extend([obj.state, obj.param_groups])
        elif isinstance(obj, dict):
            todo.extend(obj.values())
            todo.extend(k for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            todo.extend(obj)
        elif _walked(obj):
            todo.extend(_fields(obj))
    return out


def _count(t: torch.Tensor, out: Dict[int, int]) -> None:
    if t.device.type == "meta" or _is_fake(t):
        return
    storage = t.untyped_storage()
    if storage.nbytes():
        out[storage.data_ptr()] = storage.nbytes()


def _tensor_children(t: torch.Tensor) -> list:
    """A leaf's .grad and the attributes graphc sets on a parameter (a master, a shard)."""
    kids = [t.grad] if t.is_leaf else []
    return kids + list(getattr(t, "__dict__", {}).values())


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def _walked(obj) -> bool:
    module = type(obj).__module__ or ""
    return module.startswith("graphc.") and not module.startswith(_NOT_WALKED)


def _fields(obj) -> list:
    out = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            out.append(getattr(obj, name, None))
    return out
