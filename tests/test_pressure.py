"""The pressure metrics: event-loop lag, GC pauses, requests in flight, process metrics.

Real asyncio loops, a real uvicorn server running a real FastAPI app on loopback, real aiohttp
requests, the real SDK with an in-memory reader.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import json
import logging
import sys
import threading
import time
import tomllib
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvicorn
from fastapi import FastAPI
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from tests.conftest import eventually, metric_names, metric_points, run_under_instrument

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym._shared import _settings
from opentelemetry.instrumentation.nemo_gym._shared._patching import is_live_wrapper
from opentelemetry.instrumentation.nemo_gym.environment_variables import (
    OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS,
    OTEL_PYTHON_NEMO_GYM_PRESSURE,
)
from opentelemetry.instrumentation.nemo_gym.integrations.uvicorn._request_context import (
    _fresh_context_at_startup,
)
from opentelemetry.instrumentation.nemo_gym.pressure import _pressure
from opentelemetry.instrumentation.nemo_gym.pressure._loop_lag import LoopLagProbe
from opentelemetry.instrumentation.nemo_gym.pressure._running import PressureMetrics
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import CONNECT_TOTAL
from opentelemetry.instrumentation.nemo_gym.tools._server_venvs import (
    opentelemetry_requirements,
)

APPS = Path(__file__).with_name("apps")

# The time the tests hold a loop with synchronous work, and how much later than that a
# measurement may end: generous for a shared two-core machine, yet far below a second hold.
HOLD_S = 0.3
MARGIN_S = 1.0


@pytest.fixture
def pressure() -> PressureMetrics:
    """The pressure metrics as one instrumentation owns them, started by the test itself."""
    return PressureMetrics(0.1, "test")


@pytest.fixture
def pressure_instrumentor(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[NemoGymInstrumentor]:
    """The instrumentor with only the pressure metrics on, probing every 10 ms."""
    monkeypatch.setenv(OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS, "10")
    instrumentor.instrument(
        meter_provider=meter_provider, connection_pool=False, sandbox_resources=False
    )
    yield instrumentor
    instrumentor.uninstrument()


def build_app(gate: asyncio.Event, entered: asyncio.Queue[str]) -> FastAPI:
    app = FastAPI()

    @app.get("/hold")
    async def hold() -> dict[str, str]:
        # Synchronous work that holds the loop, as a blocking call in a handler would.
        time.sleep(HOLD_S)  # noqa: ASYNC251 - the point of the test
        return {"held": "yes"}

    @app.get("/wait")
    async def wait() -> dict[str, str]:
        await entered.put("wait")
        await gate.wait()
        return {"waited": "yes"}

    @app.get("/fail")
    async def fail() -> dict[str, str]:
        raise RuntimeError("the handler's own failure")

    return app


class Served:
    def __init__(self, server: uvicorn.Server, gate: asyncio.Event, entered: Any) -> None:
        self.server = server
        self.gate = gate
        self.entered: asyncio.Queue[str] = entered
        sockets = server.servers[0].sockets
        self.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"


@pytest.fixture
async def served(pressure_instrumentor: NemoGymInstrumentor) -> AsyncIterator[Served]:
    """A FastAPI app served by uvicorn on 127.0.0.1, in this test's loop, stopped after it."""
    gate = asyncio.Event()
    entered: asyncio.Queue[str] = asyncio.Queue()
    config = uvicorn.Config(
        build_app(gate, entered), host="127.0.0.1", port=0, log_level="critical", lifespan="on"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started or task.done(), "uvicorn started")
    assert server.started
    yield Served(server, gate, entered)
    gate.set()
    server.should_exit = True
    await task


def lag_points(reader: InMemoryMetricReader) -> list[Any]:
    return metric_points(reader.get_metrics_data(), _pressure.LOOP_LAG)


def in_flight(reader: InMemoryMetricReader) -> int:
    points = metric_points(reader.get_metrics_data(), _pressure.IN_FLIGHT)
    assert len(points) == 1
    return int(points[0].value)


async def test_loop_lag_probe_measures_a_held_loop() -> None:
    """A loop held for HOLD_S by synchronous work runs the probe's next tick at least
    HOLD_S minus one interval late, and less than MARGIN_S later than that."""
    loop = asyncio.get_running_loop()
    interval_s = 0.01
    lags: list[float] = []
    ticked = asyncio.Event()

    def record(lag_ms: float) -> None:
        lags.append(lag_ms)
        ticked.set()

    probe = LoopLagProbe(loop, interval_s, record)
    probe.start()
    try:
        await ticked.wait()  # just after a tick: the next one is due one interval from now
        ticked.clear()
        before = len(lags)
        time.sleep(HOLD_S)  # noqa: ASYNC251 - holds the loop on purpose
        await ticked.wait()
        held = lags[before]
    finally:
        probe.stop()
    assert (HOLD_S - interval_s) * 1000 <= held < (HOLD_S + MARGIN_S) * 1000
    assert all(lag >= 0 for lag in lags)
    assert not probe.running


