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
`_from_text`) and its JSON (`to_json`, `_from_json`). A new instruction is one class here, listed in
INSTRUCTIONS; parse_instruction and instruction_from_json ask each class in turn.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Tuple

from ..errors import GraphcError

ACT = "F"   # activations flow forward
GRAD = "B"  # gradients flow backward

_DTYPE_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b1",
}
_DTYPE_LONG = {v: k for k, v in _DTYPE_SHORT.items()}

# What a collective instruction joins the other members of its group in (its class's `joins`,
# by which plan verification pairs it: plan/verify.py's tables): a sum, gather or scatter of
# the named tensors, or one fx node's boxing conversion. Compute, transfers and a rank's own
# steps join nothing ("").
JOINS_TENSORS = "tensors"
JOINS_CONVERSION = "conversion"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a transfer: the fx value it carries, its shape and dtype (torch name).

    A piece of a value (an n-to-m transfer, NOTE: Reshard pieces in graphc/sbp/pieces.py)
    also says where it sits in the local tensor of the rank that lists it: `at` (offsets)
    within `of` (that local tensor's shape); it prints as `h:f64[2,8]@1,0/3,8`. The sender's
    and the receiver's offsets differ, so they take no part in comparing specs."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    at: Tuple[int, ...] = field(default=(), compare=False)
    of: Tuple[int, ...] = field(default=(), compare=False)

    @property
    def nbytes(self) -> int:
        import torch
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * getattr(torch, self.dtype).itemsize

    @property
    def is_piece(self) -> bool:
        return bool(self.of) and self.shape != self.of

    def to_json(self) -> dict:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.is_piece:
            out.update(at=list(self.at), of=list(self.of))
        return out

    def __str__(self) -> str:
        text = f"{self.name}:{_DTYPE_SHORT.get(self.dtype, self.dtype)}[{','.join(map(str, self.shape))}]"
        if self.is_piece:
            text += f"@{','.join(map(str, self.at))}/{','.join(map(str, self.of))}"
        return text

    @staticmethod
    def parse(text: str) -> "TensorSpec":
        m = re.fullmatch(r"([\w.]+):(\w+)\[([\d,]*)\](?:@([\d,]*)/([\d,]*))?", text.strip())
        if not m:
            raise GraphcError(f"cannot parse tensor spec {text!r}; expected name:dtype[d0,d1]")
        ints = lambda g: tuple(int(d) for d in (g or "").split(",") if d)  # noqa: E731
        return TensorSpec(m.group(1), ints(m.group(3)), _DTYPE_LONG.get(m.group(2), m.group(2)),
                          ints(m.group(4)), ints(m.group(5)))


def _ints(text: str) -> Tuple[int, ...]:
    return tuple(int(r) for r in text.split(",") if r.strip())


def _specs(text: str) -> Tuple[TensorSpec, ...]:
    return tuple(TensorSpec.parse(s) for s in text.split())


def _specs_from_json(d: dict) -> Tuple[TensorSpec, ...]:
    return tuple(TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], tuple(t.get("at", ())),
                            tuple(t.get("of", ()))) for t in d.get("tensors", ()))


@dataclass(frozen=True)
class Instruction:
    """One step of a rank's plan; each subclass carries its whole vocabulary (module docstring)."""

    op: ClassVar[str] = ""                  # its JSON "op"
    span_kind: ClassVar[str] = ""           # what it shows as on a timeline (runtime/trace.py KINDS)
    word: ClassVar[str] = ""                # what a count of it is headed by (tools/summary.py)
    runs: ClassVar[str] = ""                # its run entry: Runtime._run_<runs> (runtime/actors.py)
    joins: ClassVar[str] = ""               # a collective's group entry (JOINS_* above): plan/verify.py
    TEXT: ClassVar[Optional[re.Pattern]] = None   # its printed form, for parse_instruction

    @property
    def label(self) -> str:
        """The listing up to its first space: `1F3`, `0SEND_F3`, `1F0.ALL_GATHER`, `ALL_REDUCE`."""
        return str(self).split(" ", 1)[0]

    @property
    def parts(self) -> Tuple["Instruction", ...]:
        """What it runs, one after the other: itself (an OverlapFB: its two halves)."""
        return (self,)

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
    direction: str                      # ACT or GRAD
    peer_stage: int
    tensors: Tuple[TensorSpec, ...] = field(default=())

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.TEXT = re.compile(rf"(\d+){cls.word}_([FB])(\d+) {cls.towards}=(\d+) stage=(\d+) \[(.*)\]")

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
    word: ClassVar[str] = "SEND"
    towards: ClassVar[str] = "to"


