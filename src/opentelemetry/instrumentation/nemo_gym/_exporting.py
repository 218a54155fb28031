"""Is this process exporting metrics, or traces?

Telemetry that nobody exports should cost nothing, so the timed connector and the resource
sampler are only switched on when the global (or given) provider is an SDK provider that is
not disabled and has somewhere to send data. The SDK exposes no public "has readers" or "has
processors" question, so the answer reads its private state here, in one place, through
``getattr`` with safe defaults: when the SDK changes shape we answer "not exporting", which
turns our telemetry off rather than breaking the application.
"""

from __future__ import annotations

import os

from opentelemetry import metrics, trace
from opentelemetry.sdk.environment_variables import OTEL_SDK_DISABLED
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider


def sdk_disabled() -> bool:
    """``OTEL_SDK_DISABLED=true`` in the environment."""
    return os.environ.get(OTEL_SDK_DISABLED, "").strip().lower() == "true"


def metrics_exported(meter_provider: metrics.MeterProvider | None = None) -> bool:
    """Whether ``meter_provider`` (default: the global one) sends metrics anywhere."""
    provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
    if not isinstance(provider, SdkMeterProvider) or sdk_disabled():
        return False
    if getattr(provider, "_disabled", False):
        return False
    return _metric_reader_count(provider) > 0


def _metric_reader_count(provider: SdkMeterProvider) -> int:
    # Newer SDKs can add and remove readers after construction (add_metric_reader); the
    # measurement consumer's storages are then the live set, while _metric_readers only
    # remembers the constructor's argument. Older SDKs have just the latter.
    consumer = getattr(provider, "_measurement_consumer", None)
    storages = getattr(consumer, "_reader_storages", None)
    if storages is not None:
        try:
            return len(storages)
        except TypeError:
            pass
    readers = getattr(provider, "_metric_readers", ())
    try:
        return len(readers)
    except TypeError:
        return 0


def span_processors(tracer_provider: trace.TracerProvider) -> tuple[object, ...]:
    """The span processors registered on an SDK tracer provider; empty for any other."""
    if not isinstance(tracer_provider, SdkTracerProvider):
        return ()
    multi = getattr(tracer_provider, "_active_span_processor", None)
    processors = getattr(multi, "_span_processors", ())
    return tuple(processors) if isinstance(processors, tuple | list) else ()


def traces_exported(
    tracer_provider: trace.TracerProvider | None = None,
    *,
    ignore: tuple[type, ...] = (),
) -> bool:
    """Whether ``tracer_provider`` (default: the global one) sends spans anywhere.

    Processors that are instances of ``ignore`` (our own, which only decorate spans) do not
    count as a destination.
    """
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    if not isinstance(provider, SdkTracerProvider) or sdk_disabled():
        return False
    if getattr(provider, "_disabled", False):
        return False
    return any(not isinstance(p, ignore) for p in span_processors(provider))
