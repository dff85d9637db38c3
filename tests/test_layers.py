"""Imports point down the layers (docs/design.md: Layers), checked by reading every module.

    API -> compiler -> passes -> ops -> plan,   runtime -> ops,   all of them -> value types

Value types (placement, errors, meta, sbp/, batch_rows/, ...) import nothing above them, passes
never import the runtime, the functions stage programs call (graphc/ops/) import neither,
the plan IR imports none of them (it is data), and nothing the API needs imports graphc/tools.
Within the API layer the modules are ordered (API_ORDER): an import up that order, the
start of any circle among them, is a named failure. Each module's
imports are read with `ast` (function-level imports included), so no module is executed.
Plan mode finds the tools' writer by name, not by an import (See NOTE: Plan-mode writer,
graphc/modes.py): test_plan_mode_writer_is_the_tools_write_all keeps that name true.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "graphc"

# The layer of each module, by dotted name (the longest matching prefix wins).
LAYER_OF = {
    "graphc.errors": "value", "graphc.meta": "value", "graphc.placement": "value",
    "graphc.log": "value", "graphc.env": "value",
    "graphc.fx_graphs": "value",  # fx graph operations passes and the runtime share
    "graphc.modes": "value", "graphc.guards": "value",  # the plan and check modes' settings; tools write the files
    "graphc.world": "value",  # the world a rank communicates in (NOTE: Worlds)
    "graphc.sbp": "value", "graphc.batch_rows": "value",  # the batch rows micro-batching splits
    "graphc.plan": "plan",
    # the functions stage programs call (NOTE: Stage-program names, graphc/ops/__init__.py)
    "graphc.ops": "ops",
    "graphc.runtime": "runtime",
    "graphc.passes": "passes",
    "graphc.compiler": "compiler",
    "graphc.compile_values": "compiler",  # what compile() reads (CompileSpec) and produces (CompiledGraph)
    "graphc.history": "compiler",  # the compilation history's records and their text
    "graphc.plan_cache": "compiler",  # compile's plans on disk, keyed by its inputs (NOTE: Plan cache)
    "graphc": "api",      # graph.py, config.py, global_tensor.py, block.py, executable_cache.py, ...
    # one compiled specialisation (compile, start, check, call): API, built from values; it
    # reaches down to the compiler, runtime and plan, never up to the user's Graph class
    "graphc.executable": "api",
    "graphc.checking": "api", "graphc.testing": "api",  # the Graph's checks of a step, optimizer
    "graphc.tools": "tools",
    # a layout as a value and its CompileSpec (config.load_layout) below the API; the search
    # (compile, simulate, memory model) above the tools, run by graphc plan --auto
    "graphc.auto.layout": "api", "graphc.auto.inputs": "api", "graphc.auto": "entry",
    "graphc.tools.plan_cli": "entry",   # `graphc plan`'s command line (it installs --auto's search)
    "graphc.cli": "entry", "graphc.__main__": "entry",
}

# What each layer may import. Tools read plans beside the API: they may use everything
# below it, and the API may not need them. The command line sits on top.
MAY_IMPORT = {
    "value": {"value"},
    "plan": {"value", "plan"},
    "ops": {"value", "plan", "ops"},
    "runtime": {"value", "plan", "ops", "runtime"},
    "passes": {"value", "plan", "ops", "passes"},
    "compiler": {"value", "plan", "ops", "passes", "compiler"},
    "api": {"value", "plan", "ops", "runtime", "passes", "compiler", "api"},
    "tools": {"value", "plan", "ops", "runtime", "passes", "compiler", "tools"},
    "entry": {"value", "plan", "ops", "runtime", "passes", "compiler", "api", "tools", "entry"},
}

# The API layer's modules in order, lowest first (issue 36): each may import only those
# before it (and the layers below), so a circle among them contains an upward import and
# fails by name, as block.py -> config.py -> global_tensor.py -> block.py did.
API_ORDER = [
    "graphc.auto.layout",     # a whole parallel layout as a value and the CompileSpec it gives
    "graphc.config",          # the Graph's and each module's settings (values, no compiler)
    "graphc.amp",             # GradScaler checks
    "graphc.block",           # ModuleBlock: a module wrapped with its config
    "graphc.global_tensor",   # to_global on tensors and modules; the declared layouts
    "graphc.checkpoint.dcp",          # checkpoint state in DCP form
    "graphc.checkpoint.dcp_load",     # and loaded back from it
    "graphc.checkpoint.files",        # graphc.save / graphc.load
    "graphc.checkpoint.graph_state",  # a graph's parameters and optimizer state across plans
    "graphc.checkpoint",              # the room's public names
    "graphc.build_root",      # the traced root module
    "graphc.checking.optimizer",   # the optimizer settings a step supports
    "graphc.checking.first_step",  # the first step against eager (the eager twin)
    "graphc.checking.every_step",  # every step against eager (check mode)
    "graphc.checking",             # the room
    "graphc.executable",      # one compiled specialisation: compile, start, call
    "graphc.testing",         # local worlds for tests and `graphc check`
    "graphc.graph_spec",      # what the compiler reads of a Graph (compile_spec)
    "graphc.executable_cache",  # a Graph's executables: looked up, or compiled, agreed and started
    "graphc.auto.inputs",     # a call's inputs under a loaded layout: this rank's rows
    "graphc.graph",           # the user's Graph
    "graphc",                 # the package's public names
]

# Wrong-way imports that remain, each with what would remove it (issue 13). Keys are
# (importing module, imported module); a listed import that is gone fails the test, so the
# list only shrinks. It is empty: plan mode's setting moved below the API
# (graphc/modes.py) and the measured trace into the runtime (graphc/runtime/trace.py).
ALLOWED: dict = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def graphc_imports(module: str, source: str, is_package: bool = False):
    """(line, imported module) for every import of a graphc module in `source`. For
    `from X import name`, a name that is itself a graphc module (`from ..tools import
    plan_mode`) counts as that module."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    found = []  # in order, each (line, module) once
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "graphc"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "graphc":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append((node.lineno, sub if _is_module(sub) else target))
    return list(dict.fromkeys(found))


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def wrong_way(module: str, source: str, where: str, is_package: bool = False):
    """'file:line: a imports b (layer x may not import layer y)' for each wrong-way import,
    and 'a imports b (API order: b comes after a)' for an upward import in the API layer."""
    out = []
    for line, target in graphc_imports(module, source, is_package):
        if target == "graphc":   # `from graphc import __version__` and the like
            continue
        if layer(target) not in MAY_IMPORT[layer(module)]:
            out.append((f"{where}:{line}: {module} imports {target} ({layer(module)} may not "
                        f"import {layer(target)})", (module, target)))
        elif _api_upward(module, target):
            out.append((f"{where}:{line}: {module} imports {target} (API order: "
                        f"{api_module(target)} comes after {api_module(module)}; test_layers.API_ORDER)",
                        (module, target)))
    return out


