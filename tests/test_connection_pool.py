"""QueueTimedTCPConnector against real loopback servers and the real OpenTelemetry SDK.

Every queue wait here is made by holding requests in a gated server and released by the test,
so the assertions are exact counts and attributes, never durations.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from conftest import (
    GatedServer,
    cancel_while_queued,
    connect_counts,
    eventually,
    fetch,
    metric_points,
    outcome,
    queue_waits,
    queued,
    same_failure,
    timed_connector,
    timeout_while_queued,
)
from opentelemetry.instrumentation.nemo_gym.telemetry import _pool_telemetry, connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    QUEUE_DURATION,
    QUEUE_DURATION_BUCKETS,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    reset_server_name,
    set_server_name,
)

POOL_LOGGER = connection_pool.__name__
TELEMETRY_LOGGER = _pool_telemetry.__name__


# --- queue waits -----------------------------------------------------------------------------


async def test_queue_timed_connector_total_limit_records_each_queued_wait(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Two requests queued behind an exhausted total limit record two `total`/`ok` samples."""
    connector = timed_connector(pool_telemetry, limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        requests = [
            asyncio.create_task(fetch(session, f"{server.url}/hold", label="model-a"))
            for _ in range(3)
        ]
        await server.until_held(1)
        await eventually(lambda: queued(connector) == 2, "two requests queued")
        assert queue_waits(metric_reader) == {}  # a wait is recorded when it ends
        server.open()
        assert await asyncio.gather(*requests) == ["ok"] * 3
    assert queue_waits(metric_reader) == {("total", "ok", "model-a"): 2}
    (point,) = metric_points(metric_reader.get_metrics_data(), QUEUE_DURATION)
    assert tuple(point.explicit_bounds) == QUEUE_DURATION_BUCKETS
    assert connect_counts(metric_reader) == {"model-a": 3}


async def test_queue_timed_connector_no_sample_when_slot_free(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Requests that find a free slot record no queue sample but are counted as connects."""
    connector = timed_connector(pool_telemetry, limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await fetch(session, server.url) == "ok"
        assert await fetch(session, server.url) == "ok"
    assert queue_waits(metric_reader) == {}
    assert connect_counts(metric_reader) == {"external": 2}


async def test_queue_timed_connector_per_host_limit_two_destinations(
    two_hosts: tuple[GatedServer, GatedServer],
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Under an unlimited total, a per-host limit waits as `per_host`, per destination label."""
    first, second = two_hosts
    connector = timed_connector(pool_telemetry, limit=0, limit_per_host=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        requests = [
            asyncio.create_task(fetch(session, f"{server.url}/hold", label=label))
            for server, label in ((first, "alpha"), (second, "beta"))
            for _ in range(2)
        ]
        await first.until_held(1)
        await second.until_held(1)
        await eventually(lambda: queued(connector) == 2, "one request queued per host")
        first.open()
        second.open()
        assert await asyncio.gather(*requests) == ["ok"] * 4
    assert queue_waits(metric_reader) == {
        ("per_host", "ok", "alpha"): 1,
        ("per_host", "ok", "beta"): 1,
    }
    assert connect_counts(metric_reader) == {"alpha": 2, "beta": 2}


async def test_queue_timed_connector_constraint_decided_when_wait_starts(
    two_hosts: tuple[GatedServer, GatedServer],
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """With both limits finite, a full host waits as `per_host`, a full pool as `total`."""
    first, second = two_hosts
    connector = timed_connector(pool_telemetry, limit=2, limit_per_host=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        a1 = asyncio.create_task(fetch(session, f"{first.url}/hold", label="a"))
        await first.until_held(1)
        a2 = asyncio.create_task(fetch(session, f"{first.url}/hold", label="a"))
        await eventually(lambda: queued(connector) == 1, "a2 queued behind its host")
        b1 = asyncio.create_task(fetch(session, f"{second.url}/hold", label="b"))
        await second.until_held(1)
        b2 = asyncio.create_task(fetch(session, f"{second.url}/hold", label="b"))
        await eventually(lambda: queued(connector) == 2, "b2 queued behind the pool")
        first.open()
        second.open()
        assert await asyncio.gather(a1, a2, b1, b2) == ["ok"] * 4
    assert queue_waits(metric_reader) == {("per_host", "ok", "a"): 1, ("total", "ok", "b"): 1}


@pytest.mark.parametrize(
    ("abandon", "raised"),
    [(timeout_while_queued, asyncio.TimeoutError), (cancel_while_queued, asyncio.CancelledError)],
    ids=["connect-timeout", "cancelled"],
)
async def test_queue_timed_connector_abandoned_while_queued(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
    abandon: Any,
    raised: type[BaseException],
) -> None:
    """A wait given up while queued (a connect timeout, or the task cancelled) records
    `abandoned` once, raises exactly what plain aiohttp raises, and leaves no waiter; both
    connects were counted."""
    plain = aiohttp.TCPConnector(limit=1)
    timed = timed_connector(pool_telemetry, limit=1)
    plain_error, plain_session, plain_holder = await abandon(plain, server)
    timed_error, timed_session, timed_holder = await abandon(timed, server)
    try:
        same_failure(plain_error, timed_error)
        assert isinstance(timed_error, raised)
        assert queued(plain) == queued(timed) == 0
        server.open()
        assert await asyncio.gather(plain_holder, timed_holder) == ["ok", "ok"]
    finally:
        await plain_session.close()
        await timed_session.close()
    assert queue_waits(metric_reader) == {("total", "abandoned", "external"): 1}
    assert connect_counts(metric_reader) == {"external": 2}


async def test_queue_timed_connector_failed_connect_counted_and_raised_as_plain(
    pool_telemetry: PoolTelemetry, metric_reader: InMemoryMetricReader
) -> None:
    """A connect that fails (nothing listens) raises as plain aiohttp and is still counted."""
    results = []
    for connector in (aiohttp.TCPConnector(), timed_connector(pool_telemetry)):
        async with aiohttp.ClientSession(connector=connector) as session:
            results.append(await outcome(fetch(session, "http://127.0.0.1:9/", label="gone")))
    same_failure(*results)
    assert isinstance(results[1], aiohttp.ClientConnectionError)
    assert connect_counts(metric_reader) == {"gone": 1}


async def test_queue_timed_connector_redirect_hops_wait_separately(
    two_hosts: tuple[GatedServer, GatedServer],
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A redirected request that queues before each hop records one sample per hop."""
    first, second = two_hosts
    connector = timed_connector(pool_telemetry, limit=0, limit_per_host=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        holders = [
            asyncio.create_task(fetch(session, f"{first.url}/hold", label="holder")),
            asyncio.create_task(fetch(session, f"{second.url}/hold", label="holder")),
        ]
        await first.until_held(1)
        await second.until_held(1)
        redirected = asyncio.create_task(
            fetch(session, f"{first.url}/redirect?to={second.url}/hold", label="hop")
        )
        await eventually(lambda: queued(connector) == 1, "first hop queued")
        first.open()
        # The first hop gets its slot, is redirected and queues again behind the second host.
        await eventually(lambda: first.requests == 2 and queued(connector) == 1, "second hop")
        second.open()
        assert await asyncio.gather(redirected, *holders) == ["ok"] * 3
    assert queue_waits(metric_reader) == {("per_host", "ok", "hop"): 2}
    assert connect_counts(metric_reader) == {"holder": 2, "hop": 2}


async def test_queue_timed_connector_retry_records_its_own_sample(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """An attempt abandoned by its timeout and the retry that then waits are two samples."""
    connector = timed_connector(pool_telemetry, limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        holder = asyncio.create_task(fetch(session, f"{server.url}/hold", label="holder"))
        await server.until_held(1)
        first = await outcome(
            fetch(session, server.url, label="retry", timeout=aiohttp.ClientTimeout(connect=0.05))
        )
        assert isinstance(first, asyncio.TimeoutError)
        retry = asyncio.create_task(fetch(session, server.url, label="retry"))
        await eventually(lambda: queued(connector) == 1, "the retry queued")
        server.open()
        assert await asyncio.gather(holder, retry) == ["ok", "ok"]
    assert queue_waits(metric_reader) == {
        ("total", "abandoned", "retry"): 1,
        ("total", "ok", "retry"): 1,
    }
    assert connect_counts(metric_reader) == {"holder": 1, "retry": 2}


# --- connect() -------------------------------------------------------------------------------


class _RecordingConnector(aiohttp.TCPConnector):
    """Sits between QueueTimedTCPConnector and TCPConnector and records what it is given."""

    telemetry: PoolTelemetry

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[ClientRequest, tuple[Any, ...], dict[str, Any], dict[str, int]]]
        self.calls = []

    async def connect(self, req: ClientRequest, *args: Any, **kwargs: Any) -> Connection:
        self.calls.append((req, args, dict(kwargs), self.telemetry.connect_counts()))
        # Pass on only what this aiohttp understands, so the "future" arguments in the test
        # reach this layer unchanged without breaking the real connect underneath.
        known = {k: v for k, v in kwargs.items() if k in {"traces", "timeout"}}
        return await super().connect(req, *args[:2], **known)


class _ProbeConnector(QueueTimedTCPConnector, _RecordingConnector):
    """MRO: QueueTimedTCPConnector, then _RecordingConnector, then aiohttp's TCPConnector."""


async def test_queue_timed_connector_connect_forwards_all_arguments(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """connect() counts first, then passes the caller's arguments, as given, to the next class."""
    assert _ProbeConnector.__mro__[1:3] == (QueueTimedTCPConnector, _RecordingConnector)
    connector = _ProbeConnector()
    connector._nemo_gym_attach(pool_telemetry)
    connector.telemetry = pool_telemetry
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await fetch(session, server.url) == "ok"
        req, args, kwargs, counts = connector.calls[0]
        assert counts == {"external": 1}
        assert len(args) == 2
        assert kwargs == {}

        traces: list[Any] = []
        timeout = aiohttp.ClientTimeout(total=5)
        for call in (
            lambda: connector.connect(req, traces, timeout),
            lambda: connector.connect(req, traces=traces, timeout=timeout),
        ):
            conn = await call()
            try:
                _, args, kwargs, _counts = connector.calls[-1]
                assert args[0] is traces
                assert args[1] is timeout
                assert kwargs == {}
            finally:
                conn.release()
        assert [counts for *_, counts in connector.calls] == [
            {"external": 1},
            {"external": 2},
            {"external": 3},
        ]
    assert connect_counts(metric_reader) == {"external": 3}


async def test_queue_timed_connector_connect_refuses_what_aiohttp_refuses(
    pool_telemetry: PoolTelemetry,
) -> None:
    """An argument aiohttp's connect() does not take is a TypeError at the call, as for aiohttp,
    and is not counted."""
    plain = aiohttp.TCPConnector()
    timed = QueueTimedTCPConnector()
    timed._nemo_gym_attach(pool_telemetry)
    try:
        for connector in (plain, timed):
            with pytest.raises(TypeError, match="unexpected keyword argument 'future_keyword'"):
                connector.connect(None, [], None, future_keyword=1)  # type: ignore[call-arg,arg-type]
        assert pool_telemetry.connect_counts() == {}
    finally:
        await plain.close()
        await timed.close()


# --- labels ----------------------------------------------------------------------------------


async def test_set_server_name_cap_turns_extra_names_into_other(
    server: GatedServer,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Beyond the provider's cap of distinct names, labels become `other`, with one warning."""
    telemetry = PoolTelemetry.of(meter_provider, version="test", max_server_names=2)
    caplog.set_level(logging.WARNING, logger=TELEMETRY_LOGGER)
    connector = timed_connector(telemetry, limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await fetch(session, server.url, label="a") == "ok"
        assert await fetch(session, server.url, label="b") == "ok"
        requests = [
            asyncio.create_task(fetch(session, f"{server.url}/hold", label=name))
            for name in ("c", "d", "e")
        ]
        await server.until_held(1)
        await eventually(lambda: queued(connector) == 2, "d and e queued")
        server.open()
        assert await asyncio.gather(*requests) == ["ok"] * 3
        assert await fetch(session, server.url, label="a") == "ok"
    assert connect_counts(metric_reader) == {"a": 2, "b": 1, "other": 3}
    assert queue_waits(metric_reader) == {("total", "ok", "other"): 2}
    cap_warnings = [r for r in caplog.records if "MAX_SERVER_NAMES" in r.getMessage()]
    assert len(cap_warnings) == 1


@pytest.mark.parametrize("bad", ["", None, 3])
def test_set_server_name_rejects_bad_names(bad: Any) -> None:
    """An empty or non-string destination name raises ValueError naming the value."""
    with pytest.raises(ValueError, match="server_name="):
        set_server_name(bad)


def test_set_server_name_reset_restores_previous() -> None:
    """reset_server_name restores the label that was current before set_server_name."""
    assert connection_pool._SERVER_NAME.get() == "external"
    outer = set_server_name("outer")
    inner = set_server_name("inner")
    assert connection_pool._SERVER_NAME.get() == "inner"
    reset_server_name(inner)
    assert connection_pool._SERVER_NAME.get() == "outer"
    reset_server_name(outer)
    assert connection_pool._SERVER_NAME.get() == "external"
