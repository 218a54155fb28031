"""The one INFO line ``instrument()`` logs: each capability on or off, and why."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.test.globals_test import reset_metrics_globals

from opentelemetry.instrumentation.nemo_gym import (
    _PLAIN_CONNECTOR_NOTICE,
    NemoGymInstrumentor,
)
from opentelemetry.instrumentation.nemo_gym._shared import _settings, _status
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import SandboxSpanProcessor
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    timed_connector_mismatch,
)

STATUS_LOGGER = "opentelemetry.instrumentation.nemo_gym"
# What the instrumentor passes status_line about the capabilities themselves.
CAPABILITY_CHECKS: dict[str, Any] = {
    "pool_unfit": timed_connector_mismatch,
    "own_span_processors": (SandboxSpanProcessor,),
}


@pytest.fixture
def instrumentor(monkeypatch: pytest.MonkeyPatch) -> Iterator[NemoGymInstrumentor]:
    """The singleton instrumentor in a clean environment, uninstrumented after the test."""
    for name in ("OTEL_SDK_DISABLED", "OTEL_METRICS_EXPORTER", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    for name in ("CONNECTION_POOL", "SANDBOX_RESOURCES", "SANDBOX_RESOURCE_INTERVAL"):
        monkeypatch.delenv(f"OTEL_PYTHON_NEMO_GYM_{name}", raising=False)
    _settings._ONCE.reset()
    instance = NemoGymInstrumentor()
    instance.uninstrument()
    yield instance
    instance.uninstrument()


def _status_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == STATUS_LOGGER and r.getMessage().startswith("nemo_gym instrumentation:")
    ]


def _instrument(
    instrumentor: NemoGymInstrumentor, caplog: pytest.LogCaptureFixture, **kwargs: object
) -> str:
    caplog.set_level(logging.INFO, logger=STATUS_LOGGER)
    instrumentor.instrument(**kwargs)
    (line,) = _status_lines(caplog)
    (record,) = [r for r in caplog.records if r.getMessage() == line]
    assert record.levelno == logging.INFO
    return line


def test_instrument_status_both_on(
    instrumentor: NemoGymInstrumentor,
    caplog: pytest.LogCaptureFixture,
    meter_provider: MeterProvider,
    tracer_provider: TracerProvider,
) -> None:
    """Exporting providers: both capabilities on, with what was found."""
    line = _instrument(
        instrumentor, caplog, meter_provider=meter_provider, tracer_provider=tracer_provider
    )
    assert line == (
        "nemo_gym instrumentation: connection_pool=on (SDK MeterProvider with 1 metric reader: "
        "new aiohttp.TCPConnector pools are timed); sandbox_resources=on (SDK TracerProvider "
        "with 1 exporting span processor; usage sampled every 10 s); rollout_span=on; "
        "ray_propagation=on"
    )


def test_instrument_status_no_sdk_says_what_to_install(
    instrumentor: NemoGymInstrumentor, caplog: pytest.LogCaptureFixture
) -> None:
    """With the API's proxy providers, both are off and the line says what to install."""
    line = _instrument(instrumentor, caplog)
    assert "connection_pool=off for now (no SDK MeterProvider (the global one is a " in line
    assert "install opentelemetry-distro and an exporter" in line
    assert "checked again at each construction" in line
    assert "sandbox_resources=off (no SDK TracerProvider (the global one is a Proxy" in line


def test_instrument_status_no_reader(
    instrumentor: NemoGymInstrumentor, caplog: pytest.LogCaptureFixture
) -> None:
    """An SDK provider with nothing to send to is named as such."""
    provider = MeterProvider()
    try:
        line = _instrument(instrumentor, caplog, meter_provider=provider, sandbox_resources=False)
    finally:
        provider.shutdown()
    assert line == (
        "nemo_gym instrumentation: connection_pool=off for now (the SDK MeterProvider has no "
        "metric reader; aiohttp.TCPConnector stays plain, checked again at each construction); "
        "sandbox_resources=off (sandbox_resources=False was passed to instrument(); only "
        "providers wrapped with traced_provider() are traced); "
        "rollout_span=on; ray_propagation=on"
    )


def test_instrument_status_exporter_none(
    instrumentor: NemoGymInstrumentor,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_METRICS_EXPORTER=none and OTEL_TRACES_EXPORTER=none are named as the reason."""
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    meters, tracers = MeterProvider(), TracerProvider()
    try:
        line = _instrument(instrumentor, caplog, meter_provider=meters, tracer_provider=tracers)
    finally:
        meters.shutdown()
        tracers.shutdown()
    assert "connection_pool=off for now (OTEL_METRICS_EXPORTER=none: " in line
    assert "sandbox_resources=off (OTEL_TRACES_EXPORTER=none: " in line


def test_instrument_status_sdk_disabled(
    instrumentor: NemoGymInstrumentor,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    meter_provider: MeterProvider,
    tracer_provider: TracerProvider,
) -> None:
    """OTEL_SDK_DISABLED=true wins over providers that would export."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    line = _instrument(
        instrumentor, caplog, meter_provider=meter_provider, tracer_provider=tracer_provider
    )
    assert "connection_pool=off for now (OTEL_SDK_DISABLED=true;" in line
    assert "sandbox_resources=off (OTEL_SDK_DISABLED=true;" in line


