"""OpenTelemetry's private names and attributes, renamed by a later release, on the real SDK.

Importing the package reads three API private names (the proxy meter provider's class and the
two suppression keys); ``_exporting`` reads the SDK providers' readers and processors. A
release that renames one must neither break ``import`` nor a request: the capability that
needs it is off, and one warning says which and why. The names are deleted from the real
modules in a fresh interpreter (imports happen once per process); attributes are deleted from
real provider objects with ``monkeypatch`` (restored after).
"""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym._shared import _exporting, _otel_private

RENAMED = {
    "opentelemetry.context._SUPPRESS_INSTRUMENTATION_KEY": (
        "suppress_instrumentation() for connection-pool telemetry"
    ),
    "opentelemetry.context._SUPPRESS_HTTP_INSTRUMENTATION_KEY": (
        "suppress_http_instrumentation() for connection-pool telemetry"
    ),
    "opentelemetry.metrics._internal._ProxyMeterProvider": (
        "recording into a global meter provider that is not an SDK MeterProvider"
    ),
}

# Run in a fresh interpreter: the OpenTelemetry modules other packages import are loaded
# first (they read these names too, and are not ours to test), the names are deleted, then
# our package is imported, instruments, and serves a request through a timed pool.
RENAMED_THEN_IMPORTED = textwrap.dedent(
    """
    import asyncio, importlib, logging, sys
    import opentelemetry.context, opentelemetry.metrics._internal
    import opentelemetry.instrumentation.instrumentor, opentelemetry.instrumentation.utils
    import opentelemetry.sdk.metrics, opentelemetry.sdk.metrics.export
    import opentelemetry.sdk.trace, opentelemetry.sdk.trace.export
    for dotted in sys.argv[1:]:
        module, name = dotted.rsplit(".", 1)
        delattr(importlib.import_module(module), name)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

    import aiohttp
    from aiohttp import web
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
    from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
        QueueTimedTCPConnector, global_pool_telemetry,
    )

    async def main():
        assert global_pool_telemetry() is None  # the API's proxy is not mistaken for a provider
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        NemoGymInstrumentor().instrument(sandbox_resources=False)
        app = web.Application()
        app.router.add_get("/", lambda request: web.Response(text="ok"))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        async with aiohttp.ClientSession() as session:
            assert type(session.connector) is QueueTimedTCPConnector
            async with session.get(f"http://127.0.0.1:{port}/") as response:
                print("answer", await response.text())
        await runner.cleanup()
        print("connects", global_pool_telemetry().connect_counts())

    asyncio.run(main())
    """
)


