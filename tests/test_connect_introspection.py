"""What introspection sees of a connector is the same with and without the instrumentation.

Mocks (``mock.patch(..., autospec=True)``) and frameworks that choose a sync or an async path
ask ``inspect`` about a connector's methods; the timed connector must answer as aiohttp's own
does, on every supported Python (CI runs this module on 3.11, 3.12 and 3.13). Each test builds
a real ``aiohttp.TCPConnector`` plain and instrumented (the real SDK, an in-memory reader).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any
from unittest import mock

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
)

# What the timed connector overrides, and what the pool's callers reach through it.
METHODS = ("connect", "_wait_for_available_connection", "_create_connection", "close")


def shape(function: Any) -> tuple[tuple[str, object, object], ...]:
    """Parameter names, kinds and defaults (annotations are spelled differently per release)."""
    return tuple(
        (p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()
    )


def introspected(connector: aiohttp.BaseConnector) -> dict[str, tuple[object, ...]]:
    return {
        name: (
            inspect.iscoroutinefunction(getattr(connector, name)),
            inspect.iscoroutinefunction(getattr(type(connector), name)),
            shape(getattr(connector, name)),
        )
        for name in METHODS
    }


@pytest.fixture
def instrumented() -> Iterator[None]:
    """The pool timing on, exporting to an in-memory reader."""
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(meter_provider=provider, sandbox_resources=False, pressure=False)
    yield
    instrumentor.uninstrument()
    provider.shutdown()


async def test_connect_introspection_same_as_plain_aiohttp(instrumented: None) -> None:
    """``inspect`` gives the same answers for a timed connector's methods as for aiohttp's."""
    timed = aiohttp.TCPConnector()
    assert isinstance(timed, QueueTimedTCPConnector)
    plain = aiohttp.TCPConnector.__new__(aiohttp.TCPConnector)  # its class's methods only
    assert introspected(timed) == introspected(plain)
    assert inspect.iscoroutinefunction(timed.connect)
    await timed.close()


async def test_connect_introspection_autospec_mock_is_awaitable(instrumented: None) -> None:
    """``mock.patch.object(connector, "connect", autospec=True)`` gives an awaitable mock."""
    timed = aiohttp.TCPConnector()
    assert isinstance(timed, QueueTimedTCPConnector)
    with mock.patch.object(timed, "connect", autospec=True) as patched:
        patched.return_value = "a connection"
        assert await timed.connect(None, [], None) == "a connection"  # type: ignore[arg-type]
        patched.assert_awaited_once_with(None, [], None)
    await timed.close()
