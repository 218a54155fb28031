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
Only OpenTelemetry's context is replaced, for the call's duration; the application's own
context variables, its results, exceptions and cancellation pass through unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from opentelemetry import context

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog

__all__ = ["FreshTraceContextApp", "wrap_app"]

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
