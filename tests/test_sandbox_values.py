"""Sandbox value types refuse what no span may carry, naming the field and never a secret."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    ContainerResourceAmounts,
    SandboxHandle,
    SandboxResourceAmounts,
    SandboxResources,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    Attribute,
    ComponentAllocation,
    ResourceAllocation,
    ResourceDesignator,
    ResourceSampler,
)

SECRET = "hunter2-Zq9"


# --- amounts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("memory_mib", 10**30), ("cpu", 10**400), ("gpu", 2**63), ("disk_gib", 1e300)],
)
def test_sandbox_resource_amounts_huge_value_names_field(field: str, value: object) -> None:
    """A number beyond 64 bits is a ValueError naming the field, not an OverflowError."""
    with pytest.raises(ValueError, match=field):
        SandboxResourceAmounts(**{field: value})


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (math.nan, "must be finite"),
        (math.inf, "must be finite"),
        (-1, "must not be negative"),
        ("32", "is not a number"),
        (True, "is not a number"),
        (1.5, "must be a whole number"),
        (2**63, "is too large"),
    ],
)
def test_container_resource_amounts_bad_pids_names_field(value: object, says: str) -> None:
    """A pids limit that no span may carry is a ValueError naming ``pids`` and the value."""
    with pytest.raises(ValueError, match=rf"sandbox resource pids={value!r} {says}"):
        ContainerResourceAmounts(pids=value)  # type: ignore[arg-type]


def test_container_resource_amounts_validates_shared_quantities() -> None:
    """The shared quantities are checked as in ``SandboxResourceAmounts``, unset pids is None,
    and a whole float becomes an int."""
    with pytest.raises(ValueError, match="cpu=nan"):
        ContainerResourceAmounts(cpu=math.nan, pids=32)
    amounts = ContainerResourceAmounts(cpu=0.5, memory_mib=64, pids=32.0)  # type: ignore[arg-type]
    assert (amounts.cpu, amounts.memory_mib, amounts.disk_gib, amounts.gpu) == (0.5, 64, None, None)
    assert amounts.pids == 32
    assert type(amounts.pids) is int
    assert ContainerResourceAmounts().pids is None
    assert isinstance(amounts, SandboxResourceAmounts)


def test_sandbox_resources_from_mapping_huge_string_names_field() -> None:
    """A huge whole number written as text is refused by field, not rounded to a float."""
    with pytest.raises(ValueError, match="memory_mib"):
        SandboxResources.from_mapping({"memory_mib": "1" + "0" * 30})


def test_sandbox_resources_from_mapping_non_string_key_names_it() -> None:
    """A non-string key is a ValueError naming the key and listing the allowed ones."""
    with pytest.raises(ValueError, match=r"key 1 .*allowed keys: cpu"):
        SandboxResources.from_mapping({1: 2, "cpu": 1})  # type: ignore[dict-item]


@pytest.mark.parametrize("gpu_type", [math.nan, "", 3])
def test_sandbox_resources_gpu_type_must_be_non_empty_string(gpu_type: object) -> None:
    """A NaN, empty or numeric gpu_type is refused, never turned into "nan"."""
    with pytest.raises(ValueError, match="gpu_type"):
        SandboxResources.from_mapping({"gpu_type": gpu_type})
    with pytest.raises(ValueError, match="gpu_type"):
        SandboxResources(gpu_type=gpu_type)  # type: ignore[arg-type]


# --- allocations -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_component_allocation_duck_typed_amounts_validated(bad: float) -> None:
    """Amounts given as another library's object or a mapping are checked like ours."""
    with pytest.raises(ValueError, match=r"requests.*cpu"):
        ComponentAllocation(
            "main", requests=SimpleNamespace(cpu=bad, memory_mib=None, disk_gib=None, gpu=None)
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"limits.*cpu"):
        ComponentAllocation("main", limits={"cpu": bad})  # type: ignore[arg-type]


def test_component_allocation_converts_duck_typed_amounts() -> None:
    """Valid duck-typed amounts become our validated type with the same values."""
    component = ComponentAllocation(
        "main",
        limits=SimpleNamespace(cpu=0.5, memory_mib=64, disk_gib=None, gpu=None),  # type: ignore[arg-type]
    )
    assert component.limits == SandboxResourceAmounts(cpu=0.5, memory_mib=64)


