"""NeMo Gym's sandbox API under ``NemoGymInstrumentor``: spans, records and fleet metrics.

Against the installed ``nemo-gym`` wheel: ``AsyncSandbox`` and ``Sandbox`` with our providers
by registry name and with a provider class of the test's own registered with
``register_provider``; NeMo Gym's ``SandboxCreateError`` reaching the caller unchanged;
``instrument()`` before and after ``import nemo_gym.sandbox``; ``uninstrument()`` restoring
NeMo Gym's functions; a capped allocation reported as a mismatch; an OOM kill counted. Each
telemetry test runs twice: with the global providers, and with explicit ``tracer_provider=`` /
``meter_provider=`` while other global providers are installed (which must stay empty).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.test.globals_test import reset_metrics_globals, reset_trace_globals
from opentelemetry.trace import StatusCode

from conftest import require_service
from nemo_gym_support import nemo_gym_sandbox
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.sandbox import _nemo_gym_providers as hook
from opentelemetry.instrumentation.nemo_gym.sandbox._mismatch import LOGGER as MISMATCH_LOGGER
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ComponentAllocation,
    ResourceAllocation,
    ResourceDesignator,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
    TracedSandboxProvider,
    sandbox_scope,
)
from test_docker_provider import (  # the engine checks of the Docker provider's own tests
    SUITE_ID,
    SUITE_LABEL,
    _image,
    _socket,
    engine_ready,  # noqa: F401 - a fixture, used by name
)

SRC = str(Path(__file__).resolve().parents[1] / "src")
INTERVAL_VARIABLE = "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL"
REQUEST_ID, PROVIDER, SANDBOX_ID = PREFIX + "request.id", PREFIX + "provider", PREFIX + "id"
KIND, FINAL = PREFIX + "resource.kind", PREFIX + "resource.final"
MISMATCH = "nemo.gym.sandbox.allocation.mismatch."
CREATIONS, OOM_KILLS = "gym.sandbox.creations", "gym.sandbox.oom_kills"
MISMATCHES = "gym.sandbox.allocation.mismatches"
LIFECYCLE = (
    "sandbox.create",
    "sandbox.upload",
    "sandbox.exec",
    "sandbox.download",
    "sandbox.close",
)


# --- telemetry: the global providers, or explicit ones beside other global ones --------------


@dataclass
class Telemetry:
    """Where the instrumentation's spans and metrics must go, and where they must not."""

    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider
    instrument_kwargs: dict[str, Any]
    elsewhere_spans: InMemorySpanExporter | None = None
    elsewhere_reader: InMemoryMetricReader | None = None
    providers: list[Any] = field(default_factory=list)

    def finished(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if name is None or s.name == name]

    def points(self, name: str) -> dict[tuple[tuple[str, Any], ...], int]:
        """Metric ``name``'s data points: sorted attribute items -> value."""
        return metric_points(self.reader, name)

    def assert_nothing_elsewhere(self) -> None:
        """With explicit providers, the global ones received no span and no metric."""
        if self.elsewhere_spans is not None:
            assert self.elsewhere_spans.get_finished_spans() == ()
        if self.elsewhere_reader is not None:
            for name in (CREATIONS, OOM_KILLS, MISMATCHES):
                assert metric_points(self.elsewhere_reader, name) == {}


def metric_points(
    reader: InMemoryMetricReader, name: str
) -> dict[tuple[tuple[str, Any], ...], int]:
    found: dict[tuple[tuple[str, Any], ...], int] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        key = tuple(sorted((point.attributes or {}).items()))
                        found[key] = point.value  # type: ignore[union-attr]
    return found


def sdk_providers() -> tuple[
    TracerProvider, InMemorySpanExporter, MeterProvider, InMemoryMetricReader
]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    return tracer_provider, exporter, MeterProvider(metric_readers=[reader]), reader


