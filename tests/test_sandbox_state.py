"""The sandbox state: explicit providers, suppression, records beside provider calls,
sampler ownership under cancellation, and no exception text in spans."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxExecResult,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    Attribute,
    ResourceAllocation,
    ResourceSampler,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import traced_provider
from span_support import (
    ERROR,
    FINAL,
    KIND,
    NOTHING_REQUESTED,
    PROC_USAGE,
    REQUEST_ID,
    SANDBOX_ID,
    UNSPECIFIED,
    UUID4_HEX,
    attributes_of,
    identity,
    process_allocation,
    record,
    settled,
)

INTERVAL_VARIABLE = "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL"
SECRET = "hunter2-sk-live-4242"


def names(exporter: InMemorySpanExporter) -> list[str]:
    return [s.name for s in exporter.get_finished_spans()]


def records(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == "sandbox.resources"]


def span_texts(span: ReadableSpan) -> list[str]:
    """Every piece of text a span would export: attributes, events, status description."""
    texts = [str(v) for v in (span.attributes or {}).values()]
    for event in span.events:
        texts.append(event.name)
        texts += [str(v) for v in (event.attributes or {}).values()]
    texts.append(str(span.status.description))
    return texts


@dataclass
class Handle:
    sandbox_id: str
    provider_name: str
    raw: Any = None


class HangingResources:
    """A duck-typed provider whose resource reads wait on events the test controls."""

    name = "hanging"

    def __init__(self) -> None:
        self.answer_allocation = asyncio.Event()
        self.answer_sample = asyncio.Event()
        self.sample_asked = asyncio.Event()
        self.closed: list[str] = []
        self.created = 0

    async def create(self, spec: Any) -> Handle:
        self.created += 1
        return Handle(f"h-{self.created}", self.name)

    async def close(self, handle: Any) -> None:
        self.closed.append(handle.sandbox_id)

    async def aclose(self) -> None:
        return None

    async def resource_allocation(self, handle: Any) -> ResourceAllocation:
        await self.answer_allocation.wait()
        return ResourceAllocation(source="hanging")

    async def resource_sample(self, handle: Any) -> dict[str, Attribute]:
        self.sample_asked.set()
        await self.answer_sample.wait()
        return {"usage.pids": 1}


@pytest.fixture
def exporting(
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> InMemorySpanExporter:
    """The global provider exports; samples every 10 s (longer than any caller bound here)."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "10")
    return span_exporter


@pytest.fixture
def own_provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """An SDK tracer provider that is NOT the global one, with its own exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


# --- explicit providers and suppression ----------------------------------------------------


async def test_traced_provider_uses_the_instrumentors_tracer_provider(
    own_provider: tuple[TracerProvider, InMemorySpanExporter],
    process: ProcessSandboxProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With instrument(tracer_provider=tp) every sandbox span and record goes to tp, and tp
    (not the global proxy, which exports nothing) decides that records are made."""
    from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

    monkeypatch.setenv(INTERVAL_VARIABLE, "10")
    tp, exporter = own_provider
    instrumentor = NemoGymInstrumentor()
    instrumentor.uninstrument()
    instrumentor.instrument(tracer_provider=tp, connection_pool=False)
    try:
        traced = traced_provider(process)
        handle = await traced.create(SandboxSpec())
        await traced.exec(handle, "exit 0")
        await traced.close(handle)
    finally:
        instrumentor.uninstrument()
    got = names(exporter)
    assert [n for n in got if n != "sandbox.resources"] == [
        "sandbox.create",
        "sandbox.exec",
        "sandbox.close",
    ]
    calls = [s for s in exporter.get_finished_spans() if s.name != "sandbox.resources"]
    known = identity(
        attributes_of(calls[0])[REQUEST_ID], "process", handle.sandbox_id, isolation="bwrap"
    )
    assert [attributes_of(s) for s in calls] == [
        {**known, REQUEST_ID: UUID4_HEX, UNSPECIFIED: NOTHING_REQUESTED},
        {**known, PREFIX + "exec.return_code": 0},
        known,
    ]
    assert sorted((attributes_of(r) for r in records(exporter)), key=lambda r: str(r[KIND])) == [
        {**record(known, "allocation"), **process_allocation()},
        {**record(known, "sample", final=True), **PROC_USAGE},
    ]
    scopes = {
        s.instrumentation_scope.name
        for s in exporter.get_finished_spans()
        if s.instrumentation_scope
    }
    assert scopes == {"opentelemetry.instrumentation.nemo_gym"}