def api_module(module: str):
    """The API_ORDER entry `module` belongs to (itself, or the package it is in); None for
    an API module without a place (test_api_order_names_every_api_module_once names it)."""
    within = [m for m in API_ORDER if module == m or (m != "graphc" and module.startswith(m + "."))]
    return max(within, key=len, default=None)   # "graphc" is the package module alone


def _api_upward(module: str, target: str) -> bool:
    if layer(module) != "api" or layer(target) != "api":
        return False
    here, there = api_module(module), api_module(target)
    if here is None or there is None or here == there:
        return False
    return API_ORDER.index(there) > API_ORDER.index(here)


def all_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, module_name(path)


def test_every_module_has_a_layer():
    for _, module in all_modules():
        assert layer(module) in MAY_IMPORT, module


def test_imports_point_down_the_layers():
    found = []
    for path, module in all_modules():
        found += wrong_way(module, path.read_text(), str(path.relative_to(PACKAGE.parent)),
                           path.name == "__init__.py")
    bad = [text for text, key in found if key not in ALLOWED]
    assert not bad, "imports against the layers (docs/design.md: Layers):\n" + "\n".join(bad)
    gone = set(ALLOWED) - {key for _, key in found}
    assert not gone, f"no longer imported, remove from ALLOWED: {sorted(gone)}"


@pytest.mark.parametrize("module, source, culprit", [
    ("graphc.passes.insert_boxing", "from ..runtime.collectives import GradSync\n",
     "graphc.runtime.collectives"),
    ("graphc.plan.verify", "def f():\n    from ..passes import lower_plan\n",
     "graphc.passes.lower_plan"),
    ("graphc.sbp.cost", "import graphc.plan.instructions\n", "graphc.plan.instructions"),
    ("graphc.compiler", "from .tools.summary import summary\n", "graphc.tools.summary"),
    ("graphc.graph", "from .tools import dump\n", "graphc.tools.dump"),
    ("graphc.graph", "from .tools.trace import Tracer\n", "graphc.tools.trace"),
    ("graphc.modes", "from .tools.dump import write_all\n", "graphc.tools.dump"),
    ("graphc.runtime.trace", "from ..tools.simulate import Span\n", "graphc.tools.simulate"),
    ("graphc.runtime.actors", "from ..passes.lower_plan import lower_plan\n",
     "graphc.passes.lower_plan"),
    ("graphc.tools.dump", "from ..graph import Graph\n", "graphc.graph"),
    ("graphc.plan.verify", "from ..ops.conversions import box\n", "graphc.ops.conversions"),
    ("graphc.plan.program", "from ..ops import random_ops\n", "graphc.ops.random_ops"),
    ("graphc.ops.conversions", "from ..runtime.collectives import GradSync\n",
     "graphc.runtime.collectives"),
    ("graphc.ops.loss", "from ..passes.feed_whole_batch import feed_whole_batch\n",
     "graphc.passes.feed_whole_batch"),
])
def test_a_wrong_way_import_is_reported_with_file_and_line(module, source, culprit):
    found = wrong_way(module, source, "synthetic.py")
    assert [key for _, key in found] == [(module, culprit)]
    assert found[0][0].startswith("synthetic.py:") and culprit in found[0][0]
    assert (module, culprit) not in ALLOWED   # so the whole-package test would fail on it


