"""Quickstart: is my latency the backend, or my own aiohttp connection pool?

Starts two real aiohttp servers on loopback (127.0.0.1 and 127.0.0.2) whose handlers take a
few milliseconds, then sends ``--requests`` requests in two phases through one small pool,
labelled with two destination names, and prints what the instrumentation saw per destination:
connects, queued waits, which limit made them wait, wait percentiles, and waits abandoned by a
connect timeout. Then the pool's capacity report against the phases' peak concurrency, and
what to do about it: which limit to raise to what, and the command that checks the new sizing.

Run it as is (an embedded OpenTelemetry SDK with an in-memory reader is used), or under
``opentelemetry-instrument`` with no code change: the metrics then also go wherever that
configured (for example ``--metrics_exporter console``, printed when the process exits).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import textwrap
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


@dataclass(frozen=True)
class Plan:
    """How many requests each phase sends; ``total`` is exactly what ``--requests`` asked."""

    alone: int  # phase 1: policy-model alone
    policy: int  # phase 2: policy-model ...
    sandbox: int  # ... and sandbox-server at once ...
    impatient: int  # ... plus impatient sandbox-server requests with a 2 ms connect timeout

    @classmethod
    def for_total(cls, total: int) -> Plan:
        impatient = max(1, total // 15)
        rest = total - impatient
        return cls(
            alone=rest // 3, policy=rest // 3, sandbox=rest - 2 * (rest // 3), impatient=impatient
        )

    @property
    def total(self) -> int:
        return self.alone + self.policy + self.sandbox + self.impatient

    @property
    def peak(self) -> int:
        """Most requests in flight at once: all of phase 2."""
        return self.policy + self.sandbox + self.impatient

    @property
    def peak_per_host(self) -> int:
        """Most requests to one destination at once."""
        return max(self.alone, self.policy, self.sandbox + self.impatient)

    def sent(self) -> dict[str, int]:
        return {
            "policy-model": self.alone + self.policy,
            "sandbox-server": self.sandbox + self.impatient,
        }


@dataclass
class PoolConfig:
    """The pool's budgets and the demand the bursts put on it, as the report expects them."""

    global_aiohttp_connector_limit: int
    global_aiohttp_connector_limit_per_host: int
    global_aiohttp_intended_concurrency: int | None
    global_aiohttp_intended_concurrency_per_host: int | None


async def run_bursts(limit: int, limit_per_host: int, plan: Plan, delay_s: float) -> int:
    """Send the two phases; return how many requests timed out (the impatient ones)."""
    runner_a, policy_url = await start_server("127.0.0.1", delay_s)
    runner_b, sandbox_url = await start_server("127.0.0.2", delay_s)
    try:
        # A plain TCPConnector: after instrument() it is the queue-timed one while metrics
        # are exported. Nothing in the application changes.
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit_per_host)
        async with aiohttp.ClientSession(connector=connector) as session:
            # 1. One destination alone: its per-host limit binds before the total does.
            await asyncio.gather(
                *(send(session, policy_url, "policy-model") for _ in range(plan.alone))
            )
            # 2. Both destinations at once: now the total limit is exhausted first. A few
            #    impatient requests have a 2 ms connect timeout, which covers the wait for a
            #    pool slot: under load they give up in the queue ("abandoned").
            both = [send(session, policy_url, "policy-model") for _ in range(plan.policy)]
            both += [send(session, sandbox_url, "sandbox-server") for _ in range(plan.sandbox)]
            impatient = aiohttp.ClientTimeout(connect=0.002)
            both += [
                send(session, sandbox_url, "sandbox-server", impatient)
                for _ in range(plan.impatient)
            ]
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
                if metric.name not in (CONNECT_METRIC, QUEUE_METRIC):
                    continue  # other instrumentations' metrics, under opentelemetry-instrument
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


