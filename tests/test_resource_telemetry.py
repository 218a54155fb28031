"""Resource records: attribute building, the sampler's lifecycle, and when sampling is on."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.test.globals_test import reset_trace_globals

from opentelemetry.instrumentation.nemo_gym._shared import _settings
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    ContainerResourceAmounts,
    SandboxHandle,
    SandboxResourceAmounts,
    SandboxResources,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    Attribute,
    ComponentAllocation,
    ResourceAllocation,
    ResourceDesignator,
    ResourceProvider,
    ResourceSampler,
    allocation_attributes,
    amount_attributes,
    record_request,
    requested_attributes,
    sampling_interval,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import SandboxSpanProcessor
from span_support import ERROR, settled
from span_support import record as recorded

INTERVAL_VARIABLE = "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL"

ALLOCATION = ResourceAllocation(
    source="test",
    components=(
        ComponentAllocation(
            "main",
            requests=SandboxResourceAmounts(cpu=0.25),
            limits=SandboxResourceAmounts(cpu=0.5, memory_mib=64),
        ),
    ),
    designator=ResourceDesignator("cgroup", "/nemo_gym/x", "boot-1"),
    host=ResourceDesignator("host", "node-a"),
)


class FakeResources:
    """A real ResourceProvider whose answers and failures the test controls.

    ``hang`` makes every call wait for an hour; ``hang_calls`` makes only those sample calls
    (numbered from 1) wait. ``sample_called(n)`` returns once the n-th sample call has begun:
    the test waits on the provider being asked, never on the clock.
    """

    def __init__(self) -> None:
        self.samples = 0
        self.sample_calls = 0
        self.fail: BaseException | None = None
        self.hang = False
        self.hang_calls: set[int] = set()
        self.ignore_cancel = False
        self._asked = asyncio.Condition()

    async def sample_called(self, count: int) -> None:
        """Return once ``count`` sample calls have begun; fail after 30 s."""
        async with asyncio.timeout(30), self._asked:
            await self._asked.wait_for(lambda: self.sample_calls >= count)

    async def _answer(self, hang: bool = False) -> None:
        if self.hang or hang:
            if self.ignore_cancel:
                # Swallows the first cancellation, as a badly written provider might.
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    await asyncio.sleep(3600)
            await asyncio.sleep(3600)
        if self.fail is not None:
            raise self.fail

    async def resource_allocation(self, handle: SandboxHandle) -> ResourceAllocation:
        await self._answer()
        return ALLOCATION

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Attribute]:
        async with self._asked:
            self.sample_calls += 1
            self._asked.notify_all()
        await self._answer(self.sample_calls in self.hang_calls)
        self.samples += 1
        # One key without the prefix, one that tries to override the identity.
        return {"usage.pids": self.samples, PREFIX + "id": "spoofed"}


def handle(sandbox_id: str = "sbx-1") -> SandboxHandle:
    return SandboxHandle(sandbox_id=sandbox_id, provider_name="fake", raw=None)


IDENTITY: dict[str, Attribute] = {PREFIX + "provider": "fake", PREFIX + "id": "sbx-1"}


def records(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == "sandbox.resources"]


def attrs(span: ReadableSpan) -> dict[str, object]:
    return dict(span.attributes or {})


# --- attribute building ---------------------------------------------------------------------


def test_requested_attributes_absent_values_omitted_and_listed() -> None:
    """Absent quantities are left out, never written as 0, and named in `unspecified`."""
    got = requested_attributes(SandboxSpec(resources={"cpu": 0.5}))
    assert got == {
        PREFIX + "requested.cpu": 0.5,
        PREFIX + "requested.unspecified": ("memory_mib", "disk_gib", "gpu", "gpu_type"),
    }
    assert 0 not in got.values()


def test_requested_attributes_fully_specified_has_no_unspecified_list() -> None:
    """A fully declared shape yields every key and no `unspecified` list."""
    spec = SandboxSpec(
        resources=SandboxResources(cpu=2, memory_mib=512, disk_gib=10, gpu=1, gpu_type="a100")
    )
    assert requested_attributes(spec) == {
        PREFIX + "requested.cpu": 2.0,
        PREFIX + "requested.memory_mib": 512,
        PREFIX + "requested.disk_gib": 10,
        PREFIX + "requested.gpu": 1,
        PREFIX + "requested.gpu_type": "a100",
    }


def test_requested_attributes_duck_typed_resources() -> None:
    """A nemo_gym-style resources object (any attributes of the same names) is read alike."""

    @dataclass
    class NemoResources:
        cpu: float | None = None
        memory_mib: int | None = 256
        disk_gib: int | None = None
        gpu: int | None = None
        gpu_type: str | None = None

    @dataclass
    class NemoSpec:
        resources: NemoResources

    got = requested_attributes(NemoSpec(NemoResources()))  # type: ignore[arg-type]
    assert got[PREFIX + "requested.memory_mib"] == 256
    assert got[PREFIX + "requested.unspecified"] == ("cpu", "disk_gib", "gpu", "gpu_type")


def test_requested_attributes_invalid_duck_typed_value_raises() -> None:
    """A negative quantity in a duck-typed spec raises ValueError naming the field."""

    @dataclass
    class NemoSpec:
        resources: dict[str, object]

    with pytest.raises(ValueError, match="cpu"):
        requested_attributes(NemoSpec({"cpu": -1}))  # type: ignore[arg-type]


def test_amount_attributes_uses_given_prefix() -> None:
    """Keys are the prefix plus the quantity name; absent ones are listed under the prefix."""
    got = amount_attributes(SandboxResourceAmounts(memory_mib=64, gpu=0), "p.")
    assert got == {"p.memory_mib": 64, "p.gpu": 0, "p.unspecified": ("cpu", "disk_gib")}


def test_amount_attributes_container_pids_limit() -> None:
    """A container's pids limit is ``prefix + "pids"``; unset, it is listed as unspecified."""
    limited = ContainerResourceAmounts(cpu=0.5, memory_mib=64, pids=32)
    assert amount_attributes(limited, "p.") == {
        "p.cpu": 0.5,
        "p.memory_mib": 64,
        "p.pids": 32,
        "p.unspecified": ("disk_gib", "gpu"),
    }
    assert amount_attributes(ContainerResourceAmounts(cpu=0.5), "p.") == {
        "p.cpu": 0.5,
        "p.unspecified": ("memory_mib", "disk_gib", "gpu", "pids"),
    }
    everything = ContainerResourceAmounts(cpu=1.0, memory_mib=1, disk_gib=2, gpu=0, pids=4096)
    assert amount_attributes(everything, "p.") == {
        "p.cpu": 1.0,
        "p.memory_mib": 1,
        "p.disk_gib": 2,
        "p.gpu": 0,
        "p.pids": 4096,
    }


