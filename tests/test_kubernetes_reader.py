"""The Kubernetes reader against the real single-node cluster of scripts/start-kubernetes.sh.

Each test makes its own namespace and pods (the local busybox image, requests and limits
500m / 64Mi), reads them through ``KubernetesReader`` as a ``ResourceSampler`` does, and checks
each record whole against what the API server and the kubelet say. The section runs inside
the cluster's network namespace (the kubelet is at the node's address, 192.0.2.1); it fails,
never skips, when the cluster is not there (tests/conftest.py, ``kubernetes``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import ssl
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxHandle
from opentelemetry.instrumentation.nemo_gym.sandbox.readers import kubernetes as reader_module
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.kubernetes import KubernetesReader
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import OpenSandboxReader
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ResourceDesignator,
    ResourceSampler,
    ResourcesUnknown,
)
from waiting import eventually

try:  # the kubernetes extra; without it the section's check fails each test (conftest.py)
    import httpx2
    from lightkube import AsyncClient, codecs
    from lightkube.core.exceptions import ApiError
    from lightkube.models.authentication_v1 import TokenRequestSpec
    from lightkube.models.core_v1 import (
        Container,
        PodSpec,
        ResourceRequirements,
    )
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import (
        Namespace,
        Pod,
        ServiceAccount,
        ServiceAccountToken,
    )
    from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding
except ImportError:
    pass

pytestmark = pytest.mark.kubernetes

IMAGE = "localhost/nemo-gym-busybox:1"
NODE = "nemo-gym-node"
LIMITS = {"cpu": "500m", "memory": "64Mi", "ephemeral-storage": "1Gi"}
ALLOCATION = PREFIX + "allocation."
USAGE = PREFIX + "usage."
DOCS = Path(__file__).resolve().parent.parent / "docs" / "sandboxes.md"
ADMIN_KUBECONFIG = Path(os.environ.get("KUBECONFIG", "/nonexistent"))


def state_dir() -> Path:
    return Path(os.environ["KUBECONFIG"]).resolve().parent


def api_scope() -> str:
    server = re.search(r"server: https://(\S+)", Path(os.environ["KUBECONFIG"]).read_text())
    assert server is not None
    return server.group(1)


@pytest.fixture
async def admin() -> AsyncIterator[AsyncClient]:
    client = AsyncClient(field_manager="nemo-gym-otel-tests")
    yield client
    await client.close()


@pytest.fixture
async def namespace(admin: AsyncClient) -> AsyncIterator[str]:
    name = f"nemo-gym-test-{uuid.uuid4().hex[:8]}"
    await admin.create(Namespace(metadata=ObjectMeta(name=name)))

    async def default_account() -> bool:
        # The controller manager makes it; a pod created before it is refused.
        try:
            await admin.get(ServiceAccount, "default", namespace=name)
        except ApiError:
            return False
        return True

    await eventually(default_account, f"the default service account of {name}", timeout=60)
    yield name
    await admin.delete(Namespace, name, grace_period=0)


@pytest.fixture
def spans(
    global_tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter
) -> InMemorySpanExporter:
    return span_exporter


def pod_of(
    name: str, sandbox_id: str, command: str, restart: str = "Never", small: bool = False
) -> Pod:
    """A sandbox pod as OpenSandbox's runtime makes one: labelled with the sandbox id, its
    main container ``sandbox`` with requests equal to limits (Guaranteed)."""
    return Pod(
        metadata=ObjectMeta(name=name, labels={"opensandbox.io/id": sandbox_id}),
        spec=PodSpec(
            restartPolicy=restart,
            terminationGracePeriodSeconds=1,
            containers=[
                Container(
                    name="sandbox",
                    image=IMAGE,
                    imagePullPolicy="Never",
                    command=["/bin/sh", "-c", command],
                    resources=ResourceRequirements(
                        requests={"cpu": "1m", "memory": "8Mi"} if small else dict(LIMITS),
                        limits=dict(LIMITS),
                    ),
                )
            ],
        ),
    )


async def start_pod(
    admin: AsyncClient, namespace: str, command: str, restart: str = "Never", small: bool = False
) -> tuple[SandboxHandle, Pod]:
    sandbox_id = uuid.uuid4().hex[:12]
    await admin.create(
        pod_of(f"sandbox-{sandbox_id}", sandbox_id, command, restart, small),
        namespace=namespace,
    )

    async def running() -> Pod | None:
        pod = await admin.get(Pod, f"sandbox-{sandbox_id}", namespace=namespace)
        statuses = (pod.status and pod.status.containerStatuses) or []
        return pod if statuses and statuses[0].state and statuses[0].state.running else None

    pod = await eventually(running, f"pod sandbox-{sandbox_id} running", timeout=120)
    return SandboxHandle(sandbox_id=sandbox_id, provider_name="opensandbox", raw=None), pod


def kubelet_client() -> httpx2.AsyncClient:
    """The kubelet, asked directly with the admin's certificate: the figures to compare with."""
    pki = state_dir() / "pki"
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return httpx2.AsyncClient(base_url="https://192.0.2.1:10250", verify=context, timeout=10)


