"""``_aiohttp_compat``, the one reader of aiohttp's private connector state, on real connectors.

CI runs this file on the lowest supported aiohttp (3.10.11) and the newest: when aiohttp
changes the shape of ``_limit``, ``_acquired``, ``_conns`` or ``_waiters``, these fail first.
A "future aiohttp" whose overridden methods changed signature is the real ``TCPConnector``
with one method replaced for the test (restored after): the timed connector must stay off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from yarl import URL

from conftest import GatedServerFactory, eventually, queued
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry import _aiohttp_compat, connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry._aiohttp_compat import (
    PoolState,
    destination,
    override_mismatch,
    pool_state,
    queue_constraint,
)
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    build_connection_pool_connector,
)


async def get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as response:
        return await response.text()


def connection_key(url: str) -> Any:
    """aiohttp's own ConnectionKey for ``url``, as its connector would see it."""
    request = aiohttp.ClientRequest("GET", URL(url), loop=asyncio.get_running_loop())
    return request.connection_key


# --- queue_constraint ------------------------------------------------------------------------


async def test_queue_constraint_real_connector_states(gated_server: GatedServerFactory) -> None:
    """A full finite pool is `total`; a pool with free total slots or no total limit `per_host`."""
    server = await gated_server("127.0.0.1")
    full = aiohttp.TCPConnector(limit=2)
    roomy = aiohttp.TCPConnector(limit=3, limit_per_host=2)
    unlimited = aiohttp.TCPConnector(limit=0, limit_per_host=2)
    sessions = [aiohttp.ClientSession(connector=c) for c in (full, roomy, unlimited)]
    try:
        assert [queue_constraint(c) for c in (full, roomy, unlimited)] == ["per_host"] * 3
        held = [
            asyncio.create_task(get(session, f"{server.url}/hold"))
            for session in sessions
            for _ in range(2)
        ]
        await server.until_held(6)
        assert queue_constraint(full) == "total"
        assert queue_constraint(roomy) == "per_host"
        assert queue_constraint(unlimited) == "per_host"
        server.open()
        assert await asyncio.gather(*held) == ["ok"] * 6
    finally:
        for session in sessions:
            await session.close()


class _Opaque:
    """An object without any of aiohttp's private connector attributes."""


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({"_limit": 2, "_acquired": {1, 2}}, "total"),
        ({"_limit": 2, "_acquired": {1}}, "per_host"),
        ({"_limit": 0, "_acquired": {1, 2, 3}}, "per_host"),
        ({"_limit": 2}, "unknown"),
        ({"_limit": -1, "_acquired": set()}, "unknown"),
        ({"_limit": "2", "_acquired": {1, 2}}, "unknown"),
        ({"_limit": True, "_acquired": {1}}, "unknown"),
        ({"_limit": 2, "_acquired": 5}, "unknown"),
        ({}, "unknown"),
    ],
)
def test_queue_constraint_unexpected_shapes(state: dict[str, Any], expected: str) -> None:
    """`total` only for a finite exhausted total; any shape it cannot read is `unknown`."""
    subject = _Opaque()
    for name, value in state.items():
        setattr(subject, name, value)
    assert queue_constraint(subject) == expected


class _Unsized(set[object]):
    def __len__(self) -> int:
        raise RuntimeError("cannot count")


class _ExplodingLimit:
    @property
    def _limit(self) -> int:
        raise OSError("limit unreadable")


@pytest.mark.parametrize("subject", [_ExplodingLimit(), type("U", (), {"_limit": 1})()])
def test_queue_constraint_any_exception_is_unknown(subject: Any) -> None:
    """Whatever reading the connector raises (not just TypeError), the answer is `unknown`."""
    if not isinstance(subject, _ExplodingLimit):
        subject._acquired = _Unsized({1})
    assert queue_constraint(subject) == "unknown"


# --- destination -----------------------------------------------------------------------------