def test_allocation_attributes_pids_only_in_container_limits() -> None:
    """Only the container limits mention pids; shared-quantity requests never do."""
    allocation = ResourceAllocation(
        source="test",
        components=(
            ComponentAllocation(
                "container",
                requests=SandboxResourceAmounts(memory_mib=32),
                limits=ContainerResourceAmounts(memory_mib=64),
            ),
        ),
    )
    base = PREFIX + "allocation."
    assert allocation_attributes(allocation) == {
        base + "source": "test",
        base + "components": ("container",),
        base + "component.container.requests.memory_mib": 32,
        base + "component.container.requests.unspecified": ("cpu", "disk_gib", "gpu"),
        base + "component.container.limits.memory_mib": 64,
        base + "component.container.limits.unspecified": ("cpu", "disk_gib", "gpu", "pids"),
    }


def test_record_request_gives_distinct_identities() -> None:
    """Each call gives a fresh uuid4 hex request id and keeps the caller's attributes."""
    given = {PREFIX + "provider": "fake"}
    first = record_request(SandboxSpec(), given)
    second = record_request(SandboxSpec(), given)
    ids = [first[PREFIX + "request.id"], second[PREFIX + "request.id"]]
    assert ids[0] != ids[1]
    for request_id in ids:
        assert isinstance(request_id, str)
        assert uuid.UUID(hex=request_id).version == 4
        assert request_id == uuid.UUID(hex=request_id).hex
    assert first[PREFIX + "provider"] == "fake"
    assert given == {PREFIX + "provider": "fake"}
    assert first[PREFIX + "requested.unspecified"] == (
        "cpu",
        "memory_mib",
        "disk_gib",
        "gpu",
        "gpu_type",
    )


def test_record_request_keeps_an_existing_request_id() -> None:
    """A retry that passes its request id along keeps it."""
    got = record_request(SandboxSpec(), {PREFIX + "request.id": "abc"})
    assert got[PREFIX + "request.id"] == "abc"


