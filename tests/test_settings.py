"""``OTEL_PYTHON_NEMO_GYM_*`` variables: forgiving reads, one warning per bad value, at start-up."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym import environment_variables as env
from opentelemetry.instrumentation.nemo_gym._shared import _settings

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
        env.OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT: "gym.slice",
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
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT, "/gym.slice")
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


@pytest.mark.parametrize(
    ("raw", "level"),
    [
        ("critical", logging.CRITICAL),
        ("WARN", logging.WARNING),
        ("Fatal", logging.CRITICAL),
        (" Warning ", logging.WARNING),
        ("DEBUG", logging.DEBUG),
        ("error", logging.ERROR),
    ],
)
def test_log_level_standard_names_any_case(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str, level: int
) -> None:
    """Every level name Python's logging takes (WARN, FATAL included) is accepted in any case."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_LOG_LEVEL, raw)
    assert _settings.log_level() == level
    assert _warnings(caplog) == []


def test_log_level_bad_value_names_variable_value_and_levels(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A value that is no level: one warning with the variable, the value and every level."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_LOG_LEVEL, "loud")
    assert _settings.log_level() is None
    assert _warnings(caplog) == [
        "OTEL_PYTHON_NEMO_GYM_LOG_LEVEL='loud' is not a log level (debug, info, warning, warn, "
        "error, critical, fatal; any case); treating it as unset: the application's logging "
        "configuration decides"
    ]


@pytest.mark.parametrize("raw", ["1e-9", "0.0999", "5e-324"])
def test_sandbox_resource_interval_below_floor_raised_with_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str
) -> None:
    """A positive interval under 0.1 s becomes 0.1 s, with one warning naming the floor."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL, raw)
    assert _settings.sandbox_resource_interval() == 0.1
    _settings.validate_all()
    assert _warnings(caplog) == [
        f"OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL={raw!r} is below the floor of 0.1 s; "
        "sampling every 0.1 s"
    ]


@pytest.mark.parametrize(("raw", "seconds"), [("0", 0.0), ("0.1", 0.1), ("2.5", 2.5)])
def test_sandbox_resource_interval_at_or_above_floor_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str, seconds: float
) -> None:
    """Zero (off), the floor itself and longer intervals are taken as given, silently."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL, raw)
    assert _settings.sandbox_resource_interval() == seconds
    assert _warnings(caplog) == []


def test_warning_long_value_cut_with_its_length(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A 5,000-digit value is quoted by its first 64 characters and its full length."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_WORKERS, "9" * 5000)
    assert _settings.workers() == 1
    assert _warnings(caplog) == [
        f"OTEL_PYTHON_NEMO_GYM_WORKERS={'9' * 64!r}... (5000 characters) is not an integer "
        ">= 1; using the default 1"
    ]


@pytest.mark.parametrize(
    ("raw", "read"),
    [("/", "/"), ("/gym.slice/sandboxes", "/gym.slice/sandboxes"), (" //a//b/ ", "/a/b")],
)
def test_sandbox_cgroup_parent_reads_an_absolute_path_normalised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str, read: str
) -> None:
    """An absolute cgroup path is read with its doubled and trailing slashes dropped."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT, raw)
    assert _settings.sandbox_cgroup_parent() == read
    assert _warnings(caplog) == []


@pytest.mark.parametrize("raw", ["gym.slice", "/a/../b", "/a/./b"])
def test_sandbox_cgroup_parent_bad_value_warns_and_means_the_own_cgroup(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str
) -> None:
    """A relative path or one with . or .. is one warning naming the variable, the value and
    what is done instead (the server's own cgroup), and reads as unset."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT, raw)
    assert _settings.sandbox_cgroup_parent() is None
    assert _settings.sandbox_cgroup_parent() is None
    assert _warnings(caplog) == [
        f"OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT={raw!r} is not an absolute cgroup path "
        "without . or .. (such as /gym.slice/sandboxes); treating it as unset: sandbox cgroups "
        "go under the server's own cgroup"
    ]