async def test_loop_lag_probe_survives_a_failing_record(caplog: pytest.LogCaptureFixture) -> None:
    """A record that raises is logged once and the probe keeps ticking."""
    calls: list[float] = []
    third = asyncio.Event()

    def record(lag_ms: float) -> None:
        calls.append(lag_ms)
        if len(calls) >= 3:
            third.set()
        raise ValueError("exporter broke")

    probe = LoopLagProbe(asyncio.get_running_loop(), 0.001, record)
    with caplog.at_level(logging.WARNING):
        probe.start()
        await third.wait()
        probe.stop()
    assert len([r for r in caplog.records if "exporter broke" in r.getMessage()]) == 1


async def test_pressure_server_lag_recorded_for_held_request(
    served: Served, metric_reader: InMemoryMetricReader
) -> None:
    """A request whose handler holds the uvicorn loop for HOLD_S shows in
    gym.event_loop.lag_ms as one measurement of at least HOLD_S minus the 10 ms interval."""
    async with aiohttp.ClientSession() as session, session.get(served.url + "/hold") as response:
        assert await response.json() == {"held": "yes"}
    await eventually(
        lambda: bool(lag_points(metric_reader)) and lag_points(metric_reader)[0].max >= 250,
        "the held loop measured",
    )
    (point,) = lag_points(metric_reader)
    assert (HOLD_S - 0.01) * 1000 <= point.max < (HOLD_S + MARGIN_S) * 1000
    assert dict(point.attributes) == {}
    assert point.explicit_bounds == _pressure.LOOP_LAG_BUCKETS_MS


async def test_pressure_in_flight_counts_requests_being_handled(
    served: Served, metric_reader: InMemoryMetricReader
) -> None:
    """Three requests waiting in the handler read 3 in flight; once answered, 0; a handler
    that raises still answers 500 and leaves no request counted."""
    async with aiohttp.ClientSession() as session:
        requests = [asyncio.create_task(session.get(served.url + "/wait")) for _ in range(3)]
        for _ in range(3):
            await served.entered.get()
        assert in_flight(metric_reader) == 3
        served.gate.set()
        for response in await asyncio.gather(*requests):
            assert response.status == 200
            assert await response.json() == {"waited": "yes"}
            response.release()
        async with session.get(served.url + "/fail") as failed:
            assert failed.status == 500
    assert in_flight(metric_reader) == 0


async def test_pressure_gc_pauses_recorded_by_generation(
    served: Served, metric_reader: InMemoryMetricReader
) -> None:
    """A full collection adds a pause and a collection of generation 2, with what it freed."""
    cycle: list[Any] = []
    cycle.append(cycle)  # one object only the cycle collector can free
    del cycle
    before = metric_reader.get_metrics_data()
    full_before = {
        p.attributes[_pressure.ATTR_GC_GENERATION]: p.value
        for p in metric_points(before, _pressure.GC_COLLECTIONS)
    }.get(2, 0)
    gc.collect()
    data = metric_reader.get_metrics_data()
    pauses = {
        p.attributes[_pressure.ATTR_GC_GENERATION]: p
        for p in metric_points(data, _pressure.GC_PAUSE)
    }
    assert pauses[2].count >= 1
    assert pauses[2].max > 0
    collections = {
        p.attributes[_pressure.ATTR_GC_GENERATION]: p.value
        for p in metric_points(data, _pressure.GC_COLLECTIONS)
    }
    assert collections[2] >= full_before + 1
    collected = {
        p.attributes[_pressure.ATTR_GC_GENERATION]: p.value
        for p in metric_points(data, _pressure.GC_COLLECTED)
    }
    assert collected[2] >= 1
    counts = metric_points(data, _pressure.GC_COUNT)
    assert sorted(p.attributes[_pressure.ATTR_GC_GENERATION] for p in counts) == [0, 1, 2]


async def test_pressure_process_metrics_from_system_metrics(
    served: Served, metric_reader: InMemoryMetricReader
) -> None:
    """opentelemetry-instrumentation-system-metrics reports the process's CPU, memory,
    threads and file descriptors, and none of its host-wide system.* metrics."""
    names = metric_names(metric_reader.get_metrics_data())
    assert set(_pressure.PROCESS_METRICS) <= names
    assert not {name for name in names if name.startswith("system.")}


