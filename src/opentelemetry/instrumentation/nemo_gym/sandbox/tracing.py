"""Traced sandbox providers, sandbox scopes, and the span processor that stamps them.

``traced_provider(provider)`` wraps any object of the ``SandboxProvider`` shape (ours or
nemo_gym's, duck-typed) so that each lifecycle call is a span (``sandbox.create``,
``sandbox.exec``, ``sandbox.upload``, ``sandbox.download``, ``sandbox.close``) carrying the
sandbox's identity: ``request.id``, ``provider`` and ``id`` under ``PREFIX``. Create records
the request before provisioning, then the allocation (for a ``ResourceProvider``) and starts
the ``ResourceSampler``; close stops it first, so the final sample still sees the sandbox.
Exec spans record the return code and never the command text.

``set_auto_trace(True)`` applies the same tracing to the bundled provider classes, so plain
``ProcessSandboxProvider()`` objects are traced without wrapping; ``sandbox_scope(handle)``
marks user code as running for a sandbox, and ``SandboxSpanProcessor`` copies the identity
onto every span started inside such a scope (both live in ``_scope`` and are exported here).

Telemetry never changes a provider's behaviour: its results and exceptions pass through
unchanged, failures of ours are logged once and swallowed, cancellation propagates.
"""

from __future__ import annotations

import importlib
import logging
import uuid
import weakref
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import wrapt
from opentelemetry import trace
from opentelemetry.instrumentation.utils import unwrap

from opentelemetry.instrumentation.nemo_gym import _exporting
from opentelemetry.instrumentation.nemo_gym.sandbox._scope import (
    _SANDBOXES,
    PROVIDER,
    REQUEST_ID,
    SANDBOX_ID,
    SandboxSpanProcessor,
    _key,
    _provider_name,
    _Sandbox,
    install_span_processor,
    sandbox_identity,
    sandbox_scope,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxExecResult,
    SandboxHandle,
    SandboxSpec,
    SandboxStatus,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    Attribute,
    ResourceProvider,
    ResourceSampler,
    _log_once,
    record_request,
    sampling_interval,
)
from opentelemetry.instrumentation.nemo_gym.version import __version__

