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
import random
import weakref
from collections.abc import Iterable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider, ObservableCounter
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader

from conftest import GatedServer, GatedServerFactory, metric_points, serve_on_loopback
from conftest import timed_connector as make_timed
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym import environment_variables as env
from opentelemetry.instrumentation.nemo_gym._shared import _settings
from opentelemetry.instrumentation.nemo_gym.telemetry._aiohttp_compat import Destination
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


def _series(attributes: Any) -> Any:
    """A ``connections_created`` point's series: ``(address, port)``, or ``"overflow"``."""
    if attributes.get(OVERFLOW_ATTRIBUTE):
        return "overflow"
    return (attributes["server.address"], attributes["server.port"])


def _created(reader: InMemoryMetricReader) -> tuple[dict[tuple[Any, ...], int], int | None]:
    own: dict[tuple[Any, ...], int] = {}
    overflow: int | None = None
    for point in metric_points(reader.get_metrics_data(), CONNECTIONS_CREATED):
        series = _series(point.attributes)
        if series == "overflow":
            overflow = point.value
        else:
            own[series] = point.value
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


# --- connections_created stays exact under churn ----------------------------------------------


class _IncreaseReader:
    """Sums a cumulative counter's increases across collections, as Prometheus would.

    A series' first point counts from zero; so does a point whose start time changed or whose
    value went down (a reset). ``decreases`` counts the points that went down.
    """

    def __init__(self) -> None:
        self.total = 0
        self.decreases = 0
        self._last: dict[Any, tuple[int, int]] = {}

    def read(self, points: Iterable[tuple[Any, int, int]]) -> None:
        """Take one collection: ``(series, start time, value)`` per point."""
        for series, start, value in points:
            previous = self._last.get(series)
            if previous is not None and value < previous[1]:
                self.decreases += 1
            if previous is None or start != previous[0] or value < previous[1]:
                self.total += value
            else:
                self.total += value - previous[1]
            self._last[series] = (start, value)

    def read_sdk(self, reader: InMemoryMetricReader) -> dict[Any, int]:
        """Take one collection of ``connections_created`` from ``reader``; its values by series."""
        points = metric_points(reader.get_metrics_data(), CONNECTIONS_CREATED)
        values = {_series(point.attributes): point.value for point in points}
        self.read((_series(p.attributes), p.start_time_unix_nano, p.value) for p in points)
        return values


@pytest.mark.parametrize(("seed", "limit"), [(1, 100), (2, 100), (3, 7), (4, 1)])
def test_destination_budget_churn_keeps_totals_exact(seed: int, limit: int) -> None:
    """Seeded churn over 5,000 destinations: the series' increases sum to the connections made.

    The caller is simulated as ``PoolTelemetry`` is: connectors that count into their own
    dictionaries, retire (sometimes missing one collection, as a connector collected between
    two reads does), fold into a total, and drop folded counts of destinations without a
    series of their own. No series decreases, the overflow included.
    """
    rng = random.Random(seed)
    destinations: list[Destination] = [("127.0.0.3", port, "http") for port in range(5_000)]
    hot = destinations[:30]
    budget = DestinationBudget(limit)
    reader = _IncreaseReader()
    live: list[dict[Destination, int]] = []
    retiring: list[dict[Destination, int]] = []
    folded: dict[Destination, int] = {}
    made = 0
    previous_overflow = 0

    def collect() -> None:
        nonlocal previous_overflow
        totals = dict(folded)
        for counts in live:
            for where, count in counts.items():
                totals[where] = totals.get(where, 0) + count
        busy = {where for counts in live[-2:] for where in counts}
        report = budget.created(totals, busy)
        for where in [w for w in folded if not budget.tracks(w)]:
            budget.dropped(where, folded.pop(where))
        assert len(report.own) <= limit
        overflow = report.overflow or 0
        assert overflow >= previous_overflow
        previous_overflow = overflow
        points = [(where, 0, value) for where, value in report.own.items()]
        if report.overflow is not None:
            points.append(("overflow", 0, report.overflow))
        reader.read(points)  # the SDK keeps one start time per series
        assert reader.total <= made

    for _ in range(300):
        if not live or rng.random() < 0.3:
            live.append({})
        for _ in range(rng.randrange(80)):
            where = rng.choice(hot) if rng.random() < 0.4 else rng.choice(destinations)
            counts = rng.choice(live)
            counts[where] = counts.get(where, 0) + 1
            made += 1
        # Connectors collected since the last collection: most are folded before it reads,
        # some only at the one after.
        for counts in retiring:
            for where, count in counts.items():
                folded[where] = folded.get(where, 0) + count
        retiring = []
        while len(live) > 1 and rng.random() < 0.3:
            gone = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.2:
                retiring.append(gone)
            else:
                for where, count in gone.items():
                    folded[where] = folded.get(where, 0) + count
        collect()

    for counts in retiring + live:
        for where, count in counts.items():
            folded[where] = folded.get(where, 0) + count
    live = []
    collect()
    assert made > 10_000
    assert reader.total == made
    assert reader.decreases == 0


