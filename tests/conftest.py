"""Shared fixtures: real loopback aiohttp servers and real OpenTelemetry SDK providers."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from aiohttp import web
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.test.globals_test import reset_metrics_globals, reset_trace_globals

IN_CI = os.environ.get("CI", "").strip().lower() == "true"


def require_service(available: bool, reason: str) -> None:
    """Skip a test whose external service is missing; under ``CI=true`` fail instead."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"required service missing under CI=true: {reason}")
    pytest.skip(reason)


class LoopbackServer:
    """A real aiohttp server on a loopback address whose handler sleeps ``delay_s``."""

    def __init__(self, host: str, delay_s: float) -> None:
        self.host = host
        self.delay_s = delay_s
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def _handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            delay = float(request.query.get("delay", self.delay_s))
            if delay:
                await asyncio.sleep(delay)
            return web.Response(text="ok")
        finally:
            self.in_flight -= 1

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None)
        assert sockets
        self.port = sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


ServerFactory = Callable[..., Awaitable[LoopbackServer]]


@pytest.fixture
async def loopback_server() -> AsyncIterator[ServerFactory]:
    """Start real aiohttp servers on loopback: ``await loopback_server("127.0.0.2", 0.01)``."""
    servers: list[LoopbackServer] = []

    async def start(host: str = "127.0.0.1", delay_s: float = 0.0) -> LoopbackServer:
        server = LoopbackServer(host, delay_s)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
def metric_reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def meter_provider(metric_reader: InMemoryMetricReader) -> Iterator[MeterProvider]:
    provider = MeterProvider(metric_readers=[metric_reader])
    yield provider
    provider.shutdown()


@pytest.fixture
def span_exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer_provider(span_exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    yield provider
    provider.shutdown()


@pytest.fixture
def global_meter_provider(meter_provider: MeterProvider) -> Iterator[MeterProvider]:
    """Install ``meter_provider`` as the global one for the test, then restore the proxy."""
    reset_metrics_globals()
    metrics.set_meter_provider(meter_provider)
    yield meter_provider
    reset_metrics_globals()


@pytest.fixture
def global_tracer_provider(tracer_provider: TracerProvider) -> Iterator[TracerProvider]:
    """Install ``tracer_provider`` as the global one for the test, then restore the proxy."""
    reset_trace_globals()
    trace.set_tracer_provider(tracer_provider)
    yield tracer_provider
    reset_trace_globals()
