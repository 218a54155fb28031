"""DockerSandboxProvider against a real container engine (Podman's Docker-compatible service).

Start the engine with ``scripts/start-podman.sh``; the tests find it through ``DOCKER_HOST``
or the script's default socket, and use the image ``NEMO_GYM_TEST_IMAGE`` (default: the
script's busybox image). Without an engine they skip, under ``CI=true`` they fail. Every
container is labelled with this run's id, and the module checks at the end that none is left.
The pure translations (frames, archives, HostConfig, stats) are tested without an engine.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from tests.conftest import require_service
from tests.span_support import (
    ERROR,
    FINAL,
    KIND,
    NOTHING_REQUESTED,
    PROVIDER,
    REQUEST_ID,
    SANDBOX_ID,
    UNSPECIFIED,
    UUID4_HEX,
    attributes_of,
    carried_forward,
    identity,
    matching,
    one_of,
    record,
    sample_outcome,
    usage_figures,
)

from opentelemetry.instrumentation.nemo_gym.sandbox.providers._docker_resources import (
    allocation_from_inspect,
    host_config,
    sample_from_stats,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._engine_api import (
    FrameDecoder,
    single_file_of,
    socket_path,
    tar_of,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    ContainerResourceAmounts,
    SandboxCreateError,
    SandboxHandle,
    SandboxResourceAmounts,
    SandboxResources,
    SandboxSpec,
    SandboxStatus,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.docker import (
    TIMEOUT_RETURN_CODE,
    DockerEngineError,
    DockerSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ResourceDesignator,
    ResourceProvider,
    ResourceSampler,
)
from waiting import eventually

DEFAULT_SOCKET = "/run/nemo-gym-podman/podman.sock"
DEFAULT_IMAGE = "localhost/nemo-gym-busybox:latest"
SUITE_LABEL = "nemo-gym-test-suite"
SUITE_ID = uuid.uuid4().hex
MIB = 1024 * 1024


def _socket() -> str:
    host = os.environ.get("DOCKER_HOST")
    return socket_path(host) if host else DEFAULT_SOCKET


def _image() -> str:
    return os.environ.get("NEMO_GYM_TEST_IMAGE") or DEFAULT_IMAGE


class _UnixHTTPConnection(http.client.HTTPConnection):
    """A plain HTTP connection over the engine's unix socket, independent of the provider."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(10)
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def engine(method: str, path: str) -> tuple[int, Any]:
    """Ask the engine directly (a test's independent view); returns status and decoded JSON."""
    connection = _UnixHTTPConnection(_socket())
    try:
        connection.request(method, path)
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    try:
        return response.status, json.loads(body)
    except ValueError:
        return response.status, body.decode("utf-8", "replace")


def _engine_state() -> str | None:
    """Why the engine cannot be used, or ``None`` when it answers and has the image."""
    try:
        status, _ = engine("GET", "/_ping")
        if status != 200:
            return f"/_ping answered {status}"
        status, _ = engine("GET", f"/v1.41/images/{_image()}/json")
    except OSError as exc:
        return f"no engine at unix://{_socket()} ({exc})"
    if status != 200:
        return f"image {_image()} not found"
    return None


def labelled_containers(label: str = f"{SUITE_LABEL}={SUITE_ID}") -> list[dict[str, Any]]:
    query = quote(json.dumps({"label": [label]}))
    status, answer = engine("GET", f"/v1.41/containers/json?all=true&filters={query}")
    assert status == 200, answer
    return list(answer)


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """After the module: no container labelled by this run exists, running or not."""
    yield
    if _engine_state() is None:
        assert labelled_containers() == []


@pytest.fixture
def engine_ready() -> None:
    reason = _engine_state()
    require_service(
        reason is None, f"container engine unavailable: {reason}; run scripts/start-podman.sh"
    )


@pytest.fixture
async def provider(engine_ready: None) -> AsyncIterator[DockerSandboxProvider]:
    docker = DockerSandboxProvider(f"unix://{_socket()}", api_timeout_s=15.0)
    yield docker
    await docker.aclose()


