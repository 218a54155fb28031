"""QueueTimedTCPConnector against real loopback servers and the real OpenTelemetry SDK."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from opentelemetry import context as otel_context
from opentelemetry import metrics
from opentelemetry.metrics import Histogram
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.test.globals_test import reset_metrics_globals
from opentelemetry.util.types import Attributes

from opentelemetry.instrumentation.nemo_gym import _aiohttp_compat
from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    ATTR_QUEUE_CONSTRAINT,
    ATTR_QUEUE_OUTCOME,
    ATTR_SERVER_NAME,
    CONNECT_TOTAL,
    QUEUE_DURATION,
    QUEUE_DURATION_BUCKETS,
    ConnectionPoolInstruments,
    active_instruments,
    bind_instruments,
    instruments_for,
)
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    build_connection_pool_connector,
    reset_server_name,
    set_server_name,
)

POOL_LOGGER = connection_pool.__name__


@pytest.fixture(autouse=True)
def _fresh_pool_state() -> Iterator[None]:
    """Each test starts with no connect counts, labels or bound instruments."""
    connection_pool._reset_for_tests()
    bind_instruments(None)
    yield
    bind_instruments(None)
    connection_pool._reset_for_tests()


@pytest.fixture
def bound(meter_provider: MeterProvider) -> MeterProvider:
    """Bind the test's SDK meter provider's instruments for connectors built in the test."""
    bind_instruments(instruments_for(meter_provider))
    return meter_provider


@pytest.fixture
def clean_metrics_globals() -> Iterator[None]:
    """Start and end with the API's proxy meter provider as the global one."""
    reset_metrics_globals()
    yield
    reset_metrics_globals()


# --- helpers ---------------------------------------------------------------------------------


