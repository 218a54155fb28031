"""Connection-pool and sandbox metrics scraped by a real Prometheus server.

The app exposes its metrics with ``opentelemetry-exporter-prometheus`` on a loopback port,
instruments aiohttp and the bundled sandbox providers with ``NemoGymInstrumentor``, and
starts two loopback aiohttp servers. Each *round* of traffic drives three saturated pools and
two sandboxes:

* ``policy`` (127.0.0.1): a pool of 2 for 20 requests of 0.15 s at once, so most of them
  queue on the ``total`` limit, some for over a second;
* ``resources`` (127.0.0.2): a total limit of 100 but 1 per host, 10 requests at once, so
  most queue on the ``per_host`` limit;
* ``judge`` (127.0.0.1): a pool of 1 held by a slow request while a second request gives up
  after 0.2 s in the queue: one ``abandoned`` wait;
* a process sandbox with a 64 MiB cgroup runs a command that allocates 200 MiB: the kernel
  OOM-kills it (where cgroups are writable, e.g. as root);
* a process sandbox without cgroups asks for 0.5 CPU and 64 MiB, which nothing enforces: an
  allocation mismatch (``no_limit``).

Both sandboxes also give the lifecycle metrics (two starts, one command, none held at the
end) and, from their usage samples, the CPU time and memory peak of the sandboxes of
``--nemo-gym-server`` (default ``sandbox_example``): the app labels them as that NeMo Gym
server would, ``gym env start`` setting its name in ``NEMO_GYM_CONFIG_PATH``.

The *hold* step then leaves a pool in a known state for Prometheus to scrape: one connector
(``limit=3, limit_per_host=2``) with 2 idle keep-alive connections to 127.0.0.2, 2 active
requests to 127.0.0.1 held open by the server, and 3 more requests to 127.0.0.1 waiting for a
slot on the per-host limit, until *release* (or ``--hold-seconds`` pass).

By default the app waits ``--wait`` seconds (time to start Prometheus), runs two rounds three
scrape intervals apart (rates need a counter seen before and after it grew), holds, releases,
and keeps serving ``/metrics`` for ``--linger`` seconds or until Ctrl-C. With
``--control stdin`` it does each step when told, one command a line: ``round``, ``hold``,
``release``, ``quit`` (or end of input). After each step it prints one JSON line with what it
did and what its own in-process reader saw. ``--prometheus-config PATH`` writes a Prometheus
configuration that scrapes it every ``--scrape-interval`` seconds and, with
``--rule-file PATH``, evaluates those rules as often.

    python examples/prometheus/app.py --metrics-port 9464 \\
        --prometheus-config /tmp/prometheus.yml \\
        --rule-file "$PWD/examples/prometheus/rules.yml"

``OTEL_SEMCONV_STABILITY_OPT_IN=http`` (or ``http/dup``) picks the naming mode as usual.

``--otlp-endpoint http://127.0.0.1:4318`` sends the metrics over OTLP/HTTP to a collector
instead of serving them (needs ``opentelemetry-exporter-otlp-proto-http``), flushing after
each step; then ``--scrape-target HOST:PORT`` (the collector's Prometheus exporter) is what
the written Prometheus configuration scrapes, with ``honor_labels`` so the ``job`` and
``instance`` the collector derives from ``service.name`` and ``service.instance.id`` stay.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import start_http_server

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    reset_server_name,
    set_server_name,
)

QUEUE_DURATIONS = (
    "gym.http.connection_pool.queue_duration_ms",  # default names (NeMo Gym's)
    "http.client.request.time_in_queue",  # OTEL_SEMCONV_STABILITY_OPT_IN=http
)
CONNECT_TOTAL = "gym.http.connection_pool.connect_total"
WAITING_REQUESTS = "gym.http.connection_pool.waiting_requests"
OPEN_CONNECTIONS = "http.client.open_connections"
SERVER_LABEL = "nemo.gym.http.destination.server.name"
CONSTRAINT_LABEL = "nemo.gym.http.connection_pool.queue_constraint"
OUTCOME_LABEL = "nemo.gym.http.connection_pool.queue_outcome"

POLICY_DELAY_S = 0.15
# The sandbox lifecycle and usage instruments the app reports on.
SANDBOX_FIGURES = (
    "gym.sandbox.active",
    "gym.sandbox.startup_duration_ms",
    "gym.sandbox.exec_duration_ms",
    "gym.sandbox.cpu.time",
    "gym.sandbox.memory.peak",
)
HOLD = {"limit": 3, "limit_per_host": 2, "idle": 2, "active": 2, "waiting": 3}
# The hungry command runs the system's Python, which an isolated sandbox sees; without one,
# this interpreter, which it sees read-only where it is told to (INTERPRETER).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
INTERPRETER = [] if SYSTEM_PYTHON else sorted({sys.prefix, sys.base_prefix})
MEMORY_HUNGRY = f"{SYSTEM_PYTHON or sys.executable} -c \"b = b'x' * (200 * 1024 * 1024)\""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def prometheus_config(
    metrics_port: int,
    scrape_interval_s: float = 1.0,
    rule_files: Iterable[Path] = (),
    target: str | None = None,
) -> str:
    """A Prometheus configuration that scrapes this app on ``127.0.0.1:metrics_port``.

    With ``target`` (a collector's exporter) it scrapes that instead, honouring its labels.
    """
    interval = f"{scrape_interval_s:g}s"
    rules = "".join(f"  - {json.dumps(str(path))}\n" for path in rule_files)
    return (
        f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
        + (f"rule_files:\n{rules}" if rules else "")
        + "scrape_configs:\n"
        "  - job_name: nemo_gym_app\n"
        + ("    honor_labels: true\n" if target else "")
        + f"    scrape_interval: {interval}\n"
        f"    scrape_timeout: {interval}\n"
        "    static_configs:\n"
        f"      - targets: ['{target or f'127.0.0.1:{metrics_port}'}']\n"
    )


class Backends:
    """Two loopback servers: ``/`` answers after ``?delay=``; ``/hold`` waits for release."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.held = 0
        self._held_changed = asyncio.Condition()
        self._runners: list[web.AppRunner] = []
        self.urls: dict[str, str] = {}

    async def _handle(self, request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("delay", "0.02")))
        return web.Response(text="ok")

    async def _hold(self, request: web.Request) -> web.Response:
        async with self._held_changed:
            self.held += 1
            self._held_changed.notify_all()
        await self.release.wait()
        return web.Response(text="released")

    async def wait_held(self, count: int) -> None:
        async with self._held_changed:
            await self._held_changed.wait_for(lambda: self.held >= count)

    async def start(self) -> None:
        for host in ("127.0.0.1", "127.0.0.2"):
            app = web.Application()
            app.router.add_get("/", self._handle)
            app.router.add_get("/hold", self._hold)
            # Idle client connections must outlive a hold: keep them open on this side too.
            runner = web.AppRunner(app, access_log=None, keepalive_timeout=3600)
            await runner.setup()
            site = web.TCPSite(runner, host, 0)
            await site.start()
            server = site._server
            assert server is not None
            port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._runners.append(runner)
            self.urls[host] = f"http://{host}:{port}/"

    async def stop(self) -> None:
        self.release.set()
        for runner in self._runners:
            await runner.cleanup()