async def kubelet_cpu_s(kubelet: httpx2.AsyncClient, pod: Pod) -> float:
    summary = (await kubelet.get("/stats/summary")).json()
    (entry,) = [p for p in summary["pods"] if p["podRef"]["uid"] == pod.metadata.uid]
    (container,) = [c for c in entry["containers"] if c["name"] == "sandbox"]
    return float(container["cpu"]["usageCoreNanoSeconds"]) / 1e9


def records(spans: InMemorySpanExporter, kind: str) -> list[dict[str, Any]]:
    return [
        dict(s.attributes or {})
        for s in spans.get_finished_spans()
        if (s.attributes or {}).get(PREFIX + "resource.kind") == kind
    ]


def identity(handle: SandboxHandle) -> dict[str, Any]:
    return {PREFIX + "provider": "opensandbox", PREFIX + "id": handle.sandbox_id}


def allocation_record(handle: SandboxHandle, pod: Pod, namespace: str) -> dict[str, Any]:
    """The allocation record a 500m / 64Mi / 1Gi Guaranteed pod gets, whole."""
    scope = api_scope()
    component = ALLOCATION + "component.sandbox."
    return {
        **identity(handle),
        PREFIX + "resource.kind": "allocation",
        PREFIX + "resource.final": False,
        ALLOCATION + "source": "kubernetes.pod",
        ALLOCATION + "designator.kind": "k8s.pod",
        ALLOCATION + "designator.id": pod.metadata.uid,
        ALLOCATION + "designator.scope": scope,
        ALLOCATION + "host.kind": "k8s.node",
        ALLOCATION + "host.id": NODE,
        ALLOCATION + "host.scope": scope,
        ALLOCATION + "components": ("sandbox",),
        component + "requests.cpu": 0.5,
        component + "requests.memory_mib": 64,
        component + "requests.disk_gib": 1,
        component + "requests.unspecified": ("gpu",),
        component + "limits.cpu": 0.5,
        component + "limits.memory_mib": 64,
        component + "limits.disk_gib": 1,
        component + "limits.unspecified": ("gpu",),
        ALLOCATION + "placement.namespace": namespace,
        ALLOCATION + "placement.pod": pod.metadata.name,
        ALLOCATION + "placement.node": NODE,
        ALLOCATION + "placement.qos_class": "Guaranteed",
    }


# What a sample from a running container holds, as the reader answers it.
SAMPLE_FIGURES = {
    "usage." + figure
    for figure in ("source", "cpu.time_s", "memory_mib", "memory_rss_mib", "oom_kills", "restarts")
}


def sample_keys() -> set[str]:
    """The attributes of a sample record from a running container."""
    base = {PREFIX + "provider", PREFIX + "id", PREFIX + "resource.kind", PREFIX + "resource.final"}
    return base | {PREFIX + figure for figure in SAMPLE_FIGURES}


@pytest.fixture(autouse=True)
def fresh_once_log() -> Iterator[None]:
    reader_module._ONCE.reset()
    yield
    reader_module._ONCE.reset()


async def test_kubernetes_reader_cpu_loop_matches_the_kubelet(
    admin: AsyncClient, namespace: str, spans: InMemorySpanExporter
) -> None:
    """A pod with a CPU loop: its allocation record is its requests and limits exactly, placed
    on the node with its QoS class; each sample's CPU time lies between the kubelet's own
    figures read just before and just after it, and grows."""
    handle, pod = await start_pod(admin, namespace, "while :; do :; done")
    reader = KubernetesReader(namespace, summary_max_age_s=0)
    sampler = ResourceSampler(reader, handle, identity(handle), 0)
    sampler.start()
    await sampler.record("allocation")
    assert records(spans, "allocation") == [allocation_record(handle, pod, namespace)]
    async with kubelet_client() as kubelet:
        cpu: list[float] = []
        for _ in range(2):
            before = await kubelet_cpu_s(kubelet, pod)
            sample = await reader.resource_sample(handle)
            after = await kubelet_cpu_s(kubelet, pod)
            assert not isinstance(sample, reader_module.ResourcesUnknown)
            # The reader rounds CPU time to the microsecond: so are the bounds.
            assert round(before, 6) <= sample["usage.cpu.time_s"] <= round(after, 6)
            cpu.append(float(sample["usage.cpu.time_s"]))
            # The kubelet's figures move every few seconds (its housekeeping): wait for a move.
            await eventually(
                lambda seen=after: _grew(kubelet, pod, seen),  # type: ignore[misc]
                "the kubelet's CPU figure moved",
                timeout=60,
            )
        assert 0 < cpu[0] < cpu[1]
    await sampler.stop()
    reader.release(handle)
    await reader.aclose()
    (final,) = [r for r in records(spans, "sample") if r[PREFIX + "resource.final"]]
    assert set(final) == sample_keys()
    assert final[USAGE + "source"] == "kubelet.summary"
    assert final[USAGE + "oom_kills"] == 0
    assert final[USAGE + "restarts"] == 0
    assert final[USAGE + "cpu.time_s"] >= cpu[1]
    assert 0 < final[USAGE + "memory_mib"] < 64
    assert reader.calls["list"] == 1
    assert reader.calls["watch"] == 1
    assert reader.calls["lookup"] == 0


