"""Export what a process counted as soon as it starts to exit, before slower exit handlers.

The SDK exports a meter provider's last data from its own ``atexit`` handler, registered when
``opentelemetry-instrument`` configured it: the first registered, so the *last* to run. A NeMo
Gym server imports Ray and NeMo Gym after that, and their exit handlers (closing the global
aiohttp client, shutting down Ray) run first and take seconds, while NeMo Gym kills a server
one second after its SIGINT. ``flush_at_exit(provider)``, called when the first timed
connector is built (after the application's own imports), registers a flush that runs first
at exit: the export then leaves before those handlers. The SDK's own shutdown still exports
afterwards (the same cumulative totals). A failing flush is logged at debug.

Against a collector that is down or hung, the OTLP exporters retry until their own timeout
(``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s by default; they ignore the flush's), and the SDK's
shutdown already spends up to two such timeouts (the export in flight, then the last one).
A flush queued behind them would add a third, so exit is never held up for more than
``EXIT_WAIT_S``: an export still in flight at exit that does not end within it means the
collector is slow or down, and the flush is left to the SDK's shutdown; the flush itself runs
on a thread of its own and is waited for no longer than what is left of that time (on Python
3.12, which starts no thread during exit, it runs in the handler itself).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any

from opentelemetry.instrumentation.nemo_gym._exporting import metric_export_in_flight

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_MS = 5000
# NeMo Gym kills a server 1 s after its SIGINT: a flush not done by then is not waited for.
EXIT_WAIT_S = 1.0
_IN_FLIGHT_POLL_S = 0.01

_LOCK = threading.Lock()
_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()


def _flush_provider(provider: Any) -> None:
    try:
        provider.force_flush(timeout_millis=FLUSH_TIMEOUT_MS)
    except Exception:  # exit goes on; the SDK's own shutdown still exports
        logger.debug("nemo_gym: flushing metrics at exit failed", exc_info=True)


def _flush(reference: weakref.ref[Any]) -> None:
    provider = reference()
    if provider is None:
        return
    try:
        deadline = time.monotonic() + EXIT_WAIT_S
        while metric_export_in_flight(provider):
            if time.monotonic() >= deadline:
                logger.debug("nemo_gym: an export is still in flight at exit; not flushing")
                return
            time.sleep(_IN_FLIGHT_POLL_S)
        flusher = threading.Thread(
            target=_flush_provider, args=(provider,), name="nemo-gym-exit-flush", daemon=True
        )
        try:
            flusher.start()
        except RuntimeError:
            # Python 3.12 starts no thread once finalization has begun, exit handlers
            # included: flush here, unbounded by EXIT_WAIT_S but not queued behind an export.
            _flush_provider(provider)
            return
        flusher.join(max(0.0, deadline - time.monotonic()))
    except Exception:  # exit goes on; the SDK's own shutdown still exports
        logger.debug("nemo_gym: could not flush metrics at exit", exc_info=True)


def flush_at_exit(provider: Any) -> None:
    """Flush ``provider`` (an SDK ``MeterProvider``) first thing at interpreter exit; once
    per provider, never raises."""
    try:
        with _LOCK:
            if provider in _REGISTERED:
                return
            _REGISTERED.add(provider)
        atexit.register(_flush, weakref.ref(provider))
    except Exception:  # telemetry set-up never fails the application
        logger.debug("nemo_gym: could not register the exit flush", exc_info=True)