def spec(**overrides: Any) -> SandboxSpec:
    """A spec for the test image, labelled with this run's id."""
    values: dict[str, Any] = {"image": _image(), "metadata": {SUITE_LABEL: SUITE_ID}}
    values.update(overrides)
    return SandboxSpec(**values)


async def stopped(provider: DockerSandboxProvider, handle: SandboxHandle) -> bool:
    """Whether the engine reports the sandbox's container as ended."""
    return await provider.status(handle) is SandboxStatus.STOPPED


def records(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == "sandbox.resources"]


# --- pure translations, no engine -------------------------------------------------------------


def test_frame_decoder_split_frames() -> None:
    """Frames split at any byte land in the right stream; stdin echoes are dropped."""
    stream = b"".join(
        bytes([kind, 0, 0, 0]) + len(data).to_bytes(4, "big") + data
        for kind, data in ((1, b"out1\n"), (2, b"err\n"), (0, b"in"), (1, b"out2"))
    )
    for cut in range(len(stream) + 1):
        frames = FrameDecoder()
        frames.feed(stream[:cut])
        frames.feed(stream[cut:])
        assert (bytes(frames.stdout), bytes(frames.stderr)) == (b"out1\nout2", b"err\n")


def test_tar_of_round_trip() -> None:
    """An archived file reads back whole; a path naming no file raises ``ValueError``."""
    assert single_file_of(tar_of({"/a/b.txt": b"hi"}), "/a/b.txt") == b"hi"
    with pytest.raises(ValueError, match="path='/'"):
        tar_of({"/": b""})


def test_socket_path_docker_host() -> None:
    """``unix://`` gives its path, nothing gives the default, other schemes are refused."""
    assert socket_path("unix:///x/y.sock") == "/x/y.sock"
    assert socket_path(None) == "/var/run/docker.sock"
    with pytest.raises(ValueError, match=r"tcp://127\.0\.0\.1:2375"):
        socket_path("tcp://127.0.0.1:2375")


def test_host_config_requested_shape() -> None:
    """cpu and memory become NanoCpus, Memory and MemorySwap; absent values set nothing."""
    assert host_config(SandboxResources(cpu=0.5, memory_mib=64), {}) == {
        "NanoCpus": 500_000_000,
        "Memory": 64 * MIB,
        "MemorySwap": 64 * MIB,
    }
    assert host_config(SandboxResources(), {"CpuShares": 512}) == {"CpuShares": 512}


def test_allocation_from_inspect_unset_fields() -> None:
    """Zero, -1 and missing HostConfig fields stay unknown; CpuQuota/CpuPeriod give the limit."""
    allocation = allocation_from_inspect(
        {"Id": "c1", "HostConfig": {"CpuQuota": 25000, "CpuPeriod": 100000, "Memory": 0}},
        {"ID": "", "Name": "node"},
    )
    (component,) = allocation.components
    assert component.limits == ContainerResourceAmounts(cpu=0.25)
    assert component.requests == SandboxResourceAmounts()
    assert allocation.designator == ResourceDesignator("container", "c1", scope=None)
    assert allocation.host == ResourceDesignator("host", "node")


@pytest.mark.parametrize(
    ("pids_limit", "pids"), [(None, None), (0, None), (-1, None), (2048, 2048)]
)
def test_allocation_from_inspect_pids_limit(pids_limit: int | None, pids: int | None) -> None:
    """``PidsLimit`` is the container's pids limit; Docker's null, 0 and -1 (no limit) stay
    unknown, never 0."""
    inspect = {"Id": "c1", "HostConfig": {"Memory": 64 * MIB, "PidsLimit": pids_limit}}
    (component,) = allocation_from_inspect(inspect, {}).components
    assert component.limits == ContainerResourceAmounts(memory_mib=64, pids=pids)