async def _grew(kubelet: httpx2.AsyncClient, pod: Pod, than: float) -> bool:
    return await kubelet_cpu_s(kubelet, pod) > than


async def test_kubernetes_reader_counts_an_oom_kill(
    admin: AsyncClient,
    namespace: str,
    spans: InMemorySpanExporter,
    global_meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """A container that allocates beyond its 64Mi limit is OOMKilled by the kernel: the
    sample says so (one kill, exit code 137, no figure of a container that is gone), and
    gym.sandbox.oom_kills counts one."""
    sandbox_id = uuid.uuid4().hex[:12]
    name = f"sandbox-{sandbox_id}"
    # tail keeps its whole input: 200 MiB against a 64 MiB limit.
    await admin.create(
        pod_of(name, sandbox_id, "head -c 200m /dev/zero | tail > /dev/null"), namespace=namespace
    )

    async def oom_killed() -> Pod | None:
        found = await admin.get(Pod, name, namespace=namespace)
        statuses = (found.status and found.status.containerStatuses) or []
        terminated = statuses and statuses[0].state and statuses[0].state.terminated
        return found if terminated and terminated.reason == "OOMKilled" else None

    pod = await eventually(oom_killed, "the container OOMKilled", timeout=120)
    handle = SandboxHandle(sandbox_id=sandbox_id, provider_name="opensandbox", raw=None)
    reader = KubernetesReader(namespace, summary_max_age_s=0)
    sampler = ResourceSampler(reader, handle, identity(handle), 0)
    sampler.start()
    await sampler.record("allocation")
    await sampler.record("sample")
    await sampler.stop()
    await reader.aclose()
    assert records(spans, "allocation") == [allocation_record(handle, pod, namespace)]
    oom = {
        **identity(handle),
        PREFIX + "resource.kind": "sample",
        USAGE + "source": "kubelet.summary",
        USAGE + "oom_kills": 1,
        USAGE + "restarts": 0,
        USAGE + "exit_code": 137,
        USAGE + "exit_reason": "OOMKilled",
    }
    assert records(spans, "sample") == [
        {**oom, PREFIX + "resource.final": False},
        {**oom, PREFIX + "resource.final": True},
    ]
    kills = [
        point.value
        for metric in _metrics(metric_reader)
        if metric.name == "gym.sandbox.oom_kills"
        for point in metric.data.data_points
    ]
    assert kills == [1]


def _metrics(reader: InMemoryMetricReader) -> list[Any]:
    data = reader.get_metrics_data()
    return [
        metric
        for resource in (data.resource_metrics if data else [])
        for scope in resource.scope_metrics
        for metric in scope.metrics
    ]


async def test_kubernetes_reader_pod_deleted_behind_its_back(
    admin: AsyncClient, namespace: str, spans: InMemorySpanExporter
) -> None:
    """A pod deleted by someone else: the watch tells the reader, and the final sample says
    ``kubernetes.pod_deleted``, with no figure."""
    handle, pod = await start_pod(admin, namespace, "sleep 3600")
    reader = KubernetesReader(namespace, summary_max_age_s=0)
    sampler = ResourceSampler(reader, handle, identity(handle), 0)
    sampler.start()
    await sampler.record("allocation")
    await sampler.record("sample")
    await admin.delete(Pod, pod.metadata.name, namespace=namespace, grace_period=0)

    async def deleted() -> bool:
        return await reader.resource_sample(handle) == reader_module.ResourcesUnknown(
            "kubernetes.pod_deleted"
        )

    await eventually(deleted, "the reader saw the pod deleted", timeout=60)
    await sampler.stop()
    await reader.aclose()
    assert records(spans, "sample")[-1] == {
        **identity(handle),
        PREFIX + "resource.kind": "sample",
        PREFIX + "resource.final": True,
        PREFIX + "usage.unknown_reason": "kubernetes.pod_deleted",
    }


async def test_kubernetes_reader_pod_made_again_counts_a_restart(
    admin: AsyncClient, namespace: str
) -> None:
    """A sandbox's pod deleted and made again with its label (as OpenSandbox's controller makes
    it again): the reader follows the new pod, and its samples count the replacement as one
    restart (the new container's CPU time starts from zero)."""
    handle, first = await start_pod(admin, namespace, "sleep 3600")
    reader = KubernetesReader(namespace, summary_max_age_s=0)
    before = await reader.resource_sample(handle)
    assert isinstance(before, dict)
    assert before["usage.restarts"] == 0
    await admin.delete(Pod, first.metadata.name, namespace=namespace, grace_period=0)

    async def deleted() -> bool:
        answer = await reader.resource_sample(handle)
        return answer == reader_module.ResourcesUnknown("kubernetes.pod_deleted")

    await eventually(deleted, "the reader saw the pod deleted", timeout=60)
    again = pod_of("sandbox-again", str(handle.sandbox_id), "sleep 3600")
    await admin.create(again, namespace=namespace)

    async def from_the_new_pod() -> dict[str, Any] | None:
        answer = await reader.resource_sample(handle)
        return answer if isinstance(answer, dict) and "usage.cpu.time_s" in answer else None

    after = await eventually(from_the_new_pod, "a sample of the new pod", timeout=120)
    assert after["usage.restarts"] == 1
    assert after["usage.oom_kills"] == 0
    allocation = await reader.resource_allocation(handle)
    assert not isinstance(allocation, reader_module.ResourcesUnknown)
    assert allocation.designator is not None
    assert allocation.designator.id != first.metadata.uid
    assert dict(allocation.placement)["pod"] == "sandbox-again"
    reader.release(handle)
    await reader.aclose()


def rbac_yaml(namespace: str) -> str:
    """The RBAC of docs/sandboxes.md, as it stands there, for ``namespace``."""
    text = DOCS.read_text()
    block = re.search(r"<!-- rbac -->\n```yaml\n(.*?)```", text, re.DOTALL)
    assert block is not None, "docs/sandboxes.md has no ```yaml block after <!-- rbac -->"
    return block.group(1).replace("sandboxes", namespace)


async def apply_documented_rbac(
    admin: AsyncClient, namespace: str, *, node_stats: bool = True, pods: bool = True
) -> None:
    """The docs' service account in ``namespace`` with the docs' RBAC (without the node
    stats binding, or without the pods binding, when asked)."""
    for obj in codecs.load_all_yaml(rbac_yaml(namespace)):
        kind = type(obj).__name__
        if (kind == "ClusterRoleBinding" and not node_stats) or (
            kind == "RoleBinding" and not pods
        ):
            continue
        try:
            await admin.create(obj)
        except ApiError as error:
            if not (kind == "ClusterRole" and error.status.code == 409):
                raise


async def service_account_kubeconfig(
    admin: AsyncClient, namespace: str, tmp_path: Path, *, node_stats: bool, pods: bool = True
) -> Path:
    """The docs' service account and RBAC (``apply_documented_rbac``), and a kubeconfig with
    the account's token."""
    await apply_documented_rbac(admin, namespace, node_stats=node_stats, pods=pods)
    token = await admin.create(
        ServiceAccountToken(
            metadata=ObjectMeta(), spec=TokenRequestSpec(audiences=[], expirationSeconds=3600)
        ),
        "nemo-gym-otel",
        namespace=namespace,
    )
    ca = re.search(r"certificate-authority-data: (\S+)", ADMIN_KUBECONFIG.read_text())  # noqa: ASYNC240
    assert ca is not None
    path = tmp_path / "reader.kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: c\n  cluster:\n    server: https://{api_scope()}\n"
        f"    certificate-authority-data: {ca.group(1)}\n"
        f"users:\n- name: u\n  user:\n    token: {token.status.token}\n"
        "contexts:\n- name: c\n  context:\n    cluster: c\n    user: u\n"
        "current-context: c\n"
    )
    return path


