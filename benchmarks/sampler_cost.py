"""What one sandbox usage sample costs end to end, per source, and at fleet scale.

Sources (one row each, where available here):

* ``process (cgroup vN)``: ``ProcessSandboxProvider`` reading each sandbox's cgroup (where
  this process may create cgroups, e.g. as root);
* ``process (/proc)``: ``ProcessSandboxProvider(cgroups=False)``: the shared ``/proc`` scan;
* ``docker (cgroup vN)``: ``DockerSandboxProvider`` reading the containers' cgroups;
* ``docker (stats)``: the same containers through the engine's stats endpoint, as for an
  engine on another machine (the provider with cgroup sampling off);
* ``docker CLI (cgroup vN)`` and ``docker CLI (stats)``: the same containers read as NeMo
  Gym's built-in ``docker`` provider's are (``readers.docker_cli.DockerCliReader``, through
  the ``docker`` CLI on ``PATH``, pointed at the same engine), from their cgroups and, with
  cgroup sampling off, from ``docker stats``. Skipped without a ``docker`` CLI.
* with ``--opensandbox``, ``opensandbox co-located (cgroup vN)`` and ``opensandbox API``:
  NeMo Gym main's ``opensandbox`` provider's sandboxes (``--docker-sandboxes`` of them) read
  by ``readers.opensandbox.OpenSandboxReader``, from their containers' cgroups and through
  OpenSandbox's metrics API (``_opensandbox_rows``: what it needs).

Docker rows need a Docker-compatible engine (``--engine-socket``, ``DOCKER_HOST``,
``/var/run/docker.sock``, or ``scripts/start-podman.sh``'s socket) with the image.

For each source, after a warm-up, ``--rounds`` ticks: every sandbox sampled at once
(``asyncio.gather`` of ``resource_sample``, the way samplers of one interval meet):

* **plugin**: this process's CPU (``time.process_time``, all threads) plus that of the
  commands it ran and reaped (the ``docker`` CLI's, ``RUSAGE_CHILDREN``) per sample, median
  over ticks;
* **engine**: the container engine's CPU per sample, its whole process tree read from
  ``/proc`` (the process serving the socket and its descendants, reaped children included)
  over all ticks; other clients of a shared engine inflate it, so measure against a service
  of your own for clean figures;
* **record**: one ``sandbox.resources`` record of that source's sample
  (``ResourceSampler.record`` over a provider that answers at once, span ended, batched and
  encoded as OTLP protobuf by the exporter thread, flushed in the window), per record.

Projection: 1,000 sandboxes each sampled every ``--interval`` seconds (default 10, the
default ``OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL``) and every 1 s, as a share of one
core: 1,000 x (plugin + engine + record) / interval. The alternatives to a full record per
sample are measured too (a bare span, and skipping a sample equal to the previous one).
``--live-seconds`` > 0 adds a live run per source: one ``ResourceSampler`` per sandbox every
1 s, spans exported; this process's CPU share over the window.

Run from the repository root: ``python benchmarks/sampler_cost.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import _dockerstats
from _common import machine as machine_facts
from _common import median, require_at_least, run_and_report
from _sampler_parts import (
    EncodingSpanExporter,
    engine_socket,
    sample_keys,
    serving_pid,
    tree_cpu_s,
)
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

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
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.docker_cli import DockerCliReader
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import OpenSandboxReader
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ResourceSampler,
)

DEFAULT_IMAGE = "localhost/nemo-gym-busybox:latest"
LIVE_INTERVAL_S = 1.0
FLEET = 1000
# Records between flushes: fewer than the batch span processor's queue holds (2,048).
_FLUSH_EVERY = 500


class _StatsOnlyDocker(DockerSandboxProvider):
    """Every sample through the stats endpoint, as for a remote engine."""

    _cgroup_sampling = False


class _Answering:
    """A provider that answers a source's real samples again, in the order one sandbox gave
    them (round and round): what is left is the record's own cost, with figures that change
    as often as they did. ``nowait``: it answers the way the source does, without waiting
    (``resource_sample_nowait``), so the record takes the same path."""

    name = "docker"

    def __init__(self, samples: list[Mapping[str, Any]], nowait: bool) -> None:
        self._samples = [dict(sample) for sample in samples]
        self._next = 0
        if nowait:
            self.resource_sample_nowait = self._now

    async def resource_allocation(self, handle: SandboxHandle) -> Any:
        raise NotImplementedError

    def _now(self, handle: SandboxHandle) -> dict[str, Any]:
        sample = self._samples[self._next % len(self._samples)]
        self._next += 1
        return dict(sample)

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Any]:
        return self._now(handle)


class _StatsOnlyCli(DockerCliReader):
    """NeMo Gym's docker provider's reader with every sample from ``docker stats``."""

    _cgroup_sampling = False


class _Cli:
    """What the CLI reader needs of NeMo Gym's ``DockerProvider``: its binary."""

    name = "docker"

    def __init__(self, binary: str) -> None:
        self._binary = binary