@dataclass(frozen=True)
class Recv(_P2P):
    op: ClassVar[str] = "recv"
    span_kind: ClassVar[str] = "recv"
    runs: ClassVar[str] = "recv"
    word: ClassVar[str] = "RECV"
    towards: ClassVar[str] = "from"


@dataclass(frozen=True)
class AllReduce(Instruction):
    """Sums the named tensors (gradients, by parameter name) over `ranks`."""

    op: ClassVar[str] = "all_reduce"
    span_kind: ClassVar[str] = "collective"
    word: ClassVar[str] = "ALL_REDUCE"
    runs: ClassVar[str] = "grad_sync"         # waits for its bucket (runtime/collectives.py), ties and shards alike
    joins: ClassVar[str] = JOINS_TENSORS
    purpose: ClassVar[Optional[str]] = None   # told apart in JSON by "purpose"
    TEXT: ClassVar[re.Pattern] = re.compile(r"ALL_REDUCE ranks=\[([\d, ]*)\] \[(.*)\]")
    ranks: Tuple[int, ...]
    tensors: Tuple[TensorSpec, ...] = field(default=())

    @property
    def label(self) -> str:
        return self.word

    def __str__(self) -> str:
        return f"ALL_REDUCE ranks={list(self.ranks)} [{' '.join(map(str, self.tensors))}]"

    def to_json(self) -> dict:
        return {"op": self.op, "ranks": list(self.ranks),
                "tensors": [t.to_json() for t in self.tensors],
                "bytes": sum(t.nbytes for t in self.tensors)}

    @classmethod
    def reads_json(cls, d: dict) -> bool:
        # a conversion's all_reduce (a Collective) names its node; an unknown purpose is a sum
        purpose = d.get("purpose") if d.get("purpose") in _PURPOSES else None
        return d["op"] == cls.op and "node" not in d and purpose == cls.purpose

    @classmethod
    def _from_text(cls, m: re.Match) -> "AllReduce":
        return cls(_ints(m.group(1)), _specs(m.group(2)))

    @classmethod
    def _from_json(cls, d: dict) -> "AllReduce":
        return cls(tuple(d["ranks"]), _specs_from_json(d))


