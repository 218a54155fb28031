"""Sandbox lifecycle metrics in NeMo Gym's names (active, startup, exec, transfer, create
retries) from the traced calls, deferred to NeMo Gym's own ``gym_metrics`` while it records,
and usage totals (CPU time, memory high-water mark) from the usage samples.

Durations are wall-clock: where a test pins a bucket, the traced calls' clock is a test clock
that the provider itself advances, so the placement follows from the provider's events.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest

from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._sandbox_host import (
    NEMO_GYM_METRICS_MODULE,
)
from opentelemetry.instrumentation.nemo_gym.sandbox import _calls
from opentelemetry.instrumentation.nemo_gym.sandbox._lifecycle_metrics import (
    DURATION_BUCKETS_MS,
    SandboxLifecycleMetrics,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxCreateError,
    SandboxExecResult,
    SandboxHandle,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ResourceSampler,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import SandboxState, traced_provider

PROVIDER = "nemo.gym.sandbox.provider"
SERVER = "nemo.gym.server.name"
LIFECYCLE = (
    "gym.sandbox.active",
    "gym.sandbox.startup_duration_ms",
    "gym.sandbox.exec_duration_ms",
    "gym.sandbox.transfer_duration_ms",
    "gym.sandbox.create_retry_total",
)


def collected(reader: InMemoryMetricReader) -> dict[str, Any]:
    """Metric name -> the metric (one scope: ours)."""
    found: dict[str, Any] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            assert scope_metrics.scope.name == "opentelemetry.instrumentation.nemo_gym"
            for metric in scope_metrics.metrics:
                found[metric.name] = metric
    return found


def by_attributes(metric: Any) -> dict[tuple[tuple[str, Any], ...], Any]:
    return {tuple(sorted((p.attributes or {}).items())): p for p in metric.data.data_points}


class ManualClock:
    """The traced calls' ``time`` module, whose ``perf_counter`` moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


class TimedProvider:
    """A provider whose every call advances the test clock by a set number of seconds:
    ``create`` fails for spec image ``missing``; ``exec`` raises for command ``boom`` and
    reports a runtime ``error_type`` for command ``lost``."""

    name = "timed"

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.takes_s = {"create": 0.1, "exec": 0.1, "upload": 0.1, "download": 0.1}
        self.created = 0

    async def create(self, spec: Any) -> SandboxHandle:
        self.clock.now += self.takes_s["create"]
        if spec.image == "missing":
            raise SandboxCreateError("image 'missing' not found")
        self.created += 1
        return SandboxHandle(sandbox_id=f"t-{self.created}", provider_name=self.name, raw=None)

    async def exec(self, handle: SandboxHandle, command: str, **_: Any) -> SandboxExecResult:
        self.clock.now += self.takes_s["exec"]
        if command == "boom":
            raise ConnectionError("sandbox gone")
        if command == "lost":
            return SandboxExecResult(stdout=None, stderr=None, return_code=-1, error_type="lost")
        return SandboxExecResult(stdout="", stderr="", return_code=1)

    async def upload_file(self, handle: SandboxHandle, source: Path, target: str) -> None:
        self.clock.now += self.takes_s["upload"]

    async def download_file(self, handle: SandboxHandle, source: str, target: Path) -> None:
        self.clock.now += self.takes_s["download"]

    async def close(self, handle: SandboxHandle) -> None:
        return None

    async def aclose(self) -> None:
        return None


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    made = ManualClock()
    monkeypatch.setattr(_calls, "time", made)
    return made


@pytest.fixture
def state(tracer_provider: TracerProvider, meter_provider: MeterProvider) -> SandboxState:
    return SandboxState(tracer_provider, meter_provider=meter_provider, interval_s=0)


def bucket_counts(point: Any) -> dict[float, int]:
    """Upper bound -> count of the non-empty buckets (``inf`` for the overflow one)."""
    bounds = [*point.explicit_bounds, float("inf")]
    return {bound: count for bound, count in zip(bounds, point.bucket_counts, strict=True) if count}


