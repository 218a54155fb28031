"""``runtime_env()`` builds Ray's runtime_env without Ray; ``setup_worker()`` is safe to call.

The real thing (a two-node cluster, a collector, a worker on the second node) is
tests/test_ray_cluster.py, which runs once in its own CI section.
"""

from __future__ import annotations

import io
import logging
import os

import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.test.globals_test import reset_metrics_globals

from opentelemetry.instrumentation.nemo_gym.ray import (
    SETUP_HOOK,
    flush,
    runtime_env,
    setup_worker,
)

HOOK_VARIABLE = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


@pytest.fixture
def otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's OTEL_* settings: exactly two, and one unrelated variable."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "driver")
    monkeypatch.setenv("UNRELATED", "not copied")


@pytest.mark.usefixtures("otel_environment")
def test_runtime_env_copies_otel_settings_and_installs_hook() -> None:
    """The driver's OTEL_* settings, the nemo_gym detector and the worker hook; nothing else."""
    assert runtime_env() == {
        "env_vars": {
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "nemo_gym",
            HOOK_VARIABLE: SETUP_HOOK,
        }
    }


@pytest.mark.usefixtures("otel_environment")
def test_runtime_env_driver_identity_not_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's service name and instance id stay with it; its other attributes travel."""
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "service.instance.id=driver-1, deployment.environment=ci,service.name=driver",
    )
    variables = runtime_env()["env_vars"]
    assert "OTEL_SERVICE_NAME" not in variables
    assert variables["OTEL_RESOURCE_ATTRIBUTES"] == " deployment.environment=ci"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=driver-1")
    assert "OTEL_RESOURCE_ATTRIBUTES" not in runtime_env()["env_vars"]


@pytest.mark.usefixtures("otel_environment")
def test_runtime_env_precedence_base_then_explicit() -> None:
    """Lowest first: this process, ``base['env_vars']``, ``env_vars``; ``base`` is kept."""
    base = {"pip": ["aiohttp"], "env_vars": {"OTEL_SERVICE_NAME": "base", "A": "1"}}
    built = runtime_env(base, env_vars={"OTEL_SERVICE_NAME": "explicit"})
    assert built["pip"] == ["aiohttp"]
    assert built["env_vars"]["OTEL_SERVICE_NAME"] == "explicit"
    assert built["env_vars"]["A"] == "1"
    assert base == {"pip": ["aiohttp"], "env_vars": {"OTEL_SERVICE_NAME": "base", "A": "1"}}


@pytest.mark.usefixtures("otel_environment")
def test_runtime_env_without_inheritance_copies_nothing() -> None:
    """``inherit_environment=False``: only what is given, plus the detector and the hook."""
    built = runtime_env(inherit_environment=False, env_vars={"OTEL_TRACES_EXPORTER": "none"})
    assert built["env_vars"] == {
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "nemo_gym",
        HOOK_VARIABLE: SETUP_HOOK,
    }


@pytest.mark.parametrize(
    ("configured", "expected"),
    [("", "nemo_gym"), ("host, process", "host,process,nemo_gym"), ("*", "*")],
    ids=["unset", "others", "all"],
)
def test_runtime_env_detector_listed_once(configured: str, expected: str) -> None:
    """The detector is added to the configured list, and not where ``*`` already covers it."""
    built = runtime_env(
        inherit_environment=False,
        env_vars={"OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": configured},
    )
    assert built["env_vars"]["OTEL_EXPERIMENTAL_RESOURCE_DETECTORS"] == expected


def test_runtime_env_base_with_hook_rejected() -> None:
    """A ``base`` with its own setup hook: ``ValueError`` naming the field and the value."""
    with pytest.raises(ValueError, match=r"worker_process_setup_hook='mine\.setup'"):
        runtime_env({"worker_process_setup_hook": "mine.setup"})


def test_runtime_env_non_string_variable_rejected() -> None:
    """An ``env_vars`` value that is not a string: ``TypeError`` naming the key and value."""
    with pytest.raises(TypeError, match=r"env_vars\['OTEL_METRIC_EXPORT_INTERVAL'\] = 500"):
        runtime_env(env_vars={"OTEL_METRIC_EXPORT_INTERVAL": 500})  # type: ignore[dict-item]


def test_setup_worker_configured_sdk_left_alone(
    global_meter_provider: MeterProvider, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the SDK is already configured (an inherited environment), the hook changes nothing."""
    caplog.set_level(logging.DEBUG, logger="opentelemetry.instrumentation.nemo_gym.ray")
    setup_worker()
    assert metrics.get_meter_provider() is global_meter_provider
    assert [record.getMessage() for record in caplog.records] == [
        "nemo_gym: OpenTelemetry already configured in this Ray worker"
    ]


def test_flush_exports_what_was_recorded() -> None:
    """``flush()`` exports at once what a 600 s periodic reader would have held back."""
    out = io.StringIO()
    reader = PeriodicExportingMetricReader(
        ConsoleMetricExporter(out=out), export_interval_millis=600_000
    )
    provider = MeterProvider(metric_readers=[reader])
    reset_metrics_globals()
    metrics.set_meter_provider(provider)
    try:
        provider.get_meter("test").create_counter("flushed_counter").add(3)
        assert "flushed_counter" not in out.getvalue()
        assert flush() is True
        assert "flushed_counter" in out.getvalue()
    finally:
        provider.shutdown()
        reset_metrics_globals()
