"""Best-effort resource records in the existing sandbox trace stream.

Three layers: the value types a provider returns (``ResourceDesignator``,
``ComponentAllocation``, ``ResourceAllocation``, the ``ResourceProvider`` protocol, defined in
``_allocation`` and exported here); pure functions that turn them and a ``SandboxSpec`` into
span attributes (no I/O, no OpenTelemetry; defined in ``_attributes`` and exported here); and
the edge that emits them,
``ResourceSampler``, whose records are short ``sandbox.resources`` spans parented to the
context the sandbox was created in, on the tracer of the sandbox state current then
(``_state``: the instrumentor's tracer provider, else the global one).

A usage sample's record leaves out the figures that did not change since the sandbox's
previous sample (``resource.partial = true``); the first, the final and every
``WHOLE_SAMPLE_EVERY``-th go whole. A provider may offer ``resource_sample_nowait(handle)``
beside ``resource_sample``: the sample read without waiting (a cgroup's kernel files), or
``None``; the sampler takes it first and awaits ``resource_sample`` only when it answers
``None``.

Records are best effort: a provider that raises or hangs still yields a record, carrying
``resource.error`` (the exception's type, never its text), and its exception never reaches
the caller. Usage numbers that cannot be usage (NaN, infinite, negative; in a reader, more
than the answer's own total) are dropped.

The records also feed the state's fleet metrics (``_fleet_metrics``): an allocation record is
compared with the sandbox's request (mismatches go on the record, in one warning per provider
and resource, and on ``gym.sandbox.allocation.mismatches``) and carries the semantic-convention
``container.id`` / ``container.runtime.name`` of a container; each usage sample adds the OOM
kills since the sampler's previous sample to ``gym.sandbox.oom_kills``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from opentelemetry import context
from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import (
    PREFIX,
    Attribute,
    ComponentAllocation,
    ResourceAllocation,
    ResourceDesignator,
    ResourceProvider,
    ResourcesUnknown,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._attributes import (
    allocation_attributes,
    amount_attributes,
    changed_attributes,
    record_request,
    requested_attributes,
    sample_attributes,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._burst import settled
from opentelemetry.instrumentation.nemo_gym.sandbox._fleet_metrics import container_identity
from opentelemetry.instrumentation.nemo_gym.sandbox._log import log_failure, log_once
from opentelemetry.instrumentation.nemo_gym.sandbox._scope import PROVIDER
from opentelemetry.instrumentation.nemo_gym.sandbox._server_scope import server_scope_of
from opentelemetry.instrumentation.nemo_gym.sandbox._state import current_state, sandbox_key

# SandboxResourceAmounts, SandboxResources and SandboxSpec were importable from here before the
# attribute functions moved to _attributes; they stay importable for callers.
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (  # noqa: F401
    SandboxHandle,
    SandboxResourceAmounts,
    SandboxResources,
    SandboxSpec,
)

__all__ = [
    "PREFIX",
    "PROVIDER_CALL_TIMEOUT_S",
    "Attribute",
    "ComponentAllocation",
    "ResourceAllocation",
    "ResourceDesignator",
    "ResourceProvider",
    "ResourceSampler",
    "allocation_attributes",
    "amount_attributes",
    "record_request",
    "requested_attributes",
    "sampling_interval",
]

# Upper case because nemo_gym.sandbox.resource_telemetry documents it so; every other module
# of the package spells its logger ``logger``, as the logging HOWTO does.
LOGGER = logging.getLogger(__name__)

RECORD_SPAN_NAME = "sandbox.resources"

# A sample record leaves out the figures that did not change since the sandbox's previous
# sample, and says so with this attribute; one sample in this many goes whole all the same
# (at the default 10 s interval, once a minute), so a reader that lost a record, or looks at
# a short window, has every figure within that many records.
PARTIAL = PREFIX + "resource.partial"
WHOLE_SAMPLE_EVERY = 6

# The longest one provider call may take inside a record. Each attempt of the allocation read
# gets all of it, whatever the interval; a sample gets the shorter of this and the interval, so
# a hung provider delays neither the next sample nor ``stop()`` by more.
PROVIDER_CALL_TIMEOUT_S = 5.0
# The pauses between the attempts of a traced create's allocation read (``record_allocation``),
# each attempt bounded as above: a read that failed in a burst (an engine busy with creates)
# is tried again while the sandbox lives, about half a minute in all, not given up at once.
ALLOCATION_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)


# --- the edge: records as spans, and the sampler -------------------------------------------


def sampling_interval() -> float:
    """Return zero unless resource traces are enabled, including an actual exporter.

    Positive only when the sampling interval (the instrumentor's, or
    ``OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL``) is positive and the tracer provider
    (the instrumentor's, or the global one) is an SDK provider, not disabled, with at least
    one span processor besides our own (which only decorates spans and sends nothing).
    """
    return current_state().sampling_interval()


_T = TypeVar("_T")


def _discard_outcome(task: asyncio.Future[Any]) -> None:
    # An abandoned provider call may still fail later; retrieving its outcome keeps asyncio
    # from logging "exception was never retrieved" for a failure we already recorded.
    if not task.cancelled():
        task.exception()


async def _bounded(call: Awaitable[_T], timeout: float) -> _T:  # noqa: ASYNC109 - wraps wait_for
    """Await a provider call for at most ``timeout`` seconds.

    ``asyncio.wait_for`` waits for the cancelled call to finish, so a provider that swallows
    cancellation would hang it; here the call is cancelled and abandoned, and ``TimeoutError``
    is raised at the deadline whatever the provider does. Cancelling the caller cancels the
    call and propagates.
    """
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(_discard_outcome)
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_discard_outcome)
        raise TimeoutError(f"sandbox resource provider did not answer within {timeout:g} s")
    return task.result()


def _checked_interval(interval: object) -> float:
    """``interval`` as seconds, or ``ValueError`` naming the field and the value."""
    try:
        seconds = float(interval)  # type: ignore[arg-type]  # anything float() takes
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(interval, bool) or not (0 <= seconds < math.inf):
        raise ValueError(
            f"resource sampler interval={interval!r} must be a finite number of seconds >= 0"
        )
    return seconds


class ResourceSampler:
    """One owner samples a sandbox; borrowed connections do not start duplicate samplers.

    Construct it where the sandbox is created: its records are parented to the context
    current at construction, and go to the sandbox state current then (the instrumentor's
    tracer provider, or the global one without an instrumentor). ``start()`` claims the
    sandbox for this sampler (unless another sampler of that state already owns it) and, when
    ``interval > 0``, starts a task on the running loop that records a ``sample`` every
    ``interval`` seconds. ``stop()`` ends the task and, for the owner, records one last
    sample with ``resource.final = true``. Both are idempotent and bounded in time: the
    allocation read is abandoned after ``PROVIDER_CALL_TIMEOUT_S`` seconds, a sample after
    ``min(interval, PROVIDER_CALL_TIMEOUT_S)``. Nothing here raises a provider's exception;
    ``asyncio.CancelledError`` propagates. ``interval`` that is not a finite number >= 0
    raises ``ValueError`` naming it.
    """

    def __init__(
        self,
        provider: ResourceProvider,
        handle: SandboxHandle,
        attributes: Mapping[str, Attribute],
        interval: float,
    ) -> None:
        interval = _checked_interval(interval)
        self.attributes: dict[str, Attribute] = dict(attributes)
        self.task: asyncio.Task[None] | None = None
        self._provider = provider
        self._handle = handle
        self._interval = interval
        self._timeout = (
            min(interval, PROVIDER_CALL_TIMEOUT_S) if interval > 0 else PROVIDER_CALL_TIMEOUT_S
        )
        self._state = current_state()
        self._context = context.get_current()
        # Scoped by the provider's server, as the traced calls key the sandbox.
        self._key = sandbox_key(handle, server_scope_of(provider))
        self._started = False
        self._stopped = False
        self._owner = False
        self._stopping: asyncio.Task[None] | None = None
        # Set when stop() begins: an allocation read waiting for a burst or a retry goes at once.
        self._closing = asyncio.Event()
        # This sampler's last usage sample: OOM kills are counted as the difference to it.
        # One sampler owns a sandbox's samples, so this is the sandbox's previous sample.
        self._last_sample: dict[str, Attribute] | None = None
        # Partial sample records since the last whole one (see _recorded_figures).
        self._partial_run = 0
        # Read now: a close may forget the sandbox before the allocation record is answered.
        self._requested = self._requested_resources()
        nowait = getattr(provider, "resource_sample_nowait", None)
        self._sample_nowait: Callable[[SandboxHandle], Mapping[str, object] | None] | None = (
            nowait if callable(nowait) else None
        )

    @property
    def _provider_label(self) -> str:
        label = self.attributes.get(PROVIDER)
        return label if isinstance(label, str) and label else self._key[0]

    def _requested_resources(self) -> object:
        """The sandbox's requested resources: the traced create's, else the requested shape
        in this sampler's attributes (a sampler built over ``record_request(spec, ...)``)."""
        entry = self._state.registry.get(self._key)
        if entry is not None and entry.requested is not None:
            return entry.requested
        prefix = PREFIX + "requested."
        return {
            quantity: self.attributes[prefix + quantity]
            for quantity in ("cpu", "memory_mib")
            if prefix + quantity in self.attributes
        }

    def _allocation_extras(self, allocation: ResourceAllocation) -> dict[str, Attribute]:
        """The container identity and the request comparison of an allocation record; each
        mismatch is also warned about (once per provider and resource) and counted."""
        fleet = self._state.fleet_metrics()
        if fleet is None:
            return container_identity(allocation)
        return fleet.allocation_recorded(self._provider_label, self._requested, allocation)

    def _recorded_figures(
        self, sample: dict[str, Attribute], changed: dict[str, Attribute] | None, final: bool
    ) -> dict[str, Attribute]:
        """What a sample record carries of ``sample``, given what ``changed`` since the
        previous sample (``None``: no previous one, or it had a figure ``sample`` lacks):
        all of it (the first, the final, every ``WHOLE_SAMPLE_EVERY``-th, one that lacks a
        figure the previous one had, and one whose figures all changed), else the figures
        that changed, with ``resource.partial = true``."""
        if (
            final
            or changed is None
            or len(changed) == len(sample)
            or self._partial_run >= WHOLE_SAMPLE_EVERY - 1
        ):
            self._partial_run = 0
            return sample
        self._partial_run += 1
        return {**changed, PARTIAL: True}

    def _feed_usage_metrics(self, sample: dict[str, Attribute]) -> None:
        """Feed a usage sample to the fleet counters (OOM kills) and the usage totals (CPU
        time, memory high-water mark), as differences to this sampler's previous sample."""
        previous, self._last_sample = self._last_sample, sample
        fleet = self._state.fleet_metrics()
        if fleet is not None:
            fleet.sample_recorded(self._provider_label, previous, sample)
        lifecycle = self._state.lifecycle_metrics()
        if lifecycle is not None:
            lifecycle.sampled(self._provider_label, previous, sample)

    async def record_allocation(self) -> None:
        """Emit the ``allocation`` record as a traced create does, yielding to the
        application: the read waits until no sandbox create, then no other traced call, is in
        flight on the loop (a burst of them settles: ``_burst``, within its bounds), and a
        read that fails or
        times out is tried again after each of ``ALLOCATION_RETRY_DELAYS_S`` while the sandbox
        lives. Once ``stop()`` has begun, the waits end and one last attempt is made at once;
        the record then carries the last failure. Nothing is raised but cancellation."""
        await self._record("allocation", False, retry=True)

    async def record(self, kind: str, final: bool = False) -> None:
        """Emit one ``sandbox.resources`` span of ``kind`` ``allocation`` or ``sample``.

        The span carries the identity attributes, ``resource.kind``, ``resource.final`` and
        the provider's answer; of a sample, only the figures that changed since the previous
        sample, with ``resource.partial = true``, unless it goes whole (the first, the final,
        every ``WHOLE_SAMPLE_EVERY``-th: see ``_recorded_figures``). A sample comes from the
        provider's ``resource_sample_nowait`` where it has one and answers, else from an
        awaited ``resource_sample``. When the provider raises or times out the span carries
        ``resource.error`` (the exception's type name) instead, and nothing is raised. Inside
        OpenTelemetry's ``suppress_instrumentation`` nothing is read or recorded. An unknown
        ``kind`` raises ``ValueError``.
        """
        await self._record(kind, final, retry=False)

    async def _allocation_answer(self, retry: bool) -> Any:
        """The provider's allocation answer: one bounded attempt, or (``retry``) the attempts
        of ``record_allocation``."""
        if not retry:
            return await _bounded(
                self._provider.resource_allocation(self._handle), PROVIDER_CALL_TIMEOUT_S
            )
        await settled(self._closing)
        for delay in ALLOCATION_RETRY_DELAYS_S:
            try:
                return await _bounded(
                    self._provider.resource_allocation(self._handle), PROVIDER_CALL_TIMEOUT_S
                )
            except Exception as exc:
                if self._closing.is_set():
                    raise
                LOGGER.debug("sandbox %s: allocation read failed, retried: %r", self._key, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), delay)
        return await _bounded(
            self._provider.resource_allocation(self._handle), PROVIDER_CALL_TIMEOUT_S
        )

    async def _record(self, kind: str, final: bool, *, retry: bool) -> None:
        if kind not in ("allocation", "sample"):
            raise ValueError(f"resource record kind={kind!r} must be 'allocation' or 'sample'")
        if not is_instrumentation_enabled():
            return
        start: dict[str, Attribute] = dict(self.attributes)
        start[PREFIX + "resource.kind"] = kind
        start[PREFIX + "resource.final"] = bool(final)
        # The span is made once its attributes are all known (one attribute set for the SDK
        # to check instead of two), dated from before the provider was asked.
        start_time = time.time_ns()
        data: dict[str, Attribute] = {}
        try:
            if kind == "allocation":
                answer: Any = await self._allocation_answer(retry)
            else:
                answer = self._sample_now()
                if answer is None:
                    answer = await _bounded(
                        self._provider.resource_sample(self._handle), self._timeout
                    )
            if isinstance(answer, ResourcesUnknown):
                # Unknown, and why: never a figure, so nothing to compare or count either.
                area = "allocation" if kind == "allocation" else "usage"
                data = {f"{PREFIX}{area}.unknown_reason": answer.reason}
            elif kind == "allocation":
                data = allocation_attributes(answer)
                data.update(self._allocation_extras(answer))
            else:
                sample = sample_attributes(answer)
                if not start.keys().isdisjoint(sample):
                    # The provider's answer never overrides the sandbox's identity.
                    sample = {k: v for k, v in sample.items() if k not in start}
                previous = self._last_sample
                changed = None if previous is None else changed_attributes(previous, sample)
                if changed != {}:
                    # A sample equal to the previous one adds no CPU time, no memory mark
                    # and no OOM kill: the metrics are fed only what may move them.
                    self._feed_usage_metrics(sample)
                data = self._recorded_figures(sample, changed, final)
        except asyncio.CancelledError:
            # stop() cancelled a periodic record while the provider was answering: the record
            # says so instead of being exported as an empty sample, and cancellation goes on.
            data = {PREFIX + "resource.error": "CancelledError"}
            raise
        except Exception as exc:  # noqa: BLE001 - a failed provider call is part of the record
            data = {PREFIX + "resource.error": type(exc).__name__}
            log_failure(f"sandbox resource {kind} record", exc, self._key[0])
        finally:
            # The provider's answer never overrides the sandbox's identity.
            for key, value in data.items():
                start.setdefault(key, value)
            self._state.tracer.start_span(
                RECORD_SPAN_NAME, context=self._context, attributes=start, start_time=start_time
            ).end()

    def _sample_now(self) -> Mapping[str, object] | None:
        """The provider's sample when it can be read without waiting (its optional
        ``resource_sample_nowait``: a cgroup's kernel files), else ``None``: the caller
        awaits ``resource_sample``, bounded in time."""
        if self._sample_nowait is None:
            return None
        return self._sample_nowait(self._handle)

    def _release_reader(self) -> None:
        """Tell a resource reader (``readers``) that has ``release`` the sandbox is done."""
        release = getattr(self._provider, "release", None)
        if callable(release):
            try:
                release(self._handle)
            except Exception as exc:  # noqa: BLE001 - a reader's bookkeeping is not the caller's
                log_failure("releasing a sandbox's resource reader", exc, self._key[0])

    async def run(self) -> None:
        """Record a ``sample`` every ``interval`` seconds until cancelled."""
        if self._interval <= 0:
            return
        while True:
            await asyncio.sleep(self._interval)
            await self.record("sample")

    def start(self) -> None:
        """Claim the sandbox and begin periodic samples; a no-op after the first call.

        A second sampler for a sandbox that already has an owner starts no task and records
        no final sample. With ``interval <= 0`` the owner starts no task but still records
        the final sample on ``stop()``. Must be called on the event loop thread.
        """
        if self._started or self._stopped:
            return
        self._started = True
        if not self._state.registry.claim(self._key, self):
            return
        self._owner = True
        if self._interval <= 0:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            log_once(("no-loop",), "ResourceSampler.start() outside an event loop: no samples")
            return
        self.task = loop.create_task(
            self.run(), name=f"nemo-gym sandbox sampler {self._key[0]}/{self._key[2]}"
        )

    async def stop(self) -> None:
        """End the periodic task and, for the owner, record the final sample; idempotent.

        Returns within about ``min(interval, PROVIDER_CALL_TIMEOUT_S)`` seconds however the
        provider behaves, and releases the sandbox so a later sampler may own it. The work
        runs in a task of its own: cancelling a ``stop()`` cancels only the wait (the
        cancellation propagates), the stop still completes and releases the sandbox, and a
        retried ``stop()`` waits for that same stop.
        """
        self._stopped = True
        self._closing.set()
        if self._stopping is None:
            if not self._owner and self.task is None:
                return
            self._stopping = asyncio.get_running_loop().create_task(
                self._stop(), name=f"nemo-gym sandbox sampler stop {self._key[2]}"
            )
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        try:
            task = self.task
            if task is not None and not task.done():
                task.cancel()
                # run() only awaits sleep() and bounded provider calls, so this ends promptly.
                await asyncio.wait((task,))
            if self._owner:
                await self.record("sample", final=True)
                self._release_reader()
        finally:
            if self._owner:
                self._state.registry.release(self._key, self)
