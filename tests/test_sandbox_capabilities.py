"""A traced provider has exactly its provider's optional capabilities, and traces their calls.

The protocols here have the shape of NeMo Gym main's runtime-checkable capability protocols
(an endpoint, PTY sessions, re-attaching them, serialize and connect); they are our own, so
that the main suite runs them against nemo-gym 0.4.0, which has none. On NeMo Gym main the
``nemo_gym_main`` tests check them against NeMo Gym's own, its built-in providers, and its
``AsyncSandbox`` using each capability through our wrapper. The providers are the real process
provider with capability methods added: its sandboxes live in a dictionary that two provider
objects can share, standing in for an external control plane that ``connect`` reaches by id.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from nemo_gym_support import nemo_gym_main, nemo_gym_sandbox
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxHandle,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
    SandboxState,
    TracedSandboxProvider,
    sandbox_identity,
    traced_provider,
)
from span_support import (
    ISOLATION,
    NOTHING_REQUESTED,
    PROVIDER,
    REQUEST_ID,
    SANDBOX_ID,
    UNSPECIFIED,
    UUID4_HEX,
)

pytestmark = pytest.mark.nemo_gym  # also run on NeMo Gym main (nemo_gym_support)


# --- protocols of the same shape as NeMo Gym's ----------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    endpoint: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PtySpec:
    command: str | None = None


@runtime_checkable
class SupportsEndpoint(Protocol):
    async def endpoint(self, handle: SandboxHandle, port: int) -> Endpoint: ...


@runtime_checkable
class SupportsPty(Protocol):
    async def create_pty(self, handle: SandboxHandle, spec: PtySpec) -> object: ...


@runtime_checkable
class SupportsPtyAttach(Protocol):
    async def attach_pty(
        self,
        handle: SandboxHandle,
        session_id: str,
        *,
        takeover: bool = True,
        since: int | None = None,
    ) -> object: ...


@runtime_checkable
class Connectable(Protocol):
    async def serialize_handle(
        self, handle: SandboxHandle, *, scope: str | None = None
    ) -> dict[str, Any]: ...

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle: ...


@runtime_checkable
class HasResourceRead(Protocol):
    """A protocol over a provider method the wrapper does not trace: it is forwarded."""

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Any]: ...


PROTOCOLS = (SupportsEndpoint, SupportsPty, SupportsPtyAttach, Connectable, HasResourceRead)
# NeMo Gym main's name for each protocol above that it has (``nemo_gym.sandbox``).
NEMO_GYM_PROTOCOLS = {
    SupportsEndpoint: "SupportsSandboxEndpoint",
    SupportsPty: "SupportsSandboxPty",
    SupportsPtyAttach: "SupportsSandboxPtyAttach",
    Connectable: "ConnectableProvider",
}


# --- providers with some of the capabilities -------------------------------------------------


class Calls:
    """What a capability method received and returned, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple[Any, ...], dict[str, Any], object]] = []

    def note(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: object
    ) -> Any:
        self.seen.append((method, args, kwargs, result))
        return result


class WithEndpoint(ProcessSandboxProvider):
    def __init__(self) -> None:
        super().__init__(cgroups=False)
        self.calls = Calls()

    async def endpoint(self, handle: SandboxHandle, port: int) -> Endpoint:
        self._open(handle)
        found = Endpoint(f"http://127.0.0.1:{port}", {"x-route": handle.sandbox_id})
        return self.calls.note("endpoint", (handle, port), {}, found)


class WithPty(WithEndpoint):
    async def create_pty(self, handle: SandboxHandle, spec: PtySpec) -> object:
        self._open(handle)
        return self.calls.note("create_pty", (handle, spec), {}, object())


class WithPtyAttach(WithPty):
    async def attach_pty(
        self,
        handle: SandboxHandle,
        session_id: str,
        *,
        takeover: bool = True,
        since: int | None = None,
    ) -> object:
        self._open(handle)
        kwargs = {"takeover": takeover, "since": since}
        return self.calls.note("attach_pty", (handle, session_id), kwargs, object())


