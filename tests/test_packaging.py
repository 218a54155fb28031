"""The distribution's contract with ``opentelemetry-instrument``: extras, entry points."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import pydoc
import re
import sys
import tomllib
from pathlib import Path

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor, environment_variables
from opentelemetry.instrumentation.nemo_gym.package import _instruments

PYPROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
DISTRIBUTION = "opentelemetry-instrumentation-nemo-gym"


def test_instruments_extra_equals_package_instruments() -> None:
    """``[project.optional-dependencies] instruments`` is exactly ``package._instruments``."""
    assert tuple(PYPROJECT["project"]["optional-dependencies"]["instruments"]) == _instruments


def test_aiohttp_dependency_matches_instruments() -> None:
    """The runtime aiohttp requirement is the same range the instrumentor checks."""
    aiohttp_requirements = [
        d for d in PYPROJECT["project"]["dependencies"] if d.replace(" ", "").startswith("aiohttp")
    ]
    assert tuple(aiohttp_requirements) == _instruments


def test_instrumentor_entry_point_loads_the_instrumentor() -> None:
    """``opentelemetry-instrument`` finds ``nemo_gym`` in ``opentelemetry_instrumentor``."""
    (entry_point,) = [
        ep
        for ep in importlib.metadata.entry_points(group="opentelemetry_instrumentor")
        if ep.name == "nemo_gym"
    ]
    assert entry_point.load() is NemoGymInstrumentor
    assert entry_point.dist is not None
    assert entry_point.dist.name == DISTRIBUTION


def test_environment_variables_entry_point_documents_every_variable() -> None:
    """The variables module is registered, and each variable is named after itself."""
    (entry_point,) = [
        ep
        for ep in importlib.metadata.entry_points(group="opentelemetry_environment_variables")
        if ep.name == "nemo_gym"
    ]
    assert entry_point.load() is environment_variables
    names = [n for n in vars(environment_variables) if n.startswith("OTEL_PYTHON_NEMO_GYM_")]
    assert len(names) == 15
    assert all(getattr(environment_variables, n) == n for n in names)
    source = Path(environment_variables.__file__).read_text()
    assert all(f".. envvar:: {n}" in source for n in names)


def test_py_typed_is_shipped() -> None:
    """The installed package carries ``py.typed`` so type checkers use its annotations."""
    files = importlib.metadata.files(DISTRIBUTION) or []
    assert any(str(f).endswith("nemo_gym/py.typed") for f in files) or (
        Path(environment_variables.__file__).with_name("py.typed").is_file()
    )


def test_license_file_is_apache_2_and_shipped() -> None:
    """LICENSE holds the Apache-2.0 text the metadata declares, and the distribution ships it."""
    text = (Path(__file__).parents[1] / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    metadata = importlib.metadata.metadata(DISTRIBUTION)
    assert metadata.get("License-Expression") == "Apache-2.0"
    assert "LICENSE" in (metadata.get_all("License-File") or [])


def test_project_urls_are_https() -> None:
    """``[project.urls]`` exists and every entry is an https URL."""
    urls = PYPROJECT["project"]["urls"]
    assert urls
    assert all(url.startswith("https://") for url in urls.values())


def test_classifiers_declare_this_python() -> None:
    """The interpreter running the suite is a declared one (CI runs 3.11, 3.12 and 3.13)."""
    classifiers = PYPROJECT["project"]["classifiers"]
    running = f"Programming Language :: Python :: {sys.version_info[0]}.{sys.version_info[1]}"
    assert running in classifiers
    declared = [
        c for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert declared == [f"Programming Language :: Python :: 3.{minor}" for minor in (11, 12, 13)]


def test_help_on_the_package_lists_only_importable_submodules() -> None:
    """pydoc lists no module (such as ``sandbox_tracing``) that cannot be imported by that name."""
    package = importlib.import_module("opentelemetry.instrumentation.nemo_gym")
    text = pydoc.render_doc(package, renderer=pydoc.plaintext)
    assert "sandbox_tracing" not in text
    if "\nSUBMODULES\n" in text:
        listed = text.split("\nSUBMODULES\n", 1)[1].split("\n\n", 1)[0].split()
        for name in listed:
            importlib.import_module(f"{package.__name__}.{name}")


def test_help_on_instrument_shows_its_keywords() -> None:
    """``help(NemoGymInstrumentor.instrument)`` shows the documented keyword arguments."""
    parameters = inspect.signature(NemoGymInstrumentor.instrument).parameters
    for name in ("meter_provider", "tracer_provider", "connection_pool", "sandbox_resources"):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[name].default is None
    text = pydoc.render_doc(NemoGymInstrumentor.instrument, renderer=pydoc.plaintext)
    assert "meter_provider" in text
    assert "sandbox_resources" in text


def test_readme_lists_every_variable_with_its_flag() -> None:
    """The README's configuration table names each variable and its command-line flag."""
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    for name in vars(environment_variables):
        if name.startswith("OTEL_PYTHON_NEMO_GYM_"):
            flag = "--" + name.removeprefix("OTEL_PYTHON_").lower()
            assert f"| `{name}` | `{flag}` |" in readme
