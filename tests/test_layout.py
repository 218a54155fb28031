"""The package's layout: its public face at the root, documented import paths, entry points."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from opentelemetry.instrumentation.nemo_gym.sandbox import tracing

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "opentelemetry.instrumentation.nemo_gym"
PACKAGE_DIR = ROOT / "src" / PACKAGE.replace(".", "/")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

# The import paths the README, the design and the reference pages name, with a name from each.
DOCUMENTED = {
    PACKAGE: "NemoGymInstrumentor",
    f"{PACKAGE}.tools.cli": "main",
    f"{PACKAGE}.environment_variables": "OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL",
    f"{PACKAGE}.package": "_instruments",
    f"{PACKAGE}.version": "__version__",
    f"{PACKAGE}.resource_detector": "NemoGymResourceDetector",
    f"{PACKAGE}.ray": "runtime_env",
    f"{PACKAGE}.telemetry.connection_pool": "QueueTimedTCPConnector",
    f"{PACKAGE}.sandbox.resource_telemetry": "ResourceSampler",
    f"{PACKAGE}.sandbox.tracing": "traced_provider",
    f"{PACKAGE}.sandbox.providers.base": "SandboxProvider",
    f"{PACKAGE}.sandbox.providers.process": "ProcessSandboxProvider",
    f"{PACKAGE}.sandbox.providers.docker": "DockerSandboxProvider",
    f"{PACKAGE}.sandbox.readers": "resource_source",
}

# The root's public face, and the private packages that hold everything else.
ROOT_ENTRIES = {
    "__init__.py",  # the instrumentor
    "environment_variables.py",
    "package.py",
    "py.typed",
    "resource_detector.py",
    "version.py",
    "ray",  # a package so that Ray's private helpers sit beside its documented module
    "telemetry",  # the aiohttp connection pool, at NeMo Gym's path
    "pressure",
    "sandbox",
    "integrations",  # hooks into other libraries
    "tools",  # what a user runs: the nemo-gym-otel command
    "_shared",
}


@pytest.mark.parametrize(("module", "name"), sorted(DOCUMENTED.items()))
def test_layout_documented_import_path_imports(module: str, name: str) -> None:
    """Each documented import path imports and holds the name it is documented with."""
    assert hasattr(importlib.import_module(module), name)


def test_layout_ray_documented_functions() -> None:
    """The Ray hooks the README names are importable from the documented module."""
    ray = importlib.import_module(f"{PACKAGE}.ray")
    assert all(callable(getattr(ray, name)) for name in ("flush", "runtime_env", "setup_worker"))


def test_layout_every_entry_point_loads() -> None:
    """Every entry point pyproject.toml declares is installed and loads."""
    declared = {
        (group, name): value
        for group, points in PYPROJECT["project"]["entry-points"].items()
        for name, value in points.items()
    }
    declared.update(
        {
            ("console_scripts", name): value
            for name, value in PYPROJECT["project"]["scripts"].items()
        }
    )
    installed = {
        (point.group, point.name): point
        for point in importlib.metadata.distribution(
            "opentelemetry-instrumentation-nemo-gym"
        ).entry_points
    }
    assert {key: point.value for key, point in installed.items()} == declared
    for point in installed.values():
        assert point.load() is not None


def test_layout_root_holds_the_public_face_only() -> None:
    """The package root lists the public modules and the packages of each concern, no more."""
    entries = {path.name for path in PACKAGE_DIR.iterdir() if path.name != "__pycache__"}
    assert entries == ROOT_ENTRIES


def test_layout_every_provider_module_has_an_entry_point_and_back() -> None:
    """Each public module of sandbox/providers/ but base is a provider with an entry point in
    NeMo Gym's group, each such entry point names one, and those are what enable() traces."""
    group = PYPROJECT["project"]["entry-points"][tracing.PROVIDER_GROUP]
    declared_modules = {value.partition(":")[0] for value in group.values()}
    provider_modules = {
        f"{PACKAGE}.sandbox.providers.{path.stem}"
        for path in (PACKAGE_DIR / "sandbox" / "providers").glob("*.py")
        if not path.stem.startswith("_") and path.stem != "base"
    }
    assert declared_modules == provider_modules
    loaded = [point.load() for point in tracing.bundled_provider_entry_points()]
    assert {cls.__module__ for cls in loaded} == provider_modules
    assert tracing._bundled_classes() == loaded


def _import_graph_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts/import_graph.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layout_import_graph_has_no_cycle_and_keeps_the_layers() -> None:
    """scripts/import_graph.py finds no cycle and no import across the layers."""
    script = _import_graph_script()
    graph = script.import_graph()
    assert script.cycles(graph) == []
    assert script.layering_breaches(graph) == []


def test_layout_import_graph_names_each_kind_of_breach() -> None:
    """A shared leaf importing a capability, the pool importing the sandbox, the sandbox
    importing the pool, the sandbox importing any integration (a reader too), and a capability
    importing a tool are each reported; pressure reading whether NeMo Gym records, and a tool
    importing an integration, are not."""
    script = _import_graph_script()
    graph = script.import_graph()
    breaches = [
        (f"{PACKAGE}._shared._once", f"{PACKAGE}.sandbox.tracing"),
        (f"{PACKAGE}.telemetry.connection_pool", f"{PACKAGE}.sandbox._state"),
        (f"{PACKAGE}.sandbox._calls", f"{PACKAGE}.telemetry.connection_pool"),
        (f"{PACKAGE}.sandbox._calls", f"{PACKAGE}.integrations.nemo_gym._server_client"),
        (f"{PACKAGE}.sandbox._calls", f"{PACKAGE}.integrations.nemo_gym._identity"),
        (f"{PACKAGE}.telemetry.connection_pool", f"{PACKAGE}.tools._report"),
    ]
    allowed = [
        (f"{PACKAGE}.pressure._pressure", f"{PACKAGE}.integrations.nemo_gym._identity"),
        (f"{PACKAGE}.tools._report", f"{PACKAGE}.integrations.nemo_gym._identity"),
    ]
    for source, target in [*breaches, *allowed]:
        graph[source].add(target)
    assert script.layering_breaches(graph) == sorted(breaches)


def test_layout_sandbox_core_imports_no_integration() -> None:
    """No module of the sandbox core imports an integration module, directly."""
    graph = _import_graph_script().import_graph()
    assert not {
        (source, target)
        for source, targets in graph.items()
        if source.startswith(f"{PACKAGE}.sandbox")
        for target in targets
        if target.startswith(f"{PACKAGE}.integrations")
    }


def test_layout_comments_name_only_what_exists() -> None:
    """scripts/check_references.py finds no comment or docstring naming a missing file, test or
    function, and no file:line reference."""
    spec = importlib.util.spec_from_file_location(
        "check_references", ROOT / "scripts/check_references.py"
    )
    assert spec is not None
    assert spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.broken_references() == []