async def _burst(session: aiohttp.ClientSession, url: str, count: int) -> None:
    async def one() -> None:
        async with session.get(url) as response:
            await response.read()

    await asyncio.gather(*(one() for _ in range(count)))


class Labelled:
    """``with Labelled("policy"):`` labels the requests inside with that destination name."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __enter__(self) -> None:
        self._token = set_server_name(self._name)

    def __exit__(self, *exc: object) -> None:
        reset_server_name(self._token)


async def pool_round(backends: Backends) -> dict[str, Any]:
    """Drive the three saturated pools once; return what was sent, per destination."""
    url_a, url_b = backends.urls["127.0.0.1"], backends.urls["127.0.0.2"]
    with Labelled("policy"):
        connector = aiohttp.TCPConnector(limit=2)
        assert isinstance(connector, QueueTimedTCPConnector), type(connector)
        async with aiohttp.ClientSession(connector=connector) as session:
            await _burst(session, f"{url_a}?delay={POLICY_DELAY_S}", 20)
    with Labelled("resources"):
        connector = aiohttp.TCPConnector(limit=100, limit_per_host=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            await _burst(session, url_b, 10)
    with Labelled("judge"):
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            slow = asyncio.ensure_future(session.get(url_a + "?delay=0.6"))
            await asyncio.sleep(0.1)  # the slow request now holds the only slot
            abandoned = 0
            try:
                await session.get(url_a, timeout=aiohttp.ClientTimeout(total=0.2))
            except TimeoutError:
                abandoned = 1
            response = await slow
            await response.read()
            response.release()
    gc.collect()  # closed connectors leave the pool-state gauges now, not at some later GC
    return {
        "policy": {"requests": 20, "limit": 2},
        "resources": {"requests": 10, "limit_per_host": 1},
        "judge": {"requests": 2, "limit": 1, "abandoned": abandoned},
    }


async def sandbox_round() -> dict[str, Any]:
    """One OOM-killed command in a 64 MiB cgroup, and one sandbox whose request nothing
    enforces. Both providers are traced by the instrumentor."""
    enforced = ProcessSandboxProvider(read_only_paths=INTERPRETER)
    unenforced = ProcessSandboxProvider(cgroups=False, read_only_paths=INTERPRETER)
    done: dict[str, Any] = {"cgroups": enforced.cgroup_version}
    try:
        sandbox = await enforced.create(SandboxSpec(resources={"cpu": 1.0, "memory_mib": 64}))
        result = await enforced.exec(sandbox, MEMORY_HUNGRY, timeout_s=60)
        done["oom_kill"] = result.error_type == "oom_kill"
        await enforced.close(sandbox)
        sandbox = await unenforced.create(SandboxSpec(resources={"cpu": 0.5, "memory_mib": 64}))
        await unenforced.close(sandbox)
        done["unenforced"] = 1
    finally:
        await enforced.aclose()
        await unenforced.aclose()
    return done


class Hold:
    """One pool left with known numbers of idle, active and waiting requests until released."""

    def __init__(self, backends: Backends) -> None:
        self._backends = backends
        self._session: aiohttp.ClientSession | None = None
        self._held: asyncio.Future[Any] | None = None

    async def start(self, reader: InMemoryMetricReader) -> dict[str, Any]:
        connector = aiohttp.TCPConnector(
            limit=HOLD["limit"], limit_per_host=HOLD["limit_per_host"], keepalive_timeout=3600
        )
        self._session = session = aiohttp.ClientSession(connector=connector)
        with Labelled("resources"):  # two requests at once open two connections, then idle
            await _burst(session, self._backends.urls["127.0.0.2"] + "?delay=0.05", HOLD["idle"])
        with Labelled("policy"):
            url = self._backends.urls["127.0.0.1"] + "hold"
            self._held = asyncio.gather(
                *(_burst(session, url, 1) for _ in range(HOLD["active"] + HOLD["waiting"]))
            )
        await self._backends.wait_held(HOLD["active"])
        # The others queue within a few loop turns; the app's own reader says when (bounded).
        waiting = None
        for _ in range(100):
            waiting = _gauge_total(reader, WAITING_REQUESTS)
            if waiting == HOLD["waiting"]:
                break
            await asyncio.sleep(0.05)
        return {**HOLD, "waiting_seen": waiting}

    async def release(self) -> None:
        self._backends.release.set()
        if self._held is not None:
            await self._held
        if self._session is not None:
            await self._session.close()
        gc.collect()


def _gauge_total(reader: InMemoryMetricReader, name: str) -> float | None:
    data = reader.get_metrics_data()
    total = None
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    total = (total or 0) + sum(
                        p.value for p in metric.data.data_points if isinstance(p, NumberDataPoint)
                    )
    return total


def observed(reader: InMemoryMetricReader) -> dict[str, Any]:
    """What this process's own reader holds: queue samples, connects, open connections, and
    the sandbox lifecycle and usage figures (a histogram's count, a sum's or gauge's value)."""
    queue: list[dict[str, Any]] = []
    connects: dict[str, int] = {}
    connections: dict[str, float] = {}
    sandboxes: dict[str, float] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    if metric.name in QUEUE_DURATIONS and isinstance(point, HistogramDataPoint):
                        queue.append(
                            {
                                "name": metric.name,
                                "server": attributes.get(SERVER_LABEL),
                                "constraint": attributes.get(CONSTRAINT_LABEL),
                                "outcome": attributes.get(OUTCOME_LABEL),
                                "error_type": attributes.get("error.type"),
                                "count": point.count,
                                "sum": point.sum,
                            }
                        )
                    elif metric.name == CONNECT_TOTAL and isinstance(point, NumberDataPoint):
                        connects[str(attributes.get(SERVER_LABEL))] = int(point.value)
                    elif metric.name == OPEN_CONNECTIONS and isinstance(point, NumberDataPoint):
                        state = str(attributes.get("http.connection.state"))
                        connections[state] = connections.get(state, 0) + point.value
                    elif metric.name in SANDBOX_FIGURES:
                        figure = (
                            point.count if isinstance(point, HistogramDataPoint) else point.value
                        )
                        sandboxes[metric.name] = sandboxes.get(metric.name, 0) + figure
    return {
        "queue": queue,
        "connects": connects,
        "open_connections": connections,
        "sandboxes": sandboxes,
    }


def _emit(step: str, **fields: Any) -> None:
    print(json.dumps({"step": step, "time": time.time(), **fields}), flush=True)


async def _commands_from_stdin() -> asyncio.Queue[str]:
    """Lines of standard input, read on a thread; end of input becomes ``quit``."""
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str] = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, "quit")

    threading.Thread(target=read, daemon=True).start()
    return commands