async def test_destination_of_real_connection_keys() -> None:
    """server.address, server.port (defaulted by scheme) and url.scheme of aiohttp's keys."""
    assert destination(connection_key("http://127.0.0.2:8123/x")) == ("127.0.0.2", 8123, "http")
    assert destination(connection_key("http://example.test/")) == ("example.test", 80, "http")
    assert destination(connection_key("https://example.test/")) == ("example.test", 443, "https")
    assert destination(connection_key("https://[::1]:8443/")) == ("::1", 8443, "https")


class _Key:
    def __init__(self, host: Any, port: Any, is_ssl: Any) -> None:
        self.host, self.port, self.is_ssl = host, port, is_ssl


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (_Key("h", None, True), ("h", 443, "https")),
        (_Key("h", None, False), ("h", 80, "http")),
        (_Key("h", "81", False), ("h", 80, "http")),
        (_Key(None, 80, False), None),
        (_Key(b"h", 80, False), None),
        (object(), None),
        (None, None),
    ],
)
def test_destination_odd_keys(key: Any, expected: Any) -> None:
    """A key without a string host has no destination; a missing port follows the scheme."""
    assert destination(key) == expected


# --- pool_state ------------------------------------------------------------------------------


async def test_pool_state_real_connector_active_idle_waiting(
    gated_server: GatedServerFactory,
) -> None:
    """Held, kept-alive and queued requests on two destinations, read from a real connector."""
    a = await gated_server("127.0.0.1")
    b = await gated_server("127.0.0.2")
    connector = QueueTimedTCPConnector(limit=2, limit_per_host=0)
    destinations = connector._nemo_gym_counts.destinations
    where_a, where_b = ("127.0.0.1", a.port, "http"), ("127.0.0.2", b.port, "http")
    async with aiohttp.ClientSession(connector=connector) as session:
        assert pool_state(connector, destinations) == PoolState()
        assert await get(session, a.url) == "ok"  # leaves one idle connection to a
        held = [asyncio.create_task(get(session, f"{b.url}/hold")) for _ in range(3)]
        await b.until_held(2)  # an idle connection to a takes no slot, and serves only a
        await eventually(lambda: queued(connector) == 1, "one request to b queued")
        state = pool_state(connector, destinations)
        assert state.active == {where_b: 2}
        assert state.idle == {where_a: 1}
        assert state.waiting == {where_b: 1}
        # Without the map of who goes where, active connections cannot be placed.
        assert pool_state(connector, {}).active == {}
        b.open()
        assert await asyncio.gather(*held) == ["ok"] * 3
        after = pool_state(connector, destinations)
        assert after.active == {}
        assert after.waiting == {}
        assert sum(after.idle.values()) == 3
    assert pool_state(connector, destinations) == PoolState()


async def test_pool_state_plain_connector_idle_and_waiting(
    gated_server: GatedServerFactory,
) -> None:
    """On a plain TCPConnector (no destination map) idle and waiting are still read."""
    server = await gated_server("127.0.0.1")
    connector = aiohttp.TCPConnector(limit=1)
    where = ("127.0.0.1", server.port, "http")
    async with aiohttp.ClientSession(connector=connector) as session:
        held = [asyncio.create_task(get(session, f"{server.url}/hold")) for _ in range(3)]
        await server.until_held(1)
        await eventually(lambda: queued(connector) == 2, "two requests queued")
        assert pool_state(connector, {}) == PoolState(waiting={where: 2})
        server.open()
        assert await asyncio.gather(*held) == ["ok"] * 3
        assert pool_state(connector, {}) == PoolState(idle={where: 1})


