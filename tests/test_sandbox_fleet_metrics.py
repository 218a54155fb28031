"""Sandbox fleet counters with the real SDK, their Prometheus names, OOM kills read from
samples, the semantic-convention container identity of allocations, and the records and
traced calls that feed them."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from opentelemetry import metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest

from conftest import metric_names
from opentelemetry.instrumentation.nemo_gym.sandbox import _fleet_metrics
from opentelemetry.instrumentation.nemo_gym.sandbox._fleet_metrics import (
    SandboxFleetMetrics,
    container_identity,
    error_type_of,
    new_oom_kills,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxCreateError,
    SandboxHandle,
    SandboxResourceAmounts,
    SandboxResources,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ComponentAllocation,
    ResourceAllocation,
    ResourceDesignator,
    ResourceSampler,
    record_request,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import traced_provider

FLEET_COUNTERS = ("gym.sandbox.creations", "gym.sandbox.oom_kills", "gym.sandbox.allocation.")


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], int, str]]]:
    """Metric name -> (attributes, value, unit) of every data point collected now."""
    found: dict[str, list[tuple[dict[str, Any], int, str]]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            assert scope_metrics.scope.name == "opentelemetry.instrumentation.nemo_gym"
            for metric in scope_metrics.metrics:
                if not metric.name.startswith(FLEET_COUNTERS):
                    continue  # the lifecycle metrics beside them: test_sandbox_lifecycle_metrics
                assert metric.data.is_monotonic  # type: ignore[union-attr]
                found[metric.name] = sorted(
                    (
                        (dict(p.attributes or {}), p.value, metric.unit or "")
                        for p in metric.data.data_points
                    ),
                    key=repr,
                )
    return found


def test_fleet_metrics_counters_attributes_and_units(
    meter_provider: MeterProvider, metric_reader: InMemoryMetricReader
) -> None:
    """Each method adds to its counter with the agreed attributes and unit."""
    fleet = SandboxFleetMetrics(meter_provider)
    fleet.created("docker")
    fleet.created("docker")
    fleet.failed("docker", error_type_of(SandboxCreateError("no image")))
    fleet.oom_killed("process")
    fleet.oom_killed("process", 2)
    fleet.oom_killed("process", 0)
    fleet.mismatched("docker", "cpu", "below_request")
    provider, outcome = "nemo.gym.sandbox.provider", "nemo.gym.sandbox.outcome"
    assert points(metric_reader) == {
        "gym.sandbox.creations": sorted(
            [
                ({provider: "docker", outcome: "created"}, 2, "{sandbox}"),
                (
                    {provider: "docker", outcome: "failed", "error.type": "SandboxCreateError"},
                    1,
                    "{sandbox}",
                ),
            ],
            key=repr,
        ),
        "gym.sandbox.oom_kills": [({provider: "process"}, 3, "{kill}")],
        "gym.sandbox.allocation.mismatches": [
            (
                {
                    provider: "docker",
                    "nemo.gym.sandbox.resource": "cpu",
                    "nemo.gym.sandbox.mismatch": "below_request",
                },
                1,
                "{mismatch}",
            )
        ],
    }


def test_fleet_metrics_prometheus_names() -> None:
    """The real Prometheus exporter shows the names agreed in NAMES.md."""
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)
    provider = MeterProvider(metric_readers=[reader])
    try:
        fleet = SandboxFleetMetrics(provider)
        fleet.created("process")
        fleet.oom_killed("process")
        fleet.mismatched("process", "memory_mib", "no_limit")
        text = generate_latest(registry).decode()
    finally:
        provider.shutdown()
    for name in (
        "gym_sandbox_creations_total",
        "gym_sandbox_oom_kills_total",
        "gym_sandbox_allocation_mismatches_total",
    ):
        assert f"\n{name}{{" in text, text


def test_fleet_metrics_provider_labels_bounded(
    meter_provider: MeterProvider, metric_reader: InMemoryMetricReader, monkeypatch: Any
) -> None:
    """Past the bound, new provider names are counted as "other"."""
    monkeypatch.setattr(_fleet_metrics, "MAX_PROVIDER_LABELS", 2)
    fleet = SandboxFleetMetrics(meter_provider)
    for name in ("a", "b", "c", "d", "a"):
        fleet.created(name)
    creations = points(metric_reader)["gym.sandbox.creations"]
    labels = {attributes["nemo.gym.sandbox.provider"]: value for attributes, value, _ in creations}
    assert labels == {"a": 2, "b": 1, "other": 2}


def test_fleet_metrics_explicit_provider_not_global(
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    clean_metrics_globals: None,
) -> None:
    """Counters go to the meter provider given, not to the global one."""
    global_reader = InMemoryMetricReader()
    global_provider = MeterProvider(metric_readers=[global_reader])
    metrics.set_meter_provider(global_provider)
    try:
        SandboxFleetMetrics(meter_provider).created("process")
        assert points(metric_reader) == {
            "gym.sandbox.creations": [
                (
                    {"nemo.gym.sandbox.provider": "process", "nemo.gym.sandbox.outcome": "created"},
                    1,
                    "{sandbox}",
                )
            ]
        }
        assert metric_names(global_reader.get_metrics_data()) == set()
    finally:
        global_provider.shutdown()


def test_new_oom_kills_cumulative_count() -> None:
    """A cgroup's cumulative oom_kill count gives the difference since the last sample."""
    prefix = "nemo.gym.sandbox.usage."
    assert new_oom_kills(None, {prefix + "oom_kills": 0}) == 0
    assert new_oom_kills(None, {prefix + "oom_kills": 2}) == 2
    assert new_oom_kills({prefix + "oom_kills": 2}, {prefix + "oom_kills": 3}) == 1
    assert new_oom_kills({prefix + "oom_kills": 3}, {prefix + "oom_kills": 3}) == 0


