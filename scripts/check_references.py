"""Check that the comments and docstrings name files, tests and functions that exist.

Reads every tracked Python file under src/, tests/, benchmarks/, scripts/ and examples/ with
``tokenize`` (nothing is imported or run) and looks at its comments and docstrings only:

* a repository path (``src/...``, ``tests/...``, ``benchmarks/...``, ``scripts/...``,
  ``examples/...``, ``docs/...``) or a backticked ``name.py`` must be a tracked file;
* a ``file.py:123`` line reference is refused: line numbers move, name the test or function;
* a backticked ``test_...`` must be a test function defined under tests/;
* a backticked ``_module.name`` or ``Class.name``, where ``_module`` is one of this package's
  private modules or ``Class`` one of its classes, must name something that module or class
  defines; a backticked ``_private.name`` whose ``_private`` is no module or name of ours is
  refused. (Public module names are left out: ``nemo_gym``, ``ray`` and ``docker`` are also
  other projects' modules.)

    python scripts/check_references.py      # prints each broken reference; exits 1 if any
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("src", "tests", "benchmarks", "scripts", "examples")
PATH = re.compile(r"\b((?:src|tests|benchmarks|scripts|examples|docs)/[\w/.-]*\w)")
BACKTICKED_FILE = re.compile(r"`+([\w-]+\.py)`+")
LINE_REFERENCE = re.compile(r"\b[\w/-]+\.py:\d+")
BACKTICKED_TEST = re.compile(r"`+(test_\w+)`+")
BACKTICKED_DOTTED = re.compile(r"`+([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\(\))?`+")


def tracked() -> list[str]:
    listing = subprocess.run(
        ["git", "ls-files", *TREES, "README.md", "CONTRIBUTING.md", "docs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return listing.stdout.split()


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring-like string in ``source``."""
    return [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
        or (
            token.type == tokenize.STRING
            and token.string.lstrip("rbuRBU").startswith(('"""', "'''"))
        )
    ]


class Names:
    """What the tracked Python files define: tests, private modules' and classes' members."""

    def __init__(self, python: list[str]) -> None:
        self.tests: set[str] = set()
        self.bound: set[str] = set()
        self.modules: dict[str, set[str]] = defaultdict(set)
        self.classes: dict[str, set[str]] = defaultdict(set)
        for name in python:
            tree = ast.parse((ROOT / name).read_text(encoding="utf-8"))
            path = Path(name)
            stem = path.parent.name if path.stem == "__init__" else path.stem
            for node in ast.walk(tree):
                self._visit(node, name.startswith("tests/"))
            if name.startswith("src/"):
                self.modules[stem].update(self._top_level(tree))

    def _visit(self, node: ast.AST, in_tests: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and in_tests:
            self.tests.add(node.name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            self.bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            self.bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        if isinstance(node, ast.ClassDef):
            self.classes[node.name].update(self._top_level(node))
            self.classes[node.name].update(
                inner.attr
                for inner in ast.walk(node)
                if isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store)
            )

    @staticmethod
    def _top_level(node: ast.Module | ast.ClassDef) -> set[str]:
        names = set()
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(statement.name)
            elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
                targets = (
                    statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                )
                names.update(target.id for target in targets if isinstance(target, ast.Name))
            elif isinstance(statement, (ast.Import, ast.ImportFrom)):
                names.update(
                    (alias.asname or alias.name).split(".")[0] for alias in statement.names
                )
        return names


def problems_in(text: str, files: list[str], names: Names) -> list[str]:
    """What ``text`` (one comment or docstring) names that does not exist."""
    existing = set(files)
    found = [
        f"line reference {m.group(0)} (name it instead)" for m in LINE_REFERENCE.finditer(text)
    ]
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".")
        module = path.rpartition(".")[0].replace(".", "/") + ".py"  # a module's dotted name
        inside = any(name.startswith(path + "/") for name in files)
        if path not in existing and module not in existing and not inside:
            found.append(f"no such file {path}")
    basenames = {Path(name).name for name in files}
    found += [
        f"no such file {m.group(1)}"
        for m in BACKTICKED_FILE.finditer(text)
        if m.group(1) not in basenames
    ]
    found += [
        f"no such test {m.group(1)}"
        for m in BACKTICKED_TEST.finditer(text)
        if m.group(1) not in names.tests
    ]
    for match in BACKTICKED_DOTTED.finditer(text):
        owner, member = match.groups()
        if member == "py":
            continue  # a file name, checked above
        if owner.startswith("_") and owner in names.modules:
            known = names.modules[owner]
        elif owner in names.classes:
            known = names.classes[owner] | names.bound
        elif owner.startswith("_") and owner not in names.bound:
            found.append(f"no module or name {owner} ({owner}.{member})")
            continue
        else:
            continue
        if member not in known:
            found.append(f"{owner} defines no {member}")
    return found


def broken_references() -> list[str]:
    """``path:line: problem`` for every broken reference in the tracked Python files."""
    files = tracked()
    python = [name for name in files if name.endswith(".py")]
    names = Names(python)
    own = str(Path(__file__).resolve().relative_to(ROOT))  # its docstring shows what it refuses
    return [
        f"{name}:{line}: {problem}"
        for name in python
        if name != own
        for line, text in prose((ROOT / name).read_text(encoding="utf-8"))
        for problem in problems_in(text, files, names)
    ]


def main() -> int:
    problems = broken_references()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} broken references")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