async def test_lifecycle_metrics_buckets_reach_thirty_minutes(
    clock: ManualClock, state: SandboxState, metric_reader: InMemoryMetricReader
) -> None:
    """Startup, exec and transfer durations land in NeMo Gym's buckets, which reach 30
    minutes: a 29-minute start in the last bucket, a 31-minute command past it."""
    timed = TimedProvider(clock)
    provider = traced_provider(timed, state)
    timed.takes_s["create"] = 29 * 60.0
    handle = await provider.create(SandboxSpec())
    timed.takes_s["exec"] = 31 * 60.0
    await provider.exec(handle, "long")
    timed.takes_s["exec"] = 0.3
    await provider.exec(handle, "short")
    timed.takes_s["upload"], timed.takes_s["download"] = 90.0, 0.2
    await provider.upload_file(handle, Path("/dev/null"), "/tmp/x")
    await provider.download_file(handle, "/tmp/x", Path("/dev/null"))
    metrics = collected(metric_reader)
    key = ((PROVIDER, "timed"),)
    startup = by_attributes(metrics["gym.sandbox.startup_duration_ms"])[key]
    assert tuple(startup.explicit_bounds) == DURATION_BUCKETS_MS
    assert DURATION_BUCKETS_MS[-1] == 30 * 60 * 1000
    assert bucket_counts(startup) == {1_800_000: 1}
    assert metrics["gym.sandbox.startup_duration_ms"].unit == "ms"
    exec_point = by_attributes(metrics["gym.sandbox.exec_duration_ms"])[key]
    assert bucket_counts(exec_point) == {500: 1, float("inf"): 1}
    assert exec_point.sum == pytest.approx(31 * 60_000 + 300)
    transfer = by_attributes(metrics["gym.sandbox.transfer_duration_ms"])[key]
    assert bucket_counts(transfer) == {250: 1, 120_000: 1}
    assert by_attributes(metrics["gym.sandbox.active"])[key].value == 1
    await provider.close(handle)
    assert by_attributes(collected(metric_reader)["gym.sandbox.active"])[key].value == 0


async def test_lifecycle_metrics_failures_carry_error_type_and_retries(
    clock: ManualClock, state: SandboxState, metric_reader: InMemoryMetricReader
) -> None:
    """A failed create is timed with error.type and holds nothing; creating the same spec
    again is one retry; a command that raised or reported an error_type carries it; a
    nonzero exit code is no error."""
    provider = traced_provider(TimedProvider(clock), state)
    missing = SandboxSpec(image="missing")
    for _ in range(3):
        with pytest.raises(SandboxCreateError):
            await provider.create(missing)
    with pytest.raises(SandboxCreateError):
        await provider.create(SandboxSpec(image="missing"))  # another spec: no retry
    handle = await provider.create(SandboxSpec())
    assert (await provider.exec(handle, "exit 1")).return_code == 1
    with pytest.raises(ConnectionError):
        await provider.exec(handle, "boom")
    await provider.exec(handle, "lost")
    metrics = collected(metric_reader)
    ok = ((PROVIDER, "timed"),)
    startup = by_attributes(metrics["gym.sandbox.startup_duration_ms"])
    assert {k: p.count for k, p in startup.items()} == {
        ok: 1,
        (("error.type", "SandboxCreateError"), (PROVIDER, "timed")): 4,
    }
    retries = metrics["gym.sandbox.create_retry_total"]
    assert retries.unit == "1"
    assert {k: p.value for k, p in by_attributes(retries).items()} == {ok: 2}
    execs = by_attributes(metrics["gym.sandbox.exec_duration_ms"])
    assert {k: p.count for k, p in execs.items()} == {
        ok: 1,
        (("error.type", "ConnectionError"), (PROVIDER, "timed")): 1,
        (("error.type", "lost"), (PROVIDER, "timed")): 1,
    }
    assert {k: p.value for k, p in by_attributes(metrics["gym.sandbox.active"]).items()} == {ok: 1}
    await provider.aclose()  # never closed: released with its provider
    active = by_attributes(collected(metric_reader)["gym.sandbox.active"])
    assert {k: p.value for k, p in active.items()} == {ok: 0}


