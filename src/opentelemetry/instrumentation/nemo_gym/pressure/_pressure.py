"""The pressure on a Gym process, in NeMo Gym's own names.

A Gym server answers every request on one asyncio loop: synchronous work that holds it makes
every request wait, and no single request looks slow. NeMo Gym's newer in-app telemetry
(``nemo_gym.telemetry.observer``, documented at
https://docs.nvidia.com/nemo/gym/nemo-gym/nemo_gym/telemetry/observer; its source is not in
the NeMo Gym releases we could read, so names, kinds, units and attributes follow that page)
names these signals; users on NeMo Gym 0.4 and 0.5 get them from here:

* ``gym.event_loop.lag_ms`` (histogram, ``ms``): how late the loop ran a callback it was asked
  to run ``OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS`` from then (``_loop_lag.LoopLagProbe``);
  no attributes (the resource says which process);
* ``gym.gc.pause_duration_ms`` (histogram, ``ms``), and the counters
  ``gym.gc.collections_total``, ``gym.gc.collected_total``, ``gym.gc.uncollectable_total``
  (unit ``1``, as NeMo Gym's ``gym_metrics`` gives its counters), all by
  ``nemo.gym.gc.generation``; ``gym.gc.count`` (gauge, by generation): ``gc.get_count()``.
  From ``gc.callbacks``, which call no OpenTelemetry code (a collection may start inside the
  SDK holding a lock): each pause is buffered and recorded at the next collection of the
  metrics, the counters are plain integers read then;
* ``gym.server.requests.in_flight`` (up-down counter, ``{request}``): HTTP requests the
  server's ASGI app has been called with and not yet returned from: an integer per served
  app that its wrapper adds to and takes from, summed at collection time (no OpenTelemetry
  call per request). The observer page names it; its kind is not on the part we could read,
  and an up-down counter is what sums across a server's worker processes.

``process.cpu.time``, ``process.memory.usage``, ``process.open_file_descriptor.count`` and
``process.thread.count`` come from ``opentelemetry-instrumentation-system-metrics`` (the
``pressure`` extra), instrumented for those four only, where it is installed and nobody has
instrumented it yet. NeMo Gym's observer keeps the same semantic-convention names.

While NeMo Gym's own observer is loaded and recording (``nemo_gym_recording``), we record none
of these: the lag ticks, collections and in-flight observations record nothing, and the
process metrics are not started.

Everything belongs to one ``PressureMetrics``, made and kept by the instrumentor: its
``start(provider, loop)``, on the loop's thread, starts the probe once per loop, the rest once
per process; its ``stop()`` ends it all. The lag buckets (1 ms to 10 s) and
the pause buckets (0.05 ms to 1 s) are ours: the observer page gives none.
"""

from __future__ import annotations

import collections
import gc
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Final

from opentelemetry import metrics

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym._shared._buckets import ladder
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._recording import (
    nemo_gym_recording,
)

__all__ = [
    "ATTR_GC_GENERATION",
    "GC_COLLECTED",
    "GC_COLLECTIONS",
    "GC_COUNT",
    "GC_PAUSE",
    "GC_UNCOLLECTABLE",
    "IN_FLIGHT",
    "LOOP_LAG",
    "NEMO_GYM_OBSERVER_MODULE",
    "PROCESS_METRICS",
    "InFlightApp",
    "nemo_gym_observer_records",
]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

NEMO_GYM_OBSERVER_MODULE: Final = "nemo_gym.telemetry.observer"

LOOP_LAG: Final = "gym.event_loop.lag_ms"
GC_PAUSE: Final = "gym.gc.pause_duration_ms"
GC_COLLECTIONS: Final = "gym.gc.collections_total"
GC_COLLECTED: Final = "gym.gc.collected_total"
GC_UNCOLLECTABLE: Final = "gym.gc.uncollectable_total"
GC_COUNT: Final = "gym.gc.count"
IN_FLIGHT: Final = "gym.server.requests.in_flight"
ATTR_GC_GENERATION: Final = "nemo.gym.gc.generation"

# A healthy loop runs a timer within a millisecond; one held by synchronous work, for
# seconds. Boundaries across both, so a heatmap shows either end.
LOOP_LAG_BUCKETS_MS: Final = ladder(1.0, 10_000.0)
# A young-generation collection takes tens of microseconds, a full one of a large heap
# hundreds of milliseconds.
GC_PAUSE_BUCKETS_MS: Final = (0.05, *ladder(0.1, 1_000.0))

# opentelemetry-instrumentation-system-metrics' configuration: these four process metrics
# only (its default also samples every disk, network interface and CPU of the host).
PROCESS_METRICS: Final[dict[str, list[str] | None]] = {
    "process.cpu.time": ["user", "system"],
    "process.memory.usage": None,
    "process.open_file_descriptor.count": None,
    "process.thread.count": None,
}

_GENERATIONS: Final = (0, 1, 2)
_MAX_PENDING_PAUSES: Final = 100_000
_GENERATION_ATTRIBUTES: Final = {g: {ATTR_GC_GENERATION: g} for g in _GENERATIONS}


def nemo_gym_observer_records() -> bool:
    """Whether NeMo Gym's own observer is loaded and recording; never raises."""
    return nemo_gym_recording(NEMO_GYM_OBSERVER_MODULE)


class _InFlight:
    """One served app's count, changed only on its serving loop's thread (NeMo Gym 0.4 serves
    its head server on a thread of its own, so two apps may run in one process); read, summed
    over the live apps, at collection time."""

    __slots__ = ("__weakref__", "value")

    def __init__(self) -> None:
        self.value = 0


_ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


