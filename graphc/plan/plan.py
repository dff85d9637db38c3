"""ExecutionPlan: one rank's ordered instructions plus what the runtime needs to run them."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .instructions import Instruction, instruction_from_json, parse_instruction

PLAN_FORMAT = "graphc.plan/1"

# Activation checkpointing of micro-batches (torchgpipe's Pipe `checkpoint`), the modes of
# config.set_activation_checkpointing and ExecutionPlan.checkpointing: which micro-batches
# recompute their forward in their backward (checkpointed_microbatches).
CHECKPOINT_MODES = ("always", "except_last", "never")
NO_CHECKPOINTING = "never"

# Gradient buckets of data-parallel all-reduces (insert_grad_sync), the default of
# config.set_gradient_bucket_size and CompileSpec.gradient_bucket_bytes: PyTorch DDP's 25 MiB.
DEFAULT_BUCKET_BYTES = 25 * 2 ** 20


def checkpointed_microbatches(mode: str, num_microbatches: int) -> frozenset:
    """The micro-batches whose forward is recomputed in their backward (torchgpipe's Pipe `checkpoint`):
    all of them ("always"), all but the last ("except_last": its backward follows at once),
    or none ("never")."""
    m = num_microbatches
    if mode == "always":
        return frozenset(range(m))
    if mode == "except_last":
        return frozenset(range(m - 1))
    return frozenset()


@dataclass(frozen=True)
class StageInfo:
    """One pipeline stage: its id, the ranks that run it and their device type."""

    stage_id: int
    ranks: Tuple[int, ...]
    device_type: str = "cpu"


@dataclass
class ExecutionPlan:
    """This rank's compiled step: instructions in issue order.

    `str(plan)` lists one instruction a line; `to_json()` / `from_json()` round-trip.
    """

    rank: int
    world_size: int
    instructions: List[Instruction]
    num_microbatches: int = 1
    schedule: str = "1f1b"
    stages: Tuple[StageInfo, ...] = ()
    training: bool = True
    notes: Dict[str, str] = field(default_factory=dict)
    checkpointing: str = NO_CHECKPOINTING   # one of CHECKPOINT_MODES

    @property
    def local_stages(self) -> List[int]:
        return [s.stage_id for s in self.stages if self.rank in s.ranks]

    @property
    def recomputed_microbatches(self) -> frozenset:
        """The micro-batches whose backward runs their forward again (checkpointed_microbatches)."""
        if not self.training:
            return frozenset()
        return checkpointed_microbatches(self.checkpointing, self.num_microbatches)

    def __str__(self) -> str:
        """The header, the stages line and the notes (`# ...`), then one instruction a line."""
        return self.listing()

    def listing(self, text_of: Callable[[Instruction], str] = str) -> str:
        """str(plan), each instruction's text from `text_of` (the compile history prints the
        instruction objects its records share once: history.history_text)."""
        lines = [f"{i:4d}  {text_of(ins)}" for i, ins in enumerate(self.instructions)]
        return "\n".join(self._header() + lines)

    def _header(self) -> List[str]:
        head = (f"# graphc plan: rank {self.rank} of {self.world_size}, schedule={self.schedule}, "
                f"microbatches={self.num_microbatches}, stages={self.local_stages}, "
                f"{'training' if self.training else 'inference'}"
                + (f", checkpointing={self.checkpointing}" if self.checkpointing != NO_CHECKPOINTING else ""))
        stages = ([f"# {STAGES_LINE}: " + " ".join(f"{s.stage_id}={s.device_type}[{_fmt_ranks(s.ranks)}]"
                                                  for s in self.stages)] if self.stages else [])
        return [head] + stages + [f"# {key}: {text}" for key, text in sorted(self.notes.items())]

    def format(self, mark: Optional[int] = None, note: str = "") -> str:
        """The listing with instruction `mark` flagged `<-- ERROR HERE`."""
        lines = str(self).splitlines()
        if mark is not None:
            lines[mark + len(self._header())] += f"   <-- ERROR HERE{': ' + note if note else ''}"
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "training": self.training,
            "checkpointing": self.checkpointing,
            "stages": [{"stage": s.stage_id, "ranks": list(s.ranks), "device_type": s.device_type}
                       for s in self.stages],
            "notes": dict(self.notes),
            "instructions": [ins.to_json() for ins in self.instructions],
        }

    @staticmethod
    def from_json(d: dict) -> "ExecutionPlan":
        stages = tuple(StageInfo(s["stage"], tuple(s["ranks"]), s.get("device_type", "cpu"))
                       for s in d.get("stages", ()))
        return ExecutionPlan(d["rank"], d["world_size"],
                             [instruction_from_json(i) for i in d["instructions"]],
                             d.get("num_microbatches", 1), d.get("schedule", "1f1b"),
                             stages, d.get("training", True),
                             notes=dict(d.get("notes", {})),
                             checkpointing=d.get("checkpointing", NO_CHECKPOINTING))

    @staticmethod
    def parse(text: str) -> "ExecutionPlan":
        """Parses `str(plan)` back: `parse(str(plan)) == plan` (a listing without the stages
        line, as written by hand, has no stages)."""
        lines = text.strip().splitlines()
        head = lines[0]
        fields = dict(kv.split("=", 1) for kv in head.replace(",", " ").split() if "=" in kv)
        rank = int(head.split("rank ")[1].split()[0])
        world = int(head.split(" of ")[1].split(",")[0])
        comments = dict(line[2:].split(": ", 1) for line in lines[1:] if line.startswith("# "))
        stages = tuple(_parse_stage(s) for s in comments.pop(STAGES_LINE, "").split())
        instrs = [parse_instruction(line.split(None, 1)[1]) for line in lines[1:]
                  if not line.startswith("#")]
        return ExecutionPlan(rank, world, instrs, int(fields["microbatches"]), fields["schedule"],
                             stages, training="inference" not in head, notes=comments,
                             checkpointing=fields.get("checkpointing", NO_CHECKPOINTING))


ZERO_NOTE = "zero"   # plan.notes key of a ZeRO plan: `stage N; ...` (insert_zero_sync, runtime/zero.py)
STAGES_LINE = "pipeline stages"   # `# pipeline stages: 0=cpu[0..3] 1=cpu[4..7]`, never a note's key


@functools.lru_cache(maxsize=4096)   # every plan's header prints every stage's ranks
def _fmt_ranks(ranks: Tuple[int, ...]) -> str:
    """'0..3,8,10' for (0, 1, 2, 3, 8, 10): ascending runs of three or more as a..b, in order."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out += [f"{ranks[i]}..{ranks[j]}"] if j - i >= 2 else [str(r) for r in ranks[i:j + 1]]
        i = j + 1
    return ",".join(out)


def parse_ranks(text: str) -> Tuple[int, ...]:
    """_fmt_ranks's text back: '0..3,8,10' -> (0, 1, 2, 3, 8, 10)."""
    flat: List[int] = []
    for item in filter(None, text.split(",")):
        a, _, b = item.partition("..")
        flat += range(int(a), int(b) + 1) if b else [int(a)]
    return tuple(flat)


def _parse_stage(text: str) -> StageInfo:
    stage, rest = text.split("=", 1)
    device, ranks = rest[:-1].split("[", 1)
    return StageInfo(int(stage), parse_ranks(ranks), device)