@dataclass(frozen=True)
class TieAllReduce(AllReduce):
    """Sums tied parameters' gradients over the stages that hold them (see insert_tie_sync).

    `tensors` name each parameter once for the whole graph (alike on every rank); `params`
    are the names this rank's stage program knows them by (an embedding's weight on stage 0
    is the LM head's weight on the last), so they do not take part in comparing instructions
    across ranks.
    """

    word: ClassVar[str] = "TIE_ALL_REDUCE"
    purpose: ClassVar[str] = "tie"
    TEXT: ClassVar[re.Pattern] = re.compile(r"TIE_ALL_REDUCE ranks=\[([\d, ]*)\] \[(.*)\] as \[(.*)\]")
    params: Tuple[str, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        return (f"TIE_ALL_REDUCE ranks={list(self.ranks)} [{' '.join(map(str, self.tensors))}] "
                f"as [{' '.join(self.params)}]")

    def to_json(self) -> dict:
        return {**super().to_json(), "purpose": self.purpose, "params": list(self.params)}

    @classmethod
    def _from_text(cls, m: re.Match) -> "TieAllReduce":
        return cls(_ints(m.group(1)), _specs(m.group(2)), tuple(m.group(3).split()))

    @classmethod
    def _from_json(cls, d: dict) -> "TieAllReduce":
        return cls(tuple(d["ranks"]), _specs_from_json(d), tuple(d.get("params", ())))


@dataclass(frozen=True)
class OutputAllReduce(AllReduce):
    """Sums build()'s partial_sum results over `ranks`, once per step (see
    insert_output_reduce): each tensor holds every micro-batch's value, one row each, so a
    loss under data parallelism costs one small all-reduce a step instead of a blocking one
    in every micro-batch's forward. Launched after this rank's last compute of the stage that
    makes them, waited for when the step ends."""

    word: ClassVar[str] = "OUTPUT_ALL_REDUCE"
    runs: ClassVar[str] = "output_sum"
    purpose: ClassVar[str] = "output"
    TEXT: ClassVar[re.Pattern] = re.compile(r"OUTPUT_ALL_REDUCE ranks=\[([\d, ]*)\] \[(.*)\]")

    def __str__(self) -> str:
        return f"OUTPUT_ALL_REDUCE ranks={list(self.ranks)} [{' '.join(map(str, self.tensors))}]"

    def to_json(self) -> dict:
        return {**super().to_json(), "purpose": self.purpose}


@dataclass(frozen=True)
class ClipGradNorm(AllReduce):
    """Gradient clipping by the global norm: an all-reduce of one scalar, then a local scale.

    Each rank sums the squared norms of the gradients it counts (`params`: each replicated
    parameter on one rank only, see insert_grad_clip), the sum is all-reduced over `ranks`,
    and every local gradient is scaled by max_norm / (norm + 1e-6) when that is below 1.
    `params` differ per rank, so they do not take part in comparing instructions across ranks.
    """

    word: ClassVar[str] = "CLIP_GRAD_NORM"
    runs: ClassVar[str] = "clip_grad_norm"
    purpose: ClassVar[str] = "clip_grad_norm"
    TEXT: ClassVar[re.Pattern] = re.compile(
        r"CLIP_GRAD_NORM max_norm=(\S+) ranks=\[([\d, ]*)\] \[(.*)\] of \[(.*)\]")
    max_norm: float = 1.0
    params: Tuple[str, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        return (f"CLIP_GRAD_NORM max_norm={self.max_norm!r} ranks={list(self.ranks)} "
                f"[{' '.join(map(str, self.tensors))}] of [{' '.join(self.params)}]")

    def to_json(self) -> dict:
        return {**super().to_json(), "purpose": self.purpose, "max_norm": self.max_norm,
                "params": list(self.params)}

    @classmethod
    def _from_text(cls, m: re.Match) -> "ClipGradNorm":
        return cls(_ints(m.group(2)), _specs(m.group(3)), float(m.group(1)), tuple(m.group(4).split()))

    @classmethod
    def _from_json(cls, d: dict) -> "ClipGradNorm":
        return cls(tuple(d["ranks"]), _specs_from_json(d), d["max_norm"], tuple(d.get("params", ())))


@dataclass(frozen=True)
class _ShardCollective(AllReduce):
    """A ZeRO collective over `ranks` (See NOTE: ZeRO in graphc/runtime/zero.py) on a bucket of
    parameters split(0) over them, torch.chunk's sizes: every rank's part of each tensor is
    padded to its largest chunk, so the parts are equal (gloo and NCCL need that).

    A subclass of AllReduce so that everything handling a gradient collective over a group
    (its process group, the verifier's pairing, the summary's counts, the simulator) takes
    it alike; its `op` and `word` tell it apart."""

    TEXT: ClassVar[re.Pattern] = re.compile(r"(?:REDUCE_SCATTER|ALL_GATHER) ranks=\[\]")  # per class below

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.TEXT = re.compile(rf"{cls.word} ranks=\[([\d, ]*)\] \[(.*)\]")

    @property
    def padded_nbytes(self) -> int:
        """The bytes of the whole (padded) bucket: what a rank's all-reduce of it would hold."""
        d = len(self.ranks)
        total = 0
        for t in self.tensors:
            rows = t.shape[0] if t.shape else 1
            total += d * -(-rows // d) * (t.nbytes // max(rows, 1))
        return total

    def __str__(self) -> str:
        return f"{self.word} ranks={list(self.ranks)} [{' '.join(map(str, self.tensors))}]"

    def to_json(self) -> dict:
        return {"op": self.op, "ranks": list(self.ranks),
                "tensors": [t.to_json() for t in self.tensors], "bytes": self.padded_nbytes}

    @classmethod
    def reads_json(cls, d: dict) -> bool:
        return d["op"] == cls.op and "node" not in d


@dataclass(frozen=True)
class ReduceScatter(_ShardCollective):
    """Sums the named gradients over `ranks`, each rank keeping the sum of its rows (split(0))."""

    op: ClassVar[str] = "reduce_scatter"
    word: ClassVar[str] = "REDUCE_SCATTER"


@dataclass(frozen=True)
class AllGather(_ShardCollective):
    """Every rank's rows of the named parameters (split(0), just stepped) to every rank of `ranks`."""

    op: ClassVar[str] = "all_gather"
    word: ClassVar[str] = "ALL_GATHER"
    runs: ClassVar[str] = "all_gather"


@dataclass(frozen=True)
class ReleaseParams(Instruction):
    """ZeRO stage 3: frees the whole copies of the named parameters, gathered by an ALL_GATHER
    for this rank's compute; each rank keeps only its rows (See NOTE: ZeRO stage 3 in
    graphc/runtime/zero.py). Sends nothing."""

    op: ClassVar[str] = "release"
    span_kind: ClassVar[str] = "release"
    word: ClassVar[str] = "RELEASE"
    runs: ClassVar[str] = "release"
    TEXT: ClassVar[re.Pattern] = re.compile(r"RELEASE \[(.*)\]")
    tensors: Tuple[TensorSpec, ...] = field(default=())

    @property
    def label(self) -> str:
        return self.word

    def __str__(self) -> str:
        return f"RELEASE [{' '.join(map(str, self.tensors))}]"

    def to_json(self) -> dict:
        return {"op": self.op, "tensors": [t.to_json() for t in self.tensors]}

    @classmethod
    def _from_text(cls, m: re.Match) -> "ReleaseParams":
        return cls(_specs(m.group(1)))

    @classmethod
    def _from_json(cls, d: dict) -> "ReleaseParams":
        return cls(_specs_from_json(d))


class _InsideCompute:
    """A ZeRO unit event's place: the compute it runs inside (its `stage`, `microbatch` and
    `direction`, fields of the event), printed before its word: `0F1.GATHER`. The runtime runs
    it inside that compute, not as a step of its own."""

    runs = "inside_compute"   # INSIDE_COMPUTE

    @property
    def label(self) -> str:
        return f"{self.stage}{self.direction}{self.microbatch}.{self.word}"

    def _place_json(self) -> dict:
        return {"stage": self.stage, "microbatch": self.microbatch, "direction": self.direction,
                "unit": self.unit}


@dataclass(frozen=True)
class UnitGather(_InsideCompute, AllGather):
    """ZeRO stage 3 per unit: every rank's rows of one unit's parameters, gathered inside the
    compute it is listed after (`stage`, `microbatch`, `direction`), just before the unit's
    first use there; the next unit's is launched while it computes (See NOTE: ZeRO units in
    graphc/runtime/zero_units.py). Printed `0F1.GATHER u2 ranks=[0, 1] [...]`."""

    op: ClassVar[str] = "unit_gather"
    word: ClassVar[str] = "GATHER"
    stage: int = 0
    microbatch: int = 0
    direction: str = ACT
    unit: int = 0

    def __str__(self) -> str:
        return (f"{self.label} u{self.unit} ranks={list(self.ranks)} "
                f"[{' '.join(map(str, self.tensors))}]")

    def to_json(self) -> dict:
        return {**super().to_json(), **self._place_json()}

    @classmethod
    def reads_json(cls, d: dict) -> bool:
        return d["op"] == cls.op

    @classmethod
    def _from_text(cls, m: re.Match) -> "UnitGather":
        return cls(_ints(m.group(5)), _specs(m.group(6)), int(m.group(1)), int(m.group(3)),
                   m.group(2), int(m.group(4)))

    @classmethod
    def _from_json(cls, d: dict) -> "UnitGather":
        return cls(tuple(d["ranks"]), _specs_from_json(d), d["stage"], d["microbatch"],
                   d["direction"], d["unit"])


UnitGather.TEXT = re.compile(r"(\d+)([FB])(\d+)\.GATHER u(\d+) ranks=\[([\d, ]*)\] \[(.*)\]")


@dataclass(frozen=True)
class UnitRelease(_InsideCompute, ReleaseParams):
    """ZeRO stage 3 per unit: one unit's whole copies freed inside the compute it is listed
    after, after the unit's last use there (See NOTE: ZeRO units in
    graphc/runtime/zero_units.py). Printed `0F1.RELEASE u2 [...]`."""

    op: ClassVar[str] = "unit_release"
    TEXT: ClassVar[re.Pattern] = re.compile(r"(\d+)([FB])(\d+)\.RELEASE u(\d+) \[(.*)\]")
    stage: int = 0
    microbatch: int = 0
    direction: str = ACT
    unit: int = 0

    def __str__(self) -> str:
        return f"{self.label} u{self.unit} [{' '.join(map(str, self.tensors))}]"

    def to_json(self) -> dict:
        return {**super().to_json(), **self._place_json()}

    @classmethod
    def _from_text(cls, m: re.Match) -> "UnitRelease":
        return cls(_specs(m.group(5)), int(m.group(1)), int(m.group(3)), m.group(2), int(m.group(4)))

    @classmethod
    def _from_json(cls, d: dict) -> "UnitRelease":
        return cls(_specs_from_json(d), d["stage"], d["microbatch"], d["direction"], d["unit"])


UNIT_EVENTS = (UnitGather, UnitRelease)   # listed after a compute, run inside it
INSIDE_COMPUTE = UnitGather.runs          # the run entry of what runs inside the compute listed before


@dataclass(frozen=True)
class OptimizerStep(Instruction):
    op: ClassVar[str] = "optimizer_step"
    span_kind: ClassVar[str] = "optimizer"
    runs: ClassVar[str] = "optimizer_step"
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


@dataclass(frozen=True)
class Collective(Instruction):
    """An SBP conversion that runs inside a stage's forward or backward (see docs/sbp.md).

    Listed right after the compute instruction that issues it, so the plan shows every
    collective with its SBP before and after, its ranks and its bytes; the runtime runs
    it as part of that compute, not as a separate step.
    """

    span_kind: ClassVar[str] = "collective"
    word: ClassVar[str] = "collective"     # every conversion counted together
    runs: ClassVar[str] = "inside_compute"  # by the stage program that issues it
    joins: ClassVar[str] = JOINS_CONVERSION
    kind: str                          # all_gather, reduce_scatter, all_to_all, all_reduce
    stage: int
    microbatch: int
    direction: str                     # ACT (inside the forward) or GRAD (inside the backward)
    ranks: Tuple[int, ...]
    node: str                          # the conversion's fx node
    sbp_in: str
    sbp_out: str
    nbytes: int                        # bytes this rank sends
    note: str = ""                     # e.g. "fallback: ..." (an op without an SBP rule)
    dtype: str = ""                    # torch name of what travels (the value's, or its gradient's)
    TEXT: ClassVar[re.Pattern] = re.compile(
        r"(\d+)([FB])(\d+)\.(\w+) ([^\s:]+)(?::(\w+))? (.+)->(.+) ranks=\[([\d, ]*)\] bytes=(\d+)"
        r"(?: # (.*))?")

    @property
    def op(self) -> str:  # type: ignore[override]
        return self.kind

    @property
    def label(self) -> str:
        return f"{self.stage}{self.direction}{self.microbatch}.{self.kind.upper()}"

    def __str__(self) -> str:
        dtype = f":{_DTYPE_SHORT.get(self.dtype, self.dtype)}" if self.dtype else ""
        return (f"{self.label} {self.node}{dtype} {self.sbp_in}->{self.sbp_out} ranks={list(self.ranks)} "
                f"bytes={self.nbytes}" + (f" # {self.note}" if self.note else ""))

    def to_json(self) -> dict:
        return {"op": self.kind, "stage": self.stage, "microbatch": self.microbatch,
                "direction": self.direction, "ranks": list(self.ranks), "node": self.node,
                "sbp_in": self.sbp_in, "sbp_out": self.sbp_out, "bytes": self.nbytes,
                "note": self.note, "dtype": self.dtype}

    @classmethod
    def reads_json(cls, d: dict) -> bool:
        return "node" in d

    @classmethod
    def _from_text(cls, m: re.Match) -> "Collective":
        dtype = _DTYPE_LONG.get(m.group(6), m.group(6)) if m.group(6) else ""
        return cls(m.group(4).lower(), int(m.group(1)), int(m.group(3)), m.group(2),
                   _ints(m.group(9)), m.group(5), m.group(7), m.group(8), int(m.group(10)),
                   m.group(11) or "", dtype)

    @classmethod
    def _from_json(cls, d: dict) -> "Collective":
        return cls(d["op"], d["stage"], d["microbatch"], d["direction"], tuple(d["ranks"]),
                   d["node"], d["sbp_in"], d["sbp_out"], d["bytes"], d.get("note", ""),
                   d.get("dtype", ""))


_PURPOSES = (TieAllReduce.purpose, ClipGradNorm.purpose, OutputAllReduce.purpose)   # AllReduce kinds told apart in JSON

STAGE_COMPUTES = (Forward, Backward, BackwardInput, BackwardWeight)
COMPUTE = STAGE_COMPUTES + (OverlapFB,)
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
