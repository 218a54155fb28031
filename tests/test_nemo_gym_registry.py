"""Our providers in NeMo Gym's sandbox registry, by name, after ``pip install`` alone.

Against the installed ``nemo-gym`` wheel: entry-point discovery through ``list_providers()``,
``AsyncSandbox({"otel_process": {...}}, spec)`` end to end, NeMo Gym's own spec, resources and
handle objects (and plain mappings) accepted by both providers, and constructor options as a
YAML config gives them, validated with errors naming the option and the value. The Docker
provider runs against Podman's Docker-compatible service (skipped without it, failing under
``CI=true``).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from nemo_gym_support import nemo_gym_main, nemo_gym_sandbox
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxResources,
    SandboxSpec,
    _spec_from,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.docker import (
    DockerSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from test_docker_provider import (  # the engine checks of the Docker provider's own tests
    SUITE_ID,
    SUITE_LABEL,
    _image,
    _socket,
    engine_ready,  # noqa: F401 - a fixture, used by name
)

pytestmark = pytest.mark.nemo_gym  # also run on NeMo Gym main (nemo_gym_support)

# NeMo Gym's built-in provider names: 0.4.0 has apptainer and opensandbox, main all seven.
NEMO_GYM_BUILT_INS = {
    "apptainer",
    "opensandbox",
    "docker",
    "daytona",
    "ecs_fargate",
    "enroot",
    "openshell",
}
OURS = {
    "otel_process": ProcessSandboxProvider,
    "otel_docker": DockerSandboxProvider,
}


@pytest.fixture
def nemo_gym() -> ModuleType:
    return nemo_gym_sandbox()


def test_entry_points_published_in_nemo_gym_group() -> None:
    """Both providers are published in NeMo Gym's entry-point group, by this distribution."""
    published = {
        ep.name: ep for ep in importlib.metadata.entry_points(group="nemo_gym.sandbox_providers")
    }
    for name, cls in OURS.items():
        assert published[name].load() is cls
        assert published[name].dist is not None
        assert published[name].dist.name == "opentelemetry-instrumentation-nemo-gym"


def test_list_providers_names_ours_clear_of_built_ins(nemo_gym: ModuleType) -> None:
    """list_providers() finds our names, none of which is a present or announced built-in."""
    available = set(nemo_gym.list_providers())
    assert set(OURS) <= available
    assert not set(OURS) & NEMO_GYM_BUILT_INS
    for name, cls in OURS.items():
        assert nemo_gym.get_provider_class(name) is cls


@pytest.mark.nemo_gym_main
def test_nemo_gym_main_built_ins_are_the_ones_ours_avoid() -> None:
    """NeMo Gym main's built-in providers are exactly the names ours keep clear of, and each
    name still resolves to NeMo Gym's own class, ours to ours."""
    nemo_gym = nemo_gym_main()
    registry = importlib.import_module("nemo_gym.sandbox.providers.registry")
    assert set(registry._BUILTIN_PROVIDER_LOADERS) == NEMO_GYM_BUILT_INS
    assert NEMO_GYM_BUILT_INS | set(OURS) <= set(nemo_gym.list_providers())
    assert nemo_gym.get_provider_class("docker").__module__.startswith("nemo_gym.sandbox.")
    for name, cls in OURS.items():
        assert nemo_gym.get_provider_class(name) is cls


async def test_async_sandbox_otel_process_end_to_end(
    nemo_gym: ModuleType, tmp_path: Path, sandbox_base_dir: Path
) -> None:
    """AsyncSandbox picks the process provider by its registry name and runs a command, with
    files uploaded by NeMo Gym and a download back."""
    spec = nemo_gym.SandboxSpec(
        files={"greeting.txt": "hello"},
        env={"WHO": "gym"},
        resources={"cpu": 0.5, "memory_mib": 256},
    )
    async with nemo_gym.AsyncSandbox(
        {"otel_process": {"cgroups": False, "base_dir": str(sandbox_base_dir)}}, spec
    ) as sandbox:
        await sandbox.start()
        result = await sandbox.exec('printf "%s %s" "$(cat greeting.txt)" "$WHO"')
        assert (result.return_code, result.stdout) == (0, "hello gym")
        await sandbox.download("greeting.txt", tmp_path / "back.txt")
        assert (await sandbox.status()).value == "running"
    assert (tmp_path / "back.txt").read_text() == "hello"
    assert (await sandbox.status()).value == "stopped"


@pytest.mark.nemo_gym_main
async def test_async_sandbox_otel_process_ports_without_endpoint(sandbox_base_dir: Path) -> None:
    """A NeMo Gym main spec declaring ports starts a process sandbox (its ports ignored, as
    NeMo Gym's own apptainer does), and asking for an endpoint raises NeMo Gym's error."""
    nemo_gym = nemo_gym_main()
    spec = nemo_gym.SandboxSpec(ports=[8080])
    config = {"otel_process": {"cgroups": False, "base_dir": str(sandbox_base_dir)}}
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        await sandbox.start()
        assert (await sandbox.exec("echo up")).stdout == "up\n"
        with pytest.raises(NotImplementedError, match="'process' does not support service"):
            await sandbox.endpoint(8080)