async def test_lifecycle_metrics_process_provider_exact_counts(
    state: SandboxState, metric_reader: InMemoryMetricReader, tmp_path: Path
) -> None:
    """The real process provider, traced: two creates, three commands, an upload and a
    download, one close give exactly those counts, one sandbox still active, no sandbox id."""
    provider = traced_provider(ProcessSandboxProvider(cgroups=False), state)
    first = await provider.create(SandboxSpec())
    second = await provider.create(SandboxSpec())
    source = tmp_path / "in.txt"
    source.write_text("hello")
    try:
        for command in ("true", "false", "echo hi"):
            await provider.exec(first, command)
        await provider.upload_file(first, source, "in.txt")
        await provider.download_file(first, "in.txt", tmp_path / "out.txt")
        await provider.close(second)
        metrics = collected(metric_reader)
        key = ((PROVIDER, "process"),)
        counts = {
            name: by_attributes(metrics[name])[key].count
            for name in (
                "gym.sandbox.startup_duration_ms",
                "gym.sandbox.exec_duration_ms",
                "gym.sandbox.transfer_duration_ms",
            )
        }
        assert counts == {
            "gym.sandbox.startup_duration_ms": 2,
            "gym.sandbox.exec_duration_ms": 3,
            "gym.sandbox.transfer_duration_ms": 2,
        }
        assert {k: p.value for k, p in by_attributes(metrics["gym.sandbox.active"]).items()} == {
            key: 1
        }
        assert "gym.sandbox.create_retry_total" not in metrics
    finally:
        await provider.close(first)
        await provider.aclose()
    active = by_attributes(collected(metric_reader)["gym.sandbox.active"])
    assert {k: p.value for k, p in active.items()} == {((PROVIDER, "process"),): 0}


# --- NeMo Gym's own gym_metrics records them: we record none ---------------------------------


def stand_in_gym_metrics(exporting: list[bool]) -> types.ModuleType:
    """NeMo Gym's ``nemo_gym.telemetry.gym_metrics`` as far as this plugin looks at it: its
    gate, answering ``exporting[0]``."""
    module = types.ModuleType(NEMO_GYM_METRICS_MODULE)
    module.metrics_exporting = lambda: exporting[0]  # type: ignore[attr-defined]
    return module


