"""Users' programs over the layout matrix (NOTE: Fidelity probe, tests/fidelity.py): each
program, its Python state changed between calls as its user changes it, trains as plain eager
PyTorch on the whole batch does (float64, 1e-10: every returned value and the full state, 3
steps at accumulation 2) on every layout of the matrix (tests/layouts.py), or is refused with a
GraphcError that names the user's line and the fix. One test a group of programs; the whole
matrix runs under -m slow, a case per mechanism this file guards by default (DEFAULT)."""
from __future__ import annotations

import pytest

from fidelity import outcome
from fidelity_probes import AFTER, BUILD, MODEL, OPTIMIZER, REDUCTIONS, STATE
from layouts import LAYOUTS

# the default cases: one per mechanism (what it covers in the comment), the rest under -m slow
DEFAULT = {
    ("function_defaults_edited", "dp2"),        # guards/frames.py: a function's defaults
    ("tensor_from_list", "dp2"),                # trace_build: fx's constants named alike on every rank
    ("output_with_python_values", "pp2"),       # check_batch_sizes: the whole batch's returned numbers
    ("manual_seed_in_build", "one"),            # traced_calls: seeding a generator refused
    ("grad_read_in_build", "one"),              # traced_tensors: a parameter's .grad refused
    ("grad_of_attribute_in_build", "one"),      # build_tracer: a traced value's .grad refused
    ("metric_list_on_graph", "one"),            # guards/own_writes.py: traced values kept refused
    # (check_batch_sizes' refusals: tests/passes/test_check_batch_sizes.py, in one process)
    ("arange_row_index", "dp2"),                # check_batch_sizes: what it must not refuse
    ("lr_sweep", "zero3"),                      # the optimizer's settings between calls
    ("validation_on_the_model_between_calls", "pp2"),   # zero_access: parameters held elsewhere
}


def _cases(programs):
    return [pytest.param(p, layout, id=f"{p.name}-{layout}",
                         marks=() if (p.name, layout) in DEFAULT else pytest.mark.slow)
            for p in programs for layout in LAYOUTS]


def _check(program, layout):
    got = outcome(program, layout)
    want = program.expected(layout)
    assert got.kind == want, f"{program.name} on {layout}: {got.kind}, expected {want}: {got.detail}"
    if want == "refused":
        assert program.says in got.detail, got.detail
        assert "Fix" in got.detail or "fix" in got.detail, got.detail


@pytest.mark.parametrize("program,layout", _cases(STATE))
def test_python_state_changed_between_calls(program, layout):
    _check(program, layout)


@pytest.mark.parametrize("program,layout", _cases(OPTIMIZER))
def test_optimizer_changed_between_calls(program, layout):
    _check(program, layout)


@pytest.mark.parametrize("program,layout", _cases(MODEL))
def test_model_changed_between_calls(program, layout):
    _check(program, layout)


@pytest.mark.parametrize("program,layout", _cases(BUILD))
def test_what_build_does(program, layout):
    _check(program, layout)


@pytest.mark.parametrize("program,layout", _cases(REDUCTIONS))
def test_reductions_and_the_batch_size(program, layout):
    _check(program, layout)


@pytest.mark.parametrize("program,layout", _cases(AFTER))
def test_the_users_code_after_each_call(program, layout):
    _check(program, layout)