def test_sample_from_stats_absent_fields() -> None:
    """Only the stats fields present become usage attributes, never a 0 in their place."""
    assert sample_from_stats({"memory_stats": {}, "pids_stats": {"current": 3}}) == {
        "usage.pids": 3
    }
    assert sample_from_stats(None) == {}


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True])
async def test_docker_provider_refuses_bad_timeouts(bad: object) -> None:
    """Timeouts must be finite positive seconds, in the constructor and in exec, as in the
    process provider; the check comes before any engine call."""
    with pytest.raises(ValueError, match="api_timeout_s="):
        DockerSandboxProvider("unix:///nonexistent.sock", api_timeout_s=bad)  # type: ignore[arg-type]
    docker = DockerSandboxProvider("unix:///nonexistent.sock")
    handle = SandboxHandle(sandbox_id="never-created", provider_name="docker", raw=None)
    with pytest.raises(ValueError, match="timeout_s="):
        await docker.exec(handle, "true", timeout_s=bad)  # type: ignore[arg-type]
    await docker.aclose()


# --- the real engine ------------------------------------------------------------------------


@pytest.mark.integration
async def test_docker_provider_allocation_matches_engine(provider: DockerSandboxProvider) -> None:
    """The allocation is the container's HostConfig as the engine reports it, scoped by the
    daemon's identity and placed on the daemon's host."""
    assert isinstance(provider, ResourceProvider)
    handle = await provider.create(
        spec(
            resources={"cpu": 0.5, "memory_mib": 64},
            provider_options={
                "host_config": {"MemoryReservation": 32 * MIB, "CpuShares": 512, "PidsLimit": 32}
            },
        )
    )
    other = DockerSandboxProvider(f"unix://{_socket()}")
    try:
        allocation = await provider.resource_allocation(handle)
        again = await other.resource_allocation(handle)
        _, inspect = await asyncio.to_thread(
            engine, "GET", f"/v1.41/containers/{handle.sandbox_id}/json"
        )
        _, info = await asyncio.to_thread(engine, "GET", "/v1.41/info")
        _, version = await asyncio.to_thread(engine, "GET", "/v1.41/version")
    finally:
        await other.aclose()
        await provider.close(handle)
    reported = inspect["HostConfig"]
    assert (reported["NanoCpus"], reported["Memory"]) == (500_000_000, 64 * MIB)
    assert (reported["MemoryReservation"], reported["CpuShares"]) == (32 * MIB, 512)
    assert reported["PidsLimit"] == 32
    (component,) = allocation.components
    assert component.limits == ContainerResourceAmounts(cpu=0.5, memory_mib=64, pids=32)
    assert component.requests == SandboxResourceAmounts(cpu=0.5, memory_mib=32)
    assert allocation.source == "docker.inspect"
    assert allocation.designator is not None
    assert (allocation.designator.kind, allocation.designator.id) == (
        "container",
        handle.sandbox_id,
    )
    # Podman's compatible /info invents a new ID per call; Docker's is the daemon's identity.
    if "Podman Engine" in [c["Name"] for c in version.get("Components", ())]:
        assert str(allocation.designator.scope).startswith("podman-")
    else:
        assert allocation.designator.scope == info["ID"]
    assert again.designator == allocation.designator
    assert allocation.host == ResourceDesignator("host", info["Name"])


@pytest.mark.integration
async def test_docker_provider_exec_streams_and_files(
    provider: DockerSandboxProvider, tmp_path: Path
) -> None:
    """Exec separates stdout and stderr and returns the exit code, in the spec's workdir and
    env; spec files, uploads and downloads go through the archive API."""
    handle = await provider.create(
        spec(workdir="/workspace", env={"GREETING": "hi"}, files={"in/a.txt": "from spec"})
    )
    try:
        result = await provider.exec(
            handle,
            'echo "$GREETING $X"; pwd; cat in/a.txt; echo oops >&2; exit 7',
            env={"X": "there"},
        )
        assert (result.stdout, result.stderr, result.return_code) == (
            "hi there\n/workspace\nfrom spec",
            "oops\n",
            7,
        )
        assert result.error_type is None
        source = tmp_path / "up.txt"
        source.write_bytes(b"\x00binary\xff")
        await provider.upload_file(handle, source, "/deep/er/up.bin")
        await provider.download_file(handle, "/deep/er/up.bin", tmp_path / "down.bin")
        assert (tmp_path / "down.bin").read_bytes() == b"\x00binary\xff"
        with pytest.raises(FileNotFoundError, match="/missing"):
            await provider.download_file(handle, "/missing", tmp_path / "never")
        assert await provider.status(handle) is SandboxStatus.RUNNING
    finally:
        await provider.close(handle)


