"""NeMo Gym's sandbox API traced by ``NemoGymInstrumentor``, against the installed wheel.

``AsyncSandbox`` and ``Sandbox`` with our process provider by registry name and with a
provider class of the test's own registered with ``register_provider``; NeMo Gym's
``SandboxCreateError`` reaching the caller unchanged; ``suppress_instrumentation``;
``instrument()`` before and after ``import nemo_gym.sandbox``; ``uninstrument()`` restoring
NeMo Gym's functions. Each telemetry test runs with the global providers and with explicit
``tracer_provider=`` / ``meter_provider=`` (see ``nemo_gym_telemetry``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.trace import StatusCode

from nemo_gym_support import nemo_gym_sandbox
from nemo_gym_telemetry import (
    CREATIONS,
    INTERVAL_VARIABLE,
    LIFECYCLE,
    MISMATCH,
    MISMATCHES,
    OOM_KILLS,
    PROVIDER,
    REQUEST_ID,
    CappedProvider,
    Telemetry,
    attrs,
    holders,
    instrumented_fixture,  # noqa: F401 - a fixture, used by name
    register,
    resource_records,
    telemetry_fixture,  # noqa: F401 - a fixture, used by name
)
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
    TracedSandboxProvider,
    sandbox_scope,
)
from span_support import (
    KIND,
    NOTHING_REQUESTED,
    PROC_USAGE,
    UNSPECIFIED,
    UUID4_HEX,
    identity,
    process_allocation,
    record,
)
from waiting import settled

pytestmark = pytest.mark.nemo_gym  # also run on NeMo Gym main (nemo_gym_support)

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def nemo_gym() -> ModuleType:
    return nemo_gym_sandbox()


@pytest.mark.usefixtures("instrumented")
async def test_async_sandbox_otel_process_one_span_per_call(
    telemetry: Telemetry, nemo_gym: ModuleType, tmp_path: Path, sandbox_base_dir: Path
) -> None:
    """AsyncSandbox with our process provider by name: one span per call (the provider's class
    is already traced, NeMo Gym's hook adds nothing), one identity throughout, the records,
    and one ``created`` count."""
    spec = nemo_gym.SandboxSpec(files={"in.txt": "payload"})
    config = {"otel_process": {"cgroups": False, "base_dir": str(sandbox_base_dir)}}
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        assert type(sandbox._provider) is ProcessSandboxProvider
        await sandbox.start()
        assert (await sandbox.exec("cat in.txt")).stdout == "payload"
        await sandbox.download("in.txt", tmp_path / "back.txt")
        sandbox_id = sandbox._handle.sandbox_id
    records = await resource_records(telemetry, sandbox_id)
    lifecycle = [s for s in telemetry.finished() if s.name in LIFECYCLE]
    assert [s.name for s in lifecycle] == list(LIFECYCLE)
    known = identity(attrs(lifecycle[0])[REQUEST_ID], "process", sandbox_id, isolation="bwrap")
    assert [attrs(s) for s in lifecycle] == [
        {**known, REQUEST_ID: UUID4_HEX, UNSPECIFIED: NOTHING_REQUESTED},
        known,
        {**known, PREFIX + "exec.return_code": 0},
        known,
        known,
    ]
    # No mismatch keys: the process provider enforces nothing, and nothing was requested.
    assert sorted(records, key=lambda r: str(r[KIND])) == [
        {**record(known, "allocation"), **process_allocation()},
        {**record(known, "sample", final=True), **PROC_USAGE},
    ]
    created = {
        (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "process")): 1
    }
    assert telemetry.points(CREATIONS) == created
    assert telemetry.points(MISMATCHES) == {}
    telemetry.assert_nothing_elsewhere()


@pytest.mark.usefixtures("instrumented")
async def test_registered_provider_traced_through_create_provider(
    telemetry: Telemetry, nemo_gym: ModuleType
) -> None:
    """A provider class registered with register_provider and built by create_provider is
    traced like ours: spans with one identity per sandbox, the requested shape, its handle in
    sandbox_scope stamping user spans, its options and ResourceProvider methods still there."""
    provider = nemo_gym.create_provider({register(nemo_gym): {"region": "eu"}})
    assert isinstance(provider, TracedSandboxProvider)
    assert isinstance(provider.wrapped, CappedProvider)
    assert provider.region == "eu"
    assert callable(provider.resource_allocation)
    spec = nemo_gym.SandboxSpec(resources=nemo_gym.SandboxResources(cpu=2.0, memory_mib=256))
    handle = await provider.create(spec)
    user_tracer = telemetry.tracer_provider.get_tracer("user-code")
    with sandbox_scope(handle), user_tracer.start_as_current_span("grade"):
        pass
    await provider.exec(handle, "echo hi")
    await provider.close(handle)
    records = await resource_records(telemetry, handle.sandbox_id)
    await provider.aclose()

    lifecycle = [s for s in telemetry.finished() if s.name in LIFECYCLE]
    assert [s.name for s in lifecycle] == ["sandbox.create", "sandbox.exec", "sandbox.close"]
    known = identity(attrs(lifecycle[0])[REQUEST_ID], "capped", handle.sandbox_id)
    assert [attrs(s) for s in lifecycle] == [
        {
            **known,
            REQUEST_ID: UUID4_HEX,
            PREFIX + "requested.cpu": 2.0,
            PREFIX + "requested.memory_mib": 256,
            UNSPECIFIED: ("disk_gib", "gpu", "gpu_type"),
        },
        {**known, PREFIX + "exec.return_code": 0},
        known,
    ]
    (grade,) = telemetry.finished("grade")
    assert attrs(grade) == known
    allocation, component = PREFIX + "allocation.", PREFIX + "allocation.component.main."
    assert sorted(records, key=lambda r: str(r[KIND])) == [
        {
            **record(known, "allocation"),
            allocation + "source": "capped",
            allocation + "designator.kind": "vm",
            allocation + "designator.id": handle.sandbox_id,
            allocation + "designator.scope": "eu",
            allocation + "components": ("main",),
            component + "requests.unspecified": ("cpu", "memory_mib", "disk_gib", "gpu"),
            component + "limits.cpu": 0.5,
            component + "limits.memory_mib": 256,
            component + "limits.unspecified": ("disk_gib", "gpu"),
            MISMATCH + "resources": ("cpu",),
            MISMATCH + "cpu.kind": "below_request",
            MISMATCH + "cpu.requested": 2.0,
            MISMATCH + "cpu.allocated": 0.5,
        },
        {
            **record(known, "sample", final=True),
            PREFIX + "usage.cpu.time_s": 0.25,
            PREFIX + "usage.source": "capped",
        },
    ]
    created = (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "capped"))
    assert telemetry.points(CREATIONS) == {created: 1}
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
    assert attrs(create) == {
        PROVIDER: "failing",
        REQUEST_ID: UUID4_HEX,
        PREFIX + "requested.cpu": 1.0,
        UNSPECIFIED: ("memory_mib", "disk_gib", "gpu", "gpu_type"),
        "error.type": "SandboxCreateError",
    }
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
    await settled()  # what would have recorded runs beside the calls
    telemetry.tracer_provider.force_flush()
    assert telemetry.finished() == []
    for name in (CREATIONS, OOM_KILLS, MISMATCHES):
        assert telemetry.points(name) == {}


# --- instrument / uninstrument ----------------------------------------------------------------


# --- instrument / uninstrument --------------------------------------------------------------


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
    await settled()  # what would have recorded runs beside the calls
    telemetry.tracer_provider.force_flush()
    assert telemetry.finished() == []
    for metric in (CREATIONS, MISMATCHES):
        assert telemetry.points(metric) == {}


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


# Every span of one AsyncSandbox of a provider the plugin does not know (no ResourceProvider,
# no reader), sorted by name and record kind, its one request id written "<request id>": the
# calls with the sandbox's identity, one allocation record and one final sample, each record
# saying why nothing is known; never a figure.
_FRESH = {
    "nemo.gym.sandbox.request.id": "<request id>",
    "nemo.gym.sandbox.provider": "fresh",
    "nemo.gym.sandbox.id": "fresh-1",
}
UNKNOWN_PROVIDER_SPANS = [
    ["sandbox.close", _FRESH],
    [
        "sandbox.create",
        {**_FRESH, "nemo.gym.sandbox.requested.unspecified": list(NOTHING_REQUESTED)},
    ],
    ["sandbox.exec", {**_FRESH, "nemo.gym.sandbox.exec.return_code": 0}],
    [
        "sandbox.resources",
        {
            **_FRESH,
            "nemo.gym.sandbox.resource.kind": "allocation",
            "nemo.gym.sandbox.resource.final": False,
            "nemo.gym.sandbox.allocation.unknown_reason": "unknown_provider",
        },
    ],
    [
        "sandbox.resources",
        {
            **_FRESH,
            "nemo.gym.sandbox.resource.kind": "sample",
            "nemo.gym.sandbox.resource.final": True,
            "nemo.gym.sandbox.usage.unknown_reason": "unknown_provider",
        },
    ],
]

_SUBPROCESS = """
    import asyncio, json, re, sys
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
        spans = exporter.get_finished_spans()
        names = [s.name for s in spans if s.name != "sandbox.resources"]
        # Every attribute of every span; the request id, fresh each run, shown as a mark.
        request_id = "nemo.gym.sandbox.request.id"
        request_ids = sorted({str(s.attributes.get(request_id)) for s in spans})
        every = sorted(
            (
                [s.name, {k: "<request id>" if k == request_id else v
                          for k, v in s.attributes.items()}]
                for s in spans
            ),
            key=lambda span: (span[0], str(span[1].get("nemo.gym.sandbox.resource.kind"))),
        )
        one_uuid4 = len(request_ids) == 1 and bool(
            re.fullmatch("[0-9a-f]{12}4[0-9a-f]{3}[89ab][0-9a-f]{15}", request_ids[0])
        )
        found = {
            "imported_first": imported_first, "names": names, "one_uuid4_request_id": one_uuid4,
            "spans": every,
        }
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
        "one_uuid4_request_id": True,
        "spans": UNKNOWN_PROVIDER_SPANS,
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
        "one_uuid4_request_id": True,
        "spans": UNKNOWN_PROVIDER_SPANS,
        "creations": [1],
    }
