"""The docs cannot drift from the code: every `NOTE:` cited is defined (in the file a citation
names, if it names one), every code name and file the docs cite exists, README's sweep counts
are the sweep's, README's snippets parse and the graphc names they use resolve after `import
graphc` alone. Read as text (and one subprocess for
the names), so nothing here runs a model.
"""
import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("graphc", "tests", "benchmarks", "examples") for p in sorted((ROOT / d).rglob("*.py"))
           if p != Path(__file__).resolve()]   # this file writes NOTE: as a pattern
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

# -- NOTE blocks -------------------------------------------------------------------------
# A definition is a line that starts with `NOTE: <title>` (after a comment's `#`, a
# docstring's quotes or a heading's `#`s); a citation is any other `NOTE: <title>`, in
# code or docs, and may run across a line break. Titles end at ". ", " (", ": " , ",",
# ";", "`" or ")".
DEFINITION = re.compile(r'^[\s#>*"]*NOTE:\s*(.+)$')
TITLE_END = re.compile(r"\.\s|\.$|\s\(|:\s|,|;|`|\)")
CITED_END = re.compile(r"\.\s|\s\(|,|;|`|\)|\sin\s")


def note_definitions():
    titles = {}
    for path in SOURCES + DOCS:
        for line in path.read_text().splitlines():
            m = DEFINITION.match(line)
            if m:
                titles.setdefault(TITLE_END.split(m.group(1).strip())[0].strip(), []).append(path)
    return titles


def _one_line(text: str) -> str:
    """Text with line breaks (and a comment's `#` after them) as single spaces."""
    return re.sub(r"\s*\n[\s#]*", " ", text)


def unresolved_citations(titles):
    for path in SOURCES + DOCS:
        text = _one_line(path.read_text())
        for m in re.finditer(r"NOTE:\s*", text):
            rest = text[m.end():m.end() + 120]
            cited = CITED_END.split(rest)[0].strip()
            if not any(rest.startswith(t) or t.startswith(cited) for t in titles):
                yield f"{_shown(path)}: NOTE: {rest[:60]}"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


# a file named right after a cited title says where the NOTE is defined: "NOTE: Guards in
# graphc/guards/__init__.py", "(NOTE: ZeRO, runtime/zero.py)"
NAMED_HOME = re.compile(r"\s*(?:in|,)\s+`?((?:\w+/)*\w+\.(?:py|md))\b")


def misplaced_citations(titles, paths):
    """Citations whose named file is not one that defines the NOTE (a split moved it)."""
    by_length = sorted(titles, key=len, reverse=True)
    for path in paths:
        text = _one_line(path.read_text())
        for m in re.finditer(r"NOTE:\s*", text):
            rest = text[m.end():m.end() + 200]
            title = next((t for t in by_length if rest.startswith(t)), None)
            named = NAMED_HOME.match(rest[len(title):]) if title else None
            if named and not any(str(home).endswith(named.group(1)) for home in titles[title]):
                homes = ", ".join(_shown(home) for home in titles[title])
                yield f"{_shown(path)}: NOTE: {title} is cited in {named.group(1)}, defined in {homes}"


def test_every_cited_note_has_a_definition():
    titles = note_definitions()
    assert len(titles) >= 60
    assert {"Watchdog cost", "Schedule registry", "SBP rule check", "Worlds"} <= set(titles)
    assert list(unresolved_citations(titles)) == []


def test_a_note_cited_with_a_file_is_defined_in_that_file():
    assert list(misplaced_citations(note_definitions(), SOURCES + DOCS)) == []


def test_a_note_cited_in_the_wrong_file_is_found(tmp_path):
    home, doc = tmp_path / "zero.py", tmp_path / "design.md"
    home.write_text('"""\nNOTE: ZeRO stage 3\nAt stage 3 ...\n"""\n')
    doc.write_text("freed between uses (NOTE: ZeRO stage 3 in runtime/actors.py), or (See\n"
                   "NOTE: ZeRO stage 3, `zero.py`) and (NOTE: ZeRO stage 3) alone\n")
    titles = {"ZeRO stage 3": [home]}
    assert list(misplaced_citations(titles, [doc])) == [
        "design.md: NOTE: ZeRO stage 3 is cited in runtime/actors.py, defined in zero.py"]


