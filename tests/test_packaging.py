"""The distribution's contract with ``opentelemetry-instrument``: extras, entry points."""

from __future__ import annotations

import importlib.metadata
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
    assert len(names) == 7
    assert all(getattr(environment_variables, n) == n for n in names)
    source = Path(environment_variables.__file__).read_text()
    assert all(f".. envvar:: {n}" in source for n in names)


def test_py_typed_is_shipped() -> None:
    """The installed package carries ``py.typed`` so type checkers use its annotations."""
    files = importlib.metadata.files(DISTRIBUTION) or []
    assert any(str(f).endswith("nemo_gym/py.typed") for f in files) or (
        Path(environment_variables.__file__).with_name("py.typed").is_file()
    )
