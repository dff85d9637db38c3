"""The execution-plan IR: small frozen instructions that print as one line and parse back.

Compute instructions print like torch.distributed.pipelining actions: `1F3` is stage 1's
forward of micro-batch 3, `1B3` its backward. Communication prints with its peer and
payload: `0SEND_F3 to=1 [relu0:f32[4,512]]`, `1RECV_B3 from=2 [...]`.

Each instruction class owns its whole vocabulary, as pipelining's `_ComputationType` does:
its JSON `op`, its `span_kind` on a timeline (runtime/trace.py, the charts), a stage compute's
`letter`, the `word` a count of it is headed by (tools/summary.py), what the runtime runs it as
(`runs`: Runtime's entry `_run_<runs>` in runtime/actors.py), what a collective joins the other
members of its group in (`joins`: how plan/verify.py pairs it), how it prints (`__str__`,
and `label`, the listing up to its first space), the pattern it parses back from (`TEXT`,
`_from_text`) and its JSON (`to_json`, `_from_json`). A new instruction is one class, listed in
INSTRUCTIONS; parse_instruction and instruction_from_json ask each class in turn. Compute,
transfers and the optimizer step are here; what every rank of a group issues together in
collective_instructions.py; the base class in instruction_base.py, TensorSpec in tensor_spec.py
(all importable from here).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Tuple

from ..errors import GraphcError
from .collective_instructions import (INSIDE_COMPUTE, UNIT_EVENTS, AllGather, AllReduce, ClipGradNorm,
                                      Collective, OutputAllReduce, ReduceScatter, ReleaseParams,
                                      TieAllReduce, UnitGather, UnitRelease)
from .instruction_base import ACT, GRAD, JOINS_CONVERSION, JOINS_TENSORS, PRE, Instruction
from .tensor_spec import TensorSpec, _specs, _specs_from_json


@dataclass(frozen=True)
class _StageCompute(Instruction):
    """One stage's compute on one micro-batch, printed `<stage><letter><micro-batch>`."""

    letter: ClassVar[str] = ""
    stage: int
    microbatch: int

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.word = cls.letter
        cls.TEXT = re.compile(rf"(\d+){cls.letter}(\d+)")

    @property
    def caption(self) -> str:
        """Its letter and micro-batch, as a chart box shows it: `F3`."""
        return f"{self.letter}{self.microbatch}"

    def __str__(self) -> str:
        return f"{self.stage}{self.letter}{self.microbatch}"

    def to_json(self) -> dict:
        return {"op": self.op, "stage": self.stage, "microbatch": self.microbatch}

    @classmethod
    def _from_text(cls, m: re.Match) -> "_StageCompute":
        return cls(int(m.group(1)), int(m.group(2)))

    @classmethod
    def _from_json(cls, d: dict) -> "_StageCompute":
        return cls(d["stage"], d["microbatch"])


@dataclass(frozen=True)
class Forward(_StageCompute):
    op: ClassVar[str] = "forward"
    span_kind: ClassVar[str] = "forward"
    runs: ClassVar[str] = "forward"
    letter: ClassVar[str] = "F"


@dataclass(frozen=True)
class Backward(_StageCompute):
    """Backward of one micro-batch through one stage: input and weight gradients together."""

    op: ClassVar[str] = "backward"
    span_kind: ClassVar[str] = "backward"
    runs: ClassVar[str] = "backward"
    letter: ClassVar[str] = "B"


@dataclass(frozen=True)
class BackwardInput(_StageCompute):
    """First half of a split backward: gradients of the stage's inputs only (sent upstream at
    once); the stage keeps what its BackwardWeight of the same micro-batch needs."""

    op: ClassVar[str] = "backward_input"
    span_kind: ClassVar[str] = "backward_input"
    runs: ClassVar[str] = "backward_input"
    letter: ClassVar[str] = "I"


@dataclass(frozen=True)
class BackwardWeight(_StageCompute):
    """Second half of a split backward: the parameter gradients of one micro-batch."""

    op: ClassVar[str] = "backward_weight"
    span_kind: ClassVar[str] = "backward_weight"
    runs: ClassVar[str] = "backward_weight"
    letter: ClassVar[str] = "W"


