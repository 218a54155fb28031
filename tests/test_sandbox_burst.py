"""Sandbox telemetry under a burst of creates: few engine calls, none in front of the burst.

NeMo Gym makes one provider, so one resource reader, per ``AsyncSandbox``, and a run starts
its sandboxes in bursts. Against the real engine (Podman's service in CI) behind a counting
proxy of the test's own (``engine_proxy``), the readers of a burst share one engine: the
daemon's facts are read once per engine for the process, whatever the number of readers and
``otel_docker`` providers on it; the allocation reads of a burst are one batch (one inspect
request per container over the socket, one ``docker inspect`` process for all through the
CLI); samples read the cgroup and ask the engine nothing; ``opensandbox`` lookups of a burst
are one list. The allocation read of a traced create waits while creates are in flight, and
a read the engine fails (the proxy injects the fault) is tried again, so the record is there.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import require_service
from engine_proxy import EngineProxy, engine_proxy
from opentelemetry.instrumentation.nemo_gym.sandbox._burst import calling, settled
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    ContainerResourceAmounts,
    SandboxHandle,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.docker import (
    DockerSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.readers._engine import Engine
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.docker_cli import DockerCliReader
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import (
    ID_LABEL,
    OpenSandboxReader,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ResourceSampler,
)
from span_support import ERROR
from test_docker_provider import (  # noqa: F401 - engine_ready: a fixture, used by name
    _image,
    _socket,
    engine_ready,
)

BURST = 4
IDENTITY = {PREFIX + "provider": "docker", PREFIX + "id": "burst"}


class _CliProvider:
    """What a reader needs of NeMo Gym's DockerProvider: the binary it drives."""

    def __init__(self, binary: str) -> None:
        self._binary = binary


def _docker() -> str:
    binary = shutil.which("docker")
    require_service(binary is not None, "the docker CLI is not on PATH")
    assert binary is not None
    return binary