@pytest.fixture(params=["global", "explicit"])
def telemetry(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Telemetry]:
    """SDK providers with in-memory exporters, global or passed explicitly to instrument()."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "0")  # no periodic samples: allocation + final only
    tracer_provider, exporter, meter_provider, reader = sdk_providers()
    reset_trace_globals()
    reset_metrics_globals()
    if request.param == "global":
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(meter_provider)
        made = Telemetry(
            exporter, reader, tracer_provider, {}, providers=[tracer_provider, meter_provider]
        )
    else:
        other_tracer, other_spans, other_meter, other_reader = sdk_providers()
        trace.set_tracer_provider(other_tracer)
        metrics.set_meter_provider(other_meter)
        made = Telemetry(
            exporter,
            reader,
            tracer_provider,
            {"tracer_provider": tracer_provider, "meter_provider": meter_provider},
            other_spans,
            other_reader,
            [tracer_provider, meter_provider, other_tracer, other_meter],
        )
    yield made
    for provider in made.providers:
        provider.shutdown()
    reset_trace_globals()
    reset_metrics_globals()


@pytest.fixture
def nemo_gym() -> ModuleType:
    return nemo_gym_sandbox()


@pytest.fixture
def instrumented(telemetry: Telemetry, nemo_gym: ModuleType) -> Iterator[NemoGymInstrumentor]:
    """The instrumentor, instrumented for ``telemetry`` (sandbox half only) for the test."""
    instrumentor = NemoGymInstrumentor()
    instrumentor.uninstrument()
    instrumentor.instrument(connection_pool=False, **telemetry.instrument_kwargs)
    yield instrumentor
    instrumentor.uninstrument()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def resource_records(telemetry: Telemetry, sandbox_id: str) -> list[dict[str, Any]]:
    """The sandbox's records once its allocation record and final sample are both exported.

    They run beside the caller and may finish after ``stop()`` returns on a loaded machine:
    waited for on the condition, bounded at 60 s.
    """
    for _ in range(600):
        found = [
            attrs(s)
            for s in telemetry.finished("sandbox.resources")
            if attrs(s).get(SANDBOX_ID) == sandbox_id
        ]
        kinds = {(r[KIND], r[FINAL]) for r in found}
        if ("allocation", False) in kinds and ("sample", True) in kinds:
            return found
        await asyncio.sleep(0.1)
    pytest.fail(f"no allocation record and final sample for sandbox {sandbox_id}")


def one(records: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [r for r in records if r[KIND] == kind and (kind == "allocation" or r[FINAL])]
    return found


# --- providers of the test's own, registered with NeMo Gym -----------------------------------


class CappedProvider:
    """A registered provider of the test's own, with the ResourceProvider methods: like a real
    provider that silently caps CPU, its allocation gives at most 0.5 CPU whatever is asked."""

    name = "capped"
    cpu_cap = 0.5
    create_error: BaseException | None = None

    def __init__(self, region: str = "local") -> None:
        self.region = region
        self.requested: dict[str, Any] = {}

    async def create(self, spec: Any) -> Any:
        if self.create_error is not None:
            raise self.create_error
        from nemo_gym.sandbox import SandboxHandle

        handle = SandboxHandle(sandbox_id=uuid.uuid4().hex, provider_name=self.name, raw=None)
        self.requested[handle.sandbox_id] = spec.resources
        return handle

    async def exec(self, handle: Any, command: str, **kwargs: Any) -> Any:
        from nemo_gym.sandbox import SandboxExecResult

        return SandboxExecResult(stdout=command, stderr="", return_code=0)

    async def upload_file(self, handle: Any, source_path: Path, target_path: str) -> None:
        return None

    async def download_file(self, handle: Any, source_path: str, target_path: Path) -> None:
        return None

    async def status(self, handle: Any) -> Any:
        from nemo_gym.sandbox import SandboxStatus

        return SandboxStatus.RUNNING

    async def close(self, handle: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def resource_allocation(self, handle: Any) -> ResourceAllocation:
        resources = self.requested[handle.sandbox_id]
        cpu = min(resources.cpu, self.cpu_cap) if resources and resources.cpu else None
        memory = resources.memory_mib if resources else None
        return ResourceAllocation(
            source="capped",
            components=(ComponentAllocation("main", limits={"cpu": cpu, "memory_mib": memory}),),
            designator=ResourceDesignator("vm", handle.sandbox_id, self.region),
        )

    async def resource_sample(self, handle: Any) -> dict[str, Any]:
        return {"usage.cpu.time_s": 0.25, "usage.source": "capped"}


def register(nemo_gym: ModuleType, cls: type = CappedProvider) -> str:
    """Register ``cls`` under a fresh name (NeMo Gym's registry has no removal)."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    nemo_gym.register_provider(name, cls)
    return name


def holders() -> dict[str, Any]:
    """What each module that binds ``create_provider`` holds now."""
    return {name: sys.modules[name].create_provider for name in hook.PATCHED_MODULES}


# --- AsyncSandbox / Sandbox with our providers and the test's own -----------------------------


@pytest.mark.usefixtures("instrumented")
async def test_async_sandbox_otel_process_one_span_per_call(
    telemetry: Telemetry, nemo_gym: ModuleType, tmp_path: Path
) -> None:
    """AsyncSandbox with our process provider by name: one span per call (the provider's class
    is already traced, NeMo Gym's hook adds nothing), one identity throughout, the records,
    and one ``created`` count."""
    spec = nemo_gym.SandboxSpec(files={"in.txt": "payload"})
    config = {"otel_process": {"cgroups": False, "base_dir": str(tmp_path)}}
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        assert type(sandbox._provider) is ProcessSandboxProvider
        await sandbox.start()
        assert (await sandbox.exec("cat in.txt")).stdout == "payload"
        await sandbox.download("in.txt", tmp_path / "back.txt")
        sandbox_id = sandbox._handle.sandbox_id
    records = await resource_records(telemetry, sandbox_id)
    lifecycle = [s for s in telemetry.finished() if s.name in LIFECYCLE]
    assert [s.name for s in lifecycle] == list(LIFECYCLE)
    (request_id,) = {attrs(s)[REQUEST_ID] for s in lifecycle}
    assert {attrs(s)[SANDBOX_ID] for s in lifecycle} == {sandbox_id}
    assert {attrs(s)[PROVIDER] for s in lifecycle} == {"process"}
    assert attrs(lifecycle[2])[PREFIX + "exec.return_code"] == 0
    assert {r[REQUEST_ID] for r in records} == {request_id}
    assert one(records, "allocation")[PREFIX + "allocation.source"] == "process"
    assert not [k for k in one(records, "allocation") if k.startswith(MISMATCH)]
    created = {
        (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "process")): 1
    }
    assert telemetry.points(CREATIONS) == created
    assert telemetry.points(MISMATCHES) == {}
    telemetry.assert_nothing_elsewhere()