@pytest.fixture
async def cluster_role_bindings(admin: AsyncClient, namespace: str) -> AsyncIterator[None]:
    yield
    try:
        await admin.delete(ClusterRoleBinding, f"nemo-gym-otel-node-stats-{namespace}")
    except ApiError as error:
        if error.status.code != 404:  # a test that binds nothing leaves nothing to delete
            raise


@pytest.mark.usefixtures("cluster_role_bindings")
async def test_kubernetes_reader_least_privilege_as_documented(
    admin: AsyncClient, namespace: str, tmp_path: Path
) -> None:
    """The docs' service account and RBAC (pods in one namespace, nodes/stats; not
    nodes/proxy) read the allocation and samples with figures."""
    handle, pod = await start_pod(admin, namespace, "sleep 3600")
    kubeconfig = await service_account_kubeconfig(admin, namespace, tmp_path, node_stats=True)
    reader = KubernetesReader(namespace, kubeconfig=str(kubeconfig), summary_max_age_s=0)
    allocation = await reader.resource_allocation(handle)
    assert not isinstance(allocation, reader_module.ResourcesUnknown)
    assert allocation.designator is not None
    assert allocation.designator.id == pod.metadata.uid
    sample = await reader.resource_sample(handle)
    assert isinstance(sample, dict)
    assert set(sample) == SAMPLE_FIGURES
    await reader.aclose()
    # The role really is that narrow: nodes/proxy (the API server's node proxy) is refused.
    async with httpx2.AsyncClient(
        base_url=f"https://{api_scope()}",
        verify=ssl.create_default_context(cafile=str(state_dir() / "pki" / "ca.crt")),
        headers={"Authorization": "Bearer " + _token_of(kubeconfig)},
    ) as api:
        proxied = await api.get(f"/api/v1/nodes/{NODE}/proxy/stats/summary")
    assert proxied.status_code == 403


