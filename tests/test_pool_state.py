"""Pool-state gauges: exact numbers of active, idle and waiting connections.

Connections are held active by requests waiting in a gated loopback server, left idle by
keep-alive after the gate opens, and requests are queued behind the limits; each collection is
compared with the numbers the test arranged.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import weakref
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from conftest import GatedServer, eventually, metric_points, queued
from conftest import timed_connector as make_timed
from opentelemetry.instrumentation.nemo_gym.telemetry import _pool_telemetry
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    ATTR_CONNECTION_STATE,
    ATTR_LIMIT_KIND,
    ATTR_SERVER_ADDRESS,
    ATTR_SERVER_NAME,
    ATTR_SERVER_PORT,
    ATTR_URL_SCHEME,
    CONNECT_TOTAL,
    CONNECTIONS_CREATED,
    LIMIT,
    OPEN_CONNECTIONS,
    WAITING_REQUESTS,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
)

# (server.address, server.port, url.scheme[, http.connection.state]) -> value
Series = dict[tuple[Any, ...], int]


def _where(point: Any) -> tuple[str, int, str]:
    attributes = point.attributes
    return (
        attributes[ATTR_SERVER_ADDRESS],
        attributes[ATTR_SERVER_PORT],
        attributes[ATTR_URL_SCHEME],
    )


class PoolSnapshot:
    """Every pool gauge and counter of one collection, keyed by its attributes."""

    def __init__(self, reader: InMemoryMetricReader) -> None:
        data = reader.get_metrics_data()
        self.open: Series = {
            (*_where(p), p.attributes[ATTR_CONNECTION_STATE]): p.value
            for p in metric_points(data, OPEN_CONNECTIONS)
        }
        self.waiting: Series = {_where(p): p.value for p in metric_points(data, WAITING_REQUESTS)}
        self.created: Series = {
            _where(p): p.value for p in metric_points(data, CONNECTIONS_CREATED)
        }
        self.limits = {p.attributes[ATTR_LIMIT_KIND]: p.value for p in metric_points(data, LIMIT)}
        self.connects = {
            p.attributes[ATTR_SERVER_NAME]: p.value for p in metric_points(data, CONNECT_TOTAL)
        }

    def nonzero_open(self) -> Series:
        return {key: value for key, value in self.open.items() if value}


def dest(server: GatedServer) -> tuple[str, int, str]:
    return (server.host, server.port, "http")


async def get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as response:
        return await response.text()


async def test_pool_state_active_idle_waiting_per_destination(
    two_hosts: tuple[GatedServer, GatedServer],
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Held requests are active, kept-alive ones idle, queued ones waiting, per destination."""
    a, b = two_hosts
    connector = make_timed(pool_telemetry, limit=5, limit_per_host=2)
    async with aiohttp.ClientSession(connector=connector) as session:
        # Two held on each host fill both per-host limits; one more queues behind each host.
        requests = {
            server.host: [asyncio.create_task(get(session, f"{server.url}/hold")) for _ in "xyz"]
            for server in (a, b)
        }
        await a.until_held(2)
        await b.until_held(2)
        await eventually(lambda: queued(connector) == 2, "one request queued per host")

        held = PoolSnapshot(metric_reader)
        assert held.open == {
            (*dest(a), "active"): 2,
            (*dest(a), "idle"): 0,
            (*dest(b), "active"): 2,
            (*dest(b), "idle"): 0,
        }
        assert held.waiting == {dest(a): 1, dest(b): 1}
        assert held.limits == {"total": 5, "per_host": 2}
        assert held.created == {dest(a): 2, dest(b): 2}
        assert held.connects == {"external": 6}

        # Host a answers: its three requests finish over its two connections, now idle.
        a.open()
        assert await asyncio.gather(*requests[a.host]) == ["ok"] * 3
        half = PoolSnapshot(metric_reader)
        assert half.open == {
            (*dest(a), "active"): 0,
            (*dest(a), "idle"): 2,
            (*dest(b), "active"): 2,
            (*dest(b), "idle"): 0,
        }
        assert half.waiting == {dest(b): 1}
        assert half.created == {dest(a): 2, dest(b): 2}

        b.open()
        assert await asyncio.gather(*requests[b.host]) == ["ok"] * 3
        done = PoolSnapshot(metric_reader)
        assert done.nonzero_open() == {(*dest(a), "idle"): 2, (*dest(b), "idle"): 2}
        assert done.waiting == {}
        assert done.created == {dest(a): 2, dest(b): 2}
        assert done.connects == {"external": 6}


class _SlowToConnect(QueueTimedTCPConnector):
    """Holds each new connection's setup (as a slow DNS lookup would) until ``proceed`` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.proceed = asyncio.Event()
        self.connecting = 0

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:  # noqa: ASYNC109
        self.connecting += 1
        await self.proceed.wait()
        return await super()._create_connection(req, traces, timeout)


async def test_pool_state_connection_being_established_is_not_active(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A connection aiohttp is still setting up counts as neither active nor idle."""
    connector = _SlowToConnect(limit=3)
    connector._nemo_gym_attach(pool_telemetry)
    async with aiohttp.ClientSession(connector=connector) as session:
        holder = asyncio.create_task(get(session, f"{server.url}/hold"))
        connector.proceed.set()
        await server.until_held(1)
        connector.proceed.clear()
        establishing = asyncio.create_task(get(session, f"{server.url}/hold"))
        await eventually(lambda: connector.connecting == 2, "a second connection being set up")
        snapshot = PoolSnapshot(metric_reader)
        connector.proceed.set()
        server.open()
        assert await asyncio.gather(holder, establishing) == ["ok", "ok"]
    assert snapshot.open == {(*dest(server), "active"): 1, (*dest(server), "idle"): 0}
    assert snapshot.created == {dest(server): 1}