def test_pool_state_unreadable_parts_left_out() -> None:
    """Parts of unexpected shape are left out; the rest is still reported; nothing raises."""
    where = ("h", 1, "http")
    key = _Key("h", 1, False)
    subject = _Opaque()
    subject._conns = [("not", "a mapping")]  # type: ignore[attr-defined]
    subject._waiters = {key: [object(), object()]}  # type: ignore[attr-defined]
    subject._acquired = ["not", "a set"]  # type: ignore[attr-defined]
    assert pool_state(subject, {}) == PoolState(waiting={where: 2})
    assert pool_state(_Opaque(), {}) == PoolState()

    class Exploding:
        @property
        def _conns(self) -> Any:
            raise RuntimeError("changed aiohttp")

    assert pool_state(Exploding(), {}) == PoolState()


def test_compat_names_module_surface() -> None:
    """The module keeps to the three readers the telemetry uses, and their constants."""
    public = {name for name in vars(_aiohttp_compat) if not name.startswith("_")}
    assert {"queue_constraint", "destination", "pool_state", "PoolState"} <= public
    assert (
        _aiohttp_compat.CONSTRAINT_TOTAL,
        _aiohttp_compat.CONSTRAINT_PER_HOST,
        _aiohttp_compat.CONSTRAINT_UNKNOWN,
    ) == ("total", "per_host", "unknown")


# --- a future aiohttp: overridden methods whose signature changed ----------------------------

TIMED_OFF = "connection-pool timing off"


@pytest.fixture
def fresh_mismatch_log() -> Iterator[None]:
    """No aiohttp mismatch remembered as logged, as in a fresh process."""
    connection_pool._MISMATCH.reset()
    yield
    connection_pool._MISMATCH.reset()


@pytest.fixture
def future_aiohttp(monkeypatch: pytest.MonkeyPatch) -> str:
    """The real ``TCPConnector.connect`` with keyword-only ``traces`` and ``timeout``, as a
    later aiohttp might have it (its session passes them by keyword); restored afterwards."""
    original = aiohttp.TCPConnector.connect

    async def connect(
        self: aiohttp.TCPConnector,
        req: aiohttp.ClientRequest,
        *,
        traces: list[Any],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - aiohttp's parameter
    ) -> Any:
        return await original(self, req, traces, timeout)

    monkeypatch.setattr(aiohttp.TCPConnector, "connect", connect)
    return "TCPConnector.connect takes (self, req, *, traces, timeout)"


def test_override_mismatch_installed_aiohttp_fits() -> None:
    """The installed aiohttp's methods have the signatures the timed connector overrides."""
    assert connection_pool.timed_connector_mismatch() is None
    assert (
        override_mismatch(aiohttp.TCPConnector, QueueTimedTCPConnector, connection_pool._OVERRIDDEN)
        is None
    )


class _WaitTakesDeadline(aiohttp.TCPConnector):
    async def _wait_for_available_connection(self, key: Any, traces: Any, deadline: Any) -> None:
        raise AssertionError("never called")


class _CreateIsPlain(aiohttp.TCPConnector):
    def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:  # type: ignore[override]
        raise AssertionError("never called")


class _NoWait(aiohttp.TCPConnector):
    _wait_for_available_connection = None  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("future", "reason"),
    [
        (
            _WaitTakesDeadline,
            "_WaitTakesDeadline._wait_for_available_connection takes "
            "(self, key, traces, deadline), the override takes (self, key, traces)",
        ),
        (_CreateIsPlain, "_CreateIsPlain._create_connection is no longer a coroutine function"),
        (_NoWait, "_NoWait._wait_for_available_connection is gone"),
    ],
    ids=["wait-takes-deadline", "create-not-async", "wait-gone"],
)
def test_override_mismatch_names_method_and_signatures(future: type, reason: str) -> None:
    """A changed parameter list, a method no longer async, or one gone: named, with both sides."""
    got = override_mismatch(future, QueueTimedTCPConnector, connection_pool._OVERRIDDEN)
    assert got == reason


