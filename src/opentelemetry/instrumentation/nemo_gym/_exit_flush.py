"""Export what a process counted as soon as it starts to exit, before slower exit handlers.

The SDK exports a meter provider's last data from its own ``atexit`` handler, registered when
``opentelemetry-instrument`` configured it: the first registered, so the *last* to run. A NeMo
Gym server imports Ray and NeMo Gym after that, and their exit handlers (closing the global
aiohttp client, shutting down Ray) run first and take seconds, while NeMo Gym kills a server
one second after its SIGINT. ``flush_at_exit(provider)``, called when the first timed
connector is built (after the application's own imports), registers a flush that runs first
at exit: the export then leaves before those handlers. The SDK's own shutdown still exports
afterwards (the same cumulative totals). A failing flush is logged at debug and never delays
exit beyond its bound.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_MS = 5000

_LOCK = threading.Lock()
_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()


def _flush(reference: weakref.ref[Any]) -> None:
    provider = reference()
    if provider is None:
        return
    try:
        provider.force_flush(timeout_millis=FLUSH_TIMEOUT_MS)
    except Exception:  # exit goes on; the SDK's own shutdown still exports
        logger.debug("nemo_gym: flushing metrics at exit failed", exc_info=True)


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
