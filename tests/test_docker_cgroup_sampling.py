"""DockerSandboxProvider's two sampling paths on one real container (Podman's service): the
container's cgroup read from this host, and the engine's stats endpoint (what a remote engine
leaves); and OOM kills inside a container that survives them.

Engine, image and the leftover check are test_docker_provider.py's (see there)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.span_support import (
    FINAL,
    KIND,
    SANDBOX_ID,
    attributes_of,
    carried_forward,
    matching,
    usage_figures,
)
from tests.test_docker_provider import (  # noqa: F401 - fixtures used by name
    _nothing_left_behind,
    _socket,
    engine,
    engine_ready,
    provider,
    records,
    spec,
    stopped,
)

from opentelemetry.instrumentation.nemo_gym.sandbox.providers._container_cgroup import (
    container_cgroup,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxHandle,
    SandboxStatus,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.docker import (
    DockerSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ResourceSampler,
)
from waiting import eventually

# A command whose memory grows without bound: tail keeps the last lines of input that has
# no newline, so it holds all 300 MB; the 64 MiB limit makes the kernel kill it. Its
# oom_score_adj (inherited by the pipeline) makes it the kernel's first choice in the
# container, never the container's main process (seen chosen on a loaded machine).
# One process that grows until the kernel kills it: `sort` holds its one endless line of
# /dev/zero in memory. Not a pipeline, whose writer the kernel can take as a second victim
# while it reaps the first (seen as two kills on a loaded machine).
OOM_COMMAND = "echo 1000 >/proc/self/oom_score_adj; exec sort /dev/zero"


class StatsOnlyProvider(DockerSandboxProvider):
    """Samples as for a remote engine: every one through the stats endpoint."""

    _cgroup_sampling = False


@pytest.fixture
async def stats_provider(engine_ready: None) -> AsyncIterator[DockerSandboxProvider]:  # noqa: F811
    docker = StatsOnlyProvider(f"unix://{_socket()}", api_timeout_s=15.0)
    yield docker
    await docker.aclose()


def _pid(container_id: str) -> int:
    status, answer = engine("GET", f"/v1.41/containers/{container_id}/json")
    assert status == 200, answer
    return int(answer["State"]["Pid"])


def _v2_inactive_file_mib(container_id: str) -> float:
    """The container's inactive file cache on cgroup v2 (0 on v1), in MiB."""
    cgroup = container_cgroup(_pid(container_id), container_id)
    assert cgroup is not None
    if cgroup.version != 2:
        return 0.0
    for line in (cgroup.dirs[""] / "memory.stat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == "inactive_file":
            return int(value) / (1024 * 1024)
    return 0.0


@pytest.mark.integration
async def test_docker_provider_cgroup_sample_agrees_with_stats(
    provider: DockerSandboxProvider,  # noqa: F811
    stats_provider: DockerSandboxProvider,
) -> None:
    """On one idle container, the cgroup sample and the stats endpoint's sample give the
    same cpu time, memory and pids (cpu read before and after brackets the engine's)."""
    handle = await provider.create(spec(resources={"cpu": 0.5, "memory_mib": 64}))
    try:
        await provider.exec(handle, "sleep 600 >/dev/null 2>&1 &")
        before = await provider.resource_sample(handle)
        stats = await stats_provider.resource_sample(handle)
        after = await provider.resource_sample(handle)
        inactive = await asyncio.to_thread(_v2_inactive_file_mib, handle.sandbox_id)
    finally:
        await provider.close(handle)
    assert before["usage.source"] == after["usage.source"] == "cgroup.v1" or (
        before["usage.source"] == after["usage.source"] == "cgroup.v2"
    )
    assert stats["usage.source"] == "docker.stats"
    cpu = "usage.cpu.time_s"
    # The engine's figure is nanoseconds; ours is rounded to the microsecond.
    assert before[cpu] - 1e-6 <= stats[cpu] <= after[cpu] + 1e-6  # type: ignore[operator]
    # The keep-alive shell, its sleep, and ours.
    assert stats["usage.pids"] == before["usage.pids"] == after["usage.pids"] == 3
    memory = "usage.memory_mib"
    low, high = sorted((before[memory], after[memory]))  # type: ignore[type-var]
    # Ours is rounded to the KiB; between the reads the kernel may account a page or two.
    # On cgroup v2 Podman reports memory.current less inactive_file (as `docker stats` shows
    # it); ours is memory.current, as the process provider's.
    low -= inactive
    assert low - 0.01 <= stats[memory] <= high + 0.01  # type: ignore[operator]
    assert before["usage.oom_kills"] == 0
    assert stats["usage.oom_killed"] is False
    assert "usage.oom_kills" not in stats


@pytest.mark.integration
async def test_docker_provider_cgroup_found_once_and_checked(
    provider: DockerSandboxProvider,  # noqa: F811
) -> None:
    """The container's cgroup is found from State.Pid and refused for another container's
    ID; a handle made elsewhere (id only) finds it at its first sample."""
    handle = await provider.create(spec())
    try:
        pid = await asyncio.to_thread(_pid, handle.sandbox_id)
        found = container_cgroup(pid, handle.sandbox_id)
        assert found is not None
        assert handle.sandbox_id in found.path
        assert container_cgroup(pid, "0" * 64) is None
        rebuilt = DockerSandboxProvider(f"unix://{_socket()}", api_timeout_s=15.0)
        try:
            sample = await rebuilt.resource_sample(SandboxHandle(handle.sandbox_id, "docker", None))
        finally:
            await rebuilt.aclose()
        assert sample["usage.source"] == f"cgroup.v{found.version}"
    finally:
        await provider.close(handle)


@pytest.mark.integration
async def test_docker_provider_ended_container_sample_has_exit_code(
    provider: DockerSandboxProvider,  # noqa: F811
    stats_provider: DockerSandboxProvider,
) -> None:
    """Once the container's processes are gone, both paths give the engine's exit code."""
    handle = await provider.create(
        spec(entrypoint=["/bin/sh", "-c", "while [ ! -e /tmp/go ]; do sleep 0.05; done; exit 3"])
    )
    try:
        first = await provider.resource_sample(handle)
        assert str(first["usage.source"]).startswith("cgroup.v")
        await provider.exec(handle, "touch /tmp/go")
        await eventually(lambda: stopped(provider, handle), "the container stopped", interval=0.05)
        ended = await provider.resource_sample(handle)
        engine_view = await stats_provider.resource_sample(handle)
    finally:
        await provider.close(handle)
    assert ended["usage.exit_code"] == engine_view["usage.exit_code"] == 3
    assert ended["usage.oom_killed"] is False
    assert ended["usage.oom_kills"] == 0


@pytest.mark.integration
async def test_docker_provider_nowait_sample_from_cgroup_none_once_ended(
    provider: DockerSandboxProvider,  # noqa: F811
) -> None:
    """While the container runs, resource_sample_nowait reads its cgroup and gives the keys
    resource_sample gives; once it has ended (the engine must tell how) it gives None."""
    handle = await provider.create(
        spec(entrypoint=["/bin/sh", "-c", "while [ ! -e /tmp/go ]; do sleep 0.05; done; exit 3"])
    )
    try:
        now = provider.resource_sample_nowait(handle)
        awaited = await provider.resource_sample(handle)
        await provider.exec(handle, "touch /tmp/go")
        await eventually(lambda: stopped(provider, handle), "the container stopped", interval=0.05)
        ended = provider.resource_sample_nowait(handle)
    finally:
        await provider.close(handle)
    assert now is not None
    assert str(now["usage.source"]).startswith("cgroup.v")
    assert sorted(now) == sorted(awaited)
    assert ended is None


@pytest.mark.integration
async def test_docker_provider_exec_oom_kill_counted_container_lives(
    provider: DockerSandboxProvider,  # noqa: F811
    stats_provider: DockerSandboxProvider,
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    global_meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A command exec'd into a 64 MiB container outgrows it and the kernel kills it; the
    container lives on, the next sample and the final record show one OOM kill, and
    gym.sandbox.oom_kills counts one. The stats endpoint cannot see it."""
    handle = await provider.create(spec(resources={"memory_mib": 64}))
    sampler = ResourceSampler(provider, handle, {PREFIX + "id": handle.sandbox_id}, 0)
    sampler.start()  # the owner: stop() adds the final record
    try:
        await sampler.record("sample")
        result = await provider.exec(handle, OOM_COMMAND, timeout_s=60)
        assert result.return_code == 137
        assert await provider.status(handle) is SandboxStatus.RUNNING
        assert (await provider.exec(handle, "echo alive")).stdout == "alive\n"
        await sampler.record("sample")
        engine_view = await stats_provider.resource_sample(handle)
        await sampler.stop()
    finally:
        await provider.close(handle)
    got = carried_forward([attributes_of(s) for s in records(span_exporter)])
    assert got == [
        {
            SANDBOX_ID: handle.sandbox_id,
            KIND: "sample",
            FINAL: final,
            PREFIX + "usage.source": matching(r"cgroup\.v[12]"),
            **usage_figures(r),
            PREFIX + "usage.oom_kills": kills,
        }
        for r, (kills, final) in zip(got, [(0, False), (1, False), (1, True)], strict=True)
    ]
    # The engine's flag is about the container's main process, which was not killed.
    assert engine_view["usage.oom_killed"] is False
    assert "usage.oom_kills" not in engine_view
    data = metric_reader.get_metrics_data()
    assert data is not None
    points = [
        (dict(point.attributes or {}), point.value)
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "gym.sandbox.oom_kills"
        for point in metric.data.data_points  # type: ignore[union-attr]
    ]
    assert points == [({"nemo.gym.sandbox.provider": "docker"}, 1)]
