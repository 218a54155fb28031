"""The exit flush: the last counts leave first thing at exit, and never add an export.

These drive ``_exit_flush``'s handler directly, with the SDK's real periodic reader and an
exporter that the test holds: a collector that answers at once, and one that hangs. The
exits of real processes, on every Python the suite runs on, are tests/test_exit_time.py.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)

from opentelemetry.instrumentation.nemo_gym._shared import _exit_flush
from opentelemetry.instrumentation.nemo_gym._shared._exporting import metric_export_in_flight


class HeldExporter(MetricExporter):
    """Counts exports; while ``hold`` is clear, each export waits for it (a hung collector)."""

    def __init__(self) -> None:
        super().__init__(preferred_temporality={}, preferred_aggregation={})
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.exports = 0
        self.points: list[int] = []
        self._lock = threading.Lock()

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> MetricExportResult:
        with self._lock:
            self.exports += 1
        self.entered.set()
        self.hold.wait(30)
        for resource_metrics in metrics_data.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    self.points.extend(int(p.value) for p in metric.data.data_points)  # type: ignore[union-attr]
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        self.hold.set()


@pytest.fixture
def exporter() -> Iterator[HeldExporter]:
    held = HeldExporter()
    yield held
    held.hold.set()


def _provider(exporter: HeldExporter, interval_ms: float) -> MeterProvider:
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    counter = provider.get_meter("exit-flush-test").create_counter("exit_flush_test_total")
    counter.add(3)
    return provider


def test_exit_flush_exports_at_once_when_no_export_is_in_flight(exporter: HeldExporter) -> None:
    """With no export under way, the handler exports the current totals before it returns."""
    provider = _provider(exporter, interval_ms=600_000)
    try:
        assert not metric_export_in_flight(provider)
        _exit_flush._at_exit(weakref.ref(provider))
        assert (exporter.exports, exporter.points) == (1, [3])
    finally:
        provider.shutdown()
    assert exporter.exports == 1  # it was the SDK's last export: its shutdown adds none


def test_exit_flush_hung_export_is_the_last_one(exporter: HeldExporter) -> None:
    """An exit flush whose export hangs is the SDK's last export: its shutdown adds none."""
    exporter.hold.clear()
    provider = _provider(exporter, interval_ms=600_000)
    try:
        started = threading.active_count()
        _exit_flush._at_exit(weakref.ref(provider))  # gives up waiting after EXIT_WAIT_S
        assert exporter.entered.is_set()
        assert metric_export_in_flight(provider)
        assert exporter.exports == 1
        # The reader's own thread exports: none is started (Python 3.12 starts none at exit).
        assert threading.active_count() == started
    finally:
        exporter.hold.set()  # the collector answers at last
        provider.shutdown()
    # A second export would have been one more export timeout at exit.
    assert (exporter.exports, exporter.points) == (1, [3])


def test_exit_flush_left_to_the_sdk_while_an_export_hangs(exporter: HeldExporter) -> None:
    """An export hung at exit is not queued behind: the last export follows it, as without."""
    exporter.hold.clear()
    provider = _provider(exporter, interval_ms=50)
    try:
        assert exporter.entered.wait(30)  # the periodic export is in flight, and held
        assert metric_export_in_flight(provider)
        started = threading.active_count()
        _exit_flush._at_exit(weakref.ref(provider))
        # The handler gave up waiting and started no thread; the reader's own thread is
        # still in the hung export, so no second export has begun.
        assert exporter.exports == 1
        assert threading.active_count() == started
    finally:
        exporter.hold.set()
        provider.shutdown()
    # The export in flight, then the reader's last one: what the SDK's shutdown does alone.
    assert exporter.exports == 2
    assert not metric_export_in_flight(provider)
