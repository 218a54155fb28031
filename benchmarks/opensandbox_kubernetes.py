"""What sampling costs when OpenSandbox's runtime is Kubernetes: per sample, per interval.

NeMo Gym main's ``opensandbox`` provider creates ``--sandboxes`` sandboxes (0.5 CPU, 64 MiB,
busybox) on the server of ``scripts/start-opensandbox.sh --kubernetes``: each a
``BatchSandbox`` and its pod on the cluster of ``scripts/start-kubernetes.sh``. They are then
sampled for ``--intervals`` intervals, every sandbox at once (``asyncio.gather``), two ways:

* ``opensandbox pod (kubelet.summary)``: ``OpenSandboxReader`` as the plugin uses it, which
  finds each sandbox's pod through the Kubernetes reader (one list and one watch of the
  labelled pods, one kubelet summary per node per interval; each interval starts with the
  node's summary expired, as at the default 10 s interval). The "serving" CPU is the API
  server's and the kubelet's process trees (the processes the reader's calls reach);
* ``opensandbox API (opensandbox.metrics)``: one ``get_metrics()`` call per sample through the
  provider's SDK object, as a sandbox no engine or cluster here knows is read; the serving CPU
  is the OpenSandbox server's process tree (which proxies each call to execd in the pod).

Per way: this process's CPU per sample (``time.process_time``), the serving processes' CPU per
sample (the median over the intervals; theirs over all of them, net of an idle window as
long), and the calls per interval by kind. The Docker
runtime's rows are ``sampler_cost.py --opensandbox`` (benchmarks/README.md has both). Not a
test; run in NeMo Gym main's virtualenv, inside the cluster's network namespace (the kubelet is
at the node's address, the pods at theirs):

    eval "$(bash scripts/start-kubernetes.sh --env)"
    eval "$(bash scripts/start-opensandbox.sh --kubernetes | sed 's/^/export /')"
    KUBECONFIG=<the admin kubeconfig with namespace opensandbox> nsenter \\
      --net="$NEMO_GYM_KUBERNETES_NETNS" .venv-nemo-gym-main/bin/python \\
      benchmarks/opensandbox_kubernetes.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _opensandbox_rows as opensandbox
from _sampler_parts import tree_cpu_s

from opentelemetry.instrumentation.nemo_gym.sandbox.readers.kubernetes import KubernetesReader
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import OpenSandboxReader

IMAGE = "localhost/nemo-gym-busybox:1"
CALL_KINDS = ("list", "watch", "lookup", "summary")


def cluster_pids() -> list[int]:
    """The API server and kubelet that scripts/start-kubernetes.sh started (its state folder is
    the admin kubeconfig's; ``KUBECONFIG`` may be a copy elsewhere, so the folder is asked of
    ``NEMO_GYM_KUBERNETES_DIR`` first)."""
    state = Path(os.environ.get("NEMO_GYM_KUBERNETES_DIR", ".kubernetes"))
    pids = []
    for component in ("kube-apiserver", "kubelet"):
        recorded = dict(
            line.split("=", 1) for line in (state / "pids" / component).read_text().split()
        )
        pids.append(int(recorded["PID"]))
    return pids


def serving_cpu_s(pids: list[int]) -> float:
    return sum(tree_cpu_s(pid) or 0.0 for pid in pids)


async def measure(
    reader: Any,
    handles: list[Any],
    intervals: int,
    serving: list[int],
    before_interval: Callable[[], None],
    calls: Callable[[], dict[str, int]],
) -> dict[str, Any]:
    """One way of sampling ``handles``: this process's CPU per sample (median over
    ``intervals``), the serving processes' (their CPU over all the intervals, net of what they
    spend in as long a time without sampling: /proc counts in 10 ms ticks, and the kubelet has
    housekeeping of its own), and the calls per interval by kind."""
    await asyncio.gather(*(reader.resource_sample(h) for h in handles))  # found, indexed, warm
    calls_before = dict(calls())
    ours = []
    serving_before, wall_started = serving_cpu_s(serving), time.perf_counter()
    for _ in range(intervals):
        before_interval()
        started = time.process_time()
        samples = await asyncio.gather(*(reader.resource_sample(h) for h in handles))
        ours.append((time.process_time() - started) / len(handles))
        assert all(isinstance(s, dict) for s in samples), samples  # figures, not unknowns
    wall = time.perf_counter() - wall_started
    serving_spent = serving_cpu_s(serving) - serving_before
    idle_before = serving_cpu_s(serving)
    await asyncio.sleep(wall)
    serving_idle = serving_cpu_s(serving) - idle_before
    after = calls()
    return {
        "sources": sorted({str(s.get("usage.source")) for s in samples}),
        "ours_us": statistics.median(ours) * 1e6,
        "serving_us": max(0.0, serving_spent - serving_idle) / (intervals * len(handles)) * 1e6,
        "calls": {k: (after.get(k, 0) - calls_before.get(k, 0)) / intervals for k in after},
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=3, help="0.5 CPU each: 3 fit 2 cores")
    parser.add_argument("--intervals", type=int, default=50)
    args = parser.parse_args()
    provider = opensandbox.provider()
    handles = list(
        await asyncio.gather(
            *(provider.create(opensandbox.spec(IMAGE)) for _ in range(args.sandboxes))
        )
    )
    try:
        reader = OpenSandboxReader(provider)
        allocations = await asyncio.gather(*(reader.resource_allocation(h) for h in handles))
        assert all(a.source == "kubernetes.pod" for a in allocations), allocations
        kubernetes = reader._kubernetes
        assert isinstance(kubernetes, KubernetesReader)
        pod = await measure(
            reader,
            handles,
            args.intervals,
            cluster_pids(),
            kubernetes._summaries.clear,  # the node's summary expired, as at each 10 s interval
            lambda: dict(kubernetes.calls),
        )
        api_reader = opensandbox.ApiCalls(provider)
        api_calls = {"get_metrics": 0}
        ask = api_reader.resource_sample

        async def counted(handle: Any) -> Any:
            api_calls["get_metrics"] += 1
            return await ask(handle)

        api_reader.resource_sample = counted  # type: ignore[method-assign]
        server = opensandbox.server_pid()
        api = await measure(
            api_reader,
            handles,
            args.intervals,
            [server] if server is not None else [],
            lambda: None,
            lambda: dict(api_calls),
        )
        for handle in handles:
            reader.release(handle)  # the last one closes the Kubernetes reader's clients
        if reader._kubernetes_closing is not None:
            await reader._kubernetes_closing
    finally:
        await asyncio.gather(*(provider.close(h) for h in handles))
        await provider.aclose()
    print(f"{args.sandboxes} sandboxes, {args.intervals} intervals (every sandbox sampled at once)")
    print(
        "| way | sources | this process µs per sample | serving µs per sample "
        "| calls per interval |"
    )
    print("|---|---|---|---|---|")
    for name, row in (("opensandbox pod (kubelet.summary)", pod), ("opensandbox API", api)):
        calls = ", ".join(f"{k} {v:g}" for k, v in row["calls"].items() if v)
        print(
            f"| {name} | {', '.join(row['sources'])} | {row['ours_us']:,.0f} | "
            f"{row['serving_us']:,.0f} | {calls} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
