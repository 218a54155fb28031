"""pytest plugin of the instrumented run: NemoGymInstrumentor on, exporting, in aiohttp's tests.

Loaded with ``-p _suite_instrumented`` (scripts/aiohttp-suite.sh) beside ``_suite_outcomes``;
aiohttp's own conftest stays as it is. At configure time it sets an SDK ``MeterProvider`` with
an ``InMemoryMetricReader`` and a ``TracerProvider`` with an ``InMemorySpanExporter``, as the
global providers and as the instrumentor's explicit ones (contrib's tests replace the global
providers with their own per test; ours must keep recording), and calls
``NemoGymInstrumentor().instrument(...)`` with every capability at its default.

**BaseConnector pools.** The instrumentation times ``aiohttp.TCPConnector(...)`` only (the
construction patch of ``telemetry/_connector_patch.py`` switches exactly that class to
``QueueTimedTCPConnector``). aiohttp tests its limits, queueing and cancellation mostly on
``aiohttp.BaseConnector(...)`` with a stand-in ``_create_connection``, which the patch leaves
plain, so those tests would prove nothing about the timed connector. This plugin does for
``BaseConnector(...)`` what the patch does for ``TCPConnector(...)``: after aiohttp's own
``__init__``, a connector whose class is exactly ``BaseConnector`` gets the telemetry the
patch itself chooses (its ``choose``, which also starts the pressure metrics in the running
loop) and is switched to ``QueueTimedBaseConnector``. That class is ``BaseConnector`` plus the
very methods of ``QueueTimedTCPConnector`` (``connect``, ``_wait_for_available_connection``,
``_create_connection`` and the helpers they call): the same function objects' code, globals
and defaults, with only the ``__class__`` cell that zero-argument ``super()`` reads pointed at
the new class, so ``super()`` there reaches ``BaseConnector``'s methods, as in
``QueueTimedTCPConnector`` it reaches ``TCPConnector``'s (which inherits ``connect`` and
``_wait_for_available_connection`` from ``BaseConnector`` unchanged). Nothing of ours is
rewritten here: a change to the timed connector's methods is what these tests run.

**Proof that the timed path ran.** After each test the reader collects (which also flushes the
buffered waits), and the connects (``gym.http.connection_pool.connect_total``) and queue waits
(``gym.http.connection_pool.queue_duration_ms`` samples) the test added are written, with the
number of TCPConnector and BaseConnector pools timed in it, to the JSON file named by
``AIOHTTP_SUITE_TIMED``, with the names of every metric recorded by the end (the pressure
metrics among them: the patch's ``choose`` starts them in each loop that builds a pool).
compare_outcomes.py requires connects and waits overall, and waits in tests that built a timed
``BaseConnector``.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import wrapt
from opentelemetry import metrics, trace
from opentelemetry.context import get_current
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor, _PoolPatch
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    CONNECT_TOTAL,
    QUEUE_DURATION,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import suppressed
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
)

TIMED_VARIABLE = "AIOHTTP_SUITE_TIMED"
# The methods of QueueTimedTCPConnector that must be on the timed BaseConnector: the three
# overrides of aiohttp's methods that do the timing and counting.
_OVERRIDES = ("connect", "_wait_for_available_connection", "_create_connection")


def _with_class_cell(function: types.FunctionType, owner: type) -> types.FunctionType:
    """``function`` itself, except that its zero-argument ``super()`` means ``owner``'s."""
    closure = function.__closure__ or ()
    cells = tuple(
        types.CellType(owner) if name == "__class__" else cell
        for name, cell in zip(function.__code__.co_freevars, closure, strict=True)
    )
    clone = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, cells
    )
    clone.__kwdefaults__ = function.__kwdefaults__
    clone.__dict__.update(function.__dict__)  # e.g. inspect.markcoroutinefunction's marker
    clone.__qualname__ = f"{owner.__qualname__}.{function.__name__}"
    clone.__doc__ = function.__doc__
    clone.__annotations__ = dict(function.__annotations__)
    return clone


def timed_base_connector_class() -> type[aiohttp.BaseConnector]:
    """``BaseConnector`` with every method ``QueueTimedTCPConnector`` defines, but ``__init__``."""
    timed = types.new_class("QueueTimedBaseConnector", (aiohttp.BaseConnector,))
    timed.__module__ = __name__
    copied = []
    for name, value in vars(QueueTimedTCPConnector).items():
        if isinstance(value, types.FunctionType) and name != "__init__":
            setattr(timed, name, _with_class_cell(value, timed))
            copied.append(name)
    missing = [name for name in _OVERRIDES if name not in copied]
    if missing:
        raise pytest.UsageError(
            f"QueueTimedTCPConnector defines no plain function {missing}: "
            "the timed BaseConnector of scripts/aiohttp_suite cannot be built"
        )
    return timed