@pytest.mark.integration
async def test_docker_provider_exec_timeout_kills_command(provider: DockerSandboxProvider) -> None:
    """A command past its timeout returns the sentinel with its output so far, and is killed."""
    handle = await provider.create(spec())
    try:
        result = await provider.exec(handle, "echo started; sleep 30 & wait", timeout_s=1)
        assert (result.return_code, result.error_type) == (TIMEOUT_RETURN_CODE, "timeout")
        assert result.stdout == "started\n"
        listing = await provider.exec(handle, "ps -o pid,args")
        assert "sleep 30" not in listing.stdout
    finally:
        await provider.close(handle)


@pytest.mark.integration
async def test_docker_provider_close_removes_container(provider: DockerSandboxProvider) -> None:
    """close force-removes the container and can be repeated; aclose removes unclosed ones."""
    handle = await provider.create(spec())
    await provider.close(handle)
    status, _ = await asyncio.to_thread(
        engine, "GET", f"/v1.41/containers/{handle.sandbox_id}/json"
    )
    assert status == 404
    assert await provider.status(handle) is SandboxStatus.STOPPED
    await provider.close(handle)
    forgotten = await provider.create(spec())
    await provider.aclose()
    status, _ = await asyncio.to_thread(
        engine, "GET", f"/v1.41/containers/{forgotten.sandbox_id}/json"
    )
    assert status == 404


