"""Resource readers: records for providers that do not implement ``ResourceProvider``.

A provider the plugin does not know (here one of the test's own in NeMo Gym's registry,
named ``docker`` like NeMo Gym's) gets records saying allocation and usage are unknown and
why. The reader of NeMo Gym's built-in docker provider is driven through the real ``docker``
CLI against Podman (``DOCKER_HOST``): its allocation equals ``otel_docker``'s for the same
container, and its fallback sample comes from ``docker stats``. NeMo Gym main's provider
itself is exercised in ``test_nemo_gym_main_providers.py``.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from conftest import require_service
from nemo_gym_support import nemo_gym_sandbox
from nemo_gym_telemetry import (
    FINAL,
    KIND,
    PROVIDER,
    REQUEST_ID,
    SANDBOX_ID,
    Telemetry,
    attrs,
    instrumented_fixture,  # noqa: F401 - a fixture, used by name
    register,
    resource_records,
    telemetry_fixture,  # noqa: F401 - a fixture, used by name
)
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    MIB,
    ContainerResourceAmounts,
    SandboxHandle,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.docker import (
    DockerSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.readers import READERS, resource_source
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.docker_cli import (
    CLI_STATS_SOURCE,
    DockerCliReader,
    sample_from_cli_stats,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.unknown import UnknownResourcesReader
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX
from test_docker_provider import (  # noqa: F401 - engine_ready: a fixture, used by name
    _image,
    _socket,
    engine,
    engine_ready,
)


class DockerProvider:
    """A user's provider that happens to share NeMo Gym's class name and provider name."""

    name = "docker"

    async def create(self, spec: Any) -> Any:
        from nemo_gym.sandbox import SandboxHandle as NemoGymHandle

        return NemoGymHandle(sandbox_id=uuid.uuid4().hex, provider_name=self.name, raw=None)

    async def exec(self, handle: Any, command: str, **kwargs: Any) -> Any:
        from nemo_gym.sandbox import SandboxExecResult

        return SandboxExecResult(stdout="", stderr="", return_code=0)

    async def close(self, handle: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None


def test_resource_source_keys_readers_by_class_not_name() -> None:
    """A provider named ``docker`` outside NeMo Gym's module gets the unknown reader, never the
    CLI reader, and one reader per provider object."""
    provider = DockerProvider()
    reader = resource_source(provider)
    assert isinstance(reader, UnknownResourcesReader)
    assert resource_source(provider) is reader
    assert (DockerProvider.__module__, "DockerProvider") not in READERS
    assert READERS[("nemo_gym.sandbox.providers.docker.provider", "DockerProvider")] is (
        DockerCliReader
    )


async def test_unknown_provider_records_say_unknown_and_why(
    telemetry: Telemetry, instrumented: NemoGymInstrumentor
) -> None:
    """Through NeMo Gym's registry and AsyncSandbox, an unknown provider's sandbox gets one
    allocation record and one final sample, each saying why nothing is known, and no figure."""
    nemo_gym: ModuleType = nemo_gym_sandbox()
    name = register(nemo_gym, DockerProvider)
    async with nemo_gym.AsyncSandbox({name: {}}, nemo_gym.SandboxSpec()) as sandbox:
        await sandbox.start()
        await sandbox.exec("true")
    (create,) = [attrs(s) for s in telemetry.finished("sandbox.create")]
    identity = {k: create[k] for k in (REQUEST_ID, PROVIDER, SANDBOX_ID)}
    records = await resource_records(telemetry, str(create[SANDBOX_ID]))
    assert sorted(records, key=lambda r: str(r[KIND])) == [
        {
            **identity,
            KIND: "allocation",
            FINAL: False,
            PREFIX + "allocation.unknown_reason": "unknown_provider",
        },
        {
            **identity,
            KIND: "sample",
            FINAL: True,
            PREFIX + "usage.unknown_reason": "unknown_provider",
        },
    ]
    assert telemetry.points("gym.sandbox.oom_kills") == {}
    telemetry.assert_nothing_elsewhere()


def test_sample_from_cli_stats_reads_docker_and_podman_sizes() -> None:
    """Docker's binary and Podman's decimal sizes become MiB, pids an int; nothing else is
    guessed, and an unreadable field is absent, never 0."""
    assert sample_from_cli_stats({"MemUsage": "444KiB / 64MiB", "PIDs": "2"}) == {
        "usage.memory_mib": 444 / 1024,
        "usage.pids": 2,
    }
    assert sample_from_cli_stats({"MemUsage": "1.5MB / 67.11MB", "PIDS": 3}) == {
        "usage.memory_mib": 1.5e6 / MIB,
        "usage.pids": 3,
    }
    assert sample_from_cli_stats({"MemUsage": "--", "PIDs": "--", "CPUPerc": "0.5%"}) == {}


class _StatsOnlyReader(DockerCliReader):
    """The CLI reader as where this host cannot read the container's cgroup."""

    _cgroup_sampling = False


class _CliProvider:
    """What the reader needs of NeMo Gym's DockerProvider: the binary it drives."""

    def __init__(self, binary: str) -> None:
        self._binary = binary