def test_allocation_attributes_uses_identical_keys() -> None:
    """The typed allocation becomes the documented keys, absent amounts listed."""
    base = PREFIX + "allocation."
    assert allocation_attributes(ALLOCATION) == {
        base + "source": "test",
        base + "designator.kind": "cgroup",
        base + "designator.id": "/nemo_gym/x",
        base + "designator.scope": "boot-1",
        base + "host.kind": "host",
        base + "host.id": "node-a",
        base + "components": ("main",),
        base + "component.main.requests.cpu": 0.25,
        base + "component.main.requests.unspecified": ("memory_mib", "disk_gib", "gpu"),
        base + "component.main.limits.cpu": 0.5,
        base + "component.main.limits.memory_mib": 64,
        base + "component.main.limits.unspecified": ("disk_gib", "gpu"),
    }


def test_allocation_attributes_without_placement() -> None:
    """Without designator, host or components only the source and an empty name list remain."""
    assert allocation_attributes(ResourceAllocation(source="none")) == {
        PREFIX + "allocation.source": "none",
        PREFIX + "allocation.components": (),
    }


# --- the sampler ----------------------------------------------------------------------------


@pytest.fixture
def exporter(
    global_tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> InMemorySpanExporter:
    return span_exporter


def test_fake_resources_is_a_resource_provider() -> None:
    """The test's provider satisfies the runtime-checkable protocol."""
    assert isinstance(FakeResources(), ResourceProvider)


async def test_resource_sampler_samples_at_interval_then_one_final(
    exporter: InMemorySpanExporter,
) -> None:
    """Samples arrive every interval, the identity winning over the provider's answer; stop()
    cuts the one in flight short and adds one final sample, and a second stop() none."""
    provider = FakeResources()
    provider.hang_calls = {4}
    sampler = ResourceSampler(provider, handle(), IDENTITY, 0.1)
    sampler.start()
    assert sampler.task is not None
    await provider.sample_called(4)  # three periodic records have ended; the fourth waits
    await sampler.stop()
    await sampler.stop()
    pids = PREFIX + "usage.pids"
    assert [attrs(s) for s in records(exporter)] == [
        {**recorded(IDENTITY, "sample"), pids: 1},
        {**recorded(IDENTITY, "sample"), pids: 2},
        {**recorded(IDENTITY, "sample"), pids: 3},
        {**recorded(IDENTITY, "sample"), ERROR: "CancelledError"},
        {**recorded(IDENTITY, "sample", final=True), pids: 4},
    ]
    assert sampler.task is not None
    assert sampler.task.done()
    await settled()
    assert len(records(exporter)) == 5


async def test_resource_sampler_provider_error_becomes_record(
    exporter: InMemorySpanExporter,
) -> None:
    """A provider that raises yields records with resource.error and no exception."""
    provider = FakeResources()
    provider.fail = RuntimeError("daemon gone")
    provider.hang_calls = {2}
    sampler = ResourceSampler(provider, handle(), IDENTITY, 0.1)
    await sampler.record("allocation")
    sampler.start()
    await provider.sample_called(2)  # the first periodic record has failed and ended
    await sampler.stop()
    assert [attrs(s) for s in records(exporter)] == [
        {**recorded(IDENTITY, "allocation"), ERROR: "RuntimeError"},
        {**recorded(IDENTITY, "sample"), ERROR: "RuntimeError"},
        {**recorded(IDENTITY, "sample"), ERROR: "CancelledError"},  # the second, cut short
        {**recorded(IDENTITY, "sample", final=True), ERROR: "RuntimeError"},
    ]


async def test_resource_sampler_hanging_provider_does_not_delay_stop(
    exporter: InMemorySpanExporter,
) -> None:
    """A provider that hangs (even ignoring cancellation) keeps stop() bounded by the interval."""
    provider = FakeResources()
    provider.hang = True
    provider.ignore_cancel = True
    sampler = ResourceSampler(provider, handle(), IDENTITY, 0.2)
    sampler.start()
    await provider.sample_called(1)  # the first periodic record is waiting on the provider
    # Bounded by the 0.2 s provider timeout; the provider itself would hang for an hour.
    await asyncio.wait_for(sampler.stop(), 5)
    assert [attrs(s) for s in records(exporter)] == [
        {**recorded(IDENTITY, "sample"), ERROR: "CancelledError"},
        {**recorded(IDENTITY, "sample", final=True), ERROR: "TimeoutError"},
    ]


async def test_resource_sampler_stop_marks_record_cancelled_in_flight(
    exporter: InMemorySpanExporter,
) -> None:
    """A periodic record cut short by stop() says CancelledError; none is exported empty."""
    provider = FakeResources()
    provider.hang = True
    sampler = ResourceSampler(provider, handle(), IDENTITY, 0.2)
    sampler.start()
    await provider.sample_called(1)  # the first periodic record is waiting on the provider
    await sampler.stop()
    assert [attrs(s) for s in records(exporter)] == [
        {**recorded(IDENTITY, "sample"), ERROR: "CancelledError"},
        {**recorded(IDENTITY, "sample", final=True), ERROR: "TimeoutError"},
    ]


async def test_resource_sampler_second_sampler_starts_no_task(
    exporter: InMemorySpanExporter,
) -> None:
    """A second sampler for the same sandbox starts no task and records no final sample."""
    provider = FakeResources()
    owner = ResourceSampler(provider, handle(), IDENTITY, 0.1)
    borrowed = ResourceSampler(provider, handle(), IDENTITY, 0.1)
    owner.start()
    borrowed.start()
    assert owner.task is not None
    assert borrowed.task is None
    await borrowed.stop()
    assert records(exporter) == []
    await owner.stop()
    assert [attrs(s) for s in records(exporter)] == [
        {**recorded(IDENTITY, "sample", final=True), PREFIX + "usage.pids": 1}
    ]
    # The owner released the sandbox: a new sampler may own it.
    later = ResourceSampler(provider, handle(), IDENTITY, 0.1)
    later.start()
    assert later.task is not None
    await later.stop()


async def test_resource_sampler_interval_zero_has_no_task_but_final(
    exporter: InMemorySpanExporter,
) -> None:
    """With interval 0 there is no periodic task; stop() still records the final sample."""
    sampler = ResourceSampler(FakeResources(), handle(), IDENTITY, 0)
    sampler.start()
    assert sampler.task is None
    await sampler.stop()
    assert [attrs(s) for s in records(exporter)] == [
        {**recorded(IDENTITY, "sample", final=True), PREFIX + "usage.pids": 1}
    ]


async def test_resource_sampler_records_parent_to_creation_context(
    exporter: InMemorySpanExporter,
) -> None:
    """Records are children of the span current when the sampler was created."""
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("rollout") as parent:
        sampler = ResourceSampler(FakeResources(), handle(), IDENTITY, 0)
    with tracer.start_as_current_span("elsewhere"):
        await sampler.record("allocation")
    (record,) = records(exporter)
    assert record.parent is not None
    assert record.parent.span_id == parent.get_span_context().span_id
    assert attrs(record) == {
        **recorded(IDENTITY, "allocation"),
        **allocation_attributes(ALLOCATION),
    }


async def test_resource_sampler_unknown_kind_raises(exporter: InMemorySpanExporter) -> None:
    """A record kind other than allocation or sample is a ValueError naming it."""
    sampler = ResourceSampler(FakeResources(), handle(), IDENTITY, 0)
    with pytest.raises(ValueError, match="'usage'"):
        await sampler.record("usage")


async def test_resource_sampler_cancelled_caller_propagates(
    exporter: InMemorySpanExporter,
) -> None:
    """Cancelling a record in progress raises CancelledError to the canceller."""
    provider = FakeResources()
    provider.hang = True
    sampler = ResourceSampler(provider, handle(), IDENTITY, 10)
    task = asyncio.ensure_future(sampler.record("sample"))
    await provider.sample_called(1)  # the record is waiting on the provider
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class ScriptedSamples:
    """A ResourceProvider that answers the given samples in turn, awaiting or at once.

    With ``nowait`` it also offers ``resource_sample_nowait``, which answers the same script
    (``None`` where the script says so: the sampler then awaits ``resource_sample``); the
    calls of each kind are counted.
    """

    def __init__(self, samples: list[dict[str, Attribute] | None], nowait: bool = False) -> None:
        self._samples = list(samples)
        self.awaited = 0
        self.nowait_calls = 0
        if nowait:
            self.resource_sample_nowait = self._nowait

    async def resource_allocation(self, handle: SandboxHandle) -> ResourceAllocation:
        return ALLOCATION

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Attribute]:
        self.awaited += 1
        return self._samples.pop(0) or {}

    def _nowait(self, handle: SandboxHandle) -> dict[str, Attribute] | None:
        self.nowait_calls += 1
        if self._samples[0] is None:
            self._samples.pop(0)
            self._samples.insert(0, {"usage.pids": 99})  # what the awaited call answers
            return None
        return self._samples.pop(0)