class WithConnect(WithPtyAttach):
    """Serialize and connect: sandboxes kept in ``control_plane``, shared between providers."""

    def __init__(self, control_plane: dict[str, Any] | None = None) -> None:
        super().__init__()
        if control_plane is not None:
            self._sandboxes = control_plane

    async def serialize_handle(
        self, handle: SandboxHandle, *, scope: str | None = None
    ) -> dict[str, Any]:
        self._open(handle)
        found = {"sandbox_id": handle.sandbox_id, "lease": "do-not-record"}
        return self.calls.note("serialize_handle", (handle,), {"scope": scope}, found)

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle:
        sandbox_id = descriptor["sandbox_id"]
        found = SandboxHandle(sandbox_id, self.name, self._sandboxes[sandbox_id])
        return self.calls.note("connect", (descriptor,), {}, found)


class EndpointSwitchedOff(WithEndpoint):
    """``endpoint = None``: a runtime-checkable protocol counts the method as absent."""

    endpoint = None  # type: ignore[assignment]


class WithPtyOnly(ProcessSandboxProvider):
    """PTY sessions without re-attach or endpoint: a capability set that skips one."""

    async def create_pty(self, handle: SandboxHandle, spec: PtySpec) -> object:
        return object()


PROVIDER_CLASSES = (
    ProcessSandboxProvider,
    WithEndpoint,
    WithPty,
    WithPtyAttach,
    WithConnect,
    EndpointSwitchedOff,
    WithPtyOnly,
)


def build(cls: type[ProcessSandboxProvider]) -> ProcessSandboxProvider:
    """A provider of ``cls`` without cgroups."""
    return cls() if issubclass(cls, WithEndpoint) else cls(cgroups=False)


@pytest.fixture
def state(tracer_provider: TracerProvider) -> SandboxState:
    """A sandbox state of the test's own tracer provider, with sampling off."""
    return SandboxState(tracer_provider, interval_s=0)


def spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def identity(span: ReadableSpan) -> dict[str, Any]:
    """The identity keys of ``span`` (a create or connect span): what every later span of
    that sandbox carries, and nothing else."""
    attributes = attrs(span)
    keys = (REQUEST_ID, PROVIDER, SANDBOX_ID, ISOLATION)
    return {key: attributes[key] for key in keys if key in attributes}


# --- capabilities ------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", PROVIDER_CLASSES, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda protocol: protocol.__name__)
async def test_traced_provider_capabilities_equal_the_providers(
    cls: type[ProcessSandboxProvider], protocol: type, state: SandboxState
) -> None:
    """isinstance against each runtime-checkable protocol is the same for wrapper and provider."""
    provider = build(cls)
    try:
        traced = traced_provider(provider, state)
        assert isinstance(traced, protocol) is isinstance(provider, protocol)
    finally:
        await provider.aclose()


async def test_traced_provider_capabilities_are_the_expected_ones(state: SandboxState) -> None:
    """The test's providers have the capabilities they are meant to have, wrapped or not."""
    expected = {
        ProcessSandboxProvider: {HasResourceRead},
        WithEndpoint: {SupportsEndpoint, HasResourceRead},
        WithPty: {SupportsEndpoint, SupportsPty, HasResourceRead},
        WithPtyAttach: {SupportsEndpoint, SupportsPty, SupportsPtyAttach, HasResourceRead},
        WithConnect: set(PROTOCOLS),
        EndpointSwitchedOff: {HasResourceRead},
        WithPtyOnly: {SupportsPty, HasResourceRead},
    }
    for cls, capabilities in expected.items():
        provider = build(cls)
        traced = traced_provider(provider, state)
        assert {p for p in PROTOCOLS if isinstance(traced, p)} == capabilities, cls.__name__
        await provider.aclose()


async def test_traced_provider_class_is_made_once_per_provider_class(state: SandboxState) -> None:
    """Two providers of one class share the wrapper class; another class gets its own."""
    first, second, other = WithPty(), WithPty(), WithConnect()
    try:
        assert type(traced_provider(first, state)) is type(traced_provider(second, state))
        assert type(traced_provider(first, state)) is not type(traced_provider(other, state))
        assert isinstance(traced_provider(other), TracedSandboxProvider)
        assert traced_provider(traced_provider(first)) is not None
    finally:
        for provider in (first, second, other):
            await provider.aclose()


async def test_traced_provider_forwarded_members_are_the_providers(state: SandboxState) -> None:
    """Members the wrapper does not trace are the provider's own, read and set through it."""
    provider = WithConnect()
    try:
        traced: Any = traced_provider(provider, state)
        assert traced.resource_sample == provider.resource_sample
        assert asyncio.iscoroutinefunction(traced.endpoint)
        assert traced.cgroup_version is None
        traced.calls = Calls()
        assert traced.calls is provider.calls
        copied = copy.copy(traced)
        assert type(copied) is type(traced)
        assert copied.wrapped is provider
    finally:
        await provider.aclose()