def flush() -> None:
    """Export now (OTLP mode: the step reaches the collector before it is reported)."""
    provider = metrics.get_meter_provider()
    if isinstance(provider, MeterProvider):
        provider.force_flush(timeout_millis=10_000)


async def run(args: argparse.Namespace, reader: InMemoryMetricReader) -> None:
    backends = Backends()
    await backends.start()
    hold = Hold(backends)
    rounds = 0

    async def step(command: str) -> None:
        nonlocal rounds
        if command == "round":
            rounds += 1
            pools = await pool_round(backends)
            sandboxes = await sandbox_round() if args.sandboxes else None
            flush()
            _emit("round", round=rounds, done=pools, sandboxes=sandboxes, observed=observed(reader))
        elif command == "hold":
            held = await hold.start(reader)
            flush()
            _emit("hold", held=held, observed=observed(reader))
        elif command == "release":
            await hold.release()
            _emit("release")
        else:
            raise ValueError(f"unknown command {command!r}: round, hold, release or quit")

    try:
        if args.control == "stdin":
            commands = await _commands_from_stdin()
            while (command := await commands.get()) != "quit":
                await step(command)
            return
        await asyncio.sleep(args.wait)
        await step("round")
        await asyncio.sleep(3 * args.scrape_interval)
        await step("round")
        await step("hold")
        await asyncio.sleep(args.hold_seconds)
        await step("release")
        await asyncio.sleep(args.linger)
    finally:
        # Bounded: a hold never outlives the app.
        await asyncio.wait_for(hold.release(), 30)
        await backends.stop()


