"""Two servers that give out the same sandbox id: two sandboxes, each with its own identity,
samples and final, in spans and records; and a connect to a sandbox already open in this
process stays that one sandbox.

The providers are the test's own, each standing for one server (its ``server_scope``), both
named alike and both answering every create with the same id, as two OpenSandbox servers
can. Spans go through the real SDK to an in-memory exporter; samples are driven by the
providers' answers, waited for with events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from opentelemetry.instrumentation.nemo_gym.sandbox._server_scope import server_scope_of
from opentelemetry.instrumentation.nemo_gym.sandbox._state import SandboxState
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxExecResult,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    Attribute,
    ResourceAllocation,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
    sandbox_identity,
    sandbox_scope,
    traced_provider,
)
from span_support import FINAL, KIND, REQUEST_ID, attributes_of, identity, settled
from test_nemo_gym_coexistence import NEMO_GYM_SAMPLER_MODULE, stand_in_sampler_module
from waiting import eventually

SAME_ID = "sbx-0001"
NAME = "colliding"
PIDS = PREFIX + "usage.pids"
BOUND_S = 30.0


@dataclass
class Handle:
    sandbox_id: str
    provider_name: str
    raw: Any = None


class Server:
    """A provider for one server: every create gives ``SAME_ID``; its samples say
    ``usage.pids = pids`` (so a record tells which server answered) and are counted."""

    name = NAME

    def __init__(self, scope: str, pids: int) -> None:
        self.server_scope = scope
        self.pids = pids
        self.samples = 0
        self._sampled = asyncio.Condition()
        self.closed = 0

    async def create(self, spec: Any) -> Handle:
        return Handle(SAME_ID, self.name, raw=self.server_scope)

    async def connect(self, descriptor: dict[str, str]) -> Handle:
        return Handle(descriptor["sandbox_id"], self.name, raw=self.server_scope)

    async def exec(self, handle: Handle, command: str, **_: Any) -> SandboxExecResult:
        return SandboxExecResult(stdout="", stderr="", return_code=self.pids)

    async def close(self, handle: Handle) -> None:
        self.closed += 1

    async def aclose(self) -> None:
        return None

    async def resource_allocation(self, handle: Handle) -> ResourceAllocation:
        return ResourceAllocation(source=self.server_scope)

    async def resource_sample(self, handle: Handle) -> dict[str, Attribute]:
        return self.resource_sample_nowait(handle)

    def resource_sample_nowait(self, handle: Handle) -> dict[str, Attribute]:
        self.samples += 1
        asyncio.get_running_loop().create_task(self._notify())
        return {"usage.pids": self.pids}

    async def _notify(self) -> None:
        async with self._sampled:
            self._sampled.notify_all()

    async def sampled_beyond(self, count: int) -> None:
        """Wait until this server has given more than ``count`` samples."""
        async with self._sampled:
            await asyncio.wait_for(self._sampled.wait_for(lambda: self.samples > count), BOUND_S)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    exporter.provider = provider  # type: ignore[attr-defined]  # for the state below
    yield exporter
    provider.shutdown()


def _state(exporter: InMemorySpanExporter) -> SandboxState:
    """A state of its own exporting to ``exporter``, sampling every 50 ms."""
    return SandboxState(exporter.provider, interval_s=0.05)  # type: ignore[attr-defined]


def _spans(exporter: InMemorySpanExporter, name: str) -> list[dict[str, Any]]:
    return [attributes_of(s) for s in exporter.get_finished_spans() if s.name == name]


def _of(spans: list[dict[str, Any]], request_id: object) -> list[dict[str, Any]]:
    return [s for s in spans if s.get(REQUEST_ID) == request_id]


def _records(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == "sandbox.resources"]


def test_server_scope_of_is_the_providers_own_or_none() -> None:
    """A provider's ``server_scope`` string is its scope; anything else, or none, is ``None``."""
    assert server_scope_of(Server("a.example:8080", 1)) == "a.example:8080"
    assert server_scope_of(object()) is None
    odd = Server("x", 1)
    odd.server_scope = 42  # type: ignore[assignment]  # not a string: no scope
    assert server_scope_of(odd) is None