# --- capability calls ------------------------------------------------------------------------


async def test_traced_provider_capability_calls_reach_provider_as_spans(
    state: SandboxState, span_exporter: InMemorySpanExporter
) -> None:
    """Each capability call gets the provider's result object and is a span with the identity."""
    provider = WithConnect()
    traced: Any = traced_provider(provider, state)
    try:
        handle = await traced.create(SandboxSpec())
        pty_spec = PtySpec("sh")
        endpoint = await traced.endpoint(handle, 8080)
        session = await traced.create_pty(handle, pty_spec)
        attached = await traced.attach_pty(handle, "s-1", takeover=False, since=0)
        descriptor = await traced.serialize_handle(handle, scope="operate")
        await traced.close(handle)
    finally:
        await traced.aclose()
    assert [(m, a, k) for m, a, k, _ in provider.calls.seen] == [
        ("endpoint", (handle, 8080), {}),
        ("create_pty", (handle, pty_spec), {}),
        ("attach_pty", (handle, "s-1"), {"takeover": False, "since": 0}),
        ("serialize_handle", (handle,), {"scope": "operate"}),
    ]
    results = [result for _, _, _, result in provider.calls.seen]
    assert [endpoint, session, attached, descriptor] == results
    assert all(
        mine is theirs
        for mine, theirs in zip([endpoint, session, attached, descriptor], results, strict=True)
    )
    (created,) = spans(span_exporter, "sandbox.create")
    assert attrs(created) == {
        **identity(created),
        REQUEST_ID: UUID4_HEX,
        UNSPECIFIED: NOTHING_REQUESTED,
    }
    assert identity(created)[SANDBOX_ID] == handle.sandbox_id
    names = ["sandbox.endpoint", "sandbox.pty.create", "sandbox.pty.attach", "sandbox.serialize"]
    for name in names:
        (span,) = spans(span_exporter, name)
        assert attrs(span) == identity(created), name
        values = [str(value) for value in (span.attributes or {}).values()]
        assert not any("do-not-record" in v or "127.0.0.1" in v for v in values)


async def test_traced_provider_capability_failure_reaches_caller_unchanged(
    state: SandboxState, span_exporter: InMemorySpanExporter
) -> None:
    """A capability call that fails raises the provider's exception object; its span says so."""
    provider = WithConnect()
    traced: Any = traced_provider(provider, state)
    stranger = SandboxHandle("not-a-sandbox", provider.name, None)
    try:
        with pytest.raises(RuntimeError, match="not-a-sandbox") as raised:
            await traced.endpoint(stranger, 8080)
        with pytest.raises(RuntimeError) as direct:
            await provider.endpoint(stranger, 8080)
    finally:
        await provider.aclose()
    assert type(raised.value) is type(direct.value)
    assert str(raised.value) == str(direct.value)
    (span,) = spans(span_exporter, "sandbox.endpoint")
    assert span.status.status_code is StatusCode.ERROR
    assert attrs(span) == {
        PROVIDER: provider.name,
        SANDBOX_ID: "not-a-sandbox",
        "error.type": "RuntimeError",
    }


async def test_traced_provider_connect_handle_is_known_as_created(
    state: SandboxState, span_exporter: InMemorySpanExporter
) -> None:
    """A handle from connect() has a request id, and its exec and close spans carry it."""
    control_plane: dict[str, Any] = {}
    creator = WithConnect(control_plane)
    descriptor = await creator.serialize_handle(await creator.create(SandboxSpec()))
    connecting = WithConnect(control_plane)
    traced: Any = traced_provider(connecting, state)
    try:
        handle = await traced.connect(descriptor)
        with state.active():
            known = sandbox_identity(handle)
        result = await traced.exec(handle, "echo connected")
        assert result.stdout == "connected\n"
        await traced.close(handle)
    finally:
        await creator.aclose()
    assert handle is connecting.calls.seen[-1][3]
    (connect,) = spans(span_exporter, "sandbox.connect")
    assert known == {
        REQUEST_ID: UUID4_HEX,
        PROVIDER: connecting.name,
        SANDBOX_ID: descriptor["sandbox_id"],
        ISOLATION: "bwrap",
    }
    assert attrs(connect) == known
    (exec_span,) = spans(span_exporter, "sandbox.exec")
    (close,) = spans(span_exporter, "sandbox.close")
    assert attrs(exec_span) == {**known, PREFIX + "exec.return_code": 0}
    assert attrs(close) == known
    assert len(state.registry) == 0  # closed: forgotten like a created sandbox
    assert spans(span_exporter, "sandbox.create") == []