@pytest.mark.integration
async def test_docker_provider_samples_cpu_time_and_throttling(
    provider: DockerSandboxProvider,
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through traced_provider, a CPU-bound command under a 0.1-core limit shows CPU time
    growing at the throttled rate in the periodic samples, with the throttled time."""
    from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import traced_provider

    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL", "0.5")
    cpu_key = PREFIX + "usage.cpu.time_s"
    throttled_key = PREFIX + "usage.cpu.throttled_s"

    def answered() -> list[tuple[ReadableSpan, dict[str, Any]]]:
        # A periodic record that close() cancels mid-call carries no answer; skip such records.
        # Each with its attributes as a reader rebuilds them (figures a partial sample left
        # out, from the sample before).
        every = records(span_exporter)
        rebuilt = carried_forward([attributes_of(s) for s in every])
        return [
            (s, a)
            for s, a in zip(every, rebuilt, strict=True)
            if cpu_key in a and not a[PREFIX + "resource.final"]
        ]

    async def periods_counted(got: list[tuple[ReadableSpan, dict[str, Any]]]) -> bool:
        # A cgroup sample reads the kernel's own throttled time (cpu.stat), which counts
        # whenever the quota binds. The engine's stats may not: Podman 4 on cgroup v1 sends
        # zero quota periods always.
        if str(got[0][1][PREFIX + "usage.source"]).startswith("cgroup."):
            return True
        _, raw = await asyncio.to_thread(
            engine, "GET", f"/v1.41/containers/{handle.sandbox_id}/stats?stream=false&one-shot=true"
        )
        return bool(raw["cpu_stats"]["throttling_data"].get("periods", 0) > 0)

    traced = traced_provider(provider)
    # A tenth of a core: the burner outruns that quota even on a machine whose other work
    # leaves it a small share of a core, so the kernel throttles it.
    handle = await traced.create(spec(resources={"cpu": 0.1, "memory_mib": 64}))
    try:
        _, inspect = await asyncio.to_thread(
            engine, "GET", f"/v1.41/containers/{handle.sandbox_id}/json"
        )
        _, version = await asyncio.to_thread(engine, "GET", "/v1.41/version")
        burner = await traced.exec(handle, "sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!")
        # Wait on the condition, bounded generously (a loaded machine may give the burner
        # less than its quota for a while): five answered samples, and a throttled one
        # where throttling is counted at all.
        counted = True

        async def settled() -> bool:
            nonlocal counted
            got = answered()
            if len(got) < 5:
                return False
            if any((a.get(throttled_key) or 0) > 0 for _, a in got):
                return True
            counted = await periods_counted(got)
            return not counted

        await eventually(
            settled,
            "five samples, a throttled one where the engine counts throttling",
            timeout=150,
            interval=0.1,
        )
        await traced.exec(handle, f"kill -9 {(burner.stdout or '').strip()}")
    finally:
        await traced.close(handle)
    # The allocation record runs beside the samples, so it may end after the first of them.
    every = records(span_exporter)
    (create,) = [s for s in span_exporter.get_finished_spans() if s.name == "sandbox.create"]
    known = identity(attributes_of(create)[REQUEST_ID], "docker", handle.sandbox_id)
    (allocation,) = [attributes_of(s) for s in every if attributes_of(s)[KIND] == "allocation"]
    base, container = PREFIX + "allocation.", PREFIX + "allocation.component.container."
    # No pids limit asked for. Podman then sets its default (containers.conf's pids_limit,
    # 2048) and the record carries it; Docker sets none, and the record says unspecified.
    pids_limit = inspect["HostConfig"].get("PidsLimit")
    if "Podman Engine" in [c["Name"] for c in version.get("Components", ())]:
        assert pids_limit == 2048
        pids = {
            container + "limits.pids": 2048,
            container + "limits.unspecified": ("disk_gib", "gpu"),
        }
    else:
        assert pids_limit in (None, 0, -1)
        pids = {container + "limits.unspecified": ("disk_gib", "gpu", "pids")}
    assert allocation == {
        **record(known, "allocation"),
        base + "source": "docker.inspect",
        base + "designator.kind": "container",
        base + "designator.id": handle.sandbox_id,
        base + "designator.scope": matching(".+"),
        base + "host.kind": "host",
        base + "host.id": matching(".+"),
        base + "components": ("container",),
        container + "requests.unspecified": ("cpu", "memory_mib", "disk_gib", "gpu"),
        container + "limits.cpu": 0.1,
        container + "limits.memory_mib": 64,
        **pids,
        "container.id": handle.sandbox_id,
        "container.runtime.name": one_of("docker", "podman"),
    }
    source = matching(r"cgroup\.v[12]|docker\.stats")
    finals = [attributes_of(s) for s in every if attributes_of(s)[FINAL]]
    assert finals == [
        {
            **record(known, "sample", final=True),
            **sample_outcome(
                finals[0], {PREFIX + "usage.source": source, **usage_figures(finals[0])}
            ),
        }
    ]
    got = answered()
    assert len(got) >= 5
    assert [a for _, a in got] == [
        {**record(known, "sample"), PREFIX + "usage.source": source, **usage_figures(a)}
        for _, a in got
    ]
    timed = [(s.start_time or 0, a[cpu_key]) for s, a in got]
    cpu = [c for _, c in timed]
    assert cpu == sorted(cpu)
    # Never the full core the loop would take unthrottled: at most a tenth of a core-second
    # per second (with room for the jitter of when each answer was read).
    rate = (timed[-1][1] - timed[0][1]) / ((timed[-1][0] - timed[0][0]) / 1e9)
    assert 0 < rate < 0.15, timed
    # Throttled time is the engine's figure when it counts quota periods, absent otherwise
    # (Podman 4 on cgroup v1 sends zeros); never an invented 0.
    throttled = [a.get(throttled_key) for _, a in got]
    if counted:
        assert any((t or 0) > 0 for t in throttled)
    else:
        assert throttled == [None] * len(throttled)


@pytest.mark.integration
async def test_docker_provider_memory_hog_oom_killed(
    provider: DockerSandboxProvider,
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """A process that outgrows the 64 MiB limit is OOM-killed by the engine, and the final
    record says so."""
    hog = "while [ ! -e /tmp/go ]; do sleep 0.1; done; exec tail /dev/zero"
    handle = await provider.create(
        spec(resources={"memory_mib": 64}, entrypoint=["/bin/sh", "-c", hog])
    )
    sampler = ResourceSampler(provider, handle, {PREFIX + "id": handle.sandbox_id}, 0)
    sampler.start()
    try:
        await provider.exec(handle, "touch /tmp/go")
        await eventually(lambda: stopped(provider, handle), "the OOM-killed container stopped")
        await sampler.stop()
    finally:
        await provider.close(handle)
    (final,) = [attributes_of(s) for s in records(span_exporter)]
    assert final == {
        SANDBOX_ID: handle.sandbox_id,
        KIND: "sample",
        FINAL: True,
        PREFIX + "usage.source": matching(r"cgroup\.v[12]|docker\.stats"),
        **usage_figures(final),
        PREFIX + "usage.oom_killed": True,
        PREFIX + "usage.exit_code": 137,
    }


@pytest.mark.integration
async def test_docker_provider_failed_sample_records_error(
    provider: DockerSandboxProvider,
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """A stats call that fails (the container is gone) yields a record with resource.error."""
    handle = await provider.create(spec())
    await provider.close(handle)
    sampler = ResourceSampler(provider, handle, {PREFIX + "id": handle.sandbox_id}, 0)
    await sampler.record("sample")
    assert [attributes_of(s) for s in records(span_exporter)] == [
        {SANDBOX_ID: handle.sandbox_id, KIND: "sample", FINAL: False, ERROR: "DockerEngineError"}
    ]


async def _failed_create(
    docker: DockerSandboxProvider, sandbox: SandboxSpec, exporter: InMemorySpanExporter
) -> tuple[str, ReadableSpan]:
    from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import traced_provider

    with pytest.raises(SandboxCreateError) as caught:
        await traced_provider(docker).create(sandbox)
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "sandbox.create"]
    assert span.status.status_code is StatusCode.ERROR
    assert attributes_of(span) == {
        PROVIDER: "docker",
        REQUEST_ID: UUID4_HEX,
        UNSPECIFIED: NOTHING_REQUESTED,
        "error.type": "SandboxCreateError",
    }
    return str(caught.value), span


@pytest.mark.integration
@pytest.mark.parametrize(
    ("overrides", "engine_words"),
    [
        ({"image": "localhost/nemo-gym-no-such-image:latest"}, "no such image"),
        ({"entrypoint": ["/no/such/binary"]}, "no such file or directory"),
    ],
    ids=["missing-image", "start-fails"],
)
async def test_docker_provider_create_failure_removes_container(
    provider: DockerSandboxProvider,
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    overrides: dict[str, Any],
    engine_words: str,
) -> None:
    """An engine refusal raises SandboxCreateError with the engine's words, the create span
    has the request identity and ERROR status, and no container is left behind."""
    marker = uuid.uuid4().hex
    sandbox = spec(metadata={SUITE_LABEL: SUITE_ID, "case": marker}, **overrides)
    message, _ = await _failed_create(provider, sandbox, span_exporter)
    assert engine_words in message.lower()
    assert await asyncio.to_thread(labelled_containers, f"case={marker}") == []


@pytest.mark.integration
async def test_docker_provider_create_daemon_not_listening(
    engine_ready: None,
    tmp_path: Path,
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """A socket nobody listens on gives SandboxCreateError naming the refused connection."""
    path = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # bound, never listening: connections are refused
    docker = DockerSandboxProvider(f"unix://{path}", api_timeout_s=5.0)
    try:
        message, _ = await _failed_create(docker, spec(), span_exporter)
    finally:
        await docker.aclose()
    assert "refused" in message.lower()
    assert str(path) in message
    with pytest.raises(DockerEngineError):
        await docker.status(SandboxHandle("x", "docker", None))
    await docker.aclose()
