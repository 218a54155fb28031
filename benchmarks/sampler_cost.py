"""CPU per sandbox resource sample, and the CPU share of sampling many sandboxes every second.

For ``ProcessSandboxProvider`` both ways it samples are measured: from each sandbox's cgroup
(where this process may create cgroups, e.g. as root) and from ``/proc`` (``cgroups=False``,
which scans the process table). ``DockerSandboxProvider`` is measured too when a
Docker-compatible engine answers (``DOCKER_HOST``, ``/var/run/docker.sock``, or the socket of
``scripts/start-podman.sh``) and has the image.

Each provider gets ``--sandboxes`` sandboxes, each running one idle background process, then:

1. **direct**: ``resource_sample(handle)`` over every sandbox, ``--rounds`` times; CPU per
   sample is ``time.process_time`` over the loop divided by the number of samples. For Docker
   the engine's own CPU is reported beside it (read from ``/proc`` for the daemon's process).
2. **live**: one ``ResourceSampler`` per sandbox with a 1 s interval, exporting spans through
   an SDK tracer provider (batch processor, discarding exporter), for ``--live-seconds``; the
   CPU share is this process's CPU time over that window divided by its length.

The projection "N sandboxes sampled every second" is N x CPU per sample, as a share of one
core. Run from the repository root: ``python benchmarks/sampler_cost.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from _common import DiscardingSpanExporter, median, require_at_least, run_and_report
from _common import machine as machine_facts
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxHandle,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.docker import (
    DockerSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ResourceSampler,
)

PODMAN_SOCKET = "/run/nemo-gym-podman/podman.sock"
DEFAULT_IMAGE = "localhost/nemo-gym-busybox:latest"
LIVE_INTERVAL_S = 1.0


class CountingSpanExporter(DiscardingSpanExporter):
    """Discards spans but counts the resource samples among them."""

    def __init__(self) -> None:
        self.samples = 0

    def export(self, spans: Any) -> SpanExportResult:
        batch: list[ReadableSpan] = list(spans)
        self.samples += sum(
            1 for s in batch if (s.attributes or {}).get(PREFIX + "resource.kind") == "sample"
        )
        return SpanExportResult.SUCCESS


def _engine_socket() -> str | None:
    """The unix socket of a Docker-compatible engine that accepts connections, if any."""
    host = os.environ.get("DOCKER_HOST", "")
    candidates = [host.removeprefix("unix://")] if host.startswith("unix://") else []
    candidates += ["/var/run/docker.sock", PODMAN_SOCKET]
    for path in candidates:
        if not path or not Path(path).exists():
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(2)
            try:
                probe.connect(path)
            except OSError:
                continue
        return path
    return None


def _peer_cpu_s(socket_path: str) -> float | None:
    """CPU seconds used so far by the process serving ``socket_path`` (Linux peer credentials)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(socket_path)
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        # utime, stime, cutime, cstime (fields 14-17 of stat; index 11-14 after the name).
        ticks = sum(int(value) for value in fields[11:15])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, struct.error):
        return None


@contextlib.asynccontextmanager
async def _sandboxes(provider: Any, count: int, spec: SandboxSpec) -> AsyncIterator[list[Any]]:
    handles: list[SandboxHandle] = []
    try:
        for _ in range(count):
            handle = await provider.create(spec)
            handles.append(handle)
            # Something to measure: an idle process that outlives the exec call.
            await provider.exec(handle, "sleep 3600 >/dev/null 2>&1 &", timeout_s=30)
        yield handles
    finally:
        for handle in handles:
            with contextlib.suppress(Exception):
                await provider.close(handle)
        aclose = getattr(provider, "aclose", None)
        if aclose is not None:
            await aclose()


async def _measure(
    label: str,
    provider: Any,
    spec: SandboxSpec,
    args: argparse.Namespace,
    exporter: CountingSpanExporter,
    sandboxes: int,
    engine_socket: str | None = None,
) -> dict[str, Any]:
    created = time.perf_counter()
    async with _sandboxes(provider, sandboxes, spec) as handles:
        setup_s = time.perf_counter() - created
        first = await provider.resource_sample(handles[0])
        source = first.get(PREFIX + "usage.source", first.get("usage.source"))
        for handle in handles:  # warm-up
            await provider.resource_sample(handle)

        per_round: list[float] = []
        engine_before = _peer_cpu_s(engine_socket) if engine_socket else None
        wall_start = time.perf_counter()
        for _ in range(args.rounds):
            start = time.process_time()
            for handle in handles:
                await provider.resource_sample(handle)
            per_round.append((time.process_time() - start) / len(handles))
        wall_per_sample = (time.perf_counter() - wall_start) / (args.rounds * len(handles))
        engine_after = _peer_cpu_s(engine_socket) if engine_socket else None
        cpu_per_sample = median(per_round)

        samplers = [
            ResourceSampler(provider, h, {PREFIX + "id": h.sandbox_id}, LIVE_INTERVAL_S)
            for h in handles
        ]
        exported_before = exporter.samples
        for sampler in samplers:
            sampler.start()
        # Let every sampler reach its first tick before the window opens.
        await asyncio.sleep(LIVE_INTERVAL_S)
        live_start = time.process_time()
        await asyncio.sleep(args.live_seconds)
        live_cpu = time.process_time() - live_start
        await asyncio.gather(*(sampler.stop() for sampler in samplers))
        trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
        live_samples = exporter.samples - exported_before

    result: dict[str, Any] = {
        "provider": label,
        "usage_source": source,
        "sandboxes": len(handles),
        "setup_s": setup_s,
        "cpu_us_per_sample": cpu_per_sample * 1e6,
        "wall_us_per_sample": wall_per_sample * 1e6,
        "projected_cpu_share_200_per_s": 200 * cpu_per_sample / LIVE_INTERVAL_S,
        "projected_cpu_share_per_s": len(handles) * cpu_per_sample / LIVE_INTERVAL_S,
        "live_seconds": args.live_seconds,
        "live_cpu_share": live_cpu / args.live_seconds,
        "live_samples_exported": live_samples,
    }
    if engine_before is not None and engine_after is not None:
        result["engine_cpu_us_per_sample"] = (
            (engine_after - engine_before) / (args.rounds * len(handles)) * 1e6
        )
    return result


