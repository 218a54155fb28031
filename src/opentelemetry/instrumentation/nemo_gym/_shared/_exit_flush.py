"""The last counts leave as soon as a process starts to end: first thing at exit, and at SIGTERM.

At exit. The SDK exports a meter provider's last data from its own ``atexit`` handler,
registered when ``opentelemetry-instrument`` configured it: the first registered, so the
*last* to run. A NeMo Gym server imports Ray and NeMo Gym after that, and their exit handlers
(closing the global aiohttp client, shutting down Ray) run first and take seconds, while NeMo
Gym kills a server one second after its SIGINT. ``flush_at_exit(provider)``, called when the
first timed connector is built and when a uvicorn server starts with the pressure metrics
(both after the application's own imports), registers a handler
that runs first at exit and starts that last export then, on the periodic reader's own thread
(``start_last_exports``): the export the SDK's shutdown waits for anyway, started earlier. It
waits for it at most ``EXIT_WAIT_S``; the SDK's shutdown later finds it done or under way.
So the plugin adds no export, and no export timeout, to exit: against a collector that is
down or hung, exit costs what the SDK's own shutdown costs (up to two
``OTEL_EXPORTER_OTLP_TIMEOUT``: the export in flight, then the last one), and with a slow exit
handler in between, less. No thread is started during exit (Python 3.12 refuses to).

At SIGTERM. Kubernetes, Slurm and most process managers stop a process with SIGTERM, whose
default action ends it at once: no exit handler runs, and what was counted since the last
periodic export is lost. ``flush_at_sigterm()``, called by ``instrument()``, installs a handler
only where SIGTERM has its default action; it starts the same last exports, waits for them at
most ``EXIT_WAIT_S``, then restores the default action and raises the signal again, so the
process ends as SIGTERM would have ended it (status -15, 143 in a shell). A handler of the
application's own, installed before ``instrument()`` or after it, is left alone. Python runs a
signal's handler in the main thread, between two bytecodes: a main thread stuck in one long C
call ends when that call returns.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
import weakref
from collections.abc import Iterable
from types import FrameType
from typing import Any

from opentelemetry import metrics

from opentelemetry.instrumentation.nemo_gym._shared._exporting import start_last_exports

logger = logging.getLogger(__name__)

# NeMo Gym kills a server 1 s after its SIGINT: a last export not done by then is not waited
# for (the SDK's shutdown still waits for it at exit).
EXIT_WAIT_S = 1.0

_LOCK = threading.Lock()
_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()


def export_last(providers: Iterable[object], wait_s: float = EXIT_WAIT_S) -> None:
    """Start each SDK meter provider's last periodic export and wait at most ``wait_s`` for
    them all; starts no thread, never raises."""
    deadline = time.monotonic() + wait_s
    try:
        exporting = [thread for provider in providers for thread in start_last_exports(provider)]
        for thread in exporting:
            thread.join(max(0.0, deadline - time.monotonic()))
    except Exception:  # the process ends anyway; the SDK's shutdown still exports at exit
        logger.debug("nemo_gym: could not export the last metrics", exc_info=True)


def _at_exit(reference: weakref.ref[Any]) -> None:
    provider = reference()
    if provider is not None:
        export_last([provider])


def flush_at_exit(provider: Any) -> None:
    """Start ``provider``'s (an SDK ``MeterProvider``) last export first thing at interpreter
    exit; once per provider, never raises."""
    try:
        with _LOCK:
            if provider in _REGISTERED:
                return
            _REGISTERED.add(provider)
        atexit.register(_at_exit, weakref.ref(provider))
    except Exception:  # telemetry set-up never fails the application
        logger.debug("nemo_gym: could not register the exit flush", exc_info=True)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Export the last counts, then end the process as the signal's default action would."""
    try:
        # No lock: the handler runs in the main thread, which may be holding it.
        providers = dict.fromkeys([*_REGISTERED, metrics.get_meter_provider()])
    except Exception:  # a registration racing on another thread
        logger.debug("nemo_gym: could not list the providers to flush", exc_info=True)
        providers = dict.fromkeys([metrics.get_meter_provider()])
    export_last(providers)
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def stop_flush_at_exit() -> None:
    """Take every exit flush ``flush_at_exit`` registered off ``atexit``; never raises."""
    try:
        with _LOCK:
            atexit.unregister(_at_exit)
            _REGISTERED.clear()
    except Exception:  # telemetry tear-down never fails the application
        logger.debug("nemo_gym: could not unregister the exit flush", exc_info=True)


def flush_at_sigterm() -> object:
    """Handle SIGTERM where nothing else does: the last counts leave, then the process ends
    by that signal (SIGTERM's default action, chained). Left alone where SIGTERM is ignored or
    has a handler already, and off the main thread (only the main thread may set handlers).
    Returns the handler replaced (``signal.SIG_DFL``), for ``stop_flush_at_sigterm``, or
    ``None`` where nothing was installed. Never raises."""
    try:
        if threading.current_thread() is not threading.main_thread():
            logger.debug("nemo_gym: instrument() ran off the main thread; SIGTERM not handled")
            return None
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            return previous
    except Exception:  # telemetry set-up never fails the application
        logger.debug("nemo_gym: could not handle SIGTERM", exc_info=True)
    return None


def stop_flush_at_sigterm(previous: object) -> None:
    """Give SIGTERM back ``previous`` (what ``flush_at_sigterm`` returned), if our handler is
    still the one installed; a handler set after ours is left alone. Never raises."""
    try:
        if (
            previous is not None
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm
        ):
            signal.signal(signal.SIGTERM, previous)  # type: ignore[arg-type]
    except Exception:
        logger.debug("nemo_gym: could not restore SIGTERM's handler", exc_info=True)