async def test_pool_destination_budget_1_counts_each_connection_once(
    gated_server: GatedServerFactory,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Budget 1: B 5, then A 3 while B is idle, then B 1: A's series 3, B's continues 5 to 6."""
    telemetry = PoolTelemetry(
        meter_provider, version="test", max_server_names=100, max_destinations=1
    )
    a, b = await _open_pair(gated_server)
    reader = _IncreaseReader()
    connector = make_timed(telemetry, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(5):
            await _get(session, b.url)
        first = reader.read_sdk(metric_reader)
        for _ in range(3):
            await _get(session, a.url)
        second = reader.read_sdk(metric_reader)
        total_after_a = reader.total
        await _get(session, b.url)
        third = reader.read_sdk(metric_reader)
    assert first == {("127.0.0.2", b.port): 5}
    # B is gone (no new connection, none open): A takes its place; nothing overflows.
    assert second == {("127.0.0.1", a.port): 3}
    assert total_after_a == 8
    # A is gone in turn; B comes back and its series goes on from 5.
    assert third == {("127.0.0.2", b.port): 6}
    assert reader.total == 9
    assert reader.decreases == 0
    assert a.requests + b.requests == 9


async def test_pool_destination_budget_delta_reader_gets_no_negative_delta(
    gated_server: GatedServerFactory,
) -> None:
    """A delta-temporality reader of the budget-1 churn gets deltas >= 0 that sum to 9."""
    reader = InMemoryMetricReader(
        preferred_temporality={ObservableCounter: AggregationTemporality.DELTA}
    )
    provider = MeterProvider(metric_readers=[reader])
    try:
        telemetry = PoolTelemetry(
            provider, version="test", max_server_names=100, max_destinations=1
        )
        a, b = await _open_pair(gated_server)
        deltas: list[int] = []
        connector = make_timed(telemetry, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            for url, times in ((b.url, 5), (a.url, 3), (b.url, 1)):
                for _ in range(times):
                    await _get(session, url)
                points = metric_points(reader.get_metrics_data(), CONNECTIONS_CREATED)
                deltas += [point.value for point in points]
    finally:
        provider.shutdown()
    assert min(deltas) >= 0
    assert sum(deltas) == 9


async def test_pool_destination_budget_churn_through_real_pools_is_exact(
    meter_provider: MeterProvider, metric_reader: InMemoryMetricReader
) -> None:
    """24 loopback servers, budget 5, a fresh pool per round: every connection is seen once.

    Each round's pool stays open over the next collection, so its destinations are busy then
    and new ones overflow; the real connections are counted by the servers themselves.
    """
    telemetry = PoolTelemetry(
        meter_provider, version="test", max_server_names=100, max_destinations=5
    )
    connections: set[object] = set()

    async def answer(request: web.Request) -> web.StreamResponse:
        connections.add(request.transport)  # held, so no two connections share an identity
        return web.Response(text="ok")

    servers = [await serve_on_loopback(f"127.0.0.{1 + index % 2}", answer) for index in range(24)]
    urls = [f"http://127.0.0.{1 + index % 2}:{port}/" for index, (_, port) in enumerate(servers)]
    rng = random.Random(22)
    reader = _IncreaseReader()
    overflows: list[int] = []
    previous: aiohttp.ClientSession | None = None
    try:
        for _ in range(40):
            session = aiohttp.ClientSession(connector=make_timed(telemetry))
            for url in rng.sample(urls, 3):
                await _get(session, url)
            values = reader.read_sdk(metric_reader)
            overflows.append(values.get("overflow", 0))
            if previous is not None:
                await previous.close()
            previous = session
    finally:
        if previous is not None:
            await previous.close()
        for runner, _ in servers:
            await runner.cleanup()
    assert len(connections) == 120
    assert reader.total == 120
    assert overflows == sorted(overflows)
    assert overflows[-1] > 0
