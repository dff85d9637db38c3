"""GRAPHC_PLAN_CACHE (NOTE: Plan cache): a second compile of the same inputs reads its plans
from disk; an entry compiled from other inputs, or unreadable, is ignored with a warning."""
import json
import os
import sys

import pytest

from graphc import compiler, plan_cache
from graphc.executable import input_specs

sys.path.insert(0, os.path.dirname(__file__))
from layouts import Pair, SquaredError, batches, feed  # noqa: E402


def _compile(ranks=(1,), bucket_bytes=None):
    graph = SquaredError(Pair(), "pp2xdp2")
    if bucket_bytes is not None:
        graph.config.set_gradient_bucket_size(bucket_bytes)
    specs = input_specs(feed("pp2xdp2", batches(1))(0, 0))
    return compiler.compile(graph, [s.example() for s in specs], 4, [s.layout for s in specs],
                            ranks=list(ranks))


def _steps(compiled):
    return [r.name for r in compiled.history]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHC_PLAN_CACHE", str(tmp_path))
    return tmp_path


def test_a_second_compile_reads_the_plans_from_disk(cache):
    first = _compile()
    assert "lower_plan" in _steps(first) and "store_cached_plans" in _steps(first)
    assert len(os.listdir(cache)) == 1
    second = _compile()
    assert "load_cached_plans" in _steps(second)
    assert "lower_plan" not in _steps(second) and "verify_plans" not in _steps(second)
    assert str(second.plan_for(1)) == str(first.plan_for(1))
    assert second.key == first.key
    other = _compile(ranks=(2,))     # another rank's plans: an entry of its own
    assert "lower_plan" in _steps(other) and len(os.listdir(cache)) == 2


def test_an_entry_from_other_inputs_is_ignored_with_a_warning(cache):
    _compile()
    with pytest.warns(UserWarning, match=r"compiled from other inputs \(changed: settings\)"):
        changed = _compile(bucket_bytes=2 ** 20)
    assert "lower_plan" in _steps(changed)
    (entry,) = os.listdir(cache)     # replaced: the next compile of the same inputs reads it
    assert "load_cached_plans" in _steps(_compile(bucket_bytes=2 ** 20))


def test_plans_from_other_graphc_sources_are_not_used(cache, monkeypatch):
    _compile()
    monkeypatch.setattr(plan_cache, "graphc_sources", lambda: "graphc 0.1.0 sources edited")
    with pytest.warns(UserWarning, match=r"changed: graphc and torch"):
        assert "lower_plan" in _steps(_compile())


@pytest.mark.parametrize("damage", ["truncated", "other ranks"])
def test_an_unreadable_entry_is_ignored_with_a_warning(cache, damage):
    first = _compile()
    (name,) = os.listdir(cache)
    path = cache / name
    if damage == "truncated":
        path.write_text(path.read_text()[:100])
    else:
        entry = json.loads(path.read_text())
        entry["plans"][0]["rank"] = 3
        path.write_text(json.dumps(entry))
    with pytest.warns(UserWarning, match="unreadable"):
        again = _compile()
    assert "lower_plan" in _steps(again) and str(again.plan_for(1)) == str(first.plan_for(1))


def test_off_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("GRAPHC_PLAN_CACHE", raising=False)
    assert "load_cached_plans" not in _steps(_compile())


def test_a_whole_worlds_plans_are_not_kept(cache):
    graph = SquaredError(Pair(), "pp2xdp2")
    specs = input_specs(feed("pp2xdp2", batches(1))(0, 0))
    whole = compiler.compile(graph, [s.example() for s in specs], 4, [s.layout for s in specs])
    assert "store_cached_plans" not in _steps(whole) and os.listdir(cache) == []
