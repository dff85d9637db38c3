"""The tools import each other without a circle (issue 20): a CostModel is the record that
costs.py, transport_costs.py and the simulator share, so it has its own module below them
(graphc/tools/cost_model.py) and costs.py <-> transport_costs.py is gone."""
import ast
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "graphc" / "tools"


def tool_imports(path: Path):
    """The tools modules `path` imports (`from .x import ...`; in a sub-package such as
    simulate/, `from ..x import ...`), at any depth of the file."""
    found = set()
    level = len(path.relative_to(TOOLS).parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == level:
            names = [node.module] if node.module else [a.name for a in node.names]
            found |= {n.split(".")[0] for n in names if (TOOLS / f"{n.split('.')[0]}.py").exists()
                      or (TOOLS / n.split(".")[0]).is_dir()}
    return found


def tools_graph():
    """{module: the tools modules it imports} over graphc/tools' modules (a sub-package
    counts as one module: its files together)."""
    graph = {}
    for path in sorted(TOOLS.rglob("*.py")):
        name = path.relative_to(TOOLS).with_suffix("").parts[0]
        graph.setdefault(name, set()).update(tool_imports(path) - {name})
    return graph


def a_cycle(graph):
    """One import circle as a list of modules, or None (a depth-first walk)."""
    done, path = set(), []

    def walk(name):
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for dep in sorted(graph.get(name, ())):
            found = walk(dep)
            if found:
                return found
        path.pop()
        done.add(name)
        return None

    return next((c for c in map(walk, sorted(graph)) if c), None)


def test_a_cycle_is_found_and_named():
    assert a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert a_cycle({"a": {"b"}, "b": set()}) is None


def test_tools_import_graph_has_no_cycle():
    graph = tools_graph()
    assert "transport_costs" in graph["costs"] and "cost_model" in graph["transport_costs"]
    assert "costs" not in graph["transport_costs"] and "cost_model" in graph["simulate"]
    assert a_cycle(graph) is None, f"tools modules import each other in a circle: {a_cycle(graph)}"


def test_cost_model_is_one_record_with_one_home():
    from graphc.tools import cost_model, costs, transport_costs
    assert costs.CostModel is cost_model.CostModel is transport_costs.CostModel
    assert "class CostModel" not in (TOOLS / "costs.py").read_text()
