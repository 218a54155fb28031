"""Every name on reference page 004 exists in connection_pool with its documented signature."""

from __future__ import annotations

import contextvars
import inspect
import logging
import threading
import typing
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.client_reqrep import ClientRequest, ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace

from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool as cp

P = inspect.Parameter
EMPTY = inspect.Parameter.empty

# (name, kind, default, annotation) per parameter, then the return annotation, as on page 004.
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
    "connect": (
        [
            ("self", P.POSITIONAL_OR_KEYWORD, EMPTY, EMPTY),
            ("req", P.POSITIONAL_OR_KEYWORD, EMPTY, ClientRequest),
            ("args", P.VAR_POSITIONAL, EMPTY, Any),
            ("kwargs", P.VAR_KEYWORD, EMPTY, Any),
        ],
        Connection,
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
    """The connector is a TCPConnector with asynchronous connect and wait."""
    assert issubclass(cp.QueueTimedTCPConnector, aiohttp.TCPConnector)
    assert inspect.iscoroutinefunction(cp.QueueTimedTCPConnector.connect)
    assert inspect.iscoroutinefunction(cp.QueueTimedTCPConnector._wait_for_available_connection)


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
    assert isinstance(cp._REPORTED_CAPACITIES, set)
    assert isinstance(cp._SERVER_NAME, contextvars.ContextVar)
    assert cp._SERVER_NAME.name == "nemo_gym_http_server_name"
    assert contextvars.Context().run(cp._SERVER_NAME.get) == "external"
    assert isinstance(cp.logger, logging.Logger)
    assert cp.logger.name == cp.__name__
