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
from opentelemetry import context as otel_context
from opentelemetry import metrics
from opentelemetry.metrics import Histogram, Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.util.types import Attributes

from conftest import (
    GatedServer,
    GatedServerFactory,
    eventually,
    metric_points,
    queued,
    timed_connector,
)
from opentelemetry.instrumentation.nemo_gym.telemetry import _pool_telemetry, connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    ATTR_QUEUE_CONSTRAINT,
    ATTR_QUEUE_OUTCOME,
    ATTR_SERVER_NAME,
    CONNECT_TOTAL,
    QUEUE_DURATION,
    QUEUE_DURATION_BUCKETS,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    build_connection_pool_connector,
    reset_server_name,
    set_server_name,
)

POOL_LOGGER = connection_pool.__name__
TELEMETRY_LOGGER = _pool_telemetry.__name__


# --- helpers ---------------------------------------------------------------------------------


def waits(reader: InMemoryMetricReader) -> dict[tuple[str, str, str], int]:
    """Queue-wait sample counts per (constraint, outcome, destination label)."""
    return {
        (
            str(point.attributes[ATTR_QUEUE_CONSTRAINT]),
            str(point.attributes[ATTR_QUEUE_OUTCOME]),
            str(point.attributes[ATTR_SERVER_NAME]),
        ): point.count
        for point in metric_points(reader.get_metrics_data(), QUEUE_DURATION)
        if point.count
    }


def connects(reader: InMemoryMetricReader) -> dict[str, int]:
    """connect_total per destination label."""
    return {
        str(point.attributes[ATTR_SERVER_NAME]): point.value
        for point in metric_points(reader.get_metrics_data(), CONNECT_TOTAL)
    }


async def fetch(
    session: aiohttp.ClientSession,
    url: str,
    *,
    label: str | None = None,
    timeout: aiohttp.ClientTimeout | None = None,  # noqa: ASYNC109 - aiohttp's own timeout
) -> str:
    """GET ``url`` (under destination label ``label`` when given) and return the body."""
    token = set_server_name(label) if label is not None else None
    try:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        async with session.get(url, **kwargs) as response:
            return await response.text()
    finally:
        if token is not None:
            reset_server_name(token)


async def outcome(awaitable: Any) -> BaseException | str:
    """What awaiting ``awaitable`` gave: its result or the exception it raised."""
    try:
        return str(await awaitable)
    except BaseException as error:  # the test compares exactly what was raised
        return error


async def timeout_while_queued(
    connector: aiohttp.TCPConnector, server: GatedServer
) -> tuple[BaseException | str, aiohttp.ClientSession, asyncio.Task[str]]:
    """Hold the connector's only slot, then let a second request's connect timeout expire.

    Returns what the queued request raised, the session and the still-held request.
    """
    session = aiohttp.ClientSession(connector=connector)
    held_before = server.held
    holder = asyncio.create_task(fetch(session, f"{server.url}/hold"))
    await server.until_held(held_before + 1)
    caught = await outcome(
        fetch(session, f"{server.url}/", timeout=aiohttp.ClientTimeout(connect=0.05))
    )
    return caught, session, holder


async def cancel_while_queued(
    connector: aiohttp.TCPConnector, server: GatedServer
) -> tuple[BaseException | str, aiohttp.ClientSession, asyncio.Task[str]]:
    """Hold the connector's only slot, queue a second request and cancel it while it waits."""
    session = aiohttp.ClientSession(connector=connector)
    held_before = server.held
    holder = asyncio.create_task(fetch(session, f"{server.url}/hold"))
    await server.until_held(held_before + 1)
    waiting = asyncio.create_task(fetch(session, f"{server.url}/"))
    await eventually(lambda: queued(connector) == 1, "the second request queued")
    waiting.cancel()
    return await outcome(waiting), session, holder


def same_failure(plain: BaseException | str, timed: BaseException | str) -> None:
    """Both raised, the same exception type with the same message."""
    assert isinstance(plain, BaseException), plain
    assert isinstance(timed, BaseException), timed
    assert type(timed) is type(plain)
    assert str(timed) == str(plain)


