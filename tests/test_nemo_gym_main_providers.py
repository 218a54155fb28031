"""NeMo Gym main's built-in ``docker`` provider gets the records ``otel_docker`` gets.

A user's script, run under a real ``opentelemetry-instrument`` on NeMo Gym's repository main
(``scripts/nemo-gym-main-env.sh`` makes its virtualenv), creates a sandbox with
``AsyncSandbox({"docker": {...}}, spec)`` on real Podman through the ``docker`` CLI
(``DOCKER_HOST``), runs an exec that the kernel OOM-kills and a CPU loop, and closes it; the
same script with ``{"otel_docker": {...}}`` runs beside it. Spans and metrics go over OTLP/HTTP
to a receiver on loopback here. The ``nemo_gym_main`` section (``SECTIONS`` in
``conftest.py``), which the main suite leaves out, runs it, and fails it when NeMo Gym main,
the ``docker`` CLI or the engine is missing:
``.venv-nemo-gym-main/bin/python -m pytest -m nemo_gym_main tests/``.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from conftest import INSTRUMENT, serve_on_loopback
from span_support import carried_forward

pytestmark = [pytest.mark.nemo_gym_main, pytest.mark.integration]

P = "nemo.gym.sandbox."
IMAGE = "localhost/nemo-gym-busybox:latest"
# The bound on the whole run: two sandboxes on a shared 2-core machine, samples every 0.2 s.
BOUND_S = 180.0
SAMPLES = 3

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from nemo_gym.sandbox import AsyncSandbox, SandboxResources, SandboxSpec

    CONFIGS = {
        "docker": {"docker": {"create": {"pids_limit": 32}}},
        "otel_docker": {"otel_docker": {}},
    }
    # The same pids limit for both: NeMo Gym's provider has it from its config, ours from
    # the spec (a NeMo Gym spec has no pids; HostConfig is otel_docker's way to set one).
    OPTIONS = {"docker": {}, "otel_docker": {"host_config": {"PidsLimit": 32}}}

    async def main():
        spec = SandboxSpec(
            image=sys.argv[2],
            resources=SandboxResources(cpu=0.5, memory_mib=64),
            provider_options=OPTIONS[sys.argv[1]],
        )
        sandbox = AsyncSandbox(CONFIGS[sys.argv[1]], spec)
        await sandbox.start()
        # The exec is the kernel's first choice in the container, never its keep-alive, and
        # its only one: one process (`sort` holds /dev/zero's endless line), not a pipeline
        # whose writer could be a second victim.
        oom = await sandbox.exec(
            "echo 1000 >/proc/self/oom_score_adj; exec sort /dev/zero",
            timeout_s=60,
        )
        loop = await sandbox.exec(
            "sh -c 'while :; do :; done' >/dev/null 2>&1 &", timeout_s=60
        )
        print(json.dumps({"oom_exit": oom.return_code, "loop_exit": loop.return_code}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the test says when it has seen enough
        await sandbox.stop()

    asyncio.run(main())
    """
)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class Receiver:
    """OTLP/HTTP traces and metrics on loopback, by ``service.name``; ``changed`` is set on
    every export, so a test waits for a condition without polling a clock."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        self.oom_kills: dict[str, dict[tuple[tuple[str, Any], ...], int]] = {}
        self.changed = asyncio.Event()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.path == "/v1/traces":
            traces = ExportTraceServiceRequest()
            traces.ParseFromString(body)
            for resource_spans in traces.resource_spans:
                service = _attributes(resource_spans.resource.attributes)["service.name"]
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        entry = (span.name, _attributes(span.attributes))
                        self.spans.setdefault(service, []).append(entry)
        elif request.path == "/v1/metrics":
            metrics = ExportMetricsServiceRequest()
            metrics.ParseFromString(body)
            for resource_metrics in metrics.resource_metrics:
                service = _attributes(resource_metrics.resource.attributes)["service.name"]
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        if metric.name != "gym.sandbox.oom_kills":
                            continue
                        counts = self.oom_kills.setdefault(service, {})
                        for point in metric.sum.data_points:
                            labels = tuple(sorted(_attributes(point.attributes).items()))
                            counts[labels] = int(point.as_int)  # cumulative: the last one
        self.changed.set()
        return web.Response(content_type="application/x-protobuf", body=b"")

    async def until(self, what: str, check: Callable[[], bool]) -> None:
        """Wait for ``check()`` after each export; fail after ``BOUND_S``."""

        async def wait() -> None:
            while not check():
                self.changed.clear()
                await self.changed.wait()

        try:
            await asyncio.wait_for(wait(), BOUND_S)
        except TimeoutError:
            seen = {
                service: [
                    (r.get(P + "usage.cpu.time_s"), r.get(P + "usage.oom_kills"))
                    for r in self.records(service)
                ]
                for service in self.spans
            }
            pytest.fail(f"never {what} within {BOUND_S:.0f} s; (cpu, oom kills) seen: {seen}")

    def records(self, service: str) -> list[dict[str, Any]]:
        return [a for name, a in self.spans.get(service, []) if name == "sandbox.resources"]


def _samples(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sample records, each as a reader rebuilds it (a partial sample laid over the
    sandbox's previous one)."""
    return [r for r in carried_forward(records) if r[P + "resource.kind"] == "sample"]


