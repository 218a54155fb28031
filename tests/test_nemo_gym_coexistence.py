"""Beside NeMo Gym's own telemetry: nothing timed or reported twice, one sandbox identity, and
a provider shutdown by somebody else still exports our buffered waits.

NeMo Gym's own connection-pool telemetry (meter scope ``nemo.lens``, its own
``QueueTimedTCPConnector`` subclass, the same capacity-report words) is neither in nemo-gym
0.4.0 nor in NeMo Gym main at 07d6b0d (a ``nemo_gym_main`` test says so), so ``StandIn`` plays
it: a module registered under its name, with a connector subclass that times waits on
``nemo.lens`` and a capacity report in our words.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator, Sequence
from time import perf_counter
from typing import Any

import aiohttp
import pytest
from aiohttp.client import ClientTimeout
from aiohttp.client_reqrep import ClientRequest, ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import GatedServerFactory, eventually, through_pool
from nemo_gym_support import nemo_gym_main
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym._shared._names import METER_NAME
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import SandboxState, traced_provider
from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry._capacity import _PoolConfig
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    ATTR_SERVER_NAME,
    CONNECT_TOTAL,
    QUEUE_DURATION,
    QUEUE_DURATION_UNIT,
)
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    build_connection_pool_connector,
    connection_pool_capacity,
)

pytestmark = pytest.mark.nemo_gym  # also run on NeMo Gym main (nemo_gym_support)

NEMO_LENS = "nemo.lens"
NEMO_GYM_POOL_MODULE = "nemo_gym.telemetry.connection_pool"  # NeMo Gym's connection-pool module
CAPACITY_PREFIX = "aiohttp connection pool capacity for this server/CLI process group:"
REQUEST_ID, PROVIDER, SANDBOX_ID = PREFIX + "request.id", PREFIX + "provider", PREFIX + "id"


# --- a stand-in for NeMo Gym's own connection-pool telemetry ---------------------------------


def stand_in_module(meter_provider: MeterProvider) -> types.ModuleType:
    """NeMo Gym's connection-pool module as far as this plugin can see it: a timed connector
    subclass recording on scope ``nemo.lens`` and a capacity report in the same words."""
    module = types.ModuleType(NEMO_GYM_POOL_MODULE)
    meter = meter_provider.get_meter(NEMO_LENS)
    waits = meter.create_histogram(QUEUE_DURATION, unit=QUEUE_DURATION_UNIT)
    connects = meter.create_counter(CONNECT_TOTAL, unit="{connection}")
    log = logging.getLogger(NEMO_GYM_POOL_MODULE)

    class NemoGymQueueTimedTCPConnector(aiohttp.TCPConnector):
        async def connect(
            self,
            req: ClientRequest,
            traces: list[Trace],
            timeout: ClientTimeout,  # noqa: ASYNC109 - aiohttp's signature
        ) -> Connection:
            connects.add(1, {ATTR_SERVER_NAME: "external"})
            return await super().connect(req, traces, timeout)

        async def _wait_for_available_connection(
            self, key: ConnectionKey, traces: list[Trace]
        ) -> None:
            started = perf_counter()
            await super()._wait_for_available_connection(key, traces)
            waits.record((perf_counter() - started) * 1000.0, {ATTR_SERVER_NAME: "external"})

    def report_connection_pool_capacity(cfg: Any, capacity: Any, visible: bool = False) -> None:
        line = connection_pool.capacity_line(cfg, capacity, None, None)
        log.info("%s", line)

    module.QueueTimedTCPConnector = NemoGymQueueTimedTCPConnector  # type: ignore[attr-defined]
    module.report_connection_pool_capacity = report_connection_pool_capacity  # type: ignore[attr-defined]
    return module


def points_by_scope(data: MetricsData | None, name: str) -> dict[str, list[Any]]:
    """Data points of metric ``name`` per instrumentation scope name."""
    found: dict[str, list[Any]] = {}
    for resource_metrics in data.resource_metrics if data is not None else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    found.setdefault(scope_metrics.scope.name, []).extend(metric.data.data_points)
    return found


def waits_and_connects(data: MetricsData | None, scope: str) -> tuple[int, int]:
    """Queue waits recorded and connects counted on ``scope``."""
    waits = sum(point.count for point in points_by_scope(data, QUEUE_DURATION).get(scope, []))
    connects = sum(point.value for point in points_by_scope(data, CONNECT_TOTAL).get(scope, []))
    return waits, connects


@pytest.fixture
def instrumented(meter_provider: MeterProvider) -> Iterator[None]:
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    yield
    instrumentor.uninstrument()


def capacity_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(CAPACITY_PREFIX)]


# --- the pool: never timed twice, the capacity line once ------------------------------------


async def test_nemo_gym_timed_connector_is_timed_only_by_nemo_gym(
    gated_server: GatedServerFactory,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    instrumented: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NeMo Gym's own timed connector subclass records on nemo.lens alone: ours adds nothing."""
    nemo_gym = stand_in_module(meter_provider)
    monkeypatch.setitem(sys.modules, NEMO_GYM_POOL_MODULE, nemo_gym)
    server = await gated_server("127.0.0.1")
    connector = nemo_gym.QueueTimedTCPConnector(limit=2, limit_per_host=0)
    assert type(connector) is nemo_gym.QueueTimedTCPConnector
    await through_pool(connector, server, requests=10, slots=2)
    data = metric_reader.get_metrics_data()
    assert waits_and_connects(data, NEMO_LENS) == (8, 10)
    assert waits_and_connects(data, METER_NAME) == (0, 0)


