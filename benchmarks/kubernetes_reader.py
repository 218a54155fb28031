"""What the Kubernetes reader costs as sandboxes grow: API calls per interval, CPU per sample.

For each count of sandbox pods (``--pods``, default 1 10 50), on the cluster of
``scripts/start-kubernetes.sh``: that many pods (busybox sleeping; requests 1m / 8Mi so fifty
fit the one node, limits 500m / 64Mi) in a namespace of their own, labelled as OpenSandbox
labels them; one ``KubernetesReader`` reads every allocation, then ``--intervals`` sampling
intervals, every sandbox sampled once per interval at once (``asyncio.gather``), each interval
starting with the node's summary expired (as at the default 10 s interval). Prints, per
count, the API calls per interval by kind (the reader's ``calls``: list and watch once, a
summary per node per interval; a lookup only for a pod the index does not hold) and this
process's CPU (``time.process_time``) per sample, median over the intervals. Not a test; run
inside the cluster's network namespace (the kubelet is at the node's address):

    eval "$(bash scripts/start-kubernetes.sh --env)"
    nsenter --net="$NEMO_GYM_KUBERNETES_NETNS" .venv/bin/python benchmarks/kubernetes_reader.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Pod, ServiceAccount

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxHandle
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.kubernetes import KubernetesReader

IMAGE = "localhost/nemo-gym-busybox:1"


def _pod(sandbox_id: str) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=f"sandbox-{sandbox_id}", labels={"opensandbox.io/id": sandbox_id}),
        spec=PodSpec(
            terminationGracePeriodSeconds=1,
            containers=[
                Container(
                    name="sandbox",
                    image=IMAGE,
                    imagePullPolicy="Never",
                    command=["/bin/sleep", "3600"],
                    resources=ResourceRequirements(
                        requests={"cpu": "1m", "memory": "8Mi"},
                        limits={"cpu": "500m", "memory": "64Mi"},
                    ),
                )
            ],
        ),
    )


async def _running(admin: AsyncClient, namespace: str, count: int) -> None:
    for _ in range(1200):
        pods = [pod async for pod in admin.list(Pod, namespace=namespace)]
        running = [p for p in pods if p.status is not None and p.status.phase == "Running"]
        if len(running) == count:
            return
        await asyncio.sleep(0.5)
    raise SystemExit(f"{count} pods not running within 600 s")


async def _measure(
    admin: AsyncClient, count: int, intervals: int
) -> tuple[dict[str, float], float]:
    namespace = f"nemo-gym-bench-{uuid.uuid4().hex[:8]}"
    await admin.create(Namespace(metadata=ObjectMeta(name=namespace)))
    for _ in range(600):  # the controller manager makes it; a pod created before is refused
        try:
            await admin.get(ServiceAccount, "default", namespace=namespace)
            break
        except ApiError:
            await asyncio.sleep(0.1)
    try:
        ids = [uuid.uuid4().hex[:12] for _ in range(count)]
        for sandbox_id in ids:
            await admin.create(_pod(sandbox_id), namespace=namespace)
        await _running(admin, namespace, count)
        handles = [SandboxHandle(sandbox_id=i, provider_name="opensandbox", raw=None) for i in ids]
        reader = KubernetesReader(namespace, summary_max_age_s=3600)
        await asyncio.gather(*(reader.resource_allocation(h) for h in handles))
        before = dict(reader.calls)
        cpu_per_sample = []
        for _ in range(intervals):
            reader._summaries.clear()  # the next interval: the node's summary expired
            started = time.process_time()
            samples = await asyncio.gather(*(reader.resource_sample(h) for h in handles))
            cpu_per_sample.append((time.process_time() - started) / count)
            assert all(isinstance(s, dict) and "usage.cpu.time_s" in s for s in samples), samples
        per_interval = {
            kind: (reader.calls[kind] - before.get(kind, 0)) / intervals
            for kind in ("list", "watch", "lookup", "summary")
        }
        per_interval["setup list+watch+lookup"] = sum(
            before.get(k, 0) for k in ("list", "watch", "lookup")
        )
        await reader.aclose()
        return per_interval, statistics.median(cpu_per_sample)
    finally:
        await admin.delete(Namespace, namespace, grace_period=0)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--intervals", type=int, default=10)
    args = parser.parse_args()
    admin = AsyncClient()
    print("| sandbox pods | list | watch | lookup | summary | setup calls | CPU per sample µs |")
    print("|---|---|---|---|---|---|---|")
    for count in args.pods:
        calls, cpu = await _measure(admin, count, args.intervals)
        print(
            f"| {count} | {calls['list']:g} | {calls['watch']:g} | {calls['lookup']:g} "
            f"| {calls['summary']:g} | {calls['setup list+watch+lookup']:g} | {cpu * 1e6:,.0f} |"
        )
    await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
