"""What OpenSandbox's metrics API says of a sandbox next to what its cgroup says.

One sandbox (0.5 CPU, 64 MiB, busybox) made by NeMo Gym main's ``opensandbox`` provider
against the server of ``scripts/start-opensandbox.sh``; it holds nothing, then 40 MiB written
into a tmpfs (``/dev/shm``, charged to the container's memory cgroup). At each step it prints
``get_metrics()``'s fields, the co-located sample this package records (the container's
cgroup, found by its ``opensandbox.io/id`` label) and the engine's ``docker stats``. Not a test:
docs/sandboxes.md shows its output. Run it in NeMo Gym main's virtualenv:

    eval "$(bash scripts/start-opensandbox.sh | sed 's/^/export /')"
    OPENSANDBOX_API_KEY=$(cat "$OPENSANDBOX_API_KEY_FILE") \\
      .venv-nemo-gym-main/bin/python benchmarks/opensandbox_memory.py
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

from nemo_gym.sandbox import SandboxResources, SandboxSpec
from nemo_gym.sandbox.providers.opensandbox.provider import OpenSandboxProvider

from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import OpenSandboxReader

IMAGE = "localhost/nemo-gym-busybox:latest"


async def _row(
    label: str, provider: OpenSandboxProvider, handle: object, reader: OpenSandboxReader
) -> None:
    metrics = await handle.raw.get_metrics()  # type: ignore[attr-defined]
    sample = await reader.resource_sample(handle)  # type: ignore[arg-type]
    found = (
        await asyncio.to_thread(
            subprocess.run,
            [
                "docker",
                "ps",
                "-q",
                "--no-trunc",
                "--filter",
                f"label=opensandbox.io/id={handle.sandbox_id}",
            ],  # type: ignore[attr-defined]
            capture_output=True,
            text=True,
            check=True,
        )
    ).stdout.split()[0]
    stats = (
        await asyncio.to_thread(
            subprocess.run,
            ["docker", "stats", "--no-stream", "--format", "{{.MemUsage}}", found],
            capture_output=True,
            text=True,
            check=True,
        )
    ).stdout.strip()
    print(
        json.dumps(
            {
                "step": label,
                "get_metrics": {
                    "cpu_count": metrics.cpu_count,
                    "cpu_used_percentage": round(metrics.cpu_used_percentage, 2),
                    "memory_total_in_mib": round(metrics.memory_total_in_mib, 1),
                    "memory_used_in_mib": round(metrics.memory_used_in_mib, 1),
                },
                "cgroup": {
                    k: (round(v, 1) if isinstance(v, float) else v)
                    for k, v in sample.items()  # type: ignore[union-attr]
                    if k in ("usage.source", "usage.memory_mib", "usage.memory_peak_mib")
                },
                "docker_stats_mem": stats,
            }
        ),
        flush=True,
    )


async def main() -> None:
    provider = OpenSandboxProvider(
        connection={
            "domain": os.environ["OPENSANDBOX_DOMAIN"],
            "api_key": os.environ["OPENSANDBOX_API_KEY"],
            "protocol": "http",
            "use_server_proxy": True,
        }
    )
    spec = SandboxSpec(
        image=IMAGE, resources=SandboxResources(cpu=0.5, memory_mib=64), ready_timeout_s=120
    )
    handle = await provider.create(spec)
    reader = OpenSandboxReader(provider)
    try:
        await reader.resource_allocation(handle)
        await _row("idle", provider, handle, reader)
        result = await provider.exec(
            handle, "head -c 41943040 /dev/zero > /dev/shm/hold; ls -l /dev/shm/hold", timeout_s=60
        )
        print(json.dumps({"exec": result.stdout.strip(), "exit": result.return_code}))
        await asyncio.sleep(1.5)  # execd's CPU figure is a rate over its own window
        await _row("holding 40 MiB in /dev/shm", provider, handle, reader)
    finally:
        await provider.close(handle)
        await provider.aclose()


if __name__ == "__main__":
    asyncio.run(main())