async def test_lifecycle_metrics_deferred_while_nemo_gym_records(
    clock: ManualClock,
    state: SandboxState,
    metric_reader: InMemoryMetricReader,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While NeMo Gym's own gym_metrics is loaded and exporting, none of the five is recorded
    (creations still are); loaded but not exporting, they are; a sandbox counted +1 before
    NeMo Gym began recording is still counted -1 at its close."""
    exporting = [True]
    monkeypatch.setitem(sys.modules, NEMO_GYM_METRICS_MODULE, stand_in_gym_metrics(exporting))
    provider = traced_provider(TimedProvider(clock), state)
    failed = SandboxSpec(image="missing")
    for _ in range(2):
        with pytest.raises(SandboxCreateError):
            await provider.create(failed)
    deferred = await provider.create(SandboxSpec())
    await provider.exec(deferred, "true")
    await provider.upload_file(deferred, Path("/dev/null"), "/tmp/x")
    await provider.close(deferred)
    metrics = collected(metric_reader)
    assert [name for name in LIFECYCLE if name in metrics] == []
    assert sum(p.value for p in metrics["gym.sandbox.creations"].data.data_points) == 3

    exporting[0] = False
    held = await provider.create(SandboxSpec())
    await provider.exec(held, "true")
    exporting[0] = True
    await provider.exec(held, "true")  # NeMo Gym's now
    await provider.close(held)
    metrics = collected(metric_reader)
    key = ((PROVIDER, "timed"),)
    assert by_attributes(metrics["gym.sandbox.startup_duration_ms"])[key].count == 1
    assert by_attributes(metrics["gym.sandbox.exec_duration_ms"])[key].count == 1
    assert by_attributes(metrics["gym.sandbox.active"])[key].value == 0


async def test_lifecycle_metrics_recorded_without_nemo_gym_module(
    clock: ManualClock,
    state: SandboxState,
    metric_reader: InMemoryMetricReader,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without NeMo Gym's gym_metrics module (NeMo Gym 0.4 and 0.5), ours are recorded."""
    monkeypatch.delitem(sys.modules, NEMO_GYM_METRICS_MODULE, raising=False)
    provider = traced_provider(TimedProvider(clock), state)
    handle = await provider.create(SandboxSpec())
    await provider.close(handle)
    metrics = collected(metric_reader)
    assert (
        by_attributes(metrics["gym.sandbox.startup_duration_ms"])[((PROVIDER, "timed"),)].count == 1
    )


# --- usage totals from the usage samples ------------------------------------------------------


class UsageProvider:
    """A ResourceProvider whose samples are the test's list, one per sample taken."""

    name = "usage"

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.samples = samples

    async def resource_allocation(self, handle: SandboxHandle) -> Any:
        raise NotImplementedError

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Any]:
        return self.samples.pop(0)


async def test_usage_totals_cpu_deltas_and_memory_high_water_mark(
    state: SandboxState, metric_reader: InMemoryMetricReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU time adds each sample's increase (a first sample whole, a counter that went back
    from zero), per provider and NeMo Gym server; the memory gauge keeps the highest peak."""
    monkeypatch.setenv("NEMO_GYM_CONFIG_PATH", "math_env")
    samples = [
        {"usage.cpu.time_s": 1.5, "usage.memory_mib": 10.0},
        {"usage.cpu.time_s": 4.0, "usage.memory_mib": 8.0, "usage.memory_peak_mib": 64.0},
        {"usage.cpu.time_s": 3.0, "usage.memory_peak_mib": 32.0},  # restarted
        {"usage.memory_mib": 1.0},
    ]
    handle = SandboxHandle(sandbox_id="u-1", provider_name="usage", raw=None)
    with state.active():
        sampler = ResourceSampler(UsageProvider(samples), handle, {PREFIX + "provider": "usage"}, 0)
    for _ in range(4):
        await sampler.record("sample")
    metrics = collected(metric_reader)
    key = ((PROVIDER, "usage"), (SERVER, "math_env"))
    cpu = metrics["gym.sandbox.cpu.time"]
    assert cpu.unit == "s"
    assert cpu.data.is_monotonic
    assert by_attributes(cpu)[key].value == pytest.approx(1.5 + 2.5 + 3.0)
    peak = metrics["gym.sandbox.memory.peak"]
    assert peak.unit == "By"
    assert by_attributes(peak)[key].value == 64 * 1024 * 1024


def test_usage_totals_without_nemo_gym_server(
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside a NeMo Gym server the usage totals carry the provider alone."""
    monkeypatch.delenv("NEMO_GYM_CONFIG_PATH", raising=False)
    lifecycle = SandboxLifecycleMetrics(meter_provider)
    lifecycle.sampled("docker", None, {"nemo.gym.sandbox.usage.cpu.time_s": 2.0})
    cpu = by_attributes(collected(metric_reader)["gym.sandbox.cpu.time"])
    assert {k: p.value for k, p in cpu.items()} == {((PROVIDER, "docker"),): 2.0}


