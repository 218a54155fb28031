"""The pressure metrics of every uvicorn server, so of every NeMo Gym server.

NeMo Gym serves each of its servers' FastAPI apps with uvicorn (``uvicorn.run`` in
``nemo_gym.server_utils``). ``uvicorn.Server.startup`` runs on the serving loop, after the
app is loaded and before the first connection is accepted; while the instrumentor's
``pressure_patch()`` is installed it first starts the pressure metrics for that loop
(``PressureMetrics.start``) and wraps the loaded app in ``InFlightApp``, which counts the requests
in flight and changes nothing else. The lifespan and every connection then run the wrapped
app. (Each request's fresh OpenTelemetry context is a hook of its own,
``integrations.uvicorn._request_context``, with a switch of its own.)

Nothing here imports uvicorn: a post-import hook patches ``Server`` when the application
imports ``uvicorn.server``, or at once if it already has. Uninstalling restores it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from opentelemetry import metrics

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch, methods_of
from opentelemetry.instrumentation.nemo_gym.pressure._running import PressureMetrics

__all__ = ["MODULE", "pressure_patch"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

MODULE = "uvicorn.server"
_CLASS = "Server"
_METHOD = "startup"


def _starting(
    server: object, pressure: PressureMetrics, provider: metrics.MeterProvider | None
) -> None:
    """Start the pressure metrics for this server's loop and count its app's requests."""
    if provider is None or not pressure.start(provider, asyncio.get_running_loop()):
        return
    config = getattr(server, "config", None)
    app = getattr(config, "loaded_app", None)
    if app is not None:
        config.loaded_app = pressure.wrap_app(app)  # type: ignore[union-attr]


def pressure_patch(
    pressure: PressureMetrics, provider: Callable[[], metrics.MeterProvider | None]
) -> Patch:
    """A new ``Patch`` that starts ``pressure`` at each uvicorn server's startup while
    installed, on ``provider()``'s meter provider, resolved when a server starts (the global
    one may be set after ``instrument()``); ``None`` from it means not exporting, nothing
    started. The instrumentor makes one per ``instrument()``."""

    def startup(
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        try:
            _starting(instance, pressure, provider())
        except Exception as exc:  # noqa: BLE001 - a server starts whatever happens here
            _ONCE(("start", type(exc).__name__), logging.WARNING, "nemo_gym: uvicorn: %r", exc)
        return wrapped(*args, **kwargs)

    return Patch((MODULE,), methods_of(_CLASS, (_METHOD,), startup, _ONCE), _ONCE)
