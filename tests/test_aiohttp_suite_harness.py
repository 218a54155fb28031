"""The harness of scripts/aiohttp-suite.sh: its verdicts, and the timed BaseConnector it builds.

CI's aiohttp-suite section runs aiohttp's own tests through these (scripts/aiohttp_suite/); here
they are checked on their own: a difference is told from a flake exactly, a missing proof of
the timed path fails the run, and a ``BaseConnector`` switched to the harness's timed class
records a real queue wait while behaving as aiohttp's own.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    CONNECT_TOTAL,
    QUEUE_DURATION,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
)
from opentelemetry.instrumentation.nemo_gym.version import __version__

HARNESS = Path(__file__).resolve().parent.parent / "scripts" / "aiohttp_suite"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"aiohttp_suite_{name}", HARNESS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


compare = _load("compare_outcomes")
instrumented = _load("_suite_instrumented")


def test_compare_outcomes_differing_counts_a_missing_test_as_absent() -> None:
    """A test in one run only differs (as ``absent``); equal outcomes do not."""
    plain = {"a": "passed", "b": "failed", "c": "skipped"}
    timed = {"a": "passed", "b": "passed", "d": "xfailed"}
    assert compare.differing(plain, timed) == ["b", "c", "d"]


def test_compare_outcomes_judge_steady_disagreement_is_a_difference() -> None:
    """Each mode giving one outcome every time, the two different: a difference."""
    verdict = compare.judge("t", ["error", "error", "error"], ["passed", "passed", "passed"])
    assert verdict.kind == "difference"


def test_compare_outcomes_judge_unsteady_or_vanished_is_a_flake() -> None:
    """An outcome that changes within a mode, or a first difference that does not come back,
    is a flake."""
    assert compare.judge("t", ["failed", "passed", "passed"], ["passed"] * 3).kind == "flake"
    assert compare.judge("t", ["passed"] * 3, ["failed", "failed", "passed"]).kind == "flake"
    crossed = compare.judge("t", ["failed", "passed", "passed"], ["passed", "failed", "failed"])
    assert crossed.kind == "flake"


def test_compare_outcomes_timed_path_problems_names_each_missing_proof() -> None:
    """No connect, no switched TCPConnector, no wait, no BaseConnector wait: each is named;
    a full tally has none, and contrib's run needs no BaseConnector."""
    full = {
        "connects": 5,
        "waits": 2,
        "timed_tcp_connectors": 3,
        "timed_base_connectors": 1,
        "harness_failures": [],
        "tests": {"t": {"timed_base_connectors": 1, "waits": 1, "connects": 2}},
    }
    assert compare.timed_path_problems(full, require_base_waits=True) == []
    empty = {"connects": 0, "waits": 0, "timed_tcp_connectors": 0, "tests": {}}
    assert compare.timed_path_problems(empty, require_base_waits=True) == [
        "no connect recorded by the instrumentation's meter",
        "no aiohttp.TCPConnector was switched to QueueTimedTCPConnector",
        "no queue wait recorded by the instrumentation's meter",
        "no test built a timed aiohttp.BaseConnector",
    ]
    no_base_wait = dict(full, tests={"t": {"timed_base_connectors": 1, "waits": 0}})
    assert compare.timed_path_problems(no_base_wait, require_base_waits=True) == [
        "no test that built a timed aiohttp.BaseConnector recorded a wait"
    ]
    contrib = dict(empty, connects=1, timed_tcp_connectors=1)
    assert compare.timed_path_problems(contrib, require_base_waits=False) == []


def test_timed_base_connector_class_has_the_timed_methods_on_base_connector() -> None:
    """The class is a direct BaseConnector subclass carrying QueueTimedTCPConnector's own code
    for the three overrides, with what inspect sees of each unchanged."""
    timed = instrumented.timed_base_connector_class()
    assert timed.__mro__[1:] == aiohttp.BaseConnector.__mro__
    for name in ("connect", "_wait_for_available_connection", "_create_connection"):
        ours = vars(QueueTimedTCPConnector)[name]
        assert vars(timed)[name].__code__ is ours.__code__
        assert inspect.iscoroutinefunction(vars(timed)[name]) == inspect.iscoroutinefunction(ours)
        assert inspect.signature(vars(timed)[name]) == inspect.signature(ours)


async def test_timed_base_connector_records_a_wait_and_keeps_base_behaviour() -> None:
    """A limit-1 BaseConnector switched to the timed class (its connections made by a real
    TCPConnector's method, to a loopback server) counts both connects and records one queue
    wait for the second request, which gets the released connection; its own
    ``_create_connection`` still raises NotImplementedError, as BaseConnector's does."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    telemetry = PoolTelemetry.of(provider, version=__version__, max_server_names=8)
    app = web.Application()
    release = asyncio.Event()

    async def hello(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="hi")

    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    maker = aiohttp.TCPConnector()
    try:
        connector = aiohttp.BaseConnector(limit=1)
        timed = instrumented.timed_base_connector_class()
        timed._nemo_gym_attach(connector, telemetry)
        connector.__class__ = timed
        with pytest.raises(NotImplementedError):
            await connector._create_connection(None, [], None)  # BaseConnector's own
        # What the tests of aiohttp do: the stand-in connection maker on the instance.
        connector._create_connection = maker._create_connection  # type: ignore[method-assign]
        queued = asyncio.Event()
        tracing = aiohttp.TraceConfig()

        async def on_queued(*_: Any) -> None:
            queued.set()

        tracing.on_connection_queued_start.append(on_queued)
        async with aiohttp.ClientSession(connector=connector, trace_configs=[tracing]) as session:
            first = asyncio.create_task(session.get(f"http://127.0.0.1:{port}/"))
            second = asyncio.create_task(session.get(f"http://127.0.0.1:{port}/"))
            await queued.wait()  # the second request waits behind the first
            release.set()
            for task in (first, second):
                response = await task
                assert await response.text() == "hi"
                response.release()
    finally:
        await maker.close()
        await runner.cleanup()
    assert _total(reader, CONNECT_TOTAL) == 2
    assert _total(reader, QUEUE_DURATION) == 1
    provider.shutdown()


def _total(reader: InMemoryMetricReader, name: str) -> int:
    return int(instrumented._sum_points(reader, name))
