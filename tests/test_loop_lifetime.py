"""Nothing of ours keeps an event loop, or what it holds, alive.

A process that runs ``asyncio.run`` per task (a Ray worker, a CLI, a test suite) builds a
connector in each new loop: each loop must go when its owner lets go of it, closed or not,
exactly as without the instrumentation. Real loops, real aiohttp connectors, the real SDK with
an in-memory reader; each test runs the same steps plain and instrumented and compares.
"""

from __future__ import annotations

import asyncio
import gc
import os
import warnings
import weakref
from collections.abc import Iterator

import aiohttp
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
)

LOOPS = 100
UNCLOSED_LOOPS = 50


@pytest.fixture(params=["plain", "instrumented"])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test plain, then with the pool timing and the pressure metrics exporting."""
    if request.param == "plain":
        yield "plain"
        return
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(meter_provider=provider, sandbox_resources=False)
    try:
        yield "instrumented"
    finally:
        instrumentor.uninstrument()
        provider.shutdown()


async def build_and_close_connector(mode: str) -> weakref.ref[aiohttp.TCPConnector]:
    # Instrumented, the loop did build a timed connector and start its probe: the test proves
    # something about them, not about a path that was never taken.
    connector = aiohttp.TCPConnector()
    timed = isinstance(connector, QueueTimedTCPConnector)
    pressure = NemoGymInstrumentor()._pressure  # None when not instrumented
    probed = pressure is not None and pressure.probed(asyncio.get_running_loop())
    await connector.close()
    assert (timed, probed) == ((True, True) if mode == "instrumented" else (False, False))
    return weakref.ref(connector)


def probed_loops() -> int:
    pressure = NemoGymInstrumentor()._pressure
    return 0 if pressure is None else pressure.probed_loops()


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_loop_lifetime_closed_loops_all_collected(mode: str) -> None:
    """Loops that built a connector and closed, and their connectors, are all gone after a
    collection."""
    gc.collect()
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
    connectors: list[weakref.ref[aiohttp.TCPConnector]] = []
    for _ in range(LOOPS):
        with asyncio.Runner() as runner:
            connectors.append(runner.run(build_and_close_connector(mode)))
            loops.append(weakref.ref(runner.get_loop()))
    gc.collect()
    assert [ref for ref in loops if ref() is not None] == []
    assert [ref for ref in connectors if ref() is not None] == []
    assert probed_loops() == 0


def test_loop_lifetime_unclosed_loops_warned_and_released(mode: str) -> None:
    """Loops left unclosed are collected with Python's own warning, and their descriptors freed."""
    gc.collect()
    before = open_descriptors()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(UNCLOSED_LOOPS):
            loop = asyncio.new_event_loop()
            loop.run_until_complete(build_and_close_connector(mode))
            del loop  # never closed, as a careless caller would leave it
        gc.collect()
    unclosed = [w for w in caught if "unclosed event loop" in str(w.message)]
    assert len(unclosed) == UNCLOSED_LOOPS
    assert open_descriptors() == before
    assert probed_loops() == 0