async def test_traced_provider_inside_suppress_instrumentation_passes_through(
    exporting: InMemorySpanExporter, process: ProcessSandboxProvider
) -> None:
    """Inside suppress_instrumentation() create, exec and close make no span and no record."""
    traced = traced_provider(process)
    with suppress_instrumentation():
        handle = await traced.create(SandboxSpec())
        result = await traced.exec(handle, "exit 5")
        await traced.close(handle)
    await settled()
    assert result.return_code == 5
    assert exporting.get_finished_spans() == ()


# --- records beside provider calls ---------------------------------------------------------


async def test_traced_create_returns_while_allocation_read_hangs(
    exporting: InMemorySpanExporter,
) -> None:
    """A hung resource_allocation does not hold create back: the caller's own 2 s bound holds,
    and the allocation record appears once the provider answers."""
    inner = HangingResources()
    traced = traced_provider(inner)
    handle = await asyncio.wait_for(traced.create(SandboxSpec()), 2)
    assert handle.sandbox_id == "h-1"
    assert not inner.answer_allocation.is_set()
    inner.answer_allocation.set()
    inner.answer_sample.set()
    await asyncio.wait_for(traced.close(handle), 2)
    await settled()  # the allocation task ends a few loop turns after its answer
    (create,) = [s for s in exporting.get_finished_spans() if s.name == "sandbox.create"]
    known = identity(attributes_of(create)[REQUEST_ID], "hanging", "h-1")
    assert sorted((attributes_of(r) for r in records(exporting)), key=lambda r: str(r[KIND])) == [
        {
            **record(known, "allocation"),
            PREFIX + "allocation.source": "hanging",
            PREFIX + "allocation.components": (),
        },
        {**record(known, "sample", final=True), PREFIX + "usage.pids": 1},
    ]


async def test_traced_close_calls_provider_close_while_final_sample_hangs(
    exporting: InMemorySpanExporter,
) -> None:
    """A hung resource_sample neither prevents nor outlasts the provider's close: close is
    called, the caller's 2 s bound holds, and the sample is still waiting afterwards."""
    inner = HangingResources()
    inner.answer_allocation.set()
    traced = traced_provider(inner)
    handle = await traced.create(SandboxSpec())
    await asyncio.wait_for(traced.close(handle), 2)
    assert inner.closed == ["h-1"]
    assert inner.sample_asked.is_set()
    assert not inner.answer_sample.is_set()
    (close,) = [s for s in exporting.get_finished_spans() if s.name == "sandbox.close"]
    assert close.status.status_code is StatusCode.UNSET


async def test_traced_close_cancelled_caller_propagates(exporting: InMemorySpanExporter) -> None:
    """Cancelling close() while the final sample runs raises CancelledError in the caller."""
    inner = HangingResources()
    inner.answer_allocation.set()
    traced = traced_provider(inner)
    handle = await traced.create(SandboxSpec())
    closing = asyncio.ensure_future(traced.close(handle))
    await inner.sample_asked.wait()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    inner.answer_sample.set()


# --- sampler ownership under cancellation ----------------------------------------------------


class CountingResources:
    """Answers at once; counts the samples it gave."""

    def __init__(self) -> None:
        self.samples = 0

    async def resource_allocation(self, handle: Any) -> ResourceAllocation:
        return ResourceAllocation(source="counting")

    async def resource_sample(self, handle: Any) -> dict[str, Attribute]:
        self.samples += 1
        return {"usage.pids": 1}


