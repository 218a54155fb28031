"""Print the package's internal import graph, its import cycles and its layering breaches.

Reads every module under src/opentelemetry/instrumentation/nemo_gym with ``ast`` (nothing is
imported or run), including imports made inside functions, which is where cycles used to
hide. Exits 1 when a cycle exists or an import crosses the layers, so CI keeps them out.

The layers, by package (CONTRIBUTING.md, "Where code goes"):

* the public leaves (``environment_variables``, ``version``, ``package``) import nothing;
* ``_shared`` (settings, once-logging, caches, SDK reads, the patch helper) imports only
  itself and the public leaves;
* ``telemetry`` (the aiohttp pool) and ``ray`` import only themselves and the layers above;
* ``pressure`` may import the pool too; ``sandbox`` never imports the pool;
* ``integrations`` may import the pool, pressure and sandbox;
* the sandbox core imports no integration at all: what it needs from one it asks through
  ``sandbox/_host.py``, where the integration registers its answers;
* pressure and ray may ask an integration module only if it is a reader: one that imports
  nothing but ``_shared`` and the public leaves (whether NeMo Gym records; Ray carries the
  run's identity variable to its workers);
* ``tools`` (what a user runs) may import anything below the root, and only the root's
  modules and the tools import a tool;
* the root's modules (the instrumentor, the detector) import anything.

    python scripts/import_graph.py            # the cycles, if any, and a summary
    python scripts/import_graph.py --edges    # every internal edge too
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "opentelemetry.instrumentation.nemo_gym"
ROOT = Path(__file__).resolve().parent.parent / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    # "from pkg.mod import thing" names either a module or something inside one.
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Internal module -> the internal modules it imports (anywhere in its body)."""
    paths = sorted((ROOT / PACKAGE.replace(".", "/")).rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        source = _module_name(path)
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                target = _resolve(name, modules)
                # A package's __init__ importing its own submodules is not a cycle source.
                if target is not None and target != source:
                    targets.add(target)
        graph[source] = targets
    return graph


PUBLIC_LEAVES = frozenset({"environment_variables", "version", "package"})
ROOT_MODULES = frozenset({"", "resource_detector"})
BASE = frozenset({"_shared", "leaves"})
# Layer -> the layers its modules may import (besides their own).
ALLOWED: dict[str, frozenset[str]] = {
    "leaves": frozenset(),
    "_shared": frozenset({"leaves"}),
    "telemetry": BASE,
    "ray": BASE,
    "pressure": BASE | {"telemetry"},
    "sandbox": BASE,
    "integrations": BASE | {"telemetry", "pressure", "sandbox"},
    "tools": BASE | {"telemetry", "pressure", "sandbox", "integrations", "ray"},
}
# Layers that may import an integration module when it is a reader (see the docstring); the
# sandbox core is not one of them.
READER_USERS = frozenset({"pressure", "ray"})


def layer(module: str) -> str:
    """The layer of an internal module: its first package, "leaves" or "root"."""
    name = module[len(PACKAGE) + 1 :] if module != PACKAGE else ""
    if name in PUBLIC_LEAVES:
        return "leaves"
    if name in ROOT_MODULES:
        return "root"
    return name.split(".")[0]


def layering_breaches(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every (importer, imported) pair that crosses the layers."""
    readers = {
        module
        for module, targets in graph.items()
        if layer(module) == "integrations" and all(layer(t) in BASE for t in targets)
    }
    breaches = []
    for source in sorted(graph):
        source_layer = layer(source)
        if source_layer == "root":
            continue
        allowed = ALLOWED.get(source_layer)
        for target in sorted(graph[source]):
            target_layer = layer(target)
            if target_layer == source_layer:
                continue
            if allowed is not None and target_layer in allowed:
                continue
            if source_layer in READER_USERS and target in readers:
                continue
            breaches.append((source, target))
    return breaches


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every internal edge")
    args = parser.parse_args()
    graph = import_graph()
    short = len(PACKAGE) + 1
    if args.edges:
        for source in sorted(graph):
            for target in sorted(graph[source]):
                print(f"{source[short:] or '(package)'} -> {target[short:] or '(package)'}")
    found = cycles(graph)
    breaches = layering_breaches(graph)
    edges = sum(len(targets) for targets in graph.values())
    print(
        f"{len(graph)} modules, {edges} internal imports, {len(found)} import cycles, "
        f"{len(breaches)} layering breaches"
    )
    for component in found:
        print("cycle: " + " <-> ".join(member[short:] for member in component))
    for source, target in breaches:
        print(f"layering: {source[short:]} ({layer(source)}) -> {target[short:]} ({layer(target)})")
    return 1 if found or breaches else 0


if __name__ == "__main__":
    sys.exit(main())