def test_import_api_private_names_renamed_imports_and_warns_once() -> None:
    """With the three private names gone, the package imports, times a pool, warns once each."""
    done = subprocess.run(
        [sys.executable, "-c", RENAMED_THEN_IMPORTED, *RENAMED],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["answer ok", "connects {'external': 1}"]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == len(RENAMED), done.stderr
    for (dotted, capability), line in zip(RENAMED.items(), warnings, strict=True):
        module, name = dotted.rsplit(".", 1)
        assert line.startswith(
            f"WARNING nemo_gym: {capability} is off: this OpenTelemetry has no {module}.{name} "
        ), line


@pytest.fixture
def fresh_unreadable_log() -> None:
    """No unreadable SDK shape remembered as logged, as in a fresh process."""
    _exporting._UNREADABLE.reset()


def test_metrics_export_status_readers_renamed_off_with_one_warning(
    meter_provider: MeterProvider,
    monkeypatch: pytest.MonkeyPatch,
    fresh_unreadable_log: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An SDK that keeps its readers elsewhere: not exporting, the reason says so, warned once."""
    assert _exporting.metrics_export_status(meter_provider)[0]
    # Newer SDKs only (1.30 keeps the constructor's readers in _sdk_config, never read here).
    monkeypatch.delattr(meter_provider, "_metric_readers", raising=False)
    monkeypatch.delattr(meter_provider._measurement_consumer, "_reader_storages")
    caplog.set_level(logging.WARNING, logger=_exporting.__name__)
    statuses = [_exporting.metrics_export_status(meter_provider) for _ in range(3)]
    assert statuses == [(False, _exporting._NO_READERS)] * 3
    assert not _exporting.metric_export_in_flight(meter_provider)
    assert [record.getMessage() for record in caplog.records] == [
        f"nemo_gym: telemetry that needs a metric reader is off: {_exporting._NO_READERS}"
    ]


def test_traces_export_status_processors_renamed_off_with_one_warning(
    tracer_provider: TracerProvider,
    monkeypatch: pytest.MonkeyPatch,
    fresh_unreadable_log: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An SDK that keeps its span processors elsewhere: not exporting, warned once."""
    assert _exporting.traces_export_status(tracer_provider)[0]
    monkeypatch.delattr(tracer_provider._active_span_processor, "_span_processors")
    caplog.set_level(logging.WARNING, logger=_exporting.__name__)
    statuses = [_exporting.traces_export_status(tracer_provider) for _ in range(3)]
    assert statuses == [(False, _exporting._NO_PROCESSORS)] * 3
    assert _exporting.span_processors(tracer_provider) == ()
    assert [record.getMessage() for record in caplog.records] == [
        f"nemo_gym: telemetry that needs a span processor is off: {_exporting._NO_PROCESSORS}"
    ]


# The SDK's private attributes the package reads, each only in _shared/_otel_private.py.
SDK_PRIVATE_ATTRIBUTES = (
    "_measurement_consumer",
    "_reader_storages",
    "_metric_readers",
    "_active_span_processor",
    "_span_processors",
    "_export_lock",
    "_shutdown_event",
    "_daemon_thread",
    "_collect",
    "_exporter",
    "_disabled",
    "_instance",
)


def _reads_of(source: str) -> set[str]:
    """The SDK private attributes ``source`` reads: ``x._name`` (not ``self``'s or ``cls``'s
    own) and ``getattr(x, "_name", ...)``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in SDK_PRIVATE_ATTRIBUTES:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in SDK_PRIVATE_ATTRIBUTES
        ):
            found.add(node.args[1].value)
    return found


def test_otel_private_is_the_only_module_that_reads_sdk_internals() -> None:
    """No module but ``_otel_private`` reads one of the SDK's private attributes, and it reads
    each of them (the control: the check sees a read)."""
    package = Path(_otel_private.__file__).parents[1]
    reads = {
        str(path.relative_to(package)): _reads_of(path.read_text(encoding="utf-8"))
        for path in package.rglob("*.py")
    }
    assert {module for module, found in reads.items() if found} == {"_shared/_otel_private.py"}
    assert reads["_shared/_otel_private.py"] == set(SDK_PRIVATE_ATTRIBUTES)


def test_otel_private_each_read_finds_its_attribute_on_this_sdk() -> None:
    """On the installed SDK (CI: the newest; the lowest by hand, see CONTRIBUTING.md) every
    read answers from the real objects, never "unknown"."""
    exported = threading.Event()

    class Exporter(MetricExporter):
        def __init__(self) -> None:
            super().__init__()

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **_: Any) -> Any:
            exported.set()
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **_: Any) -> None:
            pass

    reader = PeriodicExportingMetricReader(Exporter(), export_interval_millis=600_000)
    meters = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    processor = SimpleSpanProcessor(InMemorySpanExporter())
    tracers = TracerProvider()
    tracers.add_span_processor(processor)
    meters.get_meter("sdk-internals-test").create_counter("sdk_internals_test_total").add(1)
    try:
        assert _otel_private.provider_disabled(meters) is False
        assert _otel_private.metric_readers(meters) == (reader,)
        assert _otel_private.span_processors(tracers) == (processor,)
        assert _otel_private.reader_exporting(reader) is False
        assert _otel_private.collect_and_export(reader) is not None
        ticker = _otel_private.stop_periodic_thread(reader)
        assert ticker is not None
        ticker.join(timeout=60)
        assert exported.is_set()  # the last export the stopped thread ran
        assert _otel_private.stop_periodic_thread(reader) is None  # gone now
    finally:
        meters.shutdown()
        tracers.shutdown()
    instrumentor = NemoGymInstrumentor()  # BaseInstrumentor's one instance, made on first use
    assert _otel_private.instrumented_instance(NemoGymInstrumentor) is instrumentor