async def test_pool_state_fifty_requests_over_two_kept_alive_connections(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """connect_total counts pool acquisitions (50); connections_created real TCP connects (2)."""
    connector = make_timed(pool_telemetry, limit=2)
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await asyncio.gather(*(get(session, server.url) for _ in range(50))) == ["ok"] * 50
        snapshot = PoolSnapshot(metric_reader)
    assert snapshot.connects == {"external": 50}
    assert snapshot.created == {dest(server): 2}
    assert server.requests == 50


async def test_pool_state_collected_connector_leaves_gauges_keeps_counts(
    two_hosts: tuple[GatedServer, GatedServer],
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A garbage-collected connector leaves the gauges; its connects and creations stay counted."""
    a, b = two_hosts
    kept = make_timed(pool_telemetry, limit=5, limit_per_host=2)
    async with aiohttp.ClientSession(connector=kept) as session:
        assert await get(session, a.url) == "ok"
        gone = make_timed(pool_telemetry, limit=3, limit_per_host=0)
        async with aiohttp.ClientSession(connector=gone, connector_owner=False) as other:
            assert await get(other, b.url) == "ok"
            assert await get(other, b.url) == "ok"
        both = PoolSnapshot(metric_reader)
        assert both.nonzero_open() == {(*dest(a), "idle"): 1, (*dest(b), "idle"): 1}
        assert both.limits == {"total": 8, "per_host": 2}
        await gone.close()
        reference = weakref.ref(gone)
        del gone, other
        gc.collect()
        assert reference() is None, "the connector is still referenced"

        after = PoolSnapshot(metric_reader)
        assert after.nonzero_open() == {(*dest(a), "idle"): 1}
        assert after.limits == {"total": 5, "per_host": 2}
        assert after.created == {dest(a): 1, dest(b): 1}
        assert after.connects == {"external": 3}


async def test_pool_state_limits_skip_unlimited_and_vanish_without_connectors(
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Unlimited (0) limits add nothing; with no live connector no limit is reported."""
    telemetry = PoolTelemetry.of(meter_provider, version="test", max_server_names=5)
    unlimited = make_timed(telemetry, limit=0, limit_per_host=0)
    finite = make_timed(telemetry, limit=7, limit_per_host=0)
    assert PoolSnapshot(metric_reader).limits == {"total": 7, "per_host": 0}
    await finite.close()
    await unlimited.close()
    del finite, unlimited
    gc.collect()
    assert PoolSnapshot(metric_reader).limits == {}


async def test_pool_state_failing_observation_is_logged_not_raised(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A connector whose limit cannot be read loses the limit gauge only, logged once."""

    class UnreadableLimit(QueueTimedTCPConnector):
        @property
        def limit(self) -> int:
            raise RuntimeError("limit unreadable")

    connector = UnreadableLimit()
    connector._nemo_gym_attach(pool_telemetry)
    caplog.set_level(logging.DEBUG, logger=_pool_telemetry.__name__)
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await get(session, server.url) == "ok"
        first = PoolSnapshot(metric_reader)
        second = PoolSnapshot(metric_reader)
    assert first.limits == second.limits == {}
    assert first.nonzero_open() == {(*dest(server), "idle"): 1}
    assert first.connects == {"external": 1}
    failures = [r for r in caplog.records if "observing limits" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].levelno == logging.DEBUG


@pytest.mark.parametrize("gil", [True, False], ids=["with-gil", "free-threaded"])
async def test_pool_state_without_the_gil_reads_nothing_and_says_so_once(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    gil: bool,
) -> None:
    """Where ``sys._is_gil_enabled()`` says the GIL is off (free-threaded CPython), the gauges
    that read aiohttp's pools from the exporter's thread report nothing, with one warning over
    two collections; the connect counts, recorded on the loop, still are. With the GIL (the
    control), the same pool shows its held request."""
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: gil, raising=False)
    caplog.set_level(logging.WARNING, logger=_pool_telemetry.__name__)
    connector = make_timed(pool_telemetry, limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        held = asyncio.create_task(get(session, f"{server.url}/hold"))
        await server.until_held(1)
        snapshots = [PoolSnapshot(metric_reader) for _ in range(2)]
        server.open()
        assert await held == "ok"
    active = {(*dest(server), "active"): 1}
    assert [s.nonzero_open() for s in snapshots] == [active if gil else {}] * 2
    assert snapshots[-1].connects == {"external": 1}
    warned = [r for r in caplog.records if "runs without the GIL" in r.getMessage()]
    assert len(warned) == (0 if gil else 1)