def stand_in_observer(exporting: bool) -> types.ModuleType:
    """NeMo Gym's ``nemo_gym.telemetry.observer`` as far as this plugin looks at it."""
    module = types.ModuleType(_pressure.NEMO_GYM_OBSERVER_MODULE)
    module.metrics_exporting = lambda: exporting  # type: ignore[attr-defined]
    return module


async def test_pressure_deferred_while_nemo_gym_observer_records(
    monkeypatch: pytest.MonkeyPatch,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    pressure: PressureMetrics,
) -> None:
    """With NeMo Gym's observer loaded and recording, start() starts nothing and no name of
    the observer's is recorded, a collection and a held loop included."""
    monkeypatch.setitem(
        sys.modules, _pressure.NEMO_GYM_OBSERVER_MODULE, stand_in_observer(exporting=True)
    )
    try:
        assert not pressure.start(meter_provider, asyncio.get_running_loop())
        gc.collect()
        names = metric_names(metric_reader.get_metrics_data())
    finally:
        pressure.stop()
    assert not {name for name in names if name.startswith(("gym.", "process."))}


async def test_pressure_runs_while_nemo_gym_observer_is_loaded_but_off(
    monkeypatch: pytest.MonkeyPatch,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    pressure: PressureMetrics,
) -> None:
    """An observer module that is loaded but not exporting leaves the pressure to us."""
    monkeypatch.setitem(
        sys.modules, _pressure.NEMO_GYM_OBSERVER_MODULE, stand_in_observer(exporting=False)
    )
    try:
        assert pressure.start(meter_provider, asyncio.get_running_loop())
        gc.collect()
        names = metric_names(metric_reader.get_metrics_data())
    finally:
        pressure.stop()
    assert {_pressure.GC_PAUSE, _pressure.GC_COLLECTIONS, _pressure.IN_FLIGHT} <= names