PARTIAL = PREFIX + "resource.partial"


def usage(**figures: Attribute) -> dict[str, Attribute]:
    return {PREFIX + "usage." + k.replace("__", "."): v for k, v in figures.items()}


async def test_resource_sampler_leaves_out_unchanged_figures_between_whole_first_and_final(
    exporter: InMemorySpanExporter,
) -> None:
    """The first and the final sample are whole; one between carries the identity, kind,
    final and only the figures that changed, with resource.partial; one whose figures all
    changed is whole again."""
    first = {"usage.source": "cgroup.v2", "usage.cpu.time_s": 1.5, "usage.pids": 2}
    provider = ScriptedSamples(
        [
            first,
            {**first, "usage.cpu.time_s": 1.75},  # cpu changed
            {**first, "usage.cpu.time_s": 1.75},  # nothing changed
            {"usage.source": "proc", "usage.cpu.time_s": 2.0, "usage.pids": 3},  # all changed
            {"usage.source": "proc", "usage.cpu.time_s": 2.0, "usage.pids": 3},  # final
        ]
    )
    sampler = ResourceSampler(provider, handle(), IDENTITY, 0)
    for _ in range(4):
        await sampler.record("sample")
    await sampler.record("sample", final=True)
    assert [attrs(s) for s in records(exporter)] == [
        {**recorded(IDENTITY, "sample"), **usage(source="cgroup.v2", cpu__time_s=1.5, pids=2)},
        {**recorded(IDENTITY, "sample"), **usage(cpu__time_s=1.75), PARTIAL: True},
        {**recorded(IDENTITY, "sample"), PARTIAL: True},
        {**recorded(IDENTITY, "sample"), **usage(source="proc", cpu__time_s=2.0, pids=3)},
        {
            **recorded(IDENTITY, "sample", final=True),
            **usage(source="proc", cpu__time_s=2.0, pids=3),
        },
    ]