def test_component_allocation_keeps_container_limits() -> None:
    """Container limits stay ``ContainerResourceAmounts``, their pids limit with them."""
    limits = ContainerResourceAmounts(cpu=0.5, pids=32)
    assert ComponentAllocation("container", limits=limits).limits is limits


def test_resource_allocation_refuses_wrong_parts() -> None:
    """An empty source, a component that is not one, or a designator that is not one raise."""
    with pytest.raises(ValueError, match="source"):
        ResourceAllocation(source="")
    with pytest.raises(ValueError, match="components"):
        ResourceAllocation(source="s", components=("main",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host"):
        ResourceAllocation(source="s", host="node-a")  # type: ignore[arg-type]


# --- samples ---------------------------------------------------------------------------------


class DirtySamples:
    async def resource_allocation(self, handle: Any) -> ResourceAllocation:
        return ResourceAllocation(source="dirty")

    async def resource_sample(self, handle: Any) -> dict[str, Attribute]:
        return {
            "usage.cpu.time_s": math.nan,
            "usage.memory_mib": -1,
            "usage.pids": math.inf,
            "usage.big": 2**64,
            "usage.ok": 3,
            "usage.oom_killed": False,
        }


async def test_resource_sampler_drops_unclean_sample_numbers(
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """NaN, infinite, negative and beyond-64-bit sample numbers are dropped (logged once),
    never exported; clean values and booleans stay."""
    handle = SandboxHandle("d-1", "dirty", None)
    sampler = ResourceSampler(DirtySamples(), handle, {}, 0)
    with caplog.at_level(logging.WARNING):
        await sampler.record("sample")
        await sampler.record("sample")
    # The second sample changed nothing, so it carries none of the figures (a partial one).
    clean = {PREFIX + "usage.ok": 3, PREFIX + "usage.oom_killed": False}
    assert [
        {k: v for k, v in (span.attributes or {}).items() if k.startswith(PREFIX + "usage")}
        for span in span_exporter.get_finished_spans()
    ] == [clean, {}]
    dropped = [r for r in caplog.records if "usage.cpu.time_s" in r.getMessage()]
    assert len(dropped) == 1


@pytest.mark.parametrize("interval", ["abc", None, math.nan, -1, math.inf])
def test_resource_sampler_bad_interval_names_field_and_value(interval: object) -> None:
    """An interval that is not a finite number >= 0 is a ValueError naming it and the value."""
    handle = SandboxHandle("d-1", "dirty", None)
    with pytest.raises(ValueError, match="interval") as caught:
        ResourceSampler(DirtySamples(), handle, {}, interval)  # type: ignore[arg-type]
    assert repr(interval) in str(caught.value)


# --- designators -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        f"user:{SECRET}@db.internal:5432",
        f"postgres://user:{SECRET}@db.internal/x",
        f"client_secret={SECRET}",
        f"api-key={SECRET}",
        f"api_key={SECRET}",
        f"x?apikey={SECRET}",
        f"Bearer {SECRET}",
        f"AWS_SECRET_ACCESS_KEY={SECRET}",
        f"https://bucket/obj?sv=1&sig={SECRET}",
        f"X-Amz-Signature={SECRET}",
        f"password={SECRET}",
        f"accessToken={SECRET}",
    ],
)
def test_resource_designator_refuses_credentials_without_repeating_them(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each credential shape is refused; the error names the field, never the value."""
    with caplog.at_level(logging.DEBUG), pytest.raises(ValueError, match="designator id") as caught:
        ResourceDesignator("container", value)
    assert SECRET not in str(caught.value)
    assert not [r for r in caplog.records if SECRET in r.getMessage()]


@pytest.mark.parametrize(
    "value",
    [
        "/nemo_gym/process-0123456789abcdef",
        "7TRN:IPZB:QYBB:VPBQ:UWYJ:KGPP",
        "podman-4f2a",
        "image@sha256:abcdef",
        "passage_id=3",
        "k8s:cluster-a",
    ],
)
def test_resource_designator_accepts_plain_identities(value: str) -> None:
    """Opaque identities, daemon IDs and innocuous parameters are accepted."""
    assert ResourceDesignator("container", value, scope=value).id == value
