"""Traced providers, sandbox scopes and the stamping span processor, on real sandboxes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import ProxyTracerProvider, StatusCode

from conftest import eventually, require_service
from opentelemetry.instrumentation.nemo_gym._shared._exporting import span_processors
from opentelemetry.instrumentation.nemo_gym.sandbox import tracing
from opentelemetry.instrumentation.nemo_gym.sandbox._state import default_state
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    EXEC_TIMEOUT_RETURN_CODE,
    SandboxCreateError,
    SandboxExecResult,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
    SandboxSpanProcessor,
    install_span_processor,
    sandbox_scope,
    set_auto_trace,
    traced_provider,
)
from span_support import (
    FINAL,
    KIND,
    NOTHING_REQUESTED,
    PROC_USAGE,
    PROVIDER,
    REQUEST_ID,
    SANDBOX_ID,
    UNSPECIFIED,
    UUID4_HEX,
    at_least,
    between,
    carried_forward,
    identity,
    matching,
    process_allocation,
    record,
    sample_outcome,
    sandbox_cgroup_path,
    settled,
)

INTERVAL_VARIABLE = "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL"
SECRET = "sk-live-do-not-record-4242"


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


@pytest.fixture
def exporter(
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> InMemorySpanExporter:
    monkeypatch.setenv(INTERVAL_VARIABLE, "0.1")
    return span_exporter


@pytest.fixture
def processor(global_tracer_provider: TracerProvider) -> Iterator[SandboxSpanProcessor]:
    made = install_span_processor(global_tracer_provider)
    assert made is not None
    yield made
    made.disable()


@dataclass
class NemoHandle:
    sandbox_id: str
    provider_name: str
    raw: Any = None


class BoomError(Exception):
    """The duck-typed provider's own failure, which must reach the caller untouched."""


