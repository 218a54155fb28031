"""The shared names: one module holds them, docs/names.md lists them, the code takes them there.

The scope string, the tracer and meter names and the attribute keys more than one module uses
live in ``_shared/_names.py``. These tests read the source with ``ast`` (nothing is run): a
tracer or meter named anywhere but there, a second spelling of a module logger, or a table in
docs/names.md that differs from the module fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from opentelemetry.instrumentation.nemo_gym._shared import _names

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "opentelemetry" / "instrumentation" / "nemo_gym"
NAMES_DOC = ROOT / "docs" / "names.md"
# The one documented upper-case logger: nemo_gym.sandbox.resource_telemetry names it LOGGER.
DOCUMENTED_LOGGERS = {("sandbox/resource_telemetry.py", "LOGGER")}
_ROW = re.compile(r"^\| `([A-Z_]+)` \| `([^`]*)` \|")


def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _module_constants() -> dict[str, str]:
    return {
        name: value
        for name, value in vars(_names).items()
        if name.isupper() and isinstance(value, str)
    }


def test_names_doc_table_equals_module() -> None:
    """docs/names.md's table of names in code lists exactly the module's constants and values."""
    rows = dict(
        match.groups()
        for line in NAMES_DOC.read_text(encoding="utf-8").splitlines()
        if (match := _ROW.match(line))
    )
    assert rows == _module_constants()


def test_names_tracer_and_meter_named_by_scope() -> None:
    """Every get_tracer/get_meter call in the package takes its name from ``_names``."""
    offenders = []
    for where, tree in _modules():
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"get_tracer", "get_meter"}
                and node.args
            ):
                continue
            name = node.args[0]
            from_names = (
                isinstance(name, ast.Attribute)
                and isinstance(name.value, ast.Name)
                and name.value.id == "_names"
            )
            if not from_names:
                offenders.append(f"{where}:{node.lineno} {ast.unparse(name)}")
    assert offenders == []


def test_names_scope_string_written_once() -> None:
    """The scope string appears as a literal in ``_names`` only (loggers name modules, not it)."""
    writers = sorted(
        where
        for where, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == _names.SCOPE_NAME
    )
    # _status logs under the package's root logger, which is named after the package.
    assert writers == ["_shared/_names.py", "_shared/_status.py"]


def test_names_module_loggers_spelled_logger() -> None:
    """A module-level ``logging.getLogger`` is bound to ``logger``, but the documented LOGGER."""
    spellings = set()
    for where, tree in _modules():
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "logging.getLogger"
            ):
                spellings.update(
                    (where, target.id) for target in node.targets if isinstance(target, ast.Name)
                )
    odd = {entry for entry in spellings if entry[1] != "logger"}
    assert odd == DOCUMENTED_LOGGERS
