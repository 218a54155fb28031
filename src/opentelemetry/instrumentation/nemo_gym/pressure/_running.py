"""The pressure metrics' one owner: ``PressureMetrics``, made by ``instrument()``, kept by the
instrumentor and stopped by ``uninstrument()`` (the instruments and what they observe are in
``_pressure``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import weakref
from typing import Any

from opentelemetry import metrics

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._otel_private import instrumented_instance
from opentelemetry.instrumentation.nemo_gym.pressure._loop_lag import LoopLagProbe
from opentelemetry.instrumentation.nemo_gym.pressure._pressure import (
    PROCESS_METRICS,
    InFlightApp,
    _InFlight,
    _ProcessPressure,
    nemo_gym_observer_records,
)

__all__ = ["PressureMetrics"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)


class PressureMetrics:
    """The pressure metrics of one instrumentation: made by ``instrument()``, kept by the
    instrumentor, ended by ``stop()`` in ``uninstrument()``. Nothing of it lives in the module.

    ``start(provider, loop)`` starts, on the loop's thread, the loop's lag probe (once per
    loop) and the process's instruments, GC callback and system metrics (once, on the first
    provider given, until ``stop``). Thread-safe; never raises from ``start``.
    """

    def __init__(self, interval_s: float, version: str) -> None:
        self._interval_s = interval_s
        self._version = version
        self._lock = threading.Lock()
        self._process: _ProcessPressure | None = None
        self._system_metrics: Any = None  # the SystemMetricsInstrumentor we instrumented
        # Each loop's probe, weakly on both sides: a probe refers to its loop (it schedules on
        # it), so a strong value would keep its own key, and with it every loop that ever built
        # a connector, alive for as long as this object. A running probe is kept alive by its
        # timer handle in the loop's schedule, which ``loop.close()`` clears (or by the loop
        # itself while it is garbage, unclosed): the probe then goes with its loop, and the
        # entry with both.
        self._probes: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, weakref.ref[LoopLagProbe]
        ] = weakref.WeakKeyDictionary()

    def probed(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether ``loop`` has a lag probe now."""
        with self._lock:
            known = self._probes.get(loop)
        return known is not None and known() is not None

    def probed_loops(self) -> int:
        """How many loops have a lag probe now."""
        with self._lock:
            return sum(1 for known in self._probes.values() if known() is not None)

    def _process_pressure(self, provider: metrics.MeterProvider) -> _ProcessPressure:
        """This process's instruments, made and the GC callback installed on first use."""
        with self._lock:
            if self._process is None:
                self._process = _ProcessPressure(provider, self._version)
                gc.callbacks.append(self._process.gc)
                self._system_metrics = _start_process_metrics(provider)
            return self._process

    def start(self, provider: metrics.MeterProvider, loop: asyncio.AbstractEventLoop) -> bool:
        """Start the pressure metrics of ``loop``'s process on ``provider``; call on ``loop``'s
        thread. Starts nothing while NeMo Gym's observer records. Whether they run now; never
        raises (a failure is logged once)."""
        try:
            if nemo_gym_observer_records():
                _ONCE(
                    "observer", logging.DEBUG, "nemo_gym: NeMo Gym's observer records the pressure"
                )
                return False
            pressure = self._process_pressure(provider)
            with self._lock:
                known = self._probes.get(loop)
                probe = known() if known is not None else None
                if probe is None:
                    probe = LoopLagProbe(loop, self._interval_s, pressure.record_lag)
                    self._probes[loop] = weakref.ref(probe)
            probe.start()
        except Exception as exc:  # noqa: BLE001 - telemetry never stops a server from starting
            _ONCE(("start", type(exc).__name__), logging.WARNING, "nemo_gym: pressure: %r", exc)
            return False
        return True

    def wrap_app(self, app: Any) -> Any:
        """``app`` counted by an ``InFlightApp`` (once) while the pressure metrics run; else
        ``app`` itself."""
        pressure = self._process
        if pressure is None or isinstance(app, InFlightApp):
            return app
        count = _InFlight()
        pressure.in_flight.add(count)
        return InFlightApp(app, count)

    def stop(self) -> None:
        """Stop every probe, remove the GC callback and uninstrument the system metrics we
        instrumented. Instruments already made stay with their provider (the SDK keeps them)."""
        with self._lock:
            for loop, known in list(self._probes.items()):
                probe = known()
                if probe is None:
                    continue
                try:
                    running = asyncio.get_running_loop()
                except RuntimeError:
                    running = None
                if running is loop or not loop.is_running():
                    probe.stop()
                elif not loop.is_closed():
                    loop.call_soon_threadsafe(probe.stop)
            self._probes.clear()
            if self._process is not None:
                with contextlib.suppress(ValueError):
                    gc.callbacks.remove(self._process.gc)
                self._process = None
            if self._system_metrics is not None:
                self._system_metrics.uninstrument()
                self._system_metrics = None


def _start_process_metrics(provider: metrics.MeterProvider) -> Any:
    """Instrument opentelemetry-instrumentation-system-metrics for ``PROCESS_METRICS``, where
    it is installed and not instrumented already (then it stays as its instrumentor made it);
    the instrumentor we instrumented, else ``None``."""
    try:
        from opentelemetry.instrumentation.system_metrics import (  # the pressure extra
            SystemMetricsInstrumentor,
        )
    except ImportError:
        _ONCE(
            "no-system-metrics",
            logging.DEBUG,
            "nemo_gym: opentelemetry-instrumentation-system-metrics is not installed "
            "(the pressure extra); no process metrics",
        )
        return None
    existing = instrumented_instance(SystemMetricsInstrumentor)
    if existing is not None and existing.is_instrumented_by_opentelemetry:
        return None
    instrumentor = SystemMetricsInstrumentor(config=dict(PROCESS_METRICS))
    instrumentor.instrument(meter_provider=provider)
    return instrumentor
