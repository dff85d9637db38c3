"""A tensor as plans list it (TensorSpec: name, shape, dtype, and where a piece sits), its
short dtype names, and the helpers instructions parse their tensor lists with."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Tuple

from ..errors import GraphcError

_DTYPE_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b1",
}
_DTYPE_LONG = {v: k for k, v in _DTYPE_SHORT.items()}


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