async def test_resource_sampler_whole_sample_every_sixth_and_when_a_figure_goes(
    exporter: InMemorySpanExporter,
) -> None:
    """Unchanged samples go whole every sixth record, and a sample that lost a figure the
    previous one had goes whole (a reader would take the absent figure as unchanged)."""
    steady = {"usage.memory_mib": 4.0, "usage.pids": 1}
    provider = ScriptedSamples([dict(steady) for _ in range(7)] + [{"usage.pids": 1}])
    sampler = ResourceSampler(provider, handle(), IDENTITY, 0)
    for _ in range(8):
        await sampler.record("sample")
    whole = {**recorded(IDENTITY, "sample"), **usage(memory_mib=4.0, pids=1)}
    partial = {**recorded(IDENTITY, "sample"), PARTIAL: True}
    assert [attrs(s) for s in records(exporter)] == [
        whole,
        partial,
        partial,
        partial,
        partial,
        partial,
        whole,  # the sixth after the last whole one
        {**recorded(IDENTITY, "sample"), **usage(pids=1)},  # memory_mib went: whole
    ]


async def test_resource_sampler_same_value_of_another_type_counts_as_changed(
    exporter: InMemorySpanExporter,
) -> None:
    """A figure whose value compares equal but whose type changed (1 to True, 2 to 2.0) is
    carried: a reader sees the type the provider gave."""
    provider = ScriptedSamples([{"usage.a": 1, "usage.b": 2}, {"usage.a": True, "usage.b": 2.0}])
    sampler = ResourceSampler(provider, handle(), IDENTITY, 0)
    await sampler.record("sample")
    await sampler.record("sample")
    assert [attrs(s) for s in records(exporter)] == [
        {**recorded(IDENTITY, "sample"), **usage(a=1, b=2)},
        {**recorded(IDENTITY, "sample"), **usage(a=True, b=2.0)},
    ]


async def test_resource_sampler_takes_nowait_sample_and_awaits_when_none(
    exporter: InMemorySpanExporter,
) -> None:
    """A provider's resource_sample_nowait answers samples without an awaited call; where it
    answers None the sampler awaits resource_sample; allocations are always awaited."""
    provider = ScriptedSamples([{"usage.pids": 1}, None, {"usage.pids": 5}], nowait=True)
    sampler = ResourceSampler(provider, handle(), IDENTITY, 0)
    await sampler.record("allocation")
    for _ in range(3):
        await sampler.record("sample")
    assert (provider.nowait_calls, provider.awaited) == (3, 1)
    assert [attrs(s) for s in records(exporter)] == [
        {**recorded(IDENTITY, "allocation"), **allocation_attributes(ALLOCATION)},
        {**recorded(IDENTITY, "sample"), **usage(pids=1)},
        {**recorded(IDENTITY, "sample"), **usage(pids=99)},
        {**recorded(IDENTITY, "sample"), **usage(pids=5)},
    ]


