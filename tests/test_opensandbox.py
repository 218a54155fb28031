"""NeMo Gym main's ``opensandbox`` provider against a real OpenSandbox server gets real records.

A user's script, run under a real ``opentelemetry-instrument`` on NeMo Gym's repository main,
creates a sandbox with ``AsyncSandbox({"opensandbox": {...}}, spec)``, the mapping shaped like
NeMo Gym's shipped ``opensandbox.yaml`` (``connection.domain``, ``api_key`` from the
environment, ``use_server_proxy``), against the OpenSandbox server of
``scripts/start-opensandbox.sh`` (its Docker runtime on Podman). Spans and metrics go over
OTLP/HTTP to a receiver on loopback here. Co-located, the records are the engine's and the
cgroup's; with the engine out of the script's reach (its ``DOCKER_HOST`` names no socket: the
server keeps its own), they come from OpenSandbox's metrics API. The ``opensandbox`` section
(``SECTIONS`` in ``conftest.py``) runs it, and fails it when something is missing:
``.venv-nemo-gym-main/bin/python -m pytest -s -m opensandbox tests/test_opensandbox.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import INSTRUMENT
from opensandbox_proxy import RenamingProxy
from test_nemo_gym_main_providers import (
    Receiver,
    _samples,
    _shown,
    instrumented_env,
    receiver,
)

pytestmark = [pytest.mark.opensandbox, pytest.mark.integration]

__all__ = ["receiver"]  # the fixture, shared with the docker provider's test

P = "nemo.gym.sandbox."
IMAGE = "localhost/nemo-gym-busybox:latest"
BOUND_S = 240.0
SAMPLES = 3
REPO = Path(__file__).resolve().parent.parent
START = REPO / "scripts" / "start-opensandbox.sh"
# No engine answers here: the user script's engine lookup (its docker CLI) reaches nothing.
NO_ENGINE = "unix:///nonexistent/opensandbox-test-no-engine.sock"

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from nemo_gym.sandbox import AsyncSandbox, SandboxResources, SandboxSpec

    # As NeMo Gym's shipped opensandbox.yaml has it (short timeouts for a test).
    CONFIG = {
        "opensandbox": {
            "connection": {
                "domain": os.environ["OPENSANDBOX_DOMAIN"],
                "api_key": os.environ["OPENSANDBOX_API_KEY"],
                "protocol": "http",
                "request_timeout_s": 60,
                "use_server_proxy": True,
                "keepalive_expiry_s": 3.0,
            },
            "create": {"timeout_s": 180, "skip_health_check": False, "retries": 1},
            "operations": {"retries": 0, "close_timeout_s": 30},
        }
    }

    async def main():
        spec = SandboxSpec(
            image=sys.argv[1],
            resources=SandboxResources(cpu=0.5, memory_mib=64),
            ready_timeout_s=120,
        )
        sandbox = AsyncSandbox(CONFIG, spec)
        await sandbox.start()
        oom = await sandbox.exec(
            "echo 1000 >/proc/self/oom_score_adj; exec sort /dev/zero", timeout_s=60
        )
        loop = await sandbox.exec(
            "sh -c 'while :; do :; done' >/dev/null 2>&1 &", timeout_s=60
        )
        print(json.dumps({"oom_exit": oom.return_code, "loop_exit": loop.return_code}), flush=True)
        while True:
            command = (await asyncio.to_thread(sys.stdin.readline)).strip()
            try:
                if command == "status":
                    answer = str(await sandbox.status())
                else:
                    await sandbox.stop()
                    answer = "closed"
            except Exception as exc:  # the provider's own exception, not ours
                answer = type(exc).__name__
            print(json.dumps({command: answer}), flush=True)
            if command != "status":
                return

    asyncio.run(main())
    """
)


@dataclass
class Server:
    domain: str
    key: str
    state: Path | None = None  # a server of the test's own (started and stopped by it)


