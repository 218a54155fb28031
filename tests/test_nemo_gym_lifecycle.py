"""Sandbox lifecycle metrics and usage totals of NeMo Gym's sandboxes under
``NemoGymInstrumentor``, against the installed wheel (0.4, which has no ``gym_metrics`` of its
own): a provider NeMo Gym builds from its registry, our process provider and our Docker
provider on Podman's service, all by name through ``AsyncSandbox``, each seen in NeMo Gym's
metric names. Each test runs with the global providers and with explicit
``tracer_provider=`` / ``meter_provider=`` (see ``nemo_gym_telemetry``).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from nemo_gym_support import nemo_gym_sandbox
from nemo_gym_telemetry import (
    Telemetry,
    instrumented_fixture,  # noqa: F401 - a fixture, used by name
    one,
    register,
    resource_records,
    telemetry_fixture,  # noqa: F401 - a fixture, used by name
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX
from test_docker_provider import (  # the engine checks of the Docker provider's own tests
    SUITE_ID,
    SUITE_LABEL,
    _image,
    _socket,
    engine_ready,  # noqa: F401 - a fixture, used by name
)

PROVIDER, SERVER = "nemo.gym.sandbox.provider", "nemo.gym.server.name"
HISTOGRAMS = (
    "gym.sandbox.startup_duration_ms",
    "gym.sandbox.exec_duration_ms",
    "gym.sandbox.transfer_duration_ms",
)
NAMES = ("gym.sandbox.active", *HISTOGRAMS, "gym.sandbox.cpu.time", "gym.sandbox.memory.peak")


@pytest.fixture
def nemo_gym() -> ModuleType:
    return nemo_gym_sandbox()


def figures(reader: InMemoryMetricReader | None) -> dict[str, dict[tuple[Any, ...], float]]:
    """Metric name -> sorted attributes -> value (a sum or gauge) or count (a histogram)."""
    found: dict[str, dict[tuple[Any, ...], float]] = {}
    data = reader.get_metrics_data() if reader is not None else None
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name not in NAMES:
                    continue
                for point in metric.data.data_points:
                    key = tuple(sorted((point.attributes or {}).items()))
                    value = getattr(point, "count", None)
                    found.setdefault(metric.name, {})[key] = (
                        point.value if value is None else value  # type: ignore[union-attr]
                    )
    return found


async def run_sandbox(
    nemo_gym: ModuleType, config: dict[str, Any], spec: Any, tmp: Path, remote: str = "/tmp/in.txt"
) -> str:
    """One sandbox through AsyncSandbox: start, two commands, an upload and a download (of
    ``remote``, inside the sandbox)."""
    source = tmp / "in.txt"
    source.write_text("hello")
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        await sandbox.start()
        await sandbox.exec("echo ok")
        await sandbox.exec("true")
        await sandbox.upload(source, remote)
        await sandbox.download(remote, tmp / "out.txt")
        sandbox_id: str = sandbox._handle.sandbox_id
    return sandbox_id


def assert_lifecycle(telemetry: Telemetry, provider: str, sandboxes: int) -> None:
    """Each sandbox was started, ran two commands and two transfers, and was released."""
    found = figures(telemetry.reader)
    key = ((PROVIDER, provider),)
    assert found["gym.sandbox.active"] == {key: 0}
    assert found["gym.sandbox.startup_duration_ms"] == {key: sandboxes}
    assert found["gym.sandbox.exec_duration_ms"] == {key: 2 * sandboxes}
    assert found["gym.sandbox.transfer_duration_ms"] == {key: 2 * sandboxes}
    assert figures(telemetry.elsewhere_reader) == {}


@pytest.mark.usefixtures("instrumented")
async def test_async_sandbox_registered_provider_lifecycle_and_usage(
    telemetry: Telemetry, nemo_gym: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A provider NeMo Gym builds from its registry: NeMo Gym's lifecycle metrics, and the
    CPU time of its samples (0.25 s each) per provider and NeMo Gym server."""
    monkeypatch.setenv("NEMO_GYM_CONFIG_PATH", "swe_env")
    name = register(nemo_gym)
    sandbox_ids = [
        await run_sandbox(nemo_gym, {name: {}}, nemo_gym.SandboxSpec(), tmp_path) for _ in "ab"
    ]
    for sandbox_id in sandbox_ids:
        await resource_records(telemetry, sandbox_id)  # the final samples have been taken
    assert_lifecycle(telemetry, "capped", 2)
    cpu = figures(telemetry.reader)["gym.sandbox.cpu.time"]
    assert cpu == {((PROVIDER, "capped"), (SERVER, "swe_env")): 0.5}


@pytest.mark.usefixtures("instrumented")
async def test_async_sandbox_otel_process_lifecycle(
    telemetry: Telemetry, nemo_gym: ModuleType, tmp_path: Path, sandbox_base_dir: Path
) -> None:
    """Our process provider by name: NeMo Gym's lifecycle metrics, under provider process."""
    config = {"otel_process": {"cgroups": False, "base_dir": str(sandbox_base_dir)}}
    await run_sandbox(nemo_gym, config, nemo_gym.SandboxSpec(), tmp_path, remote="in.txt")
    assert_lifecycle(telemetry, "process", 1)


@pytest.mark.integration
@pytest.mark.usefixtures("instrumented", "engine_ready")
async def test_async_sandbox_otel_docker_lifecycle_and_usage(
    telemetry: Telemetry, nemo_gym: ModuleType, tmp_path: Path
) -> None:
    """Our Docker provider on Podman's service: NeMo Gym's lifecycle metrics, and the final
    sample's CPU time and memory peak, exactly, in the usage totals."""
    spec = nemo_gym.SandboxSpec(
        image=_image(),
        metadata={SUITE_LABEL: SUITE_ID},
        resources=nemo_gym.SandboxResources(cpu=0.5, memory_mib=96),
    )
    config = {"otel_docker": {"docker_host": f"unix://{_socket()}", "api_timeout_s": 15}}
    sandbox_id = await run_sandbox(nemo_gym, config, spec, tmp_path)
    final = one(await resource_records(telemetry, sandbox_id), "sample")
    assert_lifecycle(telemetry, "docker", 1)
    found = figures(telemetry.reader)
    key = ((PROVIDER, "docker"),)
    assert found["gym.sandbox.cpu.time"] == {key: pytest.approx(final[PREFIX + "usage.cpu.time_s"])}
    peak_mib = final.get(PREFIX + "usage.memory_peak_mib", final[PREFIX + "usage.memory_mib"])
    assert found["gym.sandbox.memory.peak"] == {key: round(peak_mib * 1024 * 1024)}