async def test_traced_provider_connect_is_not_counted_as_a_creation(
    tracer_provider: TracerProvider,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """connect() rebuilds a handle to a sandbox made elsewhere: gym.sandbox.creations counts
    the create that made it, and nothing for the connect."""
    state = SandboxState(tracer_provider, meter_provider=meter_provider, interval_s=0)
    control_plane: dict[str, Any] = {}
    creator: Any = traced_provider(WithConnect(control_plane), state)
    traced: Any = traced_provider(WithConnect(control_plane), state)
    try:
        descriptor = await creator.serialize_handle(await creator.create(SandboxSpec()))
        after_create = creations(metric_reader)
        handle = await traced.connect(descriptor)
        await traced.close(handle)
    finally:
        await creator.aclose()
    assert after_create == {"created": 1}
    assert creations(metric_reader) == after_create


def creations(reader: InMemoryMetricReader) -> dict[str, int]:
    """gym.sandbox.creations collected now, by outcome."""
    counted: dict[str, int] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data is not None else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name != "gym.sandbox.creations":
                    continue
                for point in metric.data.data_points:
                    outcome = str((point.attributes or {})["nemo.gym.sandbox.outcome"])
                    counted[outcome] = counted.get(outcome, 0) + int(point.value)  # type: ignore[union-attr]
    return counted


# --- through NeMo Gym's create_provider while instrumented ------------------------------------


async def test_instrumented_nemo_gym_provider_keeps_its_capabilities(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """A capable provider NeMo Gym builds under instrument() keeps exactly its capabilities."""
    nemo_gym = nemo_gym_sandbox()
    name = f"test_{uuid.uuid4().hex[:12]}"  # NeMo Gym's registry has no removal
    nemo_gym.register_provider(name, WithPtyAttach)
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, connection_pool=False)
    try:
        provider = nemo_gym.create_provider({name: {}})
        assert isinstance(provider, TracedSandboxProvider)
        found = {protocol for protocol in PROTOCOLS if isinstance(provider, protocol)}
        assert found == {SupportsEndpoint, SupportsPty, SupportsPtyAttach, HasResourceRead}
        handle = await provider.create(SandboxSpec())
        endpoint = await provider.endpoint(handle, 9000)
        await provider.close(handle)
        await provider.aclose()
    finally:
        instrumentor.uninstrument()
    assert endpoint is provider.wrapped.calls.seen[0][3]
    (created,) = spans(span_exporter, "sandbox.create")
    (span,) = spans(span_exporter, "sandbox.endpoint")
    assert attrs(span) == {
        REQUEST_ID: UUID4_HEX,
        PROVIDER: "process",
        SANDBOX_ID: handle.sandbox_id,
        ISOLATION: "bwrap",
    }
    assert attrs(span) == identity(created)


# --- NeMo Gym main: its own protocols, its built-in providers, its AsyncSandbox ---------------


@pytest.mark.nemo_gym_main
@pytest.mark.parametrize("cls", PROVIDER_CLASSES, ids=lambda cls: cls.__name__)
async def test_stand_in_protocols_answer_as_nemo_gym_mains(
    cls: type[ProcessSandboxProvider], state: SandboxState
) -> None:
    """Each stand-in protocol answers as NeMo Gym main's own, for a provider and its wrapper."""
    nemo_gym = nemo_gym_main()
    provider = build(cls)
    try:
        traced = traced_provider(provider, state)
        for ours, name in NEMO_GYM_PROTOCOLS.items():
            theirs = getattr(nemo_gym, name)
            assert isinstance(provider, theirs) is isinstance(provider, ours), name
            assert isinstance(traced, theirs) is isinstance(provider, ours), name
    finally:
        await provider.aclose()


# NeMo Gym main's built-in providers that can be built here (apptainer and enroot need their
# binaries, openshell its SDK), with the capabilities each has at commit 07d6b0d.
MAIN_BUILT_IN_CAPABILITIES = {
    "docker": {"SupportsSandboxEndpoint"},
    "opensandbox": set(NEMO_GYM_PROTOCOLS.values()),
    "daytona": set(),
    "ecs_fargate": set(),
}


@pytest.mark.nemo_gym_main
@pytest.mark.parametrize("name", sorted(MAIN_BUILT_IN_CAPABILITIES))
async def test_instrumented_nemo_gym_built_in_keeps_its_capabilities(
    name: str, tracer_provider: TracerProvider
) -> None:
    """A built-in provider NeMo Gym main builds under instrument() is traced and keeps exactly
    the capabilities it has unwrapped."""
    nemo_gym = nemo_gym_main()
    protocols = {protocol: getattr(nemo_gym, protocol) for protocol in NEMO_GYM_PROTOCOLS.values()}
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, connection_pool=False)
    try:
        provider = nemo_gym.create_provider({name: {}})
    finally:
        instrumentor.uninstrument()
    try:
        assert isinstance(provider, TracedSandboxProvider)
        assert type(provider.wrapped) is nemo_gym.get_provider_class(name)
        traced = {found for found, protocol in protocols.items() if isinstance(provider, protocol)}
        unwrapped = {
            found for found, protocol in protocols.items() if isinstance(provider.wrapped, protocol)
        }
        assert traced == unwrapped == MAIN_BUILT_IN_CAPABILITIES[name]
    finally:
        await provider.wrapped.aclose()