def _start(state: Path | None = None) -> Server:
    env = dict(os.environ)
    if state is not None:
        env["NEMO_GYM_OPENSANDBOX_DIR"] = str(state)
    done = subprocess.run(
        ["bash", str(START)], capture_output=True, text=True, env=env, timeout=900, check=False
    )
    assert done.returncode == 0, f"start-opensandbox.sh: {done.stderr[-3000:]}"
    lines = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    key = Path(lines["OPENSANDBOX_API_KEY_FILE"]).read_text().strip()
    return Server(lines["OPENSANDBOX_DOMAIN"], key, state)


def _stop(state: Path) -> None:
    env = {**os.environ, "NEMO_GYM_OPENSANDBOX_DIR": str(state)}
    subprocess.run(["bash", str(START), "--stop"], env=env, timeout=60, check=True)


def _ready() -> None:
    version = importlib.metadata.version("nemo-gym")
    assert version.startswith("0.5"), f"nemo-gym {version} is not NeMo Gym main (0.5.x)"
    assert importlib.metadata.version("opensandbox") == "1.1.1"
    assert os.environ.get("DOCKER_HOST"), "DOCKER_HOST must name the engine (start-podman.sh)"


@pytest.fixture(scope="module")
def server() -> Server:
    """The server of ``scripts/start-opensandbox.sh`` (started when it is not running)."""
    _ready()
    return _start()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[Server]:
    """A second server, in a state folder of the test's own, that the test may stop."""
    _ready()
    state = tmp_path / "opensandbox"
    try:
        yield _start(state)
    finally:
        _stop(state)


def _remove_containers(sandbox_id: str) -> None:
    """Remove the container OpenSandbox made for ``sandbox_id`` (a test that stopped its server
    leaves it behind)."""
    found = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=opensandbox.io/id={sandbox_id}"],
        capture_output=True,
        text=True,
        check=False,
    )
    for container in found.stdout.split():
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, check=False)


