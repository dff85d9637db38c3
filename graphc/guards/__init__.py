"""Guards: the Python values a compiled plan was built from, checked again on every call.

NOTE: Guards
build() is traced once into a static graph, so every Python value the trace read is a
constant of the plan: a module's `training` flag (dropout, BatchNorm, `if self.training:`),
a temperature `model.tau`, a Graph attribute `self.cfg.aux_weight`, which module or
parameter object sits at `model.head`. TorchDynamo keeps such values honest with guards;
graphc does the same for the values its own tracer reads (docs/design.md, "Guards", says
why the capture itself stays graphc's tracer):
- while compiling, nn.Module has a __getattribute__ (record_reads) that notes each
  attribute of a module's instance __dict__ that the code read, and each plain class
  attribute (`scale = 0.5` in the class body), with the value it had at its first read;
  the Graph's attributes are noted by the traced root's fallback lookup (build_root.py);
- plain values (numbers, strings, dtypes, tuples, dicts and small objects of them) are
  compared by value (`fingerprint`): a change selects, or compiles and caches, another
  plan (Executable lookup, like Dynamo's cache entries); tensors and other objects compare
  by identity;
- which module, parameter or buffer sits under each name (`structure_of`) and torch's
  global modes (grad, autocast, default dtype) are guarded too. A module or parameter
  replaced after compile cannot simply recompile (the optimizer and the shards hold the
  old parameters): it is a GraphcError saying so.
A check costs one dict lookup and a comparison per guarded value (docs/design.md gives
the measured cost per call).
"""
from .frames import FrameReads, frames_unobserved, observe_frames
from .modules import (BACKWARD_HOOK_TABLES, FORWARD_HOOK_TABLES, GLOBAL_HOOK_TABLES, ReadLog, class_value,
                      current_log, hook_guards, hook_state, record_reads, requires_grad_guard, structure_of,
                      traced_frames)
from .own_writes import first_call_differs, refuse_traced_values_kept, settle_own_writes
from .values import MISSING, Guard, GuardSet, compiled_check, describe, difference, fingerprint, global_guards, shown

__all__ = ["BACKWARD_HOOK_TABLES", "FORWARD_HOOK_TABLES", "GLOBAL_HOOK_TABLES", "FrameReads", "Guard", "GuardSet",
           "MISSING", "ReadLog", "class_value", "compiled_check", "current_log", "describe", "difference",
           "fingerprint", "frames_unobserved", "global_guards", "hook_guards", "hook_state", "observe_frames",
           "record_reads", "requires_grad_guard", "settle_own_writes", "first_call_differs", "refuse_traced_values_kept", "shown", "structure_of", "traced_frames"]