@pytest.mark.nemo_gym_main
async def test_nemo_gym_main_async_sandbox_uses_every_capability_traced(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """NeMo Gym main's AsyncSandbox reaches an endpoint, PTY sessions, serialize and connect
    through the traced provider, gets the provider's own objects, and each call is a span
    with the sandbox identity (the descriptor's lease recorded nowhere)."""
    nemo_gym = nemo_gym_main()
    control_plane: dict[str, Any] = {}

    class MainCapable(WithConnect):
        """Every capability; endpoints as NeMo Gym's SandboxEndpoint, which AsyncSandbox
        checks for."""

        def __init__(self) -> None:
            super().__init__(control_plane)

        async def endpoint(self, handle: SandboxHandle, port: int) -> Any:
            self._open(handle)
            found = nemo_gym.SandboxEndpoint(f"http://127.0.0.1:{port}", {"x-route": "r"})
            return self.calls.note("endpoint", (handle, port), {}, found)

    name = f"test_{uuid.uuid4().hex[:12]}"  # NeMo Gym's registry has no removal
    nemo_gym.register_provider(name, MainCapable)
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, connection_pool=False)
    try:
        sandbox = nemo_gym.AsyncSandbox({name: {}}, nemo_gym.SandboxSpec(ports=[8080]))
        async with sandbox:
            await sandbox.start()
            endpoint = await sandbox.endpoint(8080)
            session = await sandbox.pty.create("sh")
            attached = await sandbox.pty.attach("s-1", takeover=False, since=0)
            descriptor = await sandbox.serialize(scope="operate")
            connecting = nemo_gym.create_provider({name: {}})
            async with await nemo_gym.AsyncSandbox.connect(
                descriptor, provider=connecting
            ) as connected:
                result = await connected.exec("echo connected")
    finally:
        instrumentor.uninstrument()
    assert isinstance(sandbox._provider, TracedSandboxProvider)
    assert isinstance(connecting, TracedSandboxProvider)
    assert result.stdout == "connected\n"
    seen = sandbox._provider.wrapped.calls.seen
    assert [method for method, *_ in seen] == [
        "endpoint",
        "create_pty",
        "attach_pty",
        "serialize_handle",
    ]
    for mine, (_, _, _, theirs) in zip([endpoint, session, attached], seen[:3], strict=True):
        assert mine is theirs
    assert descriptor["lease"] == "do-not-record"
    (created,) = spans(span_exporter, "sandbox.create")
    sandbox_id = identity(created)[SANDBOX_ID]
    assert descriptor["sandbox_id"] == sandbox_id
    names = ["sandbox.endpoint", "sandbox.pty.create", "sandbox.pty.attach", "sandbox.serialize"]
    for span_name in names:
        (span,) = spans(span_exporter, span_name)
        assert attrs(span) == identity(created), span_name
    (connect,) = spans(span_exporter, "sandbox.connect")
    (exec_span,) = spans(span_exporter, "sandbox.exec")
    assert attrs(connect) == {**identity(created), REQUEST_ID: UUID4_HEX}
    assert attrs(exec_span) == {**identity(connect), PREFIX + "exec.return_code": 0}
    for span in span_exporter.get_finished_spans():
        values = [str(value) for value in (span.attributes or {}).values()]
        assert not any("do-not-record" in v for v in values), span.name
