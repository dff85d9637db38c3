"""The plan instructions every rank of a group issues together, and ZeRO's around them:
gradient sums (AllReduce; tied, output and clipping sums), ZeRO's scatters, gathers and
releases (whole or per unit, inside a compute), and the boxing conversions a stage program
runs (Collective). See plan/instructions.py for what each class carries."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Tuple

from .instruction_base import ACT, JOINS_CONVERSION, JOINS_TENSORS, Instruction
from .tensor_spec import _DTYPE_LONG, _DTYPE_SHORT, TensorSpec, _ints, _specs, _specs_from_json


@dataclass(frozen=True)
class AllReduce(Instruction):
    """Sums the named tensors (gradients, by parameter name) over `ranks`."""

    op: ClassVar[str] = "all_reduce"
    span_kind: ClassVar[str] = "collective"
    word: ClassVar[str] = "ALL_REDUCE"
    runs: ClassVar[str] = "grad_sync"         # waits for its bucket (runtime/collectives.py), ties and shards alike
    holds: ClassVar[str] = "reduce"           # frees its gradients' partial sums (ties and clips alike)
    joins: ClassVar[str] = JOINS_TENSORS
    purpose: ClassVar[Optional[str]] = None   # told apart in JSON by "purpose"
    TEXT: ClassVar[re.Pattern] = re.compile(r"ALL_REDUCE ranks=\[([\d, ]*)\] \[(.*)\]")
    ranks: Tuple[int, ...]
    tensors: Tuple[TensorSpec, ...] = field(default=())

    def sent_bytes(self) -> int:
        """As a ring sends over d ranks: a reduce-scatter, then an all-gather, 2 (d-1)/d B."""
        d = len(self.ranks)
        return 2 * sum(t.nbytes for t in self.tensors) * (d - 1) // d

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
    holds: ClassVar[str] = ""                 # a sum of outputs: nothing beyond its compute
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

    def sent_bytes(self) -> int:
        """A ring's reduce-scatter or all-gather of the padded bucket: (d-1)/d of it."""
        d = len(self.ranks)
        return self.padded_nbytes * (d - 1) // d

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
    holds: ClassVar[str] = "scatter"


@dataclass(frozen=True)
class AllGather(_ShardCollective):
    """Every rank's rows of the named parameters (split(0), just stepped) to every rank of `ranks`."""

    op: ClassVar[str] = "all_gather"
    word: ClassVar[str] = "ALL_GATHER"
    runs: ClassVar[str] = "all_gather"
    holds: ClassVar[str] = "gather"          # a unit's gather too


@dataclass(frozen=True)
class ReleaseParams(Instruction):
    """ZeRO stage 3: frees the whole copies of the named parameters, gathered by an ALL_GATHER
    for this rank's compute; each rank keeps only its rows (See NOTE: ZeRO stage 3 in
    graphc/runtime/zero.py). Sends nothing."""

    op: ClassVar[str] = "release"
    span_kind: ClassVar[str] = "release"
    word: ClassVar[str] = "RELEASE"
    runs: ClassVar[str] = "release"
    holds: ClassVar[str] = "release"         # a unit's release too
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


UnitGather.TEXT = re.compile(r"(\d+)([FBIW])(\d+)\.GATHER u(\d+) ranks=\[([\d, ]*)\] \[(.*)\]")


@dataclass(frozen=True)
class UnitRelease(_InsideCompute, ReleaseParams):
    """ZeRO stage 3 per unit: one unit's whole copies freed inside the compute it is listed
    after, after the unit's last use there (See NOTE: ZeRO units in
    graphc/runtime/zero_units.py). Printed `0F1.RELEASE u2 [...]`."""

    op: ClassVar[str] = "unit_release"
    TEXT: ClassVar[re.Pattern] = re.compile(r"(\d+)([FBIW])(\d+)\.RELEASE u(\d+) \[(.*)\]")
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
    direction: str                     # ACT (inside the forward), GRAD (the backward) or PRE (a pre-pass)
    ranks: Tuple[int, ...]
    node: str                          # the conversion's fx node
    sbp_in: str
    sbp_out: str
    nbytes: int                        # bytes this rank sends
    note: str = ""                     # e.g. "fallback: ..." (an op without an SBP rule)
    dtype: str = ""                    # torch name of what travels (the value's, or its gradient's)
    TEXT: ClassVar[re.Pattern] = re.compile(
        r"(\d+)([FBP])(\d+)\.(\w+) ([^\s:]+)(?::(\w+))? (.+)->(.+) ranks=\[([\d, ]*)\] bytes=(\d+)"
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

    def sent_bytes(self) -> int:
        return self.nbytes

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