# Run inside the reader's pod by the host's interpreter (mounted read-only at the same paths):
# the reader configured as a NeMo Gym server in the cluster would have it, by lightkube's
# in-cluster configuration (the pod's service-account token), with no kubeconfig anywhere.
IN_CLUSTER_READER = """
import asyncio, json, os, sys
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxHandle
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.kubernetes import KubernetesReader

async def main():
    reader = KubernetesReader(sys.argv[1], summary_max_age_s=0)
    handle = SandboxHandle(sandbox_id=sys.argv[2], provider_name="opensandbox", raw=None)
    allocation = await reader.resource_allocation(handle)
    sample = await reader.resource_sample(handle)
    await reader.aclose()
    print(json.dumps({
        "kubeconfig": [k for k in ("KUBECONFIG",) if k in os.environ]
        + [p for p in (os.path.expanduser("~/.kube/config"),) if os.path.exists(p)],
        "allocation": repr(allocation) if not hasattr(allocation, "designator") else {
            "source": allocation.source,
            "designator": [allocation.designator.kind, allocation.designator.id,
                           allocation.designator.scope],
            "placement": dict(allocation.placement),
        },
        "sample": sample if isinstance(sample, dict) else repr(sample),
    }))

asyncio.run(main())
"""


def host_python_mounts() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Volumes and mounts that give a busybox container this host's interpreter, virtualenv
    and checkout at the paths they have here, read-only."""
    checkout = Path(__file__).resolve().parent.parent
    paths = sorted(
        {"/usr", "/lib", "/lib64", sys.prefix, os.path.realpath(sys.base_prefix), str(checkout)}
    )
    volumes, mounts = [], []
    for number, path in enumerate(p for p in paths if os.path.exists(p)):
        volumes.append({"name": f"host-{number}", "hostPath": {"path": os.path.realpath(path)}})
        mounts.append({"name": f"host-{number}", "mountPath": path, "readOnly": True})
    return volumes, mounts


async def test_kubernetes_reader_in_cluster_with_the_pods_service_account(
    admin: AsyncClient, namespace: str
) -> None:
    """The reader in a pod running as the docs' service account, with no kubeconfig: lightkube
    takes the pod's token and the cluster's certificate authority by itself, and the allocation
    and a sample are read with figures, scoped by the API server's address as the pod reached
    it. (No kube-proxy runs here, so the pod is pointed at the API server's node address, as
    KUBERNETES_SERVICE_HOST and _PORT point a pod at the service.)"""
    handle, pod = await start_pod(admin, namespace, "sleep 3600")
    await apply_documented_rbac(admin, namespace)
    api_port = api_scope().rsplit(":", 1)[1]
    volumes, mounts = host_python_mounts()
    reader_pod = codecs.from_dict(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "in-cluster-reader", "namespace": namespace},
            "spec": {
                "serviceAccountName": "nemo-gym-otel",
                "restartPolicy": "Never",
                "enableServiceLinks": False,
                "terminationGracePeriodSeconds": 1,
                "volumes": volumes,
                "containers": [
                    {
                        "name": "reader",
                        "image": IMAGE,
                        "imagePullPolicy": "Never",
                        "command": [
                            sys.executable,
                            "-c",
                            IN_CLUSTER_READER,
                            namespace,
                            handle.sandbox_id,
                        ],
                        "env": [
                            {"name": "KUBERNETES_SERVICE_HOST", "value": "192.0.2.1"},
                            {"name": "KUBERNETES_SERVICE_PORT", "value": api_port},
                            {"name": "HOME", "value": "/nonexistent"},
                        ],
                        "volumeMounts": mounts,
                    }
                ],
            },
        }
    )
    await admin.create(reader_pod)

    async def finished() -> Pod | None:
        found = await admin.get(Pod, "in-cluster-reader", namespace=namespace)
        phase = found.status and found.status.phase
        return found if phase in ("Succeeded", "Failed") else None

    done = await eventually(finished, "the in-cluster reader's pod finished", timeout=180)
    output = [line async for line in admin.log("in-cluster-reader", namespace=namespace)]
    assert done.status is not None
    assert done.status.phase == "Succeeded", "".join(output)
    answer = json.loads(output[-1])
    assert answer["kubeconfig"] == []
    assert answer["allocation"] == {
        "source": "kubernetes.pod",
        "designator": ["k8s.pod", pod.metadata.uid, f"192.0.2.1:{api_port}"],
        "placement": {
            "namespace": namespace,
            "pod": pod.metadata.name,
            "node": NODE,
            "qos_class": "Guaranteed",
        },
    }
    assert answer["sample"]["usage.source"] == "kubelet.summary"
    assert set(answer["sample"]) == SAMPLE_FIGURES


def _token_of(kubeconfig: Path) -> str:
    found = re.search(r"token: (\S+)", kubeconfig.read_text())
    assert found is not None
    return found.group(1)


@pytest.mark.usefixtures("cluster_role_bindings")
async def test_kubernetes_reader_without_node_stats_says_forbidden_once(
    admin: AsyncClient,
    namespace: str,
    tmp_path: Path,
    spans: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A service account without nodes/stats: the allocation record is whole, every sample
    says ``kubernetes.forbidden``, and the log says so once."""
    handle, pod = await start_pod(admin, namespace, "sleep 3600")
    kubeconfig = await service_account_kubeconfig(admin, namespace, tmp_path, node_stats=False)
    reader = KubernetesReader(namespace, kubeconfig=str(kubeconfig), summary_max_age_s=0)
    sampler = ResourceSampler(reader, handle, identity(handle), 0)
    sampler.start()
    with caplog.at_level(logging.WARNING, logger=reader_module.__name__):
        await sampler.record("allocation")
        await sampler.record("sample")
        await sampler.record("sample")
        await sampler.stop()
    await reader.aclose()
    assert records(spans, "allocation") == [allocation_record(handle, pod, namespace)]
    forbidden = {
        **identity(handle),
        PREFIX + "resource.kind": "sample",
        PREFIX + "usage.unknown_reason": "kubernetes.forbidden",
    }
    assert records(spans, "sample") == [
        {**forbidden, PREFIX + "resource.final": False},
        {**forbidden, PREFIX + "resource.final": False},
        {**forbidden, PREFIX + "resource.final": True},
    ]
    lines = [r.getMessage() for r in caplog.records if "forbidden" in r.getMessage()]
    assert lines == [
        f"Kubernetes sandbox reader: forbidden to get nodes/stats (namespace {namespace}); "
        "records say kubernetes.forbidden"
    ]


