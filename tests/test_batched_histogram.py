"""``BatchedHistogram``: buffered samples reach the SDK histogram exactly, with their context."""

from __future__ import annotations

import threading

import pytest
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from opentelemetry.instrumentation.nemo_gym.telemetry._batched_histogram import (
    BatchedHistogram,
)

NAME = "gym.http.connection_pool.queue_duration_ms"
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 1000.0)
ATTRIBUTES = {"nemo.gym.http.destination.server.name": "policy"}


def _points(reader: InMemoryMetricReader) -> list[HistogramDataPoint]:
    data = reader.get_metrics_data()
    points: list[HistogramDataPoint] = []
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == NAME:
                    points.extend(
                        p for p in metric.data.data_points if isinstance(p, HistogramDataPoint)
                    )
    return points


def _provider() -> tuple[MeterProvider, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    return MeterProvider(metric_readers=[reader]), reader


def test_batched_histogram_exports_what_immediate_recording_exports() -> None:
    """Count, sum, min, max and bucket counts equal those of a histogram recorded directly."""
    direct_provider, direct_reader = _provider()
    batched_provider, batched_reader = _provider()
    direct = direct_provider.get_meter("test").create_histogram(
        NAME, unit="ms", explicit_bucket_boundaries_advisory=BUCKETS
    )
    batched = BatchedHistogram(
        batched_provider.get_meter("test").create_histogram(
            NAME, unit="ms", explicit_bucket_boundaries_advisory=BUCKETS
        ),
        batch_size=16,
    )
    values = [0.003 * 1.37**i for i in range(40)] * 5
    for value in values:
        direct.record(value, ATTRIBUTES)
        batched.record(value, ATTRIBUTES)
    batched.flush()
    (want,) = _points(direct_reader)
    (got,) = _points(batched_reader)
    assert got.count == want.count == len(values)
    assert got.sum == pytest.approx(want.sum, rel=1e-12)
    assert (got.min, got.max) == (want.min, want.max)
    assert list(got.bucket_counts) == list(want.bucket_counts)
    assert dict(got.attributes or {}) == ATTRIBUTES
    direct_provider.shutdown()
    batched_provider.shutdown()


def test_batched_histogram_buffers_until_batch_size() -> None:
    """Samples wait in the buffer until ``batch_size`` of them are there, then all are recorded."""
    provider, reader = _provider()
    batched = BatchedHistogram(
        provider.get_meter("test").create_histogram(NAME, unit="ms"), batch_size=4
    )
    for value in (1.0, 2.0, 3.0):
        batched.record(value, ATTRIBUTES)
    assert batched.pending == 3
    assert _points(reader) == []
    batched.record(4.0, ATTRIBUTES)
    assert batched.pending == 0
    (point,) = _points(reader)
    assert (point.count, point.sum) == (4, 10.0)
    provider.shutdown()


def test_batched_histogram_flushed_by_a_callback_is_exact_at_every_collection() -> None:
    """An observable callback that flushes first makes each collection include every sample."""
    provider, reader = _provider()
    meter = provider.get_meter("test")
    batched = BatchedHistogram(meter.create_histogram(NAME, unit="ms"), batch_size=1000)

    def observe(_options: CallbackOptions) -> list[Observation]:
        batched.flush()
        return [Observation(1)]

    meter.create_observable_counter("flush.hook", callbacks=[observe])
    batched.record(5.0, ATTRIBUTES)
    (point,) = _points(reader)
    assert point.count == 1
    batched.record(7.0, ATTRIBUTES)
    (point,) = _points(reader)
    assert (point.count, point.sum) == (2, 12.0)
    provider.shutdown()


def test_batched_histogram_keeps_the_recording_context_for_exemplars() -> None:
    """A sample buffered inside a span and flushed outside it still has that span's exemplar."""
    provider, reader = _provider()
    tracer_provider = TracerProvider()
    batched = BatchedHistogram(
        provider.get_meter("test").create_histogram(NAME, unit="ms"), batch_size=100
    )
    with tracer_provider.get_tracer("test").start_as_current_span("request") as span:
        batched.record(3.0, ATTRIBUTES)
        trace_id = span.get_span_context().trace_id
    assert trace.get_current_span().get_span_context().trace_id != trace_id
    batched.flush()
    (point,) = _points(reader)
    assert [e.trace_id for e in point.exemplars] == [trace_id]
    provider.shutdown()
    tracer_provider.shutdown()


def test_batched_histogram_concurrent_flushes_record_each_sample_once() -> None:
    """Recording on one thread while another flushes loses and duplicates nothing."""
    provider, reader = _provider()
    batched = BatchedHistogram(
        provider.get_meter("test").create_histogram(NAME, unit="ms"), batch_size=64
    )
    done = threading.Event()

    def flusher() -> None:
        while not done.is_set():
            batched.flush()

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for _ in range(20_000):
            batched.record(1.0, ATTRIBUTES)
    finally:
        done.set()
        thread.join(timeout=30)
    batched.flush()
    (point,) = _points(reader)
    assert (point.count, point.sum) == (20_000, 20_000.0)
    provider.shutdown()


@pytest.mark.parametrize("batch_size", [0, -1, True, 2.5])
def test_batched_histogram_rejects_a_bad_batch_size(batch_size: object) -> None:
    """A batch size that is not an integer of at least 1 raises ``ValueError`` naming it."""
    provider, _reader = _provider()
    histogram = provider.get_meter("test").create_histogram(NAME)
    with pytest.raises(ValueError, match="batch_size="):
        BatchedHistogram(histogram, batch_size=batch_size)  # type: ignore[arg-type]
    provider.shutdown()
