"""Every private name or attribute of OpenTelemetry this package reads, each for one reason.

OpenTelemetry offers no public way to ask what these functions answer; where it does (the
readers' ``force_flush``, ``collect``, ``shutdown``; ``trace.get_current_span``; the
``suppress_instrumentation`` context manager) the package uses that instead, and this module
says beside each read why the public API does not do the job. Everything is read through
``getattr`` with a default: a release that renames a name makes the function answer "unknown"
(``None`` or an empty tuple), which turns the capability that needs it off rather than
breaking the application; its callers say so once. ``tests/test_sdk_internals.py`` removes
each name from real SDK objects and runs on the lowest and the newest SDK the package supports.

No other module of the package reads an OpenTelemetry attribute whose name starts with ``_``
(``tests/test_sdk_internals.py`` checks the source).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def private_name(module: str, name: str, capability: str) -> object | None:
    """``module.name``, or ``None`` (and one warning naming ``capability``) where it is gone.

    Why private: the API offers no public way to tell its proxy meter provider from a real one
    (``_ProxyMeterProvider``), nor the context keys behind ``suppress_instrumentation`` and
    ``suppress_http_instrumentation``, which a hot path reads with ``context.get_value`` instead
    of entering a context manager. Called once per name, at import. Never raises.
    """
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except Exception as error:  # noqa: BLE001 - a renamed internal must not break importing
        logger.warning(
            "nemo_gym: %s is off: this OpenTelemetry has no %s.%s (%s: %s)",
            capability,
            module,
            name,
            type(error).__name__,
            error,
        )
        return None


def provider_disabled(provider: object) -> bool:
    """Whether an SDK provider was built disabled (``OTEL_SDK_DISABLED`` at its construction).

    Why private: the SDK keeps it in ``_disabled`` only; the variable read now may differ from
    the one the provider was built under.
    """
    return bool(getattr(provider, "_disabled", False))


def metric_readers(meter_provider: object) -> tuple[object, ...] | None:
    """The metric readers of an SDK ``MeterProvider``; ``None`` where they cannot be found
    (an SDK of another shape), which is not the same as none.

    Why private: ``MeterProvider`` has no public list of its readers. Newer SDKs can add and
    remove readers after construction (``add_metric_reader``); the measurement consumer's
    storages (keyed by reader) are then the live set, while ``_metric_readers`` only remembers
    the constructor's argument. Older SDKs have just the latter.
    """
    consumer = getattr(meter_provider, "_measurement_consumer", None)
    storages = getattr(consumer, "_reader_storages", None)
    for readers in (storages, getattr(meter_provider, "_metric_readers", None)):
        if readers is None:
            continue
        try:
            return tuple(readers)
        except TypeError:
            continue
    return None


def span_processors(tracer_provider: object) -> tuple[object, ...] | None:
    """The span processors of an SDK ``TracerProvider``; ``None`` where they cannot be found.

    Why private: ``TracerProvider`` has ``add_span_processor`` but no public list.
    """
    multi = getattr(tracer_provider, "_active_span_processor", None)
    processors = getattr(multi, "_span_processors", None)
    return tuple(processors) if isinstance(processors, tuple | list) else None


def reader_exporting(reader: object) -> bool:
    """Whether a ``PeriodicExportingMetricReader`` is exporting right now; ``False`` for any
    other reader, or an SDK of another shape.

    Why private: the reader holds ``_export_lock`` around each export and says so nowhere else.
    """
    locked = getattr(getattr(reader, "_export_lock", None), "locked", None)
    return callable(locked) and bool(locked())


def stop_periodic_thread(reader: object) -> threading.Thread | None:
    """Tell a ``PeriodicExportingMetricReader``'s thread to stop, which makes it collect and
    export one last time; the thread, while it is alive, else ``None``. Never blocks.

    Why private: the public ``shutdown()`` does the same and then marks the reader shut down,
    so the SDK's own shutdown at exit warns and ``force_flush`` no longer works; setting the
    reader's ``_shutdown_event`` starts that last export and leaves the reader usable.
    """
    stop = getattr(reader, "_shutdown_event", None)
    ticker = getattr(reader, "_daemon_thread", None)
    if not isinstance(stop, threading.Event) or not isinstance(ticker, threading.Thread):
        return None
    if not ticker.is_alive():
        return None
    stop.set()
    return ticker


def collect_and_export(reader: object) -> tuple[Callable[..., Any], Any, Callable[..., Any]] | None:
    """A periodic reader's ``(collect, export lock, exporter's export)``, for an export whose
    result is kept; ``None`` for any other reader, or an SDK of another shape.

    Why private: the public ``force_flush`` (and ``collect``) of a periodic reader returns
    ``True`` whatever its exporter answered, so a caller that must know whether the data left
    (``ray.flush()``) does what ``collect`` does, under the same lock, and keeps the result.
    """
    collect = getattr(reader, "_collect", None)
    lock = getattr(reader, "_export_lock", None)
    export = getattr(getattr(reader, "_exporter", None), "export", None)
    if not callable(collect) or lock is None or not callable(export):
        return None
    return collect, lock, export


def instrumented_instance(instrumentor_class: type) -> Any:
    """The one instance a contrib ``BaseInstrumentor`` subclass made, or ``None``.

    Why private: ``BaseInstrumentor`` keeps its singleton in ``_instance``, and constructing
    the class again (the public way to reach it) re-runs ``__init__``, replacing the
    configuration of an instance already instrumented (whose callbacks read it).
    """
    return getattr(instrumentor_class, "_instance", None)