@pytest.mark.usefixtures("cluster_role_bindings")
async def test_kubernetes_reader_without_pod_access_says_forbidden(
    admin: AsyncClient, namespace: str, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    """A service account that may not read pods: the allocation and the samples are unknown,
    ``kubernetes.forbidden``; no figure is invented."""
    handle, _ = await start_pod(admin, namespace, "sleep 3600")
    kubeconfig = await service_account_kubeconfig(
        admin, namespace, tmp_path, node_stats=True, pods=False
    )
    reader = KubernetesReader(namespace, kubeconfig=str(kubeconfig), request_timeout_s=5)
    sampler = ResourceSampler(reader, handle, identity(handle), 0)
    sampler.start()
    await sampler.record("allocation")
    await sampler.stop()
    await reader.aclose()
    assert records(spans, "allocation") == [
        {
            **identity(handle),
            PREFIX + "resource.kind": "allocation",
            PREFIX + "resource.final": False,
            PREFIX + "allocation.unknown_reason": "kubernetes.forbidden",
        }
    ]
    assert records(spans, "sample") == [
        {
            **identity(handle),
            PREFIX + "resource.kind": "sample",
            PREFIX + "resource.final": True,
            PREFIX + "usage.unknown_reason": "kubernetes.forbidden",
        }
    ]


def api_server_pid() -> int:
    """The API server scripts/start-kubernetes.sh started, checked as the script checks it
    (PID, start time and binary recorded at its start)."""
    recorded = dict(
        line.split("=", 1) for line in (state_dir() / "pids" / "kube-apiserver").read_text().split()
    )
    pid = int(recorded["PID"])
    stat = Path(f"/proc/{pid}/stat").read_text()
    assert stat.rsplit(") ", 1)[1].split()[19] == recorded["START_TIME"]
    assert os.readlink(f"/proc/{pid}/exe") == recorded["EXE"]
    return pid


async def test_kubernetes_reader_api_server_stopped_mid_sampling(
    admin: AsyncClient, namespace: str
) -> None:
    """The API server stopped (SIGSTOP) while a sandbox is sampled: its samples go on from the
    kubelet; a sandbox the reader has not seen yet gets ``kubernetes.timeout`` instead of an
    allocation; once the API server runs again, that allocation is read."""
    followed, _ = await start_pod(admin, namespace, "sleep 3600")
    newcomer, newcomer_pod = await start_pod(admin, namespace, "sleep 3600")
    reader = KubernetesReader(namespace, summary_max_age_s=0, request_timeout_s=2)
    assert isinstance(await reader.resource_sample(followed), dict)
    pid = api_server_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        during = await reader.resource_sample(followed)
        assert isinstance(during, dict)
        assert during["usage.source"] == "kubelet.summary"
        assert "usage.cpu.time_s" in during
        # A new reader has no index: its first list and its lookup both time out.
        stranger = KubernetesReader(namespace, request_timeout_s=2)
        assert await stranger.resource_allocation(newcomer) == reader_module.ResourcesUnknown(
            "kubernetes.timeout"
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    allocation = await eventually(
        lambda: _known(stranger, newcomer), "the allocation read once the API server runs"
    )
    assert allocation.designator is not None
    assert allocation.designator.id == newcomer_pod.metadata.uid
    await reader.aclose()
    await stranger.aclose()


async def _known(reader: KubernetesReader, handle: SandboxHandle) -> Any:
    answer = await reader.resource_allocation(handle)
    return None if isinstance(answer, reader_module.ResourcesUnknown) else answer


async def test_kubernetes_reader_calls_do_not_grow_with_sandboxes(
    admin: AsyncClient, namespace: str
) -> None:
    """Five sandboxes sampled twice: one list, one watch, one summary per round for the one
    node; no call per sandbox. (Requests of 1m: five pods of 500m would not fit 2 cores.)"""
    started = await asyncio.gather(
        *(start_pod(admin, namespace, "sleep 3600", small=True) for _ in range(5))
    )
    reader = KubernetesReader(namespace, summary_max_age_s=3600)
    for handle, _ in started:
        assert not isinstance(
            await reader.resource_allocation(handle), reader_module.ResourcesUnknown
        )
    for _ in range(2):
        samples = await asyncio.gather(*(reader.resource_sample(h) for h, _ in started))
        assert all(isinstance(s, dict) and "usage.cpu.time_s" in s for s in samples)
        reader._summaries.clear()  # the next round is the next interval
    assert dict(reader.calls) == {"list": 1, "watch": 1, "summary": 2}
    await reader.aclose()


# --- NeMo Gym's opensandbox provider: its reader chooses the pod ------------------------------


class OpenSandboxProviderFields:
    """What ``OpenSandboxReader`` reads of NeMo Gym's ``OpenSandboxProvider``: its server's
    domain (the designators' scope) and the engine CLI it would ask, here the real Podman,
    which knows no container of these sandboxes (they are pods)."""

    class _Connection:
        domain = "127.0.0.1:8090"

    _connection = _Connection()
    _binary = shutil.which("podman") or "podman"


def kubeconfig_in(namespace: str, source: Path, tmp_path: Path) -> Path:
    """``source`` with its contexts set to ``namespace``: the namespace the reader looks in."""
    text, count = re.subn(
        r"\n  context:\n", f"\n  context:\n    namespace: {namespace}\n", source.read_text()
    )
    assert count == 1
    path = tmp_path / f"{namespace}.kubeconfig"
    path.write_text(text)
    return path


def opensandbox_allocation(handle: SandboxHandle, pod: Pod, namespace: str) -> dict[str, Any]:
    """The allocation record of a sandbox whose pod the opensandbox reader chose: the pod's
    (``allocation_record``), designated as the sandbox of its server, the pod as its host."""
    record = {
        k: v
        for k, v in allocation_record(handle, pod, namespace).items()
        if ".designator." not in k and ".host." not in k
    }
    return {
        **record,
        ALLOCATION + "designator.kind": "opensandbox.sandbox",
        ALLOCATION + "designator.id": handle.sandbox_id,
        ALLOCATION + "designator.scope": "127.0.0.1:8090",
        ALLOCATION + "host.kind": "k8s.pod",
        ALLOCATION + "host.id": pod.metadata.uid,
        ALLOCATION + "host.scope": api_scope(),
    }


async def released(reader: OpenSandboxReader, handle: SandboxHandle) -> None:
    """Release the sandbox, and wait for the Kubernetes reader's clients to close (the
    opensandbox reader closes them once it follows no pod)."""
    reader.release(handle)
    closing = reader._kubernetes_closing
    if closing is not None:
        await closing


def unknown_allocation(handle: SandboxHandle, reason: str) -> dict[str, Any]:
    return {
        **identity(handle),
        PREFIX + "resource.kind": "allocation",
        PREFIX + "resource.final": False,
        PREFIX + "allocation.unknown_reason": reason,
    }


async def test_opensandbox_reader_chooses_the_pod_in_the_configured_namespace(
    admin: AsyncClient,
    namespace: str,
    tmp_path: Path,
    spans: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NeMo Gym's opensandbox provider, its sandbox a pod labelled as OpenSandbox labels them
    in the kubeconfig's namespace, no engine here knowing it: the allocation is the pod's
    (``kubernetes.pod``), the samples the kubelet's; a sandbox with no pod stays remote
    (``container_not_found``, the engine's reason)."""
    handle, pod = await start_pod(admin, namespace, "sleep 3600")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig_in(namespace, ADMIN_KUBECONFIG, tmp_path)))
    reader = OpenSandboxReader(OpenSandboxProviderFields())
    sampler = ResourceSampler(reader, handle, identity(handle), 0)
    sampler.start()
    await sampler.record("allocation")
    await sampler.stop()
    await released(reader, handle)
    missing = SandboxHandle(sandbox_id=uuid.uuid4().hex[:12], provider_name="opensandbox", raw=None)
    assert await reader.resource_allocation(missing) == ResourcesUnknown("container_not_found")
    await released(reader, missing)
    assert records(spans, "allocation") == [opensandbox_allocation(handle, pod, namespace)]
    (final,) = records(spans, "sample")
    assert set(final) == sample_keys()
    assert final[USAGE + "source"] == "kubelet.summary"
    assert final[PREFIX + "resource.final"] is True
    assert final[USAGE + "oom_kills"] == 0


async def test_opensandbox_reader_without_the_cluster_stays_remote(
    admin: AsyncClient,
    namespace: str,
    tmp_path: Path,
    spans: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same pod, but no Kubernetes configuration, or one naming another namespace: the
    sandbox is remote with the engine's reason, ``container_not_found``, as before the cluster
    was looked in; the control reader, configured for the pod's namespace, finds it."""
    handle, pod = await start_pod(admin, namespace, "sleep 3600")
    elsewhere = kubeconfig_in("default", ADMIN_KUBECONFIG, tmp_path)
    for kubeconfig in (tmp_path / "none.kubeconfig", elsewhere):
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        reader = OpenSandboxReader(OpenSandboxProviderFields())
        assert await reader.resource_allocation(handle) == ResourcesUnknown("container_not_found")
        await released(reader, handle)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig_in(namespace, ADMIN_KUBECONFIG, tmp_path)))
    control = OpenSandboxReader(OpenSandboxProviderFields())
    allocation = await control.resource_allocation(handle)
    await released(control, handle)
    assert getattr(allocation, "source", None) == "kubernetes.pod"
    assert getattr(allocation, "host", None) == ResourceDesignator(
        "k8s.pod", pod.metadata.uid, scope=api_scope()
    )


@pytest.mark.usefixtures("cluster_role_bindings")
async def test_opensandbox_reader_cluster_forbidden_says_so(
    admin: AsyncClient,
    namespace: str,
    tmp_path: Path,
    spans: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kubeconfig whose service account may not read the namespace's pods: the sandbox is
    remote with the cluster's reason, ``kubernetes.forbidden``, not the engine's."""
    handle, _ = await start_pod(admin, namespace, "sleep 3600")
    kubeconfig = await service_account_kubeconfig(
        admin, namespace, tmp_path, node_stats=True, pods=False
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig_in(namespace, kubeconfig, tmp_path)))
    reader = OpenSandboxReader(OpenSandboxProviderFields())
    sampler = ResourceSampler(reader, handle, identity(handle), 0)
    sampler.start()
    await sampler.record("allocation")
    await sampler.stop()
    await released(reader, handle)
    assert records(spans, "allocation") == [unknown_allocation(handle, "kubernetes.forbidden")]
