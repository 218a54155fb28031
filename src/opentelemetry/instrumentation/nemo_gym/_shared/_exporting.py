"""Is this process exporting metrics, or traces?

Telemetry that nobody exports should cost nothing, so the timed connector and the resource
sampler are only switched on when the global (or given) provider is an SDK provider that is
not disabled and has somewhere to send data. The SDK exposes no public "has readers" or "has
processors" question, so the answer reads its private state through ``_otel_private`` (the one
module that does): when the SDK changes shape we answer "not exporting", which turns our
telemetry off rather than breaking the application, and say so once, as a warning naming the
attribute that is gone (the status line then gives the same reason).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Final, Literal

from opentelemetry import metrics, trace
from opentelemetry.environment_variables import OTEL_METRICS_EXPORTER, OTEL_TRACES_EXPORTER
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.environment_variables import OTEL_SDK_DISABLED
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.metrics.export import MetricExportResult
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

from opentelemetry.instrumentation.nemo_gym._shared import _otel_private
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog

logger = logging.getLogger(__name__)
_UNREADABLE = OnceLog(logger)

# What an SDK whose readers or processors this module cannot find is told, and logged, once.
_NO_READERS: Final = (
    "this opentelemetry-sdk's MeterProvider has neither _measurement_consumer._reader_storages "
    "nor _metric_readers, so its metric readers cannot be counted"
)
_NO_PROCESSORS: Final = (
    "this opentelemetry-sdk's TracerProvider has no _active_span_processor._span_processors, "
    "so its span processors cannot be counted"
)


def _unreadable(reason: str, capability: str) -> str:
    _UNREADABLE(reason, logging.WARNING, "nemo_gym: %s is off: %s", capability, reason)
    return reason


def sdk_disabled() -> bool:
    """``OTEL_SDK_DISABLED=true`` in the environment."""
    return os.environ.get(OTEL_SDK_DISABLED, "").strip().lower() == "true"


# Each status is (exporting, reason). The reason is a phrase for the instrumentor's one-line
# summary: what was found, and for a "no", what would turn it on.
ExportStatus = tuple[bool, str]

_INSTALL_HINT = (
    "for opentelemetry-instrument install opentelemetry-distro and an exporter, "
    "or set an SDK {kind} yourself"
)


def metrics_deliberately_off() -> bool:
    """Whether the environment says, on purpose, that no metrics are exported
    (``OTEL_SDK_DISABLED=true`` or ``OTEL_METRICS_EXPORTER=none``)."""
    return sdk_disabled() or _exporter_none(OTEL_METRICS_EXPORTER)


def _exporter_none(variable: str) -> bool:
    return os.environ.get(variable, "").strip().lower() == "none"


def _common_refusal(
    provider: object, sdk_class: type, kind: Literal["MeterProvider", "TracerProvider"]
) -> str | None:
    """Why ``provider`` cannot export whatever its readers are, or None when it could."""
    if sdk_disabled():
        return f"{OTEL_SDK_DISABLED}=true"
    if not isinstance(provider, sdk_class):
        return (
            f"no SDK {kind} (the global one is a {type(provider).__name__.lstrip('_')}; "
            f"{_INSTALL_HINT.format(kind=kind)})"
        )
    if _otel_private.provider_disabled(provider):
        return f"the SDK {kind} is disabled"
    return None


def metrics_export_status(meter_provider: metrics.MeterProvider | None = None) -> ExportStatus:
    """Whether ``meter_provider`` (default: the global one) sends metrics anywhere, and why.

    Never raises; the reason names what was found (``OTEL_SDK_DISABLED``, no SDK provider,
    no metric reader, ``OTEL_METRICS_EXPORTER=none``).
    """
    provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
    refusal = _common_refusal(provider, SdkMeterProvider, "MeterProvider")
    if refusal is not None or not isinstance(provider, SdkMeterProvider):
        return False, refusal or "no SDK MeterProvider"
    readers = _metric_reader_count(provider)
    if readers is None:
        return False, _unreadable(_NO_READERS, "telemetry that needs a metric reader")
    if readers == 0:
        if _exporter_none(OTEL_METRICS_EXPORTER):
            return False, f"{OTEL_METRICS_EXPORTER}=none: the MeterProvider has no metric reader"
        return False, "the SDK MeterProvider has no metric reader"
    return True, f"SDK MeterProvider with {readers} metric reader{'' if readers == 1 else 's'}"


def metrics_exported(meter_provider: metrics.MeterProvider | None = None) -> bool:
    """Whether ``meter_provider`` (default: the global one) sends metrics anywhere."""
    return metrics_export_status(meter_provider)[0]


def _metric_reader_count(provider: SdkMeterProvider) -> int | None:
    readers = _otel_private.metric_readers(provider)
    return None if readers is None else len(readers)


def metric_export_in_flight(meter_provider: object) -> bool:
    """Whether one of an SDK meter provider's periodic readers is exporting right now.

    Read from the reader's export lock, which it holds around each export; ``False`` for any
    other provider or reader, or when the SDK changes shape.
    """
    if not isinstance(meter_provider, SdkMeterProvider):
        return False
    readers = _otel_private.metric_readers(meter_provider) or ()
    return any(_otel_private.reader_exporting(reader) for reader in readers)


def start_last_exports(meter_provider: object) -> tuple[threading.Thread, ...]:
    """Make each periodic reader of an SDK meter provider run its last export now; the
    readers' threads that do it.

    A ``PeriodicExportingMetricReader``'s thread, once told to stop, finishes the export it is
    in, collects and exports one last time, and ends: the same export the SDK's shutdown
    waits for at exit, started early, so nothing is queued behind it and no thread is started
    (Python 3.12 starts none during exit). The reader is not shut down: ``force_flush`` and
    the SDK's shutdown still work, and the shutdown then finds that export done or under way.
    Counts recorded after it are not exported by that reader. Other readers, and an SDK of
    another shape, are left alone; never blocks, never raises for an SDK provider.
    """
    if not isinstance(meter_provider, SdkMeterProvider):
        return ()
    readers = _otel_private.metric_readers(meter_provider) or ()
    stopped = (_otel_private.stop_periodic_thread(reader) for reader in readers)
    return tuple(thread for thread in stopped if thread is not None)


def export_metrics_now(meter_provider: object, timeout_millis: float) -> bool:
    """Collect and export now, for each metric reader of an SDK meter provider; whether every
    export succeeded.

    The SDK's ``force_flush`` returns ``True`` whatever its exporters answered, so for a
    periodic reader this does what its ``collect`` does and keeps the exporter's result:
    under the reader's export lock (no export runs twice at once), with instrumentation
    suppressed. Other readers get their own ``force_flush``. Blocks for as long as the
    exporters take (they may ignore ``timeout_millis``): run it where that is bounded.
    """
    if not isinstance(meter_provider, SdkMeterProvider):
        return True
    succeeded = True
    for reader in _otel_private.metric_readers(meter_provider) or ():
        periodic = _otel_private.collect_and_export(reader)
        if periodic is None:
            force_flush = getattr(reader, "force_flush", None)
            succeeded = callable(force_flush) and bool(force_flush(timeout_millis)) and succeeded
            continue
        collect, lock, export = periodic
        collected = collect(reader, timeout_millis=timeout_millis)
        if collected is None:
            continue
        with suppress_instrumentation(), lock:
            result = export(collected, timeout_millis=timeout_millis)
        succeeded = result is MetricExportResult.SUCCESS and succeeded
    return succeeded


def span_processors(tracer_provider: trace.TracerProvider) -> tuple[object, ...]:
    """The span processors registered on an SDK tracer provider; empty for any other, or
    where the SDK keeps them where this module cannot read them."""
    if not isinstance(tracer_provider, SdkTracerProvider):
        return ()
    return _otel_private.span_processors(tracer_provider) or ()


def traces_export_status(
    tracer_provider: trace.TracerProvider | None = None,
    *,
    ignore: tuple[type, ...] = (),
) -> ExportStatus:
    """Whether ``tracer_provider`` (default: the global one) sends spans anywhere, and why.

    Processors that are instances of ``ignore`` (our own, which only decorate spans) do not
    count as a destination. Never raises.
    """
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    refusal = _common_refusal(provider, SdkTracerProvider, "TracerProvider")
    if refusal is not None or not isinstance(provider, SdkTracerProvider):
        return False, refusal or "no SDK TracerProvider"
    processors = _otel_private.span_processors(provider)
    if processors is None:
        return False, _unreadable(_NO_PROCESSORS, "telemetry that needs a span processor")
    destinations = sum(1 for p in processors if not isinstance(p, ignore))
    if destinations == 0:
        if _exporter_none(OTEL_TRACES_EXPORTER):
            return False, f"{OTEL_TRACES_EXPORTER}=none: the TracerProvider has no span processor"
        return False, "the SDK TracerProvider has no span processor that exports"
    plural = "" if destinations == 1 else "s"
    return True, f"SDK TracerProvider with {destinations} exporting span processor{plural}"


def traces_exported(
    tracer_provider: trace.TracerProvider | None = None,
    *,
    ignore: tuple[type, ...] = (),
) -> bool:
    """Whether ``tracer_provider`` (default: the global one) sends spans anywhere.

    Processors that are instances of ``ignore`` (our own, which only decorate spans) do not
    count as a destination.
    """
    return traces_export_status(tracer_provider, ignore=ignore)[0]
