"""Every documented name of nemo_gym.telemetry.connection_pool exists in ours, with its
documented signature.

One deliberate departure: ``QueueTimedTCPConnector.connect`` is a plain method returning
aiohttp's coroutine (no coroutine frame of our own on the hot path). Its parameters
stay as documented; what awaiting it gives is tested against a real server.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import sys
import threading
import typing
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import pytest
from aiohttp.client_reqrep import ClientRequest, ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from yarl import URL

from conftest import GatedServerFactory
from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool as cp
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry

P = inspect.Parameter
EMPTY = inspect.Parameter.empty

# (name, kind, default, annotation) per parameter, then the return annotation, as
# nemo_gym.telemetry.connection_pool documents them.
Documented = tuple[list[tuple[str, Any, Any, Any]], Any]

DOCUMENTED_FUNCTIONS: dict[str, Documented] = {
    "_connect_count_snapshot": ([], dict[str, int]),
    "_connector_queue_constraint": ([("connector", P.POSITIONAL_OR_KEYWORD, EMPTY, Any)], str),
    "_display_limit": ([("limit", P.POSITIONAL_OR_KEYWORD, EMPTY, int)], str),
    "_effective_per_host_limit": (
        [
            ("total", P.POSITIONAL_OR_KEYWORD, EMPTY, int),
            ("per_host", P.POSITIONAL_OR_KEYWORD, EMPTY, int),
        ],
        int,
    ),
    "_ephemeral_port_capacity": ([], typing.Optional[int]),  # noqa: UP045 - as documented
    "build_connection_pool_connector": (
        [("kwargs", P.VAR_KEYWORD, EMPTY, Any)],
        aiohttp.TCPConnector,
    ),
    "connection_pool_capacity": (
        [
            ("cfg", P.POSITIONAL_OR_KEYWORD, EMPTY, cp.ConnectionPoolConfig),
            ("workers", P.POSITIONAL_OR_KEYWORD, EMPTY, int),
        ],
        cp.ConnectionPoolCapacity,
    ),
    "report_connection_pool_capacity": (
        [
            ("cfg", P.POSITIONAL_OR_KEYWORD, EMPTY, cp.ConnectionPoolConfig),
            ("capacity", P.POSITIONAL_OR_KEYWORD, EMPTY, cp.ConnectionPoolCapacity),
            ("visible", P.POSITIONAL_OR_KEYWORD, False, bool),
        ],
        None,
    ),
    "reset_server_name": (
        [("token", P.POSITIONAL_OR_KEYWORD, EMPTY, contextvars.Token[str])],
        None,
    ),
    "set_server_name": (
        [("server_name", P.POSITIONAL_OR_KEYWORD, EMPTY, str)],
        contextvars.Token[str],
    ),
}

DOCUMENTED_METHODS: dict[str, Documented] = {
    "__init__": (
        [("self", P.POSITIONAL_OR_KEYWORD, EMPTY, EMPTY), ("kwargs", P.VAR_KEYWORD, EMPTY, Any)],
        None,
    ),
    "_wait_for_available_connection": (
        [
            ("self", P.POSITIONAL_OR_KEYWORD, EMPTY, EMPTY),
            ("key", P.POSITIONAL_OR_KEYWORD, EMPTY, ConnectionKey),
            ("traces", P.POSITIONAL_OR_KEYWORD, EMPTY, list[Trace]),
        ],
        None,
    ),
}

PUBLIC_NAMES = {
    "ConnectionPoolCapacity",
    "ConnectionPoolConfig",
    "QueueTimedTCPConnector",
    "build_connection_pool_connector",
    "connection_pool_capacity",
    "report_connection_pool_capacity",
    "reset_server_name",
    "set_server_name",
}


def _shape(function: Callable[..., Any]) -> Documented:
    signature = inspect.signature(function, eval_str=True)
    parameters = [(p.name, p.kind, p.default, p.annotation) for p in signature.parameters.values()]
    return parameters, signature.return_annotation


def test_connection_pool_all_lists_public_names() -> None:
    """__all__ is exactly the page's public names."""
    assert set(cp.__all__) == PUBLIC_NAMES
    for name in cp.__all__:
        assert hasattr(cp, name)


@pytest.mark.parametrize("name", sorted(DOCUMENTED_FUNCTIONS))
def test_connection_pool_function_signature(name: str) -> None:
    """Each documented function has the documented parameters and return type."""
    assert _shape(getattr(cp, name)) == DOCUMENTED_FUNCTIONS[name]


@pytest.mark.parametrize("name", sorted(DOCUMENTED_METHODS))
def test_queue_timed_tcp_connector_method_signature(name: str) -> None:
    """QueueTimedTCPConnector's documented methods have the documented signatures."""
    assert _shape(getattr(cp.QueueTimedTCPConnector, name)) == DOCUMENTED_METHODS[name]


def test_queue_timed_tcp_connector_is_a_tcp_connector() -> None:
    """The connector is a TCPConnector whose queue wait is a coroutine function, as aiohttp's."""
    assert issubclass(cp.QueueTimedTCPConnector, aiohttp.TCPConnector)
    assert inspect.iscoroutinefunction(cp.QueueTimedTCPConnector._wait_for_available_connection)
    assert inspect.iscoroutinefunction(cp.QueueTimedTCPConnector._create_connection)


