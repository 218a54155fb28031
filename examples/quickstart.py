"""Quickstart: is my latency the backend, or my own aiohttp connection pool?

Starts two real aiohttp servers on loopback (127.0.0.1 and 127.0.0.2) whose handlers take a
few milliseconds, then sends bursts of requests through one small pool, labelled with two
destination names, and prints what the instrumentation saw per destination: connects, queued
waits, wait percentiles, the binding limit, and waits abandoned by a connect timeout. Last
comes the pool's capacity report against the concurrency the bursts intended.

Run it as is (an embedded OpenTelemetry SDK with an in-memory reader is used), or under
``opentelemetry-instrument`` with no code change, in which case the metrics go wherever that
configured (for example ``OTEL_METRICS_EXPORTER=console``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    ConnectionPoolCapacity,
    connection_pool_capacity,
    report_connection_pool_capacity,
    reset_server_name,
    set_server_name,
)

QUEUE_METRIC = "gym.http.connection_pool.queue_duration_ms"
CONNECT_METRIC = "gym.http.connection_pool.connect_total"
ATTR = "nemo.gym.http."


async def start_server(host: str, delay_s: float) -> tuple[web.AppRunner, str]:
    async def handle(_: web.Request) -> web.Response:
        await asyncio.sleep(delay_s)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://{host}:{port}/"


async def send(
    session: aiohttp.ClientSession,
    url: str,
    server_name: str,
    client_timeout: aiohttp.ClientTimeout | None = None,
) -> bool:
    """One logical request to a named destination; False when it timed out in the queue."""
    token = set_server_name(server_name)
    try:
        async with session.get(url, timeout=client_timeout) as response:
            await response.read()
    except TimeoutError:
        return False
    else:
        return True
    finally:
        reset_server_name(token)


@dataclass
class PoolConfig:
    """The pool's budgets and the demand the bursts put on it, as the report expects them."""

    global_aiohttp_connector_limit: int
    global_aiohttp_connector_limit_per_host: int
    global_aiohttp_intended_concurrency: int | None
    global_aiohttp_intended_concurrency_per_host: int | None