@dataclass(frozen=True)
class PrePass(_StageCompute):
    """One micro-batch of a stage's pre-pass, before the step's schedule: its Prologue (the
    program cut to what the whole-batch sums need) without gradient; it receives from the
    stage before what that cut reads and sends on what later stages' cuts read (`0SEND_P3`).
    The sums are totalled after the stage's last micro-batch (NOTE: Whole-batch sums)."""

    op: ClassVar[str] = "pre_pass"
    span_kind: ClassVar[str] = "pre_pass"
    runs: ClassVar[str] = "pre_pass"
    letter: ClassVar[str] = "P"


@dataclass(frozen=True)
class OverlapFB(Instruction):
    """DualPipeV's pair: a forward of one chunk and a (whole) backward of another, meant to
    overlap (one's compute under the other's communication). Printed as torch prints it,
    `(2F3;1B1)OVERLAP_F_B`; on a CPU the two run one after the other."""

    op: ClassVar[str] = "overlap_f_b"
    span_kind: ClassVar[str] = "overlap"
    runs: ClassVar[str] = "overlap"
    word: ClassVar[str] = "OVERLAP_F_B"
    TEXT: ClassVar[re.Pattern] = re.compile(r"\((\d+F\d+);(\d+B\d+)\)OVERLAP_F_B")
    forward: Forward
    backward: Backward

    @property
    def caption(self) -> str:
        """Both halves' captions, as a chart box shows them: `F3|B1`."""
        return f"{self.forward.caption}|{self.backward.caption}"

    @property
    def parts(self) -> Tuple[Instruction, ...]:
        return (self.forward, self.backward)

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})OVERLAP_F_B"

    def to_json(self) -> dict:
        return {"op": self.op, "forward": self.forward.to_json(), "backward": self.backward.to_json()}

    @classmethod
    def _from_text(cls, m: re.Match) -> "OverlapFB":
        return cls(parse_instruction(m.group(1)), parse_instruction(m.group(2)))

    @classmethod
    def _from_json(cls, d: dict) -> "OverlapFB":
        return cls(instruction_from_json(d["forward"]), instruction_from_json(d["backward"]))


@dataclass(frozen=True)
class _P2P(Instruction):
    """A point-to-point transfer, printed `<stage><WORD>_<direction><micro-batch> <to|from>=..`."""

    word: ClassVar[str] = ""            # SEND or RECV
    towards: ClassVar[str] = ""         # to or from
    stage: int
    microbatch: int
    peer: int
    direction: str                      # ACT, GRAD or PRE (a pre-pass's values)
    peer_stage: int
    tensors: Tuple[TensorSpec, ...] = field(default=())

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.TEXT = re.compile(rf"(\d+){cls.word}_([FBP])(\d+) {cls.towards}=(\d+) stage=(\d+) \[(.*)\]")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def label(self) -> str:
        return f"{self.stage}{self.word}_{self.direction}{self.microbatch}"

    def __str__(self) -> str:
        specs = " ".join(map(str, self.tensors))
        return f"{self.label} {self.towards}={self.peer} stage={self.peer_stage} [{specs}]"

    def to_json(self) -> dict:
        return {"op": self.op, "stage": self.stage, "microbatch": self.microbatch,
                "peer": self.peer, "direction": self.direction, "peer_stage": self.peer_stage,
                "tensors": [t.to_json() for t in self.tensors],
                "bytes": self.nbytes}

    @classmethod
    def _from_text(cls, m: re.Match) -> "_P2P":
        return cls(int(m.group(1)), int(m.group(3)), int(m.group(4)), m.group(2), int(m.group(5)),
                   _specs(m.group(6)))

    @classmethod
    def _from_json(cls, d: dict) -> "_P2P":
        return cls(d["stage"], d["microbatch"], d["peer"], d["direction"], d["peer_stage"],
                   _specs_from_json(d))