__all__ = [
    "SandboxSpanProcessor",
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

_SCOPE = "opentelemetry.instrumentation.nemo_gym"
EXEC_RETURN_CODE = PREFIX + "exec.return_code"
EXEC_ERROR_TYPE = PREFIX + "exec.error_type"

_T = TypeVar("_T")


# The provider object whose call is being traced right now. A call into the same object
# while it is set (a traced_provider() wrapper around an auto-traced class) passes straight
# through, so one call never makes two spans.
_TRACING: ContextVar[int | None] = ContextVar("nemo_gym_sandbox_tracing", default=None)


def _tracer() -> trace.Tracer:
    return trace.get_tracer(_SCOPE, __version__)


# --- the traced calls, shared by traced_provider() and the auto-traced classes -------------


async def _traced_create(provider: object, call: Callable[[], Awaitable[_T]], spec: Any) -> _T:
    """Run ``call`` (the provider's create) inside a ``sandbox.create`` span."""
    if _TRACING.get() == id(provider):
        return await call()
    name = _provider_name(provider)
    try:
        attributes = record_request(spec, {PROVIDER: name})
    except Exception as exc:  # noqa: BLE001 - a spec we cannot describe still gets an identity
        _log_once(("request", name, type(exc).__name__), "cannot describe sandbox spec: %r", exc)
        attributes = {PROVIDER: name, REQUEST_ID: uuid.uuid4().hex}
    token = _TRACING.set(id(provider))
    try:
        with _tracer().start_as_current_span("sandbox.create", attributes=attributes) as span:
            handle = await call()
            span.set_attribute(SANDBOX_ID, str(getattr(handle, "sandbox_id", "")))
    finally:
        _TRACING.reset(token)
    # Outside the create span: the sampler's records belong to the caller's context, and the
    # guard above is reset so tasks started here do not inherit it.
    await _start_resource_records(provider, handle, attributes)
    return handle


async def _start_resource_records(
    provider: object, handle: Any, attributes: Mapping[str, Attribute]
) -> None:
    try:
        identity: dict[str, Attribute] = {
            REQUEST_ID: attributes[REQUEST_ID],
            PROVIDER: attributes[PROVIDER],
            SANDBOX_ID: str(handle.sandbox_id),
        }
        entry = _Sandbox(identity=identity, provider_id=id(provider))
        _SANDBOXES[_key(handle)] = entry
        # Nobody would see the records: skip the provider calls that produce them.
        if not isinstance(provider, ResourceProvider) or not _exporting.traces_exported(
            ignore=(SandboxSpanProcessor,)
        ):
            return
        entry.sampler = ResourceSampler(provider, handle, identity, sampling_interval())
        await entry.sampler.record("allocation")
        entry.sampler.start()
    except Exception as exc:  # noqa: BLE001 - telemetry must not fail a created sandbox
        _log_once(("records", type(exc).__name__), "sandbox resource records failed: %r", exc)


async def _traced_call(
    provider: object,
    span_name: str,
    handle: Any,
    call: Callable[[], Awaitable[_T]],
    describe: Callable[[_T], dict[str, Attribute]] | None = None,
) -> _T:
    """Run ``call`` inside a span named ``span_name`` carrying ``handle``'s identity, plus
    what ``describe`` says about the result."""
    if _TRACING.get() == id(provider):
        return await call()
    token = _TRACING.set(id(provider))
    try:
        with _tracer().start_as_current_span(
            span_name, attributes=_identity_or_empty(handle)
        ) as span:
            result = await call()
            if describe is not None:
                try:
                    span.set_attributes(describe(result))
                except Exception as exc:  # noqa: BLE001 - an odd result is still returned as is
                    _log_once(("result", span_name, type(exc).__name__), "odd result: %r", exc)
            return result
    finally:
        _TRACING.reset(token)


def _identity_or_empty(handle: Any) -> dict[str, Attribute]:
    try:
        return sandbox_identity(handle)
    except Exception as exc:  # noqa: BLE001 - an odd handle still gets its span
        _log_once(("identity", type(exc).__name__), "cannot read sandbox handle: %r", exc)
        return {}


def _describe_exec(result: SandboxExecResult) -> dict[str, Attribute]:
    """The exec span's outcome: the return code and error type, never the command or output."""
    described: dict[str, Attribute] = {EXEC_RETURN_CODE: int(result.return_code)}
    error_type = getattr(result, "error_type", None)
    if error_type:
        described[EXEC_ERROR_TYPE] = str(error_type)
    return described


async def _stop_sampler(entry: _Sandbox | None) -> None:
    if entry is None or entry.sampler is None:
        return
    try:
        await entry.sampler.stop()
    except Exception as exc:  # noqa: BLE001 - stop() records failures itself; belt and braces
        _log_once(("stop", type(exc).__name__), "sandbox resource sampler stop failed: %r", exc)


async def _traced_close(provider: object, handle: Any, call: Callable[[], Awaitable[_T]]) -> _T:
    """Inside a ``sandbox.close`` span, stop the sandbox's sampler (recording the final
    sample while the sandbox still exists), then run the provider's close."""
    key = _key(handle)
    entry = _SANDBOXES.get(key)

    async def stop_then_close() -> _T:
        await _stop_sampler(entry)
        return await call()

    try:
        return await _traced_call(provider, "sandbox.close", handle, stop_then_close)
    finally:
        if entry is not None and _SANDBOXES.get(key) is entry:
            del _SANDBOXES[key]


async def _traced_aclose(provider: object, call: Callable[[], Awaitable[_T]]) -> _T:
    """Stop the samplers of this provider's sandboxes that were never closed, then aclose."""
    if _TRACING.get() != id(provider):
        for key, entry in list(_SANDBOXES.items()):
            if entry.provider_id == id(provider):
                await _stop_sampler(entry)
                if _SANDBOXES.get(key) is entry:
                    del _SANDBOXES[key]
    return await call()


class TracedSandboxProvider:
    """A sandbox provider whose lifecycle calls are spans; everything else is delegated.

    Results and exceptions of the wrapped provider pass through unchanged. Attributes other
    than the protocol's methods (``resource_allocation``, provider-specific options) are read
    from the wrapped provider, so it still looks like a ``ResourceProvider`` when it is one.
    """

    def __init__(self, provider: Any) -> None:
        self.wrapped = provider

    @property
    def name(self) -> str:
        return _provider_name(self.wrapped)

    def __getattr__(self, item: str) -> Any:
        return getattr(self.wrapped, item)

    def __repr__(self) -> str:
        return f"traced_provider({self.wrapped!r})"

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        p = self.wrapped
        result: SandboxHandle = await _traced_create(p, lambda: p.create(spec), spec)
        return result

    async def exec(self, handle: SandboxHandle, command: str, **kwargs: Any) -> SandboxExecResult:
        p = self.wrapped
        result: SandboxExecResult = await _traced_call(
            p, "sandbox.exec", handle, lambda: p.exec(handle, command, **kwargs), _describe_exec
        )
        return result

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        p = self.wrapped
        await _traced_call(
            p, "sandbox.upload", handle, lambda: p.upload_file(handle, source_path, target_path)
        )

    async def download_file(
        self, handle: SandboxHandle, source_path: str, target_path: Path
    ) -> None:
        p = self.wrapped
        await _traced_call(
            p, "sandbox.download", handle, lambda: p.download_file(handle, source_path, target_path)
        )

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        result: SandboxStatus = await self.wrapped.status(handle)
        return result

    async def close(self, handle: SandboxHandle) -> None:
        p = self.wrapped
        await _traced_close(p, handle, lambda: p.close(handle))

    async def aclose(self) -> None:
        p = self.wrapped
        await _traced_aclose(p, lambda: p.aclose())


def traced_provider(provider: Any) -> TracedSandboxProvider:
    """Wrap ``provider`` (any object of the ``SandboxProvider`` shape) so its calls are traced.

    Wrapping an already wrapped provider returns it unchanged. The wrapper is safe over a
    bundled provider that ``set_auto_trace(True)`` already traces: each call is traced once.
    """
    if isinstance(provider, TracedSandboxProvider):
        return provider
    return TracedSandboxProvider(provider)


# --- auto-tracing the bundled provider classes ----------------------------------------------


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _class_wrapper(method: str) -> Callable[..., Awaitable[Any]]:
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
            return _traced_create(instance, call, _argument(args, kwargs, 0, "spec"))
        if method == "aclose":
            return _traced_aclose(instance, call)
        handle = _argument(args, kwargs, 0, "handle")
        if method == "exec":
            return _traced_call(instance, "sandbox.exec", handle, call, _describe_exec)
        if method == "close":
            return _traced_close(instance, handle, call)
        span_name = "sandbox.upload" if method == "upload_file" else "sandbox.download"
        return _traced_call(instance, span_name, handle, call)

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


# The classes set_auto_trace(True) wrapped, with the methods it wrapped; each class once.
_AUTO_TRACED: dict[type, list[str]] = {}


def set_auto_trace(enabled: bool) -> None:
    """Trace (``True``) or stop tracing (``False``) every bundled provider class's calls.

    While on, ``ProcessSandboxProvider`` and ``DockerSandboxProvider`` objects, whenever they
    were built, behave as if wrapped by ``traced_provider``. Idempotent; ``False`` restores
    the classes exactly. Called by the instrumentor on instrument and uninstrument.
    """
    for cls in _bundled_classes():
        if enabled and cls not in _AUTO_TRACED:
            methods = [m for m in _TRACED_METHODS if callable(getattr(cls, m, None))]
            for method in methods:
                wrapt.wrap_function_wrapper(cls, method, _class_wrapper(method))
            _AUTO_TRACED[cls] = methods
        elif not enabled and cls in _AUTO_TRACED:
            for method in _AUTO_TRACED.pop(cls):
                unwrap(cls, method)


# --- the instrumentor's entry points --------------------------------------------------------

# Our processor on each tracer provider, so that instrument() after uninstrument() re-enables
# it rather than stacking a second one (the SDK cannot remove processors).
_PROCESSORS: weakref.WeakKeyDictionary[trace.TracerProvider, SandboxSpanProcessor] = (
    weakref.WeakKeyDictionary()
)


def enable(tracer_provider: trace.TracerProvider | None = None) -> SandboxSpanProcessor | None:
    """Turn sandbox tracing on: the stamping processor on ``tracer_provider`` (default: the
    global one) and ``set_auto_trace(True)``. Idempotent; what ``instrument()`` calls.

    Returns the processor, or ``None`` for a provider that cannot take one (logged at debug
    level; the bundled providers are still traced).
    """
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    processor = _PROCESSORS.get(provider)
    if processor is not None:
        processor.enabled = True
    else:
        processor = install_span_processor(provider)
        if processor is not None:
            _PROCESSORS[provider] = processor
    set_auto_trace(True)
    return processor


def disable() -> None:
    """Turn sandbox tracing off: every processor ``enable`` added becomes a no-op and the
    bundled provider classes are restored. Idempotent; what ``uninstrument()`` calls."""
    for processor in list(_PROCESSORS.values()):
        processor.disable()
    set_auto_trace(False)
