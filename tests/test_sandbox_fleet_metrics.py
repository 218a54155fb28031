"""Sandbox fleet counters with the real SDK, their Prometheus names, OOM kills read from
samples, and the semantic-convention container identity of allocations."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from opentelemetry.instrumentation.nemo_gym.sandbox import _fleet_metrics
from opentelemetry.instrumentation.nemo_gym.sandbox._fleet_metrics import (
    SandboxFleetMetrics,
    container_identity,
    error_type_of,
    new_oom_kills,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxCreateError,
    SandboxResourceAmounts,
    SandboxResources,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    ComponentAllocation,
    ResourceAllocation,
    ResourceDesignator,
)


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], int, str]]]:
    """Metric name -> (attributes, value, unit) of every data point collected now."""
    found: dict[str, list[tuple[dict[str, Any], int, str]]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            assert scope_metrics.scope.name == "opentelemetry.instrumentation.nemo_gym"
            for metric in scope_metrics.metrics:
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
    meter_provider: MeterProvider, metric_reader: InMemoryMetricReader
) -> None:
    """Counters go to the meter provider given, not to the global one."""
    SandboxFleetMetrics(meter_provider).created("process")
    assert "gym.sandbox.creations" in points(metric_reader)


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
