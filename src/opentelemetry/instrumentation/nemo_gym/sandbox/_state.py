"""One sandbox telemetry state per instrumentation: tracer, interval, processor, registry.

``SandboxState`` holds everything the sandbox half used to keep in module globals: the tracer
provider it was given (or the global one, resolved at each use), the meter provider of its
fleet metrics (likewise), the sampling interval, the span processor it enabled, the registry
of sandboxes (identity, requested resources and sampling owner, one entry per sandbox) and the
background tasks its records run in. The instrumentor makes one in
``_instrument`` and drops it in ``_uninstrument``; code that runs without an instrumentor
(``traced_provider(p)``, a ``ResourceSampler`` built by hand) gets ``default_state()``, over
the global providers and the environment.

``current_state()`` answers "which state is this call for": the one a traced call made active
(``with state.active()``), else the instrumentor's, else the default.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Protocol

from opentelemetry import metrics, trace

from opentelemetry.instrumentation.nemo_gym._shared import _exporting, _names
from opentelemetry.instrumentation.nemo_gym._shared._settings import sandbox_resource_interval
from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import Attribute
from opentelemetry.instrumentation.nemo_gym.sandbox._fleet_metrics import SandboxFleetMetrics
from opentelemetry.instrumentation.nemo_gym.sandbox._lifecycle_metrics import (
    SandboxLifecycleMetrics,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._log import log_failure
from opentelemetry.instrumentation.nemo_gym.sandbox._scope import SandboxSpanProcessor

logger = logging.getLogger(__name__)

# (provider name, server scope, sandbox id): one sandbox. A sandbox id is unique only within
# the server that gave it (two OpenSandbox servers may both hand out the same id), so the
# server's scope (``_server_scope.server_scope_of``: ``host:port`` of an OpenSandbox server,
# ``None`` for providers whose ids are unique on their own) is part of the key, as it is of
# the allocation's designator.
SandboxKey = tuple[str, str | None, str]


class _Stoppable(Protocol):
    async def stop(self) -> None: ...


def sandbox_key(handle: object, scope: str | None = None) -> SandboxKey:
    """(provider name, ``scope``, sandbox id) of any handle-shaped object."""
    return (
        str(getattr(handle, "provider_name", "")),
        scope,
        str(getattr(handle, "sandbox_id", "")),
    )


@dataclass
class SandboxEntry:
    """What the state knows about one sandbox.

    ``identity``, ``provider_id`` and ``requested`` (the spec's resources, in whatever shape
    the caller gave them, for comparing with the allocation) are set by a traced create and
    dropped by its close, with ``allocation``, the task reading the allocation record;
    ``sampler`` is the one
    sampler that owns the sandbox's samples, from its ``start()`` to the end of its
    ``stop()``. The entry lives while ``identity`` or ``sampler`` is set.
    """

    identity: dict[str, Attribute] | None = None
    provider_id: int | None = None
    requested: object = None
    sampler: _Stoppable | None = None
    allocation: asyncio.Task[Any] | None = None
    # The ids of the handle objects bound to this sandbox (``SandboxRegistry.bind``).
    handles: list[int] = field(default_factory=list)


class SandboxRegistry:
    """The sandboxes of one state, keyed by (provider name, server scope, sandbox id).
    Event-loop only.

    It also knows which key each handle object it was shown (``bind``) stands for, so code
    holding only a handle (``sandbox_identity(handle)``, ``sandbox_scope(handle)``) finds its
    sandbox even when another server's sandbox has the same provider name and id.
    """

    def __init__(self) -> None:
        self._entries: dict[SandboxKey, SandboxEntry] = {}
        # id(handle) -> (a weak reference to it, its key). Handles are unhashable dataclasses,
        # so they are known by id, and the weak reference tells a reused id from the handle.
        self._handles: dict[int, tuple[weakref.ref[object], SandboxKey]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: SandboxKey) -> SandboxEntry | None:
        return self._entries.get(key)

    def remember(
        self,
        key: SandboxKey,
        identity: dict[str, Attribute],
        provider_id: int,
        requested: object = None,
    ) -> SandboxEntry:
        """Record a sandbox created through a traced provider, with its requested resources."""
        entry = self._entries.setdefault(key, SandboxEntry())
        entry.identity = identity
        entry.provider_id = provider_id
        entry.requested = requested
        return entry

    def bind(self, handle: object, key: SandboxKey) -> None:
        """Remember that ``handle`` is known ``key``'s, until the sandbox is forgotten (a
        handle that cannot be weakly referenced, or of an unknown key, is not remembered)."""
        entry = self._entries.get(key)
        if entry is None:
            return
        try:
            reference = weakref.ref(handle)
        except TypeError:
            return
        self._handles[id(handle)] = (reference, key)
        entry.handles.append(id(handle))

    def key_of(self, handle: object) -> SandboxKey | None:
        """The key ``handle`` was bound to while its sandbox is known; else the key of the one
        known sandbox with its provider name and id (``None`` when there is none, or several:
        servers whose ids collide, where a bare handle cannot tell which)."""
        bound = self._handles.get(id(handle))
        if bound is not None and bound[0]() is handle:
            return bound[1]
        name, _, sandbox_id = sandbox_key(handle)
        return self.find(name, sandbox_id)

    def find(self, provider_name: str, sandbox_id: str) -> SandboxKey | None:
        """The key of the one known sandbox with this provider name and id, whatever its
        server; ``None`` when none or several (servers whose ids collide) have them."""
        found = [k for k in self._entries if k[0] == provider_name and k[2] == sandbox_id]
        return found[0] if len(found) == 1 else None

    def forget(self, key: SandboxKey) -> None:
        """Drop a closed sandbox's identity and its handles; its entry goes once no sampler
        owns it."""
        entry = self._entries.get(key)
        if entry is None:
            return
        for handle_id in entry.handles:
            self._handles.pop(handle_id, None)
        entry.handles = []
        entry.identity = None
        entry.provider_id = None
        entry.requested = None
        entry.allocation = None
        if entry.sampler is None:
            del self._entries[key]

    def claim(self, key: SandboxKey, sampler: _Stoppable) -> bool:
        """Make ``sampler`` the sandbox's owner unless another sampler already is."""
        entry = self._entries.setdefault(key, SandboxEntry())
        if entry.sampler is None:
            entry.sampler = sampler
        return entry.sampler is sampler

    def claim_for(self, key: SandboxKey, owner: _Stoppable) -> _Stoppable | None:
        """Make ``owner`` the sandbox's owner whoever was (NeMo Gym's own sampler taking a
        sandbox over); the owner it replaced, or ``None``."""
        entry = self._entries.setdefault(key, SandboxEntry())
        previous, entry.sampler = entry.sampler, owner
        return None if previous is owner else previous

    def release_where(self, key: SandboxKey, is_owner: Callable[[_Stoppable], bool]) -> None:
        """End the ownership of the sandbox's owner when ``is_owner(owner)`` says it is the one."""
        entry = self._entries.get(key)
        if entry is not None and entry.sampler is not None and is_owner(entry.sampler):
            self.release(key, entry.sampler)

    def release(self, key: SandboxKey, sampler: _Stoppable) -> None:
        """End ``sampler``'s ownership (a no-op for any other sampler)."""
        entry = self._entries.get(key)
        if entry is None or entry.sampler is not sampler:
            return
        entry.sampler = None
        if entry.identity is None:
            del self._entries[key]

    def of_provider(self, provider_id: int) -> list[tuple[SandboxKey, SandboxEntry]]:
        """The open sandboxes created through the provider object with this ``id()``."""
        return [(k, e) for k, e in self._entries.items() if e.provider_id == provider_id]