class InFlightApp:
    """An ASGI app that counts the HTTP requests ``app`` is handling, and does nothing else.

    Calls, arguments, results, exceptions and cancellation pass through unchanged; a
    non-HTTP scope (lifespan, websocket) is not counted. Attribute reads fall through to
    ``app`` so code that inspects the served app still finds its own.
    """

    __slots__ = ("_count", "app")

    def __init__(self, app: _ASGIApp, count: _InFlight) -> None:
        self.app = app
        self._count = count

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        count = self._count
        count.value += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            count.value -= 1

    def __getattr__(self, name: str) -> Any:
        if name == "app":  # not set yet (a copy being made): no recursion through it
            raise AttributeError(name)
        return getattr(self.app, name)


class _GcPauses:
    """The ``gc.callbacks`` entry: times each collection, counts it per generation.

    It calls no OpenTelemetry code: a collection can start on any thread at any allocation,
    also inside the SDK while it holds a lock (a collection of the metrics, say), and a record
    taking that lock again there would deadlock. It appends the pause to a bounded deque and
    adds to plain integers; ``flush()`` records the pauses at the start of each collection of
    the metrics (``append``/``popleft`` are atomic under the GIL).
    """

    __slots__ = ("_histogram", "_started", "collected", "collections", "pending", "uncollectable")

    def __init__(self, histogram: metrics.Histogram) -> None:
        self._histogram = histogram
        self._started = 0.0
        self.collections = [0, 0, 0]
        self.collected = [0, 0, 0]
        self.uncollectable = [0, 0, 0]
        # Between two collections of the metrics; past this the oldest pauses are dropped.
        self.pending: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=_MAX_PENDING_PAUSES
        )

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        try:
            if phase == "start":
                self._started = time.perf_counter()
                return
            started, self._started = self._started, 0.0
            generation = info.get("generation")
            if not started or generation not in _GENERATION_ATTRIBUTES:
                return
            self.pending.append((generation, (time.perf_counter() - started) * 1000.0))
            self.collections[generation] += 1
            self.collected[generation] += int(info.get("collected", 0))
            self.uncollectable[generation] += int(info.get("uncollectable", 0))
        except Exception as exc:  # noqa: BLE001 - a collection must never raise through us
            _ONCE(("gc", type(exc).__name__), logging.WARNING, "nemo_gym: gc pause: %r", exc)

    def flush(self) -> None:
        """Record the buffered pauses (none while NeMo Gym's observer records). Never raises."""
        pending = self.pending
        record = not nemo_gym_observer_records()
        # The pauses there now only: recording allocates, and a collection it sets off adds a
        # pause of its own, for the next flush (draining until empty might never end).
        for _ in range(len(pending)):
            try:
                generation, pause_ms = pending.popleft()
            except IndexError:
                return
            if not record:
                continue
            try:
                self._histogram.record(pause_ms, attributes=_GENERATION_ATTRIBUTES[generation])
            except Exception as exc:  # noqa: BLE001 - telemetry never fails a collection
                _ONCE(("gc-record", type(exc).__name__), logging.WARNING, "nemo_gym: %r", exc)


def _per_generation(values: list[int]) -> Callable[[metrics.CallbackOptions], Iterable[Any]]:
    def observe(_options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        if nemo_gym_observer_records():
            return []
        return [metrics.Observation(values[g], _GENERATION_ATTRIBUTES[g]) for g in _GENERATIONS]

    return observe


def _gc_count(_options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
    if nemo_gym_observer_records():
        return []
    counts = gc.get_count()
    return [metrics.Observation(counts[g], _GENERATION_ATTRIBUTES[g]) for g in _GENERATIONS]


class _ProcessPressure:
    """The instruments of one meter provider, made once per process."""

    def __init__(self, provider: metrics.MeterProvider, version: str) -> None:
        meter = provider.get_meter(_names.METER_NAME, version)
        self.lag = meter.create_histogram(
            LOOP_LAG,
            unit="ms",
            description="How late the event loop ran a callback scheduled for a known time.",
            explicit_bucket_boundaries_advisory=list(LOOP_LAG_BUCKETS_MS),
        )
        self.in_flight: weakref.WeakSet[_InFlight] = weakref.WeakSet()
        self.gc = _GcPauses(
            meter.create_histogram(
                GC_PAUSE,
                unit="ms",
                description="Wall-clock time of one garbage collection.",
                explicit_bucket_boundaries_advisory=list(GC_PAUSE_BUCKETS_MS),
            )
        )
        in_flight = self.in_flight

        gc_pauses = self.gc

        # Registered first: the SDK runs observable callbacks in registration order, at the
        # start of each collection, so the GC pauses are recorded before the histograms are read.
        def observe_in_flight(_options: metrics.CallbackOptions) -> Iterable[Any]:
            gc_pauses.flush()
            if nemo_gym_observer_records():
                return []
            return [metrics.Observation(sum(count.value for count in list(in_flight)))]

        meter.create_observable_up_down_counter(
            IN_FLIGHT,
            callbacks=[observe_in_flight],
            unit="{request}",
            description="HTTP requests this server is handling now.",
        )
        for name, values, description in (
            (GC_COLLECTIONS, self.gc.collections, "Garbage collections."),
            (GC_COLLECTED, self.gc.collected, "Objects garbage collection freed."),
            (GC_UNCOLLECTABLE, self.gc.uncollectable, "Objects found uncollectable."),
        ):
            meter.create_observable_counter(
                name, callbacks=[_per_generation(values)], unit="1", description=description
            )
        meter.create_observable_gauge(
            GC_COUNT,
            callbacks=[_gc_count],
            unit="1",
            description="Allocations minus deallocations since the last collection.",
        )

    def record_lag(self, lag_ms: float) -> None:
        if not nemo_gym_observer_records():
            self.lag.record(lag_ms)