def _metric_names(reader: InMemoryMetricReader) -> list[str]:
    """The names of every metric the reader collects now, sorted."""
    data = reader.get_metrics_data()
    return sorted(
        {
            metric.name
            for resource_metrics in (data.resource_metrics if data is not None else ())
            for scope_metrics in resource_metrics.scope_metrics
            for metric in scope_metrics.metrics
        }
    )


def _sum_points(reader: InMemoryMetricReader, name: str) -> int:
    """Connects (a counter's sum) or waits (a histogram's count) of one metric, all series."""
    data = reader.get_metrics_data()
    total = 0
    for resource_metrics in data.resource_metrics if data is not None else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    if isinstance(point, HistogramDataPoint):
                        total += point.count
                    elif isinstance(point, NumberDataPoint):
                        total += int(point.value)
    return total


class _Recorder:
    """Times ``BaseConnector`` pools, counts timed pools per test, and writes the tally."""

    def __init__(self, reader: InMemoryMetricReader, instrumentor: NemoGymInstrumentor) -> None:
        self._reader = reader
        # The instrumentor's own construction patch (kept with its other patches), asked
        # for the telemetry exactly as it asks at each TCPConnector construction.
        pools = [p for p in instrumentor._patches if isinstance(p, _PoolPatch)]
        self._patch = pools[0]._patch if pools else None
        if self._patch is None or not self._patch.installed:
            raise pytest.UsageError("NemoGymInstrumentor installed no connection-pool patch")
        self._timed_base_class = timed_base_connector_class()
        self._timed_tcp = 0
        self._timed_base = 0
        self._connects = 0
        self._waits = 0
        self._tests: dict[str, dict[str, int]] = {}
        self._failures: list[str] = []

    def install(self) -> None:
        # Outermost on TCPConnector.__init__ (the instrumentation's wrapper is inside): only
        # counts what the instrumentation made of the connector.
        wrapt.wrap_function_wrapper(aiohttp.TCPConnector, "__init__", self._count_tcp)
        wrapt.wrap_function_wrapper(aiohttp.BaseConnector, "__init__", self._time_base)

    def _count_tcp(
        self, wrapped: Callable[..., None], instance: Any, args: Any, kwargs: Any
    ) -> None:
        wrapped(*args, **kwargs)
        if type(instance) is QueueTimedTCPConnector:
            self._timed_tcp += 1

    def _time_base(
        self, wrapped: Callable[..., None], instance: Any, args: Any, kwargs: Any
    ) -> None:
        wrapped(*args, **kwargs)
        if type(instance) is not aiohttp.BaseConnector or suppressed(get_current()):
            return
        # As TCPConnectorPatch._upgrade does: the telemetry the patch chooses, bound first,
        # the class switched after. A failure here is the harness's, and is reported.
        try:
            telemetry = self._patch._choose()  # type: ignore[union-attr]
            if telemetry is None:
                self._failures.append("the patch chose no telemetry for a BaseConnector")
                return
            self._timed_base_class._nemo_gym_attach(instance, telemetry)  # type: ignore[attr-defined]
            instance.__class__ = self._timed_base_class
            self._timed_base += 1
        except Exception as error:  # noqa: BLE001 - reported at the end, never into a test
            self._failures.append(f"timing a BaseConnector failed: {error!r}")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        tcp, base = self._timed_tcp, self._timed_base
        yield
        connects = _sum_points(self._reader, CONNECT_TOTAL)
        waits = _sum_points(self._reader, QUEUE_DURATION)
        tally = {
            "timed_tcp_connectors": self._timed_tcp - tcp,
            "timed_base_connectors": self._timed_base - base,
            "connects": connects - self._connects,
            "waits": waits - self._waits,
        }
        self._connects, self._waits = connects, waits
        if any(tally.values()):
            self._tests[item.nodeid] = tally

    def pytest_sessionfinish(self) -> None:
        # The last collection: connectors collected since (and their counts) are in it.
        self._connects = _sum_points(self._reader, CONNECT_TOTAL)
        self._waits = _sum_points(self._reader, QUEUE_DURATION)
        document = {
            "timed_tcp_connectors": self._timed_tcp,
            "timed_base_connectors": self._timed_base,
            "connects": self._connects,
            "waits": self._waits,
            "harness_failures": self._failures,
            "metrics": _metric_names(self._reader),
            "tests": self._tests,
        }
        Path(os.environ[TIMED_VARIABLE]).write_text(json.dumps(document, indent=1, sort_keys=True))


def _require(names: Iterable[str]) -> None:
    for name in names:
        if not os.environ.get(name):
            raise pytest.UsageError(f"{name} names no file to write to")


def pytest_configure(config: pytest.Config) -> None:
    _require([TIMED_VARIABLE])
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    metrics.set_meter_provider(meter_provider)
    trace.set_tracer_provider(tracer_provider)
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(meter_provider=meter_provider, tracer_provider=tracer_provider)
    recorder = _Recorder(reader, instrumentor)
    recorder.install()
    config.pluginmanager.register(recorder, "aiohttp-suite-timed-recorder")
