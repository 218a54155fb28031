"""Quickstart: is my latency the backend, or my own aiohttp connection pool?

Starts two real aiohttp servers on loopback (127.0.0.1 and 127.0.0.2) whose handlers take a
few milliseconds, then sends ``--requests`` requests in two phases through one small pool,
labelled with two destination names, and prints what the instrumentation saw per destination:
connects, queued waits, which limit made them wait, wait percentiles, and waits abandoned by a
connect timeout. Next to it, the pool's state at saturation: one collection in phase 2, taken
once every slot is in use and the rest of the burst is queued (the servers hold phase 2's
requests until then), and the TCP connections created against the pool acquisitions. Then the
pool's capacity report against the phases' peak concurrency, and what to do about it: which
limit to raise to what, and the command that checks the new sizing.

Then the other half, sandboxes (``quickstart_sandbox.py`` beside this file): one sandbox of the
embedded provider, no daemon, asks for 0.25 CPU and 32 MiB, runs a CPU loop and an allocation
that is OOM-killed, and its records are printed: requested, allocated, usage samples over time,
the OOM kill, and what to do about it.

Run it as is (an embedded OpenTelemetry SDK with an in-memory reader is used), or under
``opentelemetry-instrument`` with no code change: the pool's metrics then also go wherever that
configured (for example ``--metrics_exporter console``, printed when the process exits); the
sandbox half keeps an embedded SDK of its own, so its printout is complete either way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, MetricsData

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    ConnectionPoolCapacity,
    connection_pool_capacity,
    report_connection_pool_capacity,
    reset_server_name,
    set_server_name,
)

# The sandbox half, beside this file (python puts this script's folder on sys.path).
import quickstart_sandbox  # isort: skip

QUEUE_METRIC = "gym.http.connection_pool.queue_duration_ms"
CONNECT_METRIC = "gym.http.connection_pool.connect_total"
ATTR = "nemo.gym.http."
# The pool-state instruments, read from the live connectors whenever a reader collects.
METER_NAME = "opentelemetry.instrumentation.nemo_gym"
OPEN_METRIC = "http.client.open_connections"
WAITING_METRIC = "gym.http.connection_pool.waiting_requests"
LIMIT_METRIC = "gym.http.connection_pool.limit"
CREATED_METRIC = "gym.http.connection_pool.connections_created"
# A bound on waiting for the pool to settle; on an idle machine it takes milliseconds.
SETTLE_BOUND_S = 30.0

Address = tuple[str, int]  # server.address, server.port


async def start_server(host: str, delay_s: float, gate: asyncio.Event) -> tuple[web.AppRunner, str]:
    async def handle(_: web.Request) -> web.Response:
        await gate.wait()  # closed only while phase 2's pool-state snapshot is being taken
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


@dataclass
class PoolSnapshot:
    """The pool-state instruments in one collection, per ``server.address``/``server.port``."""

    active: dict[Address, int] = field(default_factory=dict)
    idle: dict[Address, int] = field(default_factory=dict)
    waiting: dict[Address, int] = field(default_factory=dict)
    created: dict[Address, int] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)  # total, per_host; 0 is unlimited

    def queues(self, where: Address) -> bool:
        """Whether one more request to ``where`` would have to wait for a slot now."""
        total = self.limits.get("total", 0)
        per_host = self.limits.get("per_host", 0)
        return bool(
            (total and sum(self.active.values()) >= total)
            or (per_host and self.active.get(where, 0) >= per_host)
        )


def address_of(attributes: dict[str, Any]) -> Address:
    port = attributes.get("server.port")
    return str(attributes.get("server.address")), port if isinstance(port, int) else 0


def read_pool_state(data: MetricsData | None) -> PoolSnapshot:
    """The pool-state instruments of this instrumentation in one collection."""
    snapshot = PoolSnapshot()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            if scope_metrics.scope.name != METER_NAME:
                continue  # other instrumentations' metrics, under opentelemetry-instrument
            for metric in scope_metrics.metrics:
                if metric.name not in (OPEN_METRIC, WAITING_METRIC, CREATED_METRIC, LIMIT_METRIC):
                    continue
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    value = int(point.value)  # type: ignore[union-attr]
                    where = address_of(attributes)
                    if metric.name == OPEN_METRIC:
                        state = attributes.get("http.connection.state")
                        counts = snapshot.active if state == "active" else snapshot.idle
                        counts[where] = counts.get(where, 0) + value
                    elif metric.name == WAITING_METRIC:
                        snapshot.waiting[where] = value
                    elif metric.name == CREATED_METRIC:
                        snapshot.created[where] = value
                    else:
                        kind = str(attributes.get(ATTR + "connection_pool.limit.kind"))
                        snapshot.limits[kind] = value
    return snapshot


async def snapshot_when_saturated(
    reader: InMemoryMetricReader, burst: list[asyncio.Task[bool]]
) -> tuple[PoolSnapshot, bool]:
    """Collect until every request of ``burst`` still running holds a connection or waits.

    The servers hold the requests meanwhile, so no slot frees up: once the connections being
    opened are open, the pool stays exactly as it is, and that collection is the snapshot.
    Polls the metrics (a collection each millisecond or so), for at most ``SETTLE_BOUND_S``;
    returns the last collection and whether the pool had settled.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_BOUND_S
    while True:
        snapshot = read_pool_state(reader.get_metrics_data())
        running = sum(1 for task in burst if not task.done())
        held = sum(snapshot.active.values()) + sum(snapshot.waiting.values())
        if held == running or loop.time() > deadline:
            return snapshot, held == running
        await asyncio.sleep(0.001)