@pytest.fixture
def containers(engine_ready: None) -> Iterator[list[str]]:  # noqa: F811 - the fixture
    """``BURST`` running containers started by the docker CLI as NeMo Gym's provider starts
    them, each labelled as OpenSandbox labels its sandboxes' (``opensandbox.io/id``: its
    name), straight on the engine (not through the proxy)."""
    binary = _docker()
    names = [f"nemo-gym-{uuid.uuid4().hex}" for _ in range(BURST)]
    try:
        for name in names:
            subprocess.run(
                [binary, "run", "-d", "--name", name, "--label", f"{ID_LABEL}={name}",
                 "--cpus", "0.5", "--memory", "64m", "--memory-swap", "64m",
                 "--pids-limit", "32", "--entrypoint", "/bin/sh", _image(), "-c",
                 "while :; do sleep 2147483647; done"],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
        yield names
    finally:
        subprocess.run([binary, "rm", "-f", *names], check=False, capture_output=True, timeout=120)


@pytest.fixture
async def proxy(
    engine_ready: None,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[EngineProxy]:
    """The counting proxy in front of the engine, as ``DOCKER_HOST``: a new endpoint for
    each test, so no engine facts are known for it yet."""
    # A short folder of its own: a unix socket's path is at most 107 bytes.
    folder = Path(tempfile.mkdtemp(prefix="burst-"))
    try:
        async with engine_proxy(_socket(), folder) as running:
            monkeypatch.setenv("DOCKER_HOST", running.docker_host)
            yield running
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _handle(name: str) -> SandboxHandle:
    return SandboxHandle(sandbox_id=name, provider_name="docker", raw=None)


async def test_docker_cli_readers_of_a_burst_share_one_batch_and_the_daemon_read(
    containers: list[str], proxy: EngineProxy
) -> None:
    """One reader per sandbox, as NeMo Gym makes them: their allocation reads, asked at
    once, are one batch of one inspect request per container over the socket, the daemon is
    read once (one ping, one libpod info) for them and for an otel_docker provider on the
    same socket, the allocations equal otel_docker's, and samples ask the engine nothing."""
    binary = _docker()
    readers = [DockerCliReader(_CliProvider(binary)) for _ in containers]
    assert len({id(reader.engine) for reader in readers}) == 1
    allocations = await asyncio.gather(
        *(
            reader.resource_allocation(_handle(name))
            for reader, name in zip(readers, containers, strict=True)
        )
    )
    assert readers[0].engine.inspect_calls == 1
    assert dict(proxy.counts) == {"_ping": 1, "libpod.info": 1, "containers.inspect": BURST}
    for allocation in allocations:
        assert allocation.components[0].limits == ContainerResourceAmounts(
            cpu=0.5, memory_mib=64, pids=32
        )

    engine_api = DockerSandboxProvider(proxy.docker_host, api_timeout_s=15.0)
    try:
        for allocation in allocations:
            assert allocation.designator is not None
            by_id = _handle(allocation.designator.id)
            assert allocation == await engine_api.resource_allocation(by_id)
    finally:
        await engine_api.aclose()
    # otel_docker's inspects, and no daemon read of its own.
    assert dict(proxy.counts) == {"_ping": 1, "libpod.info": 1, "containers.inspect": 2 * BURST}

    for reader, name in zip(readers, containers, strict=True):
        sample = await reader.resource_sample(_handle(name))
        assert str(sample["usage.source"]).startswith("cgroup.v")
    assert sum(proxy.counts.values()) == 2 + 2 * BURST


async def test_engine_through_the_cli_reads_a_burst_in_one_process(
    containers: list[str], proxy: EngineProxy
) -> None:
    """Where the engine is reached through the CLI alone, a burst's inspects are one
    ``docker inspect`` process (one ping) naming every container, a container the engine does
    not know fails only its own read, and the daemon's facts are read once, the same as over
    the socket."""
    engine = Engine(f"cli:test-{uuid.uuid4().hex}", None, _docker())
    missing = f"nemo-gym-{uuid.uuid4().hex}"
    answers = await asyncio.gather(
        *(engine.inspect(name) for name in [*containers, missing]), return_exceptions=True
    )
    assert [a["Name"].lstrip("/") for a in answers[:-1]] == containers  # type: ignore[index]
    assert isinstance(answers[-1], RuntimeError)
    assert engine.inspect_calls == 1
    assert dict(proxy.counts) == {"_ping": 1, "containers.inspect": BURST + 1}

    facts = await asyncio.gather(engine.daemon(), engine.daemon())
    again = await engine.daemon()
    assert facts[0] == facts[1] == again
    # One `info` and one `version` process (each pings once), for all three asks.
    assert proxy.counts["info"] == 1
    assert proxy.counts["version"] == 1
    assert proxy.counts["_ping"] == 3
    over_socket = Engine(proxy.docker_host, str(proxy.path), None)
    assert await over_socket.daemon() == again


async def test_opensandbox_lookups_of_a_burst_are_one_list(
    containers: list[str], proxy: EngineProxy
) -> None:
    """The readers of several OpenSandbox providers look their burst's containers up by label
    in one list request, then read each allocation with one inspect."""
    readers = [OpenSandboxReader(_CliProvider(_docker())) for _ in containers]
    allocations = await asyncio.gather(
        *(r.resource_allocation(_handle(name)) for r, name in zip(readers, containers, strict=True))
    )
    assert proxy.counts["containers.list"] == 1
    assert proxy.counts["containers.inspect"] == BURST
    assert [a.designator.id for a in allocations] == containers  # type: ignore[union-attr]


async def test_engine_read_given_up_and_asked_again_rejoins_the_request_in_flight(
    containers: list[str], proxy: EngineProxy
) -> None:
    """A read whose record gave up on a slow inspect and tries again waits for the same
    request instead of sending another: one inspect, answered to the retry."""
    engine = Engine(proxy.docker_host, str(proxy.path), None)
    arrived, release = proxy.hold("containers.inspect")
    first = asyncio.ensure_future(engine.inspect(containers[0]))
    async with asyncio.timeout(60):
        await arrived.wait()
    first.cancel()
    again = asyncio.ensure_future(engine.inspect(containers[0]))
    release.set()
    answer = await again
    assert answer["Name"].lstrip("/") == containers[0]
    assert first.cancelled()
    assert proxy.counts["containers.inspect"] == 1
    assert engine.inspect_calls == 1


@pytest.fixture
def exporter(
    global_tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> InMemorySpanExporter:
    return span_exporter


def _allocation_records(exporter: InMemorySpanExporter) -> list[dict[str, object]]:
    return [
        dict(s.attributes or {})
        for s in exporter.get_finished_spans()
        if s.name == "sandbox.resources"
    ]


async def test_allocation_read_failed_by_the_engine_is_retried(
    containers: list[str], proxy: EngineProxy, exporter: InMemorySpanExporter
) -> None:
    """An inspect the engine answers with an error fails the first attempt only: the read is
    tried again and the one allocation record carries the allocation, no error."""
    reader = DockerCliReader(_CliProvider(_docker()))
    proxy.fail("containers.inspect")
    sampler = ResourceSampler(reader, _handle(containers[0]), IDENTITY, 0)
    await sampler.record_allocation()
    (record,) = _allocation_records(exporter)
    assert ERROR not in record
    assert record[PREFIX + "allocation.component.container.limits.memory_mib"] == 64
    assert proxy.counts["containers.inspect"] == 2


async def test_allocation_read_waits_while_the_burst_is_in_flight(
    containers: list[str], proxy: EngineProxy, exporter: InMemorySpanExporter
) -> None:
    """While a create is in flight, and then while the burst's first command still is, the
    allocation read asks the engine nothing; once the burst settles it reads, and the record
    is there."""
    reader = DockerCliReader(_CliProvider(_docker()))
    sampler = ResourceSampler(reader, _handle(containers[0]), IDENTITY, 0)
    with calling():  # the command, begun before the last create ends
        with calling(create=True):
            reading = asyncio.ensure_future(sampler.record_allocation())
            # Time enough for a read that did not wait to reach the engine (a batch's window
            # is 20 ms); the read must still be waiting.
            await asyncio.sleep(0.5)
            assert sum(proxy.counts.values()) == 0
        await asyncio.sleep(0.5)
        assert sum(proxy.counts.values()) == 0
        assert not reading.done()
    await reading
    (record,) = _allocation_records(exporter)
    assert ERROR not in record
    assert proxy.counts["containers.inspect"] == 1


async def test_allocation_read_waiting_for_a_burst_goes_when_the_sandbox_closes(
    containers: list[str], proxy: EngineProxy, exporter: InMemorySpanExporter
) -> None:
    """A sandbox closed while a burst is still in flight gets its allocation read at once
    (before the close removes it), not after the burst."""
    reader = DockerCliReader(_CliProvider(_docker()))
    # Not started: its stop() records no final sample, which would read the engine too.
    sampler = ResourceSampler(reader, _handle(containers[0]), IDENTITY, 0)
    with calling(create=True):
        reading = asyncio.ensure_future(sampler.record_allocation())
        await sampler.stop()
        await reading
    (record,) = _allocation_records(exporter)
    assert ERROR not in record
    assert proxy.counts["containers.inspect"] == 1


async def test_settled_yields_only_to_a_burst() -> None:
    """A sandbox created on its own is read at once; after a burst (two creates at a time)
    the read waits for the application to be quiet."""
    with calling(create=True):
        pass
    alone = asyncio.ensure_future(settled())
    await asyncio.sleep(0)
    assert alone.done()

    with calling(create=True), calling(create=True):
        pass
    with calling():  # the burst's first command
        after_burst = asyncio.ensure_future(settled())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not after_burst.done()
    await after_burst
