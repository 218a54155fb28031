"""Telemetry fixtures and a provider of the tests' own, for the tests of NeMo Gym's sandbox
API under ``NemoGymInstrumentor`` (``test_nemo_gym_tracing.py``, ``test_nemo_gym_fleet.py``).

``telemetry`` is parametrized: the SDK providers with in-memory exporters installed as the
global ones, or passed explicitly to ``instrument()`` while other SDK providers are global
(which must stay empty: ``Telemetry.assert_nothing_elsewhere``). ``instrumented`` instruments
the sandbox half for it. ``CappedProvider`` is registered with NeMo Gym by ``register``.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.test.globals_test import reset_metrics_globals, reset_trace_globals

from nemo_gym_support import nemo_gym_sandbox
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym import _providers as hook
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ComponentAllocation,
    ResourceAllocation,
    ResourceDesignator,
)
from waiting import eventually

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


@pytest.fixture(name="telemetry", params=["global", "explicit"])
def telemetry_fixture(
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


@pytest.fixture(name="instrumented")
def instrumented_fixture(telemetry: Telemetry) -> Iterator[NemoGymInstrumentor]:
    """The instrumentor, instrumented for ``telemetry`` (sandbox half only) for the test."""
    nemo_gym_sandbox()  # skip (fail under CI=true) without the wheel
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

    def both_exported() -> list[dict[str, Any]]:
        found = [
            attrs(s)
            for s in telemetry.finished("sandbox.resources")
            if attrs(s).get(SANDBOX_ID) == sandbox_id
        ]
        kinds = {(r[KIND], r[FINAL]) for r in found}
        return found if ("allocation", False) in kinds and ("sample", True) in kinds else []

    return await eventually(
        both_exported,
        f"an allocation record and a final sample for sandbox {sandbox_id}",
        timeout=60,
        interval=0.1,
    )


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
