"""Checks that splitting a module was a pure move: every top-level statement of the old file
(read from git) is in one of the new files unchanged by ast, a class split over files keeps
each member unchanged, and every comment line of the old file is still in the new files.

    python .ci/check_moves.py REV:OLD_PATH NEW_FILE... [old_name=new_name ...] ["old=>new" ...]

`old_name=new_name` is a name made public (or renamed) on the way, applied to whole words of
the old text; "old=>new" a literal change of code, which the report then states. Imports and
module docstrings are not compared (a split rewrites them). Exit status 1 on any difference.

Example (issue 36's split of plan/verify.py):
    python .ci/check_moves.py HEAD~1:graphc/plan/verify.py graphc/plan/verify*.py _fail=fail
"""
import ast
import re
import subprocess
import sys
from collections import Counter
from typing import Dict, List


def statements(source: str) -> Counter:
    """The unparsed top-level statements of `source` but imports and docstrings."""
    out: Counter = Counter()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        out[ast.unparse(node)] += 1
    return out


def class_members(source: str) -> List[str]:
    """The unparsed body statements of every class in `source`."""
    return [ast.unparse(member) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) for member in node.body]


def comments(source: str) -> List[str]:
    return [line.strip() for line in source.splitlines() if line.strip().startswith("#")]


def main(argv: List[str]) -> int:
    literal = [a.split("=>", 1) for a in argv if "=>" in a]
    renames = [a.split("=", 1) for a in argv if "=>" not in a and "=" in a]
    files = [a for a in argv if "=" not in a]

    def changed(text: str) -> str:
        for old, new in renames:
            text = re.sub(rf"\b{re.escape(old)}\b", new, text)
        for old, new in literal:
            text = text.replace(old, new)
        return text

    old_source = subprocess.check_output(["git", "show", files[0]], text=True)
    new_sources: Dict[str, str] = {f: open(f).read() for f in files[1:]}
    new_statements: Counter = Counter()
    new_members: Counter = Counter()
    new_comments: Counter = Counter()
    for source in new_sources.values():
        new_statements.update(statements(source))
        new_members.update(class_members(source))
        new_comments.update(changed(c) for c in comments(source))
    old = statements(old_source)
    missing = [s for s in old if new_statements[changed(s)] < 1]
    for s in list(missing):
        if s.startswith("class "):   # split over files: is every member there unchanged?
            lost = [m for m in class_members(s) if new_members[changed(m)] < 1]
            print(f"{s.splitlines()[0]} split: {len(class_members(s)) - len(lost)} members "
                  f"unchanged, {len(lost)} changed or missing")
            for m in lost:
                print("  CHANGED OR MISSING MEMBER:", m.splitlines()[0])
            if not lost:
                missing.remove(s)
    for s in missing:
        print("CHANGED OR MISSING:", s.splitlines()[0])
    lost_comments = [c for c in comments(old_source) if new_comments[changed(c)] < 1]
    for c in lost_comments:
        print("COMMENT LOST:", c)
    for old_text, new_text in literal:
        print(f"stated change: {old_text!r} -> {new_text!r}")
    print(f"{files[0]}: {len(old)} top-level statements, {len(missing)} changed or missing; "
          f"{len(comments(old_source))} comment lines, {len(lost_comments)} lost")
    return 1 if missing or lost_comments else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
