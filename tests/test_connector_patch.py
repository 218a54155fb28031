"""The construction patch on ``aiohttp.TCPConnector.__init__``: exact restore, stacking, errors.

``uninstrument()`` used to leave a ``__new__`` behind, change
``inspect.signature(TCPConnector)``, undo other libraries' patches and misname the class in
construction errors; the capacity report remembered every configuration forever.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest
import wrapt
from opentelemetry.sdk.metrics import MeterProvider

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry._capacity import CAPACITY_LINE_PREFIX
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
)

# aiohttp's own, read when the test module is imported, before any test patches anything.
ORIGINAL_INIT = aiohttp.TCPConnector.__dict__["__init__"]
ORIGINAL_SIGNATURE = inspect.signature(aiohttp.TCPConnector)
ORIGINAL_DICT_NAMES = set(aiohttp.TCPConnector.__dict__)


@pytest.fixture
def instrumentor(instrumentor: NemoGymInstrumentor) -> Iterator[NemoGymInstrumentor]:
    """conftest's instrumentor, and afterwards aiohttp's __init__ restored."""
    yield instrumentor
    instrumentor.uninstrument()
    # A test that stacked another library's wrapper takes it off by restoring aiohttp's own,
    # as that library's own unwrap would.
    aiohttp.TCPConnector.__init__ = ORIGINAL_INIT  # type: ignore[method-assign]


def construction_error(build: Callable[[], Any]) -> BaseException:
    try:
        build()
    except BaseException as error:
        return error
    raise AssertionError("construction did not fail")


async def test_uninstrument_restores_tcp_connector_exactly(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """After uninstrument() the class is as aiohttp made it: same __init__, no __new__."""
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    assert aiohttp.TCPConnector.__dict__["__init__"] is not ORIGINAL_INIT
    assert "__new__" not in aiohttp.TCPConnector.__dict__
    assert inspect.signature(aiohttp.TCPConnector) == ORIGINAL_SIGNATURE
    instrumentor.uninstrument()
    assert aiohttp.TCPConnector.__dict__["__init__"] is ORIGINAL_INIT
    assert set(aiohttp.TCPConnector.__dict__) == ORIGINAL_DICT_NAMES
    assert "__new__" not in aiohttp.TCPConnector.__dict__
    assert inspect.signature(aiohttp.TCPConnector) == ORIGINAL_SIGNATURE
    connector = aiohttp.TCPConnector(limit=3)
    assert type(connector) is aiohttp.TCPConnector
    await connector.close()


async def test_construction_errors_name_tcp_connector_as_plain_aiohttp(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """TCPConnector(3) and a bad keyword raise plain aiohttp's errors, naming TCPConnector."""
    plain_positional = construction_error(lambda: aiohttp.TCPConnector(3))  # type: ignore[misc]
    plain_keyword = construction_error(lambda: aiohttp.TCPConnector(limt=3))  # type: ignore[call-arg]
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    positional = construction_error(lambda: aiohttp.TCPConnector(3))  # type: ignore[misc]
    keyword = construction_error(lambda: aiohttp.TCPConnector(limt=3))  # type: ignore[call-arg]
    for plain, ours in ((plain_positional, positional), (plain_keyword, keyword)):
        assert type(ours) is type(plain) is TypeError
        assert str(ours) == str(plain)
        assert "TCPConnector" in str(ours)
        assert "QueueTimed" not in str(ours)


async def test_later_wrapper_survives_uninstrument_and_ours_goes_inert(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """A wrapt wrapper another library put on __init__ after ours stays; ours stops acting."""
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    seen: list[tuple[type, dict[str, Any]]] = []

    def theirs(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        seen.append((type(instance), dict(kwargs)))
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(aiohttp.TCPConnector, "__init__", theirs)
    their_wrapper = aiohttp.TCPConnector.__dict__["__init__"]
    timed = aiohttp.TCPConnector(limit=2)
    assert type(timed) is QueueTimedTCPConnector

    instrumentor.uninstrument()
    assert aiohttp.TCPConnector.__dict__["__init__"] is their_wrapper
    plain = aiohttp.TCPConnector(limit=4)
    assert type(plain) is aiohttp.TCPConnector
    assert plain.limit == 4
    assert seen == [(aiohttp.TCPConnector, {"limit": 2}), (aiohttp.TCPConnector, {"limit": 4})]

    # Instrumenting again stacks on top of theirs, and uninstrumenting takes only ours off.
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    again = aiohttp.TCPConnector(limit=5)
    assert type(again) is QueueTimedTCPConnector
    instrumentor.uninstrument()
    assert aiohttp.TCPConnector.__dict__["__init__"] is their_wrapper
    assert len(seen) == 3
    for connector in (timed, plain, again):
        await connector.close()


async def test_patch_keeps_callers_arguments_and_isinstance(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """The timed connector is built from exactly the caller's arguments and is a TCPConnector."""
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    connector = aiohttp.TCPConnector(
        limit=9, limit_per_host=4, keepalive_timeout=7, ttl_dns_cache=3
    )
    try:
        assert type(connector) is QueueTimedTCPConnector
        assert isinstance(connector, aiohttp.TCPConnector)
        assert (connector.limit, connector.limit_per_host) == (9, 4)
        assert connector._keepalive_timeout == 7
    finally:
        await connector.close()


@pytest.fixture
def fresh_capacity_reports() -> Iterator[None]:
    connection_pool._REPORTED_CAPACITIES.clear()
    yield
    connection_pool._REPORTED_CAPACITIES.clear()


async def test_capacity_reports_bounded_under_many_configurations(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    fresh_capacity_reports: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Connectors with ever-new limits are reported up to the cap, then one notice, no more."""
    cap = connection_pool._MAX_REPORTED_CAPACITIES
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    caplog.set_level(logging.INFO, logger=connection_pool.__name__)
    for limit in range(1, cap + 101):
        connector = aiohttp.TCPConnector(limit=limit)
        await connector.close()
    messages = [r.getMessage() for r in caplog.records if r.name == connection_pool.__name__]
    reports = [m for m in messages if m.startswith(CAPACITY_LINE_PREFIX)]
    notices = [m for m in messages if "further ones are not logged" in m]
    assert len(reports) == cap
    assert len(notices) == 1
    assert len(messages) == cap + 1
    assert len(connection_pool._REPORTED_CAPACITIES) == cap + 1  # the configurations + a marker