async def test_pressure_off_leaves_uvicorn_alone(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_PYTHON_NEMO_GYM_PRESSURE=false: Server.startup carries only the fresh request
    context's wrapper (no pressure hook), and nothing is recorded."""
    original = uvicorn.Server.__dict__["startup"]
    monkeypatch.setenv(OTEL_PYTHON_NEMO_GYM_PRESSURE, "false")
    instrumentor.instrument(
        meter_provider=meter_provider, connection_pool=False, sandbox_resources=False
    )
    startup = uvicorn.Server.__dict__["startup"]
    assert is_live_wrapper(startup, _fresh_context_at_startup)
    assert startup.__wrapped__ is original
    assert not {
        name
        for name in metric_names(metric_reader.get_metrics_data())
        if name.startswith(("gym.", "process."))
    }


def test_pressure_uninstrument_restores_uvicorn(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """uninstrument() puts uvicorn's Server.startup back exactly."""
    original = uvicorn.Server.__dict__["startup"]
    instrumentor.instrument(
        meter_provider=meter_provider, connection_pool=False, sandbox_resources=False
    )
    assert uvicorn.Server.__dict__["startup"] is not original
    instrumentor.uninstrument()
    assert uvicorn.Server.__dict__["startup"] is original


@pytest.mark.usefixtures("fresh_settings_warnings")
@pytest.mark.parametrize("raw", ["often", "5", "-1", "inf"])
def test_settings_loop_lag_interval_bad_value_warns_once(
    raw: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop-lag interval that is not a number of at least 10 ms is one warning naming the
    variable and the value, and the default 100 ms."""
    monkeypatch.setenv(OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS, raw)
    with caplog.at_level(logging.WARNING):
        assert _settings.loop_lag_interval_s() == 0.1
        assert _settings.loop_lag_interval_s() == 0.1
    (warning,) = [r.getMessage() for r in caplog.records]
    assert OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS in warning
    assert raw in warning


def test_settings_loop_lag_interval_read_in_milliseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interval variable is milliseconds; unset is 100 ms."""
    monkeypatch.delenv(OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS, raising=False)
    assert _settings.loop_lag_interval_s() == 0.1
    monkeypatch.setenv(OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS, "250")
    assert _settings.loop_lag_interval_s() == 0.25


def test_pressure_extra_goes_into_server_venvs() -> None:
    """The pressure extra is the system-metrics instrumentation, and server-venvs' requirements
    for the server virtualenvs carry it (at this environment's version) when it is installed."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (requirement,) = pyproject["project"]["optional-dependencies"]["pressure"]
    assert requirement.startswith("opentelemetry-instrumentation-system-metrics ")
    version = importlib.metadata.version("opentelemetry-instrumentation-system-metrics")
    assert (
        f"opentelemetry-instrumentation-system-metrics=={version}" in opentelemetry_requirements()
    )


def console_metrics(console: str) -> dict[str, list[dict[str, Any]]]:
    """Every metric's data points in the console exporter's JSON documents, by name."""
    decoder = json.JSONDecoder()
    found: dict[str, list[dict[str, Any]]] = {}
    position = 0
    while (start := console.find("{", position)) >= 0:
        document, position = decoder.raw_decode(console, start)
        for resource in document["resource_metrics"]:
            for scope in resource["scope_metrics"]:
                for metric in scope["metrics"]:
                    points = metric["data"]["data_points"]
                    found.setdefault(metric["name"], []).extend(points)
    return found


def test_pressure_zero_code_uvicorn_server_reports() -> None:
    """Under opentelemetry-instrument (as NeMo Gym's servers run), a uvicorn server whose
    handler holds the loop for 0.3 s exports that lag, the GC and in-flight metrics, and the
    four process metrics (system_metrics' own auto-instrumentation disabled, as the README
    says), and no host-wide system.* metric."""
    result = run_under_instrument(
        APPS / "uvicorn_server.py",
        OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="system_metrics",
        OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS="10",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = console_metrics(result.stdout)
    (lag,) = found[_pressure.LOOP_LAG]
    assert (HOLD_S - 0.01) * 1000 <= lag["max"] < (HOLD_S + MARGIN_S) * 1000, lag
    assert [p["value"] for p in found[_pressure.IN_FLIGHT]] == [0]
    assert {_pressure.GC_PAUSE, _pressure.GC_COLLECTIONS, _pressure.GC_COUNT} <= set(found)
    assert set(_pressure.PROCESS_METRICS) <= set(found)
    assert not [name for name in found if name.startswith("system.")]


def test_pressure_server_without_a_pool_exports_before_earlier_exit_handlers() -> None:
    """A uvicorn server that never builds a connection pool (NeMo Gym's resources server)
    still sends its loop lag first thing at exit, before exit handlers registered earlier run
    (and are killed: NeMo Gym kills a server one second after its SIGINT)."""
    result = run_under_instrument(
        APPS / "uvicorn_server_killed_at_exit.py",
        OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="system_metrics",
        OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS="10",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    exported, killed, after = result.stdout.partition("KILLED")
    assert killed, result.stdout[-3000:]
    assert after.strip() == ""
    found = console_metrics(exported)
    (lag,) = found[_pressure.LOOP_LAG]
    assert lag["max"] >= (HOLD_S - 0.01) * 1000, lag
    assert CONNECT_TOTAL not in found


async def test_pressure_gc_during_metrics_collection_does_not_deadlock(
    meter_provider: MeterProvider, metric_reader: InMemoryMetricReader, pressure: PressureMetrics
) -> None:
    """Garbage collections that start while the SDK collects the metrics (holding the pause
    histogram's locks) are recorded at the next collection, not from inside this one."""
    assert pressure.start(meter_provider, asyncio.get_running_loop())
    gc.collect()  # the pause histogram has a point whose collection allocates
    thresholds = gc.get_threshold()
    collecting = threading.Thread(target=metric_reader.get_metrics_data, daemon=True)
    try:
        gc.set_threshold(1)  # every allocation in the SDK's collection starts a collection
        collecting.start()
        collecting.join(timeout=30)  # bounds a deadlock; a live collection takes milliseconds
        gc.set_threshold(*thresholds)
        assert not collecting.is_alive()
        pauses = metric_points(metric_reader.get_metrics_data(), _pressure.GC_PAUSE)
    finally:
        gc.set_threshold(*thresholds)
        pressure.stop()
    assert sum(p.count for p in pauses if p.attributes[_pressure.ATTR_GC_GENERATION] == 0) >= 1


@pytest.mark.parametrize("how", ["argument", "environment"])
async def test_fresh_request_context_off_leaves_uvicorn_alone(
    instrumentor: NemoGymInstrumentor,
    meter_provider: MeterProvider,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """``fresh_request_context=False`` or OTEL_PYTHON_NEMO_GYM_FRESH_REQUEST_CONTEXT=false,
    with the pressure metrics off too: Server.startup is not wrapped at all; with it on (the
    control), it carries the fresh context's wrapper."""
    original = uvicorn.Server.__dict__["startup"]
    monkeypatch.setenv(OTEL_PYTHON_NEMO_GYM_PRESSURE, "false")
    off: dict[str, object] = {}
    if how == "argument":
        off["fresh_request_context"] = False
    else:
        monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_FRESH_REQUEST_CONTEXT", "false")
    common = {
        "meter_provider": meter_provider,
        "connection_pool": False,
        "sandbox_resources": False,
    }
    instrumentor.instrument(**common, **off)
    assert uvicorn.Server.__dict__["startup"] is original
    instrumentor.uninstrument()
    instrumentor.instrument(**common, fresh_request_context=True)
    assert is_live_wrapper(uvicorn.Server.__dict__["startup"], _fresh_context_at_startup)