def _cpu_s() -> float:
    """This process's CPU and that of the children it reaped (the docker CLI's commands)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


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
        with contextlib.suppress(Exception):
            await provider.aclose()


async def _tick(provider: Any, handles: list[Any]) -> tuple[list[Any], bool]:
    """Every sandbox's sample, as ``ResourceSampler.record`` takes it: without waiting where
    the provider can (``resource_sample_nowait``), else all awaited at once (``gather``,
    the way samplers of one interval meet); and whether every one came without waiting."""
    nowait = getattr(provider, "resource_sample_nowait", None)
    if nowait is None:
        samples = list(await asyncio.gather(*(provider.resource_sample(h) for h in handles)))
        return samples, False
    samples = [nowait(h) for h in handles]
    missing = [i for i, sample in enumerate(samples) if sample is None]
    if missing:
        awaited = await asyncio.gather(*(provider.resource_sample(handles[i]) for i in missing))
        for i, sample in zip(missing, awaited, strict=True):
            samples[i] = sample
    return samples, not missing


async def _ticks(
    provider: Any, handles: list[Any], rounds: int, engine_pid: int | None
) -> dict[str, Any]:
    """Plugin and engine CPU per sample over ``rounds`` ticks of every sandbox at once, and
    the first sandbox's successive samples."""
    # The warm-up; it also locates containers a reader first sees now (by waiting).
    first, _ = await _tick(provider, handles)
    sequence = [sample_keys(first[0])]
    without_waiting = True
    per_tick: list[float] = []
    engine_before = tree_cpu_s(engine_pid) if engine_pid else None
    for _ in range(rounds):
        start = _cpu_s()
        samples, answered_now = await _tick(provider, handles)
        without_waiting = without_waiting and answered_now
        per_tick.append((_cpu_s() - start) / len(handles))
        sequence.append(sample_keys(samples[0]))
    engine_after = tree_cpu_s(engine_pid) if engine_pid else None
    engine_us = None
    if engine_before is not None and engine_after is not None:
        engine_us = (engine_after - engine_before) / (rounds * len(handles)) * 1e6
    sample = sequence[0]
    return {
        "usage_source": sample.get(PREFIX + "usage.source"),
        "nowait": without_waiting,
        "plugin_us": median(per_tick) * 1e6,
        "engine_us": engine_us,
        "sample": {k: v for k, v in sample.items() if isinstance(v, str | int | float | bool)},
        "sequence": [
            {k: v for k, v in one.items() if isinstance(v, str | int | float | bool)}
            for one in sequence
        ],
    }


def _identity(provider_name: str) -> dict[str, Any]:
    return {
        PREFIX + "provider": provider_name,
        PREFIX + "id": uuid.uuid4().hex + uuid.uuid4().hex,
        PREFIX + "request.id": uuid.uuid4().hex,
    }