@dataclass(frozen=True)
class Send(_P2P):
    op: ClassVar[str] = "send"
    span_kind: ClassVar[str] = "send"
    runs: ClassVar[str] = "send"
    holds: ClassVar[str] = "send"
    word: ClassVar[str] = "SEND"
    towards: ClassVar[str] = "to"

    def sent_bytes(self) -> int:
        return self.nbytes


@dataclass(frozen=True)
class Recv(_P2P):
    op: ClassVar[str] = "recv"
    span_kind: ClassVar[str] = "recv"
    runs: ClassVar[str] = "recv"
    holds: ClassVar[str] = "recv"
    word: ClassVar[str] = "RECV"
    towards: ClassVar[str] = "from"



@dataclass(frozen=True)
class OptimizerStep(Instruction):
    op: ClassVar[str] = "optimizer_step"
    span_kind: ClassVar[str] = "optimizer"
    runs: ClassVar[str] = "optimizer_step"
    holds: ClassVar[str] = "optimizer_step"
    word: ClassVar[str] = "OPTIMIZER_STEP"
    TEXT: ClassVar[re.Pattern] = re.compile("OPTIMIZER_STEP")

    def __str__(self) -> str:
        return "OPTIMIZER_STEP"

    @classmethod
    def _from_text(cls, m: re.Match) -> "OptimizerStep":
        return cls()

    @classmethod
    def _from_json(cls, d: dict) -> "OptimizerStep":
        return cls()



STAGE_COMPUTES = (Forward, Backward, BackwardInput, BackwardWeight)
COMPUTE = STAGE_COMPUTES + (OverlapFB, PrePass)
COMPUTE_RUNS = frozenset(cls.runs for cls in COMPUTE)   # the run entries of compute
# every instruction class, the most frequent first (the order parse_instruction tries them)
INSTRUCTIONS = COMPUTE + (Send, Recv, Collective, AllReduce, TieAllReduce, ClipGradNorm, OutputAllReduce,
                          OptimizerStep, ReduceScatter, AllGather, ReleaseParams, UnitGather, UnitRelease)


def _uncaptured(pattern: str) -> str:
    """`pattern` with its groups made non-capturing (escaped parentheses left alone)."""
    return re.sub(r"(?<!\\)\((?!\?)", "(?:", pattern)


# which class printed a line: every class's pattern as one alternative, one scan in C rather
# than a Python loop over the classes (plans at scale parse half a million lines)
_WHICH = re.compile("|".join(f"(?P<i{i}>{_uncaptured(cls.TEXT.pattern)})"
                             for i, cls in enumerate(INSTRUCTIONS)))


def parse_instruction(text: str) -> Instruction:
    """Parses one line of `str(instruction)` back into the instruction."""
    text = text.strip()
    which = _WHICH.fullmatch(text)
    if which is None:
        raise GraphcError(f"cannot parse plan instruction {text!r}")
    cls = INSTRUCTIONS[int(which.lastgroup[1:])]
    return cls._from_text(cls.TEXT.fullmatch(text))


def instruction_from_json(d: dict) -> Instruction:
    cls = next((c for c in INSTRUCTIONS if c.reads_json(d)), None)
    if cls is None:
        raise GraphcError(f"unknown plan instruction op {d['op']!r}")
    return cls._from_json(d)


# every instruction class and table, importable from here whichever module defines it
__all__ = ["ACT", "GRAD", "PRE", "PrePass", "JOINS_TENSORS", "JOINS_CONVERSION", "TensorSpec", "Instruction", "Forward",
           "Backward", "BackwardInput", "BackwardWeight", "OverlapFB", "Send", "Recv", "AllReduce",
           "TieAllReduce", "OutputAllReduce", "ClipGradNorm", "ReduceScatter", "AllGather", "ReleaseParams",
           "UnitGather", "UnitRelease", "UNIT_EVENTS", "INSIDE_COMPUTE", "OptimizerStep", "Collective",
           "STAGE_COMPUTES", "COMPUTE", "COMPUTE_RUNS", "INSTRUCTIONS", "parse_instruction",
           "instruction_from_json"]