async def test_resource_sampler_nowait_failure_becomes_record(
    exporter: InMemorySpanExporter,
) -> None:
    """A resource_sample_nowait that raises yields a record with resource.error, as an
    awaited call's failure does, and nothing is raised."""

    class Failing(ScriptedSamples):
        def resource_sample_nowait(self, handle: SandboxHandle) -> dict[str, Attribute]:
            raise OSError("cgroup vanished")

    sampler = ResourceSampler(Failing([]), handle(), IDENTITY, 0)
    await sampler.record("sample")
    assert [attrs(s) for s in records(exporter)] == [
        {**recorded(IDENTITY, "sample"), ERROR: "OSError"}
    ]


def test_resource_sampler_attributes_are_a_copy() -> None:
    """The sampler keeps its own copy of the identity attributes."""
    given = dict(IDENTITY)
    sampler = ResourceSampler(FakeResources(), handle(), given, 1)
    given[PREFIX + "id"] = "changed"
    assert sampler.attributes == IDENTITY


# --- sampling_interval ----------------------------------------------------------------------


@pytest.fixture
def bare_globals() -> Iterator[None]:
    reset_trace_globals()
    yield
    reset_trace_globals()


def test_sampling_interval_zero_with_api_provider(
    bare_globals: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With only the API's proxy provider nothing is exported, so no sampling."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "5")
    assert sampling_interval() == 0


def test_sampling_interval_zero_without_exporting_processor(
    bare_globals: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SDK provider with no processor but ours (OTEL_TRACES_EXPORTER=none) means no sampling."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "5")
    provider = TracerProvider()
    provider.add_span_processor(SandboxSpanProcessor())
    trace.set_tracer_provider(provider)
    assert sampling_interval() == 0


def test_sampling_interval_zero_when_variable_is_zero(
    global_tracer_provider: TracerProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interval 0 turns sampling off even while spans are exported."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "0")
    assert sampling_interval() == 0


def test_sampling_interval_zero_when_sdk_disabled(
    global_tracer_provider: TracerProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_SDK_DISABLED=true turns sampling off."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "5")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert sampling_interval() == 0


def test_sampling_interval_positive_with_exporter(
    bare_globals: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real exporting processor beside ours turns sampling on at the configured interval."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "2.5")
    provider = TracerProvider()
    provider.add_span_processor(SandboxSpanProcessor())
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    trace.set_tracer_provider(provider)
    assert sampling_interval() == 2.5
    monkeypatch.delenv(INTERVAL_VARIABLE)
    assert sampling_interval() == 10.0


@pytest.fixture
def state_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The log as a fresh process sees it: the settings' once-only memo forgotten around it."""
    _settings._ONCE.reset()
    yield caplog
    _settings._ONCE.reset()


def _warnings_of_state(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == _settings.__name__ and r.levelno == logging.WARNING
    ]


def test_sampling_interval_below_floor_raised_without_instrumentor(
    global_tracer_provider: TracerProvider,
    monkeypatch: pytest.MonkeyPatch,
    state_warnings: pytest.LogCaptureFixture,
) -> None:
    """Without an instrumentor, an interval of 1e-9 s from the environment samples every 0.1 s."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "1e-9")
    assert sampling_interval() == 0.1
    assert sampling_interval() == 0.1
    assert _warnings_of_state(state_warnings) == [
        "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL='1e-9' is below the floor of 0.1 s; "
        "sampling every 0.1 s"
    ]


def test_sampling_interval_long_bad_value_cut_in_warning(
    global_tracer_provider: TracerProvider,
    monkeypatch: pytest.MonkeyPatch,
    state_warnings: pytest.LogCaptureFixture,
) -> None:
    """A 5,000-character bad interval is quoted by its first 64 characters and its length."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "x" * 5000)
    assert sampling_interval() == 10.0
    assert _warnings_of_state(state_warnings) == [
        f"OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL={'x' * 64!r}... (5000 characters) "
        "is not a finite number >= 0.0; using the default 10.0"
    ]