async def test_instrument_future_aiohttp_signature_stays_plain(
    future_aiohttp: str,
    fresh_mismatch_log: None,
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    gated_server: GatedServerFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """aiohttp's connect changed: connectors stay plain, requests work, one warning says why."""
    caplog.set_level(logging.INFO, logger="opentelemetry.instrumentation.nemo_gym")
    server = await gated_server("127.0.0.1")
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    built = [
        aiohttp.TCPConnector(limit=1),
        QueueTimedTCPConnector(limit=1),
        build_connection_pool_connector(limit=1),
    ]
    assert [type(connector) for connector in built] == [aiohttp.TCPConnector] * 3
    for connector in built:
        async with aiohttp.ClientSession(connector=connector) as session:
            held = [asyncio.create_task(get(session, f"{server.url}/hold")) for _ in range(2)]
            await server.until_held(1)
            await eventually(lambda c=connector: queued(c) == 1, "one request queued")
            server.open()
            assert await asyncio.gather(*held) == ["ok", "ok"]
            server._gate.clear()
    async with aiohttp.ClientSession() as session:  # aiohttp's own default connector
        assert type(session.connector) is aiohttp.TCPConnector
        assert await get(session, server.url) == "ok"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert message.startswith(f"nemo_gym: {TIMED_OFF}, aiohttp.TCPConnector stays plain: ")
    assert future_aiohttp in message
    assert f"(aiohttp {aiohttp.__version__})" in message
    status = [
        r.getMessage() for r in caplog.records if "nemo_gym instrumentation:" in r.getMessage()
    ]
    assert len(status) == 1
    assert "connection_pool=off (aiohttp" in status[0]


async def test_instrument_aiohttp_restored_times_again(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """The fit is compared per set of aiohttp methods: with aiohttp's own back, pools are timed."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aiohttp.TCPConnector, "_create_connection", _CreateIsPlain._create_connection)
        assert connection_pool.timed_connector_mismatch() is not None
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    connector = aiohttp.TCPConnector()
    assert type(connector) is QueueTimedTCPConnector
    await connector.close()


# --- a future aiohttp: private pool state renamed or reshaped ---------------------------------


async def test_unreadable_state_real_connector_reads() -> None:
    """A real connector of the installed aiohttp has every attribute the pool readers use."""
    connector = aiohttp.TCPConnector()
    try:
        assert _aiohttp_compat.unreadable_state(connector) is None
    finally:
        await connector.close()


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ({"_acquired": set(), "_conns": {}, "_waiters": {}}, "the connector has no _limit"),
        (
            {"_limit": 1, "_acquired": [], "_conns": {}, "_waiters": {}},
            "the connector's _acquired is a list, not a set",
        ),
        ({"_limit": 1, "_acquired": set(), "_conns": {}}, "the connector has no _waiters"),
    ],
    ids=["limit-gone", "acquired-list", "waiters-gone"],
)
def test_unreadable_state_names_attribute(state: dict[str, Any], reason: str) -> None:
    """The first attribute that is gone or of another type is named."""
    subject = _Opaque()
    for name, value in state.items():
        setattr(subject, name, value)
    assert _aiohttp_compat.unreadable_state(subject) == reason


async def test_timed_connector_state_renamed_warns_once(
    fresh_mismatch_log: None, pool_telemetry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Three connectors bound without ``_waiters``: one warning names it, for all three."""
    caplog.set_level(logging.WARNING, logger=connection_pool.__name__)
    connectors = [aiohttp.TCPConnector() for _ in range(3)]
    for connector in connectors:
        waiters = connector.__dict__.pop("_waiters")
        QueueTimedTCPConnector._nemo_gym_attach(connector, pool_telemetry)  # type: ignore[arg-type]
        connector._waiters = waiters  # type: ignore[attr-defined]  # aiohttp's own, back
        await connector.close()
    assert [record.getMessage() for record in caplog.records] == [
        "nemo_gym: connection-pool state (open, idle and waiting connections, the queue "
        f"constraint) partly off: the connector has no _waiters (aiohttp {aiohttp.__version__})"
    ]
