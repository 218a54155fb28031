"""One span per NeMo Gym rollout, named by NeMo Gym's own task and rollout index.

``gym eval run`` (and ``ng_collect_rollouts``) sends each rollout as one ``POST /run`` to the
agent through ``nemo_gym.server_utils.ServerClient``, with the task's row as the JSON body.
NeMo Gym stamps that row with ``_ng_task_index`` (which input task) and ``_ng_rollout_index``
(which repeat of it, from 0). While the instrumentor's ``rollout_patch()`` is installed, each
such request runs inside a span ``rollout`` carrying both, and the agent's name:

* ``nemo.gym.rollout.task_index``, ``nemo.gym.rollout.rollout_index`` (ints, as NeMo Gym
  wrote them in the row; the same pair names the rollout in NeMo Gym's output file);
* ``nemo.gym.rollout.agent``: the server the request goes to.

In the CLI nothing else is current, so that span is the root of the rollout's trace: the
HTTP client span of the request (``opentelemetry-instrumentation-aiohttp-client``) nests
under it, and through the propagated context the agent's handling and every call it makes.
A request that is not a rollout (another path, a body without both indices) gets no span.

The application sees no difference: arguments, result, exception and cancellation pass
through unchanged; a failure of ours is logged once and the request made as it is. Without
a configured tracer provider the span is the API's non-recording one. Nothing here imports
``server_utils`` (a heavy stack): a post-import hook wraps ``ServerClient.request``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextvars import Token
from typing import Any, Final, TypeVar

from opentelemetry import context, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch, Wrapper, methods_of
from opentelemetry.instrumentation.nemo_gym.version import __version__

__all__ = [
    "ATTR_AGENT",
    "ATTR_ROLLOUT_INDEX",
    "ATTR_TASK_INDEX",
    "SPAN_NAME",
    "rollout_attributes",
    "rollout_patch",
]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

SPAN_NAME: Final = "rollout"
ATTR_TASK_INDEX: Final = "nemo.gym.rollout.task_index"
ATTR_ROLLOUT_INDEX: Final = "nemo.gym.rollout.rollout_index"
ATTR_AGENT: Final = "nemo.gym.rollout.agent"

# NeMo Gym's own keys (nemo_gym.global_config.TASK_INDEX_KEY_NAME, ROLLOUT_INDEX_KEY_NAME),
# the same in 0.4, 0.5 and main; spelled out so that nothing imports NeMo Gym.
_TASK_INDEX_KEY: Final = "_ng_task_index"
_ROLLOUT_INDEX_KEY: Final = "_ng_rollout_index"
_RUN_PATH: Final = "/run"
_MODULE: Final = "nemo_gym.server_utils"

_T = TypeVar("_T")


def _index(row: dict[Any, Any], key: str) -> int | None:
    value = row.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def rollout_attributes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The span attributes of ``ServerClient.request(server_name, url_path, method, json=row)``
    when it posts a rollout to ``/run``; ``None`` for any other request."""
    server_name = args[0] if args else kwargs.get("server_name")
    url_path = args[1] if len(args) > 1 else kwargs.get("url_path")
    row = kwargs.get("json")
    if url_path != _RUN_PATH or not isinstance(row, dict):
        return None
    task_index = _index(row, _TASK_INDEX_KEY)
    rollout_index = _index(row, _ROLLOUT_INDEX_KEY)
    if task_index is None or rollout_index is None:
        return None
    attributes: dict[str, Any] = {
        ATTR_TASK_INDEX: task_index,
        ATTR_ROLLOUT_INDEX: rollout_index,
    }
    if isinstance(server_name, str) and server_name:
        attributes[ATTR_AGENT] = server_name
    return attributes


def _start(
    tracer_provider: trace.TracerProvider | None, attributes: dict[str, Any]
) -> tuple[Span, Token[Context]]:
    tracer = trace.get_tracer(_names.TRACER_NAME, __version__, tracer_provider=tracer_provider)
    span = tracer.start_span(SPAN_NAME, kind=SpanKind.INTERNAL, attributes=attributes)
    return span, context.attach(trace.set_span_in_context(span))


def _end(span: Span, token: Token[Context], error: Exception | None) -> None:
    try:
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        context.detach(token)
        span.end()
    except Exception as exc:  # noqa: BLE001 - never hide the request's own outcome
        _ONCE(("end", type(exc).__name__), logging.WARNING, "nemo_gym: rollout span: %r", exc)


async def _in_rollout_span(
    call: Callable[[], Awaitable[_T]],
    tracer_provider: trace.TracerProvider | None,
    attributes: dict[str, Any],
) -> _T:
    try:
        span, token = _start(tracer_provider, attributes)
    except Exception as exc:  # noqa: BLE001 - the rollout runs without its span
        _ONCE(("start", type(exc).__name__), logging.WARNING, "nemo_gym: rollout span: %r", exc)
        return await call()
    error: Exception | None = None
    try:
        return await call()
    except Exception as exc:
        error = exc
        raise
    finally:
        # Cancelled (CancelledError passes through): the span ends without an error status.
        _end(span, token, error)


def _wrapper_on(tracer_provider: trace.TracerProvider | None) -> Wrapper:
    """The wrapper of ``ServerClient.request`` whose rollout spans go to ``tracer_provider``
    (``None``: the global one, looked up at each rollout)."""

    def in_rollout_span(
        wrapped: Callable[..., Awaitable[Any]],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Awaitable[Any]:
        """Run ``ServerClient.request`` inside a rollout span when it posts a rollout."""
        try:
            attributes = rollout_attributes(args, kwargs)
        except Exception as exc:  # noqa: BLE001 - an unnamed request is still made
            _ONCE(("read", type(exc).__name__), logging.WARNING, "nemo_gym: rollout: %r", exc)
            attributes = None
        if attributes is None:
            return wrapped(*args, **kwargs)
        return _in_rollout_span(lambda: wrapped(*args, **kwargs), tracer_provider, attributes)

    return in_rollout_span


def rollout_patch(tracer_provider: trace.TracerProvider | None = None) -> Patch:
    """A new ``Patch`` that gives each rollout ``ServerClient`` posts a span while installed,
    on ``tracer_provider`` (default the global one at each rollout); the instrumentor makes
    one per ``instrument()``. ``install()`` never raises for a missing or different
    ``nemo_gym``; ``uninstall()`` restores ``ServerClient.request`` where our wrapper still
    sits."""
    # ``request`` only: ``get`` and ``post`` call it, so a rollout gets exactly one span.
    return Patch(
        (_MODULE,),
        methods_of("ServerClient", ("request",), _wrapper_on(tracer_provider), _ONCE),
        _ONCE,
    )