class UserScript:
    """The user's script under ``opentelemetry-instrument``, driven line by line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.sandbox_id = ""

    async def line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), BOUND_S)
        if not line:
            _, stderr = await asyncio.wait_for(self.process.communicate(), BOUND_S)
            pytest.fail(f"the user script ended: {stderr.decode()[-3000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def ask(self, command: str) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(command.encode() + b"\n")
        await self.process.stdin.drain()
        return (await self.line())[command]

    async def finish(self) -> str:
        _, stderr = await asyncio.wait_for(self.process.communicate(), BOUND_S)
        assert self.process.returncode == 0, stderr.decode()[-3000:]
        return stderr.decode()


@contextlib.asynccontextmanager
async def user_script(
    tmp_path: Path, server: Server, receiver: Receiver, service: str, docker_host: str
) -> AsyncIterator[UserScript]:
    """The user script as ``service``; with the engine out of reach (``NO_ENGINE``) samples
    every 2 s (a metrics call takes about 1 s: execd's CPU window), else every 0.5 s."""
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    env = instrumented_env(service, receiver, "2" if docker_host == NO_ENGINE else "0.5")
    env.update(
        OPENSANDBOX_DOMAIN=server.domain,
        OPENSANDBOX_API_KEY=server.key,
        DOCKER_HOST=docker_host,
    )
    process = await asyncio.create_subprocess_exec(
        str(INSTRUMENT),
        sys.executable,
        str(script),
        IMAGE,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    running = UserScript(process)

    def created() -> list[dict[str, Any]]:
        return [a for name, a in receiver.spans.get(service, []) if name == "sandbox.create"]

    try:
        started = await running.line()
        # The sandbox's id, as the create span has it (NeMo Gym's AsyncSandbox keeps its
        # handle to itself).
        await receiver.until("the create span", lambda: bool(created()))
        running.sandbox_id = created()[0][P + "id"]
        # The killed exec fails (execd reports the signal as -1 here, a shell as 137): the
        # kill itself is what the records must count.
        assert started["oom_exit"] not in (0, None), started
        assert started["loop_exit"] == 0, started
        yield running
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        if running.sandbox_id:
            _remove_containers(running.sandbox_id)


def _periodic(records: list[dict[str, Any]], check: Callable[[dict[str, Any]], bool]) -> int:
    return sum(1 for s in _samples(records) if not s[P + "resource.final"] and check(s))


def _allocation(records: list[dict[str, Any]]) -> dict[str, Any]:
    [allocation] = [r for r in records if r[P + "resource.kind"] == "allocation"]
    return allocation


def _no_host_figures(records: list[dict[str, Any]]) -> None:
    """No record says the server host's 2 cores or 24 GiB: no figure from get_metrics'
    cpu_count or memory_total_in_mib is recorded."""
    for record in records:
        for key, value in record.items():
            if key.startswith((P + "allocation.component.", P + "usage.")):
                assert "total" not in key, key
                assert "cpu_count" not in key, key
                if key.endswith("memory_mib") and isinstance(value, float | int):
                    assert value <= 64, (key, value)


async def test_opensandbox_colocated_records_are_the_engines_and_the_cgroups(
    server: Server, receiver: Receiver, tmp_path: Path
) -> None:
    """A co-located OpenSandbox sandbox gets the engine's 0.5 CPU and 64 MiB, cgroup samples
    and a final one, and the exec'd OOM kill counted, under the create's identity."""
    async with user_script(
        tmp_path, server, receiver, "opensandbox", os.environ["DOCKER_HOST"]
    ) as run:
        await receiver.until(
            f"{SAMPLES} cgroup samples with the OOM kill",
            lambda: (
                _periodic(
                    receiver.records("opensandbox"),
                    lambda s: (
                        s.get(P + "usage.oom_kills") == 1
                        and str(s.get(P + "usage.source")).startswith("cgroup")
                    ),
                )
                >= SAMPLES
            ),
        )
        assert await run.ask("close") == "closed"
        await run.finish()
    records = receiver.records("opensandbox")
    print("\n== NeMo Gym's opensandbox provider, co-located ==\n" + _shown(records))
    creates = [a for name, a in receiver.spans["opensandbox"] if name == "sandbox.create"]
    assert len(creates) == 1
    identity = {k: creates[0][k] for k in (P + "request.id", P + "provider", P + "id")}
    assert identity[P + "provider"] == "opensandbox"
    assert identity[P + "id"] == run.sandbox_id
    assert all({k: r[k] for k in identity} == identity for r in records)

    allocation = _allocation(records)
    assert P + "resource.error" not in allocation
    assert allocation[P + "allocation.source"] == "docker.inspect"
    assert allocation[P + "allocation.component.container.limits.cpu"] == 0.5
    assert allocation[P + "allocation.component.container.limits.memory_mib"] == 64
    assert allocation[P + "allocation.component.container.limits.pids"] == 256
    assert allocation[P + "allocation.designator.kind"] == "opensandbox.sandbox"
    assert allocation[P + "allocation.designator.id"] == run.sandbox_id
    assert allocation[P + "allocation.designator.scope"] == server.domain
    assert allocation[P + "allocation.host.kind"] == "container"
    assert server.key not in json.dumps(records)
    _no_host_figures(records)

    samples = _samples(records)
    assert [s[P + "resource.final"] for s in samples].count(True) == 1
    final = samples[-1]
    assert final[P + "resource.final"] is True
    assert str(final[P + "usage.source"]).startswith("cgroup")
    assert final[P + "usage.oom_kills"] == 1
    assert receiver.oom_kills["opensandbox"] == {((P + "provider", "opensandbox"),): 1}


async def test_opensandbox_remote_records_come_from_the_metrics_api(
    server: Server, receiver: Receiver, tmp_path: Path
) -> None:
    """With no engine in reach, the allocation is unknown with its reason and the samples are
    OpenSandbox's metrics API's CPU percentage and memory, under its own names."""
    async with user_script(tmp_path, server, receiver, "remote", NO_ENGINE) as run:
        await receiver.until(
            f"{SAMPLES} metrics API samples",
            lambda: (
                _periodic(
                    receiver.records("remote"),
                    lambda s: s.get(P + "usage.source") == "opensandbox.metrics",
                )
                >= SAMPLES
            ),
        )
        assert await run.ask("close") == "closed"
        await run.finish()
    records = receiver.records("remote")
    print("\n== NeMo Gym's opensandbox provider, remote ==\n" + _shown(records))
    allocation = _allocation(records)
    assert allocation[P + "allocation.unknown_reason"] == "engine_unreachable"
    assert not [k for k in allocation if k.startswith(P + "allocation.component")]
    # The requested shape stands beside it, on the create span.
    [create] = [a for name, a in receiver.spans["remote"] if name == "sandbox.create"]
    assert create[P + "requested.cpu"] == 0.5
    assert create[P + "requested.memory_mib"] == 64
    _no_host_figures(records)
    samples = _samples(records)
    read = [s for s in samples if s.get(P + "usage.source") == "opensandbox.metrics"]
    assert len(read) >= SAMPLES + 1
    # A record may give up at its deadline (the call goes on; the next sample has its answer).
    assert {s.get(P + "resource.error") for s in samples if s not in read} <= {
        "CancelledError",
        "TimeoutError",
    }
    assert samples[-1][P + "resource.final"] is True
    assert samples[-1] in read
    for sample in read:
        assert isinstance(sample[P + "usage.opensandbox.cpu_used_percent"], float)
        assert isinstance(sample[P + "usage.opensandbox.memory_used_mib"], float)
        # What execd reports is not the sandbox's own: never its CPU time or memory.
        assert P + "usage.cpu.time_s" not in sample
        assert P + "usage.memory_mib" not in sample
    assert server.key not in json.dumps(records)


async def test_opensandbox_server_down_gives_unknown_samples_until_it_is_back(
    own_server: Server, receiver: Receiver, tmp_path: Path
) -> None:
    """The server stopped mid-run: the samples say unknown (unreachable) and the provider's own
    status call fails as it would without us; once the server is back, API samples again and
    a clean close."""
    assert own_server.state is not None
    async with user_script(tmp_path, own_server, receiver, "down", NO_ENGINE) as run:

        def api_samples() -> int:
            return _periodic(
                receiver.records("down"),
                lambda s: s.get(P + "usage.source") == "opensandbox.metrics",
            )

        await receiver.until("a metrics API sample", lambda: api_samples() >= 1)
        _stop(own_server.state)
        await receiver.until(
            "a sample saying the server is unreachable",
            lambda: (
                _periodic(
                    receiver.records("down"),
                    lambda s: s.get(P + "usage.unknown_reason") == "opensandbox.unreachable",
                )
                >= 1
            ),
        )
        # The provider's own call fails as it does without us (its exception, not ours).
        assert await run.ask("status") not in ("SandboxStatus.RUNNING", "closed")
        before = api_samples()
        restarted = _start(own_server.state)
        assert restarted.domain == own_server.domain
        await receiver.until("a metrics API sample again", lambda: api_samples() > before)
        assert await run.ask("status") == "SandboxStatus.RUNNING"
        assert await run.ask("close") == "closed"
        await run.finish()
    samples = _samples(receiver.records("down"))
    assert samples[-1][P + "resource.final"] is True
    assert samples[-1][P + "usage.source"] == "opensandbox.metrics"
    assert {s.get(P + "resource.error") for s in samples} <= {
        None,
        "TimeoutError",
        "CancelledError",
    }


def test_opensandbox_failed_calls_map_to_stable_reasons() -> None:
    """The SDK's own exceptions for 401, 403, 404, 5xx, a timeout and a lost connection
    become the sample's unknown reason, never the exception's text."""
    from opensandbox.exceptions.sandbox import (
        SandboxApiException,
        SandboxConnectionException,
        SandboxTimeoutException,
    )

    from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import reason_of

    assert {
        code: reason_of(SandboxApiException("x", status_code=code))
        for code in (401, 403, 404, 500, 503, 429)
    } == {
        401: "opensandbox.unauthorized",
        403: "opensandbox.unauthorized",
        404: "opensandbox.not_found",
        500: "opensandbox.server_error",
        503: "opensandbox.server_error",
        429: "opensandbox.error",
    }
    assert reason_of(SandboxTimeoutException("x")) == "opensandbox.timeout"
    assert reason_of(TimeoutError()) == "opensandbox.timeout"
    assert reason_of(SandboxConnectionException("x")) == "opensandbox.unreachable"


async def test_opensandbox_container_removed_from_outside_ends_with_a_sample_saying_so(
    server: Server, receiver: Receiver, tmp_path: Path
) -> None:
    """A co-located sandbox whose container is removed behind the server's back ends with a
    final sample saying the container was removed."""
    async with user_script(tmp_path, server, receiver, "removed", os.environ["DOCKER_HOST"]) as run:
        await receiver.until(
            "a cgroup sample",
            lambda: (
                _periodic(receiver.records("removed"), lambda s: P + "usage.memory_mib" in s) >= 1
            ),
        )
        _remove_containers(run.sandbox_id)
        await run.ask("close")
        await run.finish()
    samples = _samples(receiver.records("removed"))
    assert samples[-1][P + "resource.final"] is True
    assert samples[-1][P + "usage.unknown_reason"] == "container_removed"


# --- two servers, one sandbox id; impossible figures ------------------------------------------

# The id both proxies show their server's first sandbox under, shaped like OpenSandbox's own.
SHOWN_ID = "00000000-0000-4000-8000-000000000036"
CPU_PERCENT = P + "usage.opensandbox.cpu_used_percent"
MEMORY_USED = P + "usage.opensandbox.memory_used_mib"


@contextlib.asynccontextmanager
async def _traced_through_proxy(
    servers: list[Server], interval_s: float
) -> AsyncIterator[tuple[list[Any], list[RenamingProxy], Any]]:
    """NeMo Gym main's ``OpenSandboxProvider`` for each server, through a ``RenamingProxy`` of
    its own, traced with a sandbox state of the test's own (an SDK tracer provider with an
    in-memory exporter, sampling every ``interval_s``); yields the traced providers, the
    proxies and the exporter. Sandboxes the proxies saw created are removed at the end."""
    from nemo_gym.sandbox.providers.opensandbox.provider import OpenSandboxProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
        SandboxState,
        traced_provider,
    )

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    state = SandboxState(tracer_provider, interval_s=interval_s)
    proxies = [RenamingProxy(server.domain, SHOWN_ID) for server in servers]
    providers = []
    try:
        for proxy, server in zip(proxies, servers, strict=True):
            connection = {
                "domain": await proxy.start(),
                "api_key": server.key,
                "protocol": "http",
                "request_timeout_s": 60,
                "use_server_proxy": True,
            }
            providers.append(
                OpenSandboxProvider(
                    connection=connection,
                    create={"timeout_s": 180, "retries": 0},
                    operations={"retries": 0, "close_timeout_s": 30},
                )
            )
        yield [traced_provider(p, state) for p in providers], proxies, exporter
    finally:
        for provider in providers:
            await provider.aclose()
        for proxy in proxies:
            await proxy.close()
            if proxy.real_id is not None:
                _remove_containers(proxy.real_id)
        tracer_provider.shutdown()


def _spans_named(exporter: Any, name: str) -> list[dict[str, Any]]:
    return [dict(s.attributes or {}) for s in exporter.get_finished_spans() if s.name == name]


def _metrics_samples(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in _samples(records) if s.get(P + "usage.source") == "opensandbox.metrics"]


async def _until(what: str, condition: Callable[[], bool]) -> None:
    from waiting import eventually

    await eventually(condition, what, timeout=BOUND_S, interval=0.05)


async def _finals(exporter: Any, count: int) -> None:
    """Wait for ``count`` final samples: after a close, the last record a sandbox makes."""

    def finals() -> int:
        records = _spans_named(exporter, "sandbox.resources")
        return sum(1 for r in records if r[P + "resource.final"])

    await _until(f"{count} final samples", lambda: finals() >= count)


SPEC_ARGS = {"image": IMAGE, "ready_timeout_s": 120}

# What a sample without the metrics API's figures may say on a loaded machine: its record gave
# up at its deadline (the call goes on; the next sample has its answer), or the call itself
# passed its 3 s timeout (``usage.unknown_reason``).
SLOW_SERVER = {
    (P + "resource.error", "CancelledError"),
    (P + "resource.error", "TimeoutError"),
    (P + "usage.unknown_reason", "opensandbox.timeout"),
}


def _unread_outcomes(
    samples: list[dict[str, Any]], read: list[dict[str, Any]]
) -> set[tuple[str, Any]]:
    """What each sample that is not a metrics API reading says instead."""
    keys = (P + "resource.error", P + "usage.unknown_reason")
    return {(k, s.get(k)) for s in samples if s not in read for k in keys if k in s} | {
        ("neither", None) for s in samples if s not in read and not any(k in s for k in keys)
    }


async def test_opensandbox_two_servers_with_one_sandbox_id_keep_their_own_records(
    server: Server, own_server: Server
) -> None:
    """Two real servers whose sandboxes share one id (each behind a proxy that renames it):
    each sandbox's exec and close spans carry its own request id, each gets its own metrics
    samples (told apart by the memory figure each proxy reports) and one final, and closing
    the second leaves the first sampling."""
    from nemo_gym.sandbox.providers.base import SandboxResources, SandboxSpec

    async with _traced_through_proxy([server, own_server], interval_s=1.0) as (
        (a, b),
        (proxy_a, proxy_b),
        exporter,
    ):
        proxy_a.metrics, proxy_b.metrics = {"mem_used_mib": 11.0}, {"mem_used_mib": 22.0}
        spec = SandboxSpec(resources=SandboxResources(cpu=0.5, memory_mib=64), **SPEC_ARGS)
        handle_a = await a.create(spec)
        handle_b = await b.create(spec)
        assert handle_a.sandbox_id == handle_b.sandbox_id == SHOWN_ID
        assert proxy_a.real_id != proxy_b.real_id

        def records() -> list[dict[str, Any]]:
            return _spans_named(exporter, "sandbox.resources")

        def answered(memory: float) -> int:
            """The metrics samples with ``memory``, each sandbox's rebuilt on its own (the
            two share an id, by which a partial sample is laid over its previous one)."""
            every = records()
            return sum(
                1
                for request in {r[P + "request.id"] for r in every}
                for s in _metrics_samples([r for r in every if r[P + "request.id"] == request])
                if s.get(MEMORY_USED) == memory
            )

        await _until("2 samples of each server", lambda: min(answered(11.0), answered(22.0)) >= 2)
        assert (await a.exec(handle_a, "exit 3", timeout_s=60)).return_code == 3
        assert (await b.exec(handle_b, "exit 4", timeout_s=60)).return_code == 4
        await b.close(handle_b)
        after_close = proxy_a.metrics_answered
        await _until(
            "A's metrics asked after B's close", lambda: proxy_a.metrics_answered > after_close + 1
        )
        await a.close(handle_a)
        await _finals(exporter, 2)

    [create_a, create_b] = _spans_named(exporter, "sandbox.create")
    request_a, request_b = create_a[P + "request.id"], create_b[P + "request.id"]
    assert request_a != request_b

    def known(request_id: str) -> dict[str, Any]:
        return {P + "request.id": request_id, P + "provider": "opensandbox", P + "id": SHOWN_ID}

    assert _spans_named(exporter, "sandbox.exec") == [
        {**known(request_a), P + "exec.return_code": 3},
        {**known(request_b), P + "exec.return_code": 4},
    ]
    assert _spans_named(exporter, "sandbox.close") == [known(request_b), known(request_a)]
    records = _spans_named(exporter, "sandbox.resources")
    print("\n== two servers, one sandbox id ==\n" + _shown(records))
    for request, memory, _proxy in ((request_a, 11.0, proxy_a), (request_b, 22.0, proxy_b)):
        mine = [r for r in records if r[P + "request.id"] == request]
        [allocation] = [r for r in mine if r[P + "resource.kind"] == "allocation"]
        # The renamed id names no container on the engine: the remote path, by the metrics API.
        assert allocation[P + "allocation.unknown_reason"] == "container_not_found"
        samples = _samples(mine)
        read = _metrics_samples(mine)
        # Every figure this sandbox's samples carry is its own server's (a partial sample
        # leaves an unchanged one out).
        assert {s.get(MEMORY_USED, memory) for s in read} == {memory}
        assert len(read) >= 2
        assert [s[P + "resource.final"] for s in samples].count(True) == 1
        assert samples[-1][P + "resource.final"] is True
        assert _unread_outcomes(samples, read) <= SLOW_SERVER
        assert server.key not in json.dumps(mine)
        assert own_server.key not in json.dumps(mine)
    assert len(records) == sum(1 for r in records if r[P + "request.id"] in (request_a, request_b))
    # A went on after B's close: its last periodic sample came after B's final.
    final_b = next(
        i
        for i, r in enumerate(records)
        if r[P + "request.id"] == request_b and r[P + "resource.final"]
    )
    assert any(
        r[P + "request.id"] == request_a and not r[P + "resource.final"]
        for r in records[final_b + 1 :]
    )


async def test_opensandbox_connect_to_an_open_sandbox_stays_that_sandbox(server: Server) -> None:
    """A connect (NeMo Gym's ``connect({"sandbox_id": ...})``) to a sandbox this process has
    open gives a second handle to the same sandbox: the connect and exec spans carry the
    create's identity, no second allocation read or sampler starts, and closing one handle
    ends the one sampler with one final."""
    from nemo_gym.sandbox.providers.base import SandboxSpec

    async with _traced_through_proxy([server], interval_s=1.0) as ((provider,), _, exporter):
        created = await provider.create(SandboxSpec(**SPEC_ARGS))
        connected = await provider.connect({"sandbox_id": created.sandbox_id})
        assert connected is not created
        assert (await provider.exec(connected, "exit 5", timeout_s=60)).return_code == 5
        await _until(
            "a metrics sample",
            lambda: bool(_metrics_samples(_spans_named(exporter, "sandbox.resources"))),
        )
        await provider.close(connected)
        await _finals(exporter, 1)
    [create] = _spans_named(exporter, "sandbox.create")
    known = {k: create[k] for k in (P + "request.id", P + "provider", P + "id")}
    assert _spans_named(exporter, "sandbox.connect") == [known]
    assert _spans_named(exporter, "sandbox.exec") == [{**known, P + "exec.return_code": 5}]
    assert _spans_named(exporter, "sandbox.close") == [known]
    records = _spans_named(exporter, "sandbox.resources")
    assert all({k: r[k] for k in known} == known for r in records)
    assert [r[P + "resource.kind"] for r in records].count("allocation") == 1
    assert [r[P + "resource.final"] for r in records].count(True) == 1


async def test_opensandbox_impossible_metrics_are_dropped_and_logged_once(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Through a proxy that makes the real server's metrics answer say 1e9 % CPU on its own 2
    CPUs and 1e13 MiB of its own ~24 GiB: no sample carries either figure, and each drop is
    logged once; the answer's other figures (its timestamp) are kept."""
    from nemo_gym.sandbox.providers.base import SandboxSpec

    from opentelemetry.instrumentation.nemo_gym.sandbox import _log

    _log._FAILURES.reset()  # this test's warnings are the first of their kind
    caplog.set_level(logging.WARNING, "opentelemetry.instrumentation.nemo_gym")
    async with _traced_through_proxy([server], interval_s=1.0) as ((provider,), (proxy,), exporter):
        proxy.metrics = {"cpu_used_pct": 1e9, "mem_used_mib": 1e13}
        handle = await provider.create(SandboxSpec(**SPEC_ARGS))
        await _until(
            "2 metrics samples",
            lambda: len(_metrics_samples(_spans_named(exporter, "sandbox.resources"))) >= 2,
        )
        await provider.close(handle)
        await _finals(exporter, 1)
    records = _spans_named(exporter, "sandbox.resources")
    read = _metrics_samples(records)
    assert len(read) >= 2
    assert _unread_outcomes(_samples(records), read) <= SLOW_SERVER
    for sample in read:
        assert not {CPU_PERCENT, MEMORY_USED} & sample.keys(), sample
        assert isinstance(sample.get(P + "usage.opensandbox.timestamp_ms", 0), int)
    assert isinstance(read[0][P + "usage.opensandbox.timestamp_ms"], int)
    dropped = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "more than the answer's own" in r.getMessage()
    ]
    assert sorted(m.split(":")[0] for m in dropped) == [
        "dropping sample value usage.opensandbox.cpu_used_percent",
        "dropping sample value usage.opensandbox.memory_used_mib",
    ]