def test_queue_timed_tcp_connector_connect_reports_coroutine_function() -> None:
    """inspect.iscoroutinefunction tells the truth about connect() on every supported Python."""
    assert inspect.iscoroutinefunction(cp.QueueTimedTCPConnector.connect)


async def test_queue_timed_tcp_connector_connect_returns_awaitable_connection(
    gated_server: GatedServerFactory,
) -> None:
    """connect() returns a coroutine; awaiting it against a real server gives a Connection."""
    server = await gated_server("127.0.0.1")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    telemetry = PoolTelemetry.of(provider, version="test", max_server_names=5)
    connector = cp.QueueTimedTCPConnector()
    connector._nemo_gym_attach(telemetry)
    try:
        request = ClientRequest("GET", URL(server.url), loop=asyncio.get_running_loop())
        pending = connector.connect(request, [], aiohttp.ClientTimeout(total=30))
        assert inspect.iscoroutine(pending)
        assert inspect.isawaitable(pending)
        connection = await pending
        try:
            assert isinstance(connection, Connection)
            assert connection.protocol is not None
            assert connection.protocol.is_connected()
        finally:
            connection.release()
        assert telemetry.connect_counts() == {"external": 1}
        assert sum(telemetry.created_counts().values()) == 1
    finally:
        await connector.close()
        provider.shutdown()


def _override_shape(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    parameters = inspect.signature(function).parameters.values()
    return [(p.name, p.kind, p.default) for p in parameters]


@pytest.mark.parametrize("name", ["_wait_for_available_connection", "_create_connection"])
def test_queue_wait_override_matches_aiohttp_signature(name: str) -> None:
    """Our overrides of aiohttp's private methods have its parameter names, kinds, defaults.

    Fails when an aiohttp release changes them, before the override silently stops matching.
    """
    theirs = getattr(aiohttp.TCPConnector, name)
    ours = getattr(cp.QueueTimedTCPConnector, name)
    assert ours is not theirs
    assert inspect.iscoroutinefunction(theirs)
    assert _override_shape(ours) == _override_shape(theirs)


def test_queue_timed_tcp_connector_connect_takes_aiohttp_parameters() -> None:
    """connect() takes exactly aiohttp's parameters (names, kinds, defaults); on Python 3.12+
    it is a plain def, marked a coroutine function, returning the coroutine that awaiting gives
    a Connection, and on 3.11 an ``async def`` giving the Connection.

    nemo_gym.telemetry.connection_pool documents
    ``async connect(req, *args, **kwargs) -> Connection``. Ours departs from the letter for the
    hot path where Python lets it say the truth to ``inspect`` all the same: no coroutine frame
    of its own, and no packing and re-spreading of the arguments; every call aiohttp's
    connect() accepts, ours accepts and passes on unchanged. This test fails when an aiohttp
    release changes the parameters.
    """
    theirs = aiohttp.TCPConnector.connect
    ours = cp.QueueTimedTCPConnector.connect
    assert _override_shape(ours) == _override_shape(theirs)
    returns = Coroutine[Any, Any, Connection] if sys.version_info >= (3, 12) else Connection
    assert inspect.signature(ours, eval_str=True).return_annotation == returns


def test_connection_pool_capacity_is_named_tuple() -> None:
    """ConnectionPoolCapacity is a NamedTuple with the documented fields and types."""
    assert issubclass(cp.ConnectionPoolCapacity, tuple)
    assert typing.get_type_hints(cp.ConnectionPoolCapacity) == {
        "workers": int,
        "total": int,
        "per_host": int,
        "intended": int | None,
        "intended_per_host": int | None,
    }


def test_connection_pool_config_is_protocol() -> None:
    """ConnectionPoolConfig is a Protocol with the four documented attributes."""
    assert getattr(cp.ConnectionPoolConfig, "_is_protocol", False)
    assert typing.get_type_hints(cp.ConnectionPoolConfig) == {
        "global_aiohttp_connector_limit": int,
        "global_aiohttp_connector_limit_per_host": int,
        "global_aiohttp_intended_concurrency": int | None,
        "global_aiohttp_intended_concurrency_per_host": int | None,
    }


def test_connection_pool_module_data() -> None:
    """The documented module data exist with the documented types and defaults."""
    assert isinstance(cp._CONNECT_COUNTS, dict)
    assert isinstance(cp._CONNECT_COUNTS_LOCK, type(threading.Lock()))
    assert "_CONNECT_COUNTS" not in vars(cp)  # a view of the global provider's counts
    assert cp._connect_count_snapshot() == cp._CONNECT_COUNTS
    with pytest.raises(AttributeError, match="_NO_SUCH_NAME"):
        _ = cp._NO_SUCH_NAME  # type: ignore[attr-defined]
    assert isinstance(cp._REPORTED_CAPACITIES, set)
    assert isinstance(cp._SERVER_NAME, contextvars.ContextVar)
    assert cp._SERVER_NAME.name == "nemo_gym_http_server_name"
    assert contextvars.Context().run(cp._SERVER_NAME.get) == "external"
    assert isinstance(cp.logger, logging.Logger)
    assert cp.logger.name == cp.__name__
