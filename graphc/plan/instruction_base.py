"""What every plan instruction is (Instruction, its class-level vocabulary: see
plan/instructions.py), the two directions values flow, and what a collective joins."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

ACT = "F"   # activations flow forward
GRAD = "B"  # gradients flow backward
PRE = "P"   # a pre-pass's values flow forward before the step (NOTE: Whole-batch sums)

# What a collective instruction joins the other members of its group in (its class's `joins`,
# by which plan verification pairs it: plan/verify.py's tables): a sum, gather or scatter of
# the named tensors, or one fx node's boxing conversion. Compute, transfers and a rank's own
# steps join nothing ("").
JOINS_TENSORS = "tensors"
JOINS_CONVERSION = "conversion"


@dataclass(frozen=True)
class Instruction:
    """One step of a rank's plan; each subclass carries its whole vocabulary (module docstring)."""

    op: ClassVar[str] = ""                  # its JSON "op"
    span_kind: ClassVar[str] = ""           # what it shows as on a timeline (runtime/trace.py KINDS)
    word: ClassVar[str] = ""                # what a count of it is headed by (tools/summary.py)
    runs: ClassVar[str] = ""                # its run entry: Runtime._run_<runs> (runtime/actors.py)
    joins: ClassVar[str] = ""               # a collective's group entry (JOINS_* above): plan/verify.py
    holds: ClassVar[str] = ""               # its memory effect: Walk.<holds> (tools/simulate/memory_walk.py)
    TEXT: ClassVar[Optional[re.Pattern]] = None   # its printed form, for parse_instruction

    @property
    def label(self) -> str:
        """The listing up to its first space: `1F3`, `0SEND_F3`, `1F0.ALL_GATHER`, `ALL_REDUCE`."""
        return str(self).split(" ", 1)[0]

    @property
    def parts(self) -> Tuple["Instruction", ...]:
        """What it runs, one after the other: itself (an OverlapFB: its two halves)."""
        return (self,)

    def sent_bytes(self) -> int:
        """The bytes this rank sends for it in a step (plan/traffic.py): none for compute and
        receives; transfers and collectives say theirs."""
        return 0

    def to_json(self) -> dict:
        return {"op": self.op}

    @classmethod
    def reads_json(cls, d: dict) -> bool:
        """Whether `d` is this class's JSON (each dict is exactly one class's)."""
        return d["op"] == cls.op

    @classmethod
    def _from_text(cls, m: re.Match) -> "Instruction":
        raise NotImplementedError

    @classmethod
    def _from_json(cls, d: dict) -> "Instruction":
        raise NotImplementedError