async def test_resource_sampler_cancelled_stop_storm_leaks_no_owner(
    exporting: InMemorySpanExporter,
) -> None:
    """200 stops, each cancelled while it waits for its periodic task to end: retried stops
    complete, each sandbox gets exactly one final sample, and new samplers can own every
    sandbox again."""
    provider = CountingResources()
    handles = [Handle(f"s-{i}", "counting") for i in range(200)]
    samplers = [ResourceSampler(provider, h, {PREFIX + "id": h.sandbox_id}, 10) for h in handles]
    for sampler in samplers:
        sampler.start()
        assert sampler.task is not None
    stops = [asyncio.ensure_future(s.stop()) for s in samplers]
    await asyncio.sleep(0)  # every stop has begun and is waiting
    for stop in stops:
        stop.cancel()
    outcomes = await asyncio.gather(*stops, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    await asyncio.gather(*(s.stop() for s in samplers))  # retried: each completes
    finals = sorted(
        (attributes_of(r) for r in records(exporting) if attributes_of(r)[FINAL]),
        key=lambda r: int(str(r[SANDBOX_ID]).removeprefix("s-")),
    )
    later = [ResourceSampler(provider, h, {}, 10) for h in handles]
    for sampler in later:
        sampler.start()
    assert sum(s.task is not None for s in later) == 200
    assert finals == [
        {SANDBOX_ID: h.sandbox_id, KIND: "sample", FINAL: True, PREFIX + "usage.pids": 1}
        for h in handles
    ]
    await asyncio.gather(*(s.stop() for s in later))
    from opentelemetry.instrumentation.nemo_gym.sandbox._state import current_state

    # This test's sandboxes only: the registry is the process's, and an earlier test may
    # leave a sandbox of its own open in it.
    registry = current_state().registry
    assert [h.sandbox_id for h in handles if ("counting", None, h.sandbox_id) in registry] == []


# --- no exception text in spans or warnings --------------------------------------------------


class LeakyProvider:
    """A provider whose errors quote the caller's input, as real ones do."""

    name = "leaky"

    async def create(self, spec: Any) -> Handle:
        return Handle("l-1", self.name)

    async def exec(self, handle: Any, command: str, **kwargs: Any) -> SandboxExecResult:
        raise RuntimeError(f"exec {command!r} failed with env {kwargs.get('env')!r}")

    async def close(self, handle: Any) -> None:
        return None

    async def resource_allocation(self, handle: Any) -> ResourceAllocation:
        raise ValueError(f"cannot read allocation: password={SECRET}")

    async def resource_sample(self, handle: Any) -> dict[str, Attribute]:
        raise ValueError(f"cannot sample: token={SECRET}")


async def test_traced_provider_failed_call_span_has_no_exception_text(
    exporting: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    """A provider error quoting the command and env reaches the caller unchanged, while its
    span and every warning carry only the exception's type."""
    traced = traced_provider(LeakyProvider())
    handle = await traced.create(SandboxSpec())
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match=SECRET):
        await traced.exec(handle, f"echo {SECRET}", env={"TOKEN": SECRET})
    with caplog.at_level(logging.WARNING):
        await traced.close(handle)
    (exec_span,) = [s for s in exporting.get_finished_spans() if s.name == "sandbox.exec"]
    assert exec_span.status.status_code is StatusCode.ERROR
    assert exec_span.status.description == "RuntimeError"
    known = identity(attributes_of(exec_span)[REQUEST_ID], "leaky", "l-1")
    assert attributes_of(exec_span) == {
        **known,
        REQUEST_ID: UUID4_HEX,
        "error.type": "RuntimeError",
    }
    for span in exporting.get_finished_spans():
        assert not any(SECRET in text for text in span_texts(span)), span.name
    assert [attributes_of(r) for r in records(exporting)] == [
        {**record(known, "allocation"), ERROR: "ValueError"},
        {**record(known, "sample", final=True), ERROR: "ValueError"},
    ]
    assert not [r for r in caplog.records if SECRET in r.getMessage()]


async def test_process_exec_with_os_environ_keeps_it_out_of_spans(
    exporting: InMemorySpanExporter,
    process: ProcessSandboxProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """exec(env=os.environ) works (any mapping), and a refused provider_options password
    stays out of every span."""
    monkeypatch.setenv("NEMO_GYM_TEST_SECRET", SECRET)
    traced = traced_provider(process)
    handle = await traced.create(SandboxSpec())
    result = await traced.exec(handle, 'test -n "$NEMO_GYM_TEST_SECRET"', env=os.environ)
    assert result.return_code == 0
    await traced.close(handle)
    with pytest.raises(ValueError, match="provider_options") as refused:
        await traced.create(SandboxSpec(provider_options={"password": SECRET}))
    assert SECRET not in str(refused.value)
    for span in exporting.get_finished_spans():
        assert not any(SECRET in text for text in span_texts(span)), span.name


def test_sandbox_state_tracer_kept_per_provider_follows_global_replacement() -> None:
    """A state on the global provider keeps one tracer while that provider stays, and takes
    the new provider's tracer once the global one is replaced, so records go where spans go."""
    from opentelemetry import trace
    from opentelemetry.test.globals_test import reset_trace_globals

    from opentelemetry.instrumentation.nemo_gym.sandbox._state import SandboxState

    state = SandboxState()
    first, second = InMemorySpanExporter(), InMemorySpanExporter()
    reset_trace_globals()
    try:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(first))
        trace.set_tracer_provider(provider)
        assert state.tracer is state.tracer
        state.tracer.start_span("one").end()
        reset_trace_globals()
        replacement = TracerProvider()
        replacement.add_span_processor(SimpleSpanProcessor(second))
        trace.set_tracer_provider(replacement)
        state.tracer.start_span("two").end()
    finally:
        reset_trace_globals()
    assert [s.name for s in first.get_finished_spans()] == ["one"]
    assert [s.name for s in second.get_finished_spans()] == ["two"]