def test_new_oom_kills_sticky_flag() -> None:
    """The engine's sticky OOMKilled flag counts once, when it turns true."""
    assert new_oom_kills(None, {"usage.oom_killed": False}) == 0
    assert new_oom_kills({"usage.oom_killed": False}, {"usage.oom_killed": True}) == 1
    assert new_oom_kills({"usage.oom_killed": True}, {"usage.oom_killed": True}) == 0
    assert new_oom_kills(None, {"usage.source": "proc"}) == 0


def test_container_identity_from_designator() -> None:
    """A container allocation gives container.id and the runtime; others give nothing."""
    podman = ResourceAllocation(
        source="docker.inspect",
        designator=ResourceDesignator("container", "abc123", "podman-0123456789abcdef"),
    )
    docker = ResourceAllocation(
        source="docker.inspect", designator=ResourceDesignator("container", "def456", "DAEMONID")
    )
    other = ResourceAllocation(source="k8s", designator=ResourceDesignator("container", "x"))
    cgroup = ResourceAllocation(source="cgroup.v2", designator=ResourceDesignator("cgroup", "/a"))
    assert container_identity(podman) == {
        "container.id": "abc123",
        "container.runtime.name": "podman",
    }
    assert container_identity(docker) == {
        "container.id": "def456",
        "container.runtime.name": "docker",
    }
    assert container_identity(other) == {"container.id": "x"}
    assert container_identity(cgroup) == {}
    assert container_identity(ResourceAllocation(source="none")) == {}