def _checked_interval(interval_s: object) -> float | None:
    if interval_s is None:
        return None
    if (
        isinstance(interval_s, bool)
        or not isinstance(interval_s, int | float)
        or not math.isfinite(interval_s)
        or interval_s < 0
    ):
        raise ValueError(f"interval_s={interval_s!r} must be a finite number of seconds >= 0")
    return float(interval_s)


def _package_version() -> str | None:
    try:
        return metadata.version("opentelemetry-instrumentation-nemo-gym")
    except metadata.PackageNotFoundError:
        return None


class SandboxState:
    """The sandbox telemetry of one instrumentation.

    ``tracer_provider`` is where spans and records go and what decides whether anything is
    exported; ``None`` means the global provider, looked up at each use (it may be set after
    this state is made). ``interval_s`` is the sampling interval (``None``: read the
    environment variable at each use). ``instrumentation_version`` is the version of the
    tracer's and the meter's instrumentation scope. ``meter_provider`` is where the fleet
    metrics go (``gym.sandbox.creations`` and the others in ``_fleet_metrics``); ``None`` means
    the global one, looked up at each use. Keyword-only parameters may be added without
    breaking callers.

    ``enabled`` is true until ``tracing.disable`` turns the state off: from then on its traced
    calls pass straight through (a wrapper made while instrumented goes quiet after
    ``uninstrument()``), though samplers already running still end with their sandboxes.
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        meter_provider: metrics.MeterProvider | None = None,
        interval_s: float | None = None,
        instrumentation_version: str | None = None,
    ) -> None:
        self.enabled = True
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._interval_s = _checked_interval(interval_s)
        self._version = instrumentation_version
        self._tracer: trace.Tracer | None = None
        self._tracer_of: trace.TracerProvider | None = None
        self._fleet: tuple[metrics.MeterProvider, SandboxFleetMetrics] | None = None
        self._lifecycle: tuple[metrics.MeterProvider, SandboxLifecycleMetrics] | None = None
        self.registry = SandboxRegistry()
        self.processor: SandboxSpanProcessor | None = None
        # The provider classes this state auto-traces: class -> {method: installed wrapper}.
        self.patched: dict[type, dict[str, Any]] = {}
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def tracer_provider(self) -> trace.TracerProvider:
        """The given tracer provider, or the global one as it is now."""
        if self._tracer_provider is not None:
            return self._tracer_provider
        return trace.get_tracer_provider()

    @property
    def tracer(self) -> trace.Tracer:
        """The tracer of scope ``opentelemetry.instrumentation.nemo_gym`` on this state's
        provider as it is now (made once per provider, the global one included)."""
        provider = self.tracer_provider
        # Kept with the provider it came from: the global one may be set or replaced later,
        # and asking a provider for a tracer costs more than a record's span.
        if self._tracer is None or self._tracer_of is not provider:
            self._tracer = provider.get_tracer(_names.TRACER_NAME, self._version)
            self._tracer_of = provider
        return self._tracer

    @property
    def meter_provider(self) -> metrics.MeterProvider:
        """The given meter provider, or the global one as it is now."""
        if self._meter_provider is not None:
            return self._meter_provider
        return metrics.get_meter_provider()

    def fleet_metrics(self) -> SandboxFleetMetrics | None:
        """The fleet counters of this state's meter provider (one set per provider, made on
        first use), or ``None`` when that provider cannot make them (logged once)."""
        provider = self.meter_provider
        # Every usage sample asks: the last answer is kept with the provider it came from.
        if self._fleet is not None and self._fleet[0] is provider:
            return self._fleet[1]
        try:
            fleet = SandboxFleetMetrics.of(provider, version=self._version)
        except Exception as exc:  # noqa: BLE001 - no counters is better than a failed sandbox
            log_failure("creating the sandbox fleet metrics", exc)
            return None
        self._fleet = (provider, fleet)
        return fleet

    def lifecycle_metrics(self) -> SandboxLifecycleMetrics | None:
        """The lifecycle and usage instruments of this state's meter provider (one set per
        provider, made on first use), or ``None`` when that provider cannot make them (logged
        once)."""
        provider = self.meter_provider
        if self._lifecycle is not None and self._lifecycle[0] is provider:
            return self._lifecycle[1]
        try:
            lifecycle = SandboxLifecycleMetrics.of(provider, version=self._version)
        except Exception as exc:  # noqa: BLE001 - no metrics is better than a failed sandbox
            log_failure("creating the sandbox lifecycle metrics", exc)
            return None
        self._lifecycle = (provider, lifecycle)
        return lifecycle

    @property
    def interval_s(self) -> float:
        """The configured sampling interval, before asking whether anything is exported."""
        if self._interval_s is not None:
            return self._interval_s
        return sandbox_resource_interval()

    def exporting(self) -> bool:
        """Whether this state's tracer provider sends spans anywhere besides our processor."""
        return _exporting.traces_exported(self.tracer_provider, ignore=(SandboxSpanProcessor,))

    def sampling_interval(self) -> float:
        """The interval, or 0 unless it is positive and spans are actually exported."""
        interval = self.interval_s
        if interval <= 0 or not self.exporting():
            return 0.0
        return interval

    def spawn(self, coroutine: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coroutine`` in a task of its own on the running loop, beside the caller.

        The state keeps a reference until it ends (the loop keeps only weak ones), so records
        in flight are not garbage-collected mid-way. Must be called on the event loop.
        """
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @contextmanager
    def active(self) -> Iterator[None]:
        """Make this the ``current_state()`` inside the ``with`` block."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


# The state a traced call made active; see current_state().
_ACTIVE: ContextVar[SandboxState | None] = ContextVar("nemo_gym_sandbox_state", default=None)


class _Current:
    """The instrumentor's state while instrumented, and the lazily made default state."""

    installed: SandboxState | None = None
    default: SandboxState | None = None


def default_state() -> SandboxState:
    """The state of code running without an instrumentor: global providers, environment."""
    if _Current.default is None:
        _Current.default = SandboxState(instrumentation_version=_package_version())
    return _Current.default


def install(state: SandboxState | None) -> None:
    """Make ``state`` the instrumentor's state (``None``: there is none)."""
    _Current.installed = state


def installed_state() -> SandboxState | None:
    return _Current.installed


def current_state() -> SandboxState:
    """The state active in this context, else the instrumentor's, else the default."""
    active = _ACTIVE.get()
    if active is not None:
        return active
    if _Current.installed is not None:
        return _Current.installed
    return default_state()