@pytest.fixture
def cli_container(engine_ready: None) -> Iterator[str]:  # noqa: F811 - the fixture, by name
    """A container started with the docker CLI as NeMo Gym's provider starts one."""
    binary = shutil.which("docker")
    require_service(binary is not None, "the docker CLI is not on PATH")
    assert binary is not None
    name = f"nemo-gym-{uuid.uuid4().hex}"
    subprocess.run(
        [binary, "run", "-d", "--name", name, "--cpus", "0.5", "--memory", "64m",
         "--memory-swap", "64m", "--pids-limit", "32", "--entrypoint", "/bin/sh", _image(), "-c",
         "while :; do sleep 2147483647; done"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    try:
        yield name
    finally:
        subprocess.run([binary, "rm", "-f", name], check=False, capture_output=True, timeout=120)


async def test_docker_cli_reader_matches_otel_docker_and_falls_back_to_stats(
    cli_container: str,
) -> None:
    """Through the CLI, the allocation is what otel_docker reads over the Engine API for the
    same container (same scope and host), the sample comes from the cgroup, and without the
    cgroup from ``docker stats``."""
    binary = shutil.which("docker")
    assert binary is not None
    handle = SandboxHandle(sandbox_id=cli_container, provider_name="docker", raw=None)
    reader = DockerCliReader(_CliProvider(binary))
    allocation = await reader.resource_allocation(handle)
    engine_api = DockerSandboxProvider(api_timeout_s=15.0)
    try:
        container_id = allocation.designator.id if allocation.designator else ""
        by_id = SandboxHandle(sandbox_id=container_id, provider_name="docker", raw=None)
        assert allocation == await engine_api.resource_allocation(by_id)
    finally:
        await engine_api.aclose()
    limits = allocation.components[0].limits
    assert limits == ContainerResourceAmounts(cpu=0.5, memory_mib=64, pids=32)
    assert len(container_id) == 64

    sample = await reader.resource_sample(handle)
    assert str(sample["usage.source"]).startswith("cgroup.v")
    assert sample["usage.pids"] == 2  # the keep-alive shell and its sleep

    stats = await _StatsOnlyReader(_CliProvider(binary)).resource_sample(handle)
    assert stats["usage.source"] == CLI_STATS_SOURCE
    assert stats["usage.pids"] == 2
    assert stats["usage.oom_killed"] is False
    assert isinstance(stats["usage.memory_mib"], float)
    assert set(stats) == {"usage.source", "usage.oom_killed", "usage.memory_mib", "usage.pids"}


@pytest.fixture
def podman_cli_container(engine_ready: None) -> Iterator[str]:  # noqa: F811 - the fixture
    """A container Podman's own CLI started on the engine, asking for no pids limit."""
    _, version = engine("GET", "/v1.41/version")
    if "Podman Engine" not in [c.get("Name") for c in version.get("Components", ())]:
        pytest.skip("the engine is not Podman: no Podman default to read")
    podman = shutil.which("podman")
    require_service(podman is not None, "the podman CLI is not on PATH")
    assert podman is not None
    remote = [podman, "--remote", "--url", f"unix://{_socket()}"]
    name = f"nemo-gym-{uuid.uuid4().hex}"
    subprocess.run(
        [*remote, "run", "-d", "--name", name, "--entrypoint", "/bin/sh", _image(), "-c",
         "while :; do sleep 2147483647; done"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    try:
        yield name
    finally:
        subprocess.run([*remote, "rm", "-f", name], check=False, capture_output=True, timeout=120)


async def test_docker_cli_reader_records_podman_default_pids_limit(
    podman_cli_container: str,
) -> None:
    """A container Podman's own CLI started without a pids limit has the one Podman set by
    default (``pids_limit`` in containers.conf, 2048), and the CLI reader records that figure
    as the engine's inspect reports it, as otel_docker's reader does."""
    binary = shutil.which("docker")
    require_service(binary is not None, "the docker CLI is not on PATH")
    assert binary is not None
    _, inspect = await asyncio.to_thread(
        engine, "GET", f"/v1.41/containers/{podman_cli_container}/json"
    )
    assert inspect["HostConfig"]["PidsLimit"] == 2048
    handle = SandboxHandle(sandbox_id=podman_cli_container, provider_name="docker", raw=None)
    allocation = await DockerCliReader(_CliProvider(binary)).resource_allocation(handle)
    assert allocation.components[0].limits == ContainerResourceAmounts(pids=2048)
    engine_api = DockerSandboxProvider(api_timeout_s=15.0)
    try:
        by_id = SandboxHandle(sandbox_id=inspect["Id"], provider_name="docker", raw=None)
        assert allocation == await engine_api.resource_allocation(by_id)
    finally:
        await engine_api.aclose()


def test_opensandbox_server_scope_is_host_and_port_only() -> None:
    """The OpenSandbox designator's scope is the server's host:port, with or without a scheme,
    never user-info, a path or a query."""
    from types import SimpleNamespace

    from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import server_scope

    def scope(domain: object) -> str | None:
        return server_scope(SimpleNamespace(_connection=SimpleNamespace(domain=domain)))

    assert scope("127.0.0.1:8080") == "127.0.0.1:8080"
    assert scope("https://user:secret@sandbox.example:443/v1?token=x") == "sandbox.example:443"
    assert scope("opensandbox-server.opensandbox-system.svc.cluster.local") == (
        "opensandbox-server.opensandbox-system.svc.cluster.local"
    )
    assert scope(None) is None
    assert scope("") is None
    assert server_scope(object()) is None


def test_opensandbox_oom_status_is_read_as_nemo_gym_reads_it() -> None:
    """A status whose reason or message says OOM-killed or out of memory is an OOM, as NeMo
    Gym's provider reads it; the Docker runtime's exit-code message is not."""
    from types import SimpleNamespace

    from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import says_oom

    def info(reason: str, message: str) -> object:
        return SimpleNamespace(status=SimpleNamespace(reason=reason, message=message))

    assert says_oom(info("OOMKilled", "")) is True  # Kubernetes's container reason
    assert says_oom(info("OOM_KILLED", "")) is True
    assert says_oom(info("", "container ran out of memory")) is True
    assert says_oom(info("CONTAINER_EXITED_ERROR", "Sandbox container exited with code 137.")) is (
        False
    )
    assert says_oom(object()) is False