def test_api_order_names_every_api_module_once():
    api = {module for _, module in all_modules() if layer(module) == "api"}
    unplaced = sorted(m for m in api if api_module(m) is None)
    assert unplaced == [], f"give each a place in test_layers.API_ORDER (or a layer in LAYER_OF): {unplaced}"
    assert len(API_ORDER) == len(set(API_ORDER)) and set(API_ORDER) <= api


@pytest.mark.parametrize("module, source, culprit", [
    ("graphc.config", "def compile_spec(graph):\n    from .global_tensor import declared_layout\n",
     "graphc.global_tensor"),        # the circle block -> config -> global_tensor -> block
    ("graphc.block", "from .graph import Graph\n", "graphc.graph"),
    ("graphc.checking.first_step", "from .every_step import StepChecker\n", "graphc.checking.every_step"),
])
def test_an_upward_import_in_the_api_layer_is_named(module, source, culprit):
    found = wrong_way(module, source, "synthetic.py")
    assert [key for _, key in found] == [(module, culprit)]
    assert "API order" in found[0][0] and found[0][0].startswith("synthetic.py:")


def test_right_way_imports_pass():
    assert not wrong_way("graphc.passes.insert_boxing", "from ..ops.conversions import box\n", "x.py")
    assert not wrong_way("graphc.runtime.executor", "from ..ops.random_ops import drawing\n", "x.py")
    assert not wrong_way("graphc.ops.conversions", "from ..plan.instructions import AllReduce\n", "x.py")
    assert not wrong_way("graphc.runtime.actors", "from ..plan.plan import ExecutionPlan\n", "x.py")
    assert not wrong_way("graphc.graph", "from .compiler import compile\n", "x.py")
    assert not wrong_way("graphc.graph", "from . import modes\nfrom .runtime.trace import Tracer\n",
                         "x.py")
    assert not wrong_way("graphc.tools.plan_cli", "from ..modes import plan_mode\n", "x.py")


# API modules that hold no Graph: they must not import the user's class or its config, so
# that they are built from values (issue 20: an Executable is built from an InputSpec and a
# CompileSpec, never from the Graph).
BUILT_FROM_VALUES = {"graphc.executable", "graphc.checking.first_step", "graphc.checking.optimizer"}
GRAPH_SIDE = {"graphc.graph", "graphc.config", "graphc.graph_spec"}


def graph_side_imports(module: str, source: str, where: str):
    return [f"{where}:{line}: {module} imports {target} (built from values, never from the Graph)"
            for line, target in graphc_imports(module, source)
            if any(target == side or target.startswith(side + ".") for side in GRAPH_SIDE)]


def test_executable_and_checks_are_built_from_values():
    found = []
    for path, module in all_modules():
        if module in BUILT_FROM_VALUES:
            found += graph_side_imports(module, path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module, source, culprit", [
    ("graphc.compiler", "from .executable import Executable\n", "graphc.executable"),
    ("graphc.runtime.actors", "from ..executable import InputSpec\n", "graphc.executable"),
    ("graphc.passes.lower_plan", "from ..checking.first_step import check_step\n", "graphc.checking.first_step"),
    ("graphc.plan.plan", "from ..checking.optimizer import check_optimizer\n", "graphc.checking.optimizer"),
    ("graphc.executable", "from .tools.dump import write_all\n", "graphc.tools.dump"),
])
def test_executable_sits_in_the_api_layer(module, source, culprit):
    found = wrong_way(module, source, "synthetic.py")
    assert [key for _, key in found] == [(module, culprit)]
    assert (module, culprit) not in ALLOWED


def test_executable_reaches_down_to_compiler_runtime_and_plan_only():
    ok = "from . import compiler\nfrom .runtime.actors import Runtime\nfrom .ops.conversions import box\n" \
         "from .meta import META_SBP\nfrom .global_tensor import GlobalTensor\n"
    assert not wrong_way("graphc.executable", ok, "x.py")
    assert not graph_side_imports("graphc.executable", ok, "x.py")
    assert graph_side_imports("graphc.executable", "from .graph import Graph\n", "x.py")
    assert graph_side_imports("graphc.executable", "from .config.graph_config import GraphConfig\n", "x.py")
    assert graph_side_imports("graphc.checking.first_step", "def f():\n    from ..graph_spec import compile_spec\n",
                              "x.py")


def test_plan_mode_writer_is_the_tools_write_all():
    """The one reach from the API's plan mode into the tools is by name (See NOTE: Plan-mode
    writer): the name must keep resolving to the function that writes a graph's files."""
    from graphc import modes
    from graphc.tools.dump import write_all
    assert modes.named_writer() is write_all


def test_run_time_searcher_is_the_searchs_run_time_layout():
    """enable_auto_parallel reaches the search (above the API) by name, as plan mode reaches
    its writer (See NOTE: Run-time search): the name must keep resolving."""
    from graphc.auto.layout import named_searcher
    from graphc.auto.search import run_time_layout
    assert named_searcher() is run_time_layout
