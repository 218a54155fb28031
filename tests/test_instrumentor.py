"""``NemoGymInstrumentor``: connector construction, idempotence, restoration, configuration."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import ProxyTracerProvider

from conftest import GatedServerFactory, eventually, fetch, queued, serve_on_loopback
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import sandbox_scope
from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    reset_server_name,
    set_server_name,
)

QUEUE_METRIC = "gym.http.connection_pool.queue_duration_ms"
CONNECT_METRIC = "gym.http.connection_pool.connect_total"
SERVER_NAME = "nemo.gym.http.destination.server.name"
# aiohttp's own constructor, read at import, before any test instruments anything.
AIOHTTP_INIT = aiohttp.TCPConnector.__dict__["__init__"]


def points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    found: list[Any] = []
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    found.extend(metric.data.data_points)
    return found


class CountingMeterProvider(MeterProvider):
    """A real SDK meter provider that counts how often a meter is asked for."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.get_meter_calls = 0

    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        self.get_meter_calls += 1
        return super().get_meter(*args, **kwargs)


async def test_instrument_tcp_connector_is_timed_while_exporting(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """``TCPConnector(...)`` and the one inside ``ClientSession()`` become timed connectors."""
    instrumentor.instrument(meter_provider=meter_provider)
    connector = aiohttp.TCPConnector(limit=3)
    assert type(connector) is QueueTimedTCPConnector
    assert isinstance(connector, aiohttp.TCPConnector)
    assert connector.limit == 3
    async with aiohttp.ClientSession() as session:
        assert type(session.connector) is QueueTimedTCPConnector
    await connector.close()


async def test_instrument_aiohttp_request_counts_connects(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    gated_server: GatedServerFactory,
) -> None:
    """``aiohttp.request()`` builds its own session, whose connector is timed too."""
    server = await gated_server("127.0.0.1")
    instrumentor.instrument(meter_provider=meter_provider)
    token = set_server_name("via-aiohttp-request")
    try:
        async with aiohttp.request("GET", server.url) as response:
            assert response.status == 200
    finally:
        reset_server_name(token)
    counts = {p.attributes[SERVER_NAME]: p.value for p in points(metric_reader, CONNECT_METRIC)}
    assert counts.get("via-aiohttp-request") == 1


async def test_instrument_saturated_pool_records_queue_waits(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    gated_server: GatedServerFactory,
) -> None:
    """Through the patched construction, each queued request records one queue-wait sample."""
    server = await gated_server("127.0.0.1")
    instrumentor.instrument(meter_provider=meter_provider)
    connector = aiohttp.TCPConnector(limit=2)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def get() -> int:
            async with session.get(f"{server.url}/hold") as response:
                await response.read()
                return response.status

        requests = [asyncio.create_task(get()) for _ in range(8)]
        await server.until_held(2)
        await eventually(lambda: queued(connector) == 6, "six requests queued")
        server.open()
        assert await asyncio.gather(*requests) == [200] * 8
    histogram = points(metric_reader, QUEUE_METRIC)
    # Two requests got a free slot; the other six queued once each.
    assert sum(p.count for p in histogram) == 6
    counts = {p.attributes[SERVER_NAME]: p.value for p in points(metric_reader, CONNECT_METRIC)}
    assert counts == {"external": 8}


async def test_instrument_leaves_subclasses_and_earlier_connectors_alone(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """Subclasses of ``TCPConnector`` and connectors built before ``instrument()`` stay as is."""

    class OwnConnector(aiohttp.TCPConnector):
        pass

    earlier = aiohttp.TCPConnector()
    instrumentor.instrument(meter_provider=meter_provider)
    own = OwnConnector(limit=5)
    assert type(own) is OwnConnector
    assert own.limit == 5
    assert type(earlier) is aiohttp.TCPConnector
    await own.close()
    await earlier.close()


async def test_uninstrument_restores_construction(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """After ``uninstrument()``, ``TCPConnector`` and its subclasses build with their arguments."""

    class OwnConnector(aiohttp.TCPConnector):
        def __init__(self, marker: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.marker = marker

    instrumentor.instrument(meter_provider=meter_provider)
    timed = aiohttp.TCPConnector(limit=4, limit_per_host=2)
    assert type(timed) is QueueTimedTCPConnector
    instrumentor.uninstrument()
    connector = aiohttp.TCPConnector(limit=4, limit_per_host=2)
    assert type(connector) is aiohttp.TCPConnector
    assert (connector.limit, connector.limit_per_host) == (4, 2)
    own = OwnConnector("mine", limit=3)
    assert (type(own), own.marker, own.limit) == (OwnConnector, "mine", 3)
    async with aiohttp.ClientSession() as session:
        assert type(session.connector) is aiohttp.TCPConnector
    for each in (timed, connector, own):
        await each.close()


async def test_instrument_twice_is_harmless(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """A second ``instrument()`` changes nothing, and one ``uninstrument()`` restores."""
    instrumentor.instrument(meter_provider=meter_provider)
    instrumentor.instrument(meter_provider=meter_provider)
    connector = aiohttp.TCPConnector()
    assert type(connector) is QueueTimedTCPConnector
    await connector.close()
    instrumentor.uninstrument()
    connector = aiohttp.TCPConnector()
    assert type(connector) is aiohttp.TCPConnector
    await connector.close()


async def test_instrument_without_metric_readers_builds_plain_connectors(
    instrumentor: NemoGymInstrumentor,
) -> None:
    """A meter provider that exports nowhere gets plain connectors, decided per construction."""
    silent = MeterProvider()
    instrumentor.instrument(meter_provider=silent)
    connector = aiohttp.TCPConnector()
    assert type(connector) is aiohttp.TCPConnector
    await connector.close()
    silent.shutdown()


async def test_instrument_global_provider_is_resolved_per_construction(
    instrumentor: NemoGymInstrumentor, global_meter_provider: MeterProvider
) -> None:
    """With no explicit provider, the global SDK provider is used when connectors are built."""
    instrumentor.instrument()
    connector = aiohttp.TCPConnector()
    assert type(connector) is QueueTimedTCPConnector
    await connector.close()


async def test_instrument_creates_instruments_once(instrumentor: NemoGymInstrumentor) -> None:
    """Many sessions share the instruments made by ``instrument()``; no meter per session."""
    reader = InMemoryMetricReader()
    provider = CountingMeterProvider(metric_readers=[reader])
    # The pressure metrics take their meters once per process, at the first loop they see.
    instrumentor.instrument(meter_provider=provider, pressure=False)
    calls_after_instrument = provider.get_meter_calls
    for _ in range(20):
        async with aiohttp.ClientSession() as session:
            assert type(session.connector) is QueueTimedTCPConnector
    assert calls_after_instrument == 1
    assert provider.get_meter_calls == calls_after_instrument
    provider.shutdown()


async def test_instrument_never_raises(
    instrumentor: NemoGymInstrumentor, caplog: pytest.LogCaptureFixture
) -> None:
    """A provider that is not a provider is logged; ``instrument()`` returns and aiohttp works."""
    with caplog.at_level(logging.ERROR):
        instrumentor.instrument(meter_provider=object(), tracer_provider=object())
    assert "nemo_gym" in caplog.text

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    runner, port = await serve_on_loopback("127.0.0.1", hello)
    try:
        async with aiohttp.ClientSession() as session:
            assert type(session.connector) is aiohttp.TCPConnector
            assert await fetch(session, f"http://127.0.0.1:{port}/") == "hello"
    finally:
        await runner.cleanup()


async def test_instrument_connection_pool_disabled_by_environment(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL=false`` leaves connector construction alone."""
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL", "false")
    instrumentor.instrument(meter_provider=meter_provider)
    assert aiohttp.TCPConnector.__dict__["__init__"] is AIOHTTP_INIT
    connector = aiohttp.TCPConnector()
    assert type(connector) is aiohttp.TCPConnector
    await connector.close()


@pytest.mark.parametrize("off", [False, "false", "0", " OFF ", "no"])
async def test_instrument_connection_pool_off_argument_does_not_patch(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider, off: object
) -> None:
    """``connection_pool=False`` or a false string leaves ``TCPConnector`` untouched."""
    instrumentor.instrument(meter_provider=meter_provider, connection_pool=off)
    assert aiohttp.TCPConnector.__dict__["__init__"] is AIOHTTP_INIT
    connector = aiohttp.TCPConnector()
    assert type(connector) is aiohttp.TCPConnector
    await connector.close()


@pytest.mark.parametrize(("environment", "patched"), [("false", False), ("true", True)])
async def test_instrument_connection_pool_bogus_argument_warns_and_uses_environment(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    environment: str,
    patched: bool,
) -> None:
    """A value that is not a boolean (``[1]``, ``"maybe"``) is named in a warning; env decides."""
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL", environment)
    with caplog.at_level(logging.WARNING, logger="opentelemetry.instrumentation.nemo_gym"):
        instrumentor.instrument(meter_provider=meter_provider, connection_pool=[1])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "connection_pool=[1]" in warnings[0]
    assert (aiohttp.TCPConnector.__dict__["__init__"] is not AIOHTTP_INIT) is patched
    connector = aiohttp.TCPConnector()
    assert (type(connector) is QueueTimedTCPConnector) is patched
    await connector.close()


async def test_instrument_broken_meter_provider_leaves_aiohttp_alone(
    instrumentor: NemoGymInstrumentor, caplog: pytest.LogCaptureFixture
) -> None:
    """A meter provider that cannot make meters is logged; connectors stay plain and work."""

    class BrokenMeterProvider(MeterProvider):
        def get_meter(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no meters today")

    provider = BrokenMeterProvider(metric_readers=[InMemoryMetricReader()])
    try:
        with caplog.at_level(logging.ERROR, logger="opentelemetry.instrumentation.nemo_gym"):
            instrumentor.instrument(meter_provider=provider, sandbox_resources=False)
        assert "connection-pool instrumentation failed" in caplog.text
        assert aiohttp.TCPConnector.__dict__["__init__"] is AIOHTTP_INIT
        connector = aiohttp.TCPConnector()
        assert type(connector) is aiohttp.TCPConnector
        await connector.close()
    finally:
        provider.shutdown()


async def test_instrument_reports_each_connector_configuration_once(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each distinct (workers, limits, intended) configuration is reported exactly once."""
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_WORKERS", "4")
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY", "400")
    connection_pool._REPORTED_CAPACITIES.clear()
    instrumentor.instrument(meter_provider=meter_provider)
    with caplog.at_level(logging.INFO, logger=connection_pool.logger.name):
        connectors = [aiohttp.TCPConnector(limit=37) for _ in range(3)]
        connectors.append(aiohttp.TCPConnector(limit=38))
    reports = [r for r in caplog.records if "workers=4" in r.getMessage()]
    assert len(reports) == 2, [r.getMessage() for r in caplog.records]
    # The connector's own limit is per process: four workers make a group budget of 148.
    assert any("37" in r.getMessage() for r in reports)
    # 400 intended across 4 workers is 100 per worker, above each connector's limit.
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings
    for connector in connectors:
        await connector.close()


async def test_instrument_worker_count_read_at_first_report(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker count set after instrument() (NeMo Gym sets its own later) is the report's."""
    monkeypatch.delenv("OTEL_PYTHON_NEMO_GYM_WORKERS", raising=False)
    monkeypatch.delenv("OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY", raising=False)
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY_PER_HOST", "1024")
    connection_pool._REPORTED_CAPACITIES.clear()
    instrumentor.instrument(meter_provider=meter_provider)
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_WORKERS", "2")
    with caplog.at_level(logging.INFO, logger=connection_pool.logger.name):
        connector = aiohttp.TCPConnector(limit=51200, limit_per_host=512)
    lines = [r.getMessage() for r in caplog.records if "aggregate_total=" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "workers=2 aggregate_total=102400 aggregate_per_host=1024 " in lines[0]
    # 1024 intended per host over 2 workers is 512 each: exactly the limit, so no warning.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    await connector.close()


async def test_instrument_bad_environment_value_warns_once(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A malformed variable gets one warning naming it and its value; the default is used."""
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_WORKERS", "-2x")
    instrumentor.instrument(meter_provider=meter_provider)
    with caplog.at_level(logging.WARNING):
        connectors = [aiohttp.TCPConnector(limit=n) for n in (41, 42, 43)]
    named = [r for r in caplog.records if "OTEL_PYTHON_NEMO_GYM_WORKERS='-2x'" in r.getMessage()]
    assert len(named) == 1
    assert all(type(c) is QueueTimedTCPConnector for c in connectors)
    for connector in connectors:
        await connector.close()


# --- the sandbox half -----------------------------------------------------------------------


def stamped(span: Any) -> bool:
    return any(key.startswith("nemo.gym.sandbox.") for key in (span.attributes or {}))


async def test_instrument_registers_sandbox_processor_and_uninstrument_silences_it(
    instrumentor: NemoGymInstrumentor,
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    sandbox_base_dir: Path,
) -> None:
    """Spans inside ``sandbox_scope`` carry the sandbox identity until ``uninstrument()``."""
    instrumentor.instrument(tracer_provider=global_tracer_provider, connection_pool=False)
    tracer = global_tracer_provider.get_tracer("user-code")
    provider = ProcessSandboxProvider(base_dir=sandbox_base_dir)
    handle = await provider.create(SandboxSpec())
    try:
        with sandbox_scope(handle), tracer.start_as_current_span("grade-answer"):
            pass
        instrumentor.uninstrument()
        with sandbox_scope(handle), tracer.start_as_current_span("after-uninstrument"):
            pass
    finally:
        await provider.close(handle)
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    assert spans["grade-answer"].attributes["nemo.gym.sandbox.id"] == handle.sandbox_id
    assert not stamped(spans["after-uninstrument"])


async def test_instrument_traces_bundled_providers_until_uninstrument(
    instrumentor: NemoGymInstrumentor,
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    sandbox_base_dir: Path,
) -> None:
    """A plain ``ProcessSandboxProvider`` is traced after ``instrument()`` and not after."""
    instrumentor.instrument(connection_pool=False)
    provider = ProcessSandboxProvider(base_dir=sandbox_base_dir)
    handle = await provider.create(SandboxSpec())
    await provider.exec(handle, "true")
    await provider.close(handle)
    names = [s.name for s in span_exporter.get_finished_spans()]
    assert names.count("sandbox.create") == 1
    assert names.count("sandbox.exec") == 1
    assert names.count("sandbox.close") == 1

    instrumentor.uninstrument()
    span_exporter.clear()
    handle = await provider.create(SandboxSpec())
    await provider.close(handle)
    assert span_exporter.get_finished_spans() == ()


async def test_instrument_with_proxy_tracer_provider_skips_processor(
    instrumentor: NemoGymInstrumentor, caplog: pytest.LogCaptureFixture
) -> None:
    """With only the API's proxy provider there is nowhere to add a processor: debug, no error."""
    with caplog.at_level(logging.DEBUG, logger="opentelemetry.instrumentation.nemo_gym"):
        instrumentor.instrument(tracer_provider=ProxyTracerProvider(), connection_pool=False)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


_OWN_LINES_SCRIPT = """
import asyncio, aiohttp
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

NemoGymInstrumentor().instrument(meter_provider=MeterProvider([InMemoryMetricReader()]))

async def main():
    await aiohttp.TCPConnector(limit=33).close()

asyncio.run(main())
"""


def _run_script(script: str, **settings: str) -> subprocess.CompletedProcess[str]:
    """``python -c script`` without this shell's ``OTEL_*`` variables, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(settings)
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


@pytest.mark.parametrize("level", ["info", ""])
def test_log_level_variable_prints_own_lines_in_unconfigured_process(level: str) -> None:
    """OTEL_PYTHON_NEMO_GYM_LOG_LEVEL=info shows the status and capacity lines; unset, nothing."""
    done = _run_script(_OWN_LINES_SCRIPT, OTEL_PYTHON_NEMO_GYM_LOG_LEVEL=level)
    lines = done.stderr.splitlines()
    status = [line for line in lines if line.startswith("INFO opentelemetry.instrumentation")]
    capacity = [line for line in lines if "workers=1 aggregate_total=33 " in line]
    if level:
        assert len(capacity) == 1, done.stderr
        assert any("connection_pool=on" in line for line in status), done.stderr
    else:
        assert (status, capacity) == ([], []), done.stderr


_EXIT_FLUSH_SCRIPT = """
import asyncio, atexit, os, sys
import aiohttp
from aiohttp import web
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

reader = PeriodicExportingMetricReader(
    ConsoleMetricExporter(out=sys.stdout), export_interval_millis=600_000
)
metrics.set_meter_provider(MeterProvider([reader]))
NemoGymInstrumentor().instrument()

def killed_while_exiting():
    # Registered before the first connector, like NeMo Gym's and Ray's handlers: a process
    # killed in a slow exit handler never reaches the SDK's own final export.
    print("KILLED", flush=True)
    os._exit(0)

atexit.register(killed_while_exiting)

async def main():
    app = web.Application()
    app.router.add_get("/", lambda request: web.Response(text="ok"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.get(f"http://127.0.0.1:{port}/") as response:
                await response.read()
    await runner.cleanup()

asyncio.run(main())
"""


def test_exit_flush_exports_before_earlier_exit_handlers() -> None:
    """The counts leave at exit before handlers registered earlier run (and may be killed)."""
    done = _run_script(_EXIT_FLUSH_SCRIPT)
    exported, _, after = done.stdout.partition("KILLED")
    assert "gym.http.connection_pool.connect_total" in exported, done.stdout[-2000:]
    assert '"value": 3' in exported, exported[-3000:]
    assert after.strip() == ""