def test_allocation_recorded_counts_warns_and_describes(
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CPU capped below the request: record attributes with both values and the container
    identity, one warning for two records, and the counter at 2."""
    fleet = SandboxFleetMetrics(meter_provider)
    capped = ResourceAllocation(
        source="docker.inspect",
        components=(
            ComponentAllocation("container", limits=SandboxResourceAmounts(cpu=1.0, memory_mib=64)),
        ),
        designator=ResourceDesignator("container", "c1", "podman-0123456789abcdef"),
    )
    requested = SandboxResources(cpu=2.0, memory_mib=64)
    with caplog.at_level(logging.WARNING):
        first = fleet.allocation_recorded("docker", requested, capped)
        fleet.allocation_recorded("docker", requested, capped)
    assert first == {
        "container.id": "c1",
        "container.runtime.name": "podman",
        "nemo.gym.sandbox.allocation.mismatch.resources": ("cpu",),
        "nemo.gym.sandbox.allocation.mismatch.cpu.kind": "below_request",
        "nemo.gym.sandbox.allocation.mismatch.cpu.requested": 2.0,
        "nemo.gym.sandbox.allocation.mismatch.cpu.allocated": 1.0,
    }
    assert [r.getMessage() for r in caplog.records if "capped below" in r.getMessage()] == [
        "sandbox provider 'docker': cpu capped below the request (requested 2, allocated 1); "
        "later cpu mismatches of this provider are counted on "
        "gym.sandbox.allocation.mismatches, not logged"
    ]
    mismatches = points(metric_reader)["gym.sandbox.allocation.mismatches"]
    assert [value for _, value, _ in mismatches] == [2]


def test_allocation_recorded_bad_request_identity_only(meter_provider: MeterProvider) -> None:
    """A request that cannot be compared still yields the identity, and nothing raises."""
    fleet = SandboxFleetMetrics(meter_provider)
    allocation = ResourceAllocation(
        source="docker.inspect", designator=ResourceDesignator("container", "c2")
    )
    assert fleet.allocation_recorded("docker", {"cpu": "lots"}, allocation) == {
        "container.id": "c2",
        "container.runtime.name": "docker",
    }


def test_sample_recorded_counts_oom_kills(
    meter_provider: MeterProvider, metric_reader: InMemoryMetricReader
) -> None:
    """Successive samples count each OOM kill once."""
    fleet = SandboxFleetMetrics(meter_provider)
    key = "nemo.gym.sandbox.usage.oom_kills"
    fleet.sample_recorded("process", None, {key: 0})
    fleet.sample_recorded("process", {key: 0}, {key: 1})
    fleet.sample_recorded("process", {key: 1}, {key: 1})
    assert points(metric_reader)["gym.sandbox.oom_kills"] == [
        ({"nemo.gym.sandbox.provider": "process"}, 1, "{kill}")
    ]


def test_fleet_metrics_of_one_per_meter_provider(meter_provider: MeterProvider) -> None:
    """of() makes the counters once per meter provider and returns them on later calls."""
    other = MeterProvider(metric_readers=[InMemoryMetricReader()])
    try:
        first = SandboxFleetMetrics.of(meter_provider, version="1.2.3")
        assert SandboxFleetMetrics.of(meter_provider) is first
        assert SandboxFleetMetrics.of(other) is not first
    finally:
        other.shutdown()


# --- the records and traced calls feeding the counters ----------------------------------------


class CappingProvider:
    """A duck-typed ResourceProvider whose CPU limit is half the request and whose samples
    report a growing cumulative OOM-kill count."""

    name = "capping"

    def __init__(self) -> None:
        self.kills = 0

    async def create(self, spec: Any) -> SandboxHandle:
        if spec.image == "missing":
            raise SandboxCreateError("image 'missing' not found")
        return SandboxHandle(sandbox_id="cap-1", provider_name=self.name, raw=None)

    async def close(self, handle: SandboxHandle) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def resource_allocation(self, handle: SandboxHandle) -> ResourceAllocation:
        return ResourceAllocation(
            source="capping",
            components=(ComponentAllocation("main", limits={"cpu": 0.5, "memory_mib": 64}),),
        )

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Any]:
        return {"usage.oom_kills": self.kills}


async def test_resource_sampler_by_hand_compares_record_request(
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    global_meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A sampler built by hand over record_request(spec, ...), as
    nemo_gym.sandbox.resource_telemetry shows, compares the allocation with the requested shape in
    its attributes, and counts OOM kills as the difference between its successive samples."""
    provider = CappingProvider()
    handle = await provider.create(SandboxSpec())
    attributes = record_request(
        SandboxSpec(resources={"cpu": 1.0}), {PREFIX + "provider": "capping"}
    )
    sampler = ResourceSampler(provider, handle, attributes, 0)
    sampler.start()
    await sampler.record("allocation")
    provider.kills = 2
    await sampler.record("sample")
    provider.kills = 3
    await sampler.stop()
    (allocation,) = [
        dict(s.attributes or {})
        for s in span_exporter.get_finished_spans()
        if (s.attributes or {}).get(PREFIX + "resource.kind") == "allocation"
    ]
    assert allocation["nemo.gym.sandbox.allocation.mismatch.cpu.kind"] == "below_request"
    assert allocation["nemo.gym.sandbox.allocation.mismatch.resources"] == ("cpu",)
    found = points(metric_reader)
    assert found["gym.sandbox.oom_kills"] == [
        ({"nemo.gym.sandbox.provider": "capping"}, 3, "{kill}")
    ]
    assert [value for _, value, _ in found["gym.sandbox.allocation.mismatches"]] == [1]


async def test_traced_provider_counts_creations_on_global_meter_provider(
    global_meter_provider: MeterProvider, metric_reader: InMemoryMetricReader
) -> None:
    """Without an instrumentor, a traced_provider counts created and failed sandboxes on the
    global meter provider; the failure reaches the caller as the same object."""
    provider = traced_provider(CappingProvider())
    handle = await provider.create(SandboxSpec())
    await provider.close(handle)
    with pytest.raises(SandboxCreateError) as raised:
        await provider.create(SandboxSpec(image="missing"))
    assert "missing" in str(raised.value)
    creations = {
        tuple(sorted(attributes.items())): value
        for attributes, value, _ in points(metric_reader)["gym.sandbox.creations"]
    }
    assert creations == {
        (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "capping")): 1,
        (
            ("error.type", "SandboxCreateError"),
            ("nemo.gym.sandbox.outcome", "failed"),
            ("nemo.gym.sandbox.provider", "capping"),
        ): 1,
    }
