"""One ZeRO-sharded parameter on this rank (See NOTE: ZeRO in zero.py): its whole parameter,
group and rows, the shard parameter the optimizer holds, and how its rows are packed into a
bucket and unpacked from one, freed and given back (stage 3, masters).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass
class Shard:
    """One sharded parameter on this rank: the whole (replicated) parameter, its group and this
    rank's rows, and the shard parameter the optimizer holds (a view of those rows)."""

    name: str
    param: torch.nn.Parameter
    ranks: Tuple[int, ...]
    start: int                  # this rank's first row
    rows: int                   # this rank's rows (0 on a rank past the last chunk)
    chunk: int                  # the largest chunk's rows: every rank's part is padded to it
    shard: torch.nn.Parameter
    owns: bool = False          # stage 3: the shard owns its rows; the whole storage is freed between uses
    # set_param_dtype: the parameter's float32 master, whose rows the shard owns (its whole
    # storage freed; only its .grad is whole); gathers round the rows into the parameter
    # (See NOTE: ZeRO with master parameters)
    master: Optional[torch.nn.Parameter] = None

    @property
    def row_numel(self) -> int:
        return math.prod(self.param.shape[1:])   # from the shape: at stage 3 the storage may be freed

    @property
    def part_numel(self) -> int:
        return self.chunk * self.row_numel

    def view_rows(self) -> torch.Tensor:
        """This rank's rows: the shard's own at stage 3 or with a master, else a view of the
        parameter's."""
        if self.owns or self.master is not None:
            return self.shard.data
        return self.param.data[self.start:self.start + self.rows]

    @property
    def released(self) -> bool:
        return self.owns and self.param.data.untyped_storage().nbytes() == 0

    def release(self) -> None:
        """Stage 3: frees the whole parameter's storage (See NOTE: ZeRO stage 3)."""
        self.param.data.untyped_storage().resize_(0)

    def materialize(self) -> None:
        """Stage 3: the whole parameter's storage back (values undefined until unpacked)."""
        if self.released:
            self.param.data.untyped_storage().resize_(self.param.numel() * self.param.element_size())

    def materialize_master(self) -> None:
        """set_param_dtype: the whole master's storage back (values undefined until unpacked)."""
        m = self.master.data
        m.untyped_storage().resize_(m.numel() * m.element_size())

    @torch.no_grad()
    def keep_master_rows(self) -> None:
        """set_param_dtype: this rank's rows of the (whole) master into the shard, the
        parameter its master rounded, and the master's storage freed again."""
        m = self.master.data
        self.shard.data.copy_(m[self.start:self.start + self.rows])
        if not self.released:    # (stage 3: a freed parameter is the next gather's rounding)
            self.param.data.copy_(m)
        m.untyped_storage().resize_(0)

    def keep_rows(self) -> None:
        """Stage 3: this rank's rows of the (whole) parameter into its shard."""
        self.shard.data.copy_(self.param.data[self.start:self.start + self.rows])

    def refresh(self) -> None:
        """The shard views the parameter's current storage (a load or a device move may have
        replaced it); the optimizer's state stays keyed by the same shard parameter."""
        if self.owns or self.master is not None:
            return
        rows = self.view_rows()
        if self.shard.data.data_ptr() != rows.data_ptr() or self.shard.device != rows.device:
            self.shard.data = rows

    def pack(self, full: torch.Tensor, parts: torch.Tensor) -> None:
        """`full` (the parameter's shape) into `parts` ([d, part_numel]): rank k's rows at row
        k, padded with zeros."""
        d, c = parts.shape[0], self.chunk
        rows = full.reshape(full.shape[0], -1)
        whole = rows.shape[0] // c if c else 0     # ranks holding c rows
        if whole:
            parts[:whole].copy_(rows[:whole * c].reshape(whole, -1))
        if whole < d:
            rest = rows[whole * c:].reshape(-1)
            parts[whole, :rest.numel()].copy_(rest)
            parts[whole, rest.numel():].zero_()
            parts[whole + 1:].zero_()

    def unpack(self, parts: torch.Tensor, into: Optional[torch.Tensor] = None) -> None:
        """Every rank's rows from `parts` ([d, part_numel]) into the parameter (or `into`, of
        its shape)."""
        into = self.param if into is None else into
        rows = into.data.reshape(into.shape[0], -1)
        c = self.chunk
        whole = rows.shape[0] // c if c else 0
        if whole:
            rows[:whole * c].copy_(parts[:whole].reshape(whole * c, -1))
        if whole * c < rows.shape[0]:
            rest = rows[whole * c:]
            rest.copy_(parts[whole, :rest.numel()].view_as(rest))