@pytest.mark.usefixtures("instrumented")
async def test_registered_provider_traced_capped_cpu_reported(
    telemetry: Telemetry, nemo_gym: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """A provider class registered with register_provider and built by create_provider is
    traced like ours, sandbox scope included; its CPU capped below the request is in each
    allocation record, logged once for the provider and resource, and counted per sandbox."""
    provider = nemo_gym.create_provider({register(nemo_gym): {"region": "eu"}})
    assert isinstance(provider, TracedSandboxProvider)
    assert isinstance(provider.wrapped, CappedProvider)
    assert provider.region == "eu"
    spec = nemo_gym.SandboxSpec(resources=nemo_gym.SandboxResources(cpu=2.0, memory_mib=256))
    sandbox_ids = []
    with caplog.at_level(logging.WARNING, logger=MISMATCH_LOGGER.name):
        for _ in range(2):
            handle = await provider.create(spec)
            user_tracer = telemetry.tracer_provider.get_tracer("user-code")
            with sandbox_scope(handle), user_tracer.start_as_current_span("grade"):
                pass
            await provider.exec(handle, "echo hi")
            await provider.close(handle)
            sandbox_ids.append(handle.sandbox_id)
        allocations = [one(await resource_records(telemetry, i), "allocation") for i in sandbox_ids]
    await provider.aclose()

    assert [s.name for s in telemetry.finished() if s.name in LIFECYCLE] == [
        "sandbox.create",
        "sandbox.exec",
        "sandbox.close",
    ] * 2
    create = telemetry.finished("sandbox.create")[0]
    grade = telemetry.finished("grade")[0]
    assert attrs(grade)[REQUEST_ID] == attrs(create)[REQUEST_ID]
    assert attrs(grade)[SANDBOX_ID] == sandbox_ids[0]
    assert attrs(create)[PROVIDER] == "capped"
    assert attrs(create)[PREFIX + "requested.cpu"] == 2.0
    for allocation in allocations:
        assert allocation[MISMATCH + "resources"] == ("cpu",)
        assert allocation[MISMATCH + "cpu.kind"] == "below_request"
        assert allocation[MISMATCH + "cpu.requested"] == 2.0
        assert allocation[MISMATCH + "cpu.allocated"] == 0.5
        assert MISMATCH + "memory_mib.kind" not in allocation
        assert "container.id" not in allocation  # a VM, not a container
    warnings = [r.getMessage() for r in caplog.records if r.name == MISMATCH_LOGGER.name]
    assert len(warnings) == 1
    assert "'capped'" in warnings[0]
    assert "requested 2, allocated 0.5" in warnings[0]
    mismatch_key = (
        ("nemo.gym.sandbox.mismatch", "below_request"),
        ("nemo.gym.sandbox.provider", "capped"),
        ("nemo.gym.sandbox.resource", "cpu"),
    )
    assert telemetry.points(MISMATCHES) == {mismatch_key: 2}
    created = (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "capped"))
    assert telemetry.points(CREATIONS) == {created: 2}
    telemetry.assert_nothing_elsewhere()