def test_instrument_status_disabled_by_variables(
    instrumentor: NemoGymInstrumentor,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    meter_provider: MeterProvider,
) -> None:
    """A capability switched off by its variable names the variable and its value."""
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL", "false")
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES", "0")
    line = _instrument(instrumentor, caplog, meter_provider=meter_provider)
    assert line == (
        "nemo_gym instrumentation: connection_pool=off "
        "(OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL='false'); "
        "sandbox_resources=off (OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES='0'; only providers "
        "wrapped with traced_provider() are traced); "
        "rollout_span=on; ray_propagation=on"
    )


def test_instrument_status_interval_zero(
    instrumentor: NemoGymInstrumentor,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tracer_provider: TracerProvider,
) -> None:
    """Sampling switched off by its variable is said next to the sandbox capability."""
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL", "0")
    line = _instrument(instrumentor, caplog, tracer_provider=tracer_provider)
    assert line.endswith(
        "sandbox_resources=on (SDK TracerProvider with 1 exporting span processor; periodic "
        "usage sampling off (OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL=0)); "
        "rollout_span=on; ray_propagation=on"
    )


def test_status_line_never_reached_twice(
    instrumentor: NemoGymInstrumentor,
    caplog: pytest.LogCaptureFixture,
    meter_provider: MeterProvider,
) -> None:
    """A second instrument() while instrumented logs no second status line."""
    _instrument(instrumentor, caplog, meter_provider=meter_provider)
    instrumentor.instrument(meter_provider=meter_provider)
    assert len(_status_lines(caplog)) == 1


def test_status_line_is_pure_text() -> None:
    """status_line() builds the line without instrumenting anything."""
    line = _status.status_line(
        {"connection_pool": False, "sandbox_resources": False}, **CAPABILITY_CHECKS
    )
    assert line == (
        "nemo_gym instrumentation: connection_pool=off (connection_pool=False was passed to "
        "instrument()); sandbox_resources=off (sandbox_resources=False was passed to "
        "instrument(); only providers wrapped with traced_provider() are traced); "
        "rollout_span=on; ray_propagation=on"
    )


def test_status_line_boolean_string_argument() -> None:
    """A boolean string argument (as instrument() accepts) is read like the variable's values."""
    line = _status.status_line(
        {"connection_pool": "off", "sandbox_resources": "no"}, **CAPABILITY_CHECKS
    )
    assert line == (
        "nemo_gym instrumentation: connection_pool=off (connection_pool='off' was passed to "
        "instrument()); sandbox_resources=off (sandbox_resources='no' was passed to instrument(); "
        "only providers wrapped with traced_provider() are traced); rollout_span=on; "
        "ray_propagation=on"
    )


def test_status_line_new_switches_off_by_argument_and_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rollout span and Ray propagation switches, off by argument or by variable, are
    named in the line with what turned them off."""
    by_argument = _status.status_line(
        {"rollout_span": False, "ray_propagation": "off"}, **CAPABILITY_CHECKS
    )
    assert by_argument.endswith(
        "; rollout_span=off (rollout_span=False was passed to instrument(); ServerClient.request "
        "is not wrapped); ray_propagation=off (ray_propagation='off' was passed to "
        "instrument(); nothing added to the Ray tasks this process starts)"
    )
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_ROLLOUT_SPAN", "false")
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION", "0")
    by_variable = _status.status_line({}, **CAPABILITY_CHECKS)
    assert by_variable.endswith(
        "; rollout_span=off (OTEL_PYTHON_NEMO_GYM_ROLLOUT_SPAN='false'; ServerClient.request "
        "is not wrapped); ray_propagation=off (OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION='0'; "
        "nothing added to the Ray tasks this process starts)"
    )


def _plain_notices(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if "built without pool telemetry" in r.getMessage() and r.levelno == logging.WARNING
    ]


async def test_plain_connector_notice_once_when_nothing_exports(
    instrumentor: NemoGymInstrumentor, caplog: pytest.LogCaptureFixture
) -> None:
    """With no SDK provider, the first plain TCPConnector warns once, naming what is missing."""
    reset_metrics_globals()
    _PLAIN_CONNECTOR_NOTICE.reset()
    caplog.set_level(logging.INFO)
    instrumentor.instrument(sandbox_resources=False)
    for _ in range(3):
        connector = aiohttp.TCPConnector()
        assert type(connector) is aiohttp.TCPConnector
        await connector.close()
    (notice,) = _plain_notices(caplog)
    assert "no SDK MeterProvider" in notice.getMessage()
    assert "opentelemetry-distro" in notice.getMessage()


async def test_plain_connector_no_notice_when_metrics_are_off_on_purpose(
    instrumentor: NemoGymInstrumentor,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_METRICS_EXPORTER=none is a choice: plain connectors, and no warning about it."""
    reset_metrics_globals()
    _PLAIN_CONNECTOR_NOTICE.reset()
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    caplog.set_level(logging.INFO)
    instrumentor.instrument(sandbox_resources=False)
    connector = aiohttp.TCPConnector()
    assert type(connector) is aiohttp.TCPConnector
    await connector.close()
    assert _plain_notices(caplog) == []