def test_lifecycle_metrics_prometheus_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real Prometheus exporter shows the names the rules and the dashboard read."""
    monkeypatch.setenv("NEMO_GYM_CONFIG_PATH", "math_env")
    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    try:
        lifecycle = SandboxLifecycleMetrics(provider)
        lifecycle.created("process", ("process", "1"), 0.3)
        lifecycle.created("process", None, 0.3, "SandboxCreateError", retry_of=(1, None))
        lifecycle.executed("process", 0.1)
        lifecycle.transferred("process", 0.1)
        lifecycle._retries.add(1, {PROVIDER: "process"})
        lifecycle.sampled("process", None, {"usage.cpu.time_s": 1.0, "usage.memory_mib": 2.0})
        text = generate_latest(registry).decode()
    finally:
        provider.shutdown()
    for name in (
        'gym_sandbox_active{nemo_gym_sandbox_provider="process"',
        "gym_sandbox_startup_duration_ms_milliseconds_bucket{",
        "gym_sandbox_exec_duration_ms_milliseconds_bucket{",
        "gym_sandbox_transfer_duration_ms_milliseconds_bucket{",
        "gym_sandbox_create_retry_total{",
        'gym_sandbox_cpu_time_seconds_total{nemo_gym_sandbox_provider="process",nemo_gym_server_name="math_env"',
        "gym_sandbox_memory_peak_bytes{",
    ):
        assert f"\n{name}" in text, text


async def test_lifecycle_metrics_deferred_by_nemo_gym_telemetry_handle(
    clock: ManualClock,
    state: SandboxState,
    metric_reader: InMemoryMetricReader,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gym_metrics without ``metrics_exporting`` defers to its telemetry handle: nothing is
    recorded while ``get_telemetry()`` is exporting, ours are while it is not initialised."""
    monkeypatch.setitem(
        sys.modules, NEMO_GYM_METRICS_MODULE, types.ModuleType(NEMO_GYM_METRICS_MODULE)
    )
    setup = types.ModuleType("nemo_gym.telemetry.setup")
    handle_of: list[Any] = [types.SimpleNamespace(is_exporting=True)]
    setup.get_telemetry = lambda: handle_of[0]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nemo_gym.telemetry.setup", setup)
    provider = traced_provider(TimedProvider(clock), state)
    await provider.close(await provider.create(SandboxSpec()))
    assert [name for name in LIFECYCLE if name in collected(metric_reader)] == []
    handle_of[0] = None
    await provider.close(await provider.create(SandboxSpec()))
    startup = collected(metric_reader)["gym.sandbox.startup_duration_ms"]
    assert by_attributes(startup)[((PROVIDER, "timed"),)].count == 1


class OddResult:
    """An exec result whose ``error_type`` cannot be read."""

    return_code = 0

    @property
    def error_type(self) -> str:
        raise RuntimeError("unreadable")


async def test_lifecycle_metrics_odd_exec_result_returned_unchanged(
    clock: ManualClock,
    state: SandboxState,
    metric_reader: InMemoryMetricReader,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A result whose error_type raises reaches the caller as the same object; the timing is
    dropped with one warning, and the next command is timed again."""
    timed = TimedProvider(clock)
    provider = traced_provider(timed, state)
    handle = await provider.create(SandboxSpec())
    odd = OddResult()

    async def odd_exec(handle: SandboxHandle, command: str, **_: Any) -> Any:
        return odd if command == "odd" else SandboxExecResult(stdout="", stderr="", return_code=0)

    timed.exec = odd_exec  # type: ignore[method-assign]
    for _ in range(2):
        assert await provider.exec(handle, "odd") is odd
    await provider.exec(handle, "fine")
    execs = by_attributes(collected(metric_reader)["gym.sandbox.exec_duration_ms"])
    assert {k: p.count for k, p in execs.items()} == {((PROVIDER, "timed"),): 1}
    warnings = [r for r in caplog.records if "lifecycle" in r.getMessage()]
    assert len(warnings) == 1