def print_summary(summaries: dict[str, DestinationSummary], sent: dict[str, int]) -> None:
    header = (
        f"{'destination':<15} {'sent':>5} {'connects':>8} {'queued':>6} {'on total':>8} "
        f"{'on per_host':>11} {'p50 ms':>7} {'p95 ms':>7} {'max ms':>7} {'abandoned':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, summary in sorted(summaries.items()):
        ok_points = summary.points
        if ok_points:
            # One data point per attribute set; the largest carries the percentiles well
            # enough for a summary, and max is exact across all of them.
            main = max(ok_points, key=lambda p: p.count)
            p50 = f"{estimate_quantile(main, 0.50):7.2f}"
            p95 = f"{estimate_quantile(main, 0.95):7.2f}"
            worst = f"{max(p.max for p in ok_points):7.2f}"
        else:
            p50 = p95 = worst = f"{'-':>7}"
        on_total = summary.by_constraint.get("total", 0)
        on_per_host = summary.by_constraint.get("per_host", 0)
        print(
            f"{name:<15} {sent.get(name, 0):>5} {summary.connects:>8} {summary.waits:>6} "
            f"{on_total:>8} {on_per_host:>11} {p50} {p95} {worst} {summary.abandoned:>9}"
        )
    print(
        "\nsent: requests this example sent; connects: pool acquisitions the instrumentation "
        "counted\n(one per request); queued: requests that waited for a free pool slot, split "
        "by the limit\nthat was exhausted when the wait began (on total, on per_host); p50/p95/"
        "max: how long the\nqueued requests that got a slot waited; abandoned: waits ended by "
        "the connect timeout."
    )


def print_what_to_do(args: argparse.Namespace, plan: Plan, warnings: int) -> None:
    """End with the change to make, the command that checks it, and where to watch it."""
    print("\nWhat to do:")
    steps: list[str] = []
    if args.limit and args.limit < plan.peak:
        steps.append(
            f"Raise the pool's total limit from {args.limit} to {plan.peak} (phase 2 has "
            f"{plan.peak} requests in flight at once), or to 0 for unlimited, as far as the "
            "servers can take that concurrency."
        )
    if args.limit_per_host and args.limit_per_host < plan.peak_per_host:
        steps.append(
            f"Raise limit_per_host from {args.limit_per_host} to {plan.peak_per_host} (the most "
            "requests to one destination at once)."
        )
    if not warnings or not steps:
        steps = ["Nothing to raise: this pool holds the peak concurrency."]
    for number, step in enumerate(steps, 1):
        print(
            textwrap.fill(step, width=92, initial_indent=f"  {number}. ", subsequent_indent="     ")
        )
    limit = max(args.limit, plan.peak) if args.limit else 0
    per_host = max(args.limit_per_host, plan.peak_per_host) if args.limit_per_host else 0
    print(
        "  Check a sizing before deploying it (exit status 0 safe, 1 unsafe; add --workers N "
        "when\n  N processes share the limits):\n"
        f"    .venv/bin/nemo-gym-otel capacity --limit {limit} --limit-per-host {per_host} "
        f"--intended {plan.peak} --intended-per-host {plan.peak_per_host}"
    )
    if (limit, per_host) != (args.limit, args.limit_per_host):
        print(
            "  See the queue empty here:\n"
            f"    bash scripts/quickstart.sh --limit {limit} --limit-per-host {per_host}"
        )
    print(
        "  In a real backend: examples/prometheus/ runs Prometheus against an instrumented app;"
        "\n  graph the p95 of gym_http_connection_pool_queue_duration_ms_milliseconds_bucket per "
        "destination\n  and queue_constraint (queries in examples/prometheus/README.md)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=300, help="requests to send in all (at least 4)"
    )
    parser.add_argument("--limit", type=int, default=12, help="the pool's total limit")
    parser.add_argument("--limit-per-host", type=int, default=8, help="the pool's per-host limit")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="server handler time")
    args = parser.parse_args(argv)
    if args.requests < 4:
        parser.error(f"--requests={args.requests}: send at least 4 (one per phase and kind)")
    plan = Plan.for_total(args.requests)
    # The instrumentation's summary line is INFO; the capacity report's line is INFO and its
    # mismatches WARNING. The report is shown at the end, once, against the phases' demand.
    # To stdout, like the rest, so the lines stay in order when piped.
    logging.basicConfig(
        stream=sys.stdout, level=logging.WARNING, format="%(levelname)s %(message)s"
    )
    logging.getLogger("opentelemetry.instrumentation.nemo_gym").setLevel(logging.INFO)
    pool_logger = logging.getLogger(connection_pool.__name__)
    pool_logger.setLevel(logging.WARNING)

    reader = InMemoryMetricReader()
    provider = metrics.get_meter_provider()
    if isinstance(provider, MeterProvider):
        print("Using the meter provider configured by opentelemetry-instrument.")
        # Newer SDKs take a reader after construction: then the table is printed here too.
        add_reader = getattr(provider, "add_metric_reader", None)
        if add_reader is not None:
            add_reader(reader)
        else:
            reader = None
    else:
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        print("No OpenTelemetry SDK configured: using an embedded one with an in-memory reader.")
    instrumentor = NemoGymInstrumentor()
    # Under opentelemetry-instrument the entry point has already instrumented this process.
    if not instrumentor.is_instrumented_by_opentelemetry:
        # This example is about the pool: no sandboxes, so no sandbox telemetry.
        instrumentor.instrument(sandbox_resources=False)

    timed_out = asyncio.run(run_bursts(args.limit, args.limit_per_host, plan, args.delay_ms / 1000))
    print(
        f"\nSent {plan.total} requests through one pool (limit={args.limit}, "
        f"limit_per_host={args.limit_per_host}) to two servers whose handlers take "
        f"{args.delay_ms:g} ms:\n"
        f"  phase 1: {plan.alone} to policy-model alone;\n"
        f"  phase 2: {plan.policy} to policy-model and {plan.sandbox} to sandbox-server at "
        f"once, plus {plan.impatient} impatient ones\n"
        f"           to sandbox-server with a 2 ms connect timeout ({timed_out} timed out).\n"
    )
    if reader is not None:
        print_summary(summarize(reader), plan.sent())
    else:
        print("Queue waits and connects were exported through the configured exporter.")

    cfg = PoolConfig(args.limit, args.limit_per_host, plan.peak, plan.peak_per_host)
    capacity: ConnectionPoolCapacity = connection_pool_capacity(cfg, workers=1)
    print(
        "\nCapacity report: the instrumentation logs this line once per pool configuration. "
        "Here it is\nchecked against the phases' peak concurrency (intended_per_worker, "
        "intended_per_host_per_worker;\n`unset` there means none was configured, so that check "
        "is skipped):"
    )
    pool_logger.setLevel(logging.INFO)
    counter = _WarningCounter()
    pool_logger.addHandler(counter)
    try:
        report_connection_pool_capacity(cfg, capacity)
    finally:
        pool_logger.removeHandler(counter)
    print_what_to_do(args, plan, counter.warnings)
    return 0


class _WarningCounter(logging.Handler):
    """Counts the report's mismatch warnings, so the advice matches what was printed."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.warnings = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.warnings += 1


if __name__ == "__main__":
    raise SystemExit(main())