def test_a_note_cited_without_definition_is_found(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("See NOTE: Nowhere defined, and NOTE: Worlds.\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", DOCS + [doc])
    found = list(unresolved_citations(note_definitions()))
    assert [f.strip() for f in found] == ["doc.md: NOTE: Nowhere defined, and NOTE: Worlds."]


# -- code names --------------------------------------------------------------------------
FILE_ENDINGS = {"py", "md", "json", "cfg", "toml", "txt", "csv", "png", "svg", "html", "pt"}


def _defines(text: str, name: str) -> bool:
    return bool(re.search(rf"\b(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|self\.{name}\s*[:=]",
                          text, re.M))


def missing_code_names(docs):
    """`Class.attr`, `module.name`, `path/file.py: name` the docs cite that the code lacks.
    A dotted name counts when it starts with graphc, one of its module names or a class the
    code defines (`model.eval()` or `torch.cat` are not ours to check)."""
    sources = {p: p.read_text() for p in SOURCES}
    ours = {"graphc"} | {p.stem for p in (ROOT / "graphc").glob("*.py")} | \
        {p.name for p in (ROOT / "graphc").iterdir() if p.is_dir()}   # its top level
    classes = {}
    for p, text in sources.items():
        for c in re.findall(r"^class\s+(\w+)", text, re.M):
            classes.setdefault(c, []).append(text)
    everything = "\n".join(sources.values())
    for doc in docs:
        for name in sorted(set(re.findall(r"`([^`\n]+)`", doc.read_text()))):
            dotted = re.fullmatch(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(\(\))?", name)
            at_file = re.fullmatch(r"([\w/]+\.py):\s*(\w+)", name)
            if dotted:
                parts = dotted.group(1).split(".")
                if (parts[0] not in ours and parts[0] not in classes) or parts[-1] in FILE_ENDINGS:
                    continue
                homes = classes.get(parts[0], [everything]) if len(parts) == 2 else [everything]
                if not any(_defines(text, parts[-1]) for text in homes):
                    yield f"{doc.name}: {name}"
            elif at_file:
                homes = [t for p, t in sources.items() if str(p).endswith(at_file.group(1))]
                if not any(_defines(text, at_file.group(2)) for text in homes):
                    yield f"{doc.name}: {name}"


# a path the docs cite (graphc/plan/verify.py, runtime/zero.py, tests/sbp/rule_check.py), read
# from the repository root or from graphc/ or tests/; what graphc writes (DIR/, plans/) is not one
CITED_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)+[\w-]+\.(?:py|md))\b")
WRITTEN = ("DIR/", "plans/")


def missing_paths(docs):
    """Files the docs cite that the repository lacks (a file split or renamed since)."""
    for doc in docs:
        for path in sorted(set(CITED_PATH.findall(doc.read_text()))):
            if not path.startswith(WRITTEN) and not any(
                    (ROOT / base / path).is_file() for base in ("", "graphc", "tests")):
                yield f"{doc.name}: {path}"


def test_files_the_docs_cite_exist(tmp_path):
    assert list(missing_paths(DOCS)) == []
    doc = tmp_path / "design.md"
    doc.write_text("the walk (`plan/verify_deadlock.py: check_acyclic`), once in plan/verify.py's "
                   "_check_acyclic and graphc/runtime/world.py, writes DIR/auto.md\n")
    assert list(missing_paths([doc])) == ["design.md: graphc/runtime/world.py"]


# bare names the docs cite that are not graphc's code, with what they are
NOT_GRAPHC = {"tensorboard_trace_handler": "torch.profiler's",
              "G_m_modules_a_parameters_weight_": "a name fx generates for a parameter read",
              "_tensor_constantN": "fx's constants, N a number"}


def missing_bare_names(docs):
    """`snake_case` or `CamelCase` names the docs cite that no source file contains."""
    words = set(re.findall(r"\b\w+\b", "\n".join(p.read_text() for p in SOURCES)))
    for doc in docs:
        for name in sorted(set(re.findall(r"`([A-Za-z_]\w*)(?:\(\))?`", doc.read_text()))):
            code_like = "_" in name or re.match(r"[A-Z][a-z]+[A-Z]", name)
            if code_like and name not in words and name not in NOT_GRAPHC:
                yield f"{doc.name}: {name}"


def test_code_names_the_docs_cite_exist():
    assert list(missing_code_names(DOCS)) == []
    assert list(missing_bare_names(DOCS)) == []


def test_a_gone_method_is_found(tmp_path):
    doc = tmp_path / "design.md"
    doc.write_text("compiles on one path (`Graph._trace_and_compile`), see "
                   "`graphc/tools/costs.py: NOT_THERE` and `Graph._compile_spec()`\n")
    assert list(missing_code_names([doc])) == ["design.md: Graph._trace_and_compile",
                                                "design.md: graphc/tools/costs.py: NOT_THERE"]
    doc.write_text("the one path (`_trace_and_compile`) and `compile_spec`\n")
    assert list(missing_bare_names([doc])) == ["design.md: _trace_and_compile"]


# -- README ------------------------------------------------------------------------------
README = (ROOT / "README.md").read_text()


def readme_snippets():
    return [textwrap.dedent(m.group(1)) for m in re.finditer(r"```python\n(.*?)```", README, re.S)]


def test_readme_sweep_counts_are_the_sweeps():
    sys.path.insert(0, str(ROOT / "tests" / "local"))
    import test_sweep
    n, default, rest = len(test_sweep.CONFIGS), len(test_sweep.DEFAULT), len(test_sweep.REST)
    assert f"(tests/local/sweep.py): {n} configurations" in README
    assert f"CI runs {default} of them" in README and f"`-m slow`\nruns the other {rest}" in README
    assert f"{default} sweep configurations" in README


def test_readme_snippets_parse():
    snippets = readme_snippets()
    assert len(snippets) >= 5
    for s in snippets:
        ast.parse(s)


def test_readme_snippets_graphc_names_resolve_after_import_graphc():
    """`graphc.testing.local_world` in a snippet must work after `import graphc` alone."""
    names = sorted({m for s in readme_snippets() for m in re.findall(r"\bgraphc(?:\.\w+)+", s)})
    assert "graphc.testing.local_world" in names
    program = "import graphc\n" + "".join(f"{n}\n" for n in names)
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("phrase", [" soak tests", "one-process tests:", "`world` tests:"])
def test_readme_states_no_collection_counts(phrase):
    """Counts of collected tests drift with every test added: the table states what runs
    and dated timings, not how many tests there are."""
    assert not re.search(rf"\b\d+{re.escape(phrase)}", README)
