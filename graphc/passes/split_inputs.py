"""split_inputs: which build() inputs are cut into micro-batches, by one explicit rule.

Invariant: under gradient accumulation, an input is split along dim 0 iff it has a dim 0
equal to the batch size and the user did not mark it whole (config.set_whole_inputs); the
batch size is dim 0 of the first input not marked whole (OneFlow splits every input along
dim 0; graphc keeps inputs of another length, such as a class table, whole). The rule never
guesses from how build() uses an input: find_batch_dims then only confirms the choice
against the data flow, or refuses it naming the input and the op (NOTE: Batch split).
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from ..errors import GraphcError


def split_inputs(names: Sequence[str], example_inputs: Sequence[torch.Tensor],
                 whole: Sequence[str], graph_name: str = "Graph") -> List[bool]:
    unknown = [w for w in whole if w not in names]
    if unknown:
        raise GraphcError(
            f"config.set_whole_inputs names {unknown}, which {graph_name}.build() does not take; "
            f"its inputs are {list(names)}. Fix: name build()'s arguments as written in its "
            "signature.")
    sized = [t.shape[0] for name, t in zip(names, example_inputs) if name not in whole and t.dim() >= 1]
    if not sized:
        return [False] * len(names)
    batch = sized[0]
    return [name not in whole and t.dim() >= 1 and t.shape[0] == batch
            for name, t in zip(names, example_inputs)]
