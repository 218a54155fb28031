"""Which connector is built and which meter provider's telemetry it records into."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from conftest import (
    GatedServerFactory,
    connect_counts,
    queue_waits,
    through_pool,
)
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    build_connection_pool_connector,
)


async def test_build_connection_pool_connector_api_only_provider_is_plain(
    clean_metrics_globals: None,
) -> None:
    """With only the API's proxy meter provider, the plain TCPConnector is built."""
    connector = build_connection_pool_connector(limit=7)
    try:
        assert type(connector) is aiohttp.TCPConnector
        assert connector.limit == 7
    finally:
        await connector.close()


async def test_build_connection_pool_connector_sdk_without_readers_is_plain(
    clean_metrics_globals: None,
) -> None:
    """An SDK meter provider with no metric reader exports nothing: plain TCPConnector."""
    provider = MeterProvider()
    metrics.set_meter_provider(provider)
    try:
        connector = build_connection_pool_connector()
        assert type(connector) is aiohttp.TCPConnector
        await connector.close()
    finally:
        provider.shutdown()


async def test_build_connection_pool_connector_reader_added_later_is_timed(
    clean_metrics_globals: None,
) -> None:
    """A reader added after construction (``add_metric_reader``) counts as exporting."""
    provider = MeterProvider()
    if not hasattr(provider, "add_metric_reader"):
        pytest.skip("this opentelemetry-sdk cannot add readers after construction")
    metrics.set_meter_provider(provider)
    try:
        before = build_connection_pool_connector()
        assert type(before) is aiohttp.TCPConnector
        await before.close()
        provider.add_metric_reader(InMemoryMetricReader())
        after = build_connection_pool_connector()
        assert type(after) is QueueTimedTCPConnector
        await after.close()
    finally:
        provider.shutdown()


async def test_build_connection_pool_connector_sdk_disabled_is_plain(
    global_meter_provider: MeterProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_SDK_DISABLED=true turns the timed connector off even with a reader."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    connector = build_connection_pool_connector()
    try:
        assert type(connector) is aiohttp.TCPConnector
    finally:
        await connector.close()


async def test_build_connection_pool_connector_exporting_records_into_global_provider(
    gated_server: GatedServerFactory,
    global_meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """An SDK provider with a reader gets the timed connector, recording into that provider."""
    server = await gated_server("127.0.0.1")
    connector = build_connection_pool_connector(limit=1, limit_per_host=0)
    assert type(connector) is QueueTimedTCPConnector
    assert (connector.limit, connector.limit_per_host) == (1, 0)
    await through_pool(connector, server, requests=2, slots=1)
    assert queue_waits(metric_reader) == {("total", "ok", "external"): 1}
    assert connect_counts(metric_reader) == {"external": 2}
    assert connection_pool._CONNECT_COUNTS == {"external": 2}


def test_pool_telemetry_of_same_provider_returns_same_telemetry(
    meter_provider: MeterProvider,
) -> None:
    """One PoolTelemetry per meter provider: later calls get it whatever settings they pass."""
    first = PoolTelemetry.of(meter_provider, version="test", max_server_names=3)
    assert PoolTelemetry.of(meter_provider, version="other", max_server_names=50) is first
    other = MeterProvider()
    try:
        assert PoolTelemetry.of(other, version="test", max_server_names=3) is not first
    finally:
        other.shutdown()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("semconv_mode", "http/both"),
        ("max_server_names", 0),
        ("max_server_names", True),
        ("batch_size", 0),
    ],
)
def test_pool_telemetry_rejects_bad_settings(
    meter_provider: MeterProvider, setting: str, value: Any
) -> None:
    """A bad setting raises ValueError naming the setting and the value."""
    settings: dict[str, Any] = {"version": "test", "max_server_names": 5, setting: value}
    with pytest.raises(ValueError, match=f"{setting}={value!r}"):
        PoolTelemetry(meter_provider, **settings)


async def test_connect_count_snapshot_before_sdk_leaves_global_connectors_recording(
    gated_server: GatedServerFactory,
    clean_metrics_globals: None,
) -> None:
    """Reading the global counts under the API's proxy does not stop later connectors recording."""
    assert connection_pool._connect_count_snapshot() == {}  # the API's proxy: nothing counted
    assert connection_pool._CONNECT_COUNTS == {}
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.set_meter_provider(provider)
    try:
        server = await gated_server("127.0.0.1")
        connector = build_connection_pool_connector(limit=2, limit_per_host=0)
        assert type(connector) is QueueTimedTCPConnector
        await through_pool(connector, server, requests=10, slots=2)
        assert queue_waits(reader) == {("total", "ok", "external"): 8}
        assert connect_counts(reader) == {"external": 10}
        assert connection_pool._CONNECT_COUNTS == {"external": 10}
    finally:
        provider.shutdown()


async def test_direct_connector_before_sdk_while_instrumented_leaves_later_ones_recording(
    gated_server: GatedServerFactory,
    clean_metrics_globals: None,
) -> None:
    """Instrumented, a timed connector made under the proxy counts nothing; later ones record."""
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument()
    try:
        early = QueueTimedTCPConnector()
        await early.close()
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        metrics.set_meter_provider(provider)
        server = await gated_server("127.0.0.1")
        connector = QueueTimedTCPConnector(limit=1, limit_per_host=0)
        await through_pool(connector, server, requests=2, slots=1)
        assert queue_waits(reader) == {("total", "ok", "external"): 1}
        assert connect_counts(reader) == {"external": 2}
        provider.shutdown()
    finally:
        instrumentor.uninstrument()