async def _record_us(
    samples: list[Mapping[str, Any]],
    count: int,
    exporter: EncodingSpanExporter,
    *,
    nowait: bool,
    final: bool = False,
) -> float:
    """CPU per ``ResourceSampler.record("sample")`` of ``samples`` replayed, exported and
    flushed (``final``: every record whole, as a final one is). Flushed every
    ``_FLUSH_EVERY`` records, so the exporter's queue never drops one (checked)."""
    handle = SandboxHandle("benchmark", "docker", None)
    sampler = ResourceSampler(_Answering(samples, nowait), handle, _identity("docker"), 10.0)
    provider = trace.get_tracer_provider()
    for _ in range(min(count, 100)):  # warm-up
        await sampler.record("sample", final=final)
    provider.force_flush()  # type: ignore[attr-defined]
    exported = exporter.samples
    start = time.process_time()
    for done in range(1, count + 1):
        await sampler.record("sample", final=final)
        if done % _FLUSH_EVERY == 0:
            provider.force_flush()  # type: ignore[attr-defined]
    provider.force_flush()  # type: ignore[attr-defined]
    spent = time.process_time() - start
    if exporter.samples - exported != count:
        raise RuntimeError(f"{count - (exporter.samples - exported)} records were dropped")
    return spent / count * 1e6


async def _end_to_end_us(provider: Any, handles: list[Any], rounds: int) -> float:
    """This process's CPU per ``ResourceSampler.record("sample")`` with the source itself:
    the sample and its record as live samplers take them (one sampler per sandbox, all of
    them at once as samplers of one interval meet), over ``rounds`` ticks after a warm-up,
    the spans exported as the batch processor would (flushed every ``_FLUSH_EVERY`` or so,
    and at the end). The engine's CPU is not in it."""
    samplers = [
        ResourceSampler(provider, h, _identity(getattr(provider, "name", "docker")), 10.0)
        for h in handles
    ]
    tracer_provider = trace.get_tracer_provider()
    # The warm-up, and every sandbox's whole first sample.
    await asyncio.gather(*(sampler.record("sample") for sampler in samplers))
    tracer_provider.force_flush()  # type: ignore[attr-defined]
    unflushed = 0
    start = _cpu_s()
    for _ in range(rounds):
        await asyncio.gather(*(sampler.record("sample") for sampler in samplers))
        unflushed += len(samplers)
        if unflushed >= _FLUSH_EVERY:
            tracer_provider.force_flush()  # type: ignore[attr-defined]
            unflushed = 0
    tracer_provider.force_flush()  # type: ignore[attr-defined]
    return (_cpu_s() - start) / (rounds * len(handles)) * 1e6


def _bare_span_us(sample: Mapping[str, Any], count: int) -> float:
    """CPU per bare span with a whole record's attributes (no sampler machinery)."""
    tracer = trace.get_tracer("sampler_cost")
    attributes = {**_identity("docker"), **sample}
    provider = trace.get_tracer_provider()
    provider.force_flush()  # type: ignore[attr-defined]
    start = time.process_time()
    for done in range(1, count + 1):
        tracer.start_span("sandbox.resources", attributes=attributes).end()
        if done % _FLUSH_EVERY == 0:
            provider.force_flush()  # type: ignore[attr-defined]
    provider.force_flush()  # type: ignore[attr-defined]
    return (time.process_time() - start) / count * 1e6


async def _live_share(provider: Any, handles: list[Any], seconds: float) -> float:
    samplers = [
        ResourceSampler(
            provider, h, _identity(getattr(provider, "name", "docker")), LIVE_INTERVAL_S
        )
        for h in handles
    ]
    for sampler in samplers:
        sampler.start()
    await asyncio.sleep(LIVE_INTERVAL_S)  # every sampler past its first tick
    start = time.process_time()
    await asyncio.sleep(seconds)
    share = (time.process_time() - start) / seconds
    await asyncio.gather(*(sampler.stop() for sampler in samplers))
    return share