def _metric_points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    if data is None:
        return []
    return [
        point
        for resource_metrics in data.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def _attrs(point: Any) -> dict[str, Any]:
    return dict(point.attributes or {})


def _queue_points(reader: InMemoryMetricReader) -> list[HistogramDataPoint]:
    return [p for p in _metric_points(reader, QUEUE_DURATION) if p.count]


def _connects(reader: InMemoryMetricReader) -> dict[str, int]:
    return {
        str(_attrs(p)[ATTR_SERVER_NAME]): p.value for p in _metric_points(reader, CONNECT_TOTAL)
    }


def _wait_attrs(constraint: str, outcome: str, name: str) -> dict[str, str]:
    return {
        ATTR_QUEUE_CONSTRAINT: constraint,
        ATTR_QUEUE_OUTCOME: outcome,
        ATTR_SERVER_NAME: name,
    }


async def _wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


async def _fetch(
    session: aiohttp.ClientSession, url: str, client_timeout: aiohttp.ClientTimeout | None = None
) -> str:
    kwargs: dict[str, Any] = {} if client_timeout is None else {"timeout": client_timeout}
    async with session.get(url, **kwargs) as response:
        return await response.text()


async def _fetch_as(session: aiohttp.ClientSession, url: str, name: str) -> str:
    token = set_server_name(name)
    try:
        return await _fetch(session, url)
    finally:
        reset_server_name(token)


async def _timeout_while_queued(
    connector: aiohttp.TCPConnector, server: Any
) -> tuple[type[BaseException], int]:
    """One request holds the only slot; a second times out (connect=) while queued."""
    async with aiohttp.ClientSession(connector=connector) as session:
        holder = asyncio.create_task(_fetch(session, f"{server.url}/?delay=0.5"))
        await _wait_until(lambda: server.in_flight == 1)
        caught: BaseException | None = None
        try:
            await _fetch(session, server.url, aiohttp.ClientTimeout(connect=0.05))
        except BaseException as error:
            caught = error
        assert await holder == "ok"
        waiters = _aiohttp_compat.waiter_count(connector)
    assert caught is not None
    assert waiters is not None
    return type(caught), waiters


async def _cancelled_while_queued(
    connector: aiohttp.TCPConnector, server: Any
) -> tuple[type[BaseException], int]:
    """One request holds the only slot; a second is cancelled while queued."""
    async with aiohttp.ClientSession(connector=connector) as session:
        holder = asyncio.create_task(_fetch(session, f"{server.url}/?delay=0.3"))
        await _wait_until(lambda: server.in_flight == 1)
        queued = asyncio.create_task(_fetch(session, server.url))
        await _wait_until(lambda: _aiohttp_compat.waiter_count(connector) == 1)
        queued.cancel()
        caught: BaseException | None = None
        try:
            await queued
        except BaseException as error:
            caught = error
        assert await holder == "ok"
        waiters = _aiohttp_compat.waiter_count(connector)
    assert caught is not None
    assert waiters is not None
    return type(caught), waiters


class _ExplodingHistogram(Histogram):
    """An API histogram whose ``record`` fails, as a broken exporter pipeline might."""

    def __init__(self) -> None:
        # The API's abstract __init__ has no body worth calling.
        self.calls = 0

    def record(
        self,
        amount: int | float,
        attributes: Attributes = None,
        context: otel_context.Context | None = None,
    ) -> None:
        self.calls += 1
        raise RuntimeError("histogram exploded")


class _BrokenMeterProvider(MeterProvider):
    """An SDK meter provider that cannot hand out meters."""

    def get_meter(self, *args: Any, **kwargs: Any) -> metrics.Meter:
        raise RuntimeError("no meters today")


# --- queue waits -----------------------------------------------------------------------------


async def test_queue_timed_connector_saturated_total_limit(
    loopback_server: Any, metric_reader: InMemoryMetricReader, bound: MeterProvider
) -> None:
    """Each request queued behind an exhausted total limit records one `total`/`ok` sample."""
    server = await loopback_server("127.0.0.1", 0.2)
    connector = QueueTimedTCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        token = set_server_name("model-a")
        try:
            results = await asyncio.gather(*(_fetch(session, server.url) for _ in range(3)))
        finally:
            reset_server_name(token)
    assert results == ["ok", "ok", "ok"]
    assert server.max_in_flight == 1
    points = _queue_points(metric_reader)
    assert len(points) == 1
    (point,) = points
    assert _attrs(point) == _wait_attrs("total", "ok", "model-a")
    assert point.count == 2
    # The first queued request waits about one server delay (200 ms), the second about two.
    assert point.min >= 150
    assert point.max >= 300
    assert tuple(point.explicit_bounds) == QUEUE_DURATION_BUCKETS
    assert _connects(metric_reader) == {"model-a": 3}


async def test_queue_timed_connector_no_sample_when_slot_free(
    loopback_server: Any, metric_reader: InMemoryMetricReader, bound: MeterProvider
) -> None:
    """Requests that find a free slot record no queue sample but are counted as connects."""
    server = await loopback_server("127.0.0.1", 0.0)
    connector = QueueTimedTCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await _fetch(session, server.url) == "ok"
        assert await _fetch(session, server.url) == "ok"
    assert _queue_points(metric_reader) == []
    assert _connects(metric_reader) == {"external": 2}


async def test_queue_timed_connector_per_host_limit_two_destinations(
    loopback_server: Any, metric_reader: InMemoryMetricReader, bound: MeterProvider
) -> None:
    """Under an unlimited total, a per-host limit waits as `per_host`, per destination label."""
    first = await loopback_server("127.0.0.1", 0.15)
    second = await loopback_server("127.0.0.2", 0.15)
    connector = QueueTimedTCPConnector(limit=0, limit_per_host=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        results = await asyncio.gather(
            _fetch_as(session, first.url, "alpha"),
            _fetch_as(session, first.url, "alpha"),
            _fetch_as(session, second.url, "beta"),
            _fetch_as(session, second.url, "beta"),
        )
    assert list(results) == ["ok"] * 4
    assert (first.max_in_flight, second.max_in_flight) == (1, 1)
    by_label = {str(_attrs(p)[ATTR_SERVER_NAME]): p for p in _queue_points(metric_reader)}
    assert set(by_label) == {"alpha", "beta"}
    for name, point in by_label.items():
        assert _attrs(point) == _wait_attrs("per_host", "ok", name)
        assert point.count == 1
    assert _connects(metric_reader) == {"alpha": 2, "beta": 2}


async def test_queue_timed_connector_connect_timeout_while_queued(
    loopback_server: Any, metric_reader: InMemoryMetricReader, bound: MeterProvider
) -> None:
    """A connect timeout while queued records `abandoned` and raises what plain aiohttp raises."""
    server = await loopback_server("127.0.0.1", 0.0)
    plain_error, plain_waiters = await _timeout_while_queued(aiohttp.TCPConnector(limit=1), server)
    assert _queue_points(metric_reader) == []

    timed_error, timed_waiters = await _timeout_while_queued(
        QueueTimedTCPConnector(limit=1), server
    )
    assert timed_error is plain_error
    assert issubclass(timed_error, asyncio.TimeoutError)
    assert timed_waiters == plain_waiters == 0
    (point,) = _queue_points(metric_reader)
    assert _attrs(point) == _wait_attrs("total", "abandoned", "external")
    assert point.count == 1
    assert point.min >= 40


async def test_queue_timed_connector_cancelled_while_queued(
    loopback_server: Any, metric_reader: InMemoryMetricReader, bound: MeterProvider
) -> None:
    """A task cancelled while queued records `abandoned`, sees CancelledError, leaves no waiter."""
    server = await loopback_server("127.0.0.1", 0.0)
    plain_error, plain_waiters = await _cancelled_while_queued(
        aiohttp.TCPConnector(limit=1), server
    )
    timed_error, timed_waiters = await _cancelled_while_queued(
        QueueTimedTCPConnector(limit=1), server
    )
    assert timed_error is plain_error is asyncio.CancelledError
    assert timed_waiters == plain_waiters == 0
    (point,) = _queue_points(metric_reader)
    assert _attrs(point) == _wait_attrs("total", "abandoned", "external")
    assert point.count == 1


# --- telemetry failures never reach the application ------------------------------------------


async def test_queue_timed_connector_exploding_histogram_changes_nothing(
    loopback_server: Any,
    meter_provider: MeterProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A histogram whose record raises leaves responses and exceptions as they were."""
    histogram = _ExplodingHistogram()
    real = instruments_for(meter_provider)
    bind_instruments(ConnectionPoolInstruments(histogram, real.connect_total))
    server = await loopback_server("127.0.0.1", 0.1)
    caplog.set_level(logging.DEBUG, logger=POOL_LOGGER)

    connector = QueueTimedTCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        results = await asyncio.gather(*(_fetch(session, server.url) for _ in range(3)))
    assert results == ["ok", "ok", "ok"]

    plain_error, _ = await _timeout_while_queued(aiohttp.TCPConnector(limit=1), server)
    timed_error, waiters = await _timeout_while_queued(QueueTimedTCPConnector(limit=1), server)
    assert timed_error is plain_error
    assert waiters == 0
    assert histogram.calls == 3
    failures = [r for r in caplog.records if r.name == POOL_LOGGER and "failed" in r.message]
    assert len(failures) == 1
    assert failures[0].levelno == logging.DEBUG


async def test_queue_timed_connector_broken_meter_provider_changes_nothing(
    loopback_server: Any, clean_metrics_globals: None
) -> None:
    """A global SDK meter provider that cannot make meters still leaves a working connector."""
    provider = _BrokenMeterProvider(metric_readers=[InMemoryMetricReader()])
    metrics.set_meter_provider(provider)
    try:
        server = await loopback_server("127.0.0.1", 0.05)
        connector = QueueTimedTCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            results = await asyncio.gather(*(_fetch(session, server.url) for _ in range(2)))
        assert results == ["ok", "ok"]
    finally:
        provider.shutdown()


# --- connect() -------------------------------------------------------------------------------


class _RecordingConnector(aiohttp.TCPConnector):
    """Sits between QueueTimedTCPConnector and TCPConnector and records what it is given."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[ClientRequest, tuple[Any, ...], dict[str, Any], dict[str, int]]]
        self.calls = []

    async def connect(self, req: ClientRequest, *args: Any, **kwargs: Any) -> Connection:
        counts = connection_pool._connect_count_snapshot()
        self.calls.append((req, args, dict(kwargs), counts))
        # Pass on only what this aiohttp understands, so the "future" arguments in the test
        # reach this layer unchanged without breaking the real connect underneath.
        known = {k: v for k, v in kwargs.items() if k in {"traces", "timeout"}}
        return await super().connect(req, *args[:2], **known)


class _ProbeConnector(QueueTimedTCPConnector, _RecordingConnector):
    """MRO: QueueTimedTCPConnector, then _RecordingConnector, then aiohttp's TCPConnector."""


async def test_queue_timed_connector_connect_forwards_all_arguments(
    loopback_server: Any, metric_reader: InMemoryMetricReader, bound: MeterProvider
) -> None:
    """connect() counts first, then forwards every positional and keyword argument as given."""
    assert _ProbeConnector.__mro__[1:3] == (QueueTimedTCPConnector, _RecordingConnector)
    server = await loopback_server("127.0.0.1", 0.0)
    connector = _ProbeConnector()
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await _fetch(session, server.url) == "ok"
        req, _args, session_kwargs, counts = connector.calls[0]
        assert counts == {"external": 1}
        assert {"traces", "timeout"} <= set(session_kwargs)

        traces: list[Any] = []
        timeout = aiohttp.ClientTimeout(total=5)
        marker = object()
        conn = await connector.connect(req, traces, timeout, marker, future_keyword=marker)
        try:
            _, args, kwargs, counts = connector.calls[1]
            assert len(args) == 3
            assert args[0] is traces
            assert args[1] is timeout
            assert args[2] is marker
            assert kwargs == {"future_keyword": marker}
            assert kwargs["future_keyword"] is marker
            assert counts == {"external": 2}
        finally:
            conn.release()
    assert _connects(metric_reader) == {"external": 2}


async def test_queue_timed_connector_counts_failed_connects(
    metric_reader: InMemoryMetricReader, bound: MeterProvider
) -> None:
    """A connect that fails (nothing listens on the port) is counted under its label."""
    connector = QueueTimedTCPConnector()
    async with aiohttp.ClientSession(connector=connector) as session:
        token = set_server_name("gone")
        try:
            with pytest.raises(aiohttp.ClientConnectionError):
                await _fetch(session, "http://127.0.0.1:9/")
        finally:
            reset_server_name(token)
    assert _connects(metric_reader) == {"gone": 1}


def test_queue_wait_override_matches_aiohttp_signature() -> None:
    """Our _wait_for_available_connection has aiohttp's parameter names, kinds and defaults."""

    def shape(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
        parameters = inspect.signature(function).parameters.values()
        return [(p.name, p.kind, p.default) for p in parameters]

    theirs = aiohttp.TCPConnector._wait_for_available_connection
    ours = QueueTimedTCPConnector._wait_for_available_connection
    assert _aiohttp_compat.has_queue_wait_hook()
    assert inspect.iscoroutinefunction(theirs)
    assert inspect.iscoroutinefunction(ours)
    assert shape(ours) == shape(theirs)


def test_queue_timed_connector_connect_accepts_aiohttp_parameters() -> None:
    """Every parameter aiohttp's connect() takes can be passed to ours by position or name."""
    theirs = inspect.signature(aiohttp.TCPConnector.connect).parameters
    ours = inspect.signature(QueueTimedTCPConnector.connect).parameters
    assert list(ours)[:2] == list(theirs)[:2] == ["self", "req"]
    kinds = [p.kind for p in ours.values()]
    assert kinds[2:] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]


# --- labels ----------------------------------------------------------------------------------


async def test_set_server_name_cap_turns_extra_names_into_other(
    loopback_server: Any,
    metric_reader: InMemoryMetricReader,
    bound: MeterProvider,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Beyond OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES distinct names, labels become `other`."""
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES", "2")
    connection_pool._reset_for_tests()
    caplog.set_level(logging.WARNING, logger=POOL_LOGGER)
    server = await loopback_server("127.0.0.1", 0.1)
    connector = QueueTimedTCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await _fetch_as(session, server.url, "a") == "ok"
        assert await _fetch_as(session, server.url, "b") == "ok"
        results = await asyncio.gather(
            *(_fetch_as(session, server.url, name) for name in ("c", "d", "e"))
        )
        assert await _fetch_as(session, server.url, "a") == "ok"
    assert results == ["ok"] * 3
    assert _connects(metric_reader) == {"a": 2, "b": 1, "other": 3}
    (point,) = _queue_points(metric_reader)
    assert _attrs(point) == _wait_attrs("total", "ok", "other")
    assert point.count == 2
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


# --- which connector, which instruments ------------------------------------------------------


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


async def test_build_connection_pool_connector_exporting_is_timed(
    loopback_server: Any,
    global_meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """An SDK provider with a reader gets the timed connector, recording into that provider."""
    server = await loopback_server("127.0.0.1", 0.1)
    connector = build_connection_pool_connector(limit=1, limit_per_host=0)
    assert type(connector) is QueueTimedTCPConnector
    assert (connector.limit, connector.limit_per_host) == (1, 0)
    async with aiohttp.ClientSession(connector=connector) as session:
        results = await asyncio.gather(*(_fetch(session, server.url) for _ in range(2)))
    assert results == ["ok", "ok"]
    (point,) = _queue_points(metric_reader)
    assert _attrs(point) == _wait_attrs("total", "ok", "external")


def test_instruments_for_same_provider_returns_same_instruments(
    meter_provider: MeterProvider,
) -> None:
    """Instruments are created once per meter provider and reused."""
    first = instruments_for(meter_provider)
    assert instruments_for(meter_provider) is first
    other = MeterProvider()
    try:
        assert instruments_for(other) is not first
    finally:
        other.shutdown()


def test_active_instruments_prefers_bound_then_global(
    global_meter_provider: MeterProvider, meter_provider: MeterProvider
) -> None:
    """active_instruments returns the bound set, else the global provider's instruments."""
    assert active_instruments() is instruments_for(global_meter_provider)
    other = MeterProvider()
    try:
        bound_set = instruments_for(other)
        bind_instruments(bound_set)
        assert active_instruments() is bound_set
        bind_instruments(None)
        assert active_instruments() is instruments_for(global_meter_provider)
    finally:
        other.shutdown()


async def test_queue_timed_connector_keeps_instruments_from_construction(
    loopback_server: Any, meter_provider: MeterProvider, metric_reader: InMemoryMetricReader
) -> None:
    """A connector keeps recording into the instruments bound when it was constructed."""
    bind_instruments(instruments_for(meter_provider))
    connector = QueueTimedTCPConnector(limit=1)
    other_reader = InMemoryMetricReader()
    other = MeterProvider(metric_readers=[other_reader])
    try:
        bind_instruments(instruments_for(other))
        server = await loopback_server("127.0.0.1", 0.1)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(_fetch(session, server.url) for _ in range(2)))
        assert len(_queue_points(metric_reader)) == 1
        assert _queue_points(other_reader) == []
    finally:
        other.shutdown()


# --- the compat module -----------------------------------------------------------------------


class _Opaque:
    """An object without any of aiohttp's private connector attributes."""


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({"_limit": 2, "_acquired": {1, 2}}, "total"),
        ({"_limit": 2, "_acquired": {1}}, "per_host"),
        ({"_limit": 0, "_acquired": {1, 2, 3}}, "per_host"),
        ({"_limit": 2}, "unknown"),
        ({"_limit": "2", "_acquired": {1, 2}}, "unknown"),
        ({"_limit": True, "_acquired": {1}}, "unknown"),
        ({}, "unknown"),
    ],
)
def test_connector_queue_constraint_classifies_state(state: dict[str, Any], expected: str) -> None:
    """The constraint is `total` only for a finite exhausted total, `unknown` if unreadable."""
    subject = _Opaque()
    for name, value in state.items():
        setattr(subject, name, value)
    assert connection_pool._connector_queue_constraint(subject) == expected


def test_waiter_count_unreadable_is_none() -> None:
    """waiter_count answers None rather than raising when the shape is unexpected."""
    subject = _Opaque()
    assert _aiohttp_compat.waiter_count(subject) is None
    subject._waiters = {"k": 3}  # type: ignore[attr-defined]
    assert _aiohttp_compat.waiter_count(subject) is None
