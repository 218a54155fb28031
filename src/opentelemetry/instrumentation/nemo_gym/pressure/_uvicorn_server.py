"""The pressure metrics of every uvicorn server, so of every NeMo Gym server.

NeMo Gym serves each of its servers' FastAPI apps with uvicorn (``uvicorn.run`` in
``nemo_gym.server_utils``). ``uvicorn.Server.startup`` runs on the serving loop, after the
app is loaded and before the first connection is accepted; while ``install()`` is in effect it
first starts the pressure metrics for that loop (``_pressure.start``) and wraps the loaded
app in ``InFlightApp``, which counts the requests in flight and changes nothing else, around
``_trace_context.FreshTraceContextApp``, which starts each request from an empty
OpenTelemetry context (a request's span would otherwise nest under another request's, whose
context uvicorn may leak into it). The lifespan and every connection then run the wrapped app.

Nothing here imports uvicorn: a post-import hook patches ``Server`` when the application
imports ``uvicorn.server``, or at once if it already has. ``uninstall()`` restores it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from opentelemetry import metrics

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch, methods_of
from opentelemetry.instrumentation.nemo_gym.pressure import _pressure, _trace_context

__all__ = ["MODULE", "install", "uninstall"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

MODULE = "uvicorn.server"
_CLASS = "Server"
_METHOD = "startup"

# The meter provider to start on, resolved when a server starts (the global one may be set
# after install()); None when the pressure metrics must not run (not exporting).
_PROVIDER: Callable[[], metrics.MeterProvider | None] = lambda: None  # noqa: E731


def _starting(server: object) -> None:
    """Start the pressure metrics for this server's loop and count its app's requests; each
    request starts from an empty OpenTelemetry context (``_trace_context``)."""
    provider = _PROVIDER()
    pressure = provider is not None and _pressure.start(provider, asyncio.get_running_loop())
    config = getattr(server, "config", None)
    app = getattr(config, "loaded_app", None)
    if app is None:
        return
    app = _trace_context.wrap_app(app)
    if pressure:
        app = _pressure.wrap_app(app)
    config.loaded_app = app  # type: ignore[union-attr]


def _startup(
    wrapped: Callable[..., Any], instance: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    try:
        _starting(instance)
    except Exception as exc:  # noqa: BLE001 - a server starts whatever happens here
        _ONCE(("start", type(exc).__name__), logging.WARNING, "nemo_gym: uvicorn: %r", exc)
    return wrapped(*args, **kwargs)


_PATCH = Patch((MODULE,), methods_of(_CLASS, (_METHOD,), _startup, _ONCE), _ONCE)


def install(provider: Callable[[], metrics.MeterProvider | None]) -> None:
    """Start the pressure metrics at each uvicorn server's startup from now on, on
    ``provider()``'s meter provider; idempotent."""
    global _PROVIDER
    _PROVIDER = provider
    _PATCH.install()


def uninstall() -> None:
    """Restore ``Server.startup`` where our wrapper still sits; idempotent."""
    global _PROVIDER
    _PATCH.uninstall()
    _PROVIDER = lambda: None  # noqa: E731