async def _benchmark(args: argparse.Namespace) -> dict[str, Any]:
    exporter = CountingSpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(tracer_provider)
    spec = SandboxSpec(resources={"cpu": 0.5, "memory_mib": 256})
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}

    cgroup_provider = ProcessSandboxProvider(cgroups=True, cgroup_parent="nemo_gym_benchmark")
    if cgroup_provider.cgroup_version is not None:
        results.append(
            await _measure(
                f"process (cgroup v{cgroup_provider.cgroup_version})",
                cgroup_provider,
                spec,
                args,
                exporter,
                args.sandboxes,
            )
        )
    else:
        skipped["process (cgroup)"] = "no writable cgroup hierarchy here (run as root)"
    results.append(
        await _measure(
            "process (/proc)",
            ProcessSandboxProvider(cgroups=False),
            SandboxSpec(),
            args,
            exporter,
            args.sandboxes,
        )
    )

    engine = _engine_socket() if args.docker_sandboxes > 0 else None
    if engine is None:
        skipped["docker"] = (
            "no Docker-compatible engine answers (start one with scripts/start-podman.sh)"
            if args.docker_sandboxes > 0
            else "--docker-sandboxes 0"
        )
    else:
        try:
            results.append(
                await _measure(
                    "docker",
                    DockerSandboxProvider(f"unix://{engine}"),
                    SandboxSpec(image=args.image, resources={"cpu": 0.5, "memory_mib": 256}),
                    args,
                    exporter,
                    args.docker_sandboxes,
                    engine_socket=engine,
                )
            )
        except Exception as error:
            skipped["docker"] = f"engine at {engine} failed: {error!r}"
    tracer_provider.shutdown()
    return {
        "benchmark": "sampler_cost",
        "machine": machine_facts(),
        "command": " ".join(["python", *sys.argv]),
        "config": {
            "sandboxes": args.sandboxes,
            "docker_sandboxes": args.docker_sandboxes,
            "rounds": args.rounds,
            "live_seconds": args.live_seconds,
            "interval_s": LIVE_INTERVAL_S,
        },
        "results": results,
        "skipped": skipped,
    }


def _print(result: dict[str, Any]) -> None:
    config = result["config"]
    print(
        f"\n{config['rounds']} direct samples per sandbox; live: 1 sampler per sandbox every "
        f"{config['interval_s']:g} s for {config['live_seconds']:g} s"
    )
    header = (
        f"{'provider':<20} {'source':<10} {'sandboxes':>9} {'CPU us/sample':>13} "
        f"{'200/s projected':>15} {'live CPU share':>14} {'engine us/sample':>16}"
    )
    print(header)
    print("-" * len(header))
    for row in result["results"]:
        engine = row.get("engine_cpu_us_per_sample")
        print(
            f"{row['provider']:<20} {row['usage_source']!s:<10} {row['sandboxes']:>9} "
            f"{row['cpu_us_per_sample']:>13.0f} {row['projected_cpu_share_200_per_s']:>15.1%} "
            f"{row['live_cpu_share']:>14.1%} "
            f"{'-' if engine is None else f'{engine:.0f}':>16}"
        )
    for name, reason in result["skipped"].items():
        print(f"skipped {name}: {reason}")
    print(
        "live CPU share: this process's CPU over the window / its length, sampling all the "
        "provider's sandboxes each second and exporting the spans."
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sandboxes", type=int, default=200, help="process sandboxes")
    parser.add_argument(
        "--docker-sandboxes", type=int, default=10, help="containers (0 skips Docker)"
    )
    parser.add_argument("--rounds", type=int, default=10, help="direct samples per sandbox")
    parser.add_argument("--live-seconds", type=float, default=10.0, help="live window")
    parser.add_argument(
        "--image",
        default=os.environ.get("NEMO_GYM_TEST_IMAGE", DEFAULT_IMAGE),
        help="container image for Docker sandboxes",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args()
    require_at_least(parser, args, 1, "sandboxes", "rounds")
    require_at_least(parser, args, 0, "docker_sandboxes")
    if not args.live_seconds > 0:
        parser.error("--live-seconds must be positive")
    run_and_report(args, _benchmark, _print)


if __name__ == "__main__":
    main()
