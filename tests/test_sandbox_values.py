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


# --- impossible figures: more than the answer's own total --------------------------------------


@pytest.fixture
def fresh_once_log() -> None:
    """Forget which problems were logged, so this test sees its own first warnings."""
    from opentelemetry.instrumentation.nemo_gym.sandbox import _log

    _log._FAILURES.reset()


def _dropped(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage().split(":")[0]
        for r in caplog.records
        if r.levelno == logging.WARNING and "more than the answer's own" in r.getMessage()
    ]


def test_opensandbox_metrics_beyond_the_answers_own_totals_are_dropped(
    fresh_once_log: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A metrics answer's CPU percentage above 100 x its cpu_count (100 without a count of at
    least 1) and memory above its memory_total_in_mib are dropped and logged once per figure;
    figures at the bound, and figures without a usable total, are kept."""
    from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import (
        _sample_from_metrics,
    )

    def answer(**figures: object) -> dict[str, Attribute]:
        base = {"cpu_count": 2.0, "memory_total_in_mib": 1024.0, "timestamp": 7}
        return _sample_from_metrics(SimpleNamespace(**{**base, **figures}))

    cpu, memory = "usage.opensandbox.cpu_used_percent", "usage.opensandbox.memory_used_mib"
    kept = {"usage.source": "opensandbox.metrics", "usage.opensandbox.timestamp_ms": 7}
    with caplog.at_level(logging.WARNING):
        assert answer(cpu_used_percentage=1e9, memory_used_in_mib=1e13) == kept
        assert answer(cpu_used_percentage=200.5, memory_used_in_mib=1024.5) == kept
        assert answer(cpu_used_percentage=200.0, memory_used_in_mib=1024.0) == {
            **kept,
            cpu: 200.0,
            memory: 1024.0,
        }
        # No CPU count of at least 1: the percentage's own range, 0 to 100.
        assert answer(cpu_count=0.0, cpu_used_percentage=100.5) == kept
        assert answer(cpu_count=None, cpu_used_percentage=100.0) == {**kept, cpu: 100.0}
        # No usable memory total: nothing to bound the memory figure by.
        for total in (None, math.nan, 0.0, -1.0, math.inf):
            assert answer(memory_total_in_mib=total, memory_used_in_mib=5e6) == {
                **kept,
                memory: 5e6,
            }
    assert _dropped(caplog) == [
        "dropping sample value usage.opensandbox.cpu_used_percent",
        "dropping sample value usage.opensandbox.memory_used_mib",
    ]


def test_engine_stats_memory_beyond_the_answers_limit_is_dropped(
    fresh_once_log: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Engine stats (the Engine API's answer and the CLI's ``MemUsage``) whose memory is above
    the same answer's limit give no memory figure (logged once); at the limit they do."""
    from opentelemetry.instrumentation.nemo_gym.sandbox.providers._docker_resources import (
        sample_from_stats,
    )
    from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import MIB
    from opentelemetry.instrumentation.nemo_gym.sandbox.readers.docker_cli import (
        sample_from_cli_stats,
    )

    def stats(usage: int, peak: int) -> dict[str, Any]:
        return {
            "memory_stats": {"usage": usage, "max_usage": peak, "limit": 64 * MIB},
            "pids_stats": {"current": 2},
        }

    with caplog.at_level(logging.WARNING):
        assert sample_from_stats(stats(10**13, 10**13)) == {"usage.pids": 2}
        assert sample_from_stats(stats(64 * MIB, 64 * MIB)) == {
            "usage.memory_mib": 64.0,
            "usage.memory_peak_mib": 64.0,
            "usage.pids": 2,
        }
        assert sample_from_cli_stats({"MemUsage": "9.1TiB / 64MiB", "PIDs": "2"}) == {
            "usage.pids": 2
        }
        assert sample_from_cli_stats({"MemUsage": "64MiB / 64MiB"}) == {"usage.memory_mib": 64.0}
    assert _dropped(caplog) == [
        "dropping sample value usage.memory_mib",
        "dropping sample value usage.memory_peak_mib",
    ]
