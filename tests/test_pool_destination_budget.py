"""Series per destination (``server.address``/``server.port``) are bounded per process.

Sandboxes expose endpoints on their own ports, so one client meets thousands of destinations.
The pool's destination-keyed instruments keep at most ``max_destinations`` (default 100) series
of their own; the rest share one ``otel.metric.overflow=true`` series, and destinations that are
gone give their places to new ones. The 10,000 destinations are written into a real timed
connector's counting layer exactly as its ``_create_connection`` writes them (one count per new
TCP connection), beside real connections to two loopback servers: exact and fast.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from conftest import GatedServer, GatedServerFactory, metric_points
from conftest import timed_connector as make_timed
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor, _settings
from opentelemetry.instrumentation.nemo_gym import environment_variables as env
from opentelemetry.instrumentation.nemo_gym.telemetry._destination_budget import (
    OVERFLOW_ATTRIBUTE,
    DestinationBudget,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    CONNECTIONS_CREATED,
    OPEN_CONNECTIONS,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    build_connection_pool_connector,
)

MANY = 10_000


def _created(reader: InMemoryMetricReader) -> tuple[dict[tuple[Any, ...], int], int | None]:
    own: dict[tuple[Any, ...], int] = {}
    overflow: int | None = None
    for point in metric_points(reader.get_metrics_data(), CONNECTIONS_CREATED):
        if point.attributes.get(OVERFLOW_ATTRIBUTE):
            overflow = point.value
        else:
            attributes = point.attributes
            own[(attributes["server.address"], attributes["server.port"])] = point.value
    return own, overflow


def _synthetic(connector: Any, ports: range) -> None:
    """One new connection per port, counted as ``_create_connection`` counts it."""
    created = connector._nemo_gym_counts.created
    for port in ports:
        where = ("127.0.0.3", port, "http")
        created[where] = created.get(where, 0) + 1


async def _open_pair(gated_server: GatedServerFactory) -> tuple[GatedServer, GatedServer]:
    """Servers on 127.0.0.1 and 127.0.0.2 that answer at once."""
    a = await gated_server("127.0.0.1")
    b = await gated_server("127.0.0.2")
    a.open()
    b.open()
    return a, b


async def _get(session: aiohttp.ClientSession, url: str) -> None:
    async with session.get(url) as response:
        await response.read()


async def test_pool_destination_budget_bounds_10000_destinations_exactly(
    gated_server: GatedServerFactory,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """10,002 destinations give 100 series plus one overflow series, and every count is kept."""
    telemetry = PoolTelemetry(meter_provider, version="test", max_server_names=100)
    a, b = await _open_pair(gated_server)
    connector = make_timed(telemetry, limit=10)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _get(session, a.url)
        await _get(session, b.url)
        _synthetic(connector, range(20_000, 20_000 + MANY))

        own, overflow = _created(metric_reader)
        assert len(own) == 100
        # The real destinations sort first among the 10,002 and are open: they keep series.
        assert own[("127.0.0.1", a.port)] == 1
        assert own[("127.0.0.2", b.port)] == 1
        assert overflow == MANY + 2 - 100
        assert sum(own.values()) + overflow == MANY + 2

        # 50 new destinations take the places of 50 gone ones (no new connection, none open);
        # the open real ones stay; the overflow keeps its count (it never decreases).
        _synthetic(connector, range(40_000, 40_050))
        own_after, overflow_after = _created(metric_reader)
        assert len(own_after) == 100
        assert {("127.0.0.3", port) for port in range(40_000, 40_050)} <= own_after.keys()
        assert ("127.0.0.1", a.port) in own_after
        assert ("127.0.0.2", b.port) in own_after
        assert overflow_after == overflow


async def test_pool_destination_budget_forgets_collected_connectors_destinations(
    meter_provider: MeterProvider, metric_reader: InMemoryMetricReader
) -> None:
    """Destinations of a collected connector that lost their place keep no memory behind."""
    telemetry = PoolTelemetry(meter_provider, version="test", max_server_names=100)
    connector = make_timed(telemetry, limit=10)
    _synthetic(connector, range(20_000, 20_000 + MANY))
    _created(metric_reader)  # 100 admitted, the rest to the overflow
    _created(metric_reader)  # nothing new: the overflowed ones are gone and forgotten
    await connector.close()
    reference = weakref.ref(connector)
    del connector
    gc.collect()
    assert reference() is None
    own, overflow = _created(metric_reader)
    assert len(own) == 100
    assert overflow == MANY - 100
    assert len(telemetry._folded_created) == 100


async def test_pool_destination_budget_open_connections_overflow_per_state(
    gated_server: GatedServerFactory,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """With a budget of 1, the second destination's idle connection lands in the overflow."""
    telemetry = PoolTelemetry(
        meter_provider, version="test", max_server_names=100, max_destinations=1
    )
    a, b = await _open_pair(gated_server)
    connector = make_timed(telemetry, limit=10)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _get(session, a.url)
        await _get(session, b.url)
        points = metric_points(metric_reader.get_metrics_data(), OPEN_CONNECTIONS)
        series = {
            (
                p.attributes.get("server.address", "overflow"),
                p.attributes["http.connection.state"],
            ): p.value
            for p in points
        }
    assert series == {
        ("127.0.0.1", "active"): 0,
        ("127.0.0.1", "idle"): 1,
        ("overflow", "active"): 0,
        ("overflow", "idle"): 1,
    }


def test_destination_budget_rejects_a_non_positive_limit() -> None:
    """A budget below 1 is refused with the value named."""
    with pytest.raises(ValueError, match="max_destinations=0 must be an integer >= 1"):
        DestinationBudget(0)


# --- OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS ----------------------------------------------------


async def _five_destinations_keep_three(
    connector: aiohttp.TCPConnector, metric_reader: InMemoryMetricReader
) -> None:
    """Under a budget of 3, the timed ``connector``'s 5 destinations give 3 series + 1."""
    try:
        assert type(connector) is QueueTimedTCPConnector
        _synthetic(connector, range(20_000, 20_005))
        own, overflow = _created(metric_reader)
    finally:
        await connector.close()
    assert own == {("127.0.0.3", port): 1 for port in range(20_000, 20_003)}
    assert overflow == 2


async def test_max_destinations_env_bounds_instrumented_connectors(
    monkeypatch: pytest.MonkeyPatch,
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Under instrument(), a budget of 3 from the variable gives 5 destinations 3 series + 1."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS, "3")
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    await _five_destinations_keep_three(aiohttp.TCPConnector(), metric_reader)


async def test_max_destinations_env_bounds_global_provider_connectors(
    monkeypatch: pytest.MonkeyPatch,
    global_meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Without instrument(), the global provider's telemetry reads the same variable."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS, "3")
    await _five_destinations_keep_three(build_connection_pool_connector(), metric_reader)


@pytest.mark.parametrize("raw", ["0", "-5", "many", "3.5"])
async def test_max_destinations_env_bad_value_warns_once_and_uses_100(
    raw: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_settings_warnings: None,
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A bad value gets one warning naming variable and value, and the default budget of 100."""
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS, raw)
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    connector = aiohttp.TCPConnector()
    try:
        _synthetic(connector, range(20_000, 20_105))
        own, overflow = _created(metric_reader)
    finally:
        await connector.close()
    assert len(own) == 100
    assert overflow == 5
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == _settings.__name__ and r.levelno == logging.WARNING
    ]
    assert warnings == [
        f"OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS={raw!r} is not an integer >= 1; "
        "using the default 100"
    ]
