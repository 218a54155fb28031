"""Sandbox fleet metrics and mismatch records of NeMo Gym's sandboxes under
``NemoGymInstrumentor``, against the installed wheel.

A registered provider capping CPU below the request (record, one warning, counter); our
process provider without cgroups (nothing limited) and with them (an OOM kill counted); our
Docker provider on Podman's service (container identity on the record); the counters made
once per meter provider. Each test runs with the global providers and with explicit
``tracer_provider=`` / ``meter_provider=`` (see ``nemo_gym_telemetry``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import pytest

from conftest import require_service
from nemo_gym_support import nemo_gym_sandbox
from nemo_gym_telemetry import (
    CREATIONS,
    LIFECYCLE,
    MISMATCH,
    MISMATCHES,
    OOM_KILLS,
    Telemetry,
    instrumented_fixture,  # noqa: F401 - a fixture, used by name
    one,
    register,
    resource_records,
    telemetry_fixture,  # noqa: F401 - a fixture, used by name
)
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.sandbox import _mismatch
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX
from test_docker_provider import (  # the engine checks of the Docker provider's own tests
    SUITE_ID,
    SUITE_LABEL,
    _image,
    _socket,
    engine_ready,  # noqa: F401 - a fixture, used by name
)

pytestmark = pytest.mark.nemo_gym  # also run on NeMo Gym main (nemo_gym_support)


@pytest.fixture
def nemo_gym() -> ModuleType:
    return nemo_gym_sandbox()


@pytest.mark.usefixtures("instrumented")
async def test_registered_provider_capped_cpu_reported(
    telemetry: Telemetry, nemo_gym: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """A registered provider that caps CPU below the request: each allocation record says so
    with both values, one warning for the provider and resource, one count per sandbox."""
    provider = nemo_gym.create_provider({register(nemo_gym): {}})
    spec = nemo_gym.SandboxSpec(resources=nemo_gym.SandboxResources(cpu=2.0, memory_mib=256))
    sandbox_ids = []
    with caplog.at_level(logging.WARNING, logger=_mismatch.logger.name):
        for _ in range(2):
            handle = await provider.create(spec)
            await provider.close(handle)
            sandbox_ids.append(handle.sandbox_id)
        allocations = [one(await resource_records(telemetry, i), "allocation") for i in sandbox_ids]
    await provider.aclose()

    for allocation in allocations:
        assert allocation[MISMATCH + "resources"] == ("cpu",)
        assert allocation[MISMATCH + "cpu.kind"] == "below_request"
        assert allocation[MISMATCH + "cpu.requested"] == 2.0
        assert allocation[MISMATCH + "cpu.allocated"] == 0.5
        assert MISMATCH + "memory_mib.kind" not in allocation
        assert "container.id" not in allocation  # a VM, not a container
    warnings = [r.getMessage() for r in caplog.records if r.name == _mismatch.logger.name]
    assert len(warnings) == 1
    assert "'capped'" in warnings[0]
    assert "requested 2, allocated 0.5" in warnings[0]
    mismatch_key = (
        ("nemo.gym.sandbox.mismatch", "below_request"),
        ("nemo.gym.sandbox.provider", "capped"),
        ("nemo.gym.sandbox.resource", "cpu"),
    )
    assert telemetry.points(MISMATCHES) == {mismatch_key: 2}
    created = (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "capped"))
    assert telemetry.points(CREATIONS) == {created: 2}
    telemetry.assert_nothing_elsewhere()


@pytest.mark.usefixtures("instrumented")
async def test_async_sandbox_otel_process_without_cgroups_reports_no_limit(
    telemetry: Telemetry, nemo_gym: ModuleType, sandbox_base_dir: Path
) -> None:
    """Our process provider without cgroups enforces nothing: asked for CPU and memory, its
    allocation record says neither is limited, and both are counted."""
    spec = nemo_gym.SandboxSpec(resources={"cpu": 0.5, "memory_mib": 64})
    config = {"otel_process": {"cgroups": False, "base_dir": str(sandbox_base_dir)}}
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        await sandbox.start()
        sandbox_id = sandbox._handle.sandbox_id
    allocation = one(await resource_records(telemetry, sandbox_id), "allocation")
    assert allocation[MISMATCH + "resources"] == ("cpu", "memory_mib")
    assert allocation[MISMATCH + "cpu.kind"] == "no_limit"
    assert allocation[MISMATCH + "memory_mib.kind"] == "no_limit"
    assert allocation[MISMATCH + "memory_mib.requested"] == 64
    assert MISMATCH + "memory_mib.allocated" not in allocation
    assert telemetry.points(MISMATCHES) == {
        (
            ("nemo.gym.sandbox.mismatch", "no_limit"),
            ("nemo.gym.sandbox.provider", "process"),
            ("nemo.gym.sandbox.resource", resource),
        ): 1
        for resource in ("cpu", "memory_mib")
    }
    telemetry.assert_nothing_elsewhere()


@pytest.mark.usefixtures("instrumented")
async def test_async_sandbox_otel_process_oom_kill_counted(
    telemetry: Telemetry, nemo_gym: ModuleType, sandbox_base_dir: Path
) -> None:
    """A command outgrowing the sandbox's cgroup memory limit is OOM-killed; the final sample
    shows it and gym.sandbox.oom_kills counts exactly the kills it shows. The limit honours
    the request, so there is no mismatch."""
    require_service(
        ProcessSandboxProvider().cgroup_version is not None, "no writable cgroup hierarchy"
    )
    spec = nemo_gym.SandboxSpec(resources={"memory_mib": 48})
    config = {"otel_process": {"base_dir": str(sandbox_base_dir)}}
    # dd's 200 MiB block is one buffer, filled from /dev/zero (nothing outside the system
    # directories, which are all an isolated sandbox sees).
    hog = "exec dd if=/dev/zero of=/dev/null bs=200M count=1"
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        await sandbox.start()
        result = await sandbox.exec(hog, timeout_s=60)
        assert result.error_type == "oom_kill"
        sandbox_id = sandbox._handle.sandbox_id
    records = await resource_records(telemetry, sandbox_id)
    kills = one(records, "sample")[PREFIX + "usage.oom_kills"]
    assert kills >= 1
    assert (
        one(records, "allocation")[PREFIX + "allocation.component.sandbox.limits.memory_mib"] == 48
    )
    assert telemetry.points(OOM_KILLS) == {(("nemo.gym.sandbox.provider", "process"),): kills}
    assert telemetry.points(MISMATCHES) == {}
    telemetry.assert_nothing_elsewhere()


@pytest.mark.integration
@pytest.mark.usefixtures("instrumented", "engine_ready")
async def test_async_sandbox_otel_docker_container_identity(
    telemetry: Telemetry, nemo_gym: ModuleType
) -> None:
    """AsyncSandbox with our Docker provider by name, on Podman's service: one span per call,
    the allocation record carries container.id and container.runtime.name, no mismatch."""
    spec = nemo_gym.SandboxSpec(
        image=_image(),
        metadata={SUITE_LABEL: SUITE_ID},
        resources=nemo_gym.SandboxResources(cpu=0.5, memory_mib=96),
    )
    config = {"otel_docker": {"docker_host": f"unix://{_socket()}", "api_timeout_s": 15}}
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        await sandbox.start()
        assert (await sandbox.exec("echo ok")).stdout.strip() == "ok"
        sandbox_id = sandbox._handle.sandbox_id
    allocation = one(await resource_records(telemetry, sandbox_id), "allocation")
    names = [s.name for s in telemetry.finished() if s.name in LIFECYCLE]
    assert names == ["sandbox.create", "sandbox.exec", "sandbox.close"]
    assert allocation["container.id"] == sandbox_id
    assert allocation["container.runtime.name"] == "podman"
    assert not [k for k in allocation if k.startswith(MISMATCH)]
    created = (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "docker"))
    assert telemetry.points(CREATIONS) == {created: 1}
    assert telemetry.points(MISMATCHES) == {}
    telemetry.assert_nothing_elsewhere()


def test_fleet_metrics_made_once_per_meter_provider(
    telemetry: Telemetry, nemo_gym: ModuleType
) -> None:
    """Instrumenting again with the same meter provider counts into the same series."""
    instrumentor = NemoGymInstrumentor()
    name = register(nemo_gym)
    for _ in range(2):
        instrumentor.uninstrument()
        instrumentor.instrument(connection_pool=False, **telemetry.instrument_kwargs)
        try:
            with nemo_gym.Sandbox({name: {}}, nemo_gym.SandboxSpec()) as sandbox:
                sandbox.start()
        finally:
            instrumentor.uninstrument()
    created = (("nemo.gym.sandbox.outcome", "created"), ("nemo.gym.sandbox.provider", "capped"))
    assert telemetry.points(CREATIONS) == {created: 2}