@pytest.mark.usefixtures("instrumented")
async def test_async_sandbox_create_error_same_object_failed_span_counted(
    telemetry: Telemetry, nemo_gym: ModuleType
) -> None:
    """NeMo Gym's SandboxCreateError from a registered provider reaches AsyncSandbox's caller
    as the same object; the failed create span keeps the request identity and shape, and the
    failure is counted with its type."""
    error = nemo_gym.SandboxCreateError("quota exhausted for tenant 42")

    class Failing(CappedProvider):
        name = "failing"
        create_error = error

    spec = nemo_gym.SandboxSpec(resources={"cpu": 1.0})
    sandbox = nemo_gym.AsyncSandbox({register(nemo_gym, Failing): {}}, spec)
    with pytest.raises(nemo_gym.SandboxCreateError) as raised:
        await sandbox.start()
    assert raised.value is error
    await sandbox.stop()

    (create,) = telemetry.finished("sandbox.create")
    assert create.status.status_code is StatusCode.ERROR
    assert attrs(create)["error.type"] == "SandboxCreateError"
    assert len(str(attrs(create)[REQUEST_ID])) == 32
    assert attrs(create)[PROVIDER] == "failing"
    assert attrs(create)[PREFIX + "requested.cpu"] == 1.0
    assert "tenant 42" not in repr(attrs(create)) + repr(create.events)
    failed = (
        ("error.type", "SandboxCreateError"),
        ("nemo.gym.sandbox.outcome", "failed"),
        ("nemo.gym.sandbox.provider", "failing"),
    )
    assert telemetry.points(CREATIONS) == {failed: 1}
    telemetry.assert_nothing_elsewhere()


@pytest.mark.usefixtures("instrumented")
def test_sandbox_sync_registered_provider_traced(
    telemetry: Telemetry, nemo_gym: ModuleType
) -> None:
    """The synchronous Sandbox, which runs an AsyncSandbox on a loop thread of its own, is
    traced the same way."""
    with nemo_gym.Sandbox({register(nemo_gym): {}}, nemo_gym.SandboxSpec()) as sandbox:
        sandbox.start()
        assert sandbox.exec("pwd").stdout == "pwd"
    names = [s.name for s in telemetry.finished() if s.name in LIFECYCLE]
    assert names == ["sandbox.create", "sandbox.exec", "sandbox.close"]
    created = (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "capped"))
    assert telemetry.points(CREATIONS) == {created: 1}
    telemetry.assert_nothing_elsewhere()


@pytest.mark.usefixtures("instrumented")
async def test_async_sandbox_otel_process_without_cgroups_reports_no_limit(
    telemetry: Telemetry, nemo_gym: ModuleType, tmp_path: Path
) -> None:
    """Our process provider without cgroups enforces nothing: asked for CPU and memory, its
    allocation record says neither is limited, and both are counted."""
    spec = nemo_gym.SandboxSpec(resources={"cpu": 0.5, "memory_mib": 64})
    config = {"otel_process": {"cgroups": False, "base_dir": str(tmp_path)}}
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        await sandbox.start()
        sandbox_id = sandbox._handle.sandbox_id
    allocation = one(await resource_records(telemetry, sandbox_id), "allocation")
    assert allocation[MISMATCH + "resources"] == ("cpu", "memory_mib")
    assert allocation[MISMATCH + "cpu.kind"] == "no_limit"
    assert allocation[MISMATCH + "memory_mib.kind"] == "no_limit"
    assert allocation[MISMATCH + "memory_mib.requested"] == 64
    assert MISMATCH + "memory_mib.allocated" not in allocation
    assert telemetry.points(MISMATCHES) == {
        (
            ("nemo.gym.sandbox.mismatch", "no_limit"),
            ("nemo.gym.sandbox.provider", "process"),
            ("nemo.gym.sandbox.resource", resource),
        ): 1
        for resource in ("cpu", "memory_mib")
    }
    telemetry.assert_nothing_elsewhere()