async def _row(
    label: str,
    provider: Any,
    handles: list[Any],
    args: argparse.Namespace,
    exporter: EncodingSpanExporter,
    engine_pid: int | None = None,
) -> dict[str, Any]:
    row: dict[str, Any] = {"source": label, "sandboxes": len(handles)}
    row.update(await _ticks(provider, handles, args.rounds, engine_pid))
    row["record_us"] = await _record_us(
        row["sequence"], args.records, exporter, nowait=row["nowait"]
    )
    total = row["plugin_us"] + (row["engine_us"] or 0.0) + row["record_us"]
    row["total_us"] = total
    # A source read without waiting: as many samples as the record column times (a few
    # containers' ticks alone would be too short a window to time). Others wait on the
    # engine or a scan (a `docker stats` takes seconds): --rounds ticks.
    ticks = args.rounds
    if row["nowait"]:
        ticks = max(ticks, -(-args.records // len(handles)))
    row["end_to_end_us"] = await _end_to_end_us(provider, handles, ticks)
    row["fleet_share_default"] = FLEET * total / 1e6 / args.interval
    row["fleet_share_1s"] = FLEET * total / 1e6
    if args.live_seconds > 0:
        row["live_cpu_share"] = await _live_share(provider, handles, args.live_seconds)
    return row


async def _benchmark(args: argparse.Namespace) -> dict[str, Any]:
    collector_binary = None
    if args.dockerstats_binary:
        collector_binary = args.dockerstats_binary
    elif args.dockerstats:
        collector_binary = await asyncio.to_thread(_dockerstats.build)
    dockerstats: dict[str, Any] | None = None
    exporter = EncodingSpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(tracer_provider)
    # The fleet counters (gym.sandbox.oom_kills) are fed by every record: a real SDK.
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    spec = SandboxSpec(resources={"cpu": 0.5, "memory_mib": 64})

    cgroup_provider = ProcessSandboxProvider(cgroups=True, cgroup_parent="nemo_gym_benchmark")
    if cgroup_provider.cgroup_version is None:
        skipped["process (cgroup)"] = "no writable cgroup hierarchy here (run as root)"
    else:
        label = f"process (cgroup v{cgroup_provider.cgroup_version})"
        async with _sandboxes(cgroup_provider, args.sandboxes, spec) as handles:
            rows.append(await _row(label, cgroup_provider, handles, args, exporter))
    proc_provider = ProcessSandboxProvider(cgroups=False)
    async with _sandboxes(proc_provider, args.sandboxes, SandboxSpec()) as handles:
        rows.append(await _row("process (/proc)", proc_provider, handles, args, exporter))

    socket_path = engine_socket(args.engine_socket) if args.docker_sandboxes > 0 else None
    if socket_path is None:
        skipped["docker"] = (
            "no Docker-compatible engine answers (start one with scripts/start-podman.sh)"
            if args.docker_sandboxes > 0
            else "--docker-sandboxes 0"
        )
    else:
        engine_pid = serving_pid(socket_path)
        docker = DockerSandboxProvider(f"unix://{socket_path}")
        stats = _StatsOnlyDocker(f"unix://{socket_path}")
        image = args.image
        if collector_binary is not None:
            # A name of their own, so that the collector watches these containers only.
            image = _dockerstats.tagged_image(socket_path, args.image)
        container_spec = SandboxSpec(image=image, resources=spec.resources)
        try:
            async with _sandboxes(docker, args.docker_sandboxes, container_spec) as handles:
                first = await docker.resource_sample(handles[0])
                source = str(sample_keys(first)[PREFIX + "usage.source"])
                label = f"docker ({source.replace('.', ' ')})"
                rows.append(await _row(label, docker, handles, args, exporter, engine_pid))
                rows.append(
                    await _row("docker (stats)", stats, handles, args, exporter, engine_pid)
                )
                binary = shutil.which("docker")
                if binary is None:
                    skipped["docker CLI"] = "no docker CLI on PATH"
                else:
                    # The CLI talks to the engine measured above.
                    os.environ["DOCKER_HOST"] = f"unix://{socket_path}"
                    cli = DockerCliReader(_Cli(binary))
                    first = await cli.resource_sample(handles[0])
                    source = str(sample_keys(first)[PREFIX + "usage.source"])
                    label = f"docker CLI ({source.replace('.', ' ')})"
                    rows.append(await _row(label, cli, handles, args, exporter, engine_pid))
                    stats_cli = _StatsOnlyCli(_Cli(binary))
                    label = "docker CLI (stats)"
                    rows.append(await _row(label, stats_cli, handles, args, exporter, engine_pid))
                if collector_binary is not None:
                    # After our rows, on the same running containers: neither inflates
                    # the other's engine figure.
                    dockerstats = await asyncio.to_thread(
                        _dockerstats.measure,
                        collector_binary,
                        socket_path,
                        image,
                        engine_pid,
                        args.dockerstats_interval,
                        args.dockerstats_seconds,
                    )
        except Exception as error:
            skipped["docker"] = f"engine at {socket_path} failed: {error!r}"
        finally:
            await stats.aclose()
            if image != args.image:
                _dockerstats.untag(socket_path, image)
    if args.opensandbox:
        await _opensandbox(rows, args, exporter, socket_path)
    # The record's alternatives, on the target's samples (the Docker cgroup path) where run.
    target = next((r for r in rows if r["source"].startswith("docker (cgroup")), rows[0])
    alternatives = {
        "of": target["source"],
        "record_us": target["record_us"],
        "whole_record_us": await _record_us(
            target["sequence"], args.records, exporter, nowait=target["nowait"], final=True
        ),
        "bare_span_us": _bare_span_us(target["sample"], args.records),
    }
    tracer_provider.shutdown()
    return {
        "benchmark": "sampler_cost",
        "machine": machine_facts(),
        "command": " ".join(["python", *sys.argv]),
        "config": {
            "sandboxes": args.sandboxes,
            "docker_sandboxes": args.docker_sandboxes,
            "rounds": args.rounds,
            "records": args.records,
            "interval_s": args.interval,
            "live_seconds": args.live_seconds,
            "export": exporter.encoding,
            "engine_pid": None if socket_path is None else serving_pid(socket_path),
            "hogs": args.hogs,
        },
        "results": rows,
        "alternatives": alternatives,
        "dockerstats": dockerstats,
        "skipped": skipped,
    }


async def _opensandbox(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    exporter: EncodingSpanExporter,
    socket_path: str | None,
) -> None:
    """The OpenSandbox rows (``_opensandbox_rows``), on sandboxes of their own."""
    import _opensandbox_rows as opensandbox

    provider = opensandbox.provider()
    engine_pid = None if socket_path is None else serving_pid(socket_path)
    async with _sandboxes(provider, args.docker_sandboxes, opensandbox.spec(args.image)) as handles:
        reader = OpenSandboxReader(provider)
        first = await reader.resource_sample(handles[0])
        source = str(sample_keys(first)[PREFIX + "usage.source"])
        label = f"opensandbox co-located ({source.replace('.', ' ')})"
        rows.append(await _row(label, reader, handles, args, exporter, engine_pid))
        api = opensandbox.ApiCalls(provider)
        label = "opensandbox API (opensandbox.metrics; engine = server)"
        rows.append(await _row(label, api, handles, args, exporter, opensandbox.server_pid()))


def _us(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def _print(result: dict[str, Any]) -> None:
    config = result["config"]
    interval = config["interval_s"]
    hogs = f"; {config['hogs']} CPU hogs running" if config["hogs"] else ""
    print(
        f"\n{config['rounds']} ticks (every sandbox sampled at once); records exported as "
        f"{config['export']}; {FLEET:,} sandboxes projected at {interval:g} s and 1 s{hogs}\n"
    )
    print(
        f"| source | sandboxes | sample µs | engine µs | record µs | total µs | this "
        f"process, end to end µs | {FLEET:,} every {interval:g} s | {FLEET:,} every 1 s | live |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in result["results"]:
        live = row.get("live_cpu_share")
        print(
            f"| {row['source']} | {row['sandboxes']} | {_us(row['plugin_us'])} | "
            f"{_us(row['engine_us'])} | {_us(row['record_us'])} | {_us(row['total_us'])} | "
            f"{_us(row['end_to_end_us'])} | "
            f"{row['fleet_share_default']:.1%} | {row['fleet_share_1s']:.0%} | "
            f"{'–' if live is None else f'{live:.1%}'} |"
        )
    alternatives = result["alternatives"]
    print(
        f"\nper record of {alternatives['of']}: as recorded (unchanged figures left out) "
        f"{alternatives['record_us']:.1f} µs; every record whole "
        f"{alternatives['whole_record_us']:.1f} µs; bare span with a whole record's "
        f"attributes {alternatives['bare_span_us']:.1f} µs"
    )
    dockerstats = result.get("dockerstats")
    if dockerstats:
        ours = next(
            (r for r in result["results"] if r["source"].startswith("docker (cgroup")), None
        )
        print(
            f"\nCollector dockerstats receiver (collection_interval "
            f"{dockerstats['collection_interval_s']:g} s, {dockerstats['window_s']:.0f} s, "
            f"{dockerstats['container_samples']:,} container samples exported): collector "
            f"{dockerstats['collector_us']:,.0f} µs + engine {_us(dockerstats['engine_us'])} "
            f"µs (net of {_us(dockerstats['engine_baseline_us'])} µs without it) = "
            f"{dockerstats['total_us']:,.0f} µs per container sample"
        )
        if ours is not None:
            print(
                f"ours ({ours['source']}): {ours['total_us']:,.0f} µs total, "
                f"{ours['end_to_end_us']:,.0f} µs end to end; dockerstats / ours = "
                f"{dockerstats['total_us'] / ours['total_us']:.1f}x"
            )
    for name, reason in result["skipped"].items():
        print(f"skipped {name}: {reason}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sandboxes", type=int, default=200, help="process sandboxes")
    parser.add_argument(
        "--docker-sandboxes", type=int, default=12, help="containers (0 skips Docker)"
    )
    parser.add_argument("--rounds", type=int, default=15, help="ticks per source")
    parser.add_argument("--records", type=int, default=2000, help="records timed per source")
    parser.add_argument(
        "--interval", type=float, default=10.0, help="sampling interval projected (s)"
    )
    parser.add_argument(
        "--live-seconds", type=float, default=0.0, help="live window per source (0: none)"
    )
    parser.add_argument("--engine-socket", default=None, help="engine's unix socket path")
    parser.add_argument(
        "--image",
        default=os.environ.get("NEMO_GYM_TEST_IMAGE", DEFAULT_IMAGE),
        help="container image for Docker sandboxes",
    )
    parser.add_argument(
        "--dockerstats",
        action="store_true",
        help="also run the Collector's dockerstats receiver on the containers (builds it "
        "with benchmarks/dockerstats/build.sh: Go, the module proxy, minutes the first time)",
    )
    parser.add_argument(
        "--dockerstats-binary", default=None, help="that collector, already built (implies it)"
    )
    parser.add_argument(
        "--dockerstats-interval", type=float, default=1.0, help="its collection_interval (s)"
    )
    parser.add_argument(
        "--dockerstats-seconds", type=float, default=30.0, help="its measured window (s)"
    )
    parser.add_argument(
        "--hogs", type=int, default=0, help="busy-loop processes running meanwhile (load)"
    )
    parser.add_argument(
        "--opensandbox",
        action="store_true",
        help="also NeMo Gym main's opensandbox provider's sandboxes, co-located and through "
        "the metrics API (needs NeMo Gym main and scripts/start-opensandbox.sh's server)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args()
    require_at_least(parser, args, 1, "sandboxes", "rounds", "records")
    require_at_least(parser, args, 0, "docker_sandboxes", "live_seconds", "hogs")
    if not (args.dockerstats_interval > 0 and args.dockerstats_seconds > 0):
        parser.error("--dockerstats-interval and --dockerstats-seconds must be positive")
    if not args.interval > 0:
        parser.error("--interval must be positive")
    # The load of --hogs: busy loops of this interpreter for the whole run, ended by PID.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        run_and_report(args, _benchmark, _print)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


if __name__ == "__main__":
    main()