class NemoLikeProvider:
    """A provider of nemo_gym's shape that is not ours and has no resource capability."""

    name = "nemo"

    def __init__(self) -> None:
        self.raised: list[BaseException] = []

    async def create(self, spec: Any) -> NemoHandle:
        return NemoHandle("n-1", "nemo")

    async def exec(self, handle: Any, command: str, **kwargs: Any) -> SandboxExecResult:
        error = BoomError("exec failed")
        self.raised.append(error)
        raise error

    async def close(self, handle: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def test_traced_provider_create_records_request_and_identity(
    exporter: InMemorySpanExporter, process: ProcessSandboxProvider
) -> None:
    """sandbox.create carries the request id, provider, sandbox id and the requested shape."""
    provider = traced_provider(process)
    sandbox = await provider.create(SandboxSpec(resources={"cpu": 0.5}))
    await provider.close(sandbox)
    (create,) = named(exporter, "sandbox.create")
    request_id = attrs(create)[REQUEST_ID]
    assert attrs(create) == {
        **identity(UUID4_HEX, "process", sandbox.sandbox_id, isolation="bwrap"),
        PREFIX + "requested.cpu": 0.5,
        UNSPECIFIED: ("memory_mib", "disk_gib", "gpu", "gpu_type"),
    }
    (close,) = named(exporter, "sandbox.close")
    assert attrs(close) == identity(request_id, "process", sandbox.sandbox_id, isolation="bwrap")


async def test_traced_provider_failed_create_keeps_identity(
    exporter: InMemorySpanExporter, process: ProcessSandboxProvider
) -> None:
    """A failed create has an ERROR span with its own request id; the exception is unchanged."""
    provider = traced_provider(process)
    for _ in range(2):
        with pytest.raises(SandboxCreateError, match="no GPUs"):
            await provider.create(SandboxSpec(resources={"gpu": 1}))
    spans = named(exporter, "sandbox.create")
    assert len(spans) == 2
    assert attrs(spans[0])[REQUEST_ID] != attrs(spans[1])[REQUEST_ID]
    for span in spans:
        assert span.status.status_code is StatusCode.ERROR
        assert attrs(span) == {
            PROVIDER: "process",
            REQUEST_ID: UUID4_HEX,
            PREFIX + "requested.gpu": 1,
            UNSPECIFIED: ("cpu", "memory_mib", "disk_gib", "gpu_type"),
            "error.type": "SandboxCreateError",
        }
    assert named(exporter, "sandbox.resources") == []


async def test_traced_provider_exec_records_return_code_never_command(
    exporter: InMemorySpanExporter, process: ProcessSandboxProvider
) -> None:
    """sandbox.exec records the return code; no span anywhere holds the command's text."""
    provider = traced_provider(process)
    sandbox = await provider.create(SandboxSpec(env={"TOKEN": SECRET}))
    result = await provider.exec(sandbox, f"echo {SECRET}; exit 3")
    assert result.return_code == 3
    assert result.stdout == SECRET + "\n"
    await provider.exec(sandbox, f"sleep 5 # {SECRET}", timeout_s=0.1)
    await provider.close(sandbox)
    first, second = named(exporter, "sandbox.exec")
    known = identity(attrs(first)[REQUEST_ID], "process", sandbox.sandbox_id, isolation="bwrap")
    assert attrs(first) == {**known, REQUEST_ID: UUID4_HEX, PREFIX + "exec.return_code": 3}
    assert attrs(second) == {
        **known,
        PREFIX + "exec.return_code": EXEC_TIMEOUT_RETURN_CODE,
        PREFIX + "exec.error_type": "timeout",
    }
    for span in exporter.get_finished_spans():
        texts = [str(v) for v in attrs(span).values()]
        texts += [str(v) for e in span.events for v in (e.attributes or {}).values()]
        assert not any(SECRET in t for t in texts), span.name


async def test_traced_provider_file_and_close_spans(
    exporter: InMemorySpanExporter, process: ProcessSandboxProvider, tmp_path: Path
) -> None:
    """Upload, download and close are spans with the sandbox identity, in call order."""
    provider = traced_provider(process)
    sandbox = await provider.create(SandboxSpec())
    source = tmp_path / "a.txt"
    source.write_text("x")
    await provider.upload_file(sandbox, source, "a.txt")
    await provider.download_file(sandbox, "a.txt", tmp_path / "b.txt")
    await provider.close(sandbox)
    lifecycle = [s for s in exporter.get_finished_spans() if s.name != "sandbox.resources"]
    assert [s.name for s in lifecycle] == [
        "sandbox.create",
        "sandbox.upload",
        "sandbox.download",
        "sandbox.close",
    ]
    known = identity(
        attrs(lifecycle[0])[REQUEST_ID], "process", sandbox.sandbox_id, isolation="bwrap"
    )
    assert attrs(lifecycle[0]) == {
        **known,
        REQUEST_ID: UUID4_HEX,
        UNSPECIFIED: NOTHING_REQUESTED,
    }
    assert [attrs(s) for s in lifecycle[1:]] == [known] * 3


async def test_traced_provider_records_allocation_samples_and_final(
    exporter: InMemorySpanExporter, process: ProcessSandboxProvider
) -> None:
    """Create records the allocation and starts sampling; close records one final sample,
    all parented to the caller's span."""
    provider = traced_provider(process)
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("rollout") as rollout:
        sandbox = await provider.create(SandboxSpec(resources={"memory_mib": 64}))
    # The sampler's clock, not the test's, decides when a periodic sample comes: wait for one.
    await eventually(
        lambda: len(named(exporter, "sandbox.resources")) >= 2, "a periodic sample recorded"
    )
    await provider.close(sandbox)
    records = named(exporter, "sandbox.resources")
    assert len(records) >= 3
    known = identity(
        attrs(named(exporter, "sandbox.create")[0])[REQUEST_ID],
        "process",
        sandbox.sandbox_id,
        isolation="bwrap",
    )
    mismatch = PREFIX + "allocation.mismatch."
    assert attrs(records[0]) == {
        **record(known, "allocation"),
        **process_allocation(
            {
                mismatch + "resources": ("memory_mib",),
                mismatch + "memory_mib.kind": "no_limit",
                mismatch + "memory_mib.requested": 64,
            }
        ),
    }
    finals = [False] * (len(records) - 2) + [True]
    assert [attrs(r) for r in records[1:]] == [
        {**record(known, "sample", final), **sample_outcome(attrs(r), PROC_USAGE)}
        for r, final in zip(records[1:], finals, strict=True)
    ]
    for made in records:
        assert made.parent is not None
        assert made.parent.span_id == rollout.get_span_context().span_id
    assert (process.name, None, sandbox.sandbox_id) not in default_state().registry
    await settled()
    assert len(named(exporter, "sandbox.resources")) == len(records)


async def test_traced_provider_no_records_when_nothing_exported(
    span_exporter: InMemorySpanExporter, process: ProcessSandboxProvider
) -> None:
    """With the API's proxy provider no sampler runs and no resource record is attempted."""
    provider = traced_provider(process)
    sandbox = await provider.create(SandboxSpec())
    entry = default_state().registry.get((process.name, None, sandbox.sandbox_id))
    assert entry is not None
    assert entry.sampler is None
    await provider.close(sandbox)
    assert span_exporter.get_finished_spans() == ()


async def test_traced_provider_passes_duck_typed_results_and_exceptions(
    exporter: InMemorySpanExporter,
) -> None:
    """A nemo_gym-shaped provider's exceptions reach the caller as the same object."""
    inner = NemoLikeProvider()
    provider = traced_provider(inner)
    assert provider.name == "nemo"
    sandbox = await provider.create({"resources": {"cpu": -1}})  # undescribable spec
    with pytest.raises(BoomError) as caught:
        await provider.exec(sandbox, "true")
    assert caught.value is inner.raised[0]
    await provider.close(sandbox)
    await provider.aclose()
    (create,) = named(exporter, "sandbox.create")
    known = identity(attrs(create)[REQUEST_ID], "nemo", "n-1")
    assert attrs(create) == {**known, REQUEST_ID: UUID4_HEX, UNSPECIFIED: NOTHING_REQUESTED}
    (exec_span,) = named(exporter, "sandbox.exec")
    assert exec_span.status.status_code is StatusCode.ERROR
    assert attrs(exec_span) == {**known, "error.type": "BoomError"}
    assert [attrs(r) for r in named(exporter, "sandbox.resources")] == [
        {**record(known, "allocation"), PREFIX + "allocation.unknown_reason": "unknown_provider"},
        {**record(known, "sample", True), PREFIX + "usage.unknown_reason": "unknown_provider"},
    ]
    assert attrs(named(exporter, "sandbox.close")[0]) == known
    assert traced_provider(provider) is provider


async def test_traced_provider_cancellation_propagates(
    exporter: InMemorySpanExporter, process: ProcessSandboxProvider, tmp_path: Path
) -> None:
    """Cancelling a traced exec raises CancelledError in the caller; its span says so."""
    provider = traced_provider(process)
    sandbox = await provider.create(SandboxSpec())
    started = Path(sandbox.raw.workdir) / "started"
    task = asyncio.ensure_future(provider.exec(sandbox, "touch started; sleep 30"))
    await eventually(started.exists, "the command running")  # a process outside the test
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await provider.close(sandbox)
    (exec_span,) = named(exporter, "sandbox.exec")
    request_id = attrs(named(exporter, "sandbox.create")[0])[REQUEST_ID]
    assert attrs(exec_span) == {
        **identity(request_id, "process", sandbox.sandbox_id, isolation="bwrap"),
        "error.type": "CancelledError",
    }


async def test_sandbox_span_processor_stamps_inside_scope_only(
    exporter: InMemorySpanExporter,
    processor: SandboxSpanProcessor,
    process: ProcessSandboxProvider,
) -> None:
    """Spans inside sandbox_scope get the identity; spans outside do not; disable() stops it."""
    provider = traced_provider(process)
    sandbox = await provider.create(SandboxSpec())
    tracer = trace.get_tracer("user")
    with sandbox_scope(sandbox):
        with tracer.start_as_current_span("tool.call"):
            pass
        with tracer.start_as_current_span("explicit", attributes={SANDBOX_ID: "mine"}):
            pass
        child = asyncio.ensure_future(asyncio.sleep(0))
        await child
    with tracer.start_as_current_span("outside"):
        pass
    processor.disable()
    with sandbox_scope(sandbox), tracer.start_as_current_span("after.disable"):
        pass
    await provider.close(sandbox)
    known = identity(
        attrs(named(exporter, "sandbox.create")[0])[REQUEST_ID],
        "process",
        sandbox.sandbox_id,
        isolation="bwrap",
    )
    assert attrs(named(exporter, "tool.call")[0]) == known
    assert attrs(named(exporter, "explicit")[0]) == {**known, SANDBOX_ID: "mine"}
    assert attrs(named(exporter, "outside")[0]) == {}
    assert attrs(named(exporter, "after.disable")[0]) == {}


async def test_sandbox_scope_borrowed_handle_has_provider_and_id(
    exporter: InMemorySpanExporter, processor: SandboxSpanProcessor
) -> None:
    """A handle never created here is stamped with its provider and id, without request id."""
    with (
        sandbox_scope(NemoHandle("remote-7", "docker")),
        trace.get_tracer("u").start_as_current_span("work"),
    ):
        pass
    assert attrs(named(exporter, "work")[0]) == {PROVIDER: "docker", SANDBOX_ID: "remote-7"}


def test_install_span_processor_skips_proxy_provider() -> None:
    """The API's proxy provider cannot take processors: None, and nothing raised."""
    assert install_span_processor(ProxyTracerProvider()) is None


async def test_set_auto_trace_traces_bundled_classes_and_restores(
    exporter: InMemorySpanExporter,
) -> None:
    """With auto-trace on, plain ProcessSandboxProvider objects are traced, once even when
    also wrapped; off restores the class exactly."""
    original = ProcessSandboxProvider.__dict__["create"]
    set_auto_trace(True)
    set_auto_trace(True)
    try:
        plain = ProcessSandboxProvider(cgroups=False)
        sandbox = await plain.create(SandboxSpec())
        result = await plain.exec(sandbox, "exit 4")
        await plain.close(sandbox)
        assert result.return_code == 4
        wrapped = traced_provider(ProcessSandboxProvider(cgroups=False))
        other = await wrapped.create(SandboxSpec())
        await wrapped.close(other)
        await wrapped.aclose()
        await plain.aclose()
    finally:
        set_auto_trace(False)
    set_auto_trace(False)
    assert ProcessSandboxProvider.__dict__["create"] is original
    calls = [s for s in exporter.get_finished_spans() if s.name != "sandbox.resources"]
    assert [s.name for s in calls] == [
        "sandbox.create",
        "sandbox.exec",
        "sandbox.close",
        "sandbox.create",
        "sandbox.close",
    ]
    first = identity(attrs(calls[0])[REQUEST_ID], "process", sandbox.sandbox_id, isolation="bwrap")
    second = identity(attrs(calls[3])[REQUEST_ID], "process", other.sandbox_id, isolation="bwrap")
    created = {REQUEST_ID: UUID4_HEX, UNSPECIFIED: NOTHING_REQUESTED}
    assert [attrs(s) for s in calls] == [
        {**first, **created},
        {**first, PREFIX + "exec.return_code": 4},
        first,
        {**second, **created},
        second,
    ]
    exporter.clear()
    untraced = ProcessSandboxProvider(cgroups=False)
    await untraced.close(await untraced.create(SandboxSpec()))
    assert exporter.get_finished_spans() == ()


async def test_traced_provider_aclose_stops_unclosed_samplers(
    exporter: InMemorySpanExporter, process: ProcessSandboxProvider
) -> None:
    """aclose() records the final sample of sandboxes that were never closed."""
    provider = traced_provider(process)
    sandbox = await provider.create(SandboxSpec())
    key = (process.name, None, sandbox.sandbox_id)
    entry = default_state().registry.get(key)
    assert entry is not None
    assert entry.sampler is not None
    await provider.aclose()
    assert key not in default_state().registry
    (create,) = named(exporter, "sandbox.create")
    known = identity(attrs(create)[REQUEST_ID], "process", sandbox.sandbox_id, isolation="bwrap")
    finals = [r for r in named(exporter, "sandbox.resources") if attrs(r)[FINAL]]
    assert [attrs(r) for r in finals] == [
        {**record(known, "sample", final=True), **sample_outcome(attrs(finals[0]), PROC_USAGE)}
    ]


async def test_traced_cgroup_sandbox_records_throttling_and_oom(
    exporter: InMemorySpanExporter,
) -> None:
    """Under 0.1 CPU and 48 MiB, periodic samples show throttling while CPU-bound commands
    run, and after a memory hog is OOM-killed the final record shows the kill and the peak."""
    inner = ProcessSandboxProvider(pids_limit=None)  # cpu and memory only: no pids.max
    require_service(inner.cgroup_version is not None, "no writable cgroup hierarchy")
    provider = traced_provider(inner)
    throttled_key = PREFIX + "usage.cpu.throttled_s"

    def throttled_samples() -> list[ReadableSpan]:
        return [
            r
            for r in named(exporter, "sandbox.resources")
            if attrs(r).get(throttled_key, 0) > 0 and not attrs(r)[PREFIX + "resource.final"]
        ]

    try:
        # A tenth of a core: two burners outrun that quota even on a machine whose other work
        # leaves them a small share of a core, so the kernel throttles them.
        sandbox = await provider.create(SandboxSpec(resources={"cpu": 0.1, "memory_mib": 48}))
        burn = "sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $! >> burners.pid; "
        await provider.exec(sandbox, burn + burn)
        # Wait on the condition, bounded generously: on a loaded machine the burners may stay
        # under their quota for a long while before the kernel throttles them.
        await eventually(throttled_samples, "a throttled sample", timeout=150, interval=0.1)
        await provider.exec(sandbox, "kill -9 $(cat burners.pid)")
        hog = "exec dd if=/dev/zero of=/dev/null bs=200M count=1"  # one 200 MiB buffer
        result = await provider.exec(sandbox, hog, timeout_s=60)
        assert result.error_type == "oom_kill"
        await provider.close(sandbox)
    finally:
        await provider.aclose()
    assert throttled_samples()
    records = named(exporter, "sandbox.resources")
    known = identity(
        attrs(named(exporter, "sandbox.create")[0])[REQUEST_ID],
        "process",
        sandbox.sandbox_id,
        isolation="bwrap",
    )
    limits = PREFIX + "allocation.component.sandbox.limits."
    (allocation,) = [attrs(r) for r in records if attrs(r)[KIND] == "allocation"]
    assert allocation == {
        **record(known, "allocation"),
        **process_allocation(
            {
                limits + "cpu": 0.1,
                limits + "memory_mib": 48,
                limits + "unspecified": ("disk_gib", "gpu"),
            },
            cgroup=sandbox_cgroup_path(sandbox.sandbox_id),
        ),
    }
    usage = PREFIX + "usage."
    cgroup_usage = {
        usage + "source": matching(r"cgroup\.v[12]"),
        usage + "cpu.time_s": at_least(0),
        usage + "cpu.throttled_s": at_least(0),
        usage + "cpu.throttled_periods": at_least(0, int),
        usage + "memory_mib": at_least(0),
        usage + "memory_peak_mib": between(0, 48),
        usage + "oom_kills": at_least(0, int),
        usage + "pids": at_least(0, int),
    }
    samples = carried_forward([attrs(r) for r in records if attrs(r)[KIND] == "sample"])
    periodic = [got for got in samples if not got[FINAL]]
    assert periodic == [
        {**record(known, "sample"), **sample_outcome(got, cgroup_usage)} for got in periodic
    ]
    (final,) = [attrs(r) for r in records if attrs(r)[FINAL]]
    assert final == {
        **record(known, "sample", final=True),
        **cgroup_usage,
        usage + "oom_kills": at_least(1, int),
    }
    assert [attrs(s) for s in named(exporter, "sandbox.exec")] == [
        {**known, PREFIX + "exec.return_code": 0},
        {**known, PREFIX + "exec.return_code": 0},
        {**known, PREFIX + "exec.return_code": 137, PREFIX + "exec.error_type": "oom_kill"},
    ]


async def test_enable_disable_cycle_reuses_one_processor(
    exporter: InMemorySpanExporter, global_tracer_provider: TracerProvider
) -> None:
    """enable() adds one processor and auto-traces; disable() silences both; enable() again
    re-enables the same processor instead of adding another."""
    original = ProcessSandboxProvider.__dict__["create"]
    first = tracing.enable(global_tracer_provider)
    try:
        assert first.processor is not None
        second = tracing.enable(global_tracer_provider)
        assert second.processor is first.processor
        assert ProcessSandboxProvider.__dict__["create"].__wrapped__ is original
        plain = ProcessSandboxProvider(cgroups=False)
        sandbox = await plain.create(SandboxSpec())
        with sandbox_scope(sandbox), trace.get_tracer("user").start_as_current_span("inside"):
            pass
        await plain.close(sandbox)
        tracing.disable()
        tracing.disable()
        assert ProcessSandboxProvider.__dict__["create"] is original
        assert first.processor.enabled is False
        with sandbox_scope(sandbox), trace.get_tracer("user").start_as_current_span("off"):
            pass
        third = tracing.enable(global_tracer_provider)
        assert third.processor is first.processor
        assert first.processor.enabled is True
    finally:
        tracing.disable()
    processors = span_processors(global_tracer_provider)
    assert sum(isinstance(p, SandboxSpanProcessor) for p in processors) == 1
    request_id = attrs(named(exporter, "sandbox.create")[0])[REQUEST_ID]
    assert attrs(named(exporter, "inside")[0]) == identity(
        request_id, "process", sandbox.sandbox_id, isolation="bwrap"
    )
    assert attrs(named(exporter, "off")[0]) == {}
    assert [s.name for s in named(exporter, "sandbox.create")] == ["sandbox.create"]


def test_enable_with_proxy_provider_still_auto_traces() -> None:
    """With the API's proxy provider enable() has no processor and still traces bundled
    classes."""
    original = ProcessSandboxProvider.__dict__["create"]
    try:
        assert tracing.enable(ProxyTracerProvider()).processor is None
        assert ProcessSandboxProvider.__dict__["create"] is not original
    finally:
        tracing.disable()
    assert ProcessSandboxProvider.__dict__["create"] is original