def _growing_run(samples: list[dict[str, Any]]) -> bool:
    """Whether ``SAMPLES`` periodic samples in a row, taken after the OOM kill (so while the
    CPU loop runs), each show more CPU time than the last."""
    times = [
        s.get(P + "usage.cpu.time_s")
        for s in samples
        if not s[P + "resource.final"] and s.get(P + "usage.oom_kills") == 1
    ]
    run = 1
    for before, after in itertools.pairwise(times):
        grew = isinstance(before, float) and isinstance(after, float) and after > before
        run = run + 1 if grew else 1
        if run >= SAMPLES:
            return True
    return False


def _settled(records: list[dict[str, Any]]) -> bool:
    """Enough periodic samples to close: growing CPU time, and the OOM kill counted."""
    samples = _samples(records)
    return _growing_run(samples) and any(s.get(P + "usage.oom_kills") == 1 for s in samples)


def _engine_ready() -> None:
    """NeMo Gym main, the ``docker`` CLI and its engine must be here: this module runs only
    when they are required."""
    version = importlib.metadata.version("nemo-gym")
    assert version.startswith("0.5"), f"nemo-gym {version} is not NeMo Gym main (0.5.x)"
    assert shutil.which("docker"), "NeMo Gym's docker provider needs the docker CLI on PATH"
    assert os.environ.get("DOCKER_HOST"), "DOCKER_HOST must name the engine (start-podman.sh)"
    probe = subprocess.run(
        ["docker", "image", "inspect", IMAGE], capture_output=True, text=True, check=False
    )
    assert probe.returncode == 0, f"docker image inspect {IMAGE}: {probe.stderr.strip()}"


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    received = Receiver()
    runner, port = await serve_on_loopback("127.0.0.1", received.handle)
    received.url = f"http://127.0.0.1:{port}"
    try:
        yield received
    finally:
        await runner.cleanup()


