"""NeMo Gym main's ``opensandbox`` provider on OpenSandbox's Kubernetes runtime: true records.

A user's script, run under a real ``opentelemetry-instrument`` on NeMo Gym's repository main,
creates a sandbox (cpu 0.5, memory 64 MiB) through ``AsyncSandbox({"opensandbox": {...}})``
against the server of ``scripts/start-opensandbox.sh --kubernetes``: the server makes a
``BatchSandbox``, OpenSandbox's controller its pod, on the single-node cluster of
``scripts/start-kubernetes.sh``. The script runs a command, uploads and downloads a file,
runs a command that makes the kernel OOM-kill the sandbox container's first process, and
closes the sandbox. No engine is in its reach (``DOCKER_HOST`` names no socket), its
``KUBECONFIG`` names the server's namespace: the plugin's opensandbox reader reads the pod.
Spans and metrics go over OTLP/HTTP to a receiver on loopback here. Everything runs inside the
cluster's network namespace (the server reaches execd at the pod's address, the reader the
kubelet at the node's); the ``opensandbox_kubernetes`` section (``SECTIONS`` in
``conftest.py``) fails, never skips, when the cluster, the server or NeMo Gym main is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import INSTRUMENT
from test_nemo_gym_main_providers import (
    BOUND_S,
    Receiver,
    _samples,
    _shown,
    instrumented_env,
    receiver,
)
from waiting import eventually

try:  # NeMo Gym main's virtualenv has lightkube (this package's test extra)
    from lightkube import AsyncClient
    from lightkube.generic_resource import create_namespaced_resource
    from lightkube.resources.core_v1 import Pod
except ImportError:
    pass

pytestmark = [pytest.mark.opensandbox_kubernetes, pytest.mark.integration]

__all__ = ["receiver"]

P = "nemo.gym.sandbox."
IMAGE = "localhost/nemo-gym-busybox:1"
NAMESPACE = "opensandbox"
REPO = Path(__file__).resolve().parent.parent
START = REPO / "scripts" / "start-opensandbox.sh"
NO_ENGINE = "unix:///nonexistent/opensandbox-test-no-engine.sock"
SERVICE = "opensandbox-kubernetes"

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys, tempfile
    from pathlib import Path
    from nemo_gym.sandbox import AsyncSandbox, SandboxResources, SandboxSpec

    CONFIG = json.loads(os.environ["OPENSANDBOX_TEST_CONFIG"])  # provider_config()
    # The first process of the sandbox container (bootstrap.sh) made the OOM killer's choice;
    # the memory it fills is tmpfs, in no process's RSS, charged to the container's cgroup.
    OOM = (
        "echo 0 >/proc/self/oom_score_adj; echo 1000 >/proc/1/oom_score_adj; "
        "dd if=/dev/zero of=/dev/shm/fill bs=4k count=40000"
    )

    async def main():
        spec = SandboxSpec(
            image=sys.argv[1],
            resources=SandboxResources(cpu=0.5, memory_mib=64),
            ready_timeout_s=120,
        )
        sandbox = AsyncSandbox(CONFIG, spec)
        await sandbox.start()
        echo = await sandbox.exec("echo hello from the pod", timeout_s=60)
        folder = Path(tempfile.mkdtemp())
        (folder / "up.txt").write_text("moved both ways\\n")
        await sandbox.upload(folder / "up.txt", "/tmp/up.txt")
        await sandbox.download("/tmp/up.txt", folder / "down.txt")
        print(json.dumps({
            "echo": echo.stdout, "echo_exit": echo.return_code,
            "file": (folder / "down.txt").read_text(),
        }), flush=True)
        while True:
            command = (await asyncio.to_thread(sys.stdin.readline)).strip()
            try:
                if command == "oom":
                    answer = (await sandbox.exec(OOM, timeout_s=60)).return_code
                else:
                    await sandbox.stop()
                    answer = "closed"
            except Exception as exc:  # the provider's own exception, not ours
                answer = type(exc).__name__
            print(json.dumps({command: answer}), flush=True)
            if command != "oom":
                return

    asyncio.run(main())
    """
)