async def test_traced_providers_of_two_servers_with_one_sandbox_id_stay_two_sandboxes(
    exporter: InMemorySpanExporter,
) -> None:
    """Two servers' sandboxes with one id: each exec span carries its own request id, each
    gets its own samples and one final, and closing one leaves the other sampling."""
    state = _state(exporter)
    server_a, server_b = Server("a.example:8080", 11), Server("b.example:8080", 22)
    a, b = traced_provider(server_a, state), traced_provider(server_b, state)
    handle_a = await a.create(SandboxSpec())
    handle_b = await b.create(SandboxSpec())
    assert handle_a.sandbox_id == handle_b.sandbox_id == SAME_ID
    await server_a.sampled_beyond(1)
    await server_b.sampled_beyond(1)
    await a.exec(handle_a, "true")
    await b.exec(handle_b, "true")
    # A bare handle finds its own sandbox: the object the provider gave is remembered.
    with state.active():
        id_a, id_b = sandbox_identity(handle_a), sandbox_identity(handle_b)

    await b.close(handle_b)
    after_close = server_a.samples
    await server_a.sampled_beyond(after_close)  # A samples on after B's close
    await a.close(handle_a)
    await settled()

    [create_a, create_b] = _spans(exporter, "sandbox.create")
    request_a, request_b = create_a[REQUEST_ID], create_b[REQUEST_ID]
    assert request_a != request_b
    assert id_a == identity(request_a, NAME, SAME_ID)
    assert id_b == identity(request_b, NAME, SAME_ID)
    execs = _spans(exporter, "sandbox.exec")
    assert execs == [
        {**identity(request_a, NAME, SAME_ID), PREFIX + "exec.return_code": 11},
        {**identity(request_b, NAME, SAME_ID), PREFIX + "exec.return_code": 22},
    ]
    assert _spans(exporter, "sandbox.close") == [
        identity(request_b, NAME, SAME_ID),
        identity(request_a, NAME, SAME_ID),
    ]
    records = [attributes_of(r) for r in _records(exporter)]
    for request, server in ((request_a, server_a), (request_b, server_b)):
        mine = _of(records, request)
        [allocation] = [r for r in mine if r[KIND] == "allocation"]
        assert allocation[PREFIX + "allocation.source"] == server.server_scope
        samples = [r for r in mine if r[KIND] == "sample"]
        # Every sample is this server's answer (a partial one leaves an unchanged pids out).
        assert {r.get(PIDS, server.pids) for r in samples} == {server.pids}
        assert [r[FINAL] for r in samples].count(True) == 1
        assert samples[-1][FINAL] is True
        assert samples[-1][PIDS] == server.pids
        # The server was asked once per sample of its own: none went to the other's records.
        assert len(samples) == server.samples
    assert len(records) == len(_of(records, request_a)) + len(_of(records, request_b))
    # A's samples went on after B's close, and its final came after them.
    assert server_a.samples > after_close
    assert len(state.registry) == 0


async def test_sandbox_scope_of_each_servers_handle_stamps_its_own_identity(
    exporter: InMemorySpanExporter,
) -> None:
    """``sandbox_scope(handle)`` stamps the identity of the handle's own server's sandbox; a
    copy of a handle whose id two known sandboxes share gets the bare provider and id."""
    from opentelemetry.instrumentation.nemo_gym.sandbox import tracing

    state = _state(exporter)
    processor = tracing.install_span_processor(exporter.provider)  # type: ignore[attr-defined]
    assert processor is not None
    a = traced_provider(Server("a.example:8080", 11), state)
    b = traced_provider(Server("b.example:8080", 22), state)
    handle_a, handle_b = await a.create(SandboxSpec()), await b.create(SandboxSpec())
    tracer = exporter.provider.get_tracer("user code")  # type: ignore[attr-defined]
    with state.active():
        for name, handle in (
            ("for a", handle_a),
            ("for b", handle_b),
            ("for a copy", dataclasses.replace(handle_a)),
        ):
            with sandbox_scope(handle), tracer.start_as_current_span(name):
                pass
    await a.close(handle_a)
    await b.close(handle_b)
    await settled()
    processor.disable()
    [create_a, create_b] = _spans(exporter, "sandbox.create")
    assert _spans(exporter, "for a") == [identity(create_a[REQUEST_ID], NAME, SAME_ID)]
    assert _spans(exporter, "for b") == [identity(create_b[REQUEST_ID], NAME, SAME_ID)]
    assert _spans(exporter, "for a copy") == [{PREFIX + "provider": NAME, PREFIX + "id": SAME_ID}]


