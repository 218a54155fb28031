"""Traced sandbox providers, sandbox scopes, and turning sandbox tracing on and off.

``traced_provider(provider)`` wraps any object of the ``SandboxProvider`` shape (ours or
nemo_gym's, duck-typed) so that each lifecycle call is a span (``sandbox.create``,
``sandbox.exec``, ``sandbox.upload``, ``sandbox.download``, ``sandbox.close``) carrying the
sandbox's identity: ``request.id``, ``provider`` and ``id`` under ``PREFIX``. The wrapper has
exactly the provider's members (``_traced_provider``), so NeMo Gym's runtime-checkable
capability protocols see the same capabilities on it as on the provider, and the capability
calls are spans too (``sandbox.endpoint``, ``sandbox.pty.create``, ``sandbox.pty.attach``,
``sandbox.serialize``, ``sandbox.connect``); a handle from ``connect`` is known as a created
one (a connect to a sandbox already open in this process is that sandbox). A sandbox is known
by its provider name, its server's scope and its id (``_state``), so two servers that give
out the same id keep two identities. Create records the request before provisioning; once
the provider has answered, the allocation record and the ``ResourceSampler`` run beside the
caller, never in front of it, reading the provider when it is a ``ResourceProvider``, else
its resource reader (``readers``), whose records may say that allocation and usage are
unknown, and why.
Close gives the final sample a short head start (``FINAL_SAMPLE_GRACE_S``) so it still sees
the sandbox, then calls the provider's close whatever the sample does. Exec spans record the
return code and never the command text; a failed call's span records the exception's type,
never its message (which may hold commands, environments or options).

Every call belongs to a ``SandboxState`` (``_state``): the one given to ``traced_provider``,
else the instrumentor's, else the default over the global tracer provider. ``enable()`` makes
the instrumentor's state: the stamping span processor on its tracer provider and the bundled
provider classes (this package's entry points in NeMo Gym's provider group) traced
(``set_auto_trace``); ``disable()`` undoes both and turns the state off.
``wrapping_for(state)`` is what the instrumentor passes to the NeMo Gym hook
(``integrations.nemo_gym._providers.provider_patch``) so every provider NeMo Gym builds is traced
with that state. The traced calls themselves, shared by wrappers and auto-traced classes, live
in ``_calls``.

Telemetry never changes a provider's behaviour: its results and exceptions pass through
unchanged, failures of ours are logged once and swallowed, cancellation propagates. Inside
OpenTelemetry's ``suppress_instrumentation`` calls pass straight through.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

from opentelemetry import metrics, trace

from opentelemetry.instrumentation.nemo_gym._shared._exporting import span_processors
from opentelemetry.instrumentation.nemo_gym._shared._patching import Wrapped, unwrap, wrap
from opentelemetry.instrumentation.nemo_gym.sandbox._calls import (
    FINAL_SAMPLE_GRACE_S,
    HANDLE_SPANS,
    RESULT_DESCRIPTIONS,
    sandbox_identity,
    sandbox_scope,
    traced_aclose,
    traced_call,
    traced_close,
    traced_connect,
    traced_create,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._scope import (
    SandboxSpanProcessor,
    install_span_processor,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._state import (
    SandboxState,
    current_state,
    install,
    installed_state,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._traced_provider import (
    TracedSandboxProvider,
)

__all__ = [
    "FINAL_SAMPLE_GRACE_S",
    "SandboxSpanProcessor",
    "SandboxState",
    "TracedSandboxProvider",
    "disable",
    "enable",
    "install_span_processor",
    "sandbox_identity",
    "sandbox_scope",
    "set_auto_trace",
    "traced_provider",
    "wrapping_for",
]

logger = logging.getLogger(__name__)


def traced_provider(provider: Any, state: SandboxState | None = None) -> TracedSandboxProvider:
    """Wrap ``provider`` (any object of the ``SandboxProvider`` shape) so its calls are traced.

    ``state`` fixes the sandbox state the calls belong to; by default each call uses
    ``current_state()`` (the instrumentor's while instrumented, else the default over the
    global tracer provider). Wrapping an already wrapped provider returns it unchanged. The
    wrapper is safe over a bundled provider that ``set_auto_trace(True)`` already traces: each
    call is traced once.
    """
    if isinstance(provider, TracedSandboxProvider):
        return provider
    return TracedSandboxProvider(provider, state)


def wrapping_for(state: SandboxState) -> Callable[[Any], Any]:
    """The function that makes a provider NeMo Gym built traced with ``state``.

    A provider whose class ``state`` already auto-traces (``otel_process``, ``otel_docker``) is
    returned as it is: its calls are traced once, by the class. Anything else gets a
    ``traced_provider(provider, state)`` wrapper, which goes quiet once ``state`` is disabled.
    """

    def wrap(provider: Any) -> Any:
        if type(provider) in state.patched:
            return provider
        return traced_provider(provider, state)

    return wrap


# --- auto-tracing the bundled provider classes ----------------------------------------------


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _class_wrapper(state: SandboxState, method: str) -> Callable[..., Awaitable[Any]]:
    """A wrapt wrapper that traces ``method`` of a provider class like ``traced_provider``."""

    def wrapper(
        wrapped: Callable[..., Awaitable[Any]],
        instance: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Awaitable[Any]:
        def call() -> Awaitable[Any]:
            return wrapped(*args, **kwargs)

        if method == "create":
            return traced_create(state, instance, call, _argument(args, kwargs, 0, "spec"))
        if method == "aclose":
            return traced_aclose(state, instance, call)
        if method == "connect":
            return traced_connect(state, instance, call)
        handle = _argument(args, kwargs, 0, "handle")
        if method == "close":
            return traced_close(state, instance, handle, call)
        describe = RESULT_DESCRIPTIONS.get(method)
        return traced_call(state, instance, HANDLE_SPANS[method], handle, call, describe)

    return wrapper


# The methods traced where the class has them: those the wrapper traces too.
_TRACED_METHODS = ("create", "close", "aclose", "connect", *HANDLE_SPANS)

# The bundled providers are this distribution's entry points in NeMo Gym's provider group
# (pyproject.toml): adding a provider is its module and its entry point, nothing else.
PROVIDER_GROUP = "nemo_gym.sandbox_providers"
_OWN_PROVIDERS = "opentelemetry.instrumentation.nemo_gym.sandbox.providers."


def bundled_provider_entry_points() -> list[metadata.EntryPoint]:
    """This package's entry points in NeMo Gym's provider group, the bundled providers."""
    return [
        entry_point
        for entry_point in metadata.entry_points(group=PROVIDER_GROUP)
        if entry_point.value.startswith(_OWN_PROVIDERS)
    ]


def _bundled_classes() -> list[type]:
    # A module that is missing or fails to import (the Docker provider's optional pieces, say)
    # is skipped rather than breaking the instrumentor.
    classes = []
    for entry_point in bundled_provider_entry_points():
        try:
            provider_class = entry_point.load()
        except (ImportError, AttributeError) as exc:
            logger.debug("not auto-tracing %s: %r", entry_point.value, exc)
            continue
        if isinstance(provider_class, type) and provider_class not in classes:
            classes.append(provider_class)
    return classes


def set_auto_trace(enabled: bool, state: SandboxState | None = None) -> None:
    """Trace (``True``) or stop tracing (``False``) every bundled provider class's calls.

    While on, ``ProcessSandboxProvider`` and ``DockerSandboxProvider`` objects, whenever they
    were built, behave as if wrapped by ``traced_provider`` with ``state`` (default: the
    current state). Idempotent per state; ``False`` removes exactly that state's wrappers,
    leaving any another library added. Called by ``enable`` and ``disable``.
    """
    state = state if state is not None else current_state()
    if enabled:
        for cls in _bundled_classes():
            if cls in state.patched:
                continue
            installed: dict[str, Wrapped] = {}
            for method in _TRACED_METHODS:
                if callable(getattr(cls, method, None)):
                    installed[method] = wrap(cls, method, _class_wrapper(state, method))
            state.patched[cls] = installed
        return
    for cls, installed in list(state.patched.items()):
        for record in installed.values():
            unwrap(record)
        del state.patched[cls]


# --- the instrumentor's entry points --------------------------------------------------------


def _processor_on(tracer_provider: trace.TracerProvider) -> SandboxSpanProcessor | None:
    """Our processor on ``tracer_provider``: an earlier one turned back on (the SDK cannot
    remove processors, so instrument() after uninstrument() must not stack another), else a
    new one; ``None`` for a provider that cannot take processors."""
    for processor in span_processors(tracer_provider):
        if isinstance(processor, SandboxSpanProcessor):
            processor.enable()
            return processor
    return install_span_processor(tracer_provider)


def enable(
    tracer_provider: trace.TracerProvider | None = None,
    *,
    meter_provider: metrics.MeterProvider | None = None,
    interval_s: float | None = None,
    instrumentation_version: str | None = None,
) -> SandboxState:
    """Turn sandbox tracing on with a new ``SandboxState``; what ``instrument()`` calls.

    Spans and records go to ``tracer_provider`` (default: the global one, looked up at each
    use), which also decides whether records are exported; the fleet metrics go to
    ``meter_provider`` (default: the global one, looked up at each use); ``interval_s`` is
    the sampling interval (default: the environment variable, read at each use);
    ``instrumentation_version`` is the tracer and meter scopes' version. Adds the stamping
    processor (to the global provider as it is now, when none is given; with a provider that
    cannot take one, logged at debug level and skipped), traces the bundled provider classes,
    and makes the state current for ``traced_provider`` wrappers and samplers made without
    one.
    An earlier enabled state is disabled first. Returns the state.
    """
    previous = installed_state()
    if previous is not None:
        disable(previous)
    state = SandboxState(
        tracer_provider,
        meter_provider=meter_provider,
        interval_s=interval_s,
        instrumentation_version=instrumentation_version,
    )
    state.processor = _processor_on(state.tracer_provider)
    set_auto_trace(True, state)
    install(state)
    return state


def disable(state: SandboxState | None = None) -> None:
    """Turn ``state``'s sandbox tracing off (default: the enabled one); idempotent.

    Its processor becomes a no-op, the bundled provider classes lose its wrappers, wrappers
    made with it pass calls straight through, and it stops being current. Samplers it started
    stop when their sandboxes close.
    """
    state = state if state is not None else installed_state()
    if state is None:
        return
    state.enabled = False
    if state.processor is not None:
        state.processor.disable()
    set_auto_trace(False, state)
    if installed_state() is state:
        install(None)
