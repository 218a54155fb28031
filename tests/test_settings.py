"""``OTEL_PYTHON_NEMO_GYM_*`` variables: forgiving reads, one warning per bad value, at start-up."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor, _settings
from opentelemetry.instrumentation.nemo_gym import environment_variables as env

SETTINGS_LOGGER = _settings.__name__


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No variable set and no warning remembered, as in a fresh process."""
    for name in vars(env):
        if name.startswith("OTEL_PYTHON_NEMO_GYM_"):
            monkeypatch.delenv(name, raising=False)
    _settings._ONCE.reset()
    yield
    _settings._ONCE.reset()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == SETTINGS_LOGGER and r.levelno == logging.WARNING
    ]


def test_intended_concurrency_bad_value_says_unset_no_check(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bad intended concurrency reads as unset, and the warning says so in those words."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY, "lots")
    assert _settings.intended_concurrency() is None
    assert _warnings(caplog) == [
        "OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY='lots' is not an integer >= 1; "
        "treating it as unset: no check"
    ]


def test_workers_bad_value_names_the_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bad value with a real default names that default."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_WORKERS, "0")
    assert _settings.workers() == 1
    assert _warnings(caplog) == [
        "OTEL_PYTHON_NEMO_GYM_WORKERS='0' is not an integer >= 1; using the default 1"
    ]


def test_validate_all_warns_once_per_bad_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every variable is read: each bad one warns once, and later reads repeat nothing."""
    bad = {
        env.OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL: "maybe",
        env.OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES: "perhaps",
        env.OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL: "-1",
        env.OTEL_PYTHON_NEMO_GYM_WORKERS: "three",
        env.OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY: "0",
        env.OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY_PER_HOST: "x",
        env.OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES: "inf",
        env.OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS: "none",
    }
    for name, value in bad.items():
        monkeypatch.setenv(name, value)
    _settings.validate_all()
    _settings.validate_all()
    _settings.sandbox_resource_interval()
    warnings = _warnings(caplog)
    assert len(warnings) == len(bad)
    for name, value in bad.items():
        assert sum(w.startswith(f"{name}={value!r} is not ") for w in warnings) == 1


def test_validate_all_good_values_are_silent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Valid and unset variables give no warning."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL, "0")
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_WORKERS, "4")
    _settings.validate_all()
    assert _warnings(caplog) == []


def test_instrument_warns_bad_interval_without_any_sandbox(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """instrument() itself reports a bad sampling interval: no sandbox has to be created."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL, "ten")
    instrumentor = NemoGymInstrumentor()
    instrumentor.uninstrument()
    try:
        instrumentor.instrument()
    finally:
        instrumentor.uninstrument()
    assert _warnings(caplog) == [
        "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL='ten' is not a finite number >= 0.0; "
        "using the default 10.0"
    ]