class _ExplodingHistogram(Histogram):
    """An API histogram whose ``record`` fails, as a broken pipeline might."""

    def __init__(self) -> None:
        # The API's abstract __init__ has nothing worth calling.
        self.calls = 0

    def record(
        self,
        amount: int | float,
        attributes: Attributes = None,
        context: otel_context.Context | None = None,
    ) -> None:
        self.calls += 1
        raise RuntimeError("histogram exploded")


class _ExplodingHistogramMeter:
    """A real SDK meter except that the histograms it makes fail on ``record``."""

    def __init__(self, meter: Meter, histogram: _ExplodingHistogram) -> None:
        self._meter = meter
        self._histogram = histogram

    def create_histogram(self, *_args: Any, **_kwargs: Any) -> Histogram:
        return self._histogram

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meter, name)


class _ExplodingHistogramMeterProvider(MeterProvider):
    """An SDK meter provider whose histograms raise on every ``record``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.histogram = _ExplodingHistogram()

    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        return _ExplodingHistogramMeter(super().get_meter(*args, **kwargs), self.histogram)


class _BrokenMeterProvider(MeterProvider):
    """An SDK meter provider that cannot hand out meters."""

    def get_meter(self, *args: Any, **kwargs: Any) -> metrics.Meter:
        raise RuntimeError("no meters today")


# --- queue waits -----------------------------------------------------------------------------


async def test_queue_timed_connector_total_limit_records_each_queued_wait(
    gated_server: GatedServerFactory,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Two requests queued behind an exhausted total limit record two `total`/`ok` samples."""
    server = await gated_server("127.0.0.1")
    connector = timed_connector(pool_telemetry, limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        requests = [
            asyncio.create_task(fetch(session, f"{server.url}/hold", label="model-a"))
            for _ in range(3)
        ]
        await server.until_held(1)
        await eventually(lambda: queued(connector) == 2, "two requests queued")
        assert waits(metric_reader) == {}  # a wait is recorded when it ends
        server.open()
        assert await asyncio.gather(*requests) == ["ok"] * 3
    assert waits(metric_reader) == {("total", "ok", "model-a"): 2}
    (point,) = metric_points(metric_reader.get_metrics_data(), QUEUE_DURATION)
    assert tuple(point.explicit_bounds) == QUEUE_DURATION_BUCKETS
    assert connects(metric_reader) == {"model-a": 3}


async def test_queue_timed_connector_no_sample_when_slot_free(
    gated_server: GatedServerFactory,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Requests that find a free slot record no queue sample but are counted as connects."""
    server = await gated_server("127.0.0.1")
    connector = timed_connector(pool_telemetry, limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await fetch(session, server.url) == "ok"
        assert await fetch(session, server.url) == "ok"
    assert waits(metric_reader) == {}
    assert connects(metric_reader) == {"external": 2}


async def test_queue_timed_connector_per_host_limit_two_destinations(
    gated_server: GatedServerFactory,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Under an unlimited total, a per-host limit waits as `per_host`, per destination label."""
    first = await gated_server("127.0.0.1")
    second = await gated_server("127.0.0.2")
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
    assert waits(metric_reader) == {("per_host", "ok", "alpha"): 1, ("per_host", "ok", "beta"): 1}
    assert connects(metric_reader) == {"alpha": 2, "beta": 2}


async def test_queue_timed_connector_constraint_decided_when_wait_starts(
    gated_server: GatedServerFactory,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """With both limits finite, a full host waits as `per_host`, a full pool as `total`."""
    first = await gated_server("127.0.0.1")
    second = await gated_server("127.0.0.2")
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
    assert waits(metric_reader) == {("per_host", "ok", "a"): 1, ("total", "ok", "b"): 1}


async def test_queue_timed_connector_connect_timeout_while_queued(
    gated_server: GatedServerFactory,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A connect timeout while queued records `abandoned` and raises what plain aiohttp raises."""
    server = await gated_server("127.0.0.1")
    plain = aiohttp.TCPConnector(limit=1)
    timed = timed_connector(pool_telemetry, limit=1)
    plain_error, plain_session, plain_holder = await timeout_while_queued(plain, server)
    timed_error, timed_session, timed_holder = await timeout_while_queued(timed, server)
    try:
        same_failure(plain_error, timed_error)
        assert isinstance(timed_error, asyncio.TimeoutError)
        assert queued(plain) == queued(timed) == 0
        server.open()
        assert await asyncio.gather(plain_holder, timed_holder) == ["ok", "ok"]
    finally:
        await plain_session.close()
        await timed_session.close()
    assert waits(metric_reader) == {("total", "abandoned", "external"): 1}
    assert connects(metric_reader) == {"external": 2}


async def test_queue_timed_connector_cancelled_while_queued(
    gated_server: GatedServerFactory,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A task cancelled while queued records `abandoned`, sees CancelledError, leaves no waiter."""
    server = await gated_server("127.0.0.1")
    plain = aiohttp.TCPConnector(limit=1)
    timed = timed_connector(pool_telemetry, limit=1)
    plain_error, plain_session, plain_holder = await cancel_while_queued(plain, server)
    timed_error, timed_session, timed_holder = await cancel_while_queued(timed, server)
    try:
        assert type(plain_error) is type(timed_error) is asyncio.CancelledError
        assert queued(plain) == queued(timed) == 0
        server.open()
        assert await asyncio.gather(plain_holder, timed_holder) == ["ok", "ok"]
    finally:
        await plain_session.close()
        await timed_session.close()
    assert waits(metric_reader) == {("total", "abandoned", "external"): 1}


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
    assert connects(metric_reader) == {"gone": 1}


async def test_queue_timed_connector_redirect_hops_wait_separately(
    gated_server: GatedServerFactory,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A redirected request that queues before each hop records one sample per hop."""
    first = await gated_server("127.0.0.1")
    second = await gated_server("127.0.0.2")
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
    assert waits(metric_reader) == {("per_host", "ok", "hop"): 2}
    assert connects(metric_reader) == {"holder": 2, "hop": 2}


async def test_queue_timed_connector_retry_records_its_own_sample(
    gated_server: GatedServerFactory,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """An attempt abandoned by its timeout and the retry that then waits are two samples."""
    server = await gated_server("127.0.0.1")
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
    assert waits(metric_reader) == {
        ("total", "abandoned", "retry"): 1,
        ("total", "ok", "retry"): 1,
    }
    assert connects(metric_reader) == {"holder": 1, "retry": 2}


# --- telemetry failures never reach the application ------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 128])
async def test_queue_timed_connector_exploding_histogram_changes_nothing(
    gated_server: GatedServerFactory, caplog: pytest.LogCaptureFixture, batch_size: int
) -> None:
    """Histograms that raise on record, inline (batch of 1) or at collection, change nothing."""
    reader = InMemoryMetricReader()
    provider = _ExplodingHistogramMeterProvider(metric_readers=[reader])
    try:
        telemetry = PoolTelemetry(
            provider, version="test", max_server_names=10, batch_size=batch_size
        )
        caplog.set_level(logging.DEBUG, logger=TELEMETRY_LOGGER)
        server = await gated_server("127.0.0.1")
        plain = aiohttp.TCPConnector(limit=1)
        timed = timed_connector(telemetry, limit=1)
        plain_error, plain_session, plain_holder = await timeout_while_queued(plain, server)
        timed_error, timed_session, timed_holder = await timeout_while_queued(timed, server)
        try:
            same_failure(plain_error, timed_error)
            queued_ok = asyncio.create_task(fetch(timed_session, server.url))
            await eventually(lambda: queued(timed) == 1, "a request queued")
            server.open()
            assert await asyncio.gather(plain_holder, timed_holder, queued_ok) == ["ok"] * 3
        finally:
            await plain_session.close()
            await timed_session.close()
        reader.get_metrics_data()
        assert provider.histogram.calls == 2
        failures = [r for r in caplog.records if r.name == TELEMETRY_LOGGER]
        assert [r.levelno for r in failures] == [logging.DEBUG]
        assert "recording a queue wait" in failures[0].getMessage()
    finally:
        provider.shutdown()


async def test_queue_timed_connector_broken_global_meter_provider_changes_nothing(
    gated_server: GatedServerFactory,
) -> None:
    """A global SDK meter provider that cannot make meters still leaves a working connector."""
    from opentelemetry.test.globals_test import reset_metrics_globals

    provider = _BrokenMeterProvider(metric_readers=[InMemoryMetricReader()])
    reset_metrics_globals()
    metrics.set_meter_provider(provider)
    try:
        server = await gated_server("127.0.0.1")
        connector = QueueTimedTCPConnector(limit=1)
        assert connector._nemo_gym_pool is None
        async with aiohttp.ClientSession(connector=connector) as session:
            requests = [asyncio.create_task(fetch(session, f"{server.url}/hold")) for _ in "ab"]
            await server.until_held(1)
            await eventually(lambda: queued(connector) == 1, "one request queued")
            server.open()
            assert await asyncio.gather(*requests) == ["ok", "ok"]
        with pytest.raises(RuntimeError, match="no meters today"):
            PoolTelemetry.of(provider, version="test", max_server_names=1)
    finally:
        reset_metrics_globals()
        provider.shutdown()


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
    gated_server: GatedServerFactory,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """connect() counts first, then forwards every positional and keyword argument as given."""
    assert _ProbeConnector.__mro__[1:3] == (QueueTimedTCPConnector, _RecordingConnector)
    server = await gated_server("127.0.0.1")
    connector = _ProbeConnector()
    connector._nemo_gym_attach(pool_telemetry)
    connector.telemetry = pool_telemetry
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await fetch(session, server.url) == "ok"
        req, _args, session_kwargs, counts = connector.calls[0]
        assert counts == {"external": 1}
        assert {"traces", "timeout"} <= set(session_kwargs)

        traces: list[Any] = []
        timeout = aiohttp.ClientTimeout(total=5)
        marker = object()
        conn = await connector.connect(req, traces, timeout, marker, future_keyword=marker)
        try:
            _, args, kwargs, counts = connector.calls[1]
            assert args == (traces, timeout, marker)
            assert args[0] is traces
            assert args[1] is timeout
            assert kwargs == {"future_keyword": marker}
            assert counts == {"external": 2}
        finally:
            conn.release()
    assert connects(metric_reader) == {"external": 2}


# --- labels ----------------------------------------------------------------------------------


async def test_set_server_name_cap_turns_extra_names_into_other(
    gated_server: GatedServerFactory,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Beyond the provider's cap of distinct names, labels become `other`, with one warning."""
    telemetry = PoolTelemetry.of(meter_provider, version="test", max_server_names=2)
    caplog.set_level(logging.WARNING, logger=TELEMETRY_LOGGER)
    server = await gated_server("127.0.0.1")
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
    assert connects(metric_reader) == {"a": 2, "b": 1, "other": 3}
    assert waits(metric_reader) == {("total", "ok", "other"): 2}
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


# --- which connector, which telemetry --------------------------------------------------------


@pytest.fixture
def clean_metrics_globals() -> Any:
    """Start and end with the API's proxy meter provider as the global one."""
    from opentelemetry.test.globals_test import reset_metrics_globals

    reset_metrics_globals()
    yield
    reset_metrics_globals()


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
    async with aiohttp.ClientSession(connector=connector) as session:
        requests = [asyncio.create_task(fetch(session, f"{server.url}/hold")) for _ in "ab"]
        await server.until_held(1)
        await eventually(lambda: queued(connector) == 1, "one request queued")
        server.open()
        assert await asyncio.gather(*requests) == ["ok", "ok"]
    assert waits(metric_reader) == {("total", "ok", "external"): 1}
    assert connects(metric_reader) == {"external": 2}
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
