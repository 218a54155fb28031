"""Connection-pool metrics scraped by a real Prometheus server.

The app exposes its metrics with ``opentelemetry-exporter-prometheus`` on a loopback port,
instruments aiohttp with ``NemoGymInstrumentor``, and drives three saturated pools against
two loopback aiohttp servers it starts itself:

* ``policy`` (127.0.0.1): a pool of 2 for 20 requests at once, so 18 or so queue on the
  ``total`` limit;
* ``resources`` (127.0.0.2): a total limit of 100 but 1 per host, 10 requests at once, so
  9 or so queue on the ``per_host`` limit;
* ``judge`` (127.0.0.1): a pool of 1 held by a slow request while a second request gives up
  after 0.2 s in the queue: one ``abandoned`` wait.

It then prints one JSON line with what it did and what its own in-process reader saw, and
keeps serving ``/metrics`` for ``--linger`` seconds (or until Ctrl-C, or, with
``--until-stdin-closes``, until its standard input closes).
``--prometheus-config PATH`` writes a Prometheus configuration that scrapes it every second.

    python examples/prometheus/app.py --metrics-port 9464 \\
        --prometheus-config /tmp/prometheus.yml --linger 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.resources import Resource
from prometheus_client import start_http_server

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    reset_server_name,
    set_server_name,
)

QUEUE_DURATION = "gym.http.connection_pool.queue_duration_ms"
CONNECT_TOTAL = "gym.http.connection_pool.connect_total"
SERVER_LABEL = "nemo.gym.http.destination.server.name"
CONSTRAINT_LABEL = "nemo.gym.http.connection_pool.queue_constraint"
OUTCOME_LABEL = "nemo.gym.http.connection_pool.queue_outcome"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def prometheus_config(metrics_port: int, scrape_interval_s: float = 1.0) -> str:
    """A Prometheus configuration that scrapes this app on ``127.0.0.1:metrics_port``."""
    return (
        "global:\n"
        f"  scrape_interval: {scrape_interval_s:g}s\n"
        f"  evaluation_interval: {scrape_interval_s:g}s\n"
        "scrape_configs:\n"
        "  - job_name: nemo_gym_app\n"
        f"    scrape_interval: {scrape_interval_s:g}s\n"
        f"    scrape_timeout: {scrape_interval_s:g}s\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{metrics_port}']\n"
    )


async def _start_server(host: str) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("delay", "0.02")))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://{host}:{port}/"


async def _burst(session: aiohttp.ClientSession, url: str, count: int) -> None:
    async def one() -> None:
        async with session.get(url) as response:
            await response.read()

    await asyncio.gather(*(one() for _ in range(count)))


async def _workload() -> dict[str, Any]:
    """Drive the three pools; return what was sent, per destination label."""
    runner_a, url_a = await _start_server("127.0.0.1")
    runner_b, url_b = await _start_server("127.0.0.2")
    done: dict[str, Any] = {}
    try:
        token = set_server_name("policy")
        try:
            connector = aiohttp.TCPConnector(limit=2)
            assert isinstance(connector, QueueTimedTCPConnector), type(connector)
            async with aiohttp.ClientSession(connector=connector) as session:
                await _burst(session, url_a, 20)
            done["policy"] = {"requests": 20, "limit": 2}
        finally:
            reset_server_name(token)

        token = set_server_name("resources")
        try:
            connector = aiohttp.TCPConnector(limit=100, limit_per_host=1)
            async with aiohttp.ClientSession(connector=connector) as session:
                await _burst(session, url_b, 10)
            done["resources"] = {"requests": 10, "limit_per_host": 1}
        finally:
            reset_server_name(token)

        token = set_server_name("judge")
        try:
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=connector) as session:
                slow = asyncio.ensure_future(session.get(url_a + "?delay=1.0"))
                await asyncio.sleep(0.1)  # the slow request now holds the only slot
                abandoned = False
                try:
                    await session.get(url_a, timeout=aiohttp.ClientTimeout(total=0.2))
                except TimeoutError:
                    abandoned = True
                response = await slow
                await response.read()
                response.release()
            done["judge"] = {"requests": 2, "limit": 1, "abandoned": int(abandoned)}
        finally:
            reset_server_name(token)
    finally:
        await runner_a.cleanup()
        await runner_b.cleanup()
    return done


def _observed(reader: InMemoryMetricReader) -> dict[str, Any]:
    """What this process's own reader holds: queue samples and connects by label."""
    queue: list[dict[str, Any]] = []
    connects: dict[str, int] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    if metric.name == QUEUE_DURATION and isinstance(point, HistogramDataPoint):
                        queue.append(
                            {
                                "server": attributes.get(SERVER_LABEL),
                                "constraint": attributes.get(CONSTRAINT_LABEL),
                                "outcome": attributes.get(OUTCOME_LABEL),
                                "count": point.count,
                                "sum": point.sum,
                            }
                        )
                    elif metric.name == CONNECT_TOTAL and isinstance(point, NumberDataPoint):
                        connects[str(attributes.get(SERVER_LABEL))] = int(point.value)
    return {"queue": queue, "connects": connects}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--prometheus-config", type=Path, help="write a scrape config here")
    parser.add_argument("--scrape-interval", type=float, default=1.0, help="seconds")
    parser.add_argument("--linger", type=float, default=600.0, help="seconds to keep serving")
    parser.add_argument(
        "--until-stdin-closes",
        action="store_true",
        help="stop serving as soon as standard input closes (for a parent process)",
    )
    args = parser.parse_args()

    port = args.metrics_port or free_port()
    own_reader = InMemoryMetricReader()
    provider = MeterProvider(
        metric_readers=[PrometheusMetricReader(), own_reader],
        resource=Resource.create({"service.name": "nemo-gym-prometheus-example"}),
    )
    metrics.set_meter_provider(provider)
    NemoGymInstrumentor().instrument()
    start_http_server(port, addr="127.0.0.1")
    if args.prometheus_config is not None:
        args.prometheus_config.write_text(prometheus_config(port, args.scrape_interval))

    done = asyncio.run(_workload())
    print(
        json.dumps({"metrics_port": port, "done": done, "observed": _observed(own_reader)}),
        flush=True,
    )

    # Serve /metrics (from prometheus_client's own thread) until told to stop.
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        stop.set()

    if args.until_stdin_closes:
        threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        stop.wait(args.linger)
    except KeyboardInterrupt:
        pass
    finally:
        NemoGymInstrumentor().uninstrument()
        provider.shutdown()


if __name__ == "__main__":
    main()
