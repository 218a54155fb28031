"""Each request a uvicorn server handles starts from an empty OpenTelemetry context.

uvicorn starts a task per request, and a task copies the context current where it is made.
That is not always an empty one: a connection's read callback may be re-armed from inside an
earlier request's task (``resume_reading`` when its response completes), and a pipelined
request is started from there, so the next request's task inherits the earlier request's
context, its server span current (a CPython bug, gh-140947; uvicorn's opt-in
``reset_contextvars`` works around it, NeMo Gym does not set it). The ASGI instrumentation
then sees a span already current and makes the new request's span an ``internal`` child of
the other request, in the other request's trace: in a NeMo Gym deployment of 300 rollouts,
18 of the model server's 600 requests landed in another rollout's trace.

``FreshTraceContextApp`` wraps the app uvicorn serves (the outermost one, where nothing
legitimately precedes it) and runs each HTTP or WebSocket call with an empty OpenTelemetry
context, so the instrumentation extracts the caller's context from the request's headers.
``fresh_context_patch()`` is the hook that puts it there: ``uvicorn.Server.startup`` wraps the
loaded app before the first connection is accepted. The instrumentor installs it while
``OTEL_PYTHON_NEMO_GYM_FRESH_REQUEST_CONTEXT`` (``instrument(fresh_request_context=...)``) is
on, the default, whatever the pressure metrics' setting (it concerns traces, not metrics);
nothing here imports uvicorn (a post-import hook patches ``Server`` when the application imports
``uvicorn.server``).
Only OpenTelemetry's context is replaced, for the call's duration; the application's own
context variables, its results, exceptions and cancellation pass through unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from opentelemetry import context

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch, methods_of

__all__ = ["FreshTraceContextApp", "fresh_context_patch", "wrap_app"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

_ASGIApp = Callable[..., Awaitable[None]]
_REQUEST_SCOPES = ("http", "websocket")


class FreshTraceContextApp:
    """An ASGI app that calls ``app`` for each request with an empty OpenTelemetry context.

    Other scopes (lifespan) pass straight through. Attribute reads fall through to ``app``.
    """

    __slots__ = ("app",)

    def __init__(self, app: _ASGIApp) -> None:
        self.app = app

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope.get("type") not in _REQUEST_SCOPES:
            return await self.app(scope, receive, send)
        try:
            token = context.attach(context.Context())
        except Exception as exc:  # noqa: BLE001 - the request is served whatever happens here
            _ONCE(("attach", type(exc).__name__), logging.WARNING, "nemo_gym: %r", exc)
            return await self.app(scope, receive, send)
        try:
            return await self.app(scope, receive, send)
        finally:
            try:
                context.detach(token)
            except Exception as exc:  # noqa: BLE001 - never hide the request's own outcome
                _ONCE(("detach", type(exc).__name__), logging.WARNING, "nemo_gym: %r", exc)

    def __getattr__(self, name: str) -> Any:
        if name == "app":  # not set yet (a copy being made): no recursion through it
            raise AttributeError(name)
        return getattr(self.app, name)


def wrap_app(app: Any) -> Any:
    """``app`` wrapped by ``FreshTraceContextApp`` (once)."""
    return app if isinstance(app, FreshTraceContextApp) else FreshTraceContextApp(app)


def _fresh_context_at_startup(
    wrapped: Callable[..., Any], instance: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``uvicorn.Server.startup``, with the loaded app wrapped by ``FreshTraceContextApp``."""
    try:
        config = getattr(instance, "config", None)
        app = getattr(config, "loaded_app", None)
        if app is not None:
            config.loaded_app = wrap_app(app)  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001 - a server starts whatever happens here
        _ONCE(("startup", type(exc).__name__), logging.WARNING, "nemo_gym: uvicorn: %r", exc)
    return wrapped(*args, **kwargs)


def fresh_context_patch() -> Patch:
    """A new ``Patch`` that, while installed, makes every uvicorn server started afterwards
    serve its app through ``FreshTraceContextApp`` (the instrumentor makes one per
    ``instrument()``). Uninstalling restores ``Server.startup``; servers already started
    keep their wrapped app."""
    return Patch(
        ("uvicorn.server",),
        methods_of("Server", ("startup",), _fresh_context_at_startup, _ONCE),
        _ONCE,
    )