@dataclass
class Bursts:
    """What the two phases did: requests that timed out, and the pool at saturation."""

    timed_out: int
    destinations: dict[Address, str]  # each server's address and port, to its label
    at_saturation: PoolSnapshot | None = None
    settled: bool = False


async def run_bursts(
    limit: int,
    limit_per_host: int,
    plan: Plan,
    delay_s: float,
    reader: InMemoryMetricReader | None,
) -> Bursts:
    """Send the two phases; with a ``reader``, take the pool-state snapshot in phase 2."""
    gate = asyncio.Event()
    gate.set()
    runner_a, policy_url = await start_server("127.0.0.1", delay_s, gate)
    runner_b, sandbox_url = await start_server("127.0.0.2", delay_s, gate)
    policy_at = ("127.0.0.1", runner_a.addresses[0][1])
    sandbox_at = ("127.0.0.2", runner_b.addresses[0][1])
    bursts = Bursts(0, {policy_at: "policy-model", sandbox_at: "sandbox-server"})
    tasks: list[asyncio.Task[bool]] = []
    try:
        # A plain TCPConnector: after instrument() it is the queue-timed one while metrics
        # are exported. Nothing in the application changes.
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit_per_host)
        async with aiohttp.ClientSession(connector=connector) as session:
            # 1. One destination alone: its per-host limit binds before the total does.
            await asyncio.gather(
                *(send(session, policy_url, "policy-model") for _ in range(plan.alone))
            )
            # 2. Both destinations at once: now the total limit is exhausted first. The
            #    servers hold these requests until the pool state has been collected.
            if reader is not None:
                gate.clear()
            both = [send(session, policy_url, "policy-model") for _ in range(plan.policy)]
            both += [send(session, sandbox_url, "sandbox-server") for _ in range(plan.sandbox)]
            tasks += [asyncio.ensure_future(request) for request in both]
            if reader is not None:
                bursts.at_saturation, bursts.settled = await snapshot_when_saturated(reader, tasks)
            # A few impatient requests have a 2 ms connect timeout, which covers the wait for
            # a pool slot: under load they give up in the queue ("abandoned").
            impatient = aiohttp.ClientTimeout(connect=0.002)
            late = [
                asyncio.ensure_future(send(session, sandbox_url, "sandbox-server", impatient))
                for _ in range(plan.impatient)
            ]
            tasks += late
            if bursts.at_saturation is not None and bursts.at_saturation.queues(sandbox_at):
                # They queue behind the held requests, where no slot frees up before their
                # timeout: every one of them gives up, on a loaded machine too.
                await asyncio.wait(late, timeout=SETTLE_BOUND_S)
            gate.set()
            results = await asyncio.gather(*tasks)
            bursts.timed_out = sum(1 for ok in results if not ok)
            return bursts
    finally:
        gate.set()
        for task in tasks:
            task.cancel()  # only when something failed: otherwise every one is done
        await asyncio.gather(*tasks, return_exceptions=True)
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


