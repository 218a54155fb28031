"""The sandbox modules import each other in one direction, at the top, without the wiring."""

from __future__ import annotations

import ast
from pathlib import Path

import opentelemetry.instrumentation.nemo_gym.sandbox as sandbox_package
from opentelemetry.instrumentation.nemo_gym.sandbox.providers import (
    _cgroups,
    _docker_resources,
    base,
    docker,
    process,
)

PACKAGE = "opentelemetry.instrumentation.nemo_gym"
SANDBOX_DIR = Path(sandbox_package.__file__).parent
WIRING = {f"{PACKAGE}.version", f"{PACKAGE}._settings"}


def module_name(path: Path) -> str:
    relative = path.relative_to(SANDBOX_DIR).with_suffix("")
    parts = [p for p in relative.parts if p != "__init__"]
    return ".".join([f"{PACKAGE}.sandbox", *parts])


def imports_of(tree: ast.AST) -> list[tuple[str, bool]]:
    """(imported module, at top level?) for every import of this package's modules."""
    found: list[tuple[str, bool]] = []
    top = {id(node) for node in getattr(tree, "body", [])}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith(PACKAGE):
                found.append((name, id(node) in top))
    return found


def sandbox_graph() -> tuple[dict[str, set[str]], list[str], list[str]]:
    """The import graph among sandbox modules, function-level imports, wiring imports."""
    modules = {module_name(p): p for p in SANDBOX_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    nested: list[str] = []
    wiring: list[str] = []
    for name, path in modules.items():
        for imported, at_top in imports_of(ast.parse(path.read_text())):
            if not at_top:
                nested.append(f"{name} -> {imported}")
            if imported in WIRING:
                wiring.append(f"{name} -> {imported}")
            if imported in modules and imported != name:
                graph[name].add(imported)
    return graph, nested, wiring


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_sandbox_modules_import_graph_is_acyclic() -> None:
    """No import cycle among the sandbox modules (resource_telemetry, tracing, _scope, ...)."""
    graph, _, _ = sandbox_graph()
    assert f"{PACKAGE}.sandbox.tracing" in graph
    assert cycles(graph) == []


def test_sandbox_modules_import_only_at_top_level() -> None:
    """No function-level import of this package's modules (none is needed to dodge a cycle)."""
    _, nested, _ = sandbox_graph()
    assert nested == []


def test_sandbox_core_does_not_import_the_wiring() -> None:
    """The sandbox core takes its interval and version from the instrumentor, not from
    ``version`` or ``_settings``."""
    _, _, wiring = sandbox_graph()
    assert wiring == []


def test_providers_share_one_timeout_code_and_one_mib() -> None:
    """Both providers report a timed-out exec with the same code and convert with one MiB."""
    assert process.EXEC_TIMEOUT_RETURN_CODE == docker.TIMEOUT_RETURN_CODE
    assert docker.TIMEOUT_RETURN_CODE == base.EXEC_TIMEOUT_RETURN_CODE
    assert base.MIB == 1 << 20
    for module in (_cgroups, _docker_resources, process, docker):
        assert getattr(module, "MIB", base.MIB) is base.MIB
        assert "MIB =" not in Path(module.__file__ or "").read_text()
