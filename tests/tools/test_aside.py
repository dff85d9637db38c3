"""Aside (NOTE: Charts drawn aside): a function run in a forked child, its failure reported."""
import os
import threading

import pytest

from graphc.errors import GraphcError
from graphc.tools.aside import Aside


def _write_pid(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def _fail():
    raise ValueError("a chart that cannot be drawn")


def test_a_function_runs_in_a_child_where_this_process_has_one_thread(tmp_path):
    path = tmp_path / "pid"
    aside = Aside()
    alone = threading.active_count() == 1 and hasattr(os, "fork")
    aside.run("the pid", _write_pid, path)
    aside.wait()
    assert (int(path.read_text()) != os.getpid()) == alone   # forked only where it is safe
    assert aside.children == []


def test_a_failing_child_is_a_graphc_error_naming_it(tmp_path):
    aside = Aside()
    if not aside.forking or threading.active_count() > 1:
        with pytest.raises(ValueError):        # drawn here: the error is the function's own
            aside.run("the simulated chart", _fail)
        return
    aside.run("the simulated chart", _fail)
    with pytest.raises(GraphcError, match="drawing the simulated chart failed.*--no-chart"):
        aside.wait()


def test_without_forking_it_runs_here(tmp_path):
    path = tmp_path / "pid"
    Aside(forking=False).run("the pid", _write_pid, path)
    assert int(path.read_text()) == os.getpid()