@pytest.mark.usefixtures("instrumented")
async def test_async_sandbox_otel_process_oom_kill_counted(
    telemetry: Telemetry, nemo_gym: ModuleType, tmp_path: Path
) -> None:
    """A command outgrowing the sandbox's cgroup memory limit is OOM-killed; the final sample
    shows it and gym.sandbox.oom_kills counts exactly the kills it shows. The limit honours
    the request, so there is no mismatch."""
    require_service(
        ProcessSandboxProvider().cgroup_version is not None, "no writable cgroup hierarchy"
    )
    spec = nemo_gym.SandboxSpec(resources={"memory_mib": 48})
    config = {"otel_process": {"base_dir": str(tmp_path)}}
    hog = f"{sys.executable} -c \"b = b'x' * (200 * 1024 * 1024)\""
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        await sandbox.start()
        result = await sandbox.exec(hog, timeout_s=60)
        assert result.error_type == "oom_kill"
        sandbox_id = sandbox._handle.sandbox_id
    records = await resource_records(telemetry, sandbox_id)
    kills = one(records, "sample")[PREFIX + "usage.oom_kills"]
    assert kills >= 1
    assert (
        one(records, "allocation")[PREFIX + "allocation.component.sandbox.limits.memory_mib"] == 48
    )
    assert telemetry.points(OOM_KILLS) == {(("nemo.gym.sandbox.provider", "process"),): kills}
    assert telemetry.points(MISMATCHES) == {}
    telemetry.assert_nothing_elsewhere()


@pytest.mark.integration
@pytest.mark.usefixtures("instrumented", "engine_ready")
async def test_async_sandbox_otel_docker_container_identity(
    telemetry: Telemetry, nemo_gym: ModuleType
) -> None:
    """AsyncSandbox with our Docker provider by name, on Podman's service: one span per call,
    the allocation record carries container.id and container.runtime.name, no mismatch."""
    spec = nemo_gym.SandboxSpec(
        image=_image(),
        metadata={SUITE_LABEL: SUITE_ID},
        resources=nemo_gym.SandboxResources(cpu=0.5, memory_mib=96),
    )
    config = {"otel_docker": {"docker_host": f"unix://{_socket()}", "api_timeout_s": 15}}
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        await sandbox.start()
        assert (await sandbox.exec("echo ok")).stdout.strip() == "ok"
        sandbox_id = sandbox._handle.sandbox_id
    allocation = one(await resource_records(telemetry, sandbox_id), "allocation")
    names = [s.name for s in telemetry.finished() if s.name in LIFECYCLE]
    assert names == ["sandbox.create", "sandbox.exec", "sandbox.close"]
    assert allocation["container.id"] == sandbox_id
    assert allocation["container.runtime.name"] == "podman"
    assert not [k for k in allocation if k.startswith(MISMATCH)]
    created = (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "docker"))
    assert telemetry.points(CREATIONS) == {created: 1}
    assert telemetry.points(MISMATCHES) == {}
    telemetry.assert_nothing_elsewhere()


@pytest.mark.usefixtures("instrumented")
async def test_async_sandbox_inside_suppress_instrumentation_untraced_uncounted(
    telemetry: Telemetry, nemo_gym: ModuleType
) -> None:
    """Inside suppress_instrumentation a registered provider's calls make no span, no record
    and no count."""
    spec = nemo_gym.SandboxSpec(resources={"cpu": 4.0})
    with suppress_instrumentation():
        async with nemo_gym.AsyncSandbox({register(nemo_gym): {}}, spec) as sandbox:
            await sandbox.start()
            await sandbox.exec("true")
    await asyncio.sleep(0)
    assert telemetry.finished() == []
    for name in (CREATIONS, OOM_KILLS, MISMATCHES):
        assert telemetry.points(name) == {}


# --- instrument / uninstrument ----------------------------------------------------------------