# Creates one sandbox with short readiness bounds and says how it went; closes it if it started.
CREATE = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from nemo_gym.sandbox import AsyncSandbox, SandboxResources, SandboxSpec

    CONFIG = json.loads(os.environ["OPENSANDBOX_TEST_CONFIG"])  # provider_config()

    async def main():
        spec = SandboxSpec(
            image=sys.argv[1],
            resources=SandboxResources(cpu=0.5, memory_mib=64),
            ready_timeout_s=20,
        )
        sandbox = AsyncSandbox(CONFIG, spec)
        try:
            await sandbox.start()
        except Exception as exc:  # the provider's own exception, not ours
            print(json.dumps({"error": type(exc).__name__}), flush=True)
            return
        print(json.dumps({"started": True}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        await sandbox.stop()
        print(json.dumps({"closed": True}), flush=True)

    asyncio.run(main())
    """
)


def provider_config(server: Server, timeout_s: float = 60, create_retries: int = 1) -> str:
    """NeMo Gym's opensandbox provider configuration for ``server``, as its shipped
    opensandbox.yaml has it with short timeouts for a test (``timeout_s`` for requests and
    closes; a create has three times as long), as the user script reads it (JSON)."""
    return json.dumps(
        {
            "opensandbox": {
                "connection": {
                    "domain": server.domain,
                    "api_key": server.key,
                    "protocol": "http",
                    "request_timeout_s": timeout_s,
                    "use_server_proxy": True,
                },
                "create": {"timeout_s": 3 * timeout_s, "retries": create_retries},
                "operations": {"retries": 0, "close_timeout_s": timeout_s},
            }
        }
    )


@dataclass
class Server:
    domain: str
    key: str
    state: Path  # start-opensandbox.sh's state folder


def started_pid(server: Server, what: str) -> int:
    """The ``controller`` or ``server`` start-opensandbox.sh started, checked as the script
    checks it (PID and start time recorded at its start)."""
    recorded = dict(
        line.split("=", 1) for line in (server.state / f"{what}.identity").read_text().split()
    )
    pid = int((server.state / f"{what}.pid").read_text())
    assert recorded["PID"] == str(pid)
    stat = Path(f"/proc/{pid}/stat").read_text()
    assert stat.rsplit(") ", 1)[1].split()[19] == recorded["START_TIME"]
    return pid


@pytest.fixture(scope="module")
def server() -> Server:
    """The server of ``scripts/start-opensandbox.sh --kubernetes`` (started when not running;
    .ci/run stops it)."""
    version = importlib.metadata.version("nemo-gym")
    assert version.startswith("0.5"), f"nemo-gym {version} is not NeMo Gym main (0.5.x)"
    return start_server()


def start_server() -> Server:
    """Run start-opensandbox.sh --kubernetes (it starts what is not running) and read what it
    prints."""
    done = subprocess.run(
        ["bash", str(START), "--kubernetes"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert done.returncode == 0, f"start-opensandbox.sh --kubernetes: {done.stderr[-3000:]}"
    lines = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert lines["OPENSANDBOX_KUBERNETES_NAMESPACE"] == NAMESPACE
    key_file = Path(lines["OPENSANDBOX_API_KEY_FILE"])
    return Server(lines["OPENSANDBOX_DOMAIN"], key_file.read_text().strip(), key_file.parent)


def kubeconfig_in_namespace(tmp_path: Path) -> Path:
    """The cluster's admin kubeconfig with its context in the server's namespace: where the
    plugin's reader looks for the sandboxes' pods."""
    text, count = re.subn(
        r"\n  context:\n",
        f"\n  context:\n    namespace: {NAMESPACE}\n",
        Path(os.environ["KUBECONFIG"]).read_text(),
    )
    assert count == 1
    path = tmp_path / "user.kubeconfig"
    path.write_text(text)
    return path


class UserScript:
    """The user's script under ``opentelemetry-instrument``, driven line by line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

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
        """Wait for the script's end (status 0); its standard error (the plugin's log)."""
        _, stderr = await asyncio.wait_for(self.process.communicate(), BOUND_S)
        assert self.process.returncode == 0, stderr.decode()[-3000:]
        return stderr.decode()


@contextlib.asynccontextmanager
async def user_script(
    tmp_path: Path,
    server: Server,
    receiver: Receiver,
    text: str = SCRIPT,
    kubeconfig: Path | None = None,
    config: str | None = None,
) -> AsyncIterator[UserScript]:
    script = tmp_path / "user_script.py"
    script.write_text(text)
    env = instrumented_env(SERVICE, receiver, "2")
    env.update(
        OPENSANDBOX_TEST_CONFIG=config or provider_config(server),
        DOCKER_HOST=NO_ENGINE,
        KUBECONFIG=str(kubeconfig or kubeconfig_in_namespace(tmp_path)),
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
    try:
        yield UserScript(process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def _periodic(records: list[dict[str, Any]], oom_kills: int) -> int:
    """Periodic samples read from the kubelet's summary with ``oom_kills`` counted."""
    return sum(
        1
        for s in _samples(records)
        if not s[P + "resource.final"]
        and s.get(P + "usage.source") == "kubelet.summary"
        and s.get(P + "usage.oom_kills") == oom_kills
    )


def _cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _mib(quantity: str) -> int:
    assert quantity.endswith("Mi"), quantity
    return int(quantity[:-2])


async def test_opensandbox_kubernetes_records_come_from_the_pod_and_the_kubelet(
    server: Server, receiver: Receiver, tmp_path: Path
) -> None:
    """A sandbox that OpenSandbox's Kubernetes runtime made a pod: its allocation is exactly the
    requests and limits OpenSandbox set on the pod (``kubernetes.pod``), its samples are the
    kubelet's, its OOM kill is counted, a final sample comes at close, and the close leaves no
    BatchSandbox and no pod."""
    admin = AsyncClient(namespace=NAMESPACE)
    try:
        async with user_script(tmp_path, server, receiver) as run:
            moved = await run.line()
            assert moved == {
                "echo": "hello from the pod",
                "echo_exit": 0,
                "file": "moved both ways\n",
            }
            creates = [a for name, a in receiver.spans[SERVICE] if name == "sandbox.create"]
            assert len(creates) == 1
            sandbox_id = creates[0][P + "id"]
            pods = [p async for p in admin.list(Pod, labels={"opensandbox.io/id": sandbox_id})]
            assert len(pods) == 1, [p.metadata.name for p in pods]
            (pod,) = pods
            (container,) = [c for c in pod.spec.containers if c.name == "sandbox"]
            await receiver.until(
                "2 kubelet samples",
                lambda: _periodic(receiver.records(SERVICE), 0) >= 2,
            )
            assert await run.ask("oom") is not None
            await receiver.until(
                "a kubelet sample with the OOM kill",
                lambda: _periodic(receiver.records(SERVICE), 1) >= 1,
            )
            assert await run.ask("close") == "closed"
            await run.finish()

        records = receiver.records(SERVICE)
        print("\n== NeMo Gym's opensandbox provider, Kubernetes runtime ==\n" + _shown(records))
        identity = {k: creates[0][k] for k in (P + "request.id", P + "provider", P + "id")}
        assert all({k: r[k] for k in identity} == identity for r in records)
        [allocation] = [r for r in records if r[P + "resource.kind"] == "allocation"]
        limits, requests = container.resources.limits, container.resources.requests
        component = P + "allocation.component.sandbox."
        assert allocation == {
            **identity,
            P + "resource.kind": "allocation",
            P + "resource.final": False,
            P + "allocation.source": "kubernetes.pod",
            P + "allocation.designator.kind": "opensandbox.sandbox",
            P + "allocation.designator.id": sandbox_id,
            P + "allocation.designator.scope": server.domain,
            P + "allocation.host.kind": "k8s.pod",
            P + "allocation.host.id": pod.metadata.uid,
            P + "allocation.host.scope": allocation[P + "allocation.host.scope"],
            P + "allocation.components": ["sandbox"],
            component + "limits.cpu": _cores(limits["cpu"]),
            component + "limits.memory_mib": _mib(limits["memory"]),
            component + "limits.unspecified": ["disk_gib", "gpu"],
            component + "requests.cpu": _cores(requests["cpu"]),
            component + "requests.memory_mib": _mib(requests["memory"]),
            component + "requests.unspecified": ["disk_gib", "gpu"],
            P + "allocation.placement.namespace": NAMESPACE,
            P + "allocation.placement.pod": pod.metadata.name,
            P + "allocation.placement.node": pod.spec.nodeName,
            P + "allocation.placement.qos_class": pod.status.qosClass,
        }
        # What NeMo Gym asked for, as OpenSandbox set it.
        assert (_cores(limits["cpu"]), _mib(limits["memory"])) == (0.5, 64)

        samples = _samples(records)
        assert all(s.get(P + "usage.source") == "kubelet.summary" for s in samples)
        assert [s[P + "resource.final"] for s in samples].count(True) == 1
        final = samples[-1]
        assert final[P + "resource.final"] is True
        assert final[P + "usage.oom_kills"] == 1
        assert all(s.get(P + "usage.memory_mib", 0) <= 64 for s in samples)
        assert receiver.oom_kills[SERVICE] == {((P + "provider", "opensandbox"),): 1}

        await _nothing_left_of(admin, sandbox_id)
    finally:
        await admin.close()


async def _nothing_left_of(admin: AsyncClient, sandbox_id: str) -> None:
    """Wait until neither a BatchSandbox nor a pod of the sandbox is left in the cluster."""

    async def nothing_left() -> bool:
        left = [p async for p in admin.list(Pod, labels={"opensandbox.io/id": sandbox_id})]
        left += [b async for b in admin.list(_batch_sandbox())]
        return not [o for o in left if o.metadata.name.startswith(sandbox_id)]

    await eventually(nothing_left, "no BatchSandbox and no pod of the sandbox", timeout=120)


def _batch_sandbox() -> Any:
    return create_namespaced_resource(
        "sandbox.opensandbox.io", "v1alpha1", "BatchSandbox", "batchsandboxes"
    )


async def _remove_batch_sandboxes_made_since(admin: AsyncClient, before: set[str]) -> None:
    """Delete what a failed create left behind (the server may leave its BatchSandbox), and wait
    until neither it nor a pod of it is there, so the next test starts from the same cluster."""
    batch_sandbox = _batch_sandbox()
    left = [b.metadata.name async for b in admin.list(batch_sandbox)]
    for name in set(left) - before:
        with contextlib.suppress(Exception):  # the server may delete it at the same moment
            await admin.delete(batch_sandbox, name, grace_period=0)

    async def gone() -> bool:
        names = {b.metadata.name async for b in admin.list(batch_sandbox)}
        pods = {p.metadata.name async for p in admin.list(Pod)}
        made = names - before
        return not made and not any(p.startswith(tuple(set(left) - before)) for p in pods)

    if set(left) - before:
        await eventually(gone, "the failed create's BatchSandbox and pod removed", timeout=120)


async def test_opensandbox_kubernetes_controller_down_no_allocation_invented(
    server: Server, receiver: Receiver, tmp_path: Path
) -> None:
    """OpenSandbox's controller stopped (SIGSTOP): the BatchSandbox never gets a pod, the
    sandbox never becomes ready and NeMo Gym's provider gives up. The create span carries the
    provider's error type; no allocation and no sample is recorded for a sandbox that never
    ran. (The controller runs again afterwards, and what the create left is removed.)"""
    admin = AsyncClient(namespace=NAMESPACE)
    before = {b.metadata.name async for b in admin.list(_batch_sandbox())}
    pid = started_pid(server, "controller")
    os.kill(pid, signal.SIGSTOP)
    try:
        short = provider_config(server, timeout_s=10, create_retries=0)
        async with user_script(tmp_path, server, receiver, CREATE, config=short) as run:
            answer = await run.line()
            await run.finish()
    finally:
        os.kill(pid, signal.SIGCONT)
        try:
            await _remove_batch_sandboxes_made_since(admin, before)
        finally:
            await admin.close()
    assert set(answer) == {"error"}, answer
    spans = receiver.spans[SERVICE]
    creates = [a for name, a in spans if name == "sandbox.create"]
    assert len(creates) == 1
    assert creates[0]["error.type"] == answer["error"]
    assert receiver.records(SERVICE) == []


async def test_opensandbox_kubernetes_service_account_without_pod_access(
    server: Server, receiver: Receiver, tmp_path: Path
) -> None:
    """The user's kubeconfig holds a service account that may not read the server's pods
    (the docs' RBAC without its pods binding): the sandbox works as before, its allocation says
    ``kubernetes.forbidden`` instead of figures, its samples come from OpenSandbox's metrics
    API (the server's view of a sandbox this process cannot see), and the log says why once."""
    from test_kubernetes_reader import service_account_kubeconfig

    admin = AsyncClient(namespace=NAMESPACE)
    try:
        kubeconfig = await service_account_kubeconfig(
            admin, NAMESPACE, tmp_path, node_stats=True, pods=False
        )
        text, count = re.subn(
            r"\n  context:\n", f"\n  context:\n    namespace: {NAMESPACE}\n", kubeconfig.read_text()
        )
        assert count == 1
        kubeconfig.write_text(text)
        async with user_script(tmp_path, server, receiver, kubeconfig=kubeconfig) as run:
            moved = await run.line()
            assert moved["echo"] == "hello from the pod"
            await receiver.until(
                "a sample from OpenSandbox's metrics API",
                lambda: _periodic_from(receiver.records(SERVICE), "opensandbox.metrics") >= 1,
            )
            assert await run.ask("close") == "closed"
            log = await run.finish()
    finally:
        await _remove_documented_rbac(admin)
        await admin.close()
    records = receiver.records(SERVICE)
    [allocation] = [r for r in records if r[P + "resource.kind"] == "allocation"]
    identity = {k: allocation[k] for k in (P + "request.id", P + "provider", P + "id")}
    assert allocation == {
        **identity,
        P + "resource.kind": "allocation",
        P + "resource.final": False,
        P + "allocation.unknown_reason": "kubernetes.forbidden",
    }
    # Its usage is still read, where the server can give it: OpenSandbox's metrics API, as
    # for a sandbox no engine and no cluster here can see.
    samples = [s for s in _samples(records) if not s[P + "resource.final"]]
    assert samples
    assert all(s[P + "usage.source"] == "opensandbox.metrics" for s in samples), samples
    said = [line for line in log.splitlines() if "forbidden" in line]
    assert said == [
        "WARNING:opentelemetry.instrumentation.nemo_gym.sandbox.readers.kubernetes:Kubernetes "
        f"sandbox reader: forbidden to list and watch pods (namespace {NAMESPACE}); records say "
        "kubernetes.forbidden"
    ]


def _periodic_from(records: list[dict[str, Any]], source: str) -> int:
    """Periodic samples whose figures came from ``source``."""
    return sum(
        1
        for s in _samples(records)
        if not s[P + "resource.final"] and s.get(P + "usage.source") == source
    )


async def _remove_documented_rbac(admin: AsyncClient) -> None:
    """The docs' service account and RBAC in the server's namespace, removed (the namespace
    outlives the test)."""
    from lightkube import codecs
    from lightkube.core.exceptions import ApiError

    from test_kubernetes_reader import rbac_yaml

    for obj in codecs.load_all_yaml(rbac_yaml(NAMESPACE)):
        if type(obj).__name__ == "ClusterRole":
            continue  # shared by every namespace's binding
        try:
            await admin.delete(type(obj), obj.metadata.name, namespace=obj.metadata.namespace)
        except ApiError as error:
            if error.status.code != 404:
                raise


async def _created_and_sampled(run: UserScript, receiver: Receiver) -> str:
    """Wait for the user script's first answer (its sandbox made and used) and for one
    periodic sample from the kubelet; the sandbox's id."""
    await run.line()
    creates = [a for name, a in receiver.spans[SERVICE] if name == "sandbox.create"]
    sandbox_id: str = creates[0][P + "id"]
    await receiver.until(
        "a kubelet sample",
        lambda: _periodic_from(receiver.records(SERVICE), "kubelet.summary") >= 1,
    )
    return sandbox_id


async def test_opensandbox_kubernetes_pod_deleted_mid_run(
    server: Server, receiver: Receiver, tmp_path: Path
) -> None:
    """The sandbox's pod deleted while NeMo Gym uses it: OpenSandbox's controller makes it
    again (same name, a new UID), the plugin follows the new pod, and its samples say the
    sandbox's container started again (``usage.restarts`` 1, CPU time from zero); the close
    still leaves nothing behind."""
    admin = AsyncClient(namespace=NAMESPACE)
    try:
        async with user_script(tmp_path, server, receiver) as run:
            sandbox_id = await _created_and_sampled(run, receiver)
            (first,) = [p async for p in admin.list(Pod, labels={"opensandbox.io/id": sandbox_id})]
            await admin.delete(Pod, first.metadata.name, grace_period=0)
            await receiver.until(
                "a sample of the pod made again",
                lambda: any(
                    s.get(P + "usage.restarts") == 1 and P + "usage.cpu.time_s" in s
                    for s in _samples(receiver.records(SERVICE))
                ),
            )
            (again,) = [p async for p in admin.list(Pod, labels={"opensandbox.io/id": sandbox_id})]
            assert again.metadata.uid != first.metadata.uid
            assert await run.ask("close") == "closed"
            await run.finish()

        samples = _samples(receiver.records(SERVICE))
        restarts = [s[P + "usage.restarts"] for s in samples if P + "usage.restarts" in s]
        assert restarts == sorted(restarts)
        assert restarts[0] == 0
        assert restarts[-1] == 1
        assert samples[-1][P + "resource.final"] is True

        await _nothing_left_of(admin, sandbox_id)
    finally:
        await admin.close()


async def test_opensandbox_kubernetes_server_restarted_mid_run(
    server: Server, receiver: Receiver, tmp_path: Path
) -> None:
    """The OpenSandbox server ended (SIGTERM) while NeMo Gym holds a sandbox, and started again
    by start-opensandbox.sh: the pod goes on running, the plugin goes on sampling it from the
    kubelet while no server answers (it asks the server nothing for a pod), and after the
    restart NeMo Gym's close goes through the new server and leaves nothing behind."""
    admin = AsyncClient(namespace=NAMESPACE)
    try:
        async with user_script(tmp_path, server, receiver) as run:
            sandbox_id = await _created_and_sampled(run, receiver)
            pid = started_pid(server, "server")
            os.kill(pid, signal.SIGTERM)
            await eventually(
                lambda: not Path(f"/proc/{pid}").exists(), "the server ended", timeout=60
            )
            seen = _periodic_from(receiver.records(SERVICE), "kubelet.summary")
            await receiver.until(
                "a kubelet sample while no server runs",
                lambda: _periodic_from(receiver.records(SERVICE), "kubelet.summary") > seen,
            )
            again = await asyncio.to_thread(start_server)
            assert again.domain == server.domain
            assert await run.ask("close") == "closed"
            await run.finish()
        samples = _samples(receiver.records(SERVICE))
        assert all(s.get(P + "usage.source") == "kubelet.summary" for s in samples), samples
        assert samples[-1][P + "resource.final"] is True
        await _nothing_left_of(admin, sandbox_id)
    finally:
        await admin.close()