async def test_capacity_line_logged_once_beside_nemo_gym_report(
    meter_provider: MeterProvider,
    instrumented: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Where NeMo Gym reports its own pool sizing, connectors built meanwhile add no line."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(connection_pool, "_REPORTED_CAPACITIES", set())
    nemo_gym = stand_in_module(meter_provider)
    monkeypatch.setitem(sys.modules, NEMO_GYM_POOL_MODULE, nemo_gym)
    cfg = _PoolConfig(37, 0, None, None)
    # NeMo Gym's server start: a plain connector (its telemetry off for this pool), its report.
    plain = aiohttp.TCPConnector(limit=37, limit_per_host=0)
    nemo_gym.report_connection_pool_capacity(cfg, connection_pool_capacity(cfg, 1))
    timed = nemo_gym.QueueTimedTCPConnector(limit=37, limit_per_host=0)
    try:
        assert type(plain) is QueueTimedTCPConnector  # ours times the pool nobody else times
        (line,) = capacity_lines(caplog)
        assert "aggregate_total=37" in line
    finally:
        await plain.close()
        await timed.close()


async def test_capacity_line_logged_by_us_without_nemo_gym_report(
    instrumented: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without NeMo Gym's own connection-pool module, our patch logs the line, once."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(connection_pool, "_REPORTED_CAPACITIES", set())
    monkeypatch.delitem(sys.modules, NEMO_GYM_POOL_MODULE, raising=False)
    connectors = [aiohttp.TCPConnector(limit=37, limit_per_host=0) for _ in "ab"]
    try:
        (line,) = capacity_lines(caplog)
        assert "aggregate_total=37" in line
    finally:
        for connector in connectors:
            await connector.close()


# --- somebody else shuts the global meter provider down --------------------------------------


class ListExporter(MetricExporter):
    """A metric exporter that keeps every batch it is given, in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[MetricsData] = []

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        self.batches.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None


async def test_global_meter_provider_shutdown_exports_buffered_waits(
    gated_server: GatedServerFactory, clean_metrics_globals: None
) -> None:
    """Waits still buffered when another library shuts the global provider down are exported."""
    exporter = ListExporter()
    # An hour between exports: the only export is the one that shutdown makes.
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    server = await gated_server("127.0.0.1")
    connector = build_connection_pool_connector(limit=2, limit_per_host=0)
    assert type(connector) is QueueTimedTCPConnector
    await through_pool(connector, server, requests=10, slots=2)
    assert len(connector._nemo_gym_pending) == 8  # buffered, not yet recorded
    provider: Any = metrics.get_meter_provider()
    provider.shutdown()  # what NeMo Gym's telemetry library does at server exit
    (batch,) = exporter.batches
    assert waits_and_connects(batch, METER_NAME) == (8, 10)


# --- sandbox spans: ours inside NeMo Gym's, one identity -------------------------------------


def identity(span: ReadableSpan) -> dict[str, Any]:
    attributes = dict(span.attributes or {})
    return {key: attributes.get(key) for key in (REQUEST_ID, PROVIDER, SANDBOX_ID)}


def one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    (span,) = [s for s in spans if s.name == name]
    return span


async def test_nemo_gym_sandbox_spans_enclose_ours_with_one_identity(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> None:
    """gym.sandbox.start and gym.sandbox.exec are our spans' parents and get their identity."""
    state = SandboxState(tracer_provider, interval_s=0)
    raw = ProcessSandboxProvider(cgroups=False)
    provider: Any = traced_provider(raw, state)
    nemo_gym = tracer_provider.get_tracer(NEMO_LENS)
    try:
        with nemo_gym.start_as_current_span("gym.sandbox.start"):
            handle = await provider.create(SandboxSpec())
        with nemo_gym.start_as_current_span("gym.sandbox.exec"):
            assert (await provider.exec(handle, "true")).return_code == 0
        with trace.use_span(tracer_provider.get_tracer("app").start_span("work"), end_on_exit=True):
            await provider.exec(handle, "true")
        await provider.close(handle)
    finally:
        await raw.aclose()
    spans = span_exporter.get_finished_spans()
    start, create = one(spans, "gym.sandbox.start"), one(spans, "sandbox.create")
    gym_exec = one(spans, "gym.sandbox.exec")
    ours_in_gym = next(
        s for s in spans if s.name == "sandbox.exec" and s.parent == gym_exec.context
    )
    assert create.parent is not None
    assert create.parent.span_id == start.context.span_id
    assert identity(start) == identity(create) == identity(gym_exec) == identity(ours_in_gym)
    assert identity(start)[SANDBOX_ID] == handle.sandbox_id
    assert identity(one(spans, "work")) == {REQUEST_ID: None, PROVIDER: None, SANDBOX_ID: None}


@pytest.mark.nemo_gym_main
def test_nemo_gym_main_has_no_pool_telemetry_of_its_own() -> None:
    """NeMo Gym main still has no connection-pool module: the stand-in remains what coexistence
    is tested against (this fails the day a NeMo Gym update brings the real one)."""
    nemo_gym_main()
    assert importlib.util.find_spec("nemo_gym.telemetry") is None


# --- sandbox samples: one owner beside NeMo Gym's own sampler --------------------------------

NEMO_GYM_SAMPLER_MODULE = (
    "nemo_gym.sandbox.resource_telemetry"  # NeMo Gym's sandbox resource module
)


def stand_in_sampler_module() -> types.ModuleType:
    """NeMo Gym's own sandbox resource telemetry as far as this plugin can see it: a
    ``ResourceSampler(provider, handle, attributes, interval)`` with ``attributes``, ``task``,
    ``start()``, ``stop()``, ``run()`` and ``record()``, one owner per sandbox, each sample a
    ``resource_sample`` call of the provider (kept in ``samples``)."""
    module = types.ModuleType(NEMO_GYM_SAMPLER_MODULE)
    owners: dict[tuple[str, str], object] = {}

    class ResourceSampler:
        def __init__(
            self, provider: Any, handle: Any, attributes: dict[str, Any], interval: float
        ) -> None:
            self.attributes = dict(attributes)
            self.task: asyncio.Task[None] | None = None
            self.samples: list[dict[str, Any]] = []
            self.sampled = asyncio.Event()
            self._provider, self._handle, self._interval = provider, handle, interval
            self._key = (str(handle.provider_name), str(handle.sandbox_id))

        async def record(self, kind: str, final: bool = False) -> None:
            self.samples.append(dict(await self._provider.resource_sample(self._handle)))
            self.sampled.set()

        async def run(self) -> None:
            while True:
                await asyncio.sleep(self._interval)
                await self.record("sample")

        def start(self) -> None:
            if owners.setdefault(self._key, self) is self and self._interval > 0:
                self.task = asyncio.get_running_loop().create_task(self.run())

        async def stop(self) -> None:
            if self.task is not None:
                self.task.cancel()
                await asyncio.wait((self.task,))
                await self.record("sample", final=True)
            owners.pop(self._key, None)

    module.ResourceSampler = ResourceSampler  # type: ignore[attr-defined]
    return module


async def test_nemo_gym_own_sampler_takes_over_sandbox_samples(
    monkeypatch: pytest.MonkeyPatch,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """Once NeMo Gym's own ResourceSampler samples a sandbox, ours stops after one final
    sample and records no other, while NeMo Gym's keeps sampling; its stop frees the sandbox."""
    module = stand_in_sampler_module()
    monkeypatch.setitem(sys.modules, NEMO_GYM_SAMPLER_MODULE, module)
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL", "0.1")
    instrumentor = NemoGymInstrumentor()
    instrumentor.uninstrument()
    instrumentor.instrument(tracer_provider=tracer_provider, connection_pool=False)
    raw = ProcessSandboxProvider(cgroups=False)
    provider: Any = traced_provider(raw)
    try:
        handle = await provider.create(SandboxSpec())

        def ours(final: bool) -> list[ReadableSpan]:
            return [
                s
                for s in span_exporter.get_finished_spans()
                if s.name == "sandbox.resources"
                and s.attributes
                and s.attributes.get(PREFIX + "resource.kind") == "sample"
                and s.attributes.get(PREFIX + "resource.final") is final
            ]

        await eventually(lambda: bool(ours(final=False)), "a periodic sample of ours")
        attributes = {PROVIDER: handle.provider_name, SANDBOX_ID: handle.sandbox_id}
        theirs = module.ResourceSampler(raw, handle, attributes, 0.1)
        theirs.start()
        assert theirs.task is not None

        async def taken_over() -> None:
            while len(theirs.samples) < 3 or not ours(final=True):
                theirs.sampled.clear()
                await theirs.sampled.wait()

        # The bound only stops a broken test (ours never yielding).
        await asyncio.wait_for(taken_over(), 30)
        [final] = ours(final=True)
        assert final.end_time is not None
        assert [s for s in ours(final=False) if (s.start_time or 0) > final.end_time] == []
        periodic_before_close = len(ours(final=False))
        await theirs.stop()
        await provider.close(handle)
        # Closing sampled nothing more of ours: NeMo Gym's sampler owned the sandbox.
        assert len(ours(final=False)) == periodic_before_close
        assert len(ours(final=True)) == 1
    finally:
        instrumentor.uninstrument()
        await raw.aclose()
    # Uninstrumented, NeMo Gym's sampler is its own again.
    assert not hasattr(module.ResourceSampler.start, "__wrapped__")