def _otlp_reader(endpoint: str) -> Any:
    # Imported here: only the OTLP mode needs the exporter package.
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    exporter = OTLPMetricExporter(endpoint=endpoint.rstrip("/") + "/v1/metrics", timeout=5)
    return PeriodicExportingMetricReader(exporter, export_interval_millis=1000)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--prometheus-config", type=Path, help="write a scrape config here")
    parser.add_argument("--rule-file", type=Path, action="append", default=[], help="for it")
    parser.add_argument("--scrape-interval", type=float, default=1.0, help="seconds")
    parser.add_argument("--control", choices=("timer", "stdin"), default="timer")
    parser.add_argument("--wait", type=float, default=10.0, help="seconds before round 1")
    parser.add_argument("--hold-seconds", type=float, default=30.0, help="timer mode")
    parser.add_argument("--linger", type=float, default=600.0, help="seconds to keep serving")
    parser.add_argument("--no-sandboxes", dest="sandboxes", action="store_false", help="pools only")
    parser.add_argument("--otlp-endpoint", help="export over OTLP/HTTP here instead of serving")
    parser.add_argument("--scrape-target", help="HOST:PORT Prometheus scrapes (the collector)")
    parser.add_argument(
        "--nemo-gym-server",
        default="sandbox_example",
        help="the NeMo Gym server whose sandboxes' usage this is (NEMO_GYM_CONFIG_PATH)",
    )
    args = parser.parse_args()

    # Resource samples often enough that a short sandbox gets some, as in examples/sandbox.py.
    os.environ.setdefault("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL", "0.5")
    # What `gym env start` sets for each server: the usage totals name it.
    os.environ["NEMO_GYM_CONFIG_PATH"] = args.nemo_gym_server
    port = args.metrics_port or free_port()
    own_reader = InMemoryMetricReader()
    # Named as the resource detector and NeMo Gym's own telemetry name a server (docs/names.md).
    attributes: dict[str, str | int] = {
        "service.name": f"nemo-gym/{args.nemo_gym_server}",
        "nemo.gym.service_group": "nemo-gym",
        "nemo.gym.server.name": args.nemo_gym_server,
    }
    if args.otlp_endpoint:
        attributes["service.instance.id"] = f"{socket.gethostname()}-{os.getpid()}"
    resource = Resource.create(attributes)
    provider = MeterProvider(
        metric_readers=[_otlp_reader(args.otlp_endpoint), own_reader]
        if args.otlp_endpoint
        else [PrometheusMetricReader(), own_reader],
        resource=resource,
    )
    metrics.set_meter_provider(provider)
    tracer_provider = TracerProvider(resource=resource)
    spans = InMemorySpanExporter()  # sandbox records need a span pipeline; nothing reads it
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(tracer_provider)
    NemoGymInstrumentor().instrument()
    if not args.otlp_endpoint:
        start_http_server(port, addr="127.0.0.1")
    if args.prometheus_config is not None:
        rule_files = [path.resolve() for path in args.rule_file]
        args.prometheus_config.write_text(
            prometheus_config(port, args.scrape_interval, rule_files, args.scrape_target)
        )
    _emit("ready", metrics_port=port, semconv=os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN"))
    try:
        asyncio.run(run(args, own_reader))
    except KeyboardInterrupt:
        pass
    finally:
        NemoGymInstrumentor().uninstrument()
        provider.shutdown()
        tracer_provider.shutdown()


if __name__ == "__main__":
    main()