def summarize(data: MetricsData | None) -> dict[str, DestinationSummary]:
    summaries: dict[str, DestinationSummary] = {}
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


def print_pool_state(
    bursts: Bursts, after: PoolSnapshot, summaries: dict[str, DestinationSummary]
) -> None:
    """The snapshot at saturation next to what the whole run created and acquired."""
    during = bursts.at_saturation
    if during is None:
        return
    limits = ", ".join(
        f"{kind} {during.limits[kind] or 'unlimited'}"
        for kind in ("total", "per_host")
        if kind in during.limits
    )
    queued = sum(during.waiting.values())
    if not bursts.settled:
        moment = "in phase 2"
        heading = f"in phase 2, the last collection: it had not settled in {SETTLE_BOUND_S:g} s"
    elif queued:
        moment = "at saturation"
        heading = (
            "at saturation, collected in phase 2 once every request had a connection or\n"
            "was queued for one (the servers held them meanwhile)"
        )
    else:
        moment = "at the peak"
        heading = (
            "at phase 2's peak, collected once every request had a connection (the\n"
            "servers held them meanwhile); nothing was queued"
        )
    print(f"\nPool state {heading}; limits: {limits or 'none seen'}.\n")
    header = (
        f"{'':<15} {'':<17} {moment:^21} {'after the run':^17}".rstrip() + "\n"
        f"{'destination':<15} {'server':<17} {'active':>6} {'idle':>6} {'waiting':>7} "
        f"{'created':>8} {'connects':>8}"
    )
    print(header)
    print("-" * len(header.splitlines()[-1]))
    addresses = sorted(during.active.keys() | during.idle.keys() | during.waiting.keys())
    for where in addresses + sorted(after.created.keys() - set(addresses)):
        name = bursts.destinations.get(where, "?")
        connects = summaries[name].connects if name in summaries else 0
        print(
            f"{name:<15} {f'{where[0]}:{where[1]}':<17} {during.active.get(where, 0):>6} "
            f"{during.idle.get(where, 0):>6} {during.waiting.get(where, 0):>7} "
            f"{after.created.get(where, 0):>8} {connects:>8}"
        )
    print(
        "\nactive: connections handed to a request; idle: open and kept alive for the next one "
        "(both\nhttp.client.open_connections); waiting: requests queued for a slot "
        "(waiting_requests);\ncreated: TCP connections opened (connections_created), against "
        "connects, the pool\nacquisitions (connect_total, one per request): kept-alive "
        "connections serve many requests."
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
    parser.add_argument(
        "--no-sandbox", action="store_true", help="the pool half only, without the sandbox half"
    )
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
        # The pool half needs the pool capability only; the sandbox half traces its provider
        # itself (traced_provider, with an SDK of its own).
        instrumentor.instrument(sandbox_resources=False)

    print("\n== 1. The connection pool: is my latency the server, or my own pool? ==")
    bursts = asyncio.run(
        run_bursts(args.limit, args.limit_per_host, plan, args.delay_ms / 1000, reader)
    )
    print(
        f"\nSent {plan.total} requests through one pool (limit={args.limit}, "
        f"limit_per_host={args.limit_per_host}) to two servers whose handlers take "
        f"{args.delay_ms:g} ms:\n"
        f"  phase 1: {plan.alone} to policy-model alone;\n"
        f"  phase 2: {plan.policy} to policy-model and {plan.sandbox} to sandbox-server at "
        f"once, plus {plan.impatient} impatient ones\n"
        f"           to sandbox-server with a 2 ms connect timeout "
        f"({bursts.timed_out} timed out).\n"
    )
    if reader is not None:
        data = reader.get_metrics_data()
        summaries = summarize(data)
        print_summary(summaries, plan.sent())
        print_pool_state(bursts, read_pool_state(data), summaries)
    else:
        print("Queue waits, connects and pool state were exported through the configured exporter.")

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
    if not args.no_sandbox:
        print("\n== 2. A sandbox: what it asked for, what it got, what it used ==\n")
        print(
            "(Its provider is wrapped with traced_provider(), which records whatever the\n"
            "instrumentor's sandbox_resources switch says: off above, on in this half.)\n"
        )
        print("\n".join(quickstart_sandbox.report(asyncio.run(quickstart_sandbox.run_demo()))))
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