async def test_uninstrument_restores_create_provider_and_silences_wrappers(
    telemetry: Telemetry, nemo_gym: ModuleType
) -> None:
    """uninstrument() puts NeMo Gym's create_provider back in every module, and a provider
    built while instrumented passes its calls straight through afterwards."""
    before = holders()
    instrumentor = NemoGymInstrumentor()
    instrumentor.uninstrument()
    instrumentor.instrument(connection_pool=False, **telemetry.instrument_kwargs)
    try:
        assert all(holders()[name] is not before[name] for name in before)
        name = register(nemo_gym)
        built_while_instrumented = nemo_gym.create_provider({name: {}})
        assert isinstance(built_while_instrumented, TracedSandboxProvider)
    finally:
        instrumentor.uninstrument()
    after = holders()
    assert all(after[module] is before[module] for module in before)
    assert type(nemo_gym.create_provider({name: {}})) is CappedProvider
    handle = await built_while_instrumented.create(nemo_gym.SandboxSpec(resources={"cpu": 2.0}))
    await built_while_instrumented.exec(handle, "true")
    await built_while_instrumented.close(handle)
    async with nemo_gym.AsyncSandbox({name: {}}, nemo_gym.SandboxSpec()) as sandbox:
        await sandbox.start()
    await asyncio.sleep(0)
    assert telemetry.finished() == []
    for metric in (CREATIONS, MISMATCHES):
        assert telemetry.points(metric) == {}


def test_fleet_metrics_made_once_per_meter_provider(
    telemetry: Telemetry, nemo_gym: ModuleType
) -> None:
    """Instrumenting again with the same meter provider counts into the same series."""
    instrumentor = NemoGymInstrumentor()
    name = register(nemo_gym)
    for _ in range(2):
        instrumentor.uninstrument()
        instrumentor.instrument(connection_pool=False, **telemetry.instrument_kwargs)
        try:
            with nemo_gym.Sandbox({name: {}}, nemo_gym.SandboxSpec()) as sandbox:
                sandbox.start()
        finally:
            instrumentor.uninstrument()
    created = (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "capped"))
    assert telemetry.points(CREATIONS) == {created: 2}


def run_python(code: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (nemo_gym not yet imported); its last stdout line
    is JSON."""
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", INTERVAL_VARIABLE: "0"},
    )
    assert completed.returncode == 0, completed.stderr
    result: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


_SUBPROCESS = """
    import asyncio, json, sys
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    class Fresh:
        name = "fresh"
        async def create(self, spec):
            from nemo_gym.sandbox import SandboxHandle
            return SandboxHandle("fresh-1", self.name, None)
        async def exec(self, handle, command, **kwargs):
            from nemo_gym.sandbox import SandboxExecResult
            return SandboxExecResult(stdout=command, stderr="", return_code=0)
        async def close(self, handle):
            return None
        async def aclose(self):
            return None

    async def use_sandbox(sandbox_module):
        sandbox_module.register_provider("fresh", Fresh)
        async with sandbox_module.AsyncSandbox({"fresh": {}}, sandbox_module.SandboxSpec()) as box:
            await box.start()
            await box.exec("true")

    def report(imported_first):
        creations = [
            point.value
            for rm in reader.get_metrics_data().resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
            if metric.name == "gym.sandbox.creations"
            for point in metric.data.data_points
        ]
        names = [s.name for s in exporter.get_finished_spans()]
        ids = {s.attributes.get("nemo.gym.sandbox.id") for s in exporter.get_finished_spans()}
        found = {"imported_first": imported_first, "names": names, "ids": sorted(ids)}
        print(json.dumps({**found, "creations": creations}))
"""


def test_instrument_before_import_nemo_gym_traces_async_sandbox(nemo_gym: ModuleType) -> None:
    """instrument() before nemo_gym is imported: the post-import hook still makes every
    AsyncSandbox call a span and counts the creation."""
    result = run_python(
        _SUBPROCESS
        + """
    NemoGymInstrumentor().instrument(connection_pool=False)
    imported_first = "nemo_gym" in sys.modules
    import nemo_gym.sandbox
    asyncio.run(use_sandbox(nemo_gym.sandbox))
    report(imported_first)
    """
    )
    assert result == {
        "imported_first": False,
        "names": ["sandbox.create", "sandbox.exec", "sandbox.close"],
        "ids": ["fresh-1"],
        "creations": [1],
    }


def test_instrument_after_import_nemo_gym_traces_async_sandbox(nemo_gym: ModuleType) -> None:
    """instrument() after nemo_gym is imported patches the modules already loaded."""
    result = run_python(
        _SUBPROCESS
        + """
    import nemo_gym.sandbox
    imported_first = "nemo_gym.sandbox.api" in sys.modules
    NemoGymInstrumentor().instrument(connection_pool=False)
    asyncio.run(use_sandbox(nemo_gym.sandbox))
    report(imported_first)
    """
    )
    assert result == {
        "imported_first": True,
        "names": ["sandbox.create", "sandbox.exec", "sandbox.close"],
        "ids": ["fresh-1"],
        "creations": [1],
    }
