"""Requested against allocated sandbox resources: mismatches, record attributes, warnings."""

from __future__ import annotations

import logging
from types import ModuleType

import pytest

from nemo_gym_support import nemo_gym_sandbox
from opentelemetry.instrumentation.nemo_gym.sandbox._mismatch import (
    MISMATCH_PREFIX,
    MismatchWarnings,
    ResourceMismatch,
    compare_allocation,
    mismatch_attributes,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxResourceAmounts,
    SandboxResources,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    ComponentAllocation,
    ResourceAllocation,
)

pytestmark = pytest.mark.nemo_gym  # also run on NeMo Gym main (nemo_gym_support)


def allocation(*limits: SandboxResourceAmounts) -> ResourceAllocation:
    return ResourceAllocation(
        source="test",
        components=tuple(
            ComponentAllocation(f"c{index}", limits=limit) for index, limit in enumerate(limits)
        ),
    )


def test_compare_allocation_honoured_request_no_mismatch() -> None:
    """Limits equal to the request (CPU within a millicore) are no mismatch."""
    requested = SandboxResources(cpu=0.5, memory_mib=256)
    assert compare_allocation(requested, allocation(SandboxResourceAmounts(0.5004, 256))) == []


def test_compare_allocation_cpu_capped_below_request() -> None:
    """A CPU limit below the request is below_request, with both values."""
    found = compare_allocation(
        SandboxResources(cpu=2.0, memory_mib=512), allocation(SandboxResourceAmounts(1.0, 512))
    )
    assert found == [ResourceMismatch("cpu", "below_request", 2.0, 1.0)]


def test_compare_allocation_memory_above_request() -> None:
    """A memory limit above the request is above_request."""
    found = compare_allocation(
        SandboxResources(memory_mib=256), allocation(SandboxResourceAmounts(memory_mib=1024))
    )
    assert found == [ResourceMismatch("memory_mib", "above_request", 256, 1024)]


def test_compare_allocation_requested_without_limit() -> None:
    """A requested resource that nothing limits is no_limit, with no allocated value."""
    found = compare_allocation(
        SandboxResources(cpu=1.0, memory_mib=128), allocation(SandboxResourceAmounts())
    )
    assert found == [
        ResourceMismatch("cpu", "no_limit", 1.0, None),
        ResourceMismatch("memory_mib", "no_limit", 128, None),
    ]


def test_compare_allocation_components_summed() -> None:
    """Several components' limits add up; one unbounded component leaves the sandbox
    unbounded."""
    requested = SandboxResources(cpu=1.5, memory_mib=300)
    both = allocation(SandboxResourceAmounts(1.0, 200), SandboxResourceAmounts(0.5, 100))
    assert compare_allocation(requested, both) == []
    open_ended = allocation(SandboxResourceAmounts(1.0, 200), SandboxResourceAmounts(0.5))
    assert compare_allocation(requested, open_ended) == [
        ResourceMismatch("memory_mib", "no_limit", 300, None)
    ]


def test_compare_allocation_unrequested_or_unreported_ignored() -> None:
    """No request means nothing to compare; an allocation without components reports
    nothing about limits."""
    assert compare_allocation(None, allocation(SandboxResourceAmounts(cpu=1.0))) == []
    assert compare_allocation(SandboxResources(), allocation(SandboxResourceAmounts())) == []
    assert compare_allocation(SandboxResources(cpu=1.0), allocation()) == []


def test_compare_allocation_nemo_gym_and_mapping_requests() -> None:
    """The request may be NeMo Gym's SandboxResources or a mapping from a config."""
    nemo_gym: ModuleType = nemo_gym_sandbox()
    limits = allocation(SandboxResourceAmounts(cpu=1.0))
    theirs = nemo_gym.SandboxResources(cpu=4.0)
    assert compare_allocation(theirs, limits)[0].kind == "below_request"
    assert compare_allocation({"cpu": "4"}, limits)[0].requested == 4.0


def test_compare_allocation_bad_request_names_field() -> None:
    """A request that is not a finite, non-negative number raises ValueError naming it."""
    with pytest.raises(ValueError, match=r"cpu=-1"):
        compare_allocation({"cpu": -1}, allocation(SandboxResourceAmounts(cpu=1.0)))


def test_mismatch_attributes_keys_and_values() -> None:
    """Record attributes name each differing resource with its kind and both values; the
    allocated value is absent for no_limit."""
    attributes = mismatch_attributes(
        [
            ResourceMismatch("cpu", "below_request", 2.0, 1.0),
            ResourceMismatch("memory_mib", "no_limit", 128, None),
        ]
    )
    assert attributes == {
        MISMATCH_PREFIX + "resources": ("cpu", "memory_mib"),
        "nemo.gym.sandbox.allocation.mismatch.cpu.kind": "below_request",
        "nemo.gym.sandbox.allocation.mismatch.cpu.requested": 2.0,
        "nemo.gym.sandbox.allocation.mismatch.cpu.allocated": 1.0,
        "nemo.gym.sandbox.allocation.mismatch.memory_mib.kind": "no_limit",
        "nemo.gym.sandbox.allocation.mismatch.memory_mib.requested": 128,
    }
    assert mismatch_attributes([]) == {}


def test_mismatch_warnings_once_per_provider_and_resource(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One warning per (provider, resource), whatever the kind or how often it recurs."""
    warnings = MismatchWarnings(logging.getLogger("test.mismatch"))
    cpu_low = ResourceMismatch("cpu", "below_request", 2.0, 1.0)
    cpu_open = ResourceMismatch("cpu", "no_limit", 2.0, None)
    memory = ResourceMismatch("memory_mib", "above_request", 256, 512)
    with caplog.at_level(logging.WARNING, logger="test.mismatch"):
        warnings.warn("docker", [cpu_low])
        warnings.warn("docker", [cpu_open, memory])
        warnings.warn("docker", [cpu_low, memory])
        warnings.warn("process", [cpu_low])
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "sandbox provider 'docker': cpu capped below the request (requested 2, allocated 1); "
        "later cpu mismatches of this provider are counted on "
        "gym.sandbox.allocation.mismatches, not logged",
        "sandbox provider 'docker': memory_mib set above the request (requested 256, "
        "allocated 512); later memory_mib mismatches of this provider are counted on "
        "gym.sandbox.allocation.mismatches, not logged",
        "sandbox provider 'process': cpu capped below the request (requested 2, allocated 1); "
        "later cpu mismatches of this provider are counted on "
        "gym.sandbox.allocation.mismatches, not logged",
    ]
