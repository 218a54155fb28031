"""The traced sandbox calls, shared by ``traced_provider`` wrappers and auto-traced classes.

Each function runs one provider call for a ``SandboxState``: create inside a
``sandbox.create`` span, counted on ``gym.sandbox.creations`` (created, or failed with the
exception's type), then the resource records beside the caller; exec, upload and download
inside their spans, and so the optional capability calls (``CAPABILITY_SPANS``: endpoint,
PTY create and attach, handle serialization); ``connect`` inside ``sandbox.connect``, after
which the handle it returns is known as if create had made it; close after a short grace for
the final records. A failed call's span
records the exception's type, never its message, and the exception reaches the caller as the
same object. Inside OpenTelemetry's ``suppress_instrumentation``, for a state that
``tracing.disable`` turned off, and for a nested call into the provider already being traced,
the call passes straight through. Also here: which identity a handle has
(``sandbox_identity``) and the scope that stamps it (``sandbox_scope``). The lifecycle
metrics in NeMo Gym's names (``_lifecycle_metrics``: held sandboxes, start, exec and
transfer times, create retries) are reported from these calls through ``_measure`` alone.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.trace import Span, Status, StatusCode

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import PREFIX, Attribute
from opentelemetry.instrumentation.nemo_gym.sandbox._burst import calling
from opentelemetry.instrumentation.nemo_gym.sandbox._fleet_metrics import error_type_of
from opentelemetry.instrumentation.nemo_gym.sandbox._lifecycle_metrics import (
    SandboxLifecycleMetrics,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._log import log_failure
from opentelemetry.instrumentation.nemo_gym.sandbox._scope import (
    PROVIDER,
    REQUEST_ID,
    SANDBOX_ID,
    enclosing_nemo_gym_span,
    stamp_nemo_gym_span,
    stamped,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._server_scope import server_scope_of
from opentelemetry.instrumentation.nemo_gym.sandbox._state import (
    SandboxKey,
    SandboxState,
    current_state,
    default_state,
    sandbox_key,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxExecResult,
    SandboxHandle,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.readers import resource_source
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    ResourceSampler,
    record_request,
)

EXEC_RETURN_CODE = PREFIX + "exec.return_code"
EXEC_ERROR_TYPE = PREFIX + "exec.error_type"
ERROR_TYPE = _names.ATTR_ERROR_TYPE

# NeMo Gym's optional provider capabilities that act on a handle (the first argument), and
# the span each call is. Their results (endpoint URLs with routing headers, PTY sessions,
# descriptors that may carry leases) are never recorded.
CAPABILITY_SPANS = {
    "endpoint": "sandbox.endpoint",
    "create_pty": "sandbox.pty.create",
    "attach_pty": "sandbox.pty.attach",
    "serialize_handle": "sandbox.serialize",
}
# Every provider method that takes a handle first and is traced by ``traced_call``, and the
# span each call is: the lifecycle's, then the optional capabilities. Both the
# ``traced_provider`` wrapper and the auto-traced classes trace exactly these.
HANDLE_SPANS = {
    "exec": "sandbox.exec",
    "upload_file": "sandbox.upload",
    "download_file": "sandbox.download",
    **CAPABILITY_SPANS,
}
CONNECT_SPAN = "sandbox.connect"

# How long close() lets the final sample run before it calls the provider's close anyway: the
# sample wants the sandbox alive, the caller wants close() prompt. A slower sample goes on
# beside the close, bounded by its own timeout.
FINAL_SAMPLE_GRACE_S = 0.5

_T = TypeVar("_T")


# The provider object whose call is being traced right now. A call into the same object
# while it is set (a traced_provider() wrapper around an auto-traced class) passes straight
# through, so one call never makes two spans.
_TRACING: ContextVar[int | None] = ContextVar("nemo_gym_sandbox_tracing", default=None)


def provider_name(provider: object) -> str:
    name = getattr(provider, "name", None)
    return name if isinstance(name, str) and name else type(provider).__name__


def _passes_through(state: SandboxState, provider: object) -> bool:
    """A nested call into the provider being traced, a disabled state, or inside
    suppress_instrumentation."""
    return _TRACING.get() == id(provider) or not state.enabled or not is_instrumentation_enabled()


# --- identity and scope ---------------------------------------------------------------------


def sandbox_identity(handle: SandboxHandle) -> dict[str, Attribute]:
    """The identity attributes of ``handle``'s sandbox.

    ``request.id``, ``provider`` and ``id`` for a sandbox created (or connected to) through a
    traced provider in this process (under the current state, or the default one), found by
    the handle object the provider gave, else by its provider name and id where one known
    sandbox has them; ``provider`` and ``id`` alone for any other handle (a borrowed one, or
    a copy of a handle whose id two servers' sandboxes share).
    """
    return _identity_under(handle, None, None)


def _identity_under(
    handle: SandboxHandle, state: SandboxState | None, key: SandboxKey | None
) -> dict[str, Attribute]:
    """``sandbox_identity``, asking ``state`` first when given (a wrapper's explicit state
    need not be the current one), for the sandbox ``key`` when the caller knows it (a traced
    call knows its provider's server scope), else for the one ``handle`` stands for."""
    for candidate in _states_to_ask(state):
        found = key if key is not None else candidate.registry.key_of(handle)
        entry = candidate.registry.get(found) if found is not None else None
        if entry is not None and entry.identity is not None:
            return dict(entry.identity)
    name, _, sandbox_id = sandbox_key(handle)
    return {PROVIDER: name, SANDBOX_ID: sandbox_id}


def _states_to_ask(first: SandboxState | None) -> Iterator[SandboxState]:
    """``first`` when given, then the current state, then the default one, each once. Each is
    looked up only when the one before did not know the handle: the default state is made on
    first use."""
    if first is not None:
        yield first
    current = current_state()
    if current is not first:
        yield current
    default = default_state()
    if default is not first and default is not current:
        yield default


@contextmanager
def sandbox_scope(handle: SandboxHandle) -> Iterator[None]:
    """Mark the code inside the ``with`` block as running for ``handle``'s sandbox.

    Spans started inside the block (in this task or thread, and in tasks it creates) get the
    sandbox's identity attributes from ``SandboxSpanProcessor``. Scopes nest; the innermost
    wins.
    """
    with stamped(sandbox_identity(handle)):
        yield


def key_of(provider: object, handle: Any) -> SandboxKey:
    """The key of ``handle``'s sandbox, made by ``provider``: its provider name and id, scoped
    by the provider's server (``_server_scope.server_scope_of``)."""
    return sandbox_key(handle, server_scope_of(provider))


def _identity_or_empty(state: SandboxState, provider: object, handle: Any) -> dict[str, Attribute]:
    """The identity of ``handle``'s sandbox (of ``provider``'s server) as ``state`` knows it,
    else as the current or default state does; ``provider`` and ``id`` alone for one none
    knows, empty for a handle we cannot read."""
    try:
        return _identity_under(handle, state, key_of(provider, handle))
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
    """Our span around a provider call; an enclosing NeMo Gym sandbox span (its parent) gets
    the same identity when the call ends."""
    enclosing = enclosing_nemo_gym_span()
    with state.tracer.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
        except BaseException as exc:
            _mark_failed(span, exc)
            raise
        finally:
            stamp_nemo_gym_span(enclosing, span)


# --- the traced calls, shared by traced_provider() and the auto-traced classes -------------


async def traced_create(
    state: SandboxState, provider: object, call: Callable[[], Awaitable[_T]], spec: Any
) -> _T:
    """Run ``call`` (the provider's create) inside a ``sandbox.create`` span, then start the
    resource records beside the caller."""
    if _passes_through(state, provider):
        return await call()
    name = provider_name(provider)
    try:
        attributes = record_request(spec, {PROVIDER: name})
    except Exception as exc:  # noqa: BLE001 - a spec we cannot describe still gets an identity
        log_failure("describing a sandbox spec", exc, name)
        attributes = {PROVIDER: name, REQUEST_ID: uuid.uuid4().hex}
    retry = (provider, spec)
    started = time.perf_counter()
    try:
        # Counted in flight: the allocation reads of a burst wait for it to settle (_burst).
        with calling(create=True):
            handle = await _traced_handle_source(
                state, provider, "sandbox.create", attributes, call
            )
    except Exception as exc:
        _count_creation(state, name, exc)
        elapsed, error = time.perf_counter() - started, error_type_of(exc)
        _measure(state, lambda m: m.created(name, None, elapsed, error, retry_of=retry))
        raise  # the provider's own exception object, unchanged
    _count_creation(state, name, None)
    elapsed = time.perf_counter() - started
    _measure(state, lambda m: m.created(name, key_of(provider, handle), elapsed, retry_of=retry))
    # Outside the create span: the records belong to the caller's context, and the guard
    # _traced_handle_source set is reset so the tasks started here do not inherit it.
    _start_resource_records(state, provider, handle, attributes, _requested_resources(spec))
    return handle


async def traced_connect(
    state: SandboxState, provider: object, call: Callable[[], Awaitable[_T]]
) -> _T:
    """Run ``call`` (the provider's ``connect``, which rebuilds a handle from a descriptor)
    inside a ``sandbox.connect`` span, then treat the handle as a created one.

    The sandbox gets a request id of its own in this process and is remembered with it, so
    ``sandbox_identity``, the exec spans and ``close`` know it, and its resource records start
    as after a create. Not counted on ``gym.sandbox.creations``: nothing was created.

    A sandbox this state already knows (created or connected to earlier in this process,
    through this server, and not closed) stays one sandbox: the connect span carries its
    identity, the new handle is bound to it, and no second sampler or allocation read
    starts. Closing either handle closes the sandbox and ends its records.
    """
    if _passes_through(state, provider):
        return await call()
    name = provider_name(provider)
    attributes: dict[str, Attribute] = {PROVIDER: name, REQUEST_ID: uuid.uuid4().hex}
    handle = await _traced_handle_source(
        state, provider, CONNECT_SPAN, attributes, call, known=True
    )
    try:
        key = key_of(provider, handle)
        entry = state.registry.get(key)
        if entry is not None and entry.identity is not None:
            state.registry.bind(handle, key)
            return handle
    except Exception as exc:  # noqa: BLE001 - the handle is the caller's whatever we know
        log_failure("looking up a connected sandbox", exc)
        return handle
    _measure(state, lambda m: m.connected(name, key))
    _start_resource_records(state, provider, handle, attributes, None)
    return handle


async def _traced_handle_source(
    state: SandboxState,
    provider: object,
    span_name: str,
    attributes: Mapping[str, Attribute],
    call: Callable[[], Awaitable[_T]],
    known: bool = False,
) -> _T:
    """Run ``call`` (a provider call that gives a handle: create, connect) inside a span
    named ``span_name`` with ``attributes`` and the handle's id, with nested calls into
    ``provider`` passing straight through. With ``known``, a sandbox ``state`` already knows
    gives the span its identity instead. The guard is reset on return, so the records the
    caller starts next do not inherit it."""
    token = _TRACING.set(id(provider))
    try:
        with _span(state, span_name, attributes) as span:
            handle = await call()
            span.set_attribute(SANDBOX_ID, str(getattr(handle, "sandbox_id", "")))
            span.set_attributes(lifetime_attributes(provider, handle))
            if known:
                span.set_attributes(_known_identity(state, provider, handle))
            return handle
    finally:
        _TRACING.reset(token)


def _known_identity(state: SandboxState, provider: object, handle: Any) -> dict[str, Attribute]:
    """The identity ``state`` holds for ``handle``'s sandbox, or ``{}``; never raises."""
    try:
        entry = state.registry.get(key_of(provider, handle))
        return dict(entry.identity) if entry is not None and entry.identity is not None else {}
    except Exception as exc:  # noqa: BLE001 - a span without it is still the caller's call
        log_failure("reading a known sandbox's identity", exc)
        return {}


def lifetime_attributes(provider: object, handle: Any) -> dict[str, Attribute]:
    """What the provider says about the sandbox for its whole life (its
    ``sandbox_attributes(handle)``, e.g. the process provider's isolation level), to be part of
    the sandbox's identity: only keys under ``nemo.gym.sandbox.`` and attribute values, never
    the identity keys themselves. ``{}`` for providers without it; never raises."""
    describe = getattr(provider, "sandbox_attributes", None)
    if describe is None:
        return {}
    try:
        found = describe(handle)
        return {
            key: value
            for key, value in dict(found).items()
            if isinstance(key, str)
            and key.startswith(PREFIX)
            and key not in (REQUEST_ID, PROVIDER, SANDBOX_ID)
            and isinstance(value, str | bool | int | float)
        }
    except Exception as exc:  # noqa: BLE001 - telemetry must not fail a created sandbox
        log_failure("reading a sandbox's attributes", exc, provider_name(provider))
        return {}


def _measure(state: SandboxState, report: Callable[[SandboxLifecycleMetrics], None]) -> None:
    """Report a lifecycle event to the state's ``_lifecycle_metrics`` (nothing without them);
    never raises."""
    lifecycle = state.lifecycle_metrics()
    if lifecycle is None:
        return
    try:
        report(lifecycle)
    except Exception as exc:  # noqa: BLE001 - telemetry never fails the sandbox
        log_failure("recording sandbox lifecycle metrics", exc)


# The traced handle calls timed on NeMo Gym's duration histograms, and which one each is.
_TIMED_SPANS = {
    "sandbox.exec": SandboxLifecycleMetrics.executed,
    "sandbox.upload": SandboxLifecycleMetrics.transferred,
    "sandbox.download": SandboxLifecycleMetrics.transferred,
}


def _time_handle_call(
    state: SandboxState, provider: object, span_name: str, started: float, outcome: object
) -> None:
    """Record a timed call's wall-clock since ``started``, with ``error.type`` when it raised
    (``outcome`` is its exception) or gave an exec result with an ``error_type``."""
    timed = _TIMED_SPANS.get(span_name)
    if timed is None:
        return
    elapsed = time.perf_counter() - started
    # Read inside _measure: an odd provider or result that raises is logged, not raised.
    _measure(state, lambda m: timed(m, provider_name(provider), elapsed, _error_type(outcome)))


def _error_type(outcome: object) -> str | None:
    """A timed call's ``error.type``: its exception's, else its result's ``error_type``."""
    if isinstance(outcome, Exception):
        return error_type_of(outcome)
    found = getattr(outcome, "error_type", None)
    return str(found) if found else None


def _count_creation(state: SandboxState, provider: str, error: Exception | None) -> None:
    """One ``gym.sandbox.creations``: ``created``, or ``failed`` with the error's type."""
    fleet = state.fleet_metrics()
    if fleet is None:
        return
    if error is None:
        fleet.created(provider)
    else:
        fleet.failed(provider, error_type_of(error))


def _requested_resources(spec: Any) -> object:
    """The spec's resources as the caller gave them (any shape ``compare_allocation`` takes),
    from a spec object or a mapping; ``None`` when it declares none."""
    if isinstance(spec, Mapping):
        return spec.get("resources")
    return getattr(spec, "resources", None)


def _start_resource_records(
    state: SandboxState,
    provider: object,
    handle: Any,
    attributes: Mapping[str, Attribute],
    requested: object,
) -> None:
    """Remember the sandbox, start its sampler and read its allocation in the background.

    The records come from the provider when it implements ``ResourceProvider``, else from
    its resource reader (``readers``: NeMo Gym's built-in docker provider is read through its
    CLI; providers we cannot read get records saying so, with one final sample and no
    periodic ones). Nothing here waits for the provider: the allocation read runs in a task
    of its own (``ResourceSampler.record_allocation``: after the creates in flight settle,
    each attempt bounded by ``PROVIDER_CALL_TIMEOUT_S``), and the sampler's first sample comes
    an interval later.
    """
    try:
        identity: dict[str, Attribute] = {
            REQUEST_ID: attributes[REQUEST_ID],
            PROVIDER: attributes[PROVIDER],
            SANDBOX_ID: str(handle.sandbox_id),
            **lifetime_attributes(provider, handle),
        }
        key = key_of(provider, handle)
        entry = state.registry.remember(key, identity, id(provider), requested)
        state.registry.bind(handle, key)
        # Nobody would see the records: skip the provider calls that produce them.
        if not state.exporting():
            return
        source = resource_source(provider)
        interval = state.sampling_interval() if getattr(source, "periodic", True) else 0.0
        with state.active():
            sampler = ResourceSampler(source, handle, identity, interval)
        sampler.start()
        entry.allocation = state.spawn(
            sampler.record_allocation(), f"nemo-gym sandbox allocation {handle.sandbox_id}"
        )
    except Exception as exc:  # noqa: BLE001 - telemetry must not fail a created sandbox
        log_failure("starting sandbox resource records", exc)


async def traced_call(
    state: SandboxState,
    provider: object,
    span_name: str,
    handle: Any,
    call: Callable[[], Awaitable[_T]],
    describe: Callable[[_T], dict[str, Attribute]] | None = None,
) -> _T:
    """Run ``call`` inside a span named ``span_name`` carrying ``handle``'s identity, plus
    what ``describe`` says about the result."""
    if _passes_through(state, provider):
        return await call()
    token = _TRACING.set(id(provider))
    started = time.perf_counter()
    try:
        with (
            calling(),
            _span(state, span_name, _identity_or_empty(state, provider, handle)) as span,
        ):
            try:
                result = await call()
            except Exception as exc:
                _time_handle_call(state, provider, span_name, started, exc)
                raise
            _time_handle_call(state, provider, span_name, started, result)
            if describe is not None:
                try:
                    span.set_attributes(describe(result))
                except Exception as exc:  # noqa: BLE001 - an odd result is still returned as is
                    log_failure(f"describing a {span_name} result", exc)
            return result
    finally:
        _TRACING.reset(token)


def describe_exec(result: SandboxExecResult) -> dict[str, Attribute]:
    """The exec span's outcome: the return code and error type, never the command or output."""
    described: dict[str, Attribute] = {EXEC_RETURN_CODE: int(result.return_code)}
    error_type = getattr(result, "error_type", None)
    if error_type:
        described[EXEC_ERROR_TYPE] = str(error_type)
    return described


# What the span of a ``HANDLE_SPANS`` method records about its result; the others record
# nothing of it.
RESULT_DESCRIPTIONS: dict[str, Callable[[Any], dict[str, Attribute]]] = {"exec": describe_exec}


def _stop_samplers(state: SandboxState, keys: list[SandboxKey]) -> list[asyncio.Task[Any]]:
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
            pending.append(state.spawn(sampler.stop(), f"nemo-gym sandbox final {key[2]}"))
    return pending


async def traced_close(
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
        identity = _identity_or_empty(state, provider, handle)
        key = key_of(provider, handle)
        _measure(state, lambda m: m.released(key))
        stopping = _stop_samplers(state, [key])
    except Exception as exc:  # noqa: BLE001 - the provider's close must run regardless
        log_failure("stopping a sandbox's records", exc)
        identity, stopping = {}, []
    if not state.enabled or not is_instrumentation_enabled():
        return await call()
    if stopping:
        await asyncio.wait(stopping, timeout=FINAL_SAMPLE_GRACE_S)
    token = _TRACING.set(id(provider))
    try:
        with _span(state, "sandbox.close", identity):
            return await call()
    finally:
        _TRACING.reset(token)


async def traced_aclose(
    state: SandboxState, provider: object, call: Callable[[], Awaitable[_T]]
) -> _T:
    """Stop the samplers of this provider's sandboxes that were never closed, then aclose."""
    if _TRACING.get() != id(provider):
        try:
            keys = [key for key, _ in state.registry.of_provider(id(provider))]
            _measure(state, lambda m: m.released(*keys))
            stopping = _stop_samplers(state, keys)
        except Exception as exc:  # noqa: BLE001 - the provider's aclose must run regardless
            log_failure("stopping a provider's records", exc)
            stopping = []
        if stopping and state.enabled and is_instrumentation_enabled():
            await asyncio.wait(stopping, timeout=FINAL_SAMPLE_GRACE_S)
    return await call()
