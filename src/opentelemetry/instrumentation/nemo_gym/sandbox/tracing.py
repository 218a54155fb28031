"""Traced sandbox providers, sandbox scopes, and turning sandbox tracing on and off.

``traced_provider(provider)`` wraps any object of the ``SandboxProvider`` shape (ours or
nemo_gym's, duck-typed) so that each lifecycle call is a span (``sandbox.create``,
``sandbox.exec``, ``sandbox.upload``, ``sandbox.download``, ``sandbox.close``) carrying the
sandbox's identity: ``request.id``, ``provider`` and ``id`` under ``PREFIX``. Create records
the request before provisioning; once the provider has answered, the allocation record (for a
``ResourceProvider``) and the ``ResourceSampler`` run beside the caller, never in front of it.
Close gives the final sample a short head start (``FINAL_SAMPLE_GRACE_S``) so it still sees
the sandbox, then calls the provider's close whatever the sample does. Exec spans record the
return code and never the command text; a failed call's span records the exception's type,
never its message (which may hold commands, environments or options).

Every call belongs to a ``SandboxState`` (``_state``): the one given to ``traced_provider``,
else the instrumentor's, else the default over the global tracer provider. ``enable()`` makes
the instrumentor's state: the stamping span processor on its tracer provider and the bundled
provider classes traced (``set_auto_trace``); ``disable()`` undoes both.

Telemetry never changes a provider's behaviour: its results and exceptions pass through
unchanged, failures of ours are logged once and swallowed, cancellation propagates. Inside
OpenTelemetry's ``suppress_instrumentation`` calls pass straight through.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import wrapt
from opentelemetry import trace
from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.trace import Span, Status, StatusCode

from opentelemetry.instrumentation.nemo_gym._exporting import span_processors
from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import PREFIX, Attribute
from opentelemetry.instrumentation.nemo_gym.sandbox._log import log_failure
from opentelemetry.instrumentation.nemo_gym.sandbox._scope import (
    PROVIDER,
    REQUEST_ID,
    SANDBOX_ID,
    SandboxSpanProcessor,
    install_span_processor,
    stamped,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._state import (
    SandboxState,
    current_state,
    default_state,
    install,
    installed_state,
    sandbox_key,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxExecResult,
    SandboxHandle,
    SandboxSpec,
    SandboxStatus,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    ResourceProvider,
    ResourceSampler,
    record_request,
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
]

LOGGER = logging.getLogger(__name__)

EXEC_RETURN_CODE = PREFIX + "exec.return_code"
EXEC_ERROR_TYPE = PREFIX + "exec.error_type"
ERROR_TYPE = "error.type"

# How long close() lets the final sample run before it calls the provider's close anyway: the
# sample wants the sandbox alive, the caller wants close() prompt. A slower sample goes on
# beside the close, bounded by its own timeout.
FINAL_SAMPLE_GRACE_S = 0.5

_T = TypeVar("_T")


# The provider object whose call is being traced right now. A call into the same object
# while it is set (a traced_provider() wrapper around an auto-traced class) passes straight
# through, so one call never makes two spans.
_TRACING: ContextVar[int | None] = ContextVar("nemo_gym_sandbox_tracing", default=None)


def _provider_name(provider: object) -> str:
    name = getattr(provider, "name", None)
    return name if isinstance(name, str) and name else type(provider).__name__


def _passes_through(provider: object) -> bool:
    """A nested call into the provider being traced, or inside suppress_instrumentation."""
    return _TRACING.get() == id(provider) or not is_instrumentation_enabled()


# --- identity and scope ---------------------------------------------------------------------


def sandbox_identity(handle: SandboxHandle) -> dict[str, Attribute]:
    """The identity attributes of ``handle``'s sandbox.

    ``request.id``, ``provider`` and ``id`` for a sandbox created through a traced provider in
    this process (under the current state, or the default one); ``provider`` and ``id``
    alone for any other handle (a borrowed one, say).
    """
    key = sandbox_key(handle)
    state = current_state()
    for candidate in (state, default_state()):
        entry = candidate.registry.get(key)
        if entry is not None and entry.identity is not None:
            return dict(entry.identity)
    return {PROVIDER: key[0], SANDBOX_ID: key[1]}


@contextmanager
def sandbox_scope(handle: SandboxHandle) -> Iterator[None]:
    """Mark the code inside the ``with`` block as running for ``handle``'s sandbox.

    Spans started inside the block (in this task or thread, and in tasks it creates) get the
    sandbox's identity attributes from ``SandboxSpanProcessor``. Scopes nest; the innermost
    wins.
    """
    with stamped(sandbox_identity(handle)):
        yield


def _identity_or_empty(handle: Any) -> dict[str, Attribute]:
    try:
        return sandbox_identity(handle)
    except Exception as exc:  # noqa: BLE001 - an odd handle still gets its span
        log_failure("reading a sandbox handle", exc)
        return {}


# --- spans ----------------------------------------------------------------------------------


def _mark_failed(span: Span, exc: BaseException) -> None:
    """ERROR status and ``error.type``, with the exception's type only: its message may hold
    user data (a command, an environment, provider options), so it is never recorded."""
    try:
        name = type(exc).__qualname__
        span.set_attribute(ERROR_TYPE, name)
        span.add_event("exception", {"exception.type": name})
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
    except Exception as failure:  # noqa: BLE001 - a span that cannot say so is still fine
        log_failure("marking a sandbox span failed", failure)


@contextmanager
def _span(state: SandboxState, name: str, attributes: Mapping[str, Attribute]) -> Iterator[Span]:
    with state.tracer.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
        except BaseException as exc:
            _mark_failed(span, exc)
            raise


# --- the traced calls, shared by traced_provider() and the auto-traced classes -------------


async def _traced_create(
    state: SandboxState, provider: object, call: Callable[[], Awaitable[_T]], spec: Any
) -> _T:
    """Run ``call`` (the provider's create) inside a ``sandbox.create`` span, then start the
    resource records beside the caller."""
    if _passes_through(provider):
        return await call()
    name = _provider_name(provider)
    try:
        attributes = record_request(spec, {PROVIDER: name})
    except Exception as exc:  # noqa: BLE001 - a spec we cannot describe still gets an identity
        log_failure("describing a sandbox spec", exc, name)
        attributes = {PROVIDER: name, REQUEST_ID: uuid.uuid4().hex}
    token = _TRACING.set(id(provider))
    try:
        with _span(state, "sandbox.create", attributes) as span:
            handle = await call()
            span.set_attribute(SANDBOX_ID, str(getattr(handle, "sandbox_id", "")))
    finally:
        _TRACING.reset(token)
    # Outside the create span: the records belong to the caller's context, and the guard above
    # is reset so the tasks started here do not inherit it.
    _start_resource_records(state, provider, handle, attributes)
    return handle


def _start_resource_records(
    state: SandboxState, provider: object, handle: Any, attributes: Mapping[str, Attribute]
) -> None:
    """Remember the sandbox, start its sampler and read its allocation in the background.

    Nothing here waits for the provider: the allocation read runs in a task of its own,
    bounded by ``PROVIDER_CALL_TIMEOUT_S``, and the sampler's first sample comes an interval
    later.
    """
    try:
        identity: dict[str, Attribute] = {
            REQUEST_ID: attributes[REQUEST_ID],
            PROVIDER: attributes[PROVIDER],
            SANDBOX_ID: str(handle.sandbox_id),
        }
        entry = state.registry.remember(sandbox_key(handle), identity, id(provider))
        # Nobody would see the records: skip the provider calls that produce them.
        if not isinstance(provider, ResourceProvider) or not state.exporting():
            return
        with state.active():
            sampler = ResourceSampler(provider, handle, identity, state.sampling_interval())
        sampler.start()
        entry.allocation = state.spawn(
            sampler.record("allocation"), f"nemo-gym sandbox allocation {handle.sandbox_id}"
        )
    except Exception as exc:  # noqa: BLE001 - telemetry must not fail a created sandbox
        log_failure("starting sandbox resource records", exc)


async def _traced_call(
    state: SandboxState,
    provider: object,
    span_name: str,
    handle: Any,
    call: Callable[[], Awaitable[_T]],
    describe: Callable[[_T], dict[str, Attribute]] | None = None,
) -> _T:
    """Run ``call`` inside a span named ``span_name`` carrying ``handle``'s identity, plus
    what ``describe`` says about the result."""
    if _passes_through(provider):
        return await call()
    token = _TRACING.set(id(provider))
    try:
        with _span(state, span_name, _identity_or_empty(handle)) as span:
            result = await call()
            if describe is not None:
                try:
                    span.set_attributes(describe(result))
                except Exception as exc:  # noqa: BLE001 - an odd result is still returned as is
                    log_failure(f"describing a {span_name} result", exc)
            return result
    finally:
        _TRACING.reset(token)


def _describe_exec(result: SandboxExecResult) -> dict[str, Attribute]:
    """The exec span's outcome: the return code and error type, never the command or output."""
    described: dict[str, Attribute] = {EXEC_RETURN_CODE: int(result.return_code)}
    error_type = getattr(result, "error_type", None)
    if error_type:
        described[EXEC_ERROR_TYPE] = str(error_type)
    return described


def _stop_samplers(state: SandboxState, keys: list[tuple[str, str]]) -> list[asyncio.Task[Any]]:
    """Forget these sandboxes and stop their samplers in the background.

    Returns the records still running for them (final samples, an allocation read not yet
    answered): the close waits for them a little, so they still see the sandbox alive.
    """
    pending = []
    for key in keys:
        entry = state.registry.get(key)
        if entry is None:
            continue
        sampler, allocation = entry.sampler, entry.allocation
        state.registry.forget(key)
        if allocation is not None and not allocation.done():
            pending.append(allocation)
        if sampler is not None:
            pending.append(state.spawn(sampler.stop(), f"nemo-gym sandbox final {key[1]}"))
    return pending


async def _traced_close(
    state: SandboxState, provider: object, handle: Any, call: Callable[[], Awaitable[_T]]
) -> _T:
    """Stop the sandbox's sampler, giving its final sample (and an allocation read still in
    flight) at most ``FINAL_SAMPLE_GRACE_S`` to see the sandbox alive, then run the
    provider's close inside a ``sandbox.close`` span.

    The provider's close is called whatever the records do (hang, fail); they then finish
    beside it, bounded by their own timeouts. Cancelling the caller propagates.
    """
    if _TRACING.get() == id(provider):
        return await call()
    try:
        identity = _identity_or_empty(handle)
        stopping = _stop_samplers(state, [sandbox_key(handle)])
    except Exception as exc:  # noqa: BLE001 - the provider's close must run regardless
        log_failure("stopping a sandbox's records", exc)
        identity, stopping = {}, []
    if not is_instrumentation_enabled():
        return await call()
    if stopping:
        await asyncio.wait(stopping, timeout=FINAL_SAMPLE_GRACE_S)
    token = _TRACING.set(id(provider))
    try:
        with _span(state, "sandbox.close", identity):
            return await call()
    finally:
        _TRACING.reset(token)


async def _traced_aclose(
    state: SandboxState, provider: object, call: Callable[[], Awaitable[_T]]
) -> _T:
    """Stop the samplers of this provider's sandboxes that were never closed, then aclose."""
    if _TRACING.get() != id(provider):
        try:
            keys = [key for key, _ in state.registry.of_provider(id(provider))]
            stopping = _stop_samplers(state, keys)
        except Exception as exc:  # noqa: BLE001 - the provider's aclose must run regardless
            log_failure("stopping a provider's records", exc)
            stopping = []
        if stopping and is_instrumentation_enabled():
            await asyncio.wait(stopping, timeout=FINAL_SAMPLE_GRACE_S)
    return await call()


class TracedSandboxProvider:
    """A sandbox provider whose lifecycle calls are spans; everything else is delegated.

    Results and exceptions of the wrapped provider pass through unchanged. Attributes other
    than the protocol's methods (``resource_allocation``, provider-specific options) are read
    from the wrapped provider, so it still looks like a ``ResourceProvider`` when it is one.
    Calls belong to ``state`` when given, else to ``current_state()`` at the time of the call.
    """

    def __init__(self, provider: Any, state: SandboxState | None = None) -> None:
        self.wrapped = provider
        self._state = state

    @property
    def name(self) -> str:
        return _provider_name(self.wrapped)

    @property
    def state(self) -> SandboxState:
        """The sandbox state this wrapper's calls belong to right now."""
        return self._state if self._state is not None else current_state()

    def __getattr__(self, item: str) -> Any:
        return getattr(self.wrapped, item)

    def __repr__(self) -> str:
        return f"traced_provider({self.wrapped!r})"

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        p = self.wrapped
        result: SandboxHandle = await _traced_create(self.state, p, lambda: p.create(spec), spec)
        return result

    async def exec(self, handle: SandboxHandle, command: str, **kwargs: Any) -> SandboxExecResult:
        p = self.wrapped
        result: SandboxExecResult = await _traced_call(
            self.state,
            p,
            "sandbox.exec",
            handle,
            lambda: p.exec(handle, command, **kwargs),
            _describe_exec,
        )
        return result

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        p = self.wrapped
        await _traced_call(
            self.state,
            p,
            "sandbox.upload",
            handle,
            lambda: p.upload_file(handle, source_path, target_path),
        )

    async def download_file(
        self, handle: SandboxHandle, source_path: str, target_path: Path
    ) -> None:
        p = self.wrapped
        await _traced_call(
            self.state,
            p,
            "sandbox.download",
            handle,
            lambda: p.download_file(handle, source_path, target_path),
        )

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        result: SandboxStatus = await self.wrapped.status(handle)
        return result

    async def close(self, handle: SandboxHandle) -> None:
        p = self.wrapped
        await _traced_close(self.state, p, handle, lambda: p.close(handle))

    async def aclose(self) -> None:
        p = self.wrapped
        await _traced_aclose(self.state, p, lambda: p.aclose())


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
            return _traced_create(state, instance, call, _argument(args, kwargs, 0, "spec"))
        if method == "aclose":
            return _traced_aclose(state, instance, call)
        handle = _argument(args, kwargs, 0, "handle")
        if method == "exec":
            return _traced_call(state, instance, "sandbox.exec", handle, call, _describe_exec)
        if method == "close":
            return _traced_close(state, instance, handle, call)
        span_name = "sandbox.upload" if method == "upload_file" else "sandbox.download"
        return _traced_call(state, instance, span_name, handle, call)

    return wrapper


_TRACED_METHODS = ("create", "exec", "upload_file", "download_file", "close", "aclose")

# The bundled providers, by import path: a module that is missing or fails to import (the
# Docker provider's optional pieces, say) is skipped rather than breaking the instrumentor.
_BUNDLED = (
    ("opentelemetry.instrumentation.nemo_gym.sandbox.providers.process", "ProcessSandboxProvider"),
    ("opentelemetry.instrumentation.nemo_gym.sandbox.providers.docker", "DockerSandboxProvider"),
)


def _bundled_classes() -> list[type]:
    classes = []
    for module_name, class_name in _BUNDLED:
        try:
            module = importlib.import_module(module_name)
            classes.append(getattr(module, class_name))
        except (ImportError, AttributeError) as exc:
            LOGGER.debug("not auto-tracing %s.%s: %r", module_name, class_name, exc)
    return classes


def _unwrap_exactly(cls: type, method: str, ours: Any) -> None:
    """Remove our wrapper ``ours`` from ``cls.method``, keeping any wrapper another library
    put around it later (its ``__wrapped__`` is pointed past ours)."""
    current: Any = cls.__dict__.get(method)
    if current is ours:
        setattr(cls, method, ours.__wrapped__)
        return
    node = current
    while isinstance(node, wrapt.ObjectProxy):
        inner = node.__wrapped__
        if inner is ours:
            node.__wrapped__ = ours.__wrapped__
            return
        node = inner
    LOGGER.debug("%s.%s no longer holds our wrapper; left as is", cls.__name__, method)


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
            installed: dict[str, Any] = {}
            for method in _TRACED_METHODS:
                if callable(getattr(cls, method, None)):
                    wrapt.wrap_function_wrapper(cls, method, _class_wrapper(state, method))
                    installed[method] = cls.__dict__[method]
            state.patched[cls] = installed
        return
    for cls, installed in list(state.patched.items()):
        for method, ours in installed.items():
            _unwrap_exactly(cls, method, ours)
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
    interval_s: float | None = None,
    instrumentation_version: str | None = None,
) -> SandboxState:
    """Turn sandbox tracing on with a new ``SandboxState``; what ``instrument()`` calls.

    Spans and records go to ``tracer_provider`` (default: the global one, looked up at each
    use), which also decides whether records are exported; ``interval_s`` is the sampling
    interval (default: the environment variable, read at each use);
    ``instrumentation_version`` is the tracer scope's version. Adds the stamping processor
    (to the global provider as it is now, when none is given; with a provider that cannot
    take one, logged at debug level and skipped), traces the bundled provider classes, and
    makes the state current for ``traced_provider`` wrappers and samplers made without one.
    An earlier enabled state is disabled first. Returns the state.
    """
    previous = installed_state()
    if previous is not None:
        disable(previous)
    state = SandboxState(
        tracer_provider, interval_s=interval_s, instrumentation_version=instrumentation_version
    )
    state.processor = _processor_on(state.tracer_provider)
    set_auto_trace(True, state)
    install(state)
    return state


def disable(state: SandboxState | None = None) -> None:
    """Turn ``state``'s sandbox tracing off (default: the enabled one); idempotent.

    Its processor becomes a no-op, the bundled provider classes lose its wrappers, and it
    stops being current. Samplers it started stop when their sandboxes close.
    """
    state = state if state is not None else installed_state()
    if state is None:
        return
    if state.processor is not None:
        state.processor.disable()
    set_auto_trace(False, state)
    if installed_state() is state:
        install(None)
