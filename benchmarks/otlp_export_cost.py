"""What one process pays to export its pool metrics over OTLP/HTTP to a collector.

Makes realistic pool series (``--labels`` destination labels on two loopback servers, every
label with queued waits, in the default naming mode), then exports ``--exports`` times through
a real ``OTLPMetricExporter`` to the collector ``scripts/start-collector.sh`` started, and
prints the CPU time and wall time per export, the series exported, and what that costs at the
SDK's default export interval (60 s). Run from the repository root:

    bash scripts/start-collector.sh
    python benchmarks/otlp_export_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

import aiohttp
from aiohttp import web
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    reset_server_name,
    set_server_name,
)

DEFAULT_INTERVAL_S = 60.0


def collector(key: str) -> str:
    """An endpoint scripts/start-collector.sh recorded."""
    # The script's state folder: NEMO_GYM_COLLECTOR_DIR, else this checkout's default (one per
    # user and checkout: the first 12 hex digits of the SHA-256 of its absolute path).
    checkout = Path(__file__).resolve().parent.parent
    key = hashlib.sha256(str(checkout).encode()).hexdigest()[:12]
    state = (
        os.environ.get("NEMO_GYM_COLLECTOR_DIR") or f"/tmp/nemo-gym-collector-{os.getuid()}-{key}"
    )
    lines = Path(state, "ports.env").read_text().splitlines()
    found = dict(line.split("=", 1) for line in lines if "=" in line)
    return found[key]


def accepted_points() -> float:
    """The collector's count of metric points its OTLP receiver accepted so far."""
    with urllib.request.urlopen(collector("COLLECTOR_SELF_METRICS"), timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("otelcol_receiver_accepted_metric_points")
    )


async def traffic(telemetry: PoolTelemetry, labels: int) -> None:
    async def handle(_: web.Request) -> web.Response:
        await asyncio.sleep(0.002)
        return web.Response(text="ok")

    runners = []
    urls = []
    for host in ("127.0.0.1", "127.0.0.2"):
        app = web.Application()
        app.router.add_get("/", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, 0).start()
        runners.append(runner)
        urls.append(f"http://{host}:{runner.addresses[0][1]}/")
    connector = QueueTimedTCPConnector(limit=2)
    connector._nemo_gym_attach(telemetry)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def get(label: str, url: str) -> None:
            token = set_server_name(label)
            try:
                async with session.get(url) as response:
                    await response.read()
            finally:
                reset_server_name(token)

        for index in range(labels):
            url = urls[index % 2]
            await asyncio.gather(*(get(f"server-{index}", url) for _ in range(6)))
    for runner in runners:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--labels", type=int, default=10)
    parser.add_argument("--exports", type=int, default=200)
    args = parser.parse_args()
    exporter = OTLPMetricExporter(endpoint=collector("OTEL_EXPORTER_OTLP_ENDPOINT") + "/v1/metrics")
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(
        metric_readers=[reader],
        resource=Resource.create({"service.name": "otlp-export-cost"}),
    )
    telemetry = PoolTelemetry(provider, version="bench", max_server_names=100)
    asyncio.run(traffic(telemetry, args.labels))
    accepted_before = accepted_points()
    cpu: list[float] = []
    wall: list[float] = []
    for _ in range(args.exports):
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        assert provider.force_flush(timeout_millis=10_000)
        cpu.append(time.process_time() - cpu_start)
        wall.append(time.perf_counter() - wall_start)
    # Points per export, as the collector counted them (its own accepted-points counter).
    points = (accepted_points() - accepted_before) / args.exports
    cpu_ms = statistics.median(cpu) * 1000
    print(
        json.dumps(
            {
                "labels": args.labels,
                "exports": args.exports,
                "cpu_ms_per_export_median": round(cpu_ms, 3),
                "cpu_ms_per_export_p90": round(sorted(cpu)[int(0.9 * len(cpu))] * 1000, 3),
                "wall_ms_per_export_median": round(statistics.median(wall) * 1000, 3),
                "cpu_share_at_60s_interval_percent": round(cpu_ms / (DEFAULT_INTERVAL_S * 10), 5),
                "points": points,
            }
        )
    )
    provider.shutdown()


if __name__ == "__main__":
    main()
