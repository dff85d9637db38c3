"""Instructions are told apart by what their class says (its `runs`, `span_kind`, `joins`,
issue 36 item 3), not by an ordered isinstance chain, where a subclass test must come before
its parent's (AllGather and ClipGradNorm before AllReduce, as Runtime._run once had).

Read with `ast`, as tests/test_layers.py reads imports: outside graphc/plan/, an isinstance
test naming an instruction class that has subclasses (it catches them too, so the order of a
chain matters) is allowed only as one of the family queries listed in FAMILY_QUERIES, which
only shrinks; and an if/elif chain of two or more kind tests may test exact classes only
(`type(ins) is X`: order-free, as a table by class is), never isinstance.
"""
import ast
from pathlib import Path

from graphc.plan import instructions as I

PACKAGE = Path(__file__).resolve().parents[2] / "graphc"
CLASSES = {name: cls for name, cls in vars(I).items()
           if isinstance(cls, type) and issubclass(cls, I.Instruction)}
PARENTS = {name for name, cls in CLASSES.items()
           if any(other is not cls and issubclass(other, cls) for other in I.INSTRUCTIONS)}

# (file, the isinstance call as written): queries of a whole family on purpose, each one test
FAMILY_QUERIES = {
    ("graphc/ops/conversions.py", "isinstance(ins, AllReduce)"),   # every gradient collective's group
    ("graphc/runtime/zero.py", "isinstance(ins, AllGather)"),      # the gathers after the step, units' too
    ("graphc/tools/costs.py", "isinstance(ins, AllReduce)"),       # the largest bucket, ties and shards
}


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name != "plan":
            yield str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text())


def _class_names(node: ast.AST):
    return [getattr(e, "id", getattr(e, "attr", None)) for e in (node.elts if isinstance(node, ast.Tuple) else [node])]


def parent_tests(tree: ast.AST):
    """isinstance calls that name an instruction class with subclasses."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance" and len(n.args) == 2 \
                and set(_class_names(n.args[1])) & PARENTS:
            yield n


def kind_tests(test: ast.AST):
    """'isinstance' or 'type' for each test of an instruction class in an if's condition."""
    for n in ast.walk(test):
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance" and len(n.args) == 2 \
                and set(_class_names(n.args[1])) & set(CLASSES):
            yield "isinstance"
        if isinstance(n, ast.Compare) and isinstance(n.left, ast.Call) and getattr(n.left.func, "id", None) == "type" \
                and any(set(_class_names(c)) & set(CLASSES) for c in n.comparators):
            yield "type"


def isinstance_chains(tree: ast.AST):
    """The first line of each if/elif chain with two or more kind tests, one an isinstance."""
    inner = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and id(n) not in inner:
            chain, cur = [], n
            while isinstance(cur, ast.If):
                chain.append(cur)
                nxt = cur.orelse[0] if len(cur.orelse) == 1 and isinstance(cur.orelse[0], ast.If) else None
                if nxt is not None:
                    inner.add(id(nxt))
                cur = nxt
            tests = [k for c in chain for k in kind_tests(c.test)]
            if len(tests) >= 2 and "isinstance" in tests:
                yield chain[0].lineno


def test_no_ordered_isinstance_chain_on_instruction_kinds():
    found, chains = set(), []
    for where, tree in _sources():
        found |= {(where, ast.unparse(n)) for n in parent_tests(tree)}
        chains += [f"{where}:{line}" for line in isinstance_chains(tree)]
    assert not found - FAMILY_QUERIES, (
        "an isinstance test on an instruction class with subclasses (it catches them too): ask the "
        f"class (runs, span_kind, joins) or test the exact class: {sorted(found - FAMILY_QUERIES)}")
    assert not FAMILY_QUERIES - found, f"gone, remove from FAMILY_QUERIES: {sorted(FAMILY_QUERIES - found)}"
    assert not chains, f"if/elif chains dispatching on instruction kinds by isinstance: {chains}"


def test_a_chain_and_a_parent_test_are_found():
    chain = ast.parse("if isinstance(ins, Send):\n    a()\nelif type(ins) is Recv:\n    b()\n")
    assert list(isinstance_chains(chain)) == [1]
    by_class = ast.parse("if type(ins) is Send:\n    a()\nelif type(ins) in (Recv, AllReduce):\n    b()\n")
    assert not list(isinstance_chains(by_class))   # exact classes: order-free
    assert [ast.unparse(n) for n in parent_tests(ast.parse("ok = isinstance(ins, (AllReduce, Send))"))] == \
        ["isinstance(ins, (AllReduce, Send))"]
    assert not list(parent_tests(ast.parse("ok = isinstance(ins, ReduceScatter)")))
