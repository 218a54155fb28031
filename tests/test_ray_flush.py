"""``ray.flush()`` keeps to its timeout and says whether the export succeeded.

The global meter provider exports over OTLP/HTTP (the real exporter, its default 10 s
timeout) to a loopback collector that answers 200, answers 400, or accepts and never answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from aiohttp import web
from opentelemetry import metrics
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.test.globals_test import reset_metrics_globals

from conftest import serve_on_loopback
from exit_support import hung_collector
from opentelemetry.instrumentation.nemo_gym.ray import flush

TIMEOUT_MS = 1000
# flush() may overrun its timeout by the time a thread takes to start and be joined; a busy
# machine gets a generous second. The exporter's own timeout (10 s) would be far beyond it.
OVERRUN_S = 1.0


@pytest.fixture
def exporting_to() -> Iterator[list[MeterProvider]]:
    """The global meter provider, once the test builds it (``_global_provider``), then reset."""
    built: list[MeterProvider] = []
    reset_metrics_globals()
    yield built
    for provider in built:
        provider.shutdown(timeout_millis=1)
    reset_metrics_globals()


def _global_provider(built: list[MeterProvider], port: int) -> MeterProvider:
    exporter = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{port}/v1/metrics")
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=600_000)
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    built.append(provider)
    metrics.set_meter_provider(provider)
    provider.get_meter("ray-flush-test").create_counter("ray_flush_test_total").add(7)
    return provider


def test_flush_hung_collector_returns_false_within_timeout(
    exporting_to: list[MeterProvider],
) -> None:
    """Against a collector that never answers, flush() returns False about its timeout later."""
    with hung_collector() as hung:
        _global_provider(exporting_to, hung.port)
        started = time.monotonic()
        flushed = flush(timeout_millis=TIMEOUT_MS)
        elapsed = time.monotonic() - started
        assert hung.accepted.is_set()  # the export did reach it
    assert flushed is False
    assert elapsed < TIMEOUT_MS / 1000 + OVERRUN_S, elapsed


@pytest.mark.parametrize(("status", "expected"), [(200, True), (400, False)])
async def test_flush_collector_answer_is_the_result(
    exporting_to: list[MeterProvider], status: int, expected: bool
) -> None:
    """flush() returns True when the collector takes the export, False when it refuses it."""
    received: list[int] = []

    async def collector(request: web.Request) -> web.Response:
        received.append(len(await request.read()))
        return web.Response(status=status)

    runner, port = await serve_on_loopback("127.0.0.1", collector)
    try:
        _global_provider(exporting_to, port)
        # flush() blocks; the collector answers on this loop, so it runs on a thread.
        flushed = await asyncio.to_thread(flush, timeout_millis=5000)
    finally:
        await runner.cleanup()
    assert len(received) == 1
    assert flushed is expected
