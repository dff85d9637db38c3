"""Every test that spawns ranks is marked `world`, and no other test is.

`pytest -m "not world"` is then the fast inner loop (README: Tests): one process, no gloo
worlds. Read with `ast`, as tests/test_layers.py reads imports, so no test module runs.

A test spawns ranks when it, a fixture it takes, or a function it reaches (in its own file
or imported from another test file) calls one of LAUNCHERS or starts torchrun on a command
line. helpers.run_world and the reliability launchers also refuse to start outside a
`world` test at run time (See NOTE: World marker in tests/conftest.py), which catches what
this reading cannot see.
"""
import ast
from pathlib import Path
from typing import Dict, Set

TESTS = Path(__file__).resolve().parent

# the functions that start ranks: helpers.run_world, reliability/launch.py's torchrun and
# bare_world, and graphc's own transport measurement (a gloo pair, tools/transport_costs.py)
LAUNCHERS = {"run_world", "torchrun", "bare_world", "measure_transport"}
TORCHRUN = "torch.distributed.run"   # in a command line given to subprocess


def _functions(tree: ast.Module) -> Dict[str, ast.AST]:
    """Module-level functions and class methods by name (methods as Class.name and name)."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = item
                    out.setdefault(item.name, item)
    return out


def _launches(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id in LAUNCHERS) or \
                    (isinstance(f, ast.Attribute) and f.attr in LAUNCHERS):
                return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and TORCHRUN in node.value:
            return True
    return False


def _names(fn: ast.AST) -> Set[str]:
    """Every name `fn` reads (calls, or passes on as a value) and its arguments' names."""
    used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        used |= {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    return used


def _imported(tree: ast.Module) -> Dict[str, str]:
    """{local name: 'module.name'} for `from <test module> import name`."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def spawning(files) -> Set[str]:
    """'module.function' for every function in `files` that spawns ranks, directly or not.
    A fixture counts by its name, as the tests that take it name it."""
    trees = {p.stem: ast.parse(p.read_text()) for p in files if p.name != "conftest.py"}
    fixtures = {}   # a conftest.py's functions, reachable from every module by name
    for p in files:
        if p.name == "conftest.py":
            fixtures.update({f"conftest.{n}": fn for n, fn in _functions(ast.parse(p.read_text())).items()})
    funcs = {f"{m}.{name}": fn for m, tree in trees.items() for name, fn in _functions(tree).items()}
    funcs.update(fixtures)
    reads = {}
    for m, tree in trees.items():
        local, imported = _functions(tree), _imported(tree)
        for name, fn in local.items():
            reads[f"{m}.{name}"] = {f"{m}.{n}" if n in local else imported.get(n, f"conftest.{n}")
                                    for n in _names(fn)}
    for name, fn in fixtures.items():
        reads[name] = {f"conftest.{n}" for n in _names(fn)}
    found = {name for name, fn in funcs.items() if _launches(fn)}
    while True:
        more = {name for name, used in reads.items() if used & found} - found
        if not more:
            return found
        found |= more


def _is_world_mark(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "world" and
               isinstance(n.value, ast.Attribute) and n.value.attr == "mark" for n in ast.walk(node))


def _tests(tree: ast.Module):
    """(name, function, marked world) for every test function of a module."""
    module_mark = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                                        for t in n.targets) and _is_world_mark(n.value)
                      for n in tree.body)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            yield node.name, node, module_mark or any(map(_is_world_mark, node.decorator_list))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            class_mark = module_mark or any(map(_is_world_mark, node.decorator_list))
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                    yield (f"{node.name}.{item.name}", item,
                           class_mark or any(map(_is_world_mark, item.decorator_list)))


def misplaced_marks(files, root: Path = TESTS.parent):
    """'file:line: test ...' for each test whose world mark disagrees with what it does."""
    spawns = spawning(files)
    out = []
    for path in files:
        if not path.name.startswith("test_"):
            continue
        for name, fn, marked in _tests(ast.parse(path.read_text())):
            does = f"{path.stem}.{name}" in spawns
            if does != marked:
                where = f"{path.relative_to(root)}:{fn.lineno}: {name}"
                out.append(f"{where} spawns ranks but is not marked world" if does else
                           f"{where} is marked world but spawns no ranks")
    return out


def test_every_test_that_spawns_ranks_is_marked_world():
    bad = misplaced_marks(sorted(TESTS.rglob("*.py")))
    assert not bad, ('add or remove @pytest.mark.world (setup.cfg markers; README: Tests):\n'
                     + "\n".join(bad))


def _check(tmp_path, sources: Dict[str, str]):
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    return misplaced_marks(sorted(tmp_path.glob("*.py")), tmp_path)


def test_a_missing_mark_is_found_through_helpers_fixtures_and_imports(tmp_path):
    bad = _check(tmp_path, {
        "test_a.py": ("import pytest\nfrom helpers import run_world\n"
                      "def _worker(rank, world):\n    pass\n"
                      "def train():\n    return run_world(_worker, 2)\n"
                      "@pytest.fixture\ndef trained():\n    return train()\n"
                      "def test_direct():\n    train()\n"
                      "def test_fixture(trained):\n    pass\n"
                      "def test_alone():\n    pass\n"
                      "@pytest.mark.world\ndef test_marked():\n    train()\n"),
        "test_b.py": ("from test_a import train\n"
                      "def test_imported():\n    train()\n"
                      "def test_torchrun():\n    cmd = ['python', '-m', '" + TORCHRUN + "']\n")})
    assert [line.split(": ", 1)[1] for line in bad] == [
        "test_direct spawns ranks but is not marked world",
        "test_fixture spawns ranks but is not marked world",
        "test_imported spawns ranks but is not marked world",
        "test_torchrun spawns ranks but is not marked world"]


def test_a_mark_on_a_test_that_spawns_nothing_is_found(tmp_path):
    bad = _check(tmp_path, {"test_c.py": ("import pytest\npytestmark = pytest.mark.world\n"
                                          "def test_nothing():\n    pass\n")})
    assert len(bad) == 1 and bad[0].endswith("test_nothing is marked world but spawns no ranks")