def instrumented_env(service: str, receiver: Receiver, interval_s: str) -> dict[str, str]:
    """This process's environment without its OTEL_ and NEMO_GYM variables, for a user script
    under ``opentelemetry-instrument`` as ``service``: spans and metrics over OTLP/HTTP to
    ``receiver``, sandbox samples every ``interval_s`` seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM"))}
    env.update(
        OTEL_SERVICE_NAME=service,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_LOGS_EXPORTER="none",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_METRIC_EXPORT_INTERVAL="60000",  # read once, at shutdown
        OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL=interval_s,
    )
    return env


async def _start_user_script(
    script: Path, provider: str, receiver: Receiver
) -> asyncio.subprocess.Process:
    env = instrumented_env(provider, receiver, interval_s="0.2")
    return await asyncio.create_subprocess_exec(
        str(INSTRUMENT),
        sys.executable,
        str(script),
        provider,
        IMAGE,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


def _shown(records: list[dict[str, Any]]) -> str:
    """The records as the report shows them: sorted keys, one record a line."""
    return "\n".join(json.dumps(dict(sorted(r.items()))) for r in records)


async def test_builtin_docker_provider_records_equal_otel_docker_records(
    receiver: Receiver, tmp_path: Path
) -> None:
    """NeMo Gym's docker provider, unconfigured for us, gives otel_docker's allocation, growing
    cgroup samples, a final sample and the exec'd OOM kill, all under the create's identity."""
    _engine_ready()
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    providers = ("docker", "otel_docker")
    processes = {p: await _start_user_script(script, p, receiver) for p in providers}
    try:
        for provider, process in processes.items():
            assert process.stdout is not None
            line = await asyncio.wait_for(process.stdout.readline(), BOUND_S)
            if not line:  # the script ended early: say why
                _, stderr = await asyncio.wait_for(process.communicate(), BOUND_S)
                pytest.fail(f"{provider} script ended: {stderr.decode()[-3000:]}")
            assert json.loads(line) == {"oom_exit": 137, "loop_exit": 0}, provider
        for provider in providers:
            await receiver.until(
                f"{SAMPLES} growing samples and the OOM kill from {provider}",
                lambda p=provider: _settled(receiver.records(p)),  # type: ignore[misc]
            )
        for process in processes.values():
            assert process.stdin is not None
            process.stdin.write(b"close\n")
            await process.stdin.drain()
        outcomes = {
            p: await asyncio.wait_for(process.communicate(), BOUND_S)
            for p, process in processes.items()
        }
    finally:
        for process in processes.values():
            if process.returncode is None:
                process.kill()
                await process.wait()
    for provider, process in processes.items():
        assert process.returncode == 0, (provider, outcomes[provider][1].decode()[-3000:])

    shown = {p: receiver.records(p) for p in providers}
    print("\n== NeMo Gym's docker provider ==\n" + _shown(shown["docker"]))
    print("\n== otel_docker ==\n" + _shown(shown["otel_docker"]))

    allocations: dict[str, dict[str, Any]] = {}
    for provider in providers:
        spans = receiver.spans[provider]
        creates = [a for name, a in spans if name == "sandbox.create"]
        assert len(creates) == 1
        identity = {k: creates[0][k] for k in (P + "request.id", P + "provider", P + "id")}
        records = receiver.records(provider)
        # Every record under the create span's identity.
        assert all({k: r[k] for k in identity} == identity for r in records)
        kinds = [r[P + "resource.kind"] for r in records]
        assert kinds.count("allocation") == 1
        [allocation] = [r for r in records if r[P + "resource.kind"] == "allocation"]
        assert P + "resource.error" not in allocation
        allocations[provider] = allocation
        samples = _samples(records)
        assert [s[P + "resource.final"] for s in samples].count(True) == 1
        assert samples[-1][P + "resource.final"] is True
        # A periodic sample may be cut short (stop() cancels one in flight; with a 0.2 s
        # interval a slow read times out) and says so; every other is read from the cgroup.
        read = [s for s in samples if P + "resource.error" not in s]
        assert {s[P + "resource.error"] for s in samples if s not in read} <= {
            "CancelledError",
            "TimeoutError",
        }
        assert samples[-1] in read
        assert {s[P + "usage.source"] for s in read} <= {"cgroup.v1", "cgroup.v2"}
        assert _growing_run(samples)
        # The exec'd process was OOM-killed once; the container (and its count) lived on.
        assert max(s.get(P + "usage.oom_kills", 0) for s in samples) == 1
        assert samples[-1][P + "usage.oom_kills"] == 1
        assert receiver.oom_kills[provider] == {((P + "provider", "docker"),): 1}

    builtin, ours = allocations["docker"], allocations["otel_docker"]
    assert builtin[P + "allocation.component.container.limits.cpu"] == 0.5
    assert builtin[P + "allocation.component.container.limits.memory_mib"] == 64
    # The pids limit NeMo Gym's config asked for, as the engine set it.
    assert builtin[P + "allocation.component.container.limits.pids"] == 32
    assert builtin[P + "allocation.component.container.limits.unspecified"] == ["disk_gib", "gpu"]
    assert builtin[P + "allocation.designator.kind"] == "container"
    # The engine's container ID (NeMo Gym's sandbox id is the container's name).
    assert builtin["container.id"] == builtin[P + "allocation.designator.id"]
    assert len(builtin[P + "allocation.designator.id"]) == 64
    assert builtin[P + "id"].startswith("nemo-gym-")
    # Beyond identity, the built-in provider's allocation record is otel_docker's.
    per_sandbox = {P + "request.id", P + "id", P + "allocation.designator.id", "container.id"}
    assert {k: v for k, v in builtin.items() if k not in per_sandbox} == {
        k: v for k, v in ours.items() if k not in per_sandbox
    }


# NeMo Gym main's built-in providers and how this plugin reads each one's sandboxes.
BUILT_IN_READERS = {
    "docker": "DockerCliReader",
    "apptainer": "HostInstanceReader",
    "enroot": "HostInstanceReader",
    "opensandbox": "OpenSandboxReader",
    "daytona": "remote",
    "ecs_fargate": "remote",
    "openshell": "remote",
}


def test_readers_table_names_every_nemo_gym_main_built_in() -> None:
    """Each built-in provider class NeMo Gym main's registry loads is in ``READERS`` by its
    module and class name: the docker CLI reader, or the reason its records give."""
    from nemo_gym.sandbox.providers import registry

    from opentelemetry.instrumentation.nemo_gym.sandbox.readers import READERS
    from opentelemetry.instrumentation.nemo_gym.sandbox.readers.docker_cli import (
        DockerCliReader,
    )
    from opentelemetry.instrumentation.nemo_gym.sandbox.readers.host_instance import (
        HostInstanceReader,
    )
    from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import (
        OpenSandboxReader,
    )
    from opentelemetry.instrumentation.nemo_gym.sandbox.readers.unknown import (
        UnknownResourcesReader,
    )

    assert set(BUILT_IN_READERS) <= set(registry.list_providers())
    found = {}
    for name in BUILT_IN_READERS:
        cls = registry.get_provider_class(name)
        reader = READERS[(cls.__module__, cls.__qualname__)](object())
        if isinstance(reader, DockerCliReader | HostInstanceReader | OpenSandboxReader):
            found[name] = type(reader).__name__
        else:
            assert isinstance(reader, UnknownResourcesReader)
            found[name] = reader._answer.reason
    assert found == BUILT_IN_READERS
