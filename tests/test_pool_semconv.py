"""``OTEL_SEMCONV_STABILITY_OPT_IN``: which queue-wait histogram each naming mode emits.

Each mode gets a fresh meter provider (``PoolTelemetry.of`` keeps a provider's first settings)
and goes through ``NemoGymInstrumentor().instrument(meter_provider=...)``, as a user would.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from conftest import (
    GatedServer,
    GatedServerFactory,
    eventually,
    metric_names,
    metric_points,
    queued,
)
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry import _instruments as names
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    reset_server_name,
    set_server_name,
)

# What every mode emits besides the queue-wait histograms (pool state, connects).
ALWAYS = {
    names.CONNECT_TOTAL,
    names.CONNECTIONS_CREATED,
    names.OPEN_CONNECTIONS,
    names.LIMIT,
}
DOTNET_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)


async def _one_ok_one_abandoned(server: GatedServer, reader: InMemoryMetricReader) -> Any:
    """Through ``TCPConnector(limit=1)``: one wait abandoned by its timeout, one that ends ok.

    Returns what ``reader`` collects afterwards, while the connector is still open.
    """
    connector = aiohttp.TCPConnector(limit=1)
    assert type(connector) is QueueTimedTCPConnector
    token = set_server_name("model")
    try:
        async with aiohttp.ClientSession(connector=connector) as session:

            async def get(path: str, **kwargs: Any) -> str:
                async with session.get(f"{server.url}{path}", **kwargs) as response:
                    return await response.text()

            holder = asyncio.create_task(get("/hold"))
            await server.until_held(1)
            with pytest.raises(asyncio.TimeoutError):
                await get("/", timeout=aiohttp.ClientTimeout(connect=0.05))
            waiting = asyncio.create_task(get("/"))
            await eventually(lambda: queued(connector) == 1, "a request queued")
            server.open()
            assert await asyncio.gather(holder, waiting) == ["ok", "ok"]
            return reader.get_metrics_data()
    finally:
        reset_server_name(token)


async def _collect_in_mode(
    mode: str | None,
    instrumentor: NemoGymInstrumentor,
    server: GatedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> Any:
    if mode is None:
        monkeypatch.delenv("OTEL_SEMCONV_STABILITY_OPT_IN", raising=False)
    else:
        monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", mode)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    instrumentor.instrument(meter_provider=provider, sandbox_resources=False, pressure=False)
    try:
        return await _one_ok_one_abandoned(server, reader)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()


def _queue_duration_waits(data: Any) -> dict[tuple[str, str, str], int]:
    return {
        (
            p.attributes[names.ATTR_QUEUE_CONSTRAINT],
            p.attributes[names.ATTR_QUEUE_OUTCOME],
            p.attributes[names.ATTR_SERVER_NAME],
        ): p.count
        for p in metric_points(data, names.QUEUE_DURATION)
    }


def _assert_semconv_waits(data: Any, server: GatedServer) -> None:
    points = metric_points(data, names.TIME_IN_QUEUE)
    by_error = {p.attributes.get(names.ATTR_ERROR_TYPE): p for p in points}
    # The abandoned wait ended by the connect timeout: aiohttp's timeout interrupts the wait
    # with the CancelledError of asyncio.timeout, which only becomes TimeoutError above the
    # wait, so that is the type the wait sees (indistinguishable there from a cancellation).
    assert set(by_error) == {None, "asyncio.exceptions.CancelledError"}
    common = {
        names.ATTR_SERVER_ADDRESS: "127.0.0.1",
        names.ATTR_SERVER_PORT: server.port,
        names.ATTR_URL_SCHEME: "http",
        names.ATTR_QUEUE_CONSTRAINT: "total",
        names.ATTR_SERVER_NAME: "model",
    }
    assert dict(by_error[None].attributes) == common
    assert dict(by_error["asyncio.exceptions.CancelledError"].attributes) == {
        **common,
        names.ATTR_ERROR_TYPE: "asyncio.exceptions.CancelledError",
    }
    for point in points:
        assert point.count == 1
        assert tuple(point.explicit_bounds) == DOTNET_BUCKETS
        # Seconds: the abandoned wait lasted its 0.05 s connect timeout, far below a second.
        assert 0 < point.sum < 60
    (metric,) = [
        m
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == names.TIME_IN_QUEUE
    ]
    assert metric.unit == "s"


@pytest.mark.parametrize("mode", [None, "", "database"])
async def test_semconv_default_mode_emits_only_queue_duration_histogram(
    mode: str | None,
    instrumentor: NemoGymInstrumentor,
    gated_server: GatedServerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset (or without `http`), only gym.http.connection_pool.queue_duration_ms is emitted."""
    server = await gated_server("127.0.0.1")
    data = await _collect_in_mode(mode, instrumentor, server, monkeypatch)
    assert metric_names(data) == ALWAYS | {names.QUEUE_DURATION}
    assert _queue_duration_waits(data) == {
        ("total", "ok", "model"): 1,
        ("total", "abandoned", "model"): 1,
    }


@pytest.mark.parametrize("mode", ["http", "database, HTTP"])
async def test_semconv_http_mode_emits_only_time_in_queue(
    mode: str,
    instrumentor: NemoGymInstrumentor,
    gated_server: GatedServerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`http` emits http.client.request.time_in_queue in seconds with semconv attributes only."""
    server = await gated_server("127.0.0.1")
    data = await _collect_in_mode(mode, instrumentor, server, monkeypatch)
    assert metric_names(data) == ALWAYS | {names.TIME_IN_QUEUE}
    _assert_semconv_waits(data, server)


@pytest.mark.parametrize("mode", ["http/dup", "http,http/dup"])
async def test_semconv_http_dup_mode_emits_both(
    mode: str,
    instrumentor: NemoGymInstrumentor,
    gated_server: GatedServerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`http/dup` emits both histograms, each with its own names, units and attributes."""
    server = await gated_server("127.0.0.1")
    data = await _collect_in_mode(mode, instrumentor, server, monkeypatch)
    assert metric_names(data) == ALWAYS | {names.QUEUE_DURATION, names.TIME_IN_QUEUE}
    assert _queue_duration_waits(data) == {
        ("total", "ok", "model"): 1,
        ("total", "abandoned", "model"): 1,
    }
    _assert_semconv_waits(data, server)


async def test_semconv_mode_is_fixed_per_meter_provider(
    instrumentor: NemoGymInstrumentor,
    gated_server: GatedServerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A provider keeps the naming mode it was first instrumented with."""
    server = await gated_server("127.0.0.1")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "http")
        instrumentor.instrument(meter_provider=provider, sandbox_resources=False, pressure=False)
        instrumentor.uninstrument()
        monkeypatch.delenv("OTEL_SEMCONV_STABILITY_OPT_IN")
        instrumentor.instrument(meter_provider=provider, sandbox_resources=False, pressure=False)
        data = await _one_ok_one_abandoned(server, reader)
        assert names.QUEUE_DURATION not in metric_names(data)
        assert names.TIME_IN_QUEUE in metric_names(data)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