async def test_process_provider_nemo_gym_objects(
    nemo_gym: ModuleType, sandbox_base_dir: Path
) -> None:
    """NeMo Gym's SandboxSpec with its SandboxResources, and its SandboxHandle rebuilt from the
    id, work with the process provider as ours do."""
    provider = ProcessSandboxProvider(cgroups=False, base_dir=sandbox_base_dir)
    spec = nemo_gym.SandboxSpec(
        workdir="work",
        resources=nemo_gym.SandboxResources(cpu=1.0, memory_mib=128),
    )
    handle = await provider.create(spec)
    try:
        theirs = nemo_gym.SandboxHandle(handle.sandbox_id, "otel_process", None)
        result = await provider.exec(theirs, "basename $(pwd)")
        assert result.stdout.strip() == "work"
        assert (await provider.status(theirs)).value == "running"
    finally:
        await provider.close(handle)
    await provider.aclose()


async def test_process_provider_mapping_spec(sandbox_base_dir: Path) -> None:
    """A plain mapping spec, resources included, creates a sandbox."""
    provider = ProcessSandboxProvider(cgroups=False, base_dir=sandbox_base_dir)
    handle = await provider.create(
        {"files": {"a.txt": "x"}, "resources": {"cpu": "0.5", "memory_mib": 64}}  # type: ignore[arg-type]
    )
    try:
        assert (await provider.exec(handle, "cat a.txt")).stdout == "x"
    finally:
        await provider.aclose()


def test_spec_from_nemo_gym_and_mappings(nemo_gym: ModuleType) -> None:
    """_spec_from gives our SandboxSpec from NeMo Gym's and from a mapping, with resources
    validated as ours; unknown mapping keys name the allowed ones."""
    theirs = nemo_gym.SandboxSpec(image="busybox", resources={"cpu": 2, "gpu_type": "a100"})
    ours = _spec_from(theirs)
    assert isinstance(ours, SandboxSpec)
    assert ours.image == "busybox"
    assert ours.resources == SandboxResources(cpu=2.0, gpu_type="a100")
    assert _spec_from({"image": "x"}).image == "x"
    with pytest.raises(ValueError, match=r"unknown sandbox spec keys: cmd; allowed keys: "):
        _spec_from({"cmd": "ls"})
    with pytest.raises(ValueError, match=r"memory_mib=-1"):
        _spec_from({"resources": {"memory_mib": -1}})


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("otel_process", {"cgroups": "no"}, "cgroups='no' must be true or false"),
        ("otel_process", {"cgroup_parent": 7}, "cgroup_parent=7 must be a string"),
        ("otel_process", {"base_dir": 3}, "base_dir=3 must be a path or None"),
        ("otel_process", {"max_output_bytes": "1M"}, "max_output_bytes='1M' must be an integer"),
        ("otel_docker", {"api_timeout_s": "30"}, "api_timeout_s='30' must be a positive"),
        ("otel_docker", {"ready_timeout_s": -1}, "ready_timeout_s=-1 must be a positive"),
        ("otel_docker", {"docker_host": 5}, "docker_host=5 must be a unix:// address"),
    ],
)
def test_create_provider_bad_option_names_it(
    nemo_gym: ModuleType, name: str, options: dict[str, Any], message: str
) -> None:
    """A bad option from a config raises ValueError naming the option and the value."""
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        nemo_gym.create_provider({name: options})


def test_create_provider_unknown_option_named(nemo_gym: ModuleType) -> None:
    """An option the provider does not take is named in the TypeError Python raises."""
    with pytest.raises(TypeError, match="cgroup_root"):
        nemo_gym.create_provider({"otel_process": {"cgroup_root": "x"}})


@pytest.mark.integration
@pytest.mark.usefixtures("engine_ready")
async def test_async_sandbox_otel_docker_end_to_end(nemo_gym: ModuleType) -> None:
    """AsyncSandbox picks the Docker provider by name; NeMo Gym's spec and resources reach the
    engine, which enforces the requested memory."""
    spec = nemo_gym.SandboxSpec(
        image=_image(),
        metadata={SUITE_LABEL: SUITE_ID},
        files={"in.txt": "payload"},
        resources=nemo_gym.SandboxResources(cpu=0.5, memory_mib=96),
    )
    config = {"otel_docker": {"docker_host": f"unix://{_socket()}", "api_timeout_s": 15}}
    async with nemo_gym.AsyncSandbox(config, spec) as sandbox:
        await sandbox.start()
        result = await sandbox.exec(
            "cat /in.txt; echo; cat /sys/fs/cgroup/memory.max "
            "2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
        )
        assert result.return_code == 0, result.stderr
        payload, limit = result.stdout.split()
        assert payload == "payload"
        assert int(limit) == 96 * 1024 * 1024
        allocation = await sandbox._provider.resource_allocation(sandbox._handle)
        assert allocation.components[0].limits.cpu == 0.5
        assert allocation.designator.kind == "container"
    assert (await sandbox.status()).value == "stopped"