async def test_connect_to_a_sandbox_open_in_this_process_stays_that_sandbox(
    exporter: InMemorySpanExporter,
) -> None:
    """A connect to a sandbox this process already has open gives a second handle to the
    same sandbox: the connect and its exec spans carry the create's identity, no second
    allocation read or sampler starts, and the first close ends the one sampler with one
    final; the other handle's later calls carry the bare provider and id."""
    state = _state(exporter)
    server = Server("a.example:8080", 11)
    provider = traced_provider(server, state)
    created = await provider.create(SandboxSpec())
    await server.sampled_beyond(0)
    connected = await provider.connect({"sandbox_id": SAME_ID})
    assert connected is not created
    await provider.exec(connected, "true")
    await provider.exec(created, "true")
    assert len(state.registry) == 1
    await provider.close(connected)
    await settled()
    await provider.exec(created, "true")
    await provider.close(created)
    await settled()

    [create] = _spans(exporter, "sandbox.create")
    known = identity(create[REQUEST_ID], NAME, SAME_ID)
    assert _spans(exporter, "sandbox.connect") == [known]
    bare = {PREFIX + "provider": NAME, PREFIX + "id": SAME_ID}
    code = {PREFIX + "exec.return_code": 11}
    assert _spans(exporter, "sandbox.exec") == [
        {**known, **code},
        {**known, **code},
        {**bare, **code},
    ]
    assert _spans(exporter, "sandbox.close") == [known, bare]
    records = [attributes_of(r) for r in _records(exporter)]
    assert all(r[REQUEST_ID] == create[REQUEST_ID] for r in records)
    assert [r[KIND] for r in records].count("allocation") == 1
    assert [r[FINAL] for r in records].count(True) == 1
    assert records[-1][FINAL] is True
    assert len([r for r in records if r[KIND] == "sample"]) == server.samples
    assert server.closed == 2  # both closes reached the provider, as without us
    assert len(state.registry) == 0


async def test_nemo_gym_own_sampler_takes_over_only_its_own_servers_sandbox(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NeMo Gym's own sampler over one server's sandbox takes over that sandbox's samples
    only: ours for it ends with its final, ours for the other server's sandbox with the same
    id samples on until its close."""
    from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

    module = stand_in_sampler_module()
    monkeypatch.setitem(sys.modules, NEMO_GYM_SAMPLER_MODULE, module)
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL", "0.05")
    instrumentor = NemoGymInstrumentor()
    instrumentor.uninstrument()
    instrumentor.instrument(
        tracer_provider=exporter.provider,  # type: ignore[attr-defined]
        connection_pool=False,
    )
    server_a, server_b = Server("a.example:8080", 11), Server("b.example:8080", 22)
    try:
        a, b = traced_provider(server_a), traced_provider(server_b)
        handle_a, handle_b = await a.create(SandboxSpec()), await b.create(SandboxSpec())
        await server_a.sampled_beyond(0)
        await server_b.sampled_beyond(0)
        attributes = {PREFIX + "provider": NAME, PREFIX + "id": SAME_ID}
        theirs = module.ResourceSampler(server_b, handle_b, attributes, 3600)
        theirs.start()
        assert theirs.task is not None

        def our_finals() -> list[dict[str, Any]]:
            return [attributes_of(r) for r in _records(exporter) if (r.attributes or {})[FINAL]]

        [yielded] = await eventually(our_finals, "our final sample of B's sandbox", BOUND_S)
        b_samples = server_b.samples
        await server_a.sampled_beyond(server_a.samples + 1)  # A samples on
        await theirs.stop()  # NeMo Gym's final: one more answer of B's server
        await b.close(handle_b)
        await a.close(handle_a)
        await settled()
    finally:
        instrumentor.uninstrument()
    [create_a, create_b] = _spans(exporter, "sandbox.create")
    assert yielded[REQUEST_ID] == create_b[REQUEST_ID]
    assert yielded[PIDS] == 22
    # Nothing of ours asked B's server after it yielded (NeMo Gym's sampler owned it).
    assert server_b.samples == b_samples + 1
    records = [attributes_of(r) for r in _records(exporter)]
    finals = [r[REQUEST_ID] for r in records if r[FINAL]]
    assert finals == [create_b[REQUEST_ID], create_a[REQUEST_ID]]
    a_samples = [r for r in _of(records, create_a[REQUEST_ID]) if r[KIND] == "sample"]
    assert len(a_samples) == server_a.samples
