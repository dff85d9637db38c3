"""examples/long_context.py: HF Llama on long padded sequences, the sequence split over ranks
(NOTE: Context parallel), checked against eager on the whole batch by `graphc check`
(graphc.testing.check_script: float64, 1e-10 for parameters; Llama's loss is a float32
number, its own upcast of the logits). Each layout's check runs its ranks in this process."""
import io
import os

import pytest

import graphc

pytest.importorskip("transformers")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "long_context.py")
ARGS = ["--seq", "32", "--steps", "2", "--batch", "4", "--embd", "32"]


def _check(layout, nproc):
    out = io.StringIO()
    reports = graphc.testing.check_script(SCRIPT, ARGS + layout, nproc, steps=2, out=out)
    return reports, out.getvalue()


@pytest.mark.slow   # CI time: HF Llama cp2 in tests/runtime/test_context_parallel.py
@pytest.mark.parametrize("layout,nproc", [(["--cp", "4", "--tp", "2"], 8),
                                          (["--cp", "2", "--tp", "2", "--sp"], 4),
                                          (["--cp", "2", "--dp", "2"], 4),
                                          (["--cp", "2", "--dp", "2", "--zero", "2"], 4),
                                          (["--cp", "2", "--method", "all_to_all"], 2),
                                          (["--cp", "4", "--load-balance"], 4),
                                          (["--cp", "2", "--tp", "2", "--sp", "--load-balance"], 4)])
def test_long_context_layouts_pass_the_check(layout, nproc):
    reports, text = _check(layout, nproc)
    assert reports and all(r.ok for r in reports), text