async def run_bursts(limit: int, limit_per_host: int, requests: int, delay_s: float) -> int:
    """Send the bursts; return how many requests were abandoned by their connect timeout."""
    runner_a, policy_url = await start_server("127.0.0.1", delay_s)
    runner_b, sandbox_url = await start_server("127.0.0.2", delay_s)
    try:
        # A plain TCPConnector: after instrument() it is the queue-timed one while metrics
        # are exported. Nothing in the application changes.
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit_per_host)
        async with aiohttp.ClientSession(connector=connector) as session:
            # 1. One destination alone: its per-host limit binds before the total does.
            await asyncio.gather(
                *(send(session, policy_url, "policy-model") for _ in range(requests // 3))
            )
            # 2. Both destinations at once: now the total limit is exhausted first.
            both = [send(session, policy_url, "policy-model") for _ in range(requests // 3)]
            both += [send(session, sandbox_url, "sandbox-server") for _ in range(requests // 3)]
            # 3. A few impatient requests with a 2 ms connect timeout, which covers the wait
            #    for a pool slot: under load they give up in the queue ("abandoned").
            impatient = aiohttp.ClientTimeout(connect=0.002)
            both += [send(session, sandbox_url, "sandbox-server", impatient) for _ in range(20)]
            results = await asyncio.gather(*both)
            return sum(1 for ok in results if not ok)
    finally:
        await runner_a.cleanup()
        await runner_b.cleanup()


def estimate_quantile(point: HistogramDataPoint, q: float) -> float:
    """Quantile estimated from histogram buckets, interpolating linearly inside a bucket."""
    target = q * point.count
    seen = 0
    bounds = list(point.explicit_bounds)
    for index, count in enumerate(point.bucket_counts):
        if count and seen + count >= target:
            low = point.min if index == 0 else max(bounds[index - 1], point.min)
            high = point.max if index >= len(bounds) else min(bounds[index], point.max)
            return low + (high - low) * (target - seen) / count
        seen += count
    return point.max


@dataclass
class DestinationSummary:
    connects: int = 0
    waits: int = 0
    abandoned: int = 0
    by_constraint: dict[str, int] = field(default_factory=dict)
    points: list[HistogramDataPoint] = field(default_factory=list)


def summarize(reader: InMemoryMetricReader) -> dict[str, DestinationSummary]:
    summaries: dict[str, DestinationSummary] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    name = str(attributes.get(ATTR + "destination.server.name", "?"))
                    summary = summaries.setdefault(name, DestinationSummary())
                    if metric.name == CONNECT_METRIC:
                        summary.connects += int(point.value)  # type: ignore[union-attr]
                    elif metric.name == QUEUE_METRIC:
                        assert isinstance(point, HistogramDataPoint)
                        constraint = str(attributes.get(ATTR + "connection_pool.queue_constraint"))
                        outcome = attributes.get(ATTR + "connection_pool.queue_outcome")
                        summary.waits += point.count
                        summary.by_constraint[constraint] = (
                            summary.by_constraint.get(constraint, 0) + point.count
                        )
                        if outcome == "abandoned":
                            summary.abandoned += point.count
                        else:
                            summary.points.append(point)
    return summaries


def print_summary(summaries: dict[str, DestinationSummary]) -> None:
    header = (
        f"{'destination':<16} {'connects':>8} {'queued':>7} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'max ms':>8}  {'binding limit':<22} {'abandoned':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, summary in sorted(summaries.items()):
        ok_points = summary.points
        if ok_points:
            # One data point per attribute set; the largest carries the percentiles well
            # enough for a summary, and max is exact across all of them.
            main = max(ok_points, key=lambda p: p.count)
            p50 = f"{estimate_quantile(main, 0.50):8.2f}"
            p95 = f"{estimate_quantile(main, 0.95):8.2f}"
            worst = f"{max(p.max for p in ok_points):8.2f}"
        else:
            p50 = p95 = worst = f"{'-':>8}"
        binding = ", ".join(f"{k} {v}" for k, v in sorted(summary.by_constraint.items())) or "-"
        print(
            f"{name:<16} {summary.connects:>8} {summary.waits:>7} {p50} {p95} {worst}  "
            f"{binding:<22} {summary.abandoned:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per burst phase x3")
    parser.add_argument("--limit", type=int, default=12, help="the pool's total limit")
    parser.add_argument("--limit-per-host", type=int, default=8, help="the pool's per-host limit")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="server handler time")
    args = parser.parse_args(argv)
    # The capacity report is an INFO line, its mismatches WARNING lines; show both, once.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger(connection_pool.__name__).setLevel(logging.INFO)

    reader: InMemoryMetricReader | None = None
    if isinstance(metrics.get_meter_provider(), MeterProvider):
        print("Using the meter provider configured by opentelemetry-instrument.")
    else:
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        print("No OpenTelemetry SDK configured: using an embedded one with an in-memory reader.")
    # Under opentelemetry-instrument the entry point already did this; a second call is a
    # harmless no-op.
    NemoGymInstrumentor().instrument()

    abandoned = asyncio.run(
        run_bursts(args.limit, args.limit_per_host, args.requests, args.delay_ms / 1000)
    )
    print(
        f"\n{args.requests} requests in three bursts through one pool "
        f"(limit={args.limit}, limit_per_host={args.limit_per_host}), "
        f"server handlers {args.delay_ms:g} ms; {abandoned} impatient requests timed out.\n"
    )
    if reader is not None:
        print_summary(summarize(reader))
    else:
        print("Queue waits and connects were exported through the configured exporter.")

    cfg = PoolConfig(
        args.limit, args.limit_per_host, 2 * (args.requests // 3) + 20, args.requests // 3 + 20
    )
    capacity: ConnectionPoolCapacity = connection_pool_capacity(cfg, workers=1)
    print("\nCapacity report for this pool against the bursts' concurrency:")
    sys.stdout.flush()
    report_connection_pool_capacity(cfg, capacity)
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
